"""Span sites where nothing is recorded (no provider: the default) skip the span but keep the context that
OpenTelemetry's no-op tracer would have given: what the block publishes names the same parent."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import INVALID_SPAN, NoOpTracer, SpanKind

from monitoring import tracing

CALLER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OUTER = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture
def not_recording(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process may have a provider from another test module: say there is none."""
    monkeypatch.setattr(tracing, "recording", lambda: False)


def _published(context: Context | None, outer: str | None, *, no_op: bool) -> tuple[str | None, str | None]:
    """What an event published inside a span site would carry: through ``current_span`` or through the
    no-op tracer, inside ``outer``'s context when given."""

    def site() -> tuple[str | None, str | None]:
        if no_op:
            with NoOpTracer().start_as_current_span("site", context=context, kind=SpanKind.SERVER) as span:
                return tracing.carrier_of(span)
        with tracing.current_span("site", context=context, kind=SpanKind.SERVER) as span:
            return tracing.carrier_of(span)

    if outer is None:
        return site()
    with trace.use_span(trace.get_current_span(tracing.context_of(outer))):
        return site()


@pytest.mark.parametrize("caller", [CALLER, None], ids=["caller-traceparent", "no-traceparent"])
@pytest.mark.parametrize("outer", [OUTER, None], ids=["inside-a-span", "at-the-top"])
@pytest.mark.parametrize("explicit", [True, False], ids=["explicit-parent", "current-context"])
@pytest.mark.usefixtures("not_recording")
def test_a_skipped_span_publishes_what_the_no_op_tracer_would(
    caller: str | None, outer: str | None, explicit: bool
) -> None:
    context = tracing.context_of(caller) if explicit else None
    assert _published(context, outer, no_op=False) == _published(context, outer, no_op=True)


@pytest.mark.usefixtures("not_recording")
def test_a_callers_context_is_current_inside_the_block_and_only_there() -> None:
    assert not trace.get_current_span().get_span_context().is_valid
    with tracing.current_span("edge", context=tracing.context_of(CALLER)) as span:
        assert tracing.carrier_of(span) == (CALLER, None)
        assert tracing.carrier_of(trace.get_current_span()) == (CALLER, None)
        with tracing.current_span("inner") as inner:  # a child site: the caller's context stays current
            assert tracing.carrier_of(inner) == (CALLER, None)
    assert not trace.get_current_span().get_span_context().is_valid


@pytest.mark.usefixtures("not_recording")
def test_a_span_that_is_not_made_current_is_the_invalid_one() -> None:
    span = tracing.span("sluice.respond", attributes={"x": 1})
    assert span is INVALID_SPAN
    assert not span.is_recording()


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "recording", lambda: True)
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer(tracing.TRACER_NAME))
    yield exporter
    provider.shutdown()


def test_where_spans_are_recorded_each_site_records_one_under_the_caller(
    recorded: InMemorySpanExporter,
) -> None:
    with tracing.current_span(
        "POST /v1/embeddings", context=tracing.context_of(CALLER), kind=SpanKind.SERVER
    ):
        with tracing.current_span("sluice.admit"):
            pass
        tracing.span("sluice.respond").end()
    spans = {span.name: span for span in recorded.get_finished_spans()}
    assert set(spans) == {"POST /v1/embeddings", "sluice.admit", "sluice.respond"}
    server = spans["POST /v1/embeddings"]
    assert server.parent is not None
    assert format(server.parent.span_id, "016x") == CALLER.split("-")[2]
    assert spans["sluice.admit"].parent is not None
    assert spans["sluice.admit"].parent.span_id == server.context.span_id
    assert spans["sluice.respond"].parent is not None
    assert spans["sluice.respond"].parent.span_id == server.context.span_id


@pytest.mark.usefixtures("not_recording")
def test_a_callers_long_tracestate_is_forwarded_cut_to_its_first_whole_members() -> None:
    """Found by a review: an event holds at most 1,024 characters of ``tracestate`` (its key and headers
    must fit beside its value), and a client's header may hold ~8 KB: its request was taken (200) and then
    dead-lettered. W3C: forward at least 512, dropping members from the end."""
    members = [f"v{i}=" + "x" * 60 for i in range(20)]  # 1.3 KB
    with tracing.current_span("edge", context=tracing.context_of(CALLER, ",".join(members))) as span:
        parent, state = tracing.carrier_of(span)
    assert parent == CALLER
    assert state is not None
    assert len(state) <= tracing.TRACESTATE_CHARS
    assert state.split(",") == members[: len(state.split(","))]
    assert len(state) + 1 + len(members[0]) > tracing.TRACESTATE_CHARS  # as many as fit
    short = "v0=abc,v1=def"
    with tracing.current_span("edge", context=tracing.context_of(CALLER, short)) as span:
        assert tracing.carrier_of(span) == (CALLER, short)  # whole when it fits


@pytest.mark.usefixtures("not_recording")
@pytest.mark.parametrize(
    "tracestate",
    [
        "A" * 7000,  # one member, not key=value, past what is forwarded
        "Not=upper-case-key",
        "v0=abc,junk,v1=def",  # one bad member spoils the header (as in OpenTelemetry)
        "v0=" + "x" * 300,  # a value over 256 characters
        "v0=abc,,v1=",  # an empty value
    ],
    ids=["long", "upper-case", "bad-member", "long-value", "empty-value"],
)
def test_a_malformed_tracestate_is_dropped_without_a_word(
    tracestate: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: OpenTelemetry logs each malformed member of a caller's header whole at WARNING
    (the edge parses it before authenticating), ~8 KB of the caller's bytes a request. ``context_of`` drops
    such a header before OpenTelemetry sees it; the caller's traceparent still counts."""
    caplog.set_level(logging.DEBUG, logger="opentelemetry")  # configure_logging's ERROR is not what is tested
    context = tracing.context_of(CALLER, tracestate)
    assert [r.getMessage()[:80] for r in caplog.records] == []
    parent = trace.get_current_span(context).get_span_context()
    assert parent.is_valid
    assert format(parent.span_id, "016x") == CALLER.split("-")[2]
    assert not parent.trace_state
    with tracing.current_span("edge", context=context) as span:
        assert tracing.carrier_of(span) == (CALLER, None)


@pytest.mark.usefixtures("not_recording")
def test_a_valid_tracestate_is_kept_to_its_first_32_members(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="opentelemetry")
    members = [f"v{i}=x" for i in range(40)]  # 40 members (W3C: at most 32) in 235 characters
    for given, kept in (
        (" v0=abc , ,t@sys=1/2 ", "v0=abc,t@sys=1/2"),  # optional whitespace and empty members go
        (",".join(members), ",".join(members[:32])),
    ):
        parent = trace.get_current_span(tracing.context_of(CALLER, given)).get_span_context()
        assert parent.trace_state.to_header() == kept
    assert caplog.records == []
