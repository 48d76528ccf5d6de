"""A one-shot command's probe of a Kafka that does not answer is its one error, not librdkafka's connection
failures printed every 50 ms until the probe gives up (an audit counted ~190 lines before `sluice models
list`'s own, with SLUICE_KAFKA_BOOTSTRAP=127.0.0.1:1)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import Consumer

import bus.control
import bus.positions
from bus.control import control_start
from bus.errors import BusError
from bus.positions import topic_extent
from schemas.settings import KafkaConnection

NOWHERE = KafkaConnection("127.0.0.1:1")


class QuickConsumer(Consumer):
    """The probes' consumer, giving up on the metadata in 2 s instead of 10."""

    def list_topics(self, *args: Any, **kwargs: Any) -> Any:
        return super().list_topics(*args, **{**kwargs, "timeout": 2.0})


@pytest.mark.parametrize("probe", [control_start, topic_extent], ids=["control_start", "topic_extent"])
def test_a_probe_of_a_kafka_that_does_not_answer_prints_nothing(
    probe: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(bus.control, "Consumer", QuickConsumer)
    monkeypatch.setattr(bus.positions, "Consumer", QuickConsumer)
    with pytest.raises(BusError, match="Broker transport failure"):
        probe(NOWHERE, "sluice.control", "sluice-cli")
    # its own client's lines only: another test's client left in this process (a producer that reaches
    # nothing) may log its own connection failures meanwhile
    assert [line for line in capfd.readouterr().err.splitlines() if "|FAIL|sluice-cli#" in line] == []
