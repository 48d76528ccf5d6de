"""An idempotent, ``acks=all`` producer of platform events, usable from asyncio and from plain threads."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from bus.errors import BusError
from bus.placement import native_threads
from schemas.codec import MAX_RECORD_BYTES, encode, headers, kafka_key
from schemas.events import Event
from schemas.lifecycle import Component
from schemas.settings import KafkaConnection

log = logging.getLogger(__name__)

Position = tuple[int, int]
"""A record's place in its topic: (partition, offset)."""
DeliveryCallback = Callable[[BusError | None, Position | None], None]
Record = tuple[bytes, bytes | None, list[tuple[str, bytes]] | None]
"""A record to produce: its value, key and headers."""


class Delivery:
    """One record's delivery report for whoever asks, before or after it lands: ``settle`` is the record's
    ``on_delivery``, and each :meth:`then` callback gets the outcome once (at once where it is known). Any
    thread; callbacks run on the thread that settles, or on the caller's if it already has."""

    __slots__ = ("_error", "_lock", "_settled", "_waiting")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settled = False
        self._error: BusError | None = None
        self._waiting: list[Callable[[BusError | None], None]] = []

    def settle(self, err: BusError | None, _where: Position | None = None) -> None:
        with self._lock:
            self._settled, self._error = True, err
            waiting, self._waiting = self._waiting, []
        for callback in waiting:
            callback(err)

    def then(self, callback: Callable[[BusError | None], None]) -> None:
        with self._lock:
            if not self._settled:
                self._waiting.append(callback)
                return
        callback(self._error)


def producer_config(kafka: KafkaConnection, client_id: str, **overrides: Any) -> dict[str, Any]:
    """Durable and quick: every record is on all in-sync replicas before it counts as sent, retries do not
    duplicate, and nothing waits for batch-mates (``linger.ms=0``: librdkafka still batches what queues up while a request is in flight)."""
    config: dict[str, Any] = {
        **kafka.client_config(),
        "client.id": client_id,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": 0,
        "batch.num.messages": 10_000,
        "queue.buffering.max.messages": 100_000,
        "compression.type": "none",
        "socket.nagle.disable": True,  # small records on loopback: Nagle + delayed ACK cost ~40 ms
        "message.timeout.ms": 30_000,
        "message.max.bytes": MAX_RECORD_BYTES,
    }
    config.update(overrides)
    return config


REFRESH_EVERY_S = 5.0
"""How often a producer asks for a topic's metadata again when a partition is refused (see
``EventProducer._refresh``): a partition that does not exist costs one metadata request a while."""
REFRESH_TIMEOUT_S = 2.0


def _unknown_partition(exc: KafkaException) -> bool:
    err = exc.args[0] if exc.args else None
    return isinstance(err, KafkaError) and err.code() == KafkaError._UNKNOWN_PARTITION


class EventProducer(Component):
    """Produce events from any thread; await durability from asyncio.

    One background thread serves delivery reports (``poll``), so callers never block on the network.
    ``produce`` is non-blocking and thread-safe; ``publish`` is the asyncio form that returns once the
    record is durable. ``stop`` flushes everything still in flight.
    """

    def __init__(self, kafka: KafkaConnection, client_id: str, **overrides: Any) -> None:
        super().__init__()
        with native_threads():  # librdkafka's threads: off a worker's model cores (bus.placement)
            self._producer = Producer(producer_config(kafka, client_id, **overrides))
        self._running = False
        self._thread: threading.Thread | None = None
        self._pending: dict[int, DeliveryCallback] = {}
        """Delivery callbacks not yet called, so a dead poll thread can fail them all (none waits forever)."""
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._refreshed: dict[str, float] = {}
        """When each topic's metadata was last asked for after a partition was refused (monotonic)."""

    def _start(self) -> None:
        if self._running:
            return
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="kafka-producer-poll", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self._running:
                self._producer.poll(0.05)
        except BaseException as exc:  # fail every waiting caller instead of leaving them hanging
            log.exception("the producer's delivery thread failed")
            self.fail(exc)  # every later produce raises it as a BusError
            with self._lock:
                waiting = list(self._pending.values())
                self._pending.clear()
            for callback in waiting:
                _call(callback, BusError(f"the producer failed: {exc}"), None)

    def stop(self, timeout: float = 30.0) -> None:
        if not self._running:
            return
        self._running = False
        if self._thread is not None:
            self._thread.join()
        remaining = self._producer.flush(timeout)
        self._producer.close()  # otherwise librdkafka keeps reconnecting until garbage collection
        if remaining:
            raise BusError(f"{remaining} record(s) were not delivered within {timeout:.0f}s of shutdown")

    def produce(
        self,
        topic: str,
        event: Event,
        *,
        partition: int | None = None,
        key: bytes | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        self.produce_raw(
            topic,
            encode(event),
            key=kafka_key(event) if key is None else key,
            headers=headers(event),
            partition=partition,
            on_delivery=on_delivery,
        )

    def produce_raw(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        partition: int | None = None,
        on_delivery: DeliveryCallback | None = None,
    ) -> None:
        if self.failure is not None:
            raise BusError(f"the producer failed: {self.failure}") from self.failure
        token = next(self._tokens)
        if on_delivery is not None:
            with self._lock:
                self._pending[token] = on_delivery

        def report(err: KafkaError | None, msg: Message) -> None:
            with self._lock:
                callback = self._pending.pop(token, None)
            if callback is None:
                return
            if err is not None:
                _call(
                    callback,
                    BusError(f"delivery to {topic} failed: {err.str()}", retriable=err.retriable()),
                    None,
                )
            else:
                _call(callback, None, (msg.partition() or 0, msg.offset() or 0))

        kwargs: dict[str, Any] = {"key": key, "headers": headers, "on_delivery": report}
        if partition is not None:
            kwargs["partition"] = partition
        self._produce(topic, value, kwargs, token)

    def _produce(self, topic: str, value: bytes | None, kwargs: dict[str, Any], token: int) -> None:
        """One ``produce`` call, waiting for deliveries while librdkafka's local queue is full (never
        dropping); a record it refuses raises BusError and forgets ``token``'s pending callback."""
        while True:
            try:
                self._producer.produce(topic, value, **kwargs)
            except BufferError:
                self._producer.poll(0.05)  # local queue full: wait for deliveries, never drop
                continue
            except KafkaException as exc:
                if _unknown_partition(exc) and self._refresh(topic):
                    continue
                self._forget(token)
                raise BusError(f"cannot produce to {topic}: {exc}") from exc
            except Exception as exc:  # record too large, ...
                self._forget(token)
                raise BusError(f"cannot produce to {topic}: {exc}") from exc
            return

    def _forget(self, token: int) -> None:
        with self._lock:
            self._pending.pop(token, None)

    def _refresh(self, topic: str) -> bool:
        """Ask for ``topic``'s metadata again, at most once every :data:`REFRESH_EVERY_S` (True: asked).
        A partition added since this producer last read it (a replies topic grown for more edges) is
        refused from librdkafka's cache until its periodic refresh, 5 min: a worker dropped every reply
        for the new edges meanwhile, and their clients waited out their deadlines (a review)."""
        now = time.monotonic()
        with self._lock:
            if now - self._refreshed.get(topic, -REFRESH_EVERY_S) < REFRESH_EVERY_S:
                return False
            self._refreshed[topic] = now
        try:
            self._producer.list_topics(topic, timeout=REFRESH_TIMEOUT_S)
        except KafkaException:
            return False
        return True

    async def publish(
        self, topic: str, event: Event, *, partition: int | None = None, key: bytes | None = None
    ) -> Position:
        """Produce and wait until the record is durable; raises BusError if it is not."""
        return await self.publish_raw(
            topic,
            encode(event),
            key=kafka_key(event) if key is None else key,
            headers=headers(event),
            partition=partition,
        )

    async def publish_raw(
        self,
        topic: str,
        value: bytes | None,
        *,
        key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None,
        partition: int | None = None,
    ) -> Position:
        """:meth:`produce_raw` (``value`` None: a tombstone), awaited until durable."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Position] = loop.create_future()

        def settle(err: BusError | None, where: Position | None) -> None:
            loop.call_soon_threadsafe(_settle, future, err, where)

        self.produce_raw(topic, value, key=key, headers=headers, partition=partition, on_delivery=settle)
        return await future

    async def publish_many(self, topic: str, records: Sequence[Record]) -> list[Position]:
        """Produce ``records`` (value, key, headers) in order and wait once until every one is durable: their
        positions, in order. Raises BusError if any was not stored (the others may have been).

        The batch form of :meth:`publish_raw` for a caller with thousands of records at a time (the streams
        worker's audit entries): one pending entry and one wake-up of the loop per batch, and per record a
        ``functools.partial`` for its delivery report instead of two closures and three locks."""
        if not records:
            return []
        if self.failure is not None:
            raise BusError(f"the producer failed: {self.failure}") from self.failure
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        where: list[Position] = [(0, 0)] * len(records)
        reported = itertools.count(1)  # next() on a count is atomic: reports may come from two threads
        last = len(records)
        token = next(self._tokens)

        def failed(err: BusError | None, _: Position | None) -> None:  # the poll thread died
            loop.call_soon_threadsafe(_settle_many, done, err)

        def report(index: int, err: KafkaError | None, msg: Message) -> None:
            if err is not None:
                with self._lock:
                    self._pending.pop(token, None)
                error = BusError(f"delivery to {topic} failed: {err.str()}", retriable=err.retriable())
                loop.call_soon_threadsafe(_settle_many, done, error)
                return
            where[index] = (msg.partition() or 0, msg.offset() or 0)
            if next(reported) == last:
                with self._lock:
                    self._pending.pop(token, None)
                loop.call_soon_threadsafe(_settle_many, done, None)

        with self._lock:
            self._pending[token] = failed
        for index, (value, key, head) in enumerate(records):
            kwargs = {"key": key, "headers": head, "on_delivery": functools.partial(report, index)}
            self._produce(topic, value, kwargs, token)
        await done
        return where


def _call(callback: DeliveryCallback, err: BusError | None, where: Position | None) -> None:
    """A delivery callback runs inside ``poll``: an exception from it must not stop the delivery thread."""
    try:
        callback(err, where)
    except Exception:
        log.exception("a delivery callback failed")


def _settle_many(done: asyncio.Future[None], err: BusError | None) -> None:
    if done.done():
        return
    if err is not None:
        done.set_exception(err)
    else:
        done.set_result(None)


def _settle(future: asyncio.Future[Position], err: BusError | None, where: Position | None) -> None:
    if future.done():
        return
    if err is not None or where is None:
        future.set_exception(err or BusError("delivery report without a position"))
    else:
        future.set_result(where)
