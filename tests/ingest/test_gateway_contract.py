"""One contract for every Gateway: the fake the HTTP tests use and the Kafka gateway on the real broker
answer resumes the same way. A stream can be resumed only by the tenant that owns it; a made-up id or
another tenant's id is None (404) at once, never a scan of the log or a hanging stream; an edge that
restarts still knows the streams answered on its partition."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest

from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.gateway import Gateway
from ingest.kafka_gateway import KafkaGateway
from ingest.reply_stream import WHOLE
from schemas.events import CancelRequested, GenerationRequested, RequestFinished, TokenChunk, Usage
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames
from tests.ingest.fake_gateway import FakeGateway

Opened = Callable[[], AbstractAsyncContextManager[Gateway]]


def _request(gateway: Gateway, tenant: str = "acme") -> GenerationRequested:
    return GenerationRequested(
        tenant=tenant,
        model="demo-gpt",
        request_id=uuid7(),
        source="test",
        model_version="v1",
        input_ids=[1, 2, 3],
        reply=gateway.reply_to,
    )


@pytest.fixture(params=["fake", pytest.param("kafka", marks=pytest.mark.integration)])
def opened(request: pytest.FixtureRequest) -> Opened:
    if request.param == "fake":

        @asynccontextmanager
        async def fake() -> AsyncIterator[Gateway]:
            yield FakeGateway()

        return fake
    connection: KafkaConnection = request.getfixturevalue("kafka")
    names = TopicNames(request.getfixturevalue("topic_prefix"))
    apply_topics(make_admin(connection), platform_topics(names, ["demo-gpt"], TopicSizing(replies=1)))

    @asynccontextmanager
    async def kafka() -> AsyncIterator[Gateway]:
        async with KafkaGateway(
            kafka=connection, names=names, edge_id="edge-c", reply_partition=0
        ) as gateway:
            yield gateway

    return kafka


class TestResume:
    async def test_a_made_up_id_is_none_at_once(self, opened: Opened) -> None:
        async with opened() as gateway:
            began = time.monotonic()
            assert await gateway.resume("acme", uuid7(), WHOLE) is None
            assert await gateway.resume("acme", "not-a-uuid", WHOLE) is None
            assert time.monotonic() - began < 1.0  # a lookup, not a scan of the log

    async def test_only_the_owning_tenant_resumes(self, opened: Opened) -> None:
        async with opened() as gateway:
            request = _request(gateway)
            stream = await gateway.submit(request)
            try:
                assert await gateway.resume("intruder", request.request_id, WHOLE) is None
                resumed = await gateway.resume("acme", request.request_id, WHOLE)
                assert resumed is not None
                await resumed.aclose()
            finally:
                await stream.aclose()


@pytest.mark.integration
async def test_a_restarted_kafka_edge_still_resumes_the_streams_it_answered(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, ["demo-gpt"], TopicSizing(replies=1)))
    request_id = uuid7()
    chunk = TokenChunk(
        tenant="acme", model="demo-gpt", request_id=request_id, source="worker", seq=0, offset=0,
        token_ids=[7], text="x",
    )  # fmt: skip
    with EventProducer(kafka, "worker") as producer:  # answered before this edge (re)started
        await producer.publish(names.replies, chunk, partition=0)
    async with KafkaGateway(kafka=kafka, names=names, edge_id="edge-r", reply_partition=0) as gateway:
        assert gateway.owner(request_id) == ("acme", 0)
        assert await gateway.resume("intruder", request_id, WHOLE) is None
        stream = await gateway.resume("acme", request_id, WHOLE)
        assert stream is not None
        first = await asyncio.wait_for(anext(aiter(stream)), 10)
        assert first.request_id == request_id
        await stream.aclose()


class TestWhenFinished:
    async def test_a_listener_hears_the_end_of_a_request_whose_stream_was_closed(
        self, opened: Opened, request: pytest.FixtureRequest
    ) -> None:
        """What settles a cancelled request's reservation to what it used (``Dispatcher.cancel``)."""
        async with opened() as gateway:
            submitted = _request(gateway)
            if isinstance(gateway, FakeGateway):
                gateway.hold_after = 0  # nothing generated until it is cancelled
            stream = await gateway.submit(submitted)
            await stream.aclose()
            heard: list[RequestFinished] = []
            ended = asyncio.Event()

            def hear(finished: RequestFinished) -> None:
                heard.append(finished)
                ended.set()

            gateway.when_finished(submitted.request_id, hear)
            gateway.when_finished(uuid7(), heard.append)  # another request's: never heard here
            if isinstance(gateway, FakeGateway):
                cancel = CancelRequested(
                    tenant="acme", model="demo-gpt", request_id=submitted.request_id, source="test",
                    reason="client_cancel",
                )  # fmt: skip
                await gateway.cancel(cancel)
            else:
                finished = RequestFinished(
                    tenant="acme", model="demo-gpt", request_id=submitted.request_id, source="worker",
                    status="cancelled", finish_reason="cancelled",
                    usage=Usage(prompt_tokens=3, completion_tokens=0, total_tokens=3),
                )  # fmt: skip
                with EventProducer(request.getfixturevalue("kafka"), "worker") as producer:
                    await producer.publish(TopicNames(request.getfixturevalue("topic_prefix")).replies, finished,
                                           partition=gateway.reply_to.partition)  # fmt: skip
            await asyncio.wait_for(ended.wait(), 20)
            (end,) = heard
            assert (end.request_id, end.status, end.usage.total_tokens) == (
                submitted.request_id,
                "cancelled",
                3,
            )
