from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any

import pytest
from confluent_kafka import Message, Producer

from bus.consumer import ConsumerThread, consumer_config
from bus.dead_letter import Junk, Letter, decode_or_junk
from bus.errors import BusError
from bus.producer import EventProducer
from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.codec import MAX_RECORD_BYTES, decode, encode
from schemas.events import DeadLetter, Event
from schemas.examples import example_events
from schemas.settings import KafkaConnection

pytestmark = pytest.mark.integration


def _topics(kafka: KafkaConnection, *names: str) -> None:
    apply_topics(make_admin(kafka), [TopicSpec(name=n, partitions=2, config={}, purpose="") for n in names])


class Collector:
    def __init__(self) -> None:
        self.messages: list[Message] = []
        self.lock = threading.Lock()

    def __call__(self, batch: list[Message]) -> None:
        with self.lock:
            self.messages += batch

    def wait_for(self, n: int, timeout: float = 30) -> list[Message]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if len(self.messages) >= n:
                    return list(self.messages)
            time.sleep(0.02)
        raise AssertionError(f"got {len(self.messages)} of {n} messages")


async def test_publish_returns_once_durable_and_a_group_resumes_after_commits(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.in"
    _topics(kafka, topic)
    events = example_events()
    producer = EventProducer(kafka, "test")
    producer.start()
    try:
        positions = [await producer.publish(topic, e, partition=0) for e in events]
    finally:
        producer.stop()
    assert [off for _, off in positions] == list(range(len(events)))

    config = consumer_config(kafka, f"{topic}-g", "test")
    first = Collector()
    reader = ConsumerThread(config, first, subscribe=[topic])
    with reader:
        got = first.wait_for(len(events))
        assert [decode(m.value() or b"") for m in got] == events
        reader.commit({(topic, 0): 5})  # pretend only the first five were handled durably
    second = Collector()
    with ConsumerThread(config, second, subscribe=[topic]):
        rest = second.wait_for(len(events) - 5)
    assert [decode(m.value() or b"") for m in rest] == events[5:]


def test_undecodable_records_go_to_the_dead_letter_topic(kafka: KafkaConnection, topic_prefix: str) -> None:
    topic, dlq = f"{topic_prefix}.in", f"{topic_prefix}.dlq"
    _topics(kafka, topic, dlq)
    raw = Producer(kafka.client_config())
    raw.produce(topic, b"\x00junk", partition=0, headers=[("x", b"y")])
    assert raw.flush(10) == 0
    seen = Collector()
    with ConsumerThread(consumer_config(kafka, f"{topic}-g", "t"), seen, subscribe=[topic]):
        (message,) = seen.wait_for(1)
    producer = EventProducer(kafka, "t")
    outcomes: queue.SimpleQueue[BusError | None] = queue.SimpleQueue()
    with producer:
        junk = decode_or_junk(message)
        assert isinstance(junk, Junk)
        sent = junk.letter(producer, dlq, "test/worker")
        assert isinstance(sent, Letter)
        sent.delivery.then(outcomes.put)
        assert outcomes.get(timeout=10) is None, "the letter is durable: the record may be committed"
    sent.delivery.then(outcomes.put)  # asked after it landed: answered at once
    assert outcomes.get_nowait() is None
    dead = Collector()
    with ConsumerThread(consumer_config(kafka, f"{dlq}-g", "t"), dead, subscribe=[dlq]):
        (letter,) = dead.wait_for(1)
    event: Event = decode(letter.value() or b"")
    assert isinstance(event, DeadLetter)
    assert event.source_topic == topic
    assert event.offset == 0
    assert event.headers == {"x": "y"}
    assert "invalid" in event.reason.lower() or "decode" in event.reason.lower()


def test_a_commit_the_broker_refuses_is_reported_to_its_owner(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """The broker refuses a commit (here: for a partition that does not exist); the refusal reaches
    ``on_failure`` with the offsets, so the worker offers them again instead of believing they are stored."""
    topic = f"{topic_prefix}.commits"
    _topics(kafka, topic)
    from confluent_kafka import TopicPartition

    refused: list[dict[tuple[str, int], int]] = []
    done = threading.Event()

    def report(offsets: dict[tuple[str, int], int]) -> None:
        refused.append(offsets)
        done.set()

    with ConsumerThread(
        consumer_config(kafka, None, "no-group"), Collector(), assign=[TopicPartition(topic, 0, 0)]
    ) as consumer:
        consumer.commit({(topic, 99): 3}, on_failure=report)
        assert done.wait(30)
    assert refused == [{(topic, 99): 3}]


async def test_publish_many_returns_each_records_durable_position_in_order(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.many"
    _topics(kafka, topic)
    records = [(f"value-{i}".encode(), f"key-{i % 7}".encode(), [("n", str(i).encode())]) for i in range(300)]
    with EventProducer(kafka, "test") as producer:
        assert await producer.publish_many(topic, []) == []
        positions = await asyncio.wait_for(producer.publish_many(topic, records), timeout=30)
        assert producer._pending == {}
    assert len(set(positions)) == len(records)
    assert {partition for partition, _ in positions} == {0, 1}  # keyed across both partitions
    collector = Collector()
    with ConsumerThread(consumer_config(kafka, f"{topic}-g", "test"), collector, subscribe=[topic]):
        stored = {
            (m.partition(), m.offset()): (m.value(), m.key(), m.headers())
            for m in collector.wait_for(len(records))
        }
    assert [stored[where] for where in positions] == records


async def test_publish_many_raises_for_a_record_it_cannot_produce_and_leaves_nothing_pending(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.many-too-big"
    _topics(kafka, topic)
    with EventProducer(kafka, "test") as producer:
        records = [(b"fine", None, None), (b"x" * (MAX_RECORD_BYTES + 1), None, None)]
        with pytest.raises(BusError, match=f"cannot produce to {topic}"):
            await producer.publish_many(topic, records)
        assert producer._pending == {}
        assert await producer.publish_many(topic, records[:1])  # the producer goes on


async def test_a_failing_delivery_callback_does_not_stop_deliveries(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = f"{topic_prefix}.callbacks"
    _topics(kafka, topic)
    event = example_events()[0]

    def broken(err: object, where: object) -> None:
        raise RuntimeError("a caller's bug")

    with EventProducer(kafka, "test") as producer:
        producer.produce(topic, event, on_delivery=broken)
        where = await asyncio.wait_for(producer.publish(topic, event), timeout=30)
        assert where[1] >= 1, "the record after the failing callback was delivered too"
        assert producer.failure is None


async def test_a_dead_delivery_thread_fails_every_waiting_publish(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """Before, a poll loop that raised left every pending ``publish`` waiting forever (and the batch form)."""
    topic = f"{topic_prefix}.dead-poll"
    _topics(kafka, topic)
    event = example_events()[0]
    producer = EventProducer(kafka, "test")
    real = producer._producer

    class Broken:
        """The real producer, whose delivery poll fails (a fatal error in librdkafka)."""

        def produce(self, *args: Any, **kwargs: Any) -> None:
            real.produce(*args, **kwargs)

        def poll(self, timeout: float) -> int:
            raise RuntimeError("fatal: the producer is fenced")

        def flush(self, timeout: float) -> int:
            return int(real.flush(timeout))

        def close(self) -> None:
            real.close()

    producer._producer = Broken()  # type: ignore[assignment]
    value = encode(event)
    waiting = [
        asyncio.create_task(producer.publish(topic, event)),
        asyncio.create_task(producer.publish_many(topic, [(value, None, None)] * 3)),
    ]
    await asyncio.sleep(0)  # produced, and now waiting for their delivery reports
    assert not any(task.done() for task in waiting)
    producer.start()  # the delivery thread dies at its first poll
    try:
        for task in waiting:
            with pytest.raises(BusError, match="the producer failed"):
                await asyncio.wait_for(task, timeout=30)
        with pytest.raises(BusError, match="the producer failed"):
            producer.produce(topic, event)
        with pytest.raises(BusError, match="the producer failed"):
            await producer.publish_many(topic, [(value, None, None)])
    finally:
        producer._running = False
        real.flush(10)
        real.close()


def test_a_consumer_that_dies_tells_its_owner_and_stop_raises(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    from confluent_kafka import TopicPartition

    topic = f"{topic_prefix}.dies"
    _topics(kafka, topic)
    died: list[BaseException] = []
    told = threading.Event()

    def handler(batch: list[Message]) -> None:
        raise ValueError("a handler bug")

    def on_failure(exc: BaseException) -> None:
        died.append(exc)
        told.set()

    consumer = ConsumerThread(
        consumer_config(kafka, None, "dies"),
        handler,
        assign=[TopicPartition(topic, 0, 0)],
        on_failure=on_failure,
    )
    consumer.start()
    producer = Producer(kafka.client_config())
    producer.produce(topic, b"x", partition=0)
    producer.flush(10)
    assert told.wait(30), "the owner was never told"
    assert isinstance(died[0], ValueError)
    assert consumer.failure is died[0]
    with pytest.raises(BusError, match="a handler bug"):
        consumer.stop()


def test_a_fatal_client_error_stops_the_consumer_instead_of_being_skipped() -> None:
    from confluent_kafka import KafkaError, KafkaException

    from bus.consumer import _benign_error

    class Fake:
        def __init__(self, err: KafkaError | None) -> None:
            self._err = err

        def error(self) -> KafkaError | None:
            return self._err

    assert _benign_error(Fake(None)) is False  # type: ignore[arg-type]
    assert _benign_error(Fake(KafkaError(KafkaError._PARTITION_EOF))) is True  # type: ignore[arg-type]
    assert _benign_error(Fake(KafkaError(KafkaError._TRANSPORT))) is True  # type: ignore[arg-type]
    with pytest.raises(KafkaException):
        _benign_error(Fake(KafkaError(KafkaError._FATAL, fatal=True)))  # type: ignore[arg-type]


async def test_a_producer_reaches_a_partition_added_after_it_learnt_the_topic(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """Found by a review: a replies topic grown for more edges (``sluice topics apply``) had its new
    partitions refused by a worker's long-lived producer until librdkafka's periodic metadata refresh
    (5 min): every reply for the new edges was dropped meanwhile. A refused partition makes the producer
    ask for the topic's metadata again (at most every few seconds); one that does not exist is refused."""
    from confluent_kafka.admin import NewPartitions, NewTopic

    admin = make_admin(kafka)
    topic = f"{topic_prefix}.grown"
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(30)
    with EventProducer(kafka, "worker-like") as producer:
        assert await producer.publish_raw(topic, b"first", partition=0) == (0, 0)  # one partition known
        for future in admin.create_partitions([NewPartitions(topic, 2)]).values():
            future.result(30)
        deadline = time.monotonic() + 10
        while True:  # the broker's own metadata may lag the admin's answer a moment
            try:
                assert await producer.publish_raw(topic, b"reply", partition=1) == (1, 0)
                break
            except BusError:
                assert time.monotonic() < deadline, "the added partition stayed refused"
                await asyncio.sleep(0.2)
        with pytest.raises(BusError, match="Unknown partition"):
            await producer.publish_raw(topic, b"nowhere", partition=7)
