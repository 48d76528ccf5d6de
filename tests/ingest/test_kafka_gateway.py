"""The Kafka gateway's lifecycle on the real broker: a reply listener that dies fails the streams waiting
on it at once (not at their deadlines), new submits are refused, and a start that fails part-way stops
what it had started."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from confluent_kafka import Message, Producer

from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.errors import GatewayUnavailable
from ingest.kafka_gateway import KafkaGateway
from ingest.reply_stream import WHOLE
from schemas.codec import encode
from schemas.events import GenerationRequested
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames

pytestmark = pytest.mark.integration


@pytest.fixture
def gateway(kafka: KafkaConnection, topic_prefix: str) -> KafkaGateway:
    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, ["demo-gpt"], TopicSizing(replies=1)))
    return KafkaGateway(kafka=kafka, names=names, edge_id="edge-t", reply_partition=0)


def _request(gateway: KafkaGateway) -> GenerationRequested:
    return GenerationRequested(
        tenant="acme",
        model="demo-gpt",
        request_id=uuid7(),
        source="test",
        model_version="v1",
        input_ids=[1, 2, 3],
        reply=gateway.reply_to,
    )


async def test_a_dead_reply_listener_fails_open_streams_and_new_submits(
    gateway: KafkaGateway, kafka: KafkaConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: KafkaGateway, batch: list[Message]) -> None:
        raise RuntimeError("listener bug")

    monkeypatch.setattr(KafkaGateway, "_on_replies", broken)
    async with gateway:
        stream = await gateway.submit(_request(gateway))

        async def first() -> object:
            async for reply in stream:
                return reply
            return None

        reader = asyncio.create_task(first())
        await asyncio.sleep(0.2)
        assert not reader.done()  # waiting for replies
        producer = Producer(kafka.client_config())
        producer.produce(gateway.reply_to.topic, b"anything", partition=0)  # the listener's first batch
        producer.flush(10)
        with pytest.raises(GatewayUnavailable, match="stopped receiving replies"):
            await asyncio.wait_for(reader, 30)  # far sooner than any deadline
        assert not gateway.ready()
        with pytest.raises(GatewayUnavailable):
            await gateway.submit(_request(gateway))


async def test_a_request_the_log_refuses_is_gateway_unavailable_and_leaves_nothing_to_resume(
    gateway: KafkaGateway,
) -> None:
    """The contract: submit raises GatewayUnavailable when it cannot publish (so the edge answers 503 and
    withdraws an idempotency claim). A record the producer refused (here: over the record limit, which
    librdkafka checks itself) came out as a bare BusError, a 500 that left the claim behind."""
    async with gateway:
        event = msgspec.structs.replace(_request(gateway), input_ids=[123_456] * 1_300_000)  # ~9.1 MB
        with pytest.raises(GatewayUnavailable, match="could not be published"):
            await gateway.submit(event)
        assert gateway.owner(event.request_id) is None, "never published: not resumable from this edge"
        assert await gateway.resume("acme", event.request_id, WHOLE) is None
        stream = await gateway.submit(_request(gateway))  # the gateway itself is fine
        await stream.aclose()


async def test_a_start_that_fails_part_way_stops_what_it_started(
    gateway: KafkaGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.kafka_gateway

    def no_control(*_args: object) -> object:
        raise OSError("control topic unreachable")

    monkeypatch.setattr(ingest.kafka_gateway, "control_start", no_control)
    with pytest.raises(OSError, match="unreachable"):
        await gateway.start()
    assert gateway._listener is None  # the reply listener it had started was stopped
    assert not gateway.ready()


async def test_a_dead_control_listener_fails_the_gateway_so_budgets_never_go_stale(
    gateway: KafkaGateway, kafka: KafkaConnection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Budgets and deployments come from the control topic: once nobody follows it, the edge must not
    keep admitting on what it last knew. Open streams fail, submits are refused, readiness is false."""

    def broken(self: KafkaGateway, batch: list[Message]) -> None:
        raise RuntimeError("control bug")

    monkeypatch.setattr(KafkaGateway, "_on_control", broken)
    async with gateway:
        assert gateway.ready()
        stream = await gateway.submit(_request(gateway))
        producer = Producer(kafka.client_config())
        producer.produce(gateway._names.control, b"anything", key=b"budget:acme")
        producer.flush(10)

        async def first() -> object:
            async for reply in stream:
                return reply
            return None

        with pytest.raises(GatewayUnavailable):
            await asyncio.wait_for(first(), 30)
        assert isinstance(gateway.failure, RuntimeError)
        assert not gateway.ready()
        with pytest.raises(GatewayUnavailable, match="control bug"):
            await gateway.submit(_request(gateway))


@pytest.mark.parametrize(
    "last", [b'{"type":"a_type_from_a_newer_release"}', None], ids=["newer", "tombstone"]
)
async def test_a_control_topic_ending_in_a_record_the_edge_cannot_decode_is_still_read_to_its_end(
    gateway: KafkaGateway, kafka: KafkaConnection, last: bytes | None
) -> None:
    """Found by a review (2026-12-01): the catch-up bookkeeping came after the decode, so a control topic
    whose last record the edge could not decode (an event type of a newer release, as the streams worker's
    first ``PricesChanged`` was to an edge of the release before, or a tombstone) kept the edge unready
    until the next control record, however long that took."""
    from schemas.events import BudgetStateChanged

    producer = Producer(kafka.client_config())
    budget = BudgetStateChanged(
        tenant="acme", model="", source="test", limit_micros=1, spent_micros=2, exhausted=True
    )
    producer.produce(gateway._names.control, encode(budget), key=b"budget:acme")
    producer.produce(gateway._names.control, last, key=b"future:x")
    producer.flush(10)
    del producer
    gateway.CONTROL_CATCH_UP_S = 10.0
    async with gateway:
        assert gateway._control_seen.is_set()
        assert gateway.ready()
        assert gateway.budget_exhausted("acme")  # what came before it was followed


async def test_control_and_claims_ending_in_a_transactions_marker_are_read_to_their_ends(
    gateway: KafkaGateway, kafka: KafkaConnection
) -> None:
    """Found by a review: an edge knew it had read the control and idempotency topics to their ends by a
    record at ``end - 1``; a transaction's marker there (a topic a transactional tool wrote, MirrorMaker 2
    say) is never handed over, so the edge waited out its catch-up (30 s) and then stayed unready until the
    next control record, however long that took. The position past the marker tells it now."""
    import time

    from schemas.events import BudgetStateChanged

    budget = BudgetStateChanged(
        tenant="acme", model="", source="test", limit_micros=1, spent_micros=2, exhausted=True
    )
    producer = Producer({**kafka.client_config(), "transactional.id": f"{gateway._names.control}-tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(gateway._names.control, encode(budget), key=b"budget:acme")
    producer.produce(gateway._names.idempotency, b"not a claim", key=b"acme\x00k", partition=0)
    producer.commit_transaction(30)
    await asyncio.sleep(1.0)  # the markers are written after the commit returns
    gateway.CONTROL_CATCH_UP_S = 20.0
    began = time.monotonic()
    async with gateway:
        took = time.monotonic() - began
        assert gateway._control_seen.is_set()
        assert gateway._claims_caught_up.is_set()
        assert gateway.ready()
        assert took < 10, f"the start waited {took:.1f}s for a record past the marker"
        assert gateway.budget_exhausted("acme")  # what came before it was followed


class _Record:
    """What the gateway's listeners read of a record."""

    def __init__(self, value: bytes | None, offset: int = 0) -> None:
        self._value, self._offset = value, offset

    def value(self) -> bytes | None:
        return self._value

    def offset(self) -> int:
        return self._offset

    def partition(self) -> int:
        return 0

    def key(self) -> bytes | None:
        return b"k"


@pytest.mark.parametrize(
    "value",
    [b'{"tenant": "ac\xffme"}', b'{"x": ' + b"[" * 100_000 + b"}"],
    ids=["a string that is not UTF-8", "nested too deep"],
)
def test_the_quota_and_claims_listeners_skip_what_msgspec_cannot_read(value: bytes) -> None:
    """Found by a review: these raise ``UnicodeDecodeError`` and ``RecursionError`` (not msgspec's
    ``DecodeError``), which stopped the listener's thread: one such record on the quota or idempotency
    topic and the edge stopped reading it. (The listeners alone: no loop to hand anything to.)"""
    gateway = KafkaGateway.__new__(KafkaGateway)
    gateway._quota_apply, gateway._loop = None, None
    records = [_Record(value, 7)]
    gateway._on_quota(records)  # type: ignore[arg-type]  # logged and skipped: no exception
    gateway._on_claims(records)  # type: ignore[arg-type]


class _Reply:
    """A record of the edge's reply partition, as ``_index_recent`` reads it."""

    def __init__(self, offset: int, subject: bytes | None) -> None:
        self._offset, self._subject = offset, subject

    def headers(self) -> list[tuple[str, bytes]]:
        if self._subject is None:  # what confluent-kafka does with a header key that is not UTF-8
            raise SystemError("<method 'headers'> returned a result with an exception set")
        return [("ce_subject", self._subject), ("ce_tenant", b"acme")]

    def offset(self) -> int:
        return self._offset


def test_an_edge_indexing_its_replies_skips_records_it_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by a review: a record on the edge's reply partition whose subject (or a header key) is not
    UTF-8 raised out of the index read at start: the edge could not start while it was in the resume
    window (an hour). It is not this platform's record: skipped, and the ones around it indexed."""
    import ingest.kafka_gateway

    class Consumer:
        def __init__(self, config: object) -> None:
            pass

        def close(self) -> None:
            pass

    records = [_Reply(0, b"req-1"), _Reply(1, b"req-\xff"), _Reply(2, None), _Reply(3, b"req-4")]
    monkeypatch.setattr(ingest.kafka_gateway, "Consumer", Consumer)
    monkeypatch.setattr(ingest.kafka_gateway, "read_to_end", lambda consumer, tps, ends: iter(records))
    gateway = KafkaGateway(
        kafka=KafkaConnection(bootstrap="127.0.0.1:1"), names=TopicNames("p"), edge_id="e", reply_partition=0
    )
    monkeypatch.setattr(gateway, "_offset_at", lambda unix_ms, partition=None: 0)
    gateway._index_recent(4)
    assert gateway.owner("req-1") == ("acme", 0)
    assert gateway.owner("req-4") == ("acme", 3)


async def test_the_deployments_read_at_start_are_logged_once_each_then_every_change(
    gateway: KafkaGateway, kafka: KafkaConnection, caplog: pytest.LogCaptureFixture
) -> None:
    """An operator audit: an edge logged every deployment the control topic still held at start, a line
    per rollout ever (20 at its third start). It logs where the history ends, then each change."""
    import logging

    from schemas.codec import encode, kafka_key
    from schemas.events import DeploymentChanged

    def deployed(share: float) -> DeploymentChanged:
        traffic = {"v1": 1.0 - share, "v2": share}
        return DeploymentChanged(
            tenant="", model="demo-gpt", source="test", version="v2", action="deploy", traffic=traffic,
            reason="", stable="v1", candidate="v2", phase="canary", steps=[share, 1.0],
        )  # fmt: skip

    producer = Producer(kafka.client_config())
    for share in (0.1, 0.2, 0.3, 0.4):
        event = deployed(share)
        producer.produce(gateway._names.control, encode(event), kafka_key(event))
    assert producer.flush(10) == 0
    with caplog.at_level(logging.INFO, logger="ingest.kafka_gateway"):
        async with gateway:

            def said() -> list[str]:
                return [r.getMessage() for r in caplog.records if "deployment of demo-gpt" in r.getMessage()]

            for _ in range(500):
                if said():
                    break
                await asyncio.sleep(0.02)
            assert gateway.ready()
            (start,) = said()
            assert "share=0.4" in start
            event = deployed(0.5)
            producer.produce(gateway._names.control, encode(event), kafka_key(event))
            assert producer.flush(10) == 0
            for _ in range(500):
                if len(said()) == 2:
                    break
                await asyncio.sleep(0.02)
            assert len(said()) == 2
            assert "share=0.5" in said()[1]


async def test_an_edge_refused_its_reply_partition_is_not_ready(
    kafka: KafkaConnection, topic_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: with its ACL on the replies topic removed, every fetch of the reply listener came
    back ``TOPIC_AUTHORIZATION_FAILED``, an error librdkafka goes on from: the edge logged each one and
    stayed ready, admitting requests no reply could reach. A real client here, its fetches refused as
    librdkafka hands refusals over (one error message each)."""
    from typing import Any

    from confluent_kafka import Consumer, KafkaError

    import bus.consumer

    class Refused:
        def error(self) -> KafkaError:
            return KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED, "Broker: Topic authorization failed")

        def topic(self) -> str:
            return names.replies

    class RefusedFetches:
        def __init__(self, real: Any) -> None:
            self._real = real

        def __getattr__(self, name: str) -> Any:
            return getattr(self._real, name)

        def poll(self, timeout: float = -1) -> Any:
            self._real.consume(100, 0.1)  # its callbacks and statistics served; no record comes
            return Refused()

        def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
            return [self.poll(timeout)]

    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, ["demo-gpt"], TopicSizing(replies=1)))
    real = Consumer

    def made(config: dict[str, Any]) -> Any:
        client = real(config)
        return RefusedFetches(client) if "-replies" in str(config.get("client.id")) else client

    monkeypatch.setattr(bus.consumer, "Consumer", made)
    monkeypatch.setattr(KafkaGateway, "BROKERS_DOWN_S", 2.0)
    gateway = KafkaGateway(
        kafka=kafka, names=names, edge_id="edge-u", reply_partition=0, replies_on_loop=False
    )
    async with gateway:
        deadline = asyncio.get_running_loop().time() + 30
        while gateway.ready():
            assert asyncio.get_running_loop().time() < deadline, (
                f"refused fetch after fetch, and still ready: {gateway._listener.unreadable_for()}"  # type: ignore[union-attr]
            )
            await asyncio.sleep(0.2)
        span, why = gateway._listener.unreadable_for() if gateway._listener is not None else (0.0, "")
        assert span >= 2.0
        assert "authorization" in why.lower()
