"""A dead letter's send (no broker needed): what a refusal at once means for it."""

from __future__ import annotations

import queue
from typing import Any, cast

import pytest
from confluent_kafka import KafkaError, KafkaException

from bus.dead_letter import Letter, dead_letter_event
from bus.errors import BusError
from bus.producer import EventProducer
from schemas.codec import DecodeError


class _Refusing:
    def __init__(self, code: int) -> None:
        self.code = code
        self.sent = 0

    def produce(self, topic: str, event: Any, **_: Any) -> None:
        self.sent += 1
        raise BusError(f"cannot produce to {topic}") from KafkaException(KafkaError(self.code))


LETTER = dead_letter_event("test", ("t.requests.m", 0, 7), b"{junk", DecodeError("bad"))


@pytest.mark.parametrize(
    "code",
    [KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError.TOPIC_AUTHORIZATION_FAILED],
)
def test_a_letter_its_topic_refuses_at_once_is_not_delivered_and_can_go_again(code: int) -> None:
    producer = _Refusing(code)
    letter = Letter(cast(EventProducer, producer), "t.deadletter", LETTER)
    outcome: queue.SimpleQueue[BusError | None] = queue.SimpleQueue()
    letter.delivery.then(outcome.put)
    assert isinstance(outcome.get_nowait(), BusError)
    letter.again()
    assert producer.sent == 2


def test_the_producers_own_failure_is_its_owners() -> None:
    """A fatal error, or a closed producer (no Kafka code), is not the letter's to retry: it is raised."""
    with pytest.raises(BusError):
        Letter(cast(EventProducer, _Refusing(KafkaError._FATAL)), "t.deadletter", LETTER)

    class Closed:
        def produce(self, topic: str, event: Any, **_: Any) -> None:
            raise BusError(f"cannot produce to {topic}") from RuntimeError("Producer has been closed")

    with pytest.raises(BusError):
        Letter(cast(EventProducer, Closed()), "t.deadletter", LETTER)
