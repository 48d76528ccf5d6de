"""The HTTP routes: OpenAI-compatible endpoints, stream resume, models, health."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from ingest import openai, openapi_doc
from ingest.admission import Flight, reserved_tokens
from ingest.auth import Tenant
from ingest.context import EdgeContext
from ingest.dispatch import MAX_SESSION_ID, check_header, check_idempotency_key
from ingest.errors import IngestError, InvalidRequest, ModelNotFound, PayloadTooLarge
from ingest.gateway import ReplyStream
from ingest.observe import (
    MODEL_KEY,
    REQUEST_ID_KEY,
    SERVER_SPAN_KEY,
    SUBMITTED_KEY,
    TENANT_KEY,
    VERSION_KEY,
    RequestWatch,
    note_accepted,
)
from ingest.prepare import Kind, Prepared, Shape, parse_encoding_format, parse_timeout
from ingest.render import DONE, SseEncoder, collect, event_id, final_json, native, sse, sse_error
from ingest.reply_stream import WHOLE, After
from monitoring import metrics, tracing
from monitoring.access import OpsAccess
from monitoring.ops import Readiness
from schemas.events import TokenChunk
from schemas.ids import UUID7_PATTERN

log = logging.getLogger(__name__)

_LAST_EVENT_ID = re.compile(r"^(?P<rid>" + UUID7_PATTERN.strip("^$") + r"):(?P<at>[-.0-9]{1,24})$")
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def parse_last_event_id(value: str | None) -> tuple[str, After] | None:
    """``<request id>:<tokens>.<chars>`` (an SSE id this edge gave), or an older edge's ``<request id>:<seq>``."""
    if value is None:
        return None
    match = _LAST_EVENT_ID.match(value.strip())
    after = After.parse(match["at"]) if match is not None else None
    if match is None or after is None:
        raise InvalidRequest(
            "Last-Event-ID must be '<request id>:<tokens>.<chars>', the id of an event of the stream.",
            param="Last-Event-ID",
        )
    return match["rid"], after


def json_response(
    body: Any, *, status: int = 200, request_id: str | None = None, timing: str | None = None
) -> web.Response:
    """``body`` as JSON (``bytes``: already JSON)."""
    headers = {"x-request-id": request_id} if request_id else {}
    if timing:
        headers["Server-Timing"] = timing
    encoded = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return web.Response(status=status, body=encoded, content_type="application/json", headers=headers)


SEND_GRACE_S = 1.0
"""The least time a whole answer gets to leave, even past its request's deadline."""


async def send_now(request: web.Request, response: web.Response, within_s: float = math.inf) -> None:
    """Send a whole answer now, before the handler's bookkeeping unwinds (the flight's release, the
    request's span, the middlewares' own): aiohttp would send it only once the handler has returned, and
    right after a reply wakes the edge every line of that code runs cold (~0.1 ms of one client's request
    on the development box). aiohttp sees the response sent and does not send it again.

    A client that does not read its answer is closed after ``within_s`` (at least :data:`SEND_GRACE_S`):
    the request's concurrency slot is held until the answer is sent, and a large one unread held it for
    good (an audit)."""
    try:
        async with asyncio.timeout(max(within_s, SEND_GRACE_S)):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()  # it does not read: what is left of the answer goes nowhere
    except ConnectionResetError:
        pass  # the client left: nothing to tell it


class Routes:
    def __init__(
        self,
        ctx: EdgeContext,
        access: OpsAccess,
        *,
        failure: Callable[[], BaseException | None],
    ) -> None:
        """``access``: the ops token's rule (``SLUICE_OPS_TOKEN``), which ``/readyz``'s model list follows.
        ``failure``: the edge's own (its gateway or its batch runner died), which ``/healthz`` reports."""
        self.ctx = ctx
        self.access = access
        self._failure = failure
        self._openapi: bytes | None = None

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model}", self.model)
        app.router.add_get("/v1/streams/{request_id}", self.stream)
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/openapi.json", self.openapi)
        app.router.add_get("/v1/openapi.json", self.openapi)

    def _tenant(self, request: web.Request) -> Tenant:
        return self.ctx.tenants.authenticate(request.headers.get("Authorization"))

    async def _body(self, request: web.Request) -> bytes:
        limit = self.ctx.settings.edge_max_body_bytes
        too_large = PayloadTooLarge(f"The request body is larger than the limit of {limit} bytes.")
        if request.content_length is not None and request.content_length > limit:
            raise too_large
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise too_large from None

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "completion")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._endpoint(request, "embedding")

    async def _endpoint(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        t0 = time.monotonic()
        with tracing.current_span("sluice.admit"):
            tenant, prepared, key, last = await self._admit(request, kind)
        shape = prepared.shape
        ctx = self.ctx
        if last is not None:  # an SSE reconnect: replay after the last event seen, generate nothing
            request_id, after = last
            after = after if shape.stream else WHOLE  # one JSON body needs the whole stream
            shape = dataclasses.replace(shape, request_id=request_id)
            with ctx.admission.flight(tenant, shape.model, request_id, owner=False, resumed=True) as flight:
                stream = await ctx.dispatcher.resume(flight, after, expect=prepared)
                request[SUBMITTED_KEY] = True
                request[REQUEST_ID_KEY] = request_id
                watch = RequestWatch(None, stream=shape.stream, t0=t0)
                return await self._serve(request, shape, stream, flight, prepared.timeout_s, watch, after)
        tokens = reserved_tokens(prepared.event)
        with ctx.admission.flight(
            tenant,
            shape.model,
            shape.request_id,
            owner=True,
            tokens=tokens,
            idempotency_key=key,
            embedding=kind == "embedding",
        ) as flight:
            opened = await ctx.dispatcher.open(prepared, key, flight)
            request[SUBMITTED_KEY] = True
            request[REQUEST_ID_KEY] = opened.request_id
            shape = dataclasses.replace(shape, request_id=opened.request_id)
            watch = RequestWatch(prepared.event if opened.owner else None, stream=shape.stream, t0=t0)
            return await self._serve(request, shape, opened.stream, flight, prepared.timeout_s, watch, WHOLE)

    async def _admit(
        self, request: web.Request, kind: Kind
    ) -> tuple[Tenant, Prepared, str | None, tuple[str, After] | None]:
        """Authenticate, rate-limit, read, validate and tokenise: everything before the log sees it."""
        ctx = self.ctx
        tenant = self._tenant(request)
        request[TENANT_KEY] = metrics.tenant_label(tenant.name)
        last = parse_last_event_id(request.headers.get("Last-Event-ID")) if kind != "embedding" else None
        if last is None:  # a resume is work admitted before: a 402 lost the client its stream (an audit), and
            # a WebSocket resume or GET /v1/streams/{id} of the same stream was served
            ctx.admission.check_budget(tenant, ctx.gateway.budget_exhausted(tenant.name))
        key = check_idempotency_key(request.headers.get("Idempotency-Key"))
        with ctx.admission.preparing(  # refused before any work on the body when at a limit
            tenant, request_id=last[0] if last is not None else None, idempotency_key=key
        ):
            raw = await self._body(request)
            prepared = await ctx.preparer.prepare(
                kind,
                raw,
                tenant=tenant,
                timeout_header=request.headers.get("X-Request-Timeout"),
                idempotency_key=key,
                # empty: none (the body's ``user`` then), as before the header was checked (a review)
                session=check_header(
                    request.headers.get("X-Session-Id") or None, "X-Session-Id", MAX_SESSION_ID
                ),
            )
        request[MODEL_KEY] = prepared.event.model
        request[VERSION_KEY] = prepared.event.model_version
        note_accepted(prepared.event, request.get(SERVER_SPAN_KEY))
        return tenant, prepared, key, last

    async def _serve(
        self,
        request: web.Request,
        shape: Shape,
        stream: ReplyStream,
        flight: Flight,
        timeout_s: float,
        watch: RequestWatch,
        after: After,
    ) -> web.StreamResponse:
        with watch:
            stream = watch.wrap(stream)
            guard = self.ctx.dispatcher.guard(flight, stream, timeout_s)
            if not shape.stream:
                async with guard:
                    text, finished = await collect(stream)
                timing = watch.server_timing(finished) if self.ctx.settings.edge_server_timing else None
                answer = json_response(
                    await final_json(shape, text, finished), request_id=shape.request_id, timing=timing
                )
                await send_now(request, answer, within_s=timeout_s)  # its deadline again, at most
                return answer
            encoder = SseEncoder(shape, after)
            response = web.StreamResponse(headers={**SSE_HEADERS, "x-request-id": shape.request_id})
            ended = False
            try:
                async with guard:
                    await response.prepare(request)
                    if opening := encoder.opening():
                        await response.write(opening)
                    async for item in stream:
                        ended = not isinstance(item, TokenChunk)
                        await response.write(encoder.item(item))
                if not ended:
                    await response.write(
                        sse_error(IngestError("The reply stream ended early.", code="incomplete_stream"))
                    )
            except IngestError as exc:  # the deadline passed mid-stream
                if not response.prepared:
                    raise
                await response.write(sse_error(exc))
            except ConnectionResetError:
                pass  # the client left; the guard published the cancel
            return response

    async def stream(self, request: web.Request) -> web.StreamResponse:
        """Replay a request's replies as native frames over SSE, after ``Last-Event-ID`` (default: all)."""
        ctx = self.ctx
        tenant = self._tenant(request)
        request_id = request.match_info["request_id"]
        last = parse_last_event_id(request.headers.get("Last-Event-ID"))
        if last is not None and last[0] != request_id:
            raise InvalidRequest("Last-Event-ID names another request.", param="Last-Event-ID")
        after = last[1] if last is not None else WHOLE
        asked = parse_timeout(request.headers.get("X-Request-Timeout"))
        encoding_format = parse_encoding_format(request.query.get("encoding_format"))
        with ctx.admission.flight(tenant, "", request_id, owner=False, resumed=True) as flight:
            stream = await ctx.dispatcher.resume(flight, after, encoding_format=encoding_format)
            timeout = ctx.preparer.resume_timeout(asked, flight.time_left())
            response = web.StreamResponse(headers={**SSE_HEADERS, "x-request-id": request_id})
            try:
                async with ctx.dispatcher.guard(flight, stream, timeout):
                    await response.prepare(request)
                    async for item in stream:
                        flight.name_model(item.model)
                        chunk_id = event_id(item) if isinstance(item, TokenChunk) else None
                        await response.write(sse(native(item, flight.shape), chunk_id))
                    await response.write(DONE)
            except IngestError as exc:
                if not response.prepared:
                    raise
                await response.write(sse_error(exc))
            except ConnectionResetError:
                pass
            return response

    async def models(self, request: web.Request) -> web.Response:
        tenant = self._tenant(request)
        listed = [(m.model_id, m.created) for m in self.ctx.catalogue if tenant.may_use(m.model_id)]
        return json_response(openai.model_list(listed))

    async def model(self, request: web.Request) -> web.Response:
        """One model the tenant may use (OpenAI's "Retrieve model"; it was a 404 for every id: an audit)."""
        tenant = self._tenant(request)
        model_id = request.match_info["model"]
        if not tenant.may_use(model_id):  # as an unknown id: a model the tenant may not use is not there
            raise ModelNotFound(
                f"The model '{model_id}' does not exist or you do not have access to it.", param="model"
            )
        served = self.ctx.catalogue.get(model_id)  # ModelNotFound for an unknown id
        return json_response(openai.model_object(served.model_id, served.created))

    async def openapi(self, request: web.Request) -> web.Response:
        """The OpenAPI document of the routes this app serves (written once, on first request)."""
        if self._openapi is None:
            self._openapi = msgspec.json.encode(openapi_doc.document(request.app))
        return web.Response(body=self._openapi, content_type="application/json")

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive unless a part the edge cannot serve without died (its Kafka gateway, its batch runner):
        then 503, so that a liveness probe restarts it (it stayed 200 while every request got a 503, a
        review). Why is not said here: the probe needs no key; the process logs it."""
        if self._failure() is not None:
            return json_response({"status": "failed"}, status=503)
        return json_response({"status": "ok"})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": metrics.CONTENT_TYPE})

    async def readyz(self, request: web.Request) -> web.Response:
        """Ready when accepting, connected to Kafka (publishing and hearing replies) and serving models;
        the same ``{"ready", "checks"}`` shape as the workers' ``/readyz``, with how many models it serves.
        The probe needs no key, so it names the models only to the ops token (a set ``SLUICE_OPS_TOKEN``,
        presented): it named every model to anyone, those ``/v1/models`` hides from a tenant too (a review).
        """
        ctx = self.ctx
        readiness = Readiness.of(
            accepting=ctx.admission.accepting,
            kafka=ctx.gateway.ready(),
            models_loaded=len(ctx.catalogue) > 0,
            models=len(ctx.catalogue),
        )
        body: dict[str, Any] = {"ready": readiness.ready, "checks": readiness.checks}
        if self.access.required and self.access.allows(request.headers.get("Authorization")):
            body["models"] = sorted(m.model_id for m in ctx.catalogue)
        return json_response(body, status=200 if readiness.ready else 503)
