"""``sluice replay``: rebuild the warehouse from the log, from offset 0, into an empty warehouse.

It reads every sink topic's partitions from their first offset up to their end at the moment it starts
(no consumer group: it commits nothing and disturbs no one), and writes through the same
:class:`streams.sink.Rows` the live worker uses, so the derived tables come out identical.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import monotonic

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from bus.consumer import consumer_config, past_ends
from bus.control import read_control
from bus.errors import BusError, kafka_reason
from bus.positions import watermarks
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams import StreamsError
from streams.app import sink_topics
from streams.pricing import PriceHistory, PriceTable
from streams.sink import Consumed, Inserter, Rows, insert

TABLES = (
    "events_raw", "request_facts", "audit_log", "drift_features", "drift_reports", "deployments", "batches",
)  # fmt: skip


DEFAULT_STALL_TIMEOUT_S = 600.0
"""How long a replay waits for the next record of the log before it gives up (``sluice replay --timeout``)."""


class ReplayError(StreamsError, RuntimeError):
    """The target warehouse is not empty, or the log could not be read to its end."""


@dataclass(frozen=True)
class ReplayReport:
    events: int
    undecodable: int
    partitions: int
    seconds: float
    gone: dict[str, int] = field(default_factory=dict)
    """Per topic, the records its retention (or compaction) has removed from the start of its partitions:
    history this replay could not rebuild."""
    compacted: dict[str, int] = field(default_factory=dict)
    """Per topic, how many offsets within what it holds had no record: superseded records the cleaner of a
    compacted topic removed (``control``: older deployments and budgets), history not rebuilt either, or
    the markers and aborted records of a transactional producer (none of the platform's is one)."""


def replay(
    platform: PlatformSettings,
    writer: Inserter,
    prices: PriceTable | PriceHistory,
    request_topics: list[str],
    *,
    store_content: bool = False,
    batch_size: int = 5000,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
) -> ReplayReport:
    """Read the sink topics from the start to their current end into ``writer``; ``progress(done, total)``.

    ``timeout_s`` bounds a stall, not the replay: it fails with :class:`ReplayError` once ``timeout_s``
    pass without a record it still needs (a long log that keeps coming takes as long as it takes), and
    when Kafka cannot be asked for the topics' ends.

    Requests are priced as the live worker priced them: by the table in force when each was accepted, from
    the price history on the control topic (:func:`price_history`); ``prices`` (a table) only where the log
    holds none.
    """
    if not timeout_s > 0:
        raise ValueError("timeout_s must be positive")
    began = monotonic()
    names = TopicNames(platform.topic_prefix)
    consumer = Consumer(consumer_config(platform.kafka, None, "sluice-replay"))
    history = prices if isinstance(prices, PriceHistory) else price_history(platform, prices)
    rows = Rows(history, store_content=store_content, decisions_from_topic=True, topics=names)
    try:
        try:
            extents = _extents(consumer, sink_topics(names, request_topics))
        except KafkaException as exc:
            reason = kafka_reason(exc)
            raise ReplayError(
                f"cannot read the topics' ends on Kafka at {platform.bootstrap}: {reason}"
            ) from exc
        gone: dict[str, int] = {}
        for (topic, _), (low, _) in extents.items():
            if low > 0:  # a partition retention emptied too (low = high): its whole history is gone
                gone[topic] = gone.get(topic, 0) + low
        held = {tp: (low, high) for tp, (low, high) in extents.items() if high > low}
        total = sum(high - low for low, high in held.values())
        consumer.assign([TopicPartition(t, p, low) for (t, p), (low, _) in held.items()])
        remaining = {tp: high for tp, (_, high) in held.items()}
        read = dict.fromkeys(held, 0)  # records read per partition
        reached = {tp: low for tp, (low, _) in held.items()}  # the offset each partition is read up to
        done = undecodable = 0
        last_record = monotonic()
        while remaining:
            if monotonic() - last_record > timeout_s:
                raise ReplayError(
                    f"no record arrived for {timeout_s:g}s with {done} of up to {total} read; still to come: "
                    f"{_partitions(remaining)} (`sluice replay --timeout` waits longer)"
                )
            records = []
            for message in consumer.consume(batch_size, timeout=1.0):
                if message.error() is not None:
                    continue
                key = (message.topic() or "", message.partition() or 0)
                offset = message.offset() or 0
                end = remaining.get(key)
                if end is None or offset >= end:
                    continue  # past the end this replay covers
                records.append(Consumed(key[0], key[1], offset, message.value() or b""))
                read[key] += 1
                reached[key] = offset + 1
                if offset + 1 >= end:
                    del remaining[key]
            for key in past_ends(consumer, remaining):  # ending in a transaction's marker
                reached[key] = remaining.pop(key)
            if records:
                batch = rows.batch(records)
                insert(writer, batch)
                done += len(records)
                undecodable += len(batch.undecodable)
                if progress is not None:  # by offsets: a compacted topic's holes count as passed (a review:
                    # it ended at 3/8, counting records against a total of offsets)
                    progress(sum(reached[tp] - low for tp, (low, _) in held.items()), total)
                last_record = monotonic()  # after the insert: only the wait for Kafka counts
        compacted: dict[str, int] = {}
        for (topic, partition), (low, high) in held.items():
            holes = high - low - read[(topic, partition)]
            if holes > 0:
                compacted[topic] = compacted.get(topic, 0) + holes
        return ReplayReport(done, undecodable, len(held), monotonic() - began, gone, compacted)
    finally:
        consumer.close()


def price_history(platform: PlatformSettings, fallback: PriceTable) -> PriceHistory:
    """The price tables published on the control topic (``fallback`` where it holds none)."""
    topic = TopicNames(platform.topic_prefix).control
    try:
        return PriceHistory(fallback, read_control(platform.kafka, topic, "sluice-replay-prices"))
    except BusError as exc:
        raise ReplayError(f"cannot read the price history on {topic}: {exc}") from exc


ABSENT = frozenset({KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC})
"""The metadata errors that say a topic does not exist (nothing to replay of it)."""


def _extents(consumer: Consumer, topics: list[str]) -> dict[tuple[str, int], tuple[int, int]]:
    """(topic, partition) -> (its first offset still held, the end offset this replay reads up to), of each
    partition that ever held records."""
    extents: dict[tuple[str, int], tuple[int, int]] = {}
    for topic in topics:
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        if meta.error is not None:
            if meta.error.code() in ABSENT:
                continue  # a topic that does not exist has nothing to replay
            # Any other error is not an absence: a topic this principal may not describe (an ACL) was taken
            # for one, and the replay exited 0 with, say, no audit_log at all (a review).
            raise ReplayError(f"cannot read {topic}: {meta.error.str()}")
        for partition in meta.partitions:
            low, high = watermarks(consumer, topic, partition)
            if high > 0:
                extents[(topic, partition)] = (low, high)
    return extents


def _partitions(remaining: dict[tuple[str, int], int]) -> str:
    listed = sorted(f"{topic}[{partition}]" for topic, partition in remaining)
    return ", ".join(listed[:5]) + (f" and {len(listed) - 5} more" if len(listed) > 5 else "")
