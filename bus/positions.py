"""Reading the log by position: a partition's watermarks and its offset at a time, a whole topic's extent
and reading it to that end, each retried while the cluster is still settling in; where a consumer group
stands (the oldest record it could still be handed, its members)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from confluent_kafka import (
    TIMESTAMP_NOT_AVAILABLE,
    Consumer,
    KafkaError,
    KafkaException,
    Message,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient

from bus.consumer import consumer_config, past_ends
from bus.errors import BusError
from schemas.settings import KafkaConnection

_T = TypeVar("_T")

log = logging.getLogger(__name__)


# Errors a just-created partition answers until its leader is ready, and a group until its coordinator is
# (a broker that just started), and what a request gets when the broker it went to dies under it (a
# replicated cluster losing a node: the next try goes to the partition's new leader); librdkafka marks
# some of them non-retriable.
_SETTLING = frozenset(
    {
        KafkaError._DESTROY_BROKER,
        KafkaError._TRANSPORT,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._TIMED_OUT,
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_NOT_AVAILABLE,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    }
)


def watermarks(consumer: Consumer, topic: str, partition: int, timeout: float = 30.0) -> tuple[int, int]:
    """(low, high) offsets of a partition, retrying while a new partition's leader settles in."""
    low, high = settled(
        lambda: consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=min(timeout, 10)),
        f"the offsets of {topic}[{partition}]",
        timeout,
    )
    return int(low), int(high)


def offset_at(consumer: Consumer, topic: str, partition: int, unix_ms: int, timeout: float = 30.0) -> int:
    """The first offset of a partition at or after ``unix_ms`` (its end when there is none), retrying
    while a new partition's leader settles in."""
    (found,) = settled(
        lambda: consumer.offsets_for_times([TopicPartition(topic, partition, max(unix_ms, 0))], timeout=10),
        f"the offset of {topic}[{partition}] at {unix_ms}",
        timeout,
    )
    if found.offset < 0:  # nothing at or after that time
        return watermarks(consumer, topic, partition, timeout)[1]
    return int(found.offset)


def settled(call: Callable[[], _T], what: str, timeout: float) -> _T:
    """``call()``, retried while the cluster is still settling (a new group's coordinator, a partition's
    leader being elected), for up to ``timeout`` seconds; :class:`BusError` past it or on any other error."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return call()
        except KafkaException as exc:
            err = exc.args[0]
            settling = err.retriable() or err.code() in _SETTLING
            if not settling or time.monotonic() > deadline:
                raise BusError(f"cannot read {what}: {err}") from exc
            time.sleep(0.1)


def probe_config(kafka: KafkaConnection, client_id: str) -> dict[str, Any]:
    """The config of a short-lived probe consumer (``<client_id>-probe``) whose failure is its caller's one
    error (:class:`BusError`): its librdkafka log lines stay out of the terminal, not a connection failure
    printed every 50 ms while a Kafka that does not answer keeps it waiting."""
    return consumer_config(kafka, None, f"{client_id}-probe", logger=_PROBE_LOG)


_PROBE_LOG = logging.getLogger("sluice.bus.probe")
_PROBE_LOG.setLevel(logging.CRITICAL)
_PROBE_LOG.propagate = False


def topic_extent(
    kafka: KafkaConnection, topic: str, client_id: str
) -> tuple[list[TopicPartition], dict[int, int]] | None:
    """What a reader of a whole topic must read: every partition from its first retained offset (the low
    watermark: retention may have deleted the start), and where each ends now (the high watermark), for
    :func:`read_to_end`. None when the topic does not exist; :class:`BusError` when the cluster cannot say."""
    consumer = Consumer(probe_config(kafka, client_id))
    try:
        try:
            meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        except KafkaException as exc:
            raise BusError(
                f"cannot read the metadata of {topic} from {kafka.bootstrap}: {exc.args[0]}"
            ) from exc
        if meta is None or meta.error is not None:
            return None
        starts: list[TopicPartition] = []
        ends: dict[int, int] = {}
        for partition in sorted(meta.partitions):
            low, high = watermarks(consumer, topic, partition)
            starts.append(TopicPartition(topic, partition, low))
            ends[partition] = high
        return starts, ends
    finally:
        consumer.close()


READ_TO_END_S = 120.0


READ_BATCH = 500
"""Records :func:`read_to_end` asks the consumer for at a time."""


def read_to_end(
    consumer: Consumer,
    starts: Sequence[TopicPartition],
    ends: dict[int, int],
    timeout_s: float = READ_TO_END_S,
) -> Iterator[Message]:
    """Every record of ``starts`` (partitions of one topic with start offsets) up to ``ends`` (partition ->
    the end offset to reach, e.g. the high watermark taken before), then stop. A partition already at its
    end is not read, nor one whose retained records all come before ``starts`` or were all deleted (its
    first retained offset, the low watermark, at or past its end: an audit found a worker that could not
    start once retention had emptied a partition of the results topic, waiting for a record that would
    never come), nor one whose end is past its last record (a transaction's marker). ``ends`` is read as
    the records come: a caller that lowers a partition's end (it has what it needs of it) ends its read
    there. Raises :class:`BusError` when that takes longer than ``timeout_s``."""
    todo = {tp.partition for tp in starts if 0 <= tp.offset < ends.get(tp.partition, 0)}
    if not todo:
        return
    firsts = {
        tp.partition: watermarks(consumer, tp.topic, tp.partition)[0] for tp in starts if tp.partition in todo
    }
    todo = {part for part in todo if firsts[part] < ends[part]}
    if not todo:
        return
    consumer.assign(
        [
            TopicPartition(tp.topic, tp.partition, max(tp.offset, firsts[tp.partition]))
            for tp in starts
            if tp.partition in todo
        ]
    )
    # Ask for no more records than are left: ``consume`` waits its whole timeout for a count it cannot
    # fill, which added 0.5 s to every short read (a CLI's look at the control topic, a re-anchor). Offsets
    # a compacted topic no longer holds are counted too: such a read waits once, as before.
    at = {tp.partition: max(tp.offset, firsts[tp.partition]) for tp in starts if tp.partition in todo}
    deadline = time.monotonic() + timeout_s
    while todo:
        if time.monotonic() > deadline:
            topic = starts[0].topic
            raise BusError(
                f"reading {topic} to its end took over {timeout_s:.0f}s ({len(todo)} partitions left)"
            )
        left = sum(ends[part] - at[part] for part in todo)
        for message in consumer.consume(max(1, min(READ_BATCH, left)), timeout=0.5):
            if message.error() is not None:
                continue
            part, offset = message.partition() or 0, message.offset() or 0
            if offset >= ends.get(part, 0):  # past its end (appended since, or an end lowered as it read)
                todo.discard(part)
                continue
            at[part] = offset + 1
            if at[part] >= ends[part]:
                todo.discard(part)
            yield message
        if todo:
            topic = starts[0].topic
            todo -= {part for _, part in past_ends(consumer, {(topic, part): ends[part] for part in todo})}


def timestamp_at(
    consumer: Consumer, topic: str, partition: int, offset: int, timeout_s: float = 10.0
) -> int | None:
    """The timestamp (unix ms) of the first record of a partition at or after ``offset``; None when there
    is none within ``timeout_s`` (``consumer`` is reassigned)."""
    consumer.assign([TopicPartition(topic, partition, offset)])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for message in consumer.consume(1, timeout=0.5):
            if message.error() is None and message.partition() == partition:
                kind, ms = message.timestamp()
                return int(ms) if kind != TIMESTAMP_NOT_AVAILABLE else None
    return None


def uncommitted_since(
    kafka: KafkaConnection, group: str, topic: str, client_id: str, timeout_s: float = 30.0
) -> int | None:
    """The time (unix ms) of the oldest record ``group`` could still be handed on ``topic``: the first one
    past its committed offset on each partition, or its first retained record where the group never
    committed (the time of now when there is none: every partition committed to its end, or empty). None
    when the cluster cannot say. A record's time is its producer's clock: allow for skew. (A partition
    never committed made this None, so a worker read the whole results topic: a partition that never held
    a record is never committed, a review.)"""
    consumer = Consumer(consumer_config(kafka, group, f"{client_id}-probe"))
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            return None
        committed = consumer.committed([TopicPartition(topic, p) for p in meta.partitions], timeout=timeout_s)
        oldest = int(time.time() * 1000)
        for tp in committed:
            low, high = watermarks(consumer, topic, tp.partition, timeout_s)
            start = max(tp.offset, low)  # a negative offset: never committed, from the first record
            if start >= high:
                continue
            at = timestamp_at(consumer, topic, tp.partition, start)
            if at is None:
                return None
            oldest = min(oldest, at)
        return oldest
    except (KafkaException, BusError):
        return None
    finally:
        consumer.close()


def group_members(admin: AdminClient, group: str, timeout_s: float = 10.0) -> int | None:
    """How many members consumer group ``group`` has now (0 when it is empty or does not exist); None when
    the cluster cannot say within ``timeout_s``."""
    try:
        (future,) = admin.describe_consumer_groups([group], request_timeout=timeout_s).values()
        return len(future.result(timeout=timeout_s).members)
    except (KafkaException, TimeoutError, ValueError):
        return None


def behind_peers(own: Mapping[int, int], peers: Sequence[Mapping[int, int]]) -> dict[int, int]:
    """Where a group moves up to, from its committed offsets ``own`` and those of its ``peers`` (partition →
    offset; a partition missing or negative has none): on each partition where every peer has committed
    and the group has not, or is behind them all, the lowest of the peers' offsets. Nothing without peers,
    nothing on a partition a peer has not committed (it may still be handed anything there), and nothing at
    all where the group is ahead of them on any partition: positions are taken whole, the peers' or its
    own, never mixed. A group may release a record of a request whose other record it keeps open on
    another partition (a re-published batch line); the peers may keep the other one, and a mix of the two
    would pass both (a review)."""
    if not peers:
        return {}

    def at(offsets: Mapping[int, int], partition: int) -> int:
        return max(offsets.get(partition, -1), -1)  # none: -1 (librdkafka says -1001)

    partitions = set(own).union(*peers)
    lowest = {p: min(at(peer, p) for peer in peers) for p in partitions}
    if any(at(own, p) > lowest[p] for p in partitions):
        return {}
    return {p: low for p, low in lowest.items() if low >= 0 and at(own, p) < low}


def start_at_peers(
    kafka: KafkaConnection,
    group: str,
    topic: str,
    peers: Sequence[str],
    client_id: str,
    timeout_s: float = 30.0,
) -> dict[int, int]:
    """Before ``group`` first subscribes to ``topic``: move it up to where all of ``peers`` (other groups
    reading the same records) have committed, where it has no offset yet or is behind them
    (:func:`behind_peers`). For groups whose commits pass a record only once it has ended, whoever ended it:
    what is behind all of them needs nobody any more, and a new group would otherwise start at the topic's
    first retained record. Returns what was committed; nothing when the group already has members (Kafka
    takes commits from outside a group only while it is empty: its members' own positions stand)."""
    consumer = Consumer(consumer_config(kafka, group, f"{client_id}-seed"))
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            return {}
        tps = [TopicPartition(topic, p) for p in meta.partitions]

        def committed_by(name: str) -> dict[int, int]:
            probe = consumer if name == group else Consumer(consumer_config(kafka, name, f"{client_id}-seed"))
            try:
                found = settled(lambda: probe.committed(tps, timeout=10), f"{name}'s offsets", timeout_s)
            finally:
                if probe is not consumer:
                    probe.close()
            return {tp.partition: tp.offset for tp in found}

        theirs = [committed_by(peer) for peer in peers]
        # Its own last, just before the commit: a last member leaving meanwhile may have committed further
        # (the commit below would move it back).
        moved = behind_peers(committed_by(group), theirs)
        if not moved:
            return {}
        offsets = [TopicPartition(topic, p, offset) for p, offset in sorted(moved.items())]
        try:
            done = settled(
                lambda: consumer.commit(offsets=offsets, asynchronous=False), f"{group}'s start", timeout_s
            )
        except BusError as exc:  # the group has members (UNKNOWN_MEMBER_ID): their positions stand
            log.debug("%s is not moved on %s: it has members, or the commit failed (%s)", group, topic, exc)
            return {}
        return {tp.partition: tp.offset for tp in done or () if tp.error is None}
    finally:
        consumer.close()
