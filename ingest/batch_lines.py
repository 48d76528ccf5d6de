"""The lines of a batch: parse and check an input line, turn it into the request it runs as, and write its
output or error line. Pure functions; the batch runner (:mod:`ingest.batches`) does the I/O.

An input line is OpenAI's ``{"custom_id", "method": "POST", "url", "body"}``; ``body`` is exactly what the
online endpoint takes, and goes through the same :class:`~ingest.prepare.Preparer` (validation and
tokenising), so a line is refused for what a direct call would be refused for. A line's request id is
derived from the batch, the line and the attempt: publishing the same line twice (after an edge restart)
publishes the same request, which workers run once.
"""

from __future__ import annotations

from typing import Any

import msgspec

from ingest.auth import Tenant
from ingest.errors import IngestError, from_finished
from ingest.openai import error_param
from ingest.prepare import ENDPOINTS, Kind, Preparer, Shape
from ingest.render import final_body
from schemas.codec import UNREADABLE_JSON, unreadable_json
from schemas.events import (
    BatchItemRequested,
    BatchLineError,
    BatchRef,
    BatchStateChanged,
    Endpoint,
    GenerationRequested,
    RequestFinished,
    SamplingParams,
)
from schemas.ids import derive_seed, derived_uuid7, uuid7

KINDS: dict[str, Kind] = {endpoint: kind for kind, endpoint in ENDPOINTS.items()}
BATCH_PRIORITY = 100
"""Batch lines run in the workers' batch class (priority > 0): after every interactive request, before
shadow copies (:data:`ingest.prepare.SHADOW_PRIORITY`)."""
MAX_CUSTOM_ID = 512
BASE64 = 1
"""A line's flag: its embeddings are wanted as base64 (``encoding_format``)."""
UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")
"""How a UTF-16 file begins (little- and big-endian): its lines are said to be UTF-16, not "not JSON"."""


class InputLine(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    custom_id: str
    method: str
    url: str
    body: msgspec.Raw


class _BodyHints(msgspec.Struct, frozen=True):
    model: str | None = None
    seed: int | None = None
    encoding_format: str | None = None


_LINE = msgspec.json.Decoder(InputLine)
_HINTS = msgspec.json.Decoder(_BodyHints)


class LineError(Exception):
    """A line that cannot run, with OpenAI's code and param."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param

    def at(self, line: int) -> BatchLineError:
        return BatchLineError(code=self.code, message=self.message, line=line, param=self.param)


class Parsed(msgspec.Struct, frozen=True):
    custom_id: str
    body: bytes
    model: str
    seed_given: bool
    flags: int


ECHO_CHARS = 100
"""The most of a line's own value an error message quotes: a 100 KB ``url`` was quoted whole, in each of a
batch's reported errors, into its state (10 MB, past what a record may carry: an audit)."""


def echo(value: str) -> str:
    """``value`` quoted for an error message, cut to :data:`ECHO_CHARS`."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value):,} characters)"


def parse_line(raw: bytes, endpoint: Endpoint) -> Parsed:
    """The line's parts, checked as far as they can be without the model (:class:`LineError` otherwise)."""
    try:
        line = _LINE.decode(raw)
    except msgspec.ValidationError as exc:
        raise LineError("invalid_request", f"Invalid line: {exc}.") from None
    except UNREADABLE_JSON as exc:
        if raw.startswith(UTF16_BOMS):  # the file's first line, and every other line unreadable too
            raise LineError(
                "invalid_json_line",
                "This line is not valid JSON: the file is UTF-16 (it begins with a UTF-16 byte-order mark), "
                "which is not supported; save it as UTF-8.",
            ) from None
        raise LineError(
            "invalid_json_line", f"This line is not valid JSON: {unreadable_json(exc, raw)}."
        ) from None
    if not line.custom_id or len(line.custom_id) > MAX_CUSTOM_ID:
        raise LineError(
            "invalid_custom_id", f"custom_id must be 1 to {MAX_CUSTOM_ID} characters.", "custom_id"
        )
    if line.method.upper() != "POST":
        raise LineError("invalid_method", f"method must be POST, not {echo(line.method)}.", "method")
    if line.url != endpoint:
        raise LineError(
            "mismatched_endpoint",
            f"The url {echo(line.url)} does not match the batch's endpoint {endpoint!r}.",
            "url",
        )
    body = bytes(line.body)
    try:
        hints = _HINTS.decode(body)
    except msgspec.ValidationError as exc:
        field = error_param(str(exc))
        if field is None:  # not an object at all
            raise LineError(
                "invalid_request", "body must be a JSON object of the endpoint's request.", "body"
            ) from None
        # a field of the wrong type, said as the endpoint says it (it said "not a JSON object": a review)
        raise LineError("invalid_value", f"Invalid request body: {exc}", field) from None
    except UNREADABLE_JSON:
        raise LineError(
            "invalid_request", "body must be a JSON object of the endpoint's request.", "body"
        ) from None
    if not hints.model:
        raise LineError("invalid_request", "body.model is required.", "body.model")
    flags = BASE64 if hints.encoding_format == "base64" else 0
    return Parsed(line.custom_id, body, hints.model, hints.seed is not None, flags)


def item_request_id(batch: BatchStateChanged, index: int, attempt: int) -> str:
    """The request id of a line's attempt: a UUIDv7 at the batch's creation time (so facts sort by it),
    its random bits a hash of batch, line and attempt."""
    return derived_uuid7(int(batch.created_at.timestamp() * 1000), f"{batch.batch_id}:{index}:{attempt}")


def line_request(
    preparer: Preparer,
    tenant: Tenant,
    batch: BatchStateChanged,
    parsed: Parsed,
    index: int,
    attempt: int,
    source: str,
) -> BatchItemRequested:
    """The event that runs line ``index`` (its ``attempt``): validated and tokenised as a direct call of the
    same body would be (:class:`LineError` where that call would get a 4xx). An error that the same call
    may not get a little later (its ``retriable``: the model is being redeployed, 503) is raised as it is:
    the line is not wrong, it waits."""
    kind = KINDS[batch.endpoint]
    try:
        prepared = preparer.prepare_sync(kind, parsed.body, tenant, None, None)
    except IngestError as exc:
        if exc.retriable:
            raise
        raise LineError(exc.code or "invalid_request", exc.message, exc.param) from None
    if prepared.event.model != batch.model and batch.model:
        raise LineError(
            "mismatched_model",
            f"Every line of a batch names one model; this one names {echo(parsed.model)}.",
            "body.model",
        )
    request_id = item_request_id(batch, index, attempt)
    event = msgspec.structs.replace(
        prepared.event,
        id=uuid7(),
        request_id=request_id,
        source=source,
        deadline=batch.expires_at,
        reply=None,
        idempotency_key=None,
        priority=BATCH_PRIORITY,
    )
    if isinstance(event, GenerationRequested) and not parsed.seed_given:
        # The same line samples the same tokens however often it is published or retried.
        sampling: SamplingParams = msgspec.structs.replace(event.sampling, seed=derive_seed(request_id))
        event = msgspec.structs.replace(event, sampling=sampling)
    ref = BatchRef(batch_id=batch.batch_id, custom_id=parsed.custom_id, index=index, attempt=attempt)
    return BatchItemRequested.of(event, ref, total=max(1, batch.counts.total), endpoint=batch.endpoint)


def _line_id(request_id: str) -> str:
    return "batch_req_" + request_id.replace("-", "")


def output_line(
    finished: RequestFinished, ref: BatchRef, endpoint: Endpoint, flags: int
) -> tuple[bool, bytes]:
    """(completed, the line for the output file, or for the error file when it did not complete)."""
    error = from_finished(finished)
    if error is None:
        shape = Shape(
            kind=KINDS[endpoint],
            model=finished.model,
            request_id=finished.request_id,
            fingerprint=finished.model_version,
            encoding_format="base64" if flags & BASE64 else "float",
        )
        status, body = 200, final_body(shape, finished.text or "", finished)
    else:
        status, body = error.status, {"error": _error_object(error)}
    line = {
        "id": _line_id(finished.request_id),
        "custom_id": ref.custom_id,
        "response": {"status_code": status, "request_id": finished.request_id, "body": body},
        "error": None,
    }
    return error is None, msgspec.json.encode(line)


def _error_object(error: IngestError) -> dict[str, Any]:
    return {"message": error.message, "type": error.error_type, "param": error.param, "code": error.code}


def unrun_line(
    batch: BatchStateChanged, index: int, custom_id: str, attempt: int, code: str, message: str
) -> bytes:
    """The error line of a line that never ran to the end (the batch expired or was cancelled first)."""
    line = {
        "id": _line_id(item_request_id(batch, index, attempt)),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return msgspec.json.encode(line)
