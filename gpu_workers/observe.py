"""What a worker records about its requests: Prometheus metrics and the spans of each request's stay.

The ``process`` span opens when the consumer thread hands a request over (a child of the edge's
``publish`` span, through the event's ``traceparent``). Its phases are recorded when the request ends, from
the times the runner noted (``RequestFinished.timings``) and the moment it joined a batch
(:meth:`WorkerObserver.joined`): ``sluice.queue_wait``, ``sluice.batch_formation``, ``sluice.prefill``
and ``sluice.decode`` (``sluice.embed`` for embeddings). Spans timed after the fact are exact and cost
nothing while the request runs. Everything here but :func:`open_trace` runs on the model thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from monitoring import metrics, tracing
from schemas.events import EmbeddingRequested, GenerationRequested, RequestFinished

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerLoad:
    """How busy a runner is, after a tick."""

    running: int
    waiting: int
    budget_ratio: float
    """Share of the running batch's token budget in use (0 for embeddings)."""
    batch: int
    """Sequences in the forward pass the last tick ran (0: it ran none)."""
    out_of_memory: int = 0
    """Forward passes that ran out of memory since the runner started."""
    limit_ratio: float = 1.0
    """The runner's batch limit now over its configured one (below 1 after running out of memory)."""
    quiet_batches: int = 0
    """Batches run on a quiet team (``gpu_workers.models.QuietTeam``) since the runner started."""


@dataclass(frozen=True)
class RequestTrace:
    span: Span
    traceparent: str | None
    """What the worker's events about this request carry: the ``process`` span (or, when tracing is off
    and the span is not recording, the caller's own context, passed on unchanged)."""
    tracestate: str | None
    received_ns: int


def open_trace(
    event: GenerationRequested | EmbeddingRequested, topic: str, partition: int, offset: int, group: str
) -> RequestTrace:
    """Consumer thread: the ``process`` span of a request just consumed. Where nothing records spans (no
    provider: the default) there is none to build, and the worker's events carry the caller's context on
    as it came: the span's attributes and the no-op span cost the consumer thread ~11 us a request warm
    and ~70 us in one client's request, whose caches the model's forward has just emptied (the thread
    holds the GIL the model thread wants meanwhile)."""
    received_ns = time.time_ns()
    if not tracing.recording():
        return RequestTrace(trace.INVALID_SPAN, event.traceparent, event.tracestate, received_ns)
    attributes = {
        **tracing.messaging("process", topic, partition, offset),
        tracing.MESSAGING_CONSUMER_GROUP: group,
        **tracing.request_attributes(event),
    }
    span = tracing.tracer().start_span(
        f"process {topic}",
        context=tracing.context_of(event.traceparent, event.tracestate),
        kind=SpanKind.CONSUMER,
        attributes=attributes,
        start_time=received_ns,
    )
    traceparent, tracestate = tracing.carrier_of(span)
    if traceparent is None:
        traceparent, tracestate = event.traceparent, event.tracestate
    return RequestTrace(span, traceparent, tracestate, received_ns)


@dataclass
class _Stay:
    joined_ns: int | None = None
    batch: int = 0
    budget_ratio: float = 0.0
    chunks: int = 0
    tokens: int = 0
    first_token_ns: int | None = None


def _utc(ns: int | None) -> datetime | None:
    return None if ns is None else datetime.fromtimestamp(ns / 1e9, UTC)


class WorkerObserver:
    """Per-request bookkeeping for metrics and spans (model thread)."""

    def __init__(self, model_id: str, worker_id: str) -> None:
        self._model = model_id
        self._worker = worker_id
        self._stays: dict[str, _Stay] = {}
        self._child = metrics.Children()
        self._out_of_memory = 0
        self._quiet_batches = 0

    def joined(self, request_id: str, batch: int, budget_ratio: float) -> None:
        stay = self._stays.setdefault(request_id, _Stay())
        if stay.joined_ns is None:
            stay.joined_ns, stay.batch, stay.budget_ratio = time.time_ns(), batch, budget_ratio

    def chunk(self, request_id: str, tokens: int = 0) -> None:
        stay = self._stays.setdefault(request_id, _Stay())
        stay.chunks += 1
        stay.tokens += tokens
        if tokens and stay.first_token_ns is None:
            stay.first_token_ns = time.time_ns()

    def streamed(self, request_id: str) -> int | None:
        """How many tokens of the request's answer were published here, or None where no chunk was."""
        stay = self._stays.get(request_id)
        return stay.tokens if stay is not None and stay.chunks > 0 else None

    def joined_at(self, request_id: str) -> datetime | None:
        """When the request joined its first batch here (None: it did not)."""
        stay = self._stays.get(request_id)
        return _utc(stay.joined_ns if stay is not None else None)

    def first_token_at(self, request_id: str) -> datetime | None:
        """When the first chunk with a token of the request's answer was published here (None: none was)."""
        stay = self._stays.get(request_id)
        return _utc(stay.first_token_ns if stay is not None else None)

    def forget(self, request_id: str) -> None:
        """A request that ends here without a terminal event (another worker's is on the log)."""
        self._stays.pop(request_id, None)

    def tick(self, load: RunnerLoad, seconds: float) -> None:
        child, model = self._child, self._model
        child(metrics.WORKER_RUNNING, model).set(load.running)
        child(metrics.WORKER_WAITING, model).set(load.waiting)
        child(metrics.TOKEN_BUDGET, model).set(load.budget_ratio)
        child(metrics.WORKER_BATCH_LIMIT, model).set(load.limit_ratio)
        if load.out_of_memory > self._out_of_memory:
            child(metrics.WORKER_OUT_OF_MEMORY, model).inc(load.out_of_memory - self._out_of_memory)
            self._out_of_memory = load.out_of_memory
        if load.quiet_batches > self._quiet_batches:
            child(metrics.WORKER_QUIET_BATCHES, model).inc(load.quiet_batches - self._quiet_batches)
            self._quiet_batches = load.quiet_batches
        if load.batch:
            child(metrics.BATCH_SIZE, model).observe(load.batch)
            child(metrics.STEP_SECONDS, model).observe(seconds)

    def finishing(
        self,
        event: GenerationRequested | EmbeddingRequested,
        request: RequestTrace | None,
        result: RequestFinished,
        topic: str,
        partition: int | None,
    ) -> tuple[Span | None, tuple[str, str | None] | None]:
        """Record the request's phases, end its ``process`` span, and open the ``publish`` span of its
        terminal event (returned, to end once the event is durable) with the trace context (traceparent,
        tracestate) the terminal event must carry, when there is one. Its metrics are :meth:`measure`'s,
        which the caller calls once the reply is on its way."""
        stay = self._stays.pop(event.request_id, _Stay())
        if request is None:
            return None, None
        process = request.span
        publish: Span | None = None
        if tracing.recording():
            publish = self._record(process, request.received_ns, stay, event, result, topic, partition)
            traceparent, tracestate = tracing.carrier_of(publish)
        else:
            # Nothing is recorded in this process: no phases, no publish span (~35 us of the model thread a
            # request). A caller's context still passes through: the terminal event names the span the
            # request named (open_trace), as a non-recording publish span would.
            traceparent, tracestate = request.traceparent, request.tracestate
        process.end()
        log.debug(
            "request finished",
            extra={
                "request_id": event.request_id,
                "tenant": event.tenant,
                "model": event.model,
                "status": result.status,
                "traceparent": traceparent,
                "completion": result.text,
            },
        )
        return publish, (traceparent, tracestate) if traceparent is not None else None

    def _record(
        self,
        process: Span,
        received_ns: int,
        stay: _Stay,
        event: GenerationRequested | EmbeddingRequested,
        result: RequestFinished,
        topic: str,
        partition: int | None,
    ) -> Span:
        """The ``process`` span's attributes and phases, and the terminal event's ``publish`` span."""
        process.set_attributes(
            {
                tracing.STATUS: result.status,
                tracing.GEN_AI_INPUT_TOKENS: result.usage.prompt_tokens,
                tracing.GEN_AI_OUTPUT_TOKENS: result.usage.completion_tokens,
                "sluice.worker.id": self._worker,
            }
        )
        if result.finish_reason is not None:
            process.set_attribute(tracing.GEN_AI_FINISH_REASONS, [result.finish_reason])
        if result.status == "failed":
            process.set_status(Status(StatusCode.ERROR, result.error.code if result.error else "failed"))
        self._phases(process, received_ns, stay, result, isinstance(event, EmbeddingRequested))
        return tracing.tracer().start_span(
            f"publish {topic}",
            context=trace.set_span_in_context(process),
            kind=SpanKind.PRODUCER,
            attributes=tracing.messaging("publish", topic, partition),
        )

    def measure(
        self,
        event: GenerationRequested | EmbeddingRequested,
        request: RequestTrace | None,
        result: RequestFinished,
    ) -> None:
        """Count a finished request and observe its queue wait, time to first token and end to end."""
        received_ns = request.received_ns if request is not None else None
        child = self._child
        labels = (self._model, event.model_version)
        child(metrics.WORKER_REQUESTS, *labels, result.status).inc()
        tenant = (metrics.tenant_label(event.tenant), *labels)
        child(metrics.WORKER_PROMPT_TOKENS, *tenant).inc(result.usage.prompt_tokens)
        child(metrics.WORKER_GENERATION_TOKENS, *tenant).inc(result.usage.completion_tokens)
        if received_ns is None:
            return
        timings = result.timings
        if timings.started is not None:
            child(metrics.QUEUE_WAIT, *labels).observe(_since(received_ns, timings.started))
        if timings.first_token is not None and isinstance(event, GenerationRequested):
            child(metrics.WORKER_TTFT, *labels).observe(_since(received_ns, timings.first_token))
        if timings.finished is not None:
            child(metrics.WORKER_E2E, *labels).observe(_since(received_ns, timings.finished))

    def _phases(
        self, parent: Span, received_ns: int, stay: _Stay, result: RequestFinished, embed: bool
    ) -> None:
        timings = result.timings
        end_ns = tracing.epoch_ns(timings.finished) if timings.finished else time.time_ns()
        started_ns = tracing.epoch_ns(timings.started) if timings.started else None
        joined_ns = stay.joined_ns or started_ns
        context = trace.set_span_in_context(parent)

        def phase(name: str, start: int, end: int, **attributes: int | float) -> None:
            span = tracing.tracer().start_span(name, context=context, start_time=start, attributes=attributes)
            span.end(end_time=max(start, end))

        phase("sluice.queue_wait", received_ns, started_ns or end_ns)
        if started_ns is None or joined_ns is None:
            return  # never ran: expired, cancelled or refused while waiting
        phase(
            "sluice.batch_formation",
            started_ns,
            joined_ns,
            **{"sluice.batch.size": stay.batch, "sluice.batch.token_budget_ratio": stay.budget_ratio},
        )
        if embed:
            phase("sluice.embed", joined_ns, end_ns, **{"sluice.batch.size": stay.batch})
            return
        first_ns = tracing.epoch_ns(timings.first_token) if timings.first_token else None
        phase(
            "sluice.prefill",
            joined_ns,
            first_ns or end_ns,
            **{tracing.GEN_AI_INPUT_TOKENS: result.usage.prompt_tokens},
        )
        if first_ns is not None:
            phase(
                "sluice.decode",
                first_ns,
                end_ns,
                **{
                    tracing.GEN_AI_OUTPUT_TOKENS: result.usage.completion_tokens,
                    "sluice.chunks": stay.chunks,
                },
            )


def _since(start_ns: int, when: datetime) -> float:
    return max(0.0, (tracing.epoch_ns(when) - start_ns) / 1e9)
