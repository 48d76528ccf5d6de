"""What the edge records about the requests it serves: client-side metrics and the edge's spans.

:class:`RequestWatch` follows one request from its arrival to its end as the client saw it: TTFT and
inter-token latency of streams, end-to-end latency, tokens, and the outcome (``sluice_requests_total``; a
client's error that a worker found, answered 4xx, in ``sluice_rejections_total`` instead, as the edge's own
refusals are).
It wraps the reply stream (so HTTP, SSE and WebSocket share it), opens the ``sluice.respond`` span and
records the ``receive`` span of the terminal event as a child of the worker's ``publish`` span.
A watch made for a stream this edge did not submit (a resume, an idempotent replay) records spans only:
the request was counted where it was submitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from types import TracebackType

from aiohttp import web
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode

from ingest.errors import DeadlineExceeded, IngestError, ShuttingDown, from_finished
from ingest.gateway import ReplyItem, ReplyStream, RequestEvent
from monitoring import metrics, tracing
from schemas.events import EmbeddingRequested, RequestFinished, TokenChunk

log = logging.getLogger(__name__)

_CHILDREN = metrics.Children()
"""The edge's labelled series, remembered (its requests are watched on its event loop only)."""

# aiohttp request keys: what the error middleware needs to label a refusal.
TENANT_KEY = web.RequestKey("sluice.tenant", str)
MODEL_KEY = web.RequestKey("sluice.model", str)
VERSION_KEY = web.RequestKey("sluice.version", str)
SUBMITTED_KEY = web.RequestKey("sluice.submitted", bool)
REQUEST_ID_KEY = web.RequestKey("sluice.request_id", str)
"""The request's id once it is on the log (or resumed): an error answered after that names it in
``x-request-id``, as OpenAI's do (the SDK's ``APIStatusError.request_id``)."""
SERVER_SPAN_KEY = web.RequestKey("sluice.span", Span)


class Watched:
    """A reply stream whose items a :class:`RequestWatch` sees as they are delivered."""

    def __init__(self, stream: ReplyStream, watch: RequestWatch) -> None:
        self._stream = stream
        self._watch = watch

    async def __aiter__(self) -> AsyncIterator[ReplyItem]:
        async for item in self._stream:
            self._watch.delivered(item)
            yield item

    async def aclose(self) -> None:
        await self._stream.aclose()


class RequestWatch:
    """Use as ``with RequestWatch(event, stream=..., t0=...) as watch:`` around serving the replies, and
    iterate ``watch.wrap(stream)``. ``event`` None: a stream this edge did not submit (spans only)."""

    def __init__(
        self,
        event: RequestEvent | None,
        *,
        stream: bool,
        t0: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._event = event
        self._stream = stream
        self._t0 = t0
        self._clock = clock
        self._wall = wall
        self._received: float | None = None
        """When the terminal event reached this handler (``clock``)."""
        self._labels = (
            (metrics.tenant_label(event.tenant), event.model, event.model_version) if event else None
        )
        self._last: float | None = None
        self._outcome: str | None = None
        self._chunks = 0
        self._tokens = 0
        self._parent = trace.get_current_span()
        self._span = tracing.span("sluice.respond", attributes={tracing.GEN_AI_REQUEST_STREAM: stream})

    def wrap(self, stream: ReplyStream) -> Watched:
        return Watched(stream, self)

    def __enter__(self) -> RequestWatch:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._outcome is None and self._labels is not None:
            # The client saw no terminal event: it left, its deadline passed, or the stream broke.
            if isinstance(exc, DeadlineExceeded):
                outcome = "expired"
            elif isinstance(exc, ShuttingDown):  # cut by the edge's shutdown: cancelled, as it was
                outcome = "cancelled"
            elif exc is None or isinstance(exc, IngestError):
                outcome = "failed"
            else:  # cancelled (the client went away), connection reset
                outcome = "cancelled"
            metrics.REQUESTS.labels(*self._labels, outcome).inc()
            self._span.set_attribute(tracing.STATUS, outcome)
        self._span.set_attribute("sluice.chunks", self._chunks)
        if exc is not None and not isinstance(exc, GeneratorExit):
            self._span.record_exception(exc)
        self._span.end()

    def delivered(self, item: ReplyItem) -> None:
        now = self._clock()
        if isinstance(item, TokenChunk):
            self._chunk(item, now)
        elif isinstance(item, RequestFinished):
            self._finished(item, now)

    def _chunk(self, chunk: TokenChunk, now: float) -> None:
        count = len(chunk.token_ids)
        self._chunks += 1
        self._tokens += count
        if not count or self._labels is None:
            return
        if self._last is None:
            _CHILDREN(metrics.TTFT, *self._labels).observe(now - self._t0)
            self._span.add_event("first_token")
        else:
            gap = (now - self._last) / count
            itl = _CHILDREN(metrics.ITL, *self._labels)
            for _ in range(count):
                itl.observe(gap)
        self._last = now

    def _finished(self, finished: RequestFinished, now: float) -> None:
        self._received = now
        if self._span.is_recording() or self._parent.is_recording():
            self._trace_finished(finished)
        if self._labels is None or self._outcome is not None:
            return
        self._outcome = finished.status
        refused = from_finished(finished)
        if refused is not None and refused.status < 500:
            # a client's error the worker found (a prompt too long for it): the client is answered the 4xx
            # the edge's own check would have given, so it is counted as that refusal is, in no SLI
            count_refusal(*self._labels, refused)
        else:
            _CHILDREN(metrics.REQUESTS, *self._labels, finished.status).inc()
        _CHILDREN(metrics.PROMPT_TOKENS, *self._labels).inc(finished.usage.prompt_tokens)
        _CHILDREN(metrics.GENERATION_TOKENS, *self._labels).inc(finished.usage.completion_tokens)
        if finished.status == "completed":
            _CHILDREN(metrics.E2E, *self._labels).observe(now - self._t0)

    def _trace_finished(self, finished: RequestFinished) -> None:
        self._record_receive(finished)
        attributes: dict[str, tracing.AttributeValue] = {
            tracing.GEN_AI_RESPONSE_MODEL: finished.model,
            tracing.GEN_AI_INPUT_TOKENS: finished.usage.prompt_tokens,
            tracing.GEN_AI_OUTPUT_TOKENS: finished.usage.completion_tokens,
            tracing.STATUS: finished.status,
        }
        if finished.finish_reason is not None:
            attributes[tracing.GEN_AI_FINISH_REASONS] = [finished.finish_reason]
        for span in (self._span, self._parent):
            span.set_attributes(attributes)
            if finished.status == "failed":
                span.set_status(Status(StatusCode.ERROR, finished.error.code if finished.error else "failed"))

    def server_timing(self, finished: RequestFinished) -> str | None:
        """Where a non-streamed request's time went, as a ``Server-Timing`` header (milliseconds): ``edge``
        (the request read, checked, tokenised and published), ``queue`` (the way to the worker and the wait
        for a batch there), ``model`` (the worker's batch, up to its terminal event), ``return`` (the terminal
        event's way back to this handler) and ``total`` (this handler's time, up to now). ``queue`` and
        ``return`` span two hosts' clocks (the edge's and the worker's): an offset between them moves time
        from one to the other (their sum does not move), and one that would make either negative reads 0.
        None for a request this edge did not submit (a resume, an idempotent replay: its timings are an
        earlier run's) or one whose terminal event has not arrived."""
        if self._event is None or self._received is None:
            return None
        timings = finished.timings
        now = self._clock()
        wall_now = self._wall()

        def wall(at: float) -> float:
            return wall_now - (now - at)

        # the hand-offs in order, on the wall clock; each stage is the time between two of them
        marks = [
            wall(self._t0),
            *(at.timestamp() if at else None for at in (timings.accepted, timings.started, timings.finished)),
            wall(self._received),
        ]
        parts = [
            f"{name};dur={max(0.0, (end - start) * 1000):.2f}"
            for name, start, end in zip(("edge", "queue", "model", "return"), marks, marks[1:], strict=False)
            if start is not None and end is not None
        ]
        parts.append(f"total;dur={(now - self._t0) * 1000:.2f}")
        return ", ".join(parts)

    def _record_receive(self, finished: RequestFinished) -> None:
        """The terminal event's arrival, as a child of the worker's publish span (the Kafka hop back)."""
        reply = self._event.reply if self._event is not None else None
        topic = reply.topic if reply is not None else "replies"
        links = [Link(self._parent.get_span_context())] if self._parent.get_span_context().is_valid else []
        span = tracing.span(
            f"receive {topic}",
            context=tracing.context_of(finished.traceparent, finished.tracestate),
            kind=SpanKind.CONSUMER,
            attributes=tracing.messaging("receive", topic, reply.partition if reply else None),
            links=links,
        )
        span.end()


def note_accepted(event: RequestEvent, span: Span | None) -> None:
    """Label the request's server span with what validation established, and log the acceptance (the
    prompt reaches the logs only for tenants that enabled content logging, see monitoring.logs)."""
    if span is not None and span.is_recording():
        span.set_attributes(tracing.request_attributes(event))
    prompt = "\n".join(event.texts or []) if isinstance(event, EmbeddingRequested) else event.prompt
    log.debug(
        "request accepted",
        extra={
            "request_id": event.request_id,
            "tenant": event.tenant,
            "model": event.model,
            "prompt": prompt,
        },
    )


def note_refusal(request: web.Request, exc: IngestError) -> None:
    """Count an error answered instead of serving the request (see :func:`count_refusal`)."""
    if request.get(SUBMITTED_KEY):
        return  # the request's watch counted its outcome
    count_refusal(
        request.get(TENANT_KEY, "unknown"), request.get(MODEL_KEY, ""), request.get(VERSION_KEY, ""), exc
    )


def count_refusal(tenant: str, model: str, version: str, exc: IngestError) -> None:
    """A 4xx is the caller's (``sluice_rejections_total`` only); a 5xx before the request was submitted
    is the server shedding it, which also counts against availability (``outcome="shed"``)."""
    metrics.REJECTIONS.labels(tenant, model, str(exc.status), exc.code or exc.error_type).inc()
    if exc.status >= 500 and model:
        metrics.REQUESTS.labels(tenant, model, version, "shed").inc()
