"""A restarted edge still counts what it (in its previous life) and dead peers admitted in the last minute,
on the real broker, started as ``ingest.main.serve_edge`` starts it: the gateway first, then the edge."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.app import Edge
from ingest.auth import Tenant, TenantDirectory, hash_key
from ingest.kafka_gateway import KafkaGateway
from ingest.models import ModelCatalogue
from ingest.quota import ALL_MODELS
from schemas.coordination import QuotaSync, QuotaUsage
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames
from tests.ingest.conftest import GEN, Client, settings

KEY = "sk-acme"
CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
CATCH_UP_S = 1.0
"""How long the gateway starts before the edge: what catching up on a day of idempotency claims takes (150k
claims made every start read the quota window back before the edge followed it, a review)."""


@pytest.mark.integration
async def test_a_restarted_edge_still_counts_the_last_minutes_admissions(
    kafka: KafkaConnection, topic_prefix: str, catalogue: ModelCatalogue
) -> None:
    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, [GEN], TopicSizing(replies=2)))
    # The previous life of edge-a admitted the tenant's whole minute (4 requests) 5 s ago, then died.
    previous = KafkaGateway(kafka=kafka, names=names, edge_id="edge-a", reply_partition=0)
    async with previous:
        await previous.publish_quota(
            QuotaSync(
                edge="edge-a.0ld1fe",
                time_ms=int(time.time() * 1000) - 5_000,
                window_s=60,
                usage=(QuotaUsage(tenant="acme", model=ALL_MODELS, requests=4, tokens=40, in_flight=0),),
            )
        )
    tenants = TenantDirectory({"acme": Tenant(key_sha256=[hash_key(KEY)], requests_per_min=4)})
    gateway = KafkaGateway(kafka=kafka, names=names, edge_id="edge-a", reply_partition=0)
    async with gateway:
        await asyncio.sleep(CATCH_UP_S)
        edge = Edge(settings(edge_id="edge-a"), gateway, catalogue, tenants)
        client: Client = TestClient(TestServer(edge.app))
        await client.start_server()
        try:
            response = await client.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={"Authorization": f"Bearer {KEY}", "X-Request-Timeout": "2"},
            )
            used = edge.ctx.admission.ledger.used(("acme", ALL_MODELS))
            assert response.status == 429, f"a fresh minute after the restart; the ledger saw {used}"
            assert used[0] == 4
        finally:
            await edge.stop()
            await client.close()
