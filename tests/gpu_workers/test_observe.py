"""What a worker records when a request ends: its phases and ``publish`` span when spans are recorded, and
only the caller's context passed on when they are not."""

from __future__ import annotations

from datetime import timedelta

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span

from gpu_workers.observe import WorkerObserver, open_trace
from monitoring import tracing
from schemas.events import EmbeddingRequested, RequestFinished, Timings, Usage, utc_now
from schemas.ids import uuid7

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def request() -> EmbeddingRequested:
    return EmbeddingRequested(
        tenant="acme", model="all-minilm-l6-v2", request_id=uuid7(), source="test", model_version="v1",
        inputs=[[101, 102]], traceparent=TRACEPARENT,
    )  # fmt: skip


def finished(event: EmbeddingRequested) -> RequestFinished:
    now = utc_now()
    return RequestFinished(
        tenant=event.tenant,
        model=event.model,
        request_id=event.request_id,
        source="worker/test",
        status="completed",
        finish_reason="stop",
        usage=Usage(prompt_tokens=2, completion_tokens=0, total_tokens=2),
        timings=Timings(accepted=event.time, started=now, finished=now + timedelta(milliseconds=5)),
    )


def ended(observer: WorkerObserver, event: EmbeddingRequested) -> tuple[Span | None, object]:
    """``event`` consumed, run in a batch of one, and ended: what ``finishing`` hands its publisher."""
    observer.joined(event.request_id, 1, 0.0)
    opened = open_trace(event, "requests", 0, 7, "group")
    return observer.finishing(event, opened, finished(event), "replies", 0)


def test_without_a_recording_provider_the_callers_context_passes_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tracing, "tracer", lambda: trace.NoOpTracer())
    monkeypatch.setattr(tracing, "recording", lambda: False)
    event = request()
    observer = WorkerObserver(event.model, "w")
    span, context = ended(observer, event)
    assert span is None  # nothing to end once the event is durable
    assert context == (TRACEPARENT, None)  # the terminal event names the edge's publish span
    alone = msgspec.structs.replace(event, traceparent=None, request_id=uuid7())  # no caller's trace
    assert ended(observer, alone) == (None, None)


def test_without_a_recording_provider_no_span_is_built_for_a_consumed_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_tracer() -> trace.Tracer:
        raise AssertionError("a span was built that nothing records")

    monkeypatch.setattr(tracing, "tracer", no_tracer)
    monkeypatch.setattr(tracing, "recording", lambda: False)
    event = msgspec.structs.replace(request(), tracestate="vendor=1")
    opened = open_trace(event, "requests", 0, 7, "group")
    assert (opened.traceparent, opened.tracestate) == (TRACEPARENT, "vendor=1")  # passed on as it came
    assert not opened.span.is_recording()
    opened.span.set_attribute(tracing.STATUS, "drained")  # what the worker does to a span it drops
    opened.span.end()


def test_a_recording_provider_gets_the_phases_and_the_publish_span(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))
    monkeypatch.setattr(tracing, "recording", lambda: True)
    span, context = ended(WorkerObserver("all-minilm-l6-v2", "w"), request())
    assert span is not None
    span.end()
    names = [s.name for s in exporter.get_finished_spans()]
    assert names == [
        "sluice.queue_wait",
        "sluice.batch_formation",
        "sluice.embed",
        "process requests",
        "publish replies",
    ]
    publish = span.get_span_context()
    assert context == (f"00-{publish.trace_id:032x}-{publish.span_id:016x}-01", None)
    assert publish.trace_id == int(TRACEPARENT.split("-")[1], 16)  # one trace with the caller's
