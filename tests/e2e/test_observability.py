"""Issue 5 done-when on the real broker: one streamed request's whole span tree across the Kafka hops, and
the metrics a real scrape shows after real traffic."""

from __future__ import annotations

import asyncio
import itertools
import json

import aiohttp
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from gpu_workers.models import MINILM_ID
from gpu_workers.service import WorkerService
from ingest.auth import DEMO_KEY
from monitoring import metrics
from schemas.events import RequestFinished, TokenChunk
from tests.e2e.conftest import GPT, Platform

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
CHAT = {"model": GPT, "messages": [{"role": "user", "content": "Tell me about the river."}]}


async def _stream_chat(platform: Platform, **extra: object) -> tuple[str, int]:
    """Stream one chat completion; its request id and the tokens the client got."""
    body = {**CHAT, "stream": True, "max_tokens": 20, "temperature": 0, "ignore_eos": True, **extra}
    request_id, tokens = "", 0
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{platform.base_url}/chat/completions", headers=AUTH, json=body)
        assert response.status == 200
        request_id = response.headers["x-request-id"]
        async for line in response.content:
            if line.startswith(b"data: {"):
                tokens += 1 if json.loads(line[6:])["choices"] else 0
    return request_id, tokens


def _tree(spans: list[ReadableSpan], trace_id: int) -> dict[str, ReadableSpan]:
    mine = [s for s in spans if s.context is not None and s.context.trace_id == trace_id]
    names = [s.name for s in mine]
    assert len(names) == len(set(names)), f"a span name repeats in one request's trace: {sorted(names)}"
    return {s.name: s for s in mine}


def _parent_of(child: ReadableSpan, parent: ReadableSpan) -> bool:
    return (
        child.parent is not None
        and parent.context is not None
        and child.parent.span_id == parent.context.span_id
    )


async def test_one_streamed_request_is_one_trace_across_edge_kafka_worker_kafka_edge(
    platform: Platform, workers: list[WorkerService], span_exporter: InMemorySpanExporter
) -> None:
    span_exporter.clear()
    request_id, _ = await _stream_chat(platform)
    names = platform.names
    requests_topic, replies_topic = names.requests(GPT), names.replies

    def server() -> ReadableSpan | None:
        for span in span_exporter.get_finished_spans():
            attributes = span.attributes or {}
            if span.name == "POST /v1/chat/completions" and attributes.get("sluice.request.id") == request_id:
                return span
        return None

    expected = {
        "POST /v1/chat/completions",
        "sluice.admit",
        f"publish {requests_topic}",
        f"process {requests_topic}",
        "sluice.queue_wait",
        "sluice.batch_formation",
        "sluice.prefill",
        "sluice.decode",
        f"publish {replies_topic}",
        f"receive {replies_topic}",
        "sluice.respond",
    }

    def complete() -> bool:
        root = server()
        return (
            root is not None
            and root.context is not None
            and expected <= set(_tree(list(span_exporter.get_finished_spans()), root.context.trace_id))
        )

    await platform.results.wait(complete, within=30)
    root = server()
    assert root is not None
    assert root.context is not None
    tree = _tree(list(span_exporter.get_finished_spans()), root.context.trace_id)
    assert set(tree) == expected
    assert root.parent is None
    assert root.kind == SpanKind.SERVER

    parents = {
        "sluice.admit": "POST /v1/chat/completions",
        f"publish {requests_topic}": "POST /v1/chat/completions",
        "sluice.respond": "POST /v1/chat/completions",
        f"process {requests_topic}": f"publish {requests_topic}",
        "sluice.queue_wait": f"process {requests_topic}",
        "sluice.batch_formation": f"process {requests_topic}",
        "sluice.prefill": f"process {requests_topic}",
        "sluice.decode": f"process {requests_topic}",
        f"publish {replies_topic}": f"process {requests_topic}",
        f"receive {replies_topic}": f"publish {replies_topic}",
    }
    for child, parent in parents.items():
        assert _parent_of(tree[child], tree[parent]), f"{child} is not a child of {parent}"
    kinds = {
        f"publish {requests_topic}": SpanKind.PRODUCER,
        f"process {requests_topic}": SpanKind.CONSUMER,
        f"publish {replies_topic}": SpanKind.PRODUCER,
        f"receive {replies_topic}": SpanKind.CONSUMER,
    }
    for name, kind in kinds.items():
        assert tree[name].kind == kind, name

    # GenAI semantic conventions, plus tenant and model version. The client saw the reply topic's copy;
    # the results topic's copy may still be on its way to the test's reader.
    def finished() -> list[RequestFinished]:
        return [e for e in platform.results.of(request_id) if isinstance(e, RequestFinished)]

    await platform.results.wait(lambda: bool(finished()), within=30)
    (result,) = finished()
    root_attributes = dict(root.attributes or {})
    assert root_attributes["gen_ai.request.model"] == GPT
    assert root_attributes["gen_ai.operation.name"] == "chat"
    assert root_attributes["gen_ai.usage.input_tokens"] == result.usage.prompt_tokens
    assert root_attributes["gen_ai.usage.output_tokens"] == result.usage.completion_tokens == 20
    assert root_attributes["sluice.tenant"] == "demo"
    assert root_attributes["sluice.model.version"]
    process = dict(tree[f"process {requests_topic}"].attributes or {})
    assert process["messaging.system"] == "kafka"
    assert process["messaging.destination.name"] == requests_topic
    assert process["gen_ai.usage.output_tokens"] == 20
    assert process["sluice.model.version"] == root_attributes["sluice.model.version"]
    decode = dict(tree["sluice.decode"].attributes or {})
    assert decode["gen_ai.usage.output_tokens"] == 20
    assert int(str(decode["sluice.chunks"])) >= 2
    batch = dict(tree["sluice.batch_formation"].attributes or {})
    assert int(str(batch["sluice.batch.size"])) >= 1

    # The phases lie inside the worker's span, in order.
    proc = tree[f"process {requests_topic}"]
    phases = [
        tree[n] for n in ("sluice.queue_wait", "sluice.batch_formation", "sluice.prefill", "sluice.decode")
    ]
    assert proc.start_time is not None
    for earlier, later in itertools.pairwise(phases):
        assert earlier.end_time is not None
        assert later.start_time is not None
        assert earlier.end_time <= later.start_time + 1_000_000  # 1 ms: wall-clock stamps of two threads
    assert all(p.start_time is not None and p.start_time >= proc.start_time for p in phases)

    # The trace context travelled in the events (and so in the Kafka headers the codec writes).
    # This test's own reader of the replies topic may be a moment behind the edge's.
    await platform.replies.wait(
        lambda: any(isinstance(e, RequestFinished) for e in platform.replies.of(request_id))
    )
    replies = platform.replies.of(request_id)
    assert all(e.traceparent is not None for e in replies)
    terminal = replies[-1]
    assert isinstance(terminal, RequestFinished)
    assert terminal.traceparent is not None
    publish = tree[f"publish {replies_topic}"].context
    assert publish is not None
    assert terminal.traceparent.split("-")[1] == f"{root.context.trace_id:032x}"
    assert terminal.traceparent.split("-")[2] == f"{publish.span_id:016x}"
    assert any(isinstance(e, TokenChunk) for e in replies)


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return out


def _value(samples: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    return sum(v for got, v in samples.get(name, []) if all(got.get(k) == x for k, x in labels.items()))


async def test_metrics_scrape_after_real_traffic(platform: Platform, workers: list[WorkerService]) -> None:
    async with aiohttp.ClientSession() as session:
        before = _samples(await (await session.get(f"{platform.edge.url}/metrics")).text())
        streamed = await asyncio.gather(*(_stream_chat(platform) for _ in range(3)))
        embed = await session.post(
            f"{platform.base_url}/embeddings", headers=AUTH, json={"model": MINILM_ID, "input": ["a", "b"]}
        )
        assert embed.status == 200
        bad = await session.post(f"{platform.base_url}/chat/completions", headers=AUTH, json={"model": GPT})
        assert bad.status == 400
        response = await session.get(f"{platform.edge.url}/metrics")
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=")
        after = _samples(await response.text())

    # Every documented metric is exposed under its name, with exactly its documented labels: the edge's
    # all but the streams worker's own (which that worker's /metrics serves: metrics.STREAMS_ONLY).
    families = {f.name: f for f in text_string_to_metric_families(await _scrape(platform))}
    streams = {f.name: f for f in text_string_to_metric_families(metrics.exposition(streams=True).decode())}
    for info in metrics.catalogue():
        base = info.name.removesuffix("_total") if info.kind == "counter" else info.name
        if base in metrics.STREAMS_ONLY:
            assert base not in families, f"{info.name} is the streams worker's, not the edge's"
            assert base in streams, f"{info.name} is not exposed by the streams worker"
            continue
        assert base in families, f"{info.name} is not exposed"
        for sample in families[base].samples:
            assert set(sample.labels) - {"le"} == set(info.labels), (sample.name, sample.labels)

    demo = {"tenant": "demo", "model": GPT}
    grew = _value(after, "sluice_requests_total", outcome="completed", **demo) - _value(
        before, "sluice_requests_total", outcome="completed", **demo
    )
    assert grew == 3
    assert (
        _value(after, "sluice_time_to_first_token_seconds_count", **demo)
        - _value(before, "sluice_time_to_first_token_seconds_count", **demo)
        == 3
    )
    assert (
        _value(after, "sluice_generation_tokens_total", **demo)
        - _value(before, "sluice_generation_tokens_total", **demo)
        == 60
    )
    await platform.replies.caught_up()  # this test's reader of the replies may be behind the edge's
    assert _value(after, "sluice_inter_token_latency_seconds_count", **demo) - _value(
        before, "sluice_inter_token_latency_seconds_count", **demo
    ) == sum(_after_first_chunk(platform, request_id) for request_id, _ in streamed)
    assert (
        _value(after, "sluice_rejections_total", tenant="demo", status="400")
        - _value(before, "sluice_rejections_total", tenant="demo", status="400")
        == 1
    )
    assert _value(after, "sluice_worker_requests_total", model=MINILM_ID, status="completed") > _value(
        before, "sluice_worker_requests_total", model=MINILM_ID, status="completed"
    )
    assert _value(after, "sluice_worker_batch_size_count", model=GPT) > _value(
        before, "sluice_worker_batch_size_count", model=GPT
    )
    assert _value(after, "sluice_worker_queue_wait_seconds_count", model=GPT) >= 3
    assert _value(after, "sluice_model_memory_bytes", model=GPT) > 0
    # Lag comes from librdkafka's statistics, every 5 s: scrape until the workers' group reports it.
    requests_topic = platform.names.requests(GPT)
    for _ in range(100):
        lags = _samples(await _scrape(platform)).get("sluice_consumer_lag", [])
        mine = [
            (labels, v)
            for labels, v in lags
            if labels["topic"] == requests_topic and labels["group"].startswith(f"sluice-workers.{GPT}.")
        ]
        if mine:
            break
        await asyncio.sleep(0.1)
    assert mine, "the workers' consumer lag is not exposed"
    assert {labels["partition"] for labels, _ in mine} <= {"0", "1"}
    assert all(v >= 0 for _, v in mine)


def _after_first_chunk(platform: Platform, request_id: str) -> int:
    """Tokens of a stream after its first chunk: each gets one inter-token latency observation."""
    chunks = [e for e in platform.replies.of(request_id) if isinstance(e, TokenChunk)]
    return sum(len(c.token_ids) for c in chunks[1:])


async def _scrape(platform: Platform) -> str:
    async with aiohttp.ClientSession() as session:
        return await (await session.get(f"{platform.edge.url}/metrics")).text()
