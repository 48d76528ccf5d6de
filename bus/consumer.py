"""A confluent-kafka consumer polled in its own thread, and dead-lettering of records nobody can decode."""

from __future__ import annotations

import base64
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from bus.errors import BusError
from bus.producer import EventProducer
from schemas.codec import DecodeError, decode
from schemas.events import DeadLetter, Event

log = logging.getLogger(__name__)

TP = tuple[str, int]
Handler = Callable[[list[Message]], None]


def consumer_config(bootstrap: str, group_id: str | None, client_id: str, **overrides: Any) -> dict[str, Any]:
    """Manual commits (offsets are committed only after the effect is durable), read-committed isolation."""
    config: dict[str, Any] = {
        "bootstrap.servers": bootstrap,
        "client.id": client_id,
        "group.id": group_id or f"{client_id}-assigned",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 1_000,
        "fetch.wait.max.ms": 5,
        "socket.nagle.disable": True,
        "partition.assignment.strategy": "cooperative-sticky",
    }
    config.update(overrides)
    return config


class ConsumerThread:
    """Poll one consumer on a dedicated thread and pass each non-empty batch to ``handler`` there.

    Either ``subscribe`` to topics as a member of the consumer group in the config, or ``assign`` fixed
    partitions (with explicit start offsets, e.g. OFFSET_END). ``commit`` may be called from any thread:
    commits are queued and performed synchronously by the polling thread between batches. The handler
    must be quick (hand work to a queue); an exception in it stops the thread and is re-raised by ``stop``.
    """

    def __init__(
        self,
        config: dict[str, Any],
        handler: Handler,
        *,
        subscribe: Sequence[str] = (),
        assign: Sequence[TopicPartition] = (),
        on_revoke: Callable[[list[TP]], None] | None = None,
        name: str = "kafka-consumer",
        batch_size: int = 500,
    ) -> None:
        if bool(subscribe) == bool(assign):
            raise ValueError("give exactly one of subscribe= or assign=")
        self._config = config
        self._handler = handler
        self._subscribe = list(subscribe)
        self._assign = list(assign)
        self._on_revoke = on_revoke
        self._name = name
        self._batch_size = batch_size
        self._commits: queue.SimpleQueue[dict[TP, int]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Consumer | None = None
        self.failure: BaseException | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._consumer = Consumer(self._config)
        if self._subscribe:
            self._consumer.subscribe(
                self._subscribe, on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked
            )
        else:
            self._consumer.assign(self._assign)
            self._ready.set()
        self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        self._thread.start()

    def wait_assigned(self, timeout: float) -> bool:
        """True once the group gave this consumer its partitions (immediately for ``assign``)."""
        return self._ready.wait(timeout)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._ready.set()

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._flush_commits()
        if self._on_revoke is not None:
            self._on_revoke([(tp.topic, tp.partition) for tp in partitions])

    def _serve(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        try:
            while not self._stop.is_set():
                self._flush_commits()
                # poll() returns at the first record; consume() with a timeout would wait for a full batch
                first = consumer.poll(0.05)
                if first is None:
                    continue
                messages = [first, *consumer.consume(num_messages=self._batch_size - 1, timeout=0)]
                batch = [m for m in messages if not _benign_error(m)]
                if batch:
                    self._handler(batch)
            self._flush_commits()
        except BaseException as exc:  # surfaced by stop(); logging here too so it is never silent
            log.exception("%s stopped on an error", self._name)
            self.failure = exc
        finally:
            consumer.close()

    def commit(self, offsets: dict[TP, int]) -> None:
        """Commit ``{(topic, partition): next offset to read}`` (thread-safe, asynchronous to the caller)."""
        if offsets:
            self._commits.put(dict(offsets))

    def _flush_commits(self) -> None:
        merged: dict[TP, int] = {}
        while True:
            try:
                merged.update(self._commits.get_nowait())
            except queue.Empty:
                break
        if merged and self._consumer is not None:
            tps = [TopicPartition(topic, part, off) for (topic, part), off in merged.items()]
            try:
                self._consumer.commit(offsets=tps, asynchronous=False)
            except Exception:  # a revoked partition cannot be committed: its next owner redoes the work
                log.warning("commit of %s failed", merged, exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.failure is not None:
            raise BusError(f"{self._name} failed: {self.failure}") from self.failure

    def __enter__(self) -> ConsumerThread:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _benign_error(message: Message) -> bool:
    err = message.error()
    if err is None:
        return False
    if err.code() == KafkaError._PARTITION_EOF:
        return True
    log.warning("consumer error: %s", err)
    return True


def decode_or_dead_letter(
    message: Message, producer: EventProducer, deadletter_topic: str, source: str
) -> Event | None:
    """Decode a record into its event, or send it whole to the dead-letter topic (with the reason) and
    return None so the caller moves on."""
    value = message.value() or b""
    raw_headers = message.headers() or []
    header_list = list(raw_headers.items()) if isinstance(raw_headers, dict) else list(raw_headers)
    try:
        return decode(value, header_list)
    except DecodeError as exc:
        producer.produce(
            deadletter_topic,
            DeadLetter(
                tenant="",
                model="",
                source=source,
                source_topic=message.topic() or "",
                partition=message.partition() or 0,
                offset=message.offset() or 0,
                reason=str(exc),
                payload_b64=base64.b64encode(value).decode(),
                headers={k: _text(v) for k, v in header_list},
            ),
        )
        log.warning(
            "dead-lettered %s[%s]@%s: %s", message.topic(), message.partition(), message.offset(), exc
        )
        return None


def _text(value: str | bytes | None) -> str:
    if value is None:
        return ""
    return value if isinstance(value, str) else value.decode("utf-8", "replace")


# Errors a just-created partition answers until its leader is ready (librdkafka marks them non-retriable).
_SETTLING = frozenset(
    {
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._TIMED_OUT,
    }
)


def watermarks(consumer: Consumer, topic: str, partition: int, timeout: float = 30.0) -> tuple[int, int]:
    """(low, high) offsets of a partition, retrying while a new partition's leader settles in."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=min(timeout, 10)
            )
        except KafkaException as exc:
            err = exc.args[0]
            settling = err.retriable() or err.code() in _SETTLING
            if not settling or time.monotonic() > deadline:
                raise BusError(f"cannot read the offsets of {topic}[{partition}]: {err}") from exc
            time.sleep(0.1)
            continue
        return int(low), int(high)
