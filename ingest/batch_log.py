"""What the batch runner needs from the log, as a port, and its Kafka adapter.

- ``publish_line`` produces a line's request event on its model's request topic (``on_failed`` is called
  on the event loop if Kafka did not take it);
- ``cancel`` produces a :class:`CancelRequested`; ``publish_state`` awaits a batch state being durable on
  the ``batches`` topic;
- ``results`` waits (up to ``wait_s``) for the next terminal events of batch lines from the ``results``
  topic, in log order; ``handled`` says the runner made everything ``results`` returned durable, so
  their offsets may be committed;
- ``follow`` starts reading ``results`` (the runner calls it before it publishes a line), ``unfollow``
  stops: every terminal event of every request passes through ``results``, and an edge that tails it with
  no batch running spent ~15 % of its CPU a request doing so (``docs/perf/``);
- ``caught_up`` says whether what was written to ``results`` before the last ``follow`` from the group's
  committed offsets (an edge restarted with batches running) has all been read: until then a line with
  no result may have one waiting there, and its batch must not end without it.

The in-memory fake in ``tests/ingest`` implements the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
from collections.abc import Callable
from typing import Protocol

from confluent_kafka import Consumer, Message, TopicPartition

from bus.consumer import BACKGROUND, TP, ConsumerThread, consumer_config
from bus.errors import BusError
from bus.positions import settled, watermarks
from bus.producer import EventProducer
from schemas.codec import DecodeError, decode
from schemas.events import BatchItemRequested, BatchStateChanged, CancelRequested, RequestFinished
from schemas.lifecycle import AsyncComponent
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames


class BatchLog(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def watch(self, watcher: Callable[[BaseException], object]) -> None: ...

    def publish_line(self, event: BatchItemRequested, on_failed: Callable[[BusError], None]) -> None: ...

    def cancel(self, event: CancelRequested) -> None: ...

    async def publish_state(self, state: BatchStateChanged) -> None: ...

    async def results(self, wait_s: float) -> list[RequestFinished]: ...

    def handled(self) -> None: ...

    async def follow(self, *, from_end: bool) -> None: ...

    async def unfollow(self) -> None: ...

    @property
    def following(self) -> bool: ...

    @property
    def caught_up(self) -> bool: ...


class KafkaBatchLog(AsyncComponent):
    def __init__(self, kafka: KafkaConnection, names: TopicNames, edge_id: str) -> None:
        super().__init__()
        self._kafka, self._names, self._edge_id = kafka, names, edge_id
        self._group = f"sluice-batches.{edge_id}"
        self._queue: queue.Queue[tuple[int, list[RequestFinished], dict[TP, int]]] = queue.Queue(8)
        """(the generation of the consumer that read them, batch lines' results, where each partition is)"""
        self._stopping = threading.Event()
        self._pending: dict[TP, int] = {}
        self._producer: EventProducer | None = None
        self._consumer: ConsumerThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = 0  # counts follows and unfollows: what an earlier consumer read is stale
        self._backlog: dict[TP, int] = {}
        """Partitions with results written before the last follow from committed offsets, and the offset
        up to which they must be read (``caught_up``)."""

    async def _start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._producer = EventProducer(self._kafka, f"{self._edge_id}-batches")
        self._producer.start()
        self._producer.watch(self.fail)

    @property
    def following(self) -> bool:
        return self._consumer is not None

    @property
    def caught_up(self) -> bool:
        return not self._backlog

    async def follow(self, *, from_end: bool) -> None:
        """Read batch lines' results from now on (no-op while following). ``from_end``: no line of this
        edge is in flight, so what was written while it did not follow is skipped (the group's offsets move
        to the end first); else the group goes on from its committed offsets (an edge restarted with
        batches running: their lines' results may have landed while it was down)."""
        if self._consumer is not None:
            return
        self._backlog = await asyncio.to_thread(self._seed_group, from_end)
        self._generation += 1
        self._stopping.clear()
        consumer = ConsumerThread(
            consumer_config(self._kafka, self._group, f"{self._edge_id}-batch-results", **BACKGROUND),
            functools.partial(self._on_results, self._generation),
            subscribe=[self._names.results],
            name="batch-results",
            batch_size=1000,
        )
        consumer.watch(self.fail)
        consumer.start()
        self._consumer = consumer

    async def unfollow(self) -> None:
        """Stop reading results (no line of this edge may be in flight): commits already asked for go
        out; results read and not yet returned are dropped."""
        consumer, self._consumer = self._consumer, None
        if consumer is None:
            return
        self._generation += 1
        self._stopping.set()  # a handler waiting on the full queue gives up
        with contextlib.suppress(BusError):  # already reported through fail()
            await asyncio.to_thread(consumer.stop)
        self._pending = {}  # what it still holds is dropped by ``results`` (an earlier generation)
        self._backlog = {}

    async def stop(self) -> None:
        await self.unfollow()
        if self._producer is not None:
            producer, self._producer = self._producer, None
            await asyncio.to_thread(producer.stop)

    def _seed_group(self, from_end: bool) -> dict[TP, int]:
        """Before subscribing: a new group starts at the end of ``results``, not at its whole history (the
        current end is committed for each partition the group has no offset on yet); with ``from_end``,
        every partition does. Returns the backlog: each other partition's end now, where the group's
        offset is behind it."""
        consumer = Consumer(consumer_config(self._kafka, self._group, f"{self._edge_id}-batch-seed"))
        try:
            topic = self._names.results
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            if meta.error is not None:
                raise BusError(f"topic {topic} is missing: run `sluice topics apply`")
            tps = [TopicPartition(topic, p) for p in meta.partitions]
            # A broker that just started may not have the group's coordinator yet: wait for it.
            committed = settled(lambda: consumer.committed(tps, timeout=10), f"{self._group}'s offsets", 60)
            missing = [tp.partition for tp in committed if from_end or tp.offset < 0]
            if missing:
                ends = [TopicPartition(topic, p, watermarks(consumer, topic, p)[1]) for p in missing]
                settled(
                    lambda: consumer.commit(offsets=ends, asynchronous=False), f"{self._group}'s start", 60
                )
            backlog: dict[TP, int] = {}
            for tp in committed:
                if tp.partition in missing:
                    continue
                low, high = watermarks(consumer, topic, tp.partition)
                if max(tp.offset, low) < high:  # records past the group's offset that retention kept
                    backlog[(topic, tp.partition)] = high
            return backlog
        finally:
            consumer.close()

    def _producing(self) -> EventProducer:
        if self._producer is None:
            raise BusError("the batch log is not started")
        return self._producer

    def publish_line(self, event: BatchItemRequested, on_failed: Callable[[BusError], None]) -> None:
        loop = self._loop

        def delivered(err: BusError | None, _where: object) -> None:
            if err is not None and loop is not None:
                loop.call_soon_threadsafe(on_failed, err)

        self._producing().produce(self._names.requests(event.model), event, on_delivery=delivered)

    def cancel(self, event: CancelRequested) -> None:
        self._producing().produce(self._names.cancels, event)

    async def publish_state(self, state: BatchStateChanged) -> None:
        await self._producing().publish(self._names.batches, state)

    def _on_results(self, generation: int, batch: list[Message]) -> None:
        """On the consumer thread: decode the batch lines' results, hand them over (bounded: it waits)."""
        found: list[RequestFinished] = []
        ends: dict[TP, int] = {}
        for message in batch:
            ends[(message.topic() or "", message.partition() or 0)] = (message.offset() or 0) + 1
            value = message.value()
            if not value or b'"batch":{' not in value:
                continue  # not a batch line's result: no need to decode it
            try:
                event = decode(value)
            except DecodeError:
                continue  # the streams sink dead-letters what does not decode
            if isinstance(event, RequestFinished) and event.batch is not None:
                found.append(event)
        while not self._stopping.is_set():
            try:
                self._queue.put((generation, found, ends), timeout=0.2)
                return
            except queue.Full:
                continue

    async def results(self, wait_s: float) -> list[RequestFinished]:
        try:
            generation, found, ends = await asyncio.to_thread(self._queue.get, True, wait_s)
        except queue.Empty:
            return []
        if generation != self._generation:
            return []  # read by a consumer since stopped (no line was in flight): its offsets are stale
        self._pending.update(ends)
        for tp, reached in ends.items():
            if reached >= self._backlog.get(tp, reached + 1):
                del self._backlog[tp]
        return found

    def handled(self) -> None:
        if self._consumer is not None and self._pending:
            self._consumer.commit(self._pending)
        self._pending = {}
