"""A terminal event on its way to the log: what the request said copied in, its drift features for the
results copy, the ``failed`` event that replaces one too large for a record, and the results tail's reading
of whose terminal event a record is without decoding it."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import msgspec
from confluent_kafka import Message

from bus.consumer import UnreadableHeaders, record_headers
from gpu_workers.features import FeatureProbe, Vector
from gpu_workers.runtime import Request
from schemas.codec import MAX_RECORD_BYTES, DecodeError, ce_type, decode, encode, fits_record
from schemas.events import EmbeddingRequested, ErrorInfo, GenerationRequested, RequestFinished, Usage

log = logging.getLogger(__name__)


def with_request(
    result: RequestFinished,
    event: Request,
    context: tuple[str, str | None] | None = None,
    version: str = "",
) -> RequestFinished:
    """The terminal event with what the request said copied in (alone, it is the request's fact row),
    and the trace context of its ``publish`` span when there is one; one copy of the event. The model
    version is the one that ran it (``version``), which differs from the routed one when it was adopted."""
    kind: Literal["chat", "completion", "embedding"] = (
        "embedding" if isinstance(event, EmbeddingRequested) else "chat" if event.chat else "completion"
    )
    traceparent, tracestate = context if context is not None else (result.traceparent, result.tracestate)
    return msgspec.structs.replace(
        result,
        traceparent=traceparent,
        tracestate=tracestate,
        model_version=version or event.model_version,
        shadow_of=event.shadow_of,
        kind=kind,
        stream=isinstance(event, GenerationRequested) and event.stream,
        edge_id=event.reply.edge_id if event.reply is not None else "",
        idempotency_key=event.idempotency_key,
    )


def with_features(
    probe: FeatureProbe,
    event: Request,
    result: RequestFinished,
    value: bytes,
    key: bytes = b"",
    head: Sequence[tuple[str, bytes]] = (),
    vector: Vector | None = None,
) -> bytes:
    """The results copy of a terminal event (encoded as ``value``) with its drift features (``vector``: its
    sampled prompt's embedding), or as it was where they fail or would not fit in one record: they describe
    the request, they must never keep it from ending."""
    try:
        described = encode(msgspec.structs.replace(result, features=probe.features(event, result, vector)))
    except Exception:
        log.exception("drift features of %s failed", event.request_id)
        return value
    if not fits_record(described, key, head):
        log.warning("drift features of %s left out: the event would not fit one record", event.request_id)
        return value
    return described


_FINISHED_TYPE = ce_type(RequestFinished).encode()


def finished_by(message: Message, model_id: str, *, skip_source: str | None = None) -> str | None:
    """The request id of a terminal event of ``model_id`` on the results topic, else None.

    Read from the record's CloudEvents headers (type, model, subject) without decoding the body: every
    worker tails every result, and a body holds the whole text or every vector. A record without those
    headers (written by another tool), or whose subject or a header key is not UTF-8, is decoded. One whose ``ce_source``
    is ``skip_source`` (this worker's own results, remembered when it published them) is skipped."""
    try:
        head = record_headers(message)
    except UnreadableHeaders:
        head = []  # not headers this platform wrote: the body says whose it is (a review: it stopped the tail)
    found = {
        key: value.encode() if isinstance(value, str) else value
        for key, value in head
        if key.startswith("ce_") and value is not None
    }
    kind, model, subject = found.get("ce_type"), found.get("ce_model"), found.get("ce_subject")
    if kind is not None and model is not None and subject is not None:
        if kind != _FINISHED_TYPE or model != model_id.encode():
            return None
        if skip_source is not None and found.get("ce_source") == skip_source.encode():
            return None
        try:
            return subject.decode()
        except UnicodeDecodeError:
            pass  # not a subject this platform wrote: the body says whose it is, if anyone's
    try:
        event = decode(message.value() or b"")
    except DecodeError:
        return None
    if not isinstance(event, RequestFinished) or event.model != model_id:
        return None
    return None if event.source == skip_source else event.request_id


def too_large(result: RequestFinished, size: int) -> RequestFinished:
    """The ``failed`` terminal event that replaces one too large for the log: no text, no vectors,
    nothing billed; the message says how large the result was and what to do."""
    return msgspec.structs.replace(
        result,
        status="failed",
        finish_reason="error",
        text=None,
        embeddings=None,
        embeddings_f32=None,
        usage=Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0),
        error=ErrorInfo(
            code="result_too_large",
            message=f"the result ({size:,} bytes) does not fit one {MAX_RECORD_BYTES:,}-byte record of the "
            "event log; ask for fewer inputs or tokens per request",
        ),
    )
