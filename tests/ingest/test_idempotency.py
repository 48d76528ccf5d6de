"""Idempotency keys shared by every edge and kept across restarts.

The claim table as a plain object (first claim wins, per-tenant bounds, expiry, withdrawal), then two Kafka
gateways (two edges) on the real broker: the same key claimed on both at once has one winner on both,
the loser's edge replays the winner's stream from the winner's partition, a restarted edge still knows
the key, and a withdrawn claim frees it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.gateway import IdempotencyRecord
from ingest.idempotency import ClaimTable
from ingest.kafka_gateway import KafkaGateway
from ingest.reply_stream import WHOLE
from schemas.coordination import IdempotencyClaim, key_digest
from schemas.events import RequestFinished, TokenChunk, Usage
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames


def _claim(tenant: str, key: str, request_id: str, time_ms: int = 1_000) -> IdempotencyClaim:
    return IdempotencyClaim(
        tenant=tenant,
        key_sha256=key_digest(key),
        request_id=request_id,
        body_hash="b",
        edge="e",
        reply_partition=0,
        time_ms=time_ms,
    )


def test_the_first_claim_of_a_key_wins_until_it_expires_or_is_withdrawn() -> None:
    table = ClaimTable(ttl_s=60)
    first, second = _claim("acme", "k", "r1"), _claim("acme", "k", "r2")
    assert table.apply(first) is first
    assert table.apply(second) is first
    assert table.get("acme", key_digest("k"), 2_000) is first
    assert table.get("other", key_digest("k"), 2_000) is None  # keys are per tenant
    assert table.by_request("acme", "r1") is first
    assert table.by_request("intruder", "r1") is None
    assert table.get("acme", key_digest("k"), 62_000) is None  # expired
    late = _claim("acme", "k", "r3", time_ms=62_000)
    assert table.apply(late) is late
    table.withdraw("acme", key_digest("k"))
    assert table.get("acme", key_digest("k"), 62_000) is None
    assert table.by_request("acme", "r3") is None


def test_every_reader_of_the_log_decides_a_key_alike_whenever_it_reads() -> None:
    """Found by a review: a held claim's expiry was judged by the time an edge read the record, so an
    edge started a day later handed the key to a retry that had lost (never published: its retries replayed
    a request that never ran) while the live edges held it free. Claims are judged by their own times."""
    hour = 3600 * 1000
    log = [
        _claim("acme", "k", "winner", time_ms=0),
        _claim("acme", "k", "loser", time_ms=23 * hour),  # a retry within the day: replays the winner
        _claim("acme", "k", "fresh", time_ms=25 * hour),  # after the day: a new request
    ]
    live, later = ClaimTable(ttl_s=24 * 3600), ClaimTable(ttl_s=24 * 3600)
    assert [live.apply(c).request_id for c in log[:2]] == ["winner", "winner"]
    assert [later.apply(c).request_id for c in log[:2]] == ["winner", "winner"]  # read back a day later
    assert later.get("acme", key_digest("k"), 24 * hour + 60_000) is None  # free again, on every edge
    assert live.apply(log[2]).request_id == later.apply(log[2]).request_id == "fresh"


def test_one_tenant_flooding_keys_only_pushes_out_its_own() -> None:
    table = ClaimTable(per_tenant=100)
    quiet = table.apply(_claim("quiet", "k", "q1"))
    for i in range(1_000):
        table.apply(_claim("flood", f"k{i}", f"f{i}"))
    assert table.get("quiet", key_digest("k"), 1_000) is quiet
    assert len(table) == 101
    assert table.get("flood", key_digest("k0"), 1_000) is None
    assert table.get("flood", key_digest("k999"), 1_000) is not None


@pytest.fixture
def names(kafka: KafkaConnection, topic_prefix: str) -> TopicNames:
    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, ["demo-gpt"], TopicSizing(replies=2)))
    return names


def _gateway(kafka: KafkaConnection, names: TopicNames, edge: str, partition: int) -> KafkaGateway:
    return KafkaGateway(kafka=kafka, names=names, edge_id=edge, reply_partition=partition)


@pytest.fixture
async def edges(
    kafka: KafkaConnection, names: TopicNames
) -> AsyncIterator[tuple[KafkaGateway, KafkaGateway]]:
    async with (
        _gateway(kafka, names, "edge-a", 0) as a,
        _gateway(kafka, names, "edge-b", 1) as b,
    ):
        yield a, b


@pytest.mark.integration
async def test_the_same_key_on_two_edges_at_once_has_one_winner_on_both(
    edges: tuple[KafkaGateway, KafkaGateway],
) -> None:
    a, b = edges
    for round_ in range(5):
        key = f"order-{round_}"
        mine_a = IdempotencyRecord(request_id=uuid7(), body_hash="same")
        mine_b = IdempotencyRecord(request_id=uuid7(), body_hash="same")
        won_a, won_b = await asyncio.gather(
            a.remember_idempotent("acme", key, mine_a), b.remember_idempotent("acme", key, mine_b)
        )
        assert won_a == won_b
        assert won_a in (mine_a, mine_b)
        assert await a.lookup_idempotent("acme", key) == won_a
        assert await b.lookup_idempotent("acme", key) == won_a
        assert await b.lookup_idempotent("other-tenant", key) is None


@pytest.mark.integration
async def test_the_other_edge_replays_the_winners_stream_and_a_restarted_edge_knows_the_key(
    kafka: KafkaConnection, names: TopicNames, edges: tuple[KafkaGateway, KafkaGateway]
) -> None:
    a, b = edges
    record = IdempotencyRecord(request_id=uuid7(), body_hash="h")
    assert await a.remember_idempotent("acme", "pay-1", record) == record
    rid = record.request_id
    chunk = TokenChunk(
        tenant="acme",
        model="demo-gpt",
        request_id=rid,
        source="worker",
        seq=0,
        offset=0,
        token_ids=[7],
        text="x",
    )
    finished = RequestFinished(
        tenant="acme", model="demo-gpt", request_id=rid, source="worker", status="completed",
        finish_reason="stop", usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )  # fmt: skip
    with EventProducer(kafka, "worker") as producer:  # answered on edge a's partition
        await producer.publish(names.replies, chunk, partition=0)
        await producer.publish(names.replies, finished, partition=0)
    for _ in range(100):  # b reads a's claim on a consumer of its own
        if await b.lookup_idempotent("acme", "pay-1") == record:
            break
        await asyncio.sleep(0.05)
    assert await b.lookup_idempotent("acme", "pay-1") == record
    assert await b.resume("intruder", rid, WHOLE) is None
    stream = await b.resume("acme", rid, WHOLE)
    assert stream is not None
    items = [item async for item in stream]
    assert [type(i).__name__ for i in items] == ["TokenChunk", "RequestFinished"]
    async with _gateway(kafka, names, "edge-c", 1) as restarted:
        assert await restarted.lookup_idempotent("acme", "pay-1") == record


@pytest.mark.integration
async def test_a_claim_withdrawn_after_a_failed_publish_frees_the_key_on_every_edge(
    edges: tuple[KafkaGateway, KafkaGateway],
) -> None:
    a, b = edges
    first = IdempotencyRecord(request_id=uuid7(), body_hash="h")
    assert await a.remember_idempotent("acme", "k", first) == first
    await a.forget_idempotent("acme", "k", first)
    second = IdempotencyRecord(request_id=uuid7(), body_hash="h")
    for _ in range(100):  # b reads the tombstone
        if await b.lookup_idempotent("acme", "k") is None:
            break
        await asyncio.sleep(0.05)
    assert await b.remember_idempotent("acme", "k", second) == second
    for _ in range(100):  # and a reads b's claim after its own tombstone
        if await a.lookup_idempotent("acme", "k") == second:
            break
        await asyncio.sleep(0.05)
    assert await a.lookup_idempotent("acme", "k") == second
