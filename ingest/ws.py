"""``GET /v1/ws``: many requests multiplexed over one WebSocket, as JSON text frames.

Auth: ``Authorization: Bearer <key>`` on the upgrade request; clients that cannot set headers (browsers) may
pass ``?api_key=<key>`` instead (it can end up in proxy logs: prefer the header).

Client frames::

    {"type": "request", "id": <str|int, client-chosen>, "endpoint": "chat.completions"|"completions"|"embeddings",
     "body": {...the HTTP body...}}
    {"type": "cancel", "id": ...}
    {"type": "resume", "id": ..., "request_id": "<uuid7>", "after"?: "<a token frame's cursor>",
     "timeout"?: <seconds>, "encoding_format"?: "float"|"base64"}
    {"type": "ping", "id"?: ...}

Server frames: ``accepted`` (id, request_id), ``token`` (id, request_id, seq, cursor, offset, text, token_ids;
``cursor``, ``<tokens>.<chars>``, is where the stream stands after it: a ``resume`` frame's ``after``),
``done`` (id, request_id, status, finish_reason, usage; ``result`` = the OpenAI embeddings body for
embeddings; ``text`` = the whole text of a generation that was not streamed, as a ``resume`` of an HTTP
request without ``stream`` reads it), ``error`` (id or null, error: OpenAI error object), ``pong``. A
generation asked for here is always streamed (its body's ``stream`` is not needed, and ``false`` is ignored). Liveness is WebSocket ping/pong
every ``SLUICE_EDGE_HEARTBEAT_S`` (a peer that misses a pong is closed). Bad frames (binary, junk JSON,
unknown type, invalid body) get an ``error`` frame and the socket stays open; nothing is submitted. Two bad
frames are refused by the WebSocket layer instead, with no ``error`` frame: a text frame larger than
``SLUICE_EDGE_MAX_BODY_BYTES`` (the largest HTTP body; a ``request`` frame's own fields count too) closes the
socket with 1009 (message too big), and one that is not UTF-8 with 1007 (invalid payload data). Every
request in flight on that socket is then cancelled, as on any close; sent again, the same frame closes the
next socket too.

Resume: a ``resume`` frame reads a request's stream after ``after`` (as ``GET /v1/streams/{id}`` does), for
its ``timeout`` (as that route's ``X-Request-Timeout``; default ``SLUICE_EDGE_DEFAULT_TIMEOUT_S``, at most
``SLUICE_EDGE_MAX_TIMEOUT_S``); past it, an ``error`` frame with code ``timeout`` ends the reading, not the
request. A resume that takes its request back (its client left it on this edge less than
``SLUICE_EDGE_DISCONNECT_GRACE_S`` ago) goes on as that request: it reads until the request's own deadline
(or its ``timeout``, if sooner), cancels it on a ``cancel`` frame, on leaving, or at the deadline, and gets
an embeddings result in the ``encoding_format`` the request asked. Any other resume gets it as ``float``
lists (the stream does not say how its request asked for it), unless the frame names its own
``encoding_format`` (``"float"`` or ``"base64"``), which wins in either case.

Backpressure: every outgoing frame goes through one bounded queue per socket (``SLUICE_EDGE_WS_SEND_QUEUE``)
drained by one writer that waits for the transport to drain. When it is full, the request tasks block on
``put`` and so stop pulling their gateway reply streams: a slow reader holds at most the queue, the kernel
buffers and one frame per request in memory. Control replies (pong, error) wait in the same queue. A peer
that takes no frame for two heartbeats is gone: whichever wait for room runs out first (the reader's or a
request's) closes the socket with 1008 (policy violation), and every request on it is cancelled as on any
close.

Shutdown: when the edge stops, each request it cuts gets an ``error`` frame with code ``shutting_down`` (its
request was cancelled: send it again to another edge), then the socket closes with 1001 (going away).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import msgspec
from aiohttp import WSCloseCode, WSMsgType, web
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Link, SpanKind

from ingest.admission import Flight, reserved_tokens
from ingest.auth import Tenant
from ingest.context import EdgeContext
from ingest.errors import IngestError, InvalidRequest, OriginNotAllowed, RateLimited, Unavailable, error_body
from ingest.gateway import ReplyStream
from ingest.observe import RequestWatch, count_refusal, note_accepted
from ingest.openai import Timeout
from ingest.prepare import Kind, Shape
from ingest.render import native_json
from ingest.reply_stream import After
from monitoring import metrics, tracing
from schemas.codec import unreadable_json

log = logging.getLogger(__name__)

ClientId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | int
WS_KINDS: dict[str, Kind] = {
    "chat.completions": "chat",
    "completions": "completion",
    "embeddings": "embedding",
}


class RequestFrame(msgspec.Struct, tag="request", tag_field="type", forbid_unknown_fields=True, frozen=True):
    id: ClientId
    endpoint: Literal["chat.completions", "completions", "embeddings"]
    body: msgspec.Raw


class CancelFrame(msgspec.Struct, tag="cancel", tag_field="type", forbid_unknown_fields=True, frozen=True):
    id: ClientId


class ResumeFrame(msgspec.Struct, tag="resume", tag_field="type", forbid_unknown_fields=True, frozen=True):
    id: ClientId
    request_id: str
    after: str | None = None
    """A token frame's ``cursor`` (``<tokens>.<chars>``): what the client has; unset, the whole stream."""
    after_seq: Annotated[int, msgspec.Meta(ge=-1)] = -1
    """An older edge's resume point: a token frame's ``seq`` (a request re-run after its worker died numbers
    its chunks from 0 again, so ``after`` is the one that holds then)."""
    timeout: Timeout | None = None
    """Seconds to read for (as ``X-Request-Timeout`` on ``GET /v1/streams/{id}``): see the module's doc."""
    encoding_format: Literal["float", "base64"] | None = None
    """How an embeddings result's vectors come back; unset, as the request asked if this resume takes it
    back, else ``float``."""


class PingFrame(msgspec.Struct, tag="ping", tag_field="type", forbid_unknown_fields=True, frozen=True):
    id: ClientId | None = None


_DECODER = msgspec.json.Decoder(RequestFrame | CancelFrame | ResumeFrame | PingFrame)


@dataclass(eq=False)
class _Work:
    task: asyncio.Task[None]
    flight: Flight | None = None


def _client_id(text: str | bytes) -> Any:
    """The ``id`` of a frame that failed to decode, when it has a usable one (none in JSON nested too deep
    to decode: that raised RecursionError out of the socket's loop and closed it)."""
    with contextlib.suppress(msgspec.DecodeError, RecursionError):
        frame = msgspec.json.decode(text)
        if isinstance(frame, dict):  # only an id a frame may have: not true, nor "" (a review)
            return msgspec.convert(frame.get("id"), ClientId)
    return None


class PeerNotReading(ConnectionResetError):
    """The peer has taken no frame for two heartbeats: its socket is closed as gone (:data:`NOT_READING`)."""


NOT_READING = WSCloseCode.POLICY_VIOLATION
NOT_READING_REASON = b"no frame taken for two heartbeats"
"""The close code of a socket whose peer took no frame for two heartbeats, and its reason."""

CloseSocket = Callable[[WSCloseCode, bytes], Awaitable[object]]
"""Closes the session's socket with a code and a reason (the handler's ``WebSocketResponse.close``)."""


class WsSession:
    def __init__(
        self,
        ctx: EdgeContext,
        tenant: Tenant,
        send: Callable[[str], Awaitable[None]],
        close_socket: CloseSocket,
    ) -> None:
        self._ctx = ctx
        self._tenant = tenant
        self._send = send
        self._close_socket = close_socket
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=ctx.settings.edge_ws_send_queue)
        self._queued_bytes = 0
        self._room = asyncio.Condition()
        """Bytes waiting in the send queue, bounded by ``edge_ws_send_queue_bytes`` (frames alone are
        not a bound: one frame may carry a whole embeddings result)."""
        self._work: dict[str | int, _Work] = {}
        self._writer: asyncio.Task[None] | None = None
        self._socket_span = trace.get_current_span().get_span_context()

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write())

    async def _write(self) -> None:
        try:
            while True:
                frame = await self._queue.get()
                async with self._room:
                    self._queued_bytes -= len(frame)
                    self._room.notify_all()
                await self._send(frame.decode())
                self._queue.task_done()
        except ConnectionResetError:
            log.debug("websocket peer went away while sending")

    async def _put(self, frame: dict[str, Any] | bytes) -> None:
        """Queue ``frame`` (or its JSON) for sending, waiting for room (the socket's backpressure). A peer
        that takes nothing for two heartbeats is gone (:class:`PeerNotReading`): a wait without end held the
        socket's requests, their slots and the reader (which a heartbeat's close could not then end) for
        good."""
        data = frame if isinstance(frame, bytes) else msgspec.json.encode(frame)
        limit = self._ctx.settings.edge_ws_send_queue_bytes
        try:
            async with asyncio.timeout(2 * self._ctx.settings.edge_heartbeat_s):
                async with self._room:  # wait for room; an oversized frame waits until the queue is empty
                    await self._room.wait_for(
                        lambda: self._queued_bytes == 0 or self._queued_bytes + len(data) <= limit
                    )
                    self._queued_bytes += len(data)
                try:
                    await self._queue.put(data)
                except BaseException:  # not queued (cancelled, or out of time): give its bytes back
                    self._queued_bytes -= len(data)
                    async with self._room:
                        self._room.notify_all()
                    raise
        except TimeoutError:
            raise PeerNotReading("the WebSocket peer took no frame for two heartbeats") from None

    async def _error(self, client_id: Any, exc: IngestError) -> None:
        frame = {"type": "error", "id": client_id, **error_body(exc)}
        if isinstance(exc, RateLimited):
            frame["retry_after_ms"] = max(1, round(exc.retry_after_s * 1000))
        await self._put(frame)

    async def handle_binary(self) -> None:
        await self._error(None, InvalidRequest("Binary frames are not supported; send JSON text frames."))

    async def handle_text(self, text: str) -> None:
        try:
            frame = _DECODER.decode(text)
        except msgspec.DecodeError as exc:
            why = unreadable_json(exc, text)
            await self._error(_client_id(text), InvalidRequest(f"Invalid frame: {why}", code="invalid_frame"))
            return
        except RecursionError:  # balanced JSON nested ~1000 deep: msgspec's Raw capture recurses
            await self._error(
                _client_id(text),
                InvalidRequest("Invalid frame: JSON nested too deeply.", code="invalid_frame"),
            )
            return
        match frame:
            case PingFrame():
                await self._put({"type": "pong", "id": frame.id})
            case CancelFrame():
                await self._cancel(frame.id)
            case RequestFrame() | ResumeFrame():
                await self._begin(frame)

    async def _begin(self, frame: RequestFrame | ResumeFrame) -> None:
        if frame.id in self._work:
            await self._error(
                frame.id,
                InvalidRequest(f"Request id {frame.id!r} is already in flight.", code="duplicate_id"),
            )
            return
        if len(self._work) >= self._ctx.settings.edge_ws_max_inflight:
            limit = self._ctx.settings.edge_ws_max_inflight
            await self._error(
                frame.id,
                RateLimited(f"At most {limit} requests in flight per socket.", code="too_many_inflight"),
            )
            return
        if not self._ctx.admission.accepting:
            await self._error(frame.id, Unavailable("The server is shutting down.", code="shutting_down"))
            return
        work = _Work(task=asyncio.create_task(self._run(frame)))
        self._work[frame.id] = work

    async def _run(self, frame: RequestFrame | ResumeFrame) -> None:
        try:
            await self._answer(frame)
        except PeerNotReading:  # a frame of this request (its error frame too) could not be queued
            log.info("closing a WebSocket of %s whose peer reads nothing", self._tenant.name)
            await self._close_socket(NOT_READING, NOT_READING_REASON)
        except ConnectionResetError:
            pass  # the peer is gone (its requests' guards published their cancels): nobody to tell
        finally:
            work = self._work.get(frame.id)
            if work is not None and work.task is asyncio.current_task():
                del self._work[frame.id]

    async def _answer(self, frame: RequestFrame | ResumeFrame) -> None:
        """The request or resume, and an ``error`` frame for any error that ended it. A peer not reading
        (:class:`PeerNotReading`, here or in sending the error frame) was swallowed with the peer gone: the
        request vanished without a terminal frame and its socket stayed open (an audit)."""
        try:
            if isinstance(frame, RequestFrame):
                await self._request(frame)
            else:
                await self._resume(frame)
        except IngestError as exc:
            await self._error(frame.id, exc)
        except ConnectionResetError:
            raise
        except Exception:  # a bug must not leave the client waiting on an id that silently vanished
            log.exception("unhandled error in a WebSocket request frame %r", frame.id)
            await self._error(frame.id, IngestError("The server had an error while processing your request."))

    async def _request(self, frame: RequestFrame) -> None:
        """One request frame: its own trace (linked to the socket's span: a socket lives for hours)."""
        ctx = self._ctx
        t0 = time.monotonic()
        tracer = tracing.tracer()
        links = [Link(self._socket_span)] if self._socket_span.is_valid else []
        with tracer.start_as_current_span(
            f"WS /v1/ws {frame.endpoint}", context=Context(), kind=SpanKind.SERVER, links=links
        ) as span:
            # Every refusal before the request is submitted is counted, as over HTTP (``note_refusal``): a
            # 503 from admission or from a log that could not take the request was not, so a WebSocket-only
            # tenant's outage never moved the availability SLI nor paged (a review).
            model = version = ""
            submitted = False
            try:
                with tracer.start_as_current_span("sluice.admit"):
                    ctx.admission.check_budget(self._tenant, ctx.gateway.budget_exhausted(self._tenant.name))
                    with ctx.admission.preparing(self._tenant):
                        prepared = await ctx.preparer.prepare(
                            WS_KINDS[frame.endpoint], bytes(frame.body), tenant=self._tenant, streamed=True
                        )
                    note_accepted(prepared.event, span)
                model, version = prepared.event.model, prepared.event.model_version
                shape = prepared.shape
                with ctx.admission.flight(
                    self._tenant,
                    shape.model,
                    shape.request_id,
                    owner=True,
                    tokens=reserved_tokens(prepared.event),
                    embedding=shape.kind == "embedding",
                ) as flight:
                    self._work[frame.id].flight = flight
                    opened = await ctx.dispatcher.open(prepared, None, flight)
                    submitted = True  # from here the request's watch counts its outcome
                    accepted = {"type": "accepted", "id": frame.id, "request_id": opened.request_id}
                    watch = RequestWatch(prepared.event if opened.owner else None, stream=True, t0=t0)
                    with watch:
                        stream = watch.wrap(opened.stream)
                        await self._pump(frame.id, shape, stream, flight, prepared.timeout_s, accepted)
            except IngestError as exc:
                if not submitted:
                    count_refusal(metrics.tenant_label(self._tenant.name), model, version, exc)
                raise

    async def _resume(self, frame: ResumeFrame) -> None:
        ctx = self._ctx
        with ctx.admission.flight(self._tenant, "", frame.request_id, owner=False, resumed=True) as flight:
            self._work[frame.id].flight = flight
            after = After(seq=frame.after_seq) if frame.after is None else After.parse(frame.after)
            if after is None:
                raise InvalidRequest(
                    "'after' must be a token frame's 'cursor', '<tokens>.<chars>'.", param="after"
                )
            stream = await ctx.dispatcher.resume(flight, after, encoding_format=frame.encoding_format)
            timeout = ctx.preparer.resume_timeout(frame.timeout, flight.time_left())
            accepted = {"type": "accepted", "id": frame.id, "request_id": frame.request_id}
            with RequestWatch(None, stream=True, t0=time.monotonic()) as watch:
                await self._pump(frame.id, flight.shape, watch.wrap(stream), flight, timeout, accepted)

    async def _pump(
        self,
        client_id: str | int,
        shape: Shape | None,
        stream: ReplyStream,
        flight: Flight,
        timeout_s: float,
        accepted: dict[str, Any],
    ) -> None:
        """``accepted``, then the stream's frames, within the request's guard: its deadline bounds the wait
        for room in the send queue, and leaving early cancels the request and closes its stream (the
        ``accepted`` frame used to wait outside it, with the request's slot held and nothing cancelled)."""
        async with self._ctx.dispatcher.guard(flight, stream, timeout_s):
            await self._put(accepted)
            async for item in stream:
                flight.name_model(item.model)
                await self._put(await native_json(item, shape, client_id))

    async def _cancel(self, client_id: str | int) -> None:
        work = self._work.pop(client_id, None)
        if work is None:
            await self._error(
                client_id, InvalidRequest(f"No request {client_id!r} in flight.", code="unknown_id")
            )
            return
        request_id = None
        if work.flight is not None:
            self._ctx.dispatcher.cancel(work.flight, "client_cancel")
            request_id = work.flight.request_id
        work.task.cancel()
        await asyncio.gather(work.task, return_exceptions=True)
        frame = {"type": "done", "id": client_id, "request_id": request_id, "status": "cancelled"}
        await self._put({**frame, "finish_reason": "cancelled", "usage": None})

    async def shut_down(self, within_s: float) -> None:
        """The edge stops: once the requests in flight have ended (those it cut by an ``error`` frame,
        ``shutting_down``) and the queue is sent, or after ``within_s``, close the socket with 1001. Closed at
        once, it cut their last frames: a client saw the socket close without a word for its ids."""
        tasks = [work.task for work in self._work.values()]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                if tasks:
                    await asyncio.wait(tasks)
                await self._queue.join()
        await self._close_socket(WSCloseCode.GOING_AWAY, b"server shutting down")

    async def close(self) -> None:
        """Cancel what is in flight (published as ``client_disconnect`` unless already cancelled) and stop."""
        tasks = [work.task for work in self._work.values()]
        for task in tasks:
            task.cancel()
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:  # also when the handler is cancelled meanwhile (its connection lost): a writer never
            # cancelled waited on a queue nobody held, and was destroyed pending, an ERROR in the log
            # at each dropped socket (an audit, 2026-12-01)
            if self._writer is not None:
                self._writer.cancel()
                await asyncio.gather(self._writer, return_exceptions=True)


async def websocket(ctx: EdgeContext, request: web.Request) -> web.StreamResponse:
    origin = request.headers.get("Origin")
    if origin is not None and not ctx.origins.allows(urlsplit(origin).netloc or None):
        raise OriginNotAllowed(
            f"WebSockets from pages of {origin!r} are not allowed here (SLUICE_EDGE_ALLOWED_ORIGINS)."
        )
    tenant = ctx.tenants.authenticate(request.headers.get("Authorization"), request.query.get("api_key"))
    if not ctx.admission.accepting:
        raise Unavailable("The server is shutting down.", code="shutting_down")
    held = ctx.sockets_of.get(tenant.name, 0)
    if held >= ctx.settings.edge_ws_max_per_tenant:
        raise RateLimited(
            f"Tenant {tenant.name} already holds {held} WebSockets on this edge "
            f"(limit {ctx.settings.edge_ws_max_per_tenant}); multiplex requests over fewer sockets.",
            code="too_many_sockets",
            retry_after_s=5.0,
        )
    ws = web.WebSocketResponse(
        heartbeat=ctx.settings.edge_heartbeat_s, max_msg_size=ctx.settings.edge_max_body_bytes
    )
    await ws.prepare(request)

    async def close_socket(code: WSCloseCode, message: bytes) -> None:
        await ws.close(code=code, message=message, drain=False)  # a peer not reading would hold a drain

    session = WsSession(ctx, tenant, ws.send_str, close_socket)
    session.start()
    ctx.sockets.add(session)
    ctx.sockets_of[tenant.name] = ctx.sockets_of.get(tenant.name, 0) + 1
    code, reason = WSCloseCode.GOING_AWAY, b""
    try:
        async for message in ws:
            if message.type == WSMsgType.TEXT:
                await session.handle_text(message.data)
            elif message.type == WSMsgType.BINARY:
                await session.handle_binary()
    except PeerNotReading:
        log.info("closing a WebSocket of %s whose peer reads nothing", tenant.name)
        code, reason = NOT_READING, NOT_READING_REASON
    finally:
        ctx.sockets.discard(session)
        left = ctx.sockets_of.get(tenant.name, 1) - 1
        if left:
            ctx.sockets_of[tenant.name] = left
        else:
            ctx.sockets_of.pop(tenant.name, None)
        await session.close()
        if not ws.closed:
            await close_socket(code, reason)
    return ws
