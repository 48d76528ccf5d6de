"""A consumer told again and again that a topic or its group cannot be read (an ACL refused, a topic not
there) says so for readiness checks, on a fake clock; the errors are logged now and then, not each."""

from __future__ import annotations

import logging
import re
import types

import pytest
from confluent_kafka import KafkaError, KafkaException

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


# Commits refused. Found by a review: with a worker's requests topic deleted under it, librdkafka told its
# assigned consumer nothing, the worker stayed ready, and the commit it offered again every ~0.4 s was
# refused with UNKNOWN_TOPIC_OR_PART and logged each time (76 warnings in 30 s). The refusals are the one
# sign: they count as the topic being unreadable, and are logged now and then.


def refused_commit(code: int) -> KafkaException:
    return KafkaException(KafkaError(code, "Broker: Unknown topic or partition"))


def test_commits_refused_for_a_topic_gone_count_as_unreadable_and_are_logged_now_and_then(
    clock: Clock, caplog: pytest.LogCaptureFixture
) -> None:
    consumer = ConsumerThread(
        {"group.id": "g"}, lambda batch: None, subscribe=["p.requests"], name="requests"
    )
    caplog.set_level(logging.WARNING, logger="bus.consumer")
    offered: list[dict[tuple[str, int], int]] = []
    tp = ("p.requests.demo-gpt", 0)
    for _ in range(31):  # refused every 0.4 s for 12 s
        consumer._commit_failed(
            {tp: 7}, [({tp: 7}, offered.append)], {tp}, refused_commit(KafkaError.UNKNOWN_TOPIC_OR_PART)
        )
        clock.now += 0.4
    assert offered == [{tp: 7}] * 31  # each caller told, to offer them again
    span, why = consumer.unreadable_for()
    assert span == pytest.approx(12.0)
    assert "Unknown topic" in why
    warnings = [r.getMessage() for r in caplog.records if "commit of" in r.getMessage()]
    assert len(warnings) == 2  # 0 s, 10 s
    assert re.search(r"\((24|25) more since the last such warning\)", warnings[1])  # 10 s of 0.4 s steps
    clock.now += UNREADABLE_QUIET_S  # the topic made again: the commits go through
    assert consumer.unreadable_for() == (0.0, "")


def test_other_refused_commits_do_not_count_as_unreadable(clock: Clock) -> None:
    consumer = ConsumerThread(
        {"group.id": "g"}, lambda batch: None, subscribe=["p.requests"], name="requests"
    )
    tp = ("p.requests.demo-gpt", 0)
    for _ in range(30):
        consumer._commit_failed({tp: 7}, [], {tp}, refused_commit(KafkaError.REBALANCE_IN_PROGRESS))
        consumer._commit_failed({tp: 7}, [], {tp}, "its consumer was replaced")
        clock.now += 1.0
    assert consumer.unreadable_for() == (0.0, "")
