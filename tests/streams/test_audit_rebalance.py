"""Two streams workers in one consumer group (two replicas of a rolling update), on a real broker and chDB:
the one that gains the ``results`` partition goes on from the chains' heads on the audit topic, not from
the heads it read at its start, so the chains do not fork and ``sluice audit verify`` passes."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from clickhouse_connect.driver.client import Client

from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from infra.warehouse import migrate, open_warehouse
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from streams.anchor import TopicChain, audit_extent, audit_records, read_chains, verify_anchored
from streams.app import StreamsApp, sink_topics
from streams.pricing import PriceTable
from streams.settings import StreamsSettings
from tests.streams.test_audit import finished

pytestmark = pytest.mark.integration
MODEL = "demo-gpt"
TENANTS = ("acme", "globex", "initech", "umbrella")


PRICES = "admin:prices:demo-2026-11"
"""The chain of the price table each worker's start publishes unless the log holds it."""


def topic_chains(settings: PlatformSettings) -> tuple[dict[str, TopicChain], int]:
    """Every chain on the audit topic now (hashes checked), and how many entries it holds."""
    extent = audit_extent(settings.kafka, TopicNames(settings.topic_prefix).audit, "test-rebalance")
    return read_chains(
        audit_records(settings.kafka, extent, "test-rebalance", timeout_s=30), check_hashes=True
    )


async def until(check: Callable[[], bool], what: str, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while not await asyncio.to_thread(check):
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {within:.0f}s")
        await asyncio.sleep(0.1)


@contextlib.contextmanager
def writer(settings: PlatformSettings) -> Iterator[Client]:
    """A client of this process's chDB engine (each worker has its own, as in its own process)."""
    with contextlib.closing(open_warehouse(settings)) as client:
        yield client


@contextlib.asynccontextmanager
async def worker(settings: PlatformSettings, name: str) -> AsyncIterator[StreamsApp]:
    """A streams worker of the group ``<prefix>-streams``, started; stopped on leaving (if still running)."""
    with writer(settings) as client, EventProducer(settings.kafka, f"streams-{name}") as producer:
        app = StreamsApp(
            settings,
            StreamsSettings(streams_batch_ms=50),
            client,
            PriceTable(),
            producer,
            request_topics=[TopicNames(settings.topic_prefix).requests(MODEL)],
        )
        await app.start()
        try:
            yield app
        finally:
            await app.stop()


def owned(app: StreamsApp) -> set[tuple[str, int]]:
    sink = app._sink
    return sink.assignment() if sink is not None else set()


@pytest.mark.timeout(150)
async def test_a_worker_that_gains_the_results_partition_goes_on_from_the_topics_heads(
    kafka: KafkaConnection, platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    names = TopicNames(f"fork-{uuid.uuid4().hex[:8]}")
    admin = make_admin(kafka)
    apply_topics(admin, platform_topics(names, [MODEL], TopicSizing(requests=1, replies=1, events=1)))
    settings = msgspec.structs.replace(
        platform_settings,
        kafka_bootstrap=kafka.bootstrap,
        topic_prefix=names.prefix,
        data_dir=str(tmp_path),
        models=(MODEL,),
    )
    metadata = admin.list_topics(timeout=10).topics
    every = {
        (topic, partition)
        for topic in sink_topics(names, [names.requests(MODEL)], decisions=False)
        for partition in metadata[topic].partitions
    }
    results = (names.results, 0)

    def split(one: set[tuple[str, int]], two: set[tuple[str, int]]) -> bool:
        """The rebalance is over: every partition owned again, each by one of the two workers."""
        return bool(one) and bool(two) and not one & two and one | two == every

    with writer(settings) as client:
        migrate(client)

    made = 0
    feeder = EventProducer(kafka, "test-results")
    feeder.start()

    async def finish(count: int) -> None:
        """``count`` more terminal requests per tenant, and their entries on the audit topic."""
        nonlocal made
        for n in range(made, made + count):
            for tenant in TENANTS:
                event = finished(tenant=tenant, request_id=f"req-{tenant}-{n}", text=None, embeddings=None)
                await feeder.publish(names.results, event)
        made += count
        await until(lambda: topic_chains(settings)[1] >= made * len(TENANTS) + 1, f"{made} entries a tenant")

    try:
        async with worker(settings, "a") as first:
            await until(lambda: results in owned(first), "results partition for the first worker")
            await finish(3)
            async with worker(settings, "b") as second:
                await until(lambda: split(owned(first), owned(second)), "partitions shared by the two")
                holder, other = (first, second) if results in owned(first) else (second, first)
                await finish(3)  # chained by the holder: the other worker's heads are behind now
                await holder.stop()  # a rolling update retires it: the other gains the partition
                await until(lambda: owned(other) == every, "hand-over to the remaining worker")
                await finish(3)
                assert first.failure is None
                assert second.failure is None
    finally:
        feeder.stop()

    chains, entries = topic_chains(settings)
    # and the price table the first worker published at start (the second found it on the log)
    assert entries == made * len(TENANTS) + 1
    assert {name: chain.problem for name, chain in chains.items()} == dict.fromkeys([*TENANTS, PRICES])
    assert {
        name: (chain.first, chain.head.seq if chain.head else None) for name, chain in chains.items()
    } == (dict.fromkeys(TENANTS, (0, made - 1)) | {PRICES: (0, 0)})
    report = await asyncio.to_thread(verify_anchored, settings)
    assert report.problems == []
    assert report.warehouse.entries == made * len(TENANTS) + 1
