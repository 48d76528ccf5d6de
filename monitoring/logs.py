"""Structured, secret-safe logs: one JSON object per line (or readable text), with request context.

Call :func:`configure_logging` once per process (again is harmless: it reconfigures its own handler, it
never adds a second one). Code logs with the standard library, as everywhere else::

    log = logging.getLogger(__name__)
    with log_context(request_id=rid, tenant=tenant.name, model=model):
        log.debug("request accepted", extra={"prompt": prompt})

The contract of a formatted record (:class:`JsonFormatter`; :class:`TextFormatter` shows the same fields):

- always ``time`` (RFC 3339, UTC, milliseconds), ``level``, ``logger``, ``message`` (after %-formatting),
  ``service``;
- when known ``request_id``, ``tenant``, ``model`` and any other field of the enclosing
  :func:`log_context` (a ``contextvars`` value, so asyncio tasks created inside inherit it; threads do
  not), overridden by the record's own ``extra={...}`` fields;
- ``trace_id``/``span_id`` of the current OpenTelemetry span when it is valid, else parsed from a
  ``traceparent`` record attribute (``extra={"traceparent": event.traceparent}``);
- ``exc`` (formatted traceback) and ``stack`` when the record has them;
- every other ``extra`` attribute as a field of its own; values that are not JSON (str, int, float,
  bool, None, lists and str-keyed dicts of those) are written as their ``repr``. An extra named like a
  fixed field (``time``, ``level`` …) is written as ``extra_<name>``.

Content: the attributes ``prompt``, ``completion``, ``messages`` and ``input`` hold users' data. They are
written only when the record's tenant is in ``ObservabilitySettings.log_content_tenants``; otherwise each
is replaced by ``<name>_chars``, the number of characters of text it held.

Secrets: every string written (message, extra fields, content, traceback) goes through :func:`scrub`,
which replaces OpenAI-style keys (``sk-`` + 8 or more of ``[A-Za-z0-9_-]``), ``Bearer <token>``, the
value of ``Authorization: …`` and of ``api_key=…`` / ``"api_key": "…"`` (also ``api-key``, ``apikey``),
the password of a URL (``scheme://user:password@host``), and every exact value given to
:func:`register_secret`, with ``[REDACTED]``. A field, dict key or ``(name, value)`` tuple whose name says
it holds a secret (:func:`secret_name`: ``authorization``, ``x-api-key``, ``password``, ``ops_token``,
``cookie`` …) has its whole value replaced. Scrubbing is a safety net for mistakes, not a licence to log
secrets: content written into the *message* (``log.info("%s", prompt)``) is not recognised as content,
only secrets are.
"""

from __future__ import annotations

import contextvars
import logging
import re
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TextIO

import msgspec
from opentelemetry import trace

from monitoring.settings import ObservabilitySettings

__all__ = [
    "CONTENT_FIELDS",
    "REDACTED",
    "JsonFormatter",
    "TextFormatter",
    "configure_logging",
    "log_context",
    "make_formatter",
    "register_secret",
    "scrub",
    "secret_name",
]

REDACTED = "[REDACTED]"
CONTENT_FIELDS = frozenset({"prompt", "completion", "messages", "input"})
NOISY_LOGGERS = ("aiokafka", "faust", "mode", "urllib3", "httpx", "httpcore", "asyncio")
ERRORS_ONLY_LOGGERS = ("opentelemetry",)
"""Loggers held at ERROR. OpenTelemetry warns about what others send: each malformed ``tracestate`` member
of a caller's header or an event, whole (``monitoring.tracing`` drops those before they are parsed, and
this is the safety net), a tracestate too long or with too many members. Anyone who can connect could
otherwise fill the log (a review: 7 KB per unauthenticated request)."""
MIN_SECRET_CHARS = 4

_FIXED = ("time", "level", "logger", "message", "service")
_CONTEXT_ORDER = ("request_id", "tenant", "model", "trace_id", "span_id")
# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message",
    "asctime",
    "taskName",
}
_MAX_DEPTH = 4

# --- secrets -------------------------------------------------------------------------------------------

_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    # the whole value of an Authorization header / field, whatever its scheme
    (re.compile(r"""(?i)(authorization["']?\s*[:=]\s*["']?)[^"'\r\n,;}&]+"""), rf"\g<1>{REDACTED}"),
    (re.compile(r"""(?i)(api[_-]?key["']?\s*[:=]\s*["']?)[^\s"',;}&]+"""), rf"\g<1>{REDACTED}"),
    (re.compile(r"(?i)\b(bearer\s+)[A-Za-z0-9._~+/=-]+"), rf"\g<1>{REDACTED}"),
    (re.compile(r"(?<![A-Za-z0-9])sk-[A-Za-z0-9_-]{8,}"), REDACTED),
    # a URL's password (user-info after the first ':', up to its last '@'): a review found
    # SLUICE_WAREHOUSE_URL's written whole. The user part may hold '@' as the URL parser reads it.
    (re.compile(r"""(?i)\b([a-z][a-z0-9+.-]*://[^\s/?#:"'<>]*:)[^\s/?#"<>\\]*@"""), rf"\g<1>{REDACTED}@"),
)
# Field and key names whose whole value is a secret, matched on the name in snake case ("X-Api-Key",
# "apiKey" -> x_api_key, api_key): by its last word, so ``ops_token`` is one and ``max_tokens`` is not.
_SECRET_NAME = re.compile(
    r"(?:^|_)(?:authorization|api_?key|(?:secret|private|access)_?key|passw(?:or)?d|token|secrets?|cookies?"
    r"|credentials?)$"
)
_CAMEL_HUMP = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_NAME_SEPARATORS = re.compile(r"[-.\s]+")
_registered: set[str] = set()
_registered_pattern: re.Pattern[str] | None = None
_registered_lock = threading.Lock()


def register_secret(value: str) -> None:
    """Scrub ``value`` wherever it appears in any log line of this process from now on.

    Raises ``ValueError`` for values under ``MIN_SECRET_CHARS`` characters (they would shred every line).
    """
    global _registered_pattern
    if len(value) < MIN_SECRET_CHARS:
        raise ValueError(f"a secret to scrub needs at least {MIN_SECRET_CHARS} characters")
    with _registered_lock:
        if value in _registered:
            return
        _registered.add(value)
        # longest first, so a secret that contains another is replaced whole
        alternatives = "|".join(re.escape(s) for s in sorted(_registered, key=len, reverse=True))
        _registered_pattern = re.compile(alternatives)


def scrub(text: str) -> str:
    """``text`` with every recognised or registered secret replaced by ``[REDACTED]``."""
    registered = _registered_pattern
    if registered is not None:
        text = registered.sub(REDACTED, text)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


def secret_name(name: object) -> bool:
    """Whether a field, dict key or header called ``name`` (str or bytes) holds a secret, whatever its
    value looks like. :func:`scrub` sees a key and its value apart, so a review found
    ``extra={"headers": {"Authorization": "Basic …"}}`` and ``extra={"api_key": "…"}`` written as they were."""
    if isinstance(name, bytes):
        name = name.decode("latin-1")
    if not isinstance(name, str):
        return False
    snake = _NAME_SEPARATORS.sub("_", _CAMEL_HUMP.sub("_", name)).lower()
    return _SECRET_NAME.search(snake) is not None


# --- request context -----------------------------------------------------------------------------------

_NO_FIELDS: Mapping[str, object] = MappingProxyType({})
_context: contextvars.ContextVar[Mapping[str, object]] = contextvars.ContextVar(
    "sluice_log_context", default=_NO_FIELDS
)


@contextmanager
def log_context(**fields: object) -> Iterator[None]:
    """Add ``fields`` (``request_id``, ``tenant``, ``model`` …) to every record logged inside the block,
    including from asyncio tasks created inside it. Fields given as ``None`` are left out; nested blocks
    add to (and may override) the outer one's fields."""
    merged = {**_context.get(), **{k: v for k, v in fields.items() if v is not None}}
    token = _context.set(merged)
    try:
        yield
    finally:
        _context.reset(token)


# --- formatting ----------------------------------------------------------------------------------------

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")


def _trace_ids(traceparent: object) -> tuple[str, str] | None:
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        return format(span_context.trace_id, "032x"), format(span_context.span_id, "016x")
    if isinstance(traceparent, str) and (match := _TRACEPARENT.match(traceparent)):
        return match.group(1), match.group(2)
    return None


def _jsonable(value: object, depth: int = 0) -> object:
    """``value`` as JSON-able data with every string scrubbed, and the value of every key (or ``(name,
    value)`` pair, as headers come) named like a secret withheld; anything else as its scrubbed ``repr``."""
    if isinstance(value, str):
        return scrub(value)
    if value is None or isinstance(value, bool | int | float):
        return value
    if depth < _MAX_DEPTH:
        if isinstance(value, tuple) and len(value) == 2 and secret_name(value[0]):
            return [_jsonable(value[0], depth + 1), _withheld(value[1])]
        if isinstance(value, list | tuple):
            return [_jsonable(v, depth + 1) for v in value]
        if isinstance(value, dict):
            return {
                scrub(str(k)): _withheld(v) if secret_name(k) else _jsonable(v, depth + 1)
                for k, v in value.items()
            }
    return scrub(repr(value))


def _withheld(value: object) -> object:
    """A secret-named field's value: ``[REDACTED]``, unless there is nothing to hide (None)."""
    return None if value is None else REDACTED


def _chars(value: object, depth: int = 0) -> int:
    """Characters of text in a content value (a string, or the strings inside messages)."""
    if isinstance(value, str):
        return len(value)
    if depth < _MAX_DEPTH:
        if isinstance(value, list | tuple):
            return sum(_chars(v, depth + 1) for v in value)
        if isinstance(value, dict):
            return sum(_chars(v, depth + 1) for v in value.values())
    return 0 if value is None else len(repr(value))


class JsonFormatter(logging.Formatter):
    """One JSON object per record, per the module's contract."""

    def __init__(self, settings: ObservabilitySettings, service: str) -> None:
        super().__init__()
        self.service = service
        self.content_tenants = frozenset(settings.log_content_tenants)

    def fields(self, record: logging.LogRecord) -> dict[str, object]:
        """The record's fields, scrubbed, content dropped unless its tenant allows it."""
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")[:-6] + "Z",
            "level": record.levelname,
            "logger": record.name,
            "message": scrub(_message(record)),
            "service": self.service,
        }
        extra = {k: v for k, v in record.__dict__.items() if k not in _RECORD_ATTRS}
        traceparent = extra.pop("traceparent", None)
        context = {**_context.get(), **extra}
        ids = _trace_ids(traceparent)
        if ids is not None:
            context.setdefault("trace_id", ids[0])
            context.setdefault("span_id", ids[1])
        show_content = context.get("tenant") in self.content_tenants
        ordered = [k for k in _CONTEXT_ORDER if k in context] + [
            k for k in context if k not in _CONTEXT_ORDER
        ]
        for key in ordered:
            value = context[key]
            if key in CONTENT_FIELDS and not show_content:
                out[f"{key}_chars"] = _chars(value)
            else:
                shown = _withheld(value) if secret_name(key) else _jsonable(value)
                out[f"extra_{key}" if key in _FIXED else key] = shown
        if record.exc_info:
            out["exc"] = scrub(self.formatException(record.exc_info))
        elif record.exc_text:
            out["exc"] = scrub(record.exc_text)
        if record.stack_info:
            out["stack"] = scrub(self.formatStack(record.stack_info))
        return out

    def format(self, record: logging.LogRecord) -> str:
        return msgspec.json.encode(self.fields(record)).decode()


class TextFormatter(JsonFormatter):
    """``<time> <LEVEL> <logger>: <message> key=value …`` and the traceback below; same fields, same
    redaction as JSON."""

    def format(self, record: logging.LogRecord) -> str:
        fields = self.fields(record)
        head = (
            f"{fields.pop('time')} {fields.pop('level'):<7} {fields.pop('logger')}: {fields.pop('message')}"
        )
        fields.pop("service")
        exc, stack = fields.pop("exc", None), fields.pop("stack", None)
        pairs = " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        lines = [f"{head}  {pairs}" if pairs else head]
        lines += [str(x) for x in (exc, stack) if x]
        return "\n".join(lines)


def _text_value(value: object) -> str:
    text = value if isinstance(value, str) else msgspec.json.encode(value).decode()
    return (
        text
        if text and not any(c.isspace() or c == '"' for c in text)
        else msgspec.json.encode(text).decode()
    )


def _message(record: logging.LogRecord) -> str:
    try:
        return record.getMessage()
    except Exception:  # a broken log call must not take its arguments to stderr via handleError
        return f"{record.msg!s} [unformattable arguments: {record.args!r}]"


def make_formatter(settings: ObservabilitySettings, service: str) -> JsonFormatter:
    """The formatter ``settings.log_format`` names."""
    cls = TextFormatter if settings.log_format == "text" else JsonFormatter
    return cls(settings, service)


class _SluiceHandler(logging.StreamHandler[TextIO]):
    """The one handler :func:`configure_logging` owns on the root logger."""


def configure_logging(settings: ObservabilitySettings, service: str) -> None:
    """Log to stderr through :func:`make_formatter` at ``settings.log_level``; quiet chatty libraries
    (``NOISY_LOGGERS`` to WARNING, ``ERRORS_ONLY_LOGGERS`` to ERROR).

    Idempotent: a second call replaces the formatter and level of the handler the first one installed.
    Handlers others put on the root logger are left alone (so do not combine this with
    ``logging.basicConfig``: its handler would write unscrubbed lines).
    """
    root = logging.getLogger()
    handler = next((h for h in root.handlers if isinstance(h, _SluiceHandler)), None)
    if handler is None:
        handler = _SluiceHandler(sys.stderr)
        root.addHandler(handler)
    handler.setFormatter(make_formatter(settings, service))
    root.setLevel(settings.log_level.upper())
    for name in NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    for name in ERRORS_ONLY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
