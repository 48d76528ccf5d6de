"""A consumer told again and again that a topic or its group cannot be read (an ACL refused, a topic not
there) says so for readiness checks, on a fake clock; the errors are logged now and then, not each."""

from __future__ import annotations

import logging
import types

import pytest
from confluent_kafka import KafkaError

import bus.consumer
from bus.consumer import UNREADABLE_QUIET_S, ConsumerThread


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


class Refused:
    def __init__(self, code: int | None, topic: str = "p.replies") -> None:
        self._err = None if code is None else KafkaError(code, "Broker: Topic authorization failed")
        self._topic = topic

    def error(self) -> KafkaError | None:
        return self._err

    def topic(self) -> str:
        return self._topic


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    made = Clock()
    monkeypatch.setattr(bus.consumer, "time", types.SimpleNamespace(monotonic=made.monotonic))
    return made


def test_errors_that_say_a_topic_cannot_be_read_count_while_they_go_on(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = ConsumerThread({"group.id": "g"}, lambda batch: None, subscribe=["p.replies"], name="replies")
    caplog.set_level(logging.WARNING, logger="bus.consumer")
    refused = Refused(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    assert consumer.unreadable_for() == (0.0, "")
    assert consumer._skipped(refused)  # type: ignore[arg-type]
    assert consumer.unreadable_for()[0] == 0.0  # one alone: a topic being created, say
    for _ in range(24):  # a refused fetch every half second for 12 s
        clock.now += 0.5
        assert consumer._skipped(refused)  # type: ignore[arg-type]
    span, why = consumer.unreadable_for()
    assert span == pytest.approx(12.0)
    assert "authorization" in why.lower()
    assert len([r for r in caplog.records if "cannot read p.replies" in r.getMessage()]) == 2  # 0 s, 10 s
    clock.now += UNREADABLE_QUIET_S  # the ACL granted again: no more errors
    assert consumer.unreadable_for() == (0.0, "")
    assert consumer._skipped(refused)  # type: ignore[arg-type]
    assert consumer.unreadable_for()[0] == 0.0  # a new run of errors counts from its own first
    clock.now += 12.0
    assert consumer._skipped(refused)  # type: ignore[arg-type]
    assert consumer.unreadable_for()[0] == pytest.approx(12.0)
    assert not consumer._skipped(Refused(None, "p.other"))  # type: ignore[arg-type]
    assert consumer.unreadable_for()[0] == pytest.approx(12.0)  # another topic's record says nothing
    assert not consumer._skipped(Refused(None))  # type: ignore[arg-type]
    assert consumer.unreadable_for() == (0.0, "")  # one of its own: it is read again


def test_other_errors_are_skipped_without_counting(clock: Clock) -> None:
    consumer = ConsumerThread({"group.id": "g"}, lambda batch: None, subscribe=["p.replies"], name="replies")
    for _ in range(30):
        clock.now += 1.0
        assert consumer._skipped(Refused(KafkaError._TRANSPORT))  # type: ignore[arg-type]
    assert consumer.unreadable_for() == (0.0, "")
