"""The edge's one exception root, and its mapping to HTTP statuses and OpenAI's error shape.

Everything the edge reports to a client is an :class:`IngestError`. Each subclass carries its HTTP status,
OpenAI ``type`` and default ``code`` here and nowhere else; handlers raise, the middleware (HTTP), the SSE
writer and the WebSocket session render with :func:`error_body` / :func:`error_response`.
Gateways (Kafka or fake) raise :class:`GatewayUnavailable` when they cannot publish or read.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import msgspec
from aiohttp import web

from schemas.events import RequestFinished


class IngestError(Exception):
    """Root of every error the edge raises. Unexpected ones are 500 ``server_error``."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    retriable: ClassVar[bool] = False

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param


class InvalidRequest(IngestError):
    status = 400
    error_type = "invalid_request_error"


class MalformedHttp(InvalidRequest):
    """A request that cannot be parsed as HTTP (``ingest/protocol.py``)."""

    default_code = "malformed_http"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"


class AuthenticationFailed(IngestError):
    status = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class NotFound(IngestError):
    status = 404
    error_type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class HostNotAllowed(IngestError):
    """The ``Host`` header names none of this edge's names (``SLUICE_EDGE_ALLOWED_HOSTS``): a DNS-rebinding
    page, or a client that reached the wrong server."""

    status = 421
    error_type = "invalid_request_error"
    default_code = "host_not_allowed"


class OriginNotAllowed(IngestError):
    """A browser page of another site opened the WebSocket (``SLUICE_EDGE_ALLOWED_ORIGINS``): browsers apply
    no same-origin rule to WebSockets, and the request carries the edge's own ``Host``."""

    status = 403
    error_type = "invalid_request_error"
    default_code = "origin_not_allowed"


class MethodNotAllowed(IngestError):
    status = 405
    error_type = "invalid_request_error"
    default_code = "method_not_allowed"


class IdempotencyInProgress(IngestError):
    """The key is taken but its request cannot be read (yet): retry later."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "idempotency_key_in_progress"
    retriable = True


class IdempotencyKeyCancelled(IngestError):
    """The key's request ended cancelled (its client left, past the disconnect grace): replaying that outcome
    again and again would never get the client an answer, so it is final and says so."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "idempotency_key_cancelled"


class StreamEnded(IngestError):
    """A resumed stream (``Last-Event-ID``, ``GET /v1/streams/{id}``, a WebSocket ``resume``) whose request
    ended cancelled, or failed for a reason worth retrying: a resume replays that end every time, so it is
    final (409, not the retriable 503 an SDK would retry into the same replay); send the request again."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "stream_ended"


class IdempotencyKeyFailed(IngestError):
    """The key's request failed for a reason worth retrying (out of memory, a full queue, its model version
    retired mid-answer): the 503 told the client to retry, but a retry with the same key replays that
    failure for the key's lifetime, so the replay is final and says to use a new key."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "idempotency_key_failed"


class PayloadTooLarge(IngestError):
    status = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"


class StorageQuotaExceeded(PayloadTooLarge):
    """A tenant's stored files would pass ``SLUICE_EDGE_FILES_MAX_BYTES_PER_TENANT``, or it keeps
    ``SLUICE_EDGE_FILES_MAX_PER_TENANT`` files already."""

    default_code = "storage_quota_exceeded"


class StorageFull(IngestError):
    """The edge's files disk is full (``ENOSPC``, ``EDQUOT``): nothing could be stored."""

    status = 507
    error_type = "server_error"
    default_code = "storage_full"
    retriable = True


class IdempotencyKeyReused(IngestError):
    status = 422
    error_type = "invalid_request_error"
    default_code = "idempotency_key_reused"


class RateLimited(IngestError):
    status = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"
    retriable = True

    def __init__(
        self, message: str, *, code: str | None = None, param: str | None = None, retry_after_s: float = 1.0
    ) -> None:
        super().__init__(message, code=code, param=param)
        self.retry_after_s = retry_after_s


class BudgetExceeded(IngestError):
    """The tenant's spending budget is used up (a ``BudgetStateChanged`` on the control topic)."""

    status = 402
    error_type = "insufficient_quota"
    default_code = "budget_exceeded"


class UpstreamFailed(IngestError):
    """A worker reported the request failed."""

    status = 500
    error_type = "server_error"
    default_code = "upstream_error"


class Unavailable(IngestError):
    status = 503
    error_type = "server_error"
    default_code = "unavailable"
    retriable = True


class TooManyConnections(Unavailable):
    """The edge holds ``SLUICE_EDGE_MAX_CONNECTIONS`` connections (``ingest/protocol.py``)."""

    default_code = "too_many_connections"


class ShuttingDown(Unavailable):
    """The edge is stopping: a request it cut was cancelled (``CancelRequested(reason="shutdown")``), so a
    resume elsewhere reads only ``request_cancelled``; the client sends it again to another edge."""

    default_code = "shutting_down"


class GatewayUnavailable(Unavailable):
    default_code = "gateway_unavailable"


class RequestCancelled(Unavailable):
    default_code = "request_cancelled"


class DeadlineExceeded(IngestError):
    status = 504
    error_type = "timeout"
    default_code = "timeout"


class CatalogueError(IngestError):
    """A served model directory cannot be loaded (raised at start-up, never to a client)."""


def error_body(exc: IngestError) -> dict[str, Any]:
    return {"error": {"message": exc.message, "type": exc.error_type, "param": exc.param, "code": exc.code}}


def error_response(exc: IngestError, *, request_id: str | None = None) -> web.Response:
    headers = {"x-should-retry": "true" if exc.retriable else "false"}
    if isinstance(exc, RateLimited):  # seconds (RFC 9110), and milliseconds as OpenAI's clients read them
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after_s)))
        headers["retry-after-ms"] = str(max(1, round(exc.retry_after_s * 1000)))
    if request_id:
        headers["x-request-id"] = request_id
    return web.Response(
        status=exc.status,
        body=msgspec.json.encode(error_body(exc)),
        content_type="application/json",
        headers=headers,
    )


def from_finished(finished: RequestFinished) -> IngestError | None:
    """The error a terminal event stands for, or None when it completed."""
    if finished.status == "completed":
        return None
    if finished.status == "expired":
        return DeadlineExceeded("the request passed its deadline before it finished")
    if finished.status == "cancelled":
        return RequestCancelled("the request was cancelled before it finished")
    info = finished.error
    message = info.message if info else "the request failed"
    code = info.code if info else None
    if info is not None and finished.failed_by_client():
        # e.g. a worker that serves less context than the manifest the edge checked (a sliding-window model
        # prepared before 2026-12-03, or a worker's batch budget under a long context): the prompt is too
        # long, a 400 as the edge's own refusal, not a 500. The codes are schemas.events.CLIENT_ERROR_CODES,
        # which the SLIs leave out too, so what a client is answered 4xx is never the service's failure.
        return _CLIENT_ERRORS.get(info.code, InvalidRequest)(message, code=info.code)
    if info is not None and info.retriable:
        return Unavailable(message, code=code)
    return UpstreamFailed(message, code=code)


_CLIENT_ERRORS: dict[str, type[InvalidRequest]] = {"context_length_exceeded": ContextLengthExceeded}
"""The error class of a client's error code (``schemas.events.CLIENT_ERROR_CODES``) that has its own;
any other such code is a plain 400 :class:`InvalidRequest`."""
