"""OpenTelemetry tracing: setup, W3C trace context through Kafka, and the attribute names the platform uses.

A request's trace crosses processes inside its events: every event carries ``traceparent``/``tracestate``
(W3C Trace Context), which the codec also writes as Kafka headers. The producer of an event puts the
context of its ``publish`` span there; the consumer starts its ``process``/``receive`` span as a child of
it. So one streamed request gives one trace::

    POST /v1/chat/completions            (edge, SERVER)
    ├── sluice.admit                     (auth, rate limit, validation, tokenising)
    ├── publish <requests topic>         (edge, PRODUCER)
    │   └── process <requests topic>     (worker, CONSUMER: consumed → terminal event)
    │       ├── sluice.queue_wait
    │       ├── sluice.batch_formation   (joining the running batch; batch size, token budget)
    │       ├── sluice.prefill
    │       ├── sluice.decode            (token and chunk counts)
    │       └── publish <replies topic>  (worker, PRODUCER: the terminal event)
    │           └── receive <replies topic>  (edge, CONSUMER)
    └── sluice.respond                   (edge: streaming to the client)

Spans are created through the global tracer provider. Without :func:`configure_tracing` (no
``SLUICE_OTLP_ENDPOINT``) that is OpenTelemetry's no-op provider: spans cost next to nothing and export
nothing. Attribute names follow the OpenTelemetry GenAI and messaging semantic conventions.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from datetime import datetime
from typing import Literal

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import INVALID_SPAN, Link, Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from monitoring.settings import ObservabilitySettings
from schemas.events import EmbeddingRequested, GenerationRequested

TRACER_NAME = "sluicegate"

# GenAI semantic conventions (https://opentelemetry.io/docs/specs/semconv/gen-ai/)
GEN_AI_OPERATION = "gen_ai.operation.name"
GEN_AI_PROVIDER = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
GEN_AI_REQUEST_STREAM = "gen_ai.request.stream"
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
# Messaging semantic conventions
MESSAGING_SYSTEM = "messaging.system"
MESSAGING_OPERATION = "messaging.operation.type"
MESSAGING_DESTINATION = "messaging.destination.name"
MESSAGING_PARTITION = "messaging.destination.partition.id"
MESSAGING_OFFSET = "messaging.kafka.offset"
MESSAGING_CONSUMER_GROUP = "messaging.consumer.group.name"
# Ours
TENANT = "sluice.tenant"
MODEL_VERSION = "sluice.model.version"
REQUEST_ID = "sluice.request.id"
STATUS = "sluice.status"

_PROPAGATOR = TraceContextTextMapPropagator()

AttributeValue = str | bool | int | float | list[str]


_TRACER = trace.get_tracer(TRACER_NAME)


def tracer() -> trace.Tracer:
    """The platform's tracer: OpenTelemetry's proxy until a provider is configured, which then follows that
    provider (so one made before :func:`configure_tracing` is honoured). Made once: ``get_tracer`` looks the
    provider up in the environment at every call (~1 us)."""
    return _TRACER


def recording() -> bool:
    """Whether spans are recorded in this process (a provider was configured), so hot paths can skip
    spans, and the attributes of spans, that would be dropped."""
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def current_span(
    name: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Sequence[Link] = (),
) -> AbstractContextManager[Span]:
    """``tracer().start_as_current_span(...)`` where spans are recorded. Where they are not (no provider:
    the default), no span: the block runs in the caller's context (``context``'s span made current when it
    names one), which is what the events it publishes carry. A span through OpenTelemetry's no-op tracer
    costs ~4 us, and an edge request opened three of them and two spans beside (docs/perf)."""
    if recording():
        return tracer().start_as_current_span(
            name, context=context, kind=kind, attributes=attributes, links=links
        )
    current = trace.get_current_span()
    if context is not None:
        parent = trace.get_current_span(context)
        if parent.get_span_context().is_valid or current.get_span_context().is_valid:
            return trace.use_span(parent)  # made current, as the no-op tracer makes its parent
    return nullcontext(current)


def span(
    name: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    attributes: Mapping[str, AttributeValue] | None = None,
    links: Sequence[Link] = (),
) -> Span:
    """``tracer().start_span(...)`` where spans are recorded; elsewhere the invalid span (every call on it
    does nothing): a span that is not made current changes no context."""
    if recording():
        return tracer().start_span(name, context=context, kind=kind, attributes=attributes, links=links)
    return INVALID_SPAN


def configure_tracing(settings: ObservabilitySettings, service: str) -> TracerProvider | None:
    """Export spans over OTLP/HTTP when ``otlp_endpoint`` is set; returns the provider (call
    :func:`shutdown_tracing` with it on exit, to flush) or None when tracing stays off."""
    if settings.otlp_endpoint is None:
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": f"sluicegate-{service}", "service.namespace": "sluicegate"}
        ),
        sampler=ParentBased(TraceIdRatioBased(settings.trace_sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=settings.otlp_endpoint)))
    trace.set_tracer_provider(provider)
    return provider


def shutdown_tracing(provider: TracerProvider | None) -> None:
    if provider is not None:
        provider.shutdown()


def carrier_of(span: Span) -> tuple[str | None, str | None]:
    """``(traceparent, tracestate)`` naming ``span`` as the parent, for an event about to be published.
    ``(None, None)`` for a span that is not recording and has no valid context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent"), _forwarded(carrier.get("tracestate"))


TRACESTATE_CHARS = 512
"""The most of a ``tracestate`` an event carries: what W3C trace context asks every vendor to forward. A
client's header is up to ~8 KB (OpenTelemetry takes 8,192 characters), over what an event's envelope holds
(``schemas.events.TraceHeader``): its request was dead-lettered after the edge had taken it."""


def _forwarded(tracestate: str | None) -> str | None:
    """``tracestate`` as forwarded: whole up to :data:`TRACESTATE_CHARS`, else its first list members that
    fit (W3C: a vendor may drop members from the end), None when not even one does."""
    if tracestate is None or len(tracestate) <= TRACESTATE_CHARS:
        return tracestate
    kept = ""
    for member in tracestate.split(","):
        joined = f"{kept},{member}" if kept else member
        if len(joined) > TRACESTATE_CHARS:
            break
        kept = joined
    return kept or None


TRACESTATE_MEMBERS = 32
"""The most list members a ``tracestate`` may have (W3C); OpenTelemetry drops a longer one, with a warning."""
_TRACESTATE_MEMBER = re.compile(
    # W3C trace context's list member: a key (simple, or tenant@system) = a value, as OpenTelemetry parses it
    r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)


def _accepted(tracestate: str | None) -> str | None:
    """``tracestate`` cut as :func:`_forwarded` cuts it (and to its first :data:`TRACESTATE_MEMBERS`
    members), or None when a member left is not ``key=value`` in the W3C grammar. OpenTelemetry would drop
    such a header too, but it logs every malformed member whole at WARNING, and the edge parses the
    caller's header before authenticating, whether or not tracing is on: a review found anyone who could
    reach the edge, with no API key, writing 7 KB of their own bytes to the log per request."""
    cut = _forwarded(tracestate)
    if cut is None:
        return None
    members = [m for m in (m.strip(" \t") for m in cut.split(",")) if m]  # empty members are allowed
    if not all(_TRACESTATE_MEMBER.fullmatch(m) for m in members):
        return None
    return ",".join(members[:TRACESTATE_MEMBERS]) or None


def context_of(traceparent: str | None, tracestate: str | None = None) -> Context:
    """The remote parent context an event (or a caller) carries (an empty context when it carries none).
    ``tracestate`` is taken only as :func:`_accepted` keeps it: a malformed one is dropped unparsed."""
    carrier = {"traceparent": traceparent} if traceparent else {}
    accepted = _accepted(tracestate) if traceparent else None
    if accepted:
        carrier["tracestate"] = accepted
    return _PROPAGATOR.extract(carrier)


def context_of_headers(headers: Mapping[str, str]) -> Context:
    """The caller's trace context from HTTP headers (``traceparent``/``tracestate``), if any."""
    return context_of(headers.get("traceparent"), headers.get("tracestate"))


def epoch_ns(when: datetime) -> int:
    """An aware datetime as OpenTelemetry's nanoseconds since the epoch (for spans timed after the fact)."""
    return int(when.timestamp() * 1_000_000) * 1000


def messaging(
    operation: Literal["publish", "process", "receive"],
    topic: str,
    partition: int | None = None,
    offset: int | None = None,
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        MESSAGING_SYSTEM: "kafka",
        MESSAGING_OPERATION: operation,
        MESSAGING_DESTINATION: topic,
    }
    if partition is not None:
        attributes[MESSAGING_PARTITION] = str(partition)
    if offset is not None:
        attributes[MESSAGING_OFFSET] = offset
    return attributes


def request_attributes(event: GenerationRequested | EmbeddingRequested) -> dict[str, AttributeValue]:
    """GenAI request attributes of a request event, plus tenant, model version and request id."""
    attributes: dict[str, AttributeValue] = {
        GEN_AI_PROVIDER: "sluicegate",
        GEN_AI_REQUEST_MODEL: event.model,
        GEN_AI_RESPONSE_ID: event.request_id,
        TENANT: event.tenant,
        MODEL_VERSION: event.model_version,
        REQUEST_ID: event.request_id,
    }
    if isinstance(event, GenerationRequested):
        attributes[GEN_AI_OPERATION] = "chat" if event.chat else "text_completion"
        attributes[GEN_AI_REQUEST_MAX_TOKENS] = event.sampling.max_tokens
        attributes[GEN_AI_REQUEST_TEMPERATURE] = event.sampling.temperature
        attributes[GEN_AI_REQUEST_TOP_P] = event.sampling.top_p
        attributes[GEN_AI_REQUEST_STREAM] = event.stream
        attributes[GEN_AI_INPUT_TOKENS] = len(event.input_ids)
    else:
        attributes[GEN_AI_OPERATION] = "embeddings"
        attributes[GEN_AI_INPUT_TOKENS] = sum(len(ids) for ids in event.inputs)
    return attributes
