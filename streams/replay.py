"""``sluice replay``: rebuild the warehouse from the log, from offset 0, into an empty warehouse.

It reads every sink topic's partitions from their first offset up to their end at the moment it starts
(no consumer group: it commits nothing and disturbs no one), and writes through the same
:class:`streams.sink.Rows` the live worker uses, so the derived tables come out identical.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from bus.consumer import consumer_config
from bus.positions import watermarks
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams import StreamsError
from streams.app import sink_topics
from streams.pricing import PriceTable
from streams.sink import Consumed, Inserter, Rows, insert

TABLES = (
    "events_raw", "request_facts", "audit_log", "drift_features", "drift_reports", "deployments", "batches",
)  # fmt: skip


class ReplayError(StreamsError, RuntimeError):
    """The target warehouse is not empty, or the log could not be read to its end."""


@dataclass(frozen=True)
class ReplayReport:
    events: int
    undecodable: int
    partitions: int
    seconds: float


def replay(
    platform: PlatformSettings,
    writer: Inserter,
    prices: PriceTable,
    request_topics: list[str],
    *,
    store_content: bool = False,
    batch_size: int = 5000,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 600.0,
) -> ReplayReport:
    """Read the sink topics from the start to their current end into ``writer``; ``progress(done, total)``."""
    began = time.monotonic()
    names = TopicNames(platform.topic_prefix)
    consumer = Consumer(consumer_config(platform.kafka, None, "sluice-replay"))
    rows = Rows(prices, store_content=store_content, decisions_from_topic=True)
    try:
        ends: dict[tuple[str, int], int] = {}
        for topic in sink_topics(names, request_topics):
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            if meta.error is not None:
                continue  # a topic that does not exist has nothing to replay
            for partition in meta.partitions:
                low, high = watermarks(consumer, topic, partition)
                if high > low:
                    ends[(topic, partition)] = high
        total = sum(ends.values())
        consumer.assign([TopicPartition(t, p, 0) for t, p in ends])
        remaining = dict(ends)
        done = undecodable = 0
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise ReplayError(f"replay did not reach the end of {sorted(remaining)} in {timeout_s:.0f}s")
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
                if offset + 1 >= end:
                    del remaining[key]
            if records:
                batch = rows.batch(records)
                insert(writer, batch)
                done += len(records)
                undecodable += len(batch.undecodable)
                if progress is not None:
                    progress(done, total)
        return ReplayReport(done, undecodable, len(ends), time.monotonic() - began)
    finally:
        consumer.close()
