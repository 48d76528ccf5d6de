"""The edge's OpenAPI 3.1 document, written from the routes the app really registered.

Each route in the aiohttp router is looked up in :data:`OPERATIONS` (a route with no entry there is an
error, so a new route cannot be served undocumented); request bodies are the JSON Schema of the very msgspec
structs the handlers decode into, and every 4xx/5xx is OpenAI's error object. Served at ``/openapi.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import hdrs, web

from ingest.batches import CreateBatch
from ingest.openai import ChatCompletionRequest, CompletionRequest, EmbeddingRequest

REF = "#/components/schemas/{name}"
JSON = "application/json"
SSE = "text/event-stream"

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_OBJECT = {"type": "object"}
_ERRORS = {
    "4XX": {
        "description": "A refused request",
        "content": {JSON: {"schema": {"$ref": REF.format(name="Error")}}},
    },
    "5XX": {
        "description": "A server error",
        "content": {JSON: {"schema": {"$ref": REF.format(name="Error")}}},
    },
}

_RATE_LIMITED = {
    "description": "Over a limit (a tenant's rate, tokens, concurrency or sockets): retry after the time given",
    "headers": {
        "Retry-After": {"description": "Seconds to wait (at least 1)", "schema": {"type": "integer"}},
        "retry-after-ms": {"description": "The same in milliseconds", "schema": {"type": "integer"}},
    },
    "content": {JSON: {"schema": {"$ref": REF.format(name="Error")}}},
}


def _header(name: str, description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "description": description,
        "schema": {"type": "string"},
    }


_TIMEOUT = _header("X-Request-Timeout", "Seconds the request may take (at most the edge's maximum).")
_IDEMPOTENCY = _header("Idempotency-Key", "Replays the first request sent with the same key and body.")
_LAST_EVENT_ID = _header(
    "Last-Event-ID", "'<request id>:<tokens>.<chars>', an event's id: resume a stream after that chunk."
)
_SESSION = _header("X-Session-Id", "Routes a conversation's requests to the same worker.")
_ENCODING_FORMAT = {
    "name": "encoding_format",
    "in": "query",
    "required": False,
    "description": "How an embeddings result's vectors come back; unset, as the request asked when this "
    "resume takes it back within the disconnect grace, else 'float'.",
    "schema": {"type": "string", "enum": ["float", "base64"]},
}


@dataclass(frozen=True)
class Operation:
    summary: str
    body: type[msgspec.Struct] | None = None
    ok: dict[str, Any] = field(default_factory=lambda: {JSON: {"schema": _OBJECT}})
    """The 200 response's content, by media type."""
    headers: tuple[dict[str, Any], ...] = ()
    public: bool = False
    """Served without an API key."""
    ops: bool = False
    """Wants the ops token (``SLUICE_OPS_TOKEN``) where the edge has one, not an API key."""
    extra: dict[str, Any] = field(default_factory=dict)


_SSE_EVENT: dict[str, Any] = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {"type": "string"},
        "event": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}
"""One event of a text/event-stream (each ``data`` a JSON chunk, or ``[DONE]``), as tools validate a stream
event by event: a whole stream as a string failed schemathesis' SSE check once its fuzzing reached a 200
stream."""
_STREAMING = {JSON: {"schema": _OBJECT}, SSE: {"schema": _SSE_EVENT}}
_GENERATION_HEADERS = (_IDEMPOTENCY, _LAST_EVENT_ID, _TIMEOUT, _SESSION)

OPERATIONS: dict[tuple[str, str], Operation] = {
    ("POST", "/v1/chat/completions"): Operation(
        "Create a chat completion", ChatCompletionRequest, _STREAMING, _GENERATION_HEADERS
    ),
    ("POST", "/v1/completions"): Operation(
        "Create a completion", CompletionRequest, _STREAMING, _GENERATION_HEADERS
    ),
    ("POST", "/v1/embeddings"): Operation(
        "Create embeddings", EmbeddingRequest, headers=(_IDEMPOTENCY, _TIMEOUT, _SESSION)
    ),
    ("GET", "/v1/models"): Operation("List the models this key may use"),
    ("GET", "/v1/models/{model}"): Operation("A model this key may use (404 model_not_found otherwise)"),
    ("GET", "/v1/streams/{request_id}"): Operation(
        "Replay a request's replies as native SSE frames",
        ok={SSE: {"schema": _SSE_EVENT}},
        headers=(_LAST_EVENT_ID, _TIMEOUT, _ENCODING_FORMAT),
    ),
    ("GET", "/v1/ws"): Operation(
        "Multiplex requests over one WebSocket (JSON text frames; see ingest/ws.py). A browser, which cannot "
        "set headers on a WebSocket, passes its key as the api_key query parameter; an upgrade from a page "
        "of another site (its Origin) is refused 403 origin_not_allowed (SLUICE_EDGE_ALLOWED_ORIGINS)",
        ok={},
        extra={
            "responses": {"101": {"description": "Switching protocols to a WebSocket"}},
            "security": [{"bearerAuth": []}, {"queryKey": []}],
        },
    ),
    ("POST", "/v1/files"): Operation(
        "Upload a file (multipart/form-data: 'file', and 'purpose' = 'batch'; JSONL, one request per line); "
        "it expires 30 days after creation unless 'expires_after' says otherwise",
        extra={
            "requestBody": {
                "required": True,
                "content": {
                    "multipart/form-data": {
                        "schema": {
                            "type": "object",
                            "required": ["file", "purpose"],
                            "properties": {
                                "file": {"type": "string", "contentMediaType": "application/octet-stream"},
                                "purpose": {"type": "string", "enum": ["batch"]},
                                "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
                                "expires_after[seconds]": {
                                    "type": "integer",
                                    "minimum": 3600,
                                    "maximum": 2592000,
                                },
                            },
                        }
                    }
                },
            }
        },
    ),
    ("GET", "/v1/files"): Operation("List this key's files"),
    ("GET", "/v1/files/{file_id}"): Operation("A file's metadata"),
    ("DELETE", "/v1/files/{file_id}"): Operation("Delete a file"),
    ("GET", "/v1/files/{file_id}/content"): Operation(
        "A file's bytes (a running batch's output file: the lines settled so far, in input order)",
        ok={"application/octet-stream": {"schema": {"type": "string"}}},
    ),
    ("POST", "/v1/batches"): Operation("Create a batch from an uploaded JSONL file", CreateBatch),
    ("GET", "/v1/batches"): Operation("List this key's batches, newest first ('after', 'limit')"),
    ("GET", "/v1/batches/{batch_id}"): Operation("A batch: status, request counts, output and error files"),
    ("POST", "/v1/batches/{batch_id}/cancel"): Operation("Cancel a batch: lines not yet run never run"),
    ("GET", "/healthz"): Operation(
        "Liveness (503 once its Kafka gateway or batch runner died: restart it)",
        public=True,
        extra={"responses": {"503": {"description": "Failed", "content": {JSON: {"schema": _OBJECT}}}}},
    ),
    ("GET", "/readyz"): Operation(
        "Readiness (503 while not ready)",
        public=True,
        extra={"responses": {"503": {"description": "Not ready", "content": {JSON: {"schema": _OBJECT}}}}},
    ),
    ("GET", "/metrics"): Operation(
        "Prometheus metrics (the ops token where SLUICE_OPS_TOKEN is set)",
        ok={"text/plain": {"schema": {"type": "string"}}},
        ops=True,
    ),
    ("GET", "/openapi.json"): Operation("This document", public=True),
    ("GET", "/v1/openapi.json"): Operation("This document", public=True),
}


def registered(app: web.Application) -> set[tuple[str, str]]:
    """(method, path template) of every route the app serves, less the HEADs aiohttp adds to GETs."""
    out = set()
    for route in app.router.routes():
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter")
        if path is not None and route.method != hdrs.METH_HEAD:
            out.add((route.method, path))
    return out


def _operation(
    method: str, path: str, op: Operation, refs: dict[type[msgspec.Struct], Any]
) -> dict[str, Any]:
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name in path.replace("}", "{").split("{")[1::2]
    ] + list(op.headers)
    ok = {"description": "OK", "content": op.ok} if op.ok else {"description": "OK"}
    spec: dict[str, Any] = {
        "operationId": f"{method.lower()}{path.replace('/', '_').replace('{', '').replace('}', '')}",
        "summary": op.summary,
        "parameters": parameters,
        "responses": {"200": ok, **_ERRORS},
    }
    if op.public:
        spec["security"] = []
    elif op.ops:
        spec["security"] = [{"opsToken": []}, {}]  # {}: open where the edge has no ops token
    else:  # a key's limits: 429 with when to retry (ingest.errors.error_response)
        spec["responses"]["429"] = {**_RATE_LIMITED}
    if op.body is not None:
        spec["requestBody"] = {"required": True, "content": {JSON: {"schema": refs[op.body]}}}
    for key, value in op.extra.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    if not op.ok:
        del spec["responses"]["200"]
    return spec


def document(
    app: web.Application, *, title: str = "sluicegate edge", version: str = "0.1.0"
) -> dict[str, Any]:
    """The OpenAPI 3.1 document of every route ``app`` serves; a route missing from OPERATIONS raises."""
    routes = sorted(registered(app))
    missing = [route for route in routes if route not in OPERATIONS]
    if missing:
        raise LookupError(f"routes with no OpenAPI operation: {missing}")
    bodies = sorted({b for r in routes if (b := OPERATIONS[r].body) is not None}, key=lambda b: b.__name__)
    schemas, components = msgspec.json.schema_components(bodies, ref_template=REF)
    refs = dict(zip(bodies, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for method, path in routes:
        paths.setdefault(path, {})[method.lower()] = _operation(method, path, OPERATIONS[method, path], refs)
    return {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version, "description": "OpenAI-compatible serving on Kafka."},
        "paths": paths,
        "components": {
            "schemas": {**components, "Error": ERROR_SCHEMA},
            "securitySchemes": {
                "bearerAuth": {"type": "http", "scheme": "bearer"},
                "queryKey": {
                    "type": "apiKey",
                    "in": "query",
                    "name": "api_key",
                    "description": "The API key as a query parameter: /v1/ws only (browsers cannot set "
                    "a WebSocket's headers); it can end up in proxy logs, so prefer the header",
                },
                "opsToken": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "SLUICE_OPS_TOKEN: /metrics (and the other services' ops endpoints) "
                    "want it where it is set",
                },
            },
        },
        "security": [{"bearerAuth": []}],
    }
