"""A dead letter's send (no broker needed): what a refusal at once means for it."""

from __future__ import annotations

import gc
import queue
import weakref
from typing import Any, cast

import pytest
from confluent_kafka import KafkaError, KafkaException, Message

from bus.dead_letter import Junk, Letter, dead_letter_event, decode_or_junk
from bus.errors import BusError
from bus.producer import EventProducer
from schemas.codec import DecodeError
from schemas.events import Event


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


def test_junk_keeps_nothing_of_its_reader_alive() -> None:
    """A record that does not decode waits in a worker's inbox (and, while the dead-letter topic refuses,
    for a letter that lands) as :class:`Junk`. It kept its decode error, whose traceback kept the reader's
    frame alive, and with it the whole batch of records that reader was going through (up to 500 of up to
    1 MB each; found by review)."""

    class Batch:
        pass

    def read() -> tuple[Junk | Event, weakref.ref[Batch]]:
        batch = Batch()  # the consumer thread's batch, a local of the reader's frame
        return decode_or_junk(
            Message(topic="t.requests.m", partition=0, offset=7, value=b"{junk")
        ), weakref.ref(batch)

    junk, batch = read()
    gc.collect()
    assert isinstance(junk, Junk)
    assert batch() is None, "the reader's batch outlived it"
    assert junk.why.label == "bad_json"
    letter = dead_letter_event("test", junk.where, junk.value, junk.why)
    assert (letter.offset, letter.reason) == (7, junk.why.message)
