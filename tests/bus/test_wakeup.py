"""A consumer served on an event loop (``ConsumerThread(serve_on=loop)``): librdkafka wakes the loop through
a pipe and the loop reads the queue, with no polling thread; where the wake-up is not set up, a thread polls
and hands the batches to the loop. Against the real broker."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from bus.consumer import ConsumerThread, consumer_config
from bus.errors import BusError
from bus.wakeup import queue_wakeup
from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.settings import KafkaConnection

pytestmark = pytest.mark.integration

ON_LINUX = pytest.mark.skipif(sys.platform != "linux", reason="librdkafka's wake-up is set up on Linux only")


def _topic(kafka: KafkaConnection, name: str) -> None:
    apply_topics(make_admin(kafka), [TopicSpec(name=name, partitions=1, config={}, purpose="")])


def _produce(kafka: KafkaConnection, topic: str, values: range) -> None:
    producer = Producer(kafka.client_config())
    for n in values:
        producer.produce(topic, str(n).encode(), partition=0)
    assert producer.flush(10) == 0


class OnLoop:
    """A handler that records what it got and on which thread."""

    def __init__(self) -> None:
        self.values: list[int] = []
        self.threads: set[int] = set()

    def __call__(self, batch: list[Message]) -> None:
        self.threads.add(threading.get_ident())
        self.values += [int(m.value() or b"-1") for m in batch]

    async def until(self, n: int) -> None:
        deadline = time.monotonic() + 20
        while len(self.values) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"got {len(self.values)} of {n} records")
            await asyncio.sleep(0.01)


def _reader(
    kafka: KafkaConnection, topic: str, handler: Callable[[list[Message]], None], **kwargs: object
) -> ConsumerThread:
    return ConsumerThread(
        consumer_config(kafka, None, f"test-wakeup-{time.time_ns()}"),
        handler,
        assign=[TopicPartition(topic, 0, 0)],
        name="wakeup-test",
        serve_on=asyncio.get_running_loop(),
        **kwargs,  # type: ignore[arg-type]
    )


@ON_LINUX
async def test_records_reach_the_loop_thread_woken_by_librdkafka_with_no_polling_thread(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.wake"
    _topic(kafka, topic)
    _produce(kafka, topic, range(1200))  # before the start: more than one batch of 500, one wake-up
    got = OnLoop()
    reader = _reader(kafka, topic, got)
    reader.start()
    try:
        assert reader._thread is None  # nothing polls: the loop is woken
        await got.until(1200)
        for round_ in range(3):  # after idle gaps, each record wakes the loop again
            await asyncio.sleep(0.3)
            await asyncio.to_thread(_produce, kafka, topic, range(1200 + round_, 1201 + round_))
            await got.until(1201 + round_)
        assert got.values == list(range(1203))  # in order, each once
        assert got.threads == {threading.get_ident()}  # every batch handled on the loop's thread
        assert reader.assignment() == {(topic, 0)}
    finally:
        await asyncio.to_thread(reader.stop)  # from another thread, as owners stop it
    assert reader.assignment() == set()
    assert reader._wakeup is None  # the pipe closed
    assert reader._consumer is None  # and the client


@ON_LINUX
async def test_a_handler_that_raises_fails_the_consumer_and_its_owner_hears(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.wake-fail"
    _topic(kafka, topic)
    calls: list[int] = []
    told: list[BaseException] = []
    failed = asyncio.Event()

    def tell(exc: BaseException) -> None:  # on the loop's thread, where the handler raised
        told.append(exc)
        failed.set()

    def broken(batch: list[Message]) -> None:
        calls.append(len(batch))
        raise ValueError("handler bug")

    reader = _reader(kafka, topic, broken, on_failure=tell)
    reader.start()
    await asyncio.to_thread(_produce, kafka, topic, range(3))
    await asyncio.wait_for(failed.wait(), 20)
    assert isinstance(reader.failure, ValueError)
    assert told == [reader.failure]
    await asyncio.to_thread(_produce, kafka, topic, range(3, 6))
    await asyncio.sleep(0.5)
    assert len(calls) == 1  # the loop no longer reads it
    with pytest.raises(BusError, match="handler bug"):
        reader.stop()  # on the loop's own thread: it must not wait for the loop to let go
    assert reader._consumer is None


async def test_without_the_wake_up_a_thread_polls_and_the_loop_handles(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.wake-thread"
    _topic(kafka, topic)
    _produce(kafka, topic, range(10))
    got = OnLoop()
    reader = _reader(kafka, topic, got, wake_loop=False)
    reader.start()
    try:
        assert reader._thread is not None
        assert reader._wakeup is None
        await got.until(10)
        assert got.values == list(range(10))
        assert got.threads == {threading.get_ident()}  # handed to the loop, as with the wake-up
        with pytest.raises(RuntimeError, match="served on an event loop"):
            reader.pause()  # a group member's stop-reading, which a loop's consumer has no thread for
    finally:
        await asyncio.to_thread(reader.stop)


@ON_LINUX
async def test_a_stop_on_the_loop_right_after_the_start_does_not_wait_for_the_loop(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.wake-quick"
    _topic(kafka, topic)
    reader = _reader(kafka, topic, OnLoop())
    reader.start()  # the loop has not yet run the attach this schedules
    began = time.monotonic()
    reader.stop()  # on the loop's thread: it cannot wait for the loop to let go
    # a stop waiting for the loop would give up after 5 s: the bound is under that, with room for a stall
    assert time.monotonic() - began < 4.0
    assert reader._consumer is None
    await asyncio.sleep(0.05)  # the queued attach then finds the consumer stopped and watches nothing


@ON_LINUX
def test_the_wake_up_is_refused_for_a_handle_that_is_not_the_named_consumer(kafka: KafkaConnection) -> None:
    consumer = Consumer(consumer_config(kafka, None, "wakeup-named"))
    try:
        assert queue_wakeup(consumer, "someone-else") is None  # the handle's name is checked first
        wakeup = queue_wakeup(consumer, "wakeup-named")
        assert wakeup is not None
        wakeup.close()
        wakeup.close()  # once only
    finally:
        consumer.close()
