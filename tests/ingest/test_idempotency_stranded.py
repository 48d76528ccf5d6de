"""A key whose claiming edge died between its claim and its request (a stranded claim), on the real broker:
a retry past ``STRANDED_AFTER_S`` runs the request anew; an old claim whose request is on the log is never
superseded (it runs once)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from confluent_kafka import Consumer, Producer, TopicPartition

from bus.consumer import consumer_config
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.app import Edge
from ingest.auth import Tenant, TenantDirectory, hash_key
from ingest.kafka_gateway import KafkaGateway
from ingest.models import ModelCatalogue
from schemas.codec import decode, encode
from schemas.coordination import IdempotencyClaim, claim_key, encode_coordination, key_digest
from schemas.events import GenerationRequested, RequestFinished, TokenChunk, Usage
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames
from tests.ingest.conftest import GEN, Client, settings

pytestmark = pytest.mark.integration
KEY = "sk-acme"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": GEN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


class Worker:
    """Reads the model's requests (all of them, duplicates too) and answers each once ``release`` is set."""

    def __init__(self, kafka: KafkaConnection, names: TopicNames) -> None:
        self.kafka, self.names = kafka, names
        self.seen: list[str] = []
        self.release = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Worker:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        topic = self.names.requests(GEN)
        consumer = Consumer(consumer_config(self.kafka, None, "stranded-worker"))
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, 0) for p in parts])
        producer = Producer(self.kafka.client_config())
        pending: list[GenerationRequested] = []
        try:
            while not self._stop.is_set():
                for message in consumer.consume(100, 0.05):
                    event = decode(message.value() or b"") if message.error() is None else None
                    if isinstance(event, GenerationRequested):
                        self.seen.append(event.request_id)
                        pending.append(event)
                if self.release.is_set():
                    for event in pending:
                        self._answer(producer, event)
                    pending = []
                    producer.flush(10)
        finally:
            consumer.close()

    @staticmethod
    def _answer(producer: Producer, event: GenerationRequested) -> None:
        assert event.reply is not None
        common: dict[str, Any] = dict(
            tenant=event.tenant, model=event.model, request_id=event.request_id, source="worker"
        )
        usage = Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2)
        for reply in (
            TokenChunk(**common, seq=0, offset=0, token_ids=[5], text="x", finish_reason="stop"),
            RequestFinished(**common, status="completed", finish_reason="stop", usage=usage, text="x"),
        ):
            producer.produce(event.reply.topic, encode(reply), partition=event.reply.partition)


@pytest.fixture
def names(kafka: KafkaConnection, topic_prefix: str) -> TopicNames:
    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, [GEN], TopicSizing(replies=2)))
    return names


async def _edge(
    kafka: KafkaConnection, names: TopicNames, catalogue: ModelCatalogue, index: int, **gateway: Any
) -> AsyncIterator[tuple[Client, KafkaGateway]]:
    tenants = TenantDirectory({"acme": Tenant(key_sha256=[hash_key(KEY)])})
    async with KafkaGateway(
        kafka=kafka, names=names, edge_id=f"edge-{index}", reply_partition=index, **gateway
    ) as made:
        edge = Edge(settings(edge_id=f"edge-{index}"), made, catalogue, tenants)
        client: Client = TestClient(TestServer(edge.app))
        await client.start_server()
        try:
            yield client, made
        finally:
            await edge.stop()
            await client.close()


async def _post(client: Client, key: str, timeout_s: int = 15) -> tuple[int, dict[str, Any]]:
    headers = {**AUTH, "Idempotency-Key": key, "X-Request-Timeout": str(timeout_s)}
    response = await client.post("/v1/chat/completions", json=BODY, headers=headers)
    return response.status, await response.json()


async def test_a_retry_of_a_key_whose_edge_died_before_publishing_runs_once_the_claim_is_stranded(
    kafka: KafkaConnection, names: TopicNames, catalogue: ModelCatalogue
) -> None:
    """Found by a review: every retry of such a key waited out its deadline (504) for the claim's 24 h."""
    with Worker(kafka, names) as worker:
        worker.release.set()
        async for client, gateway in _edge(kafka, names, catalogue, 1):
            status, _ = await _post(client, "probe")  # the body's hash, as the dead edge's claim has it
            assert status == 200
            probe = await gateway.lookup_idempotent("acme", "probe")
            assert probe is not None
            # What an edge killed a minute ago left: its claim won, and its request never reached the log.
            dead = IdempotencyClaim(
                tenant="acme",
                key_sha256=key_digest("order-7"),
                request_id=uuid7(),
                body_hash=probe.body_hash,
                edge="edge-0",
                reply_partition=0,
                time_ms=int(time.time() * 1000) - 61_000,
            )
            producer = Producer(kafka.client_config())
            producer.produce(names.idempotency, encode_coordination(dead), key=claim_key("acme", "order-7"))
            producer.flush(10)
            for _ in range(100):
                if await gateway.lookup_idempotent("acme", "order-7") is not None:
                    break
                await asyncio.sleep(0.05)
            status, body = await _post(client, "order-7")
            assert status == 200, body
            assert body["id"] != f"chatcmpl-{dead.request_id}"
            again, replayed = await _post(client, "order-7")  # the key now names the request that ran
            assert (again, replayed["id"]) == (200, body["id"])
            assert len(worker.seen) == 2  # the probe and the retry: nothing ran twice


async def test_an_old_claim_whose_request_is_on_the_log_is_replayed_never_superseded(
    kafka: KafkaConnection, names: TopicNames, catalogue: ModelCatalogue
) -> None:
    """Queued longer than the claims' bound (here 1 s) with no reply yet: the retry finds the request on the
    log, waits for it, and gets its answer; the worker runs it once."""
    with Worker(kafka, names) as worker:  # holds every request until released
        async for first, _ in _edge(kafka, names, catalogue, 0, stranded_after_s=1.0):
            async for second, _ in _edge(kafka, names, catalogue, 1, stranded_after_s=1.0):
                original = asyncio.create_task(_post(first, "order-8", timeout_s=30))
                for _ in range(100):
                    if worker.seen:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.2)  # the claim is past its bound, its request still queued
                retry = asyncio.create_task(_post(second, "order-8", timeout_s=30))
                await asyncio.sleep(3.5)  # the replay gave nothing for 2 s; the log was read
                worker.release.set()
                (status, body), (again, replayed) = await asyncio.gather(original, retry)
                assert (status, again) == (200, 200), (body, replayed)
                assert replayed["id"] == body["id"]
                assert len(worker.seen) == 1
