"""Events to and from Kafka records: JSON values, CloudEvents binary-mode headers, partition keys.

``decode`` either returns a whole, validated event of its concrete type or raises :class:`DecodeError`;
consumers catch that one class and dead-letter the record.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

import msgspec

from schemas.events import (
    BATCH_KEY_SPREAD,
    EVENT_TYPES,
    BatchItemRequested,
    BatchStateChanged,
    BudgetStateChanged,
    BurnRateCrossed,
    DeadLetter,
    DeploymentChanged,
    DriftRebaselined,
    DriftReport,
    Envelope,
    Event,
    PricesChanged,
    WorkerReady,
    WorkersScaled,
    event_type_name,
)

__all__ = [
    "CE_TYPE_PREFIX",
    "EVENT_TYPES",
    "UNREADABLE_JSON",
    "DecodeError",
    "Event",
    "HeaderValue",
    "ce_type",
    "decode",
    "encode",
    "event_type_name",
    "headers",
    "kafka_key",
    "unreadable_json",
]

CE_TYPE_PREFIX = "dev.sluicegate."
CONTENT_TYPE = "application/json"

HeaderValue = bytes | str | None

# Headers that restate the body; decode rejects a record where one of them disagrees.
_CHECKED_HEADERS = frozenset(
    {"ce_specversion", "ce_id", "ce_type", "ce_subject", "ce_tenant", "ce_model", "content-type"}
)

_ENCODER = msgspec.json.Encoder(order="deterministic")
_DECODER: msgspec.json.Decoder[Event] = msgspec.json.Decoder(Event)


class DecodeError(ValueError):
    """A record is not a valid event: bad JSON, unknown type, missing or mistyped field, or its headers
    disagree with its body."""


UNREADABLE_JSON: tuple[type[Exception], ...] = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)
"""What msgspec raises for bytes it cannot read as JSON, besides a well-formed value of the wrong shape
(``msgspec.ValidationError``, a ``DecodeError`` subclass: catch it first where it means something else):
malformed JSON, a string that is not UTF-8 (``UnicodeDecodeError``, which is not a ``DecodeError``), and
nesting deeper than its decoder recurses (``RecursionError``, even inside a field it skips)."""


_LONE_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F][0-9a-fA-F]{2})")
"""A high surrogate escape with no low one after it: what msgspec reports as "Input data was truncated" (a
lone low one it names itself)."""


def unreadable_json(exc: Exception, data: bytes | str | None = None) -> str:
    """Why msgspec could not read some JSON (one of :data:`UNREADABLE_JSON`), for an error message;
    ``data``, the JSON, names a lone surrogate escape, which msgspec calls "Input data was truncated"."""
    if isinstance(exc, UnicodeDecodeError):
        return "a string in it is not UTF-8"
    if isinstance(exc, RecursionError):
        return "it is nested too deeply"
    if data is not None and str(exc) == "Input data was truncated":
        text = data if isinstance(data, str) else data.decode("utf-8", "replace")
        if found := _LONE_SURROGATE.search(text):
            return f"a string in it has {found.group()}, half of a surrogate pair: not a character"
    return str(exc)


@functools.cache
def ce_type(cls: type[Envelope]) -> str:
    """The CloudEvents type of an event class, e.g. ``dev.sluicegate.token_chunk.v1``."""
    return f"{CE_TYPE_PREFIX}{event_type_name(cls)}.v{cls.schema_version}"


TOPIC_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Every platform topic's ``max.message.bytes`` (:func:`infra.topics.platform_topics`): the largest record
batch a broker takes for it. 8 MiB is the ceiling managed clusters allow (Confluent Cloud's standard and basic
clusters), and holds a terminal event of 2,048 MiniLM vectors (4.2 MB as packed float32): the most inputs an
OpenAI embeddings request may carry. Kafka's default (1 MB) held 480."""
MAX_RECORD_BYTES = TOPIC_MAX_MESSAGE_BYTES - 64 * 1024
"""The most a producer writes in one record (librdkafka's ``message.max.bytes``, which
:func:`bus.producer.producer_config` sets to this): what a terminal event must fit. Under the topics' limit by
the record batch's framing, so a record the producer takes is one the broker takes."""
RECORD_HEADROOM_BYTES = 4096
"""Room under :data:`MAX_RECORD_BYTES` for an encoded event's key, headers, record framing and what is
added on its way out (a request's trace context)."""


def record_size(value: bytes, key: bytes = b"", head: Sequence[tuple[str, bytes]] = ()) -> int:
    """An encoded event's bytes in a record with its key and headers (the event's tenant, request id and
    trace context may be long enough together to push a value just under the limit over it, which the
    producer then refused)."""
    return len(value) + len(key) + sum(len(name) + len(data) for name, data in head)


def fits_record(value: bytes, key: bytes = b"", head: Sequence[tuple[str, bytes]] = ()) -> bool:
    """Whether an encoded event fits one log record with the key and headers it is written with."""
    return record_size(value, key, head) <= MAX_RECORD_BYTES - RECORD_HEADROOM_BYTES


def encode(event: Event) -> bytes:
    """The record value: compact JSON, fields in declaration order, dict keys sorted."""
    return _ENCODER.encode(event)


def _rfc3339(event: Envelope) -> bytes:
    # The same text as the body's "time" (msgspec writes UTC as "Z"), without the quotes.
    return _ENCODER.encode(event.time)[1:-1]


def headers(event: Event) -> list[tuple[str, bytes]]:
    """CloudEvents 1.0 Kafka binary-binding headers, plus W3C trace context when the event has one."""
    out = [
        ("ce_specversion", b"1.0"),
        ("ce_id", event.id.encode()),
        ("ce_type", ce_type(type(event)).encode()),
        ("ce_source", event.source.encode()),
        ("ce_time", _rfc3339(event)),
    ]
    if event.request_id:
        out.append(("ce_subject", event.request_id.encode()))
    out += [
        ("content-type", CONTENT_TYPE.encode()),
        ("ce_tenant", event.tenant.encode()),
        ("ce_model", event.model.encode()),
    ]
    if event.traceparent is not None:
        out.append(("traceparent", event.traceparent.encode()))
    if event.tracestate is not None:
        out.append(("tracestate", event.tracestate.encode()))
    return out


def decode(
    value: bytes | bytearray | memoryview | None,
    headers: Sequence[tuple[str, HeaderValue]] | None = None,
) -> Event:
    """The event in a record value, checked against the record's headers when given."""
    if not value:  # None, or b"" where a reader keeps bytes (the streams sink and replay): no event
        raise DecodeError("record has no value (a tombstone?)")
    try:
        event = _DECODER.decode(value)
    except msgspec.ValidationError as exc:
        raise DecodeError(f"invalid event: {exc}") from exc
    except UNREADABLE_JSON as exc:  # junk, not a consumer's death (a record is redelivered until it ends)
        raise DecodeError(f"malformed event JSON: {unreadable_json(exc)}") from exc
    if headers is not None:
        _check_headers(event, headers)
    return event


def _check_headers(event: Event, received: Sequence[tuple[str, HeaderValue]]) -> None:
    expected = dict(headers(event))
    for key, raw in received:
        if key not in _CHECKED_HEADERS:
            continue
        got = raw.encode() if isinstance(raw, str) else raw
        want = expected.get(key)
        if key == "content-type" and got is not None:
            got = got.split(b";", 1)[0].strip().lower()
        if got != want:
            shown = want.decode() if want is not None else "no such header"
            raise DecodeError(
                f"header {key}={got!r} disagrees with the {event_type_name(type(event))} body "
                f"(expected {shown!r})"
            )


def kafka_key(event: Event) -> bytes:
    """The partition key: the tenant for request-scoped events; a compaction key for control state."""
    match event:
        case BudgetStateChanged():
            return f"budget:{event.tenant}".encode()
        case DeploymentChanged():
            return f"deployment:{event.model}".encode()
        case BurnRateCrossed():
            # one key per window pair: the compacted topic keeps each pair's latest crossing (the slow
            # pair's resolving must not compact away the fast pair's firing)
            return f"burn:{event.model}:{event.slo}:{event.window}".encode()
        case WorkersScaled():
            return f"scale:{event.model}".encode()
        case WorkerReady():
            return f"ready:{event.model}:{event.version}".encode()
        case DriftRebaselined():
            return f"rebaseline:{event.model}:{event.version}".encode()
        case PricesChanged():  # a key per version: compaction keeps every table ever published
            return f"prices:{event.prices.version}".encode()
        case DriftReport():
            return f"drift:{event.model}".encode()
        case DeadLetter():
            return f"{event.source_topic}:{event.partition}".encode()
        case BatchStateChanged():
            return f"batch:{event.batch_id}".encode()
        case BatchItemRequested():
            return f"batch:{event.batch_id}:{event.index % BATCH_KEY_SPREAD}".encode()
        case _:
            return event.tenant.encode()
