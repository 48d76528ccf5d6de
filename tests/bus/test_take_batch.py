"""How the consumer thread cuts batches (``take_batch``), against a fake librdkafka consumer on a fake clock
(a preempted test thread must not eat a linger)."""

from __future__ import annotations

import types
from typing import cast

import pytest
from confluent_kafka import Message

import bus.consumer
from bus.consumer import take_batch


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    made = Clock()
    monkeypatch.setattr(bus.consumer, "time", types.SimpleNamespace(monotonic=made.monotonic))
    return made


class Source:
    """Hands out ``ready`` records at once and ``later`` ones only to a ``consume`` that waits."""

    def __init__(self, clock: Clock, ready: int, later: int = 0) -> None:
        self.clock = clock
        self.ready = list(range(ready))
        self.later = list(range(ready, ready + later))
        self.timeouts: list[float] = []

    def poll(self, timeout: float) -> Message | None:
        return cast(Message, self.ready.pop(0)) if self.ready else None

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        self.timeouts.append(timeout)
        if timeout > 0:  # what arrives while it waits
            self.ready, self.later = self.ready + self.later, []
        taken, self.ready = self.ready[:num_messages], self.ready[num_messages:]
        if len(taken) < num_messages:
            self.clock.now += timeout  # as librdkafka: a batch that is not full returns at the timeout
        return cast(list[Message], taken)


def taken(source: Source, size: int, linger_s: float) -> list[object]:
    """What ``take_batch`` took (the fake's records are ints)."""
    return list(take_batch(source, size, linger_s))


def test_nothing_comes_nothing_is_taken(clock: Clock) -> None:
    source = Source(clock, 0)
    assert taken(source, 10, 0.2) == []
    assert source.timeouts == []


def test_without_linger_a_batch_is_what_was_already_fetched(clock: Clock) -> None:
    source = Source(clock, 3, later=5)
    assert taken(source, 10, 0.0) == [0, 1, 2]
    assert source.timeouts == [0.0]


def test_a_batch_stops_at_its_size(clock: Clock) -> None:
    source = Source(clock, 25)
    assert taken(source, 10, 0.2) == list(range(10))
    assert taken(source, 10, 0.0) == list(range(10, 20))
    assert taken(source, 1, 0.2) == [20]
    assert source.timeouts[0] > 0.0


def test_with_linger_it_waits_for_records_that_follow_the_first(clock: Clock) -> None:
    source = Source(clock, 2, later=4)
    assert taken(source, 10, 0.05) == [0, 1, 2, 3, 4, 5]
    assert source.timeouts[0] == pytest.approx(0.05)  # the whole linger: no time passed before it


def test_linger_is_counted_from_the_first_record(clock: Clock) -> None:
    source = Source(clock, 1)
    began = clock.now
    assert taken(source, 10, 0.05) == [0]
    assert clock.now - began == pytest.approx(0.05)
    assert source.timeouts[-1] == 0.0  # it ends once the deadline has passed
