"""Structured logs: fields, request context, trace ids, content rules and secret scrubbing."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider

from monitoring.logs import (
    ERRORS_ONLY_LOGGERS,
    NOISY_LOGGERS,
    REDACTED,
    configure_logging,
    log_context,
    make_formatter,
    register_secret,
    scrub,
)
from monitoring.settings import ObservabilitySettings

KEY = "sk-live-SECRET0123456789abcdef"
PROMPT = "PURPLE-ELEPHANT-4417 tell me a secret"


class Capture:
    """A private logger whose records go, formatted, into a string."""

    def __init__(self, settings: ObservabilitySettings) -> None:
        self.stream = io.StringIO()
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(make_formatter(settings, "svc"))
        self.log = logging.getLogger(f"test.logs.{secrets.token_hex(4)}")
        self.log.propagate = False
        self.log.setLevel(logging.DEBUG)
        self.log.addHandler(self.handler)

    @property
    def text(self) -> str:
        return self.stream.getvalue()

    def lines(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.text.splitlines()]

    def close(self) -> None:
        self.log.removeHandler(self.handler)


@pytest.fixture
def capture() -> Iterator[Capture]:
    cap = Capture(ObservabilitySettings())
    yield cap
    cap.close()


def test_a_line_is_one_json_object_with_the_fixed_fields(capture: Capture) -> None:
    capture.log.info("hello %s", "world", extra={"request_id": "r1", "tenant": "acme", "attempt": 2})
    (line,) = capture.lines()
    assert list(line)[:5] == ["time", "level", "logger", "message", "service"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", line["time"])
    assert line["level"] == "INFO"
    assert line["logger"] == capture.log.name
    assert line["message"] == "hello world"
    assert line["service"] == "svc"
    assert line["request_id"] == "r1"
    assert line["tenant"] == "acme"
    assert line["attempt"] == 2
    assert "trace_id" not in line
    assert "exc" not in line


def test_extras_that_are_not_json_are_written_as_repr_and_fixed_names_are_kept(capture: Capture) -> None:
    class Thing:
        def __repr__(self) -> str:
            return f"Thing(key={KEY})"

    capture.log.info("x", extra={"thing": Thing(), "nested": {"a": [1, (2, "b")]}, "level": "custom"})
    (line,) = capture.lines()
    assert line["thing"] == f"Thing(key={REDACTED})"
    assert line["nested"] == {"a": [1, [2, "b"]]}
    assert line["level"] == "INFO"
    assert line["extra_level"] == "custom"


async def test_log_context_reaches_tasks_created_inside_it_and_extra_wins(capture: Capture) -> None:
    async def work() -> None:
        await asyncio.sleep(0)
        capture.log.info("in task")
        capture.log.info("override", extra={"model": "other"})

    with log_context(request_id="r7", tenant="acme", model="demo-gpt"):
        task = asyncio.create_task(work())
    await task
    capture.log.info("outside")
    inside, override, outside = capture.lines()
    assert (inside["request_id"], inside["tenant"], inside["model"]) == ("r7", "acme", "demo-gpt")
    assert override["model"] == "other"
    assert override["request_id"] == "r7"
    assert "request_id" not in outside


def test_nested_log_context_adds_fields_and_restores_on_exit(capture: Capture) -> None:
    with log_context(tenant="acme"):
        with log_context(request_id="r1", model=None):
            capture.log.info("inner")
        capture.log.info("outer")
    inner, outer = capture.lines()
    assert (inner["tenant"], inner["request_id"]) == ("acme", "r1")
    assert "model" not in inner
    assert outer["tenant"] == "acme"
    assert "request_id" not in outer


def test_trace_and_span_ids_come_from_the_current_span(capture: Capture) -> None:
    tracer = TracerProvider().get_tracer("test.logs")
    with tracer.start_as_current_span("op") as span:
        capture.log.info("traced")
        context = span.get_span_context()
    (line,) = capture.lines()
    assert line["trace_id"] == format(context.trace_id, "032x")
    assert line["span_id"] == format(context.span_id, "016x")


def test_trace_ids_fall_back_to_a_traceparent_attribute(capture: Capture) -> None:
    traceparent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    capture.log.info("from event", extra={"traceparent": traceparent})
    capture.log.info("garbage", extra={"traceparent": "nope"})
    line, garbage = capture.lines()
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["span_id"] == "b7ad6b7169203331"
    assert "traceparent" not in line
    assert "trace_id" not in garbage


def _log_key_in_message(log: logging.Logger) -> None:
    log.warning(f"auth failed for {KEY}")


def _log_key_in_args(log: logging.Logger) -> None:
    log.warning("auth failed for %s", KEY)


def _log_key_in_extra(log: logging.Logger) -> None:
    log.warning("auth failed", extra={"headers": {"Authorization": f"Bearer {KEY}"}, "key": KEY})


def _log_key_in_exception(log: logging.Logger) -> None:
    try:
        raise ValueError(f"unknown key {KEY}")
    except ValueError:
        log.exception("auth failed")


@pytest.mark.parametrize(
    "emit", [_log_key_in_message, _log_key_in_args, _log_key_in_extra, _log_key_in_exception]
)
@pytest.mark.parametrize("log_format", ["json", "text"])
def test_an_api_key_is_scrubbed_wherever_it_is_logged(emit: Any, log_format: str) -> None:
    cap = Capture(ObservabilitySettings(log_format=log_format))  # type: ignore[arg-type]
    try:
        emit(cap.log)
    finally:
        cap.close()
    assert cap.text
    assert KEY not in cap.text
    assert "SECRET0123456789" not in cap.text
    assert REDACTED in cap.text


def test_the_traceback_is_kept_but_scrubbed(capture: Capture) -> None:
    _log_key_in_exception(capture.log)
    (line,) = capture.lines()
    assert "Traceback (most recent call last)" in line["exc"]
    assert f"ValueError: unknown key {REDACTED}" in line["exc"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("key sk-proj-abc_DEF-12345678 end", f"key {REDACTED} end"),
        ("Authorization: Bearer abc.def", f"Authorization: {REDACTED}"),
        ("authorization=Basic dXNlcjpwYXNz, next", f"authorization={REDACTED}, next"),
        ("{'Authorization': 'Bearer x'}", f"{{'Authorization': '{REDACTED}'}}"),
        ("sent bearer eyJhbGciOi.payload.sig", f"sent bearer {REDACTED}"),
        ("/v1/ws?api_key=hunter22&x=1", f"/v1/ws?api_key={REDACTED}&x=1"),
        ('{"api_key": "hunter22", "n": 1}', f'{{"api_key": "{REDACTED}", "n": 1}}'),
        ("X-Api-Key: hunter22", f"X-Api-Key: {REDACTED}"),
        ("task-abcdefghijkl and sk-short", "task-abcdefghijkl and sk-short"),
        # a URL's password (a review found SLUICE_WAREHOUSE_URL's written whole)
        (
            "warehouse url 'http://default:hunter2@ch.internal:abc': the port",
            f"warehouse url 'http://default:{REDACTED}@ch.internal:abc': the port",
        ),
        ("clickhouse://u:p%40ss:w@h:8123/db", f"clickhouse://u:{REDACTED}@h:8123/db"),
        ('{"dsn": "https://an@alyst:pw@h"}', f'{{"dsn": "https://an@alyst:{REDACTED}@h"}}'),
        ("redis://:hunter2@h", f"redis://:{REDACTED}@h"),
        (
            "http://u@h:8123/x and https://h:8443/a@b, x:y@z",
            "http://u@h:8123/x and https://h:8443/a@b, x:y@z",
        ),
    ],
)
def test_scrub_recognises_the_usual_forms(text: str, expected: str) -> None:
    assert scrub(text) == expected


BASIC = "Basic dXNlcjpwYXNzd29yZA=="
TENANT_KEY = "tenant-key-123456"


@pytest.mark.parametrize("log_format", ["json", "text"])
def test_secrets_in_keyed_fields_are_withheld_by_their_name(log_format: str) -> None:
    """Found by a review: a dict's keys and values were scrubbed apart, and an extra's name apart from its
    value, so ``Authorization`` / ``api_key`` / a password given as a keyed field was written whole."""
    cap = Capture(ObservabilitySettings(log_format=log_format))  # type: ignore[arg-type]
    try:
        cap.log.warning(
            "headers",
            extra={
                "headers": {"Authorization": BASIC, "X-Api-Key": TENANT_KEY, "Accept": "text/plain"},
                "raw_headers": [(b"proxy-authorization", BASIC.encode()), (b"cookie", b"sid=s3ss10n-c00kie")],
                "api_key": TENANT_KEY,
                "authorization": "Token abc123secret",
                "config": {"db": {"password": "pa55w0rd-db", "user": "bob"}, "opsToken": "ops-t0ken-value"},
                "max_tokens": 512,
                "token_count": 3,
                "note": None,
            },
        )
        with log_context(kafka_sasl_password="sasl-pa55-word"):
            cap.log.warning("context")
    finally:
        cap.close()
    for secret in (
        "dXNlcjpwYXNzd29yZA",
        TENANT_KEY,
        "abc123secret",
        "pa55w0rd-db",
        "ops-t0ken-value",
        "s3ss10n",
    ):
        assert secret not in cap.text
    assert "sasl-pa55-word" not in cap.text
    if log_format == "json":
        headers, context = cap.lines()
        assert headers["headers"] == {
            "Authorization": REDACTED,
            "X-Api-Key": REDACTED,
            "Accept": "text/plain",
        }
        assert headers["raw_headers"] == [["b'proxy-authorization'", REDACTED], ["b'cookie'", REDACTED]]
        assert (headers["api_key"], headers["authorization"]) == (REDACTED, REDACTED)
        assert headers["config"] == {"db": {"password": REDACTED, "user": "bob"}, "opsToken": REDACTED}
        # names that merely contain a secret's word keep their values
        assert (headers["max_tokens"], headers["token_count"], headers["note"]) == (512, 3, None)
        assert context["kafka_sasl_password"] == REDACTED


def test_a_registered_secret_is_scrubbed_anywhere(capture: Capture) -> None:
    secret = f"tok{secrets.token_hex(8)}"
    register_secret(secret)
    register_secret(secret)  # twice is fine
    capture.log.info("connecting with %s", f"pw={secret}", extra={"dsn": f"clickhouse://u:{secret}@h"})
    assert secret not in capture.text
    (line,) = capture.lines()
    assert line["message"] == f"connecting with pw={REDACTED}"
    assert line["dsn"] == f"clickhouse://u:{REDACTED}@h"


def test_a_too_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        register_secret("ab")


def test_content_is_dropped_by_default_and_its_length_kept(capture: Capture) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    capture.log.debug("accepted", extra={"tenant": "acme", "prompt": PROMPT, "messages": messages})
    with log_context(tenant="acme"):
        capture.log.debug("finished", extra={"completion": "PURPLE-ELEPHANT-4417 said", "input": ["a", "bc"]})
    assert "PURPLE-ELEPHANT" not in capture.text
    accepted, finished = capture.lines()
    assert accepted["prompt_chars"] == len(PROMPT)
    assert accepted["messages_chars"] == len("user") + len(PROMPT)
    assert finished["completion_chars"] == len("PURPLE-ELEPHANT-4417 said")
    assert finished["input_chars"] == 3
    assert not {"prompt", "messages", "completion", "input"} & (set(accepted) | set(finished))


def test_content_is_kept_for_an_enabled_tenant_and_still_scrubbed() -> None:
    cap = Capture(ObservabilitySettings(log_content_tenants=("acme",)))
    try:
        cap.log.debug("accepted", extra={"tenant": "acme", "prompt": f"{PROMPT} {KEY}"})
        with log_context(tenant="acme"):
            cap.log.debug("finished", extra={"completion": "done"})
        cap.log.debug("other tenant", extra={"tenant": "globex", "prompt": PROMPT})
    finally:
        cap.close()
    acme, finished, globex = cap.lines()
    assert acme["prompt"] == f"{PROMPT} {REDACTED}"
    assert finished["completion"] == "done"
    assert "prompt" not in globex
    assert globex["prompt_chars"] == len(PROMPT)


def test_text_format_shows_the_fields_and_applies_the_same_rules() -> None:
    cap = Capture(ObservabilitySettings(log_format="text"))
    try:
        with log_context(request_id="r9", tenant="acme"):
            cap.log.warning("bad key %s", KEY, extra={"prompt": PROMPT, "note": "two words"})
    finally:
        cap.close()
    (line,) = cap.text.splitlines()
    assert " WARNING " in line
    assert f"bad key {REDACTED}" in line
    assert "request_id=r9 tenant=acme" in line
    assert f"prompt_chars={len(PROMPT)}" in line
    assert 'note="two words"' in line
    assert KEY not in line
    assert "PURPLE" not in line


def test_a_broken_log_call_does_not_leak_its_arguments() -> None:
    # formatted directly: pytest's own capture handler would raise on the bad call first
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "key %s %s", (KEY,), None)
    line = json.loads(make_formatter(ObservabilitySettings(), "svc").format(record))
    assert line["message"].startswith("key %s %s [unformattable arguments:")
    assert KEY not in json.dumps(line)


@pytest.fixture
def pristine_root() -> Iterator[logging.Logger]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    noisy = {name: logging.getLogger(name).level for name in NOISY_LOGGERS + ERRORS_ONLY_LOGGERS}
    yield root
    for handler in root.handlers:
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    for name, noisy_level in noisy.items():
        logging.getLogger(name).setLevel(noisy_level)


def test_configure_logging_is_idempotent(pristine_root: logging.Logger) -> None:
    before = list(pristine_root.handlers)
    configure_logging(ObservabilitySettings(log_level="debug"), "edge")
    configure_logging(ObservabilitySettings(log_level="warning", log_format="text"), "edge")
    added = [h for h in pristine_root.handlers if h not in before]
    assert len(added) == 1
    assert pristine_root.level == logging.WARNING
    assert added[0].formatter is not None
    assert type(added[0].formatter).__name__ == "TextFormatter"
    assert all(logging.getLogger(name).level == logging.WARNING for name in NOISY_LOGGERS)


def test_opentelemetrys_warnings_about_what_callers_send_are_not_logged(
    pristine_root: logging.Logger, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by review: OpenTelemetry logs each malformed ``tracestate`` member whole at WARNING, so anyone
    who reached the edge could write ~8 KB of their own bytes per request. Its loggers are held at ERROR
    (``monitoring.tracing`` also drops such a header unparsed: this is the net under it)."""
    from opentelemetry.trace.span import TraceState

    configure_logging(ObservabilitySettings(log_level="debug"), "edge")
    caplog.set_level(logging.DEBUG)
    junk = "A" * 7000
    assert TraceState.from_header([junk]) == TraceState()  # what a caller's header reaches in the API
    assert [r for r in caplog.records if junk in r.getMessage()] == []
    logging.getLogger("opentelemetry.sdk.trace.export").error("exporter down")
    assert [r.getMessage() for r in caplog.records] == ["exporter down"]  # errors still come through
