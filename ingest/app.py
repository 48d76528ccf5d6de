"""The edge: an aiohttp application over a :class:`~ingest.gateway.Gateway`, and its lifecycle.

``Edge(settings, gateway, catalogue)`` builds the app (``edge.app``, usable with aiohttp's test server);
``start()`` serves it on ``edge_host:edge_port`` and ``stop()`` shuts down gracefully: it stops accepting
(listeners closed, new requests 503, ``/readyz`` 503), lets in-flight requests finish for up to
``edge_shutdown_grace_s``, then publishes ``CancelRequested(reason="shutdown")`` for the rest and ends each
with an error, code ``shutting_down``: an SSE stream's last events are an error event and ``data: [DONE]``,
a WebSocket's in-flight ids get an ``error`` frame (then the socket closes with 1001), a request not
streamed gets a 503. Those requests are cancelled, not moved: a resume on another edge reads only
``request_cancelled``, and a retry with the same ``Idempotency-Key`` replays that cancel (409); the client
sends the request again, to another edge, with a new key if it used one.
The gateway's own lifecycle belongs to whoever made it.

Handlers run with ``handler_cancellation=True`` (also under aiohttp's test server), so a client that
disconnects while its request waits cancels the handler, which publishes ``client_disconnect``.

Every request but ``/healthz`` and ``/readyz`` must name this edge in its ``Host`` header
(``SLUICE_EDGE_ALLOWED_HOSTS``, else 421), and ``/metrics`` wants the ops token when one is set
(``SLUICE_OPS_TOKEN``, see :mod:`monitoring.access`). Without a tenants file or without an ops token the
edge refuses to be built for a non-loopback ``SLUICE_EDGE_HOST``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime

from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry.trace import SpanKind, Status, StatusCode

from ingest.admission import Admission
from ingest.auth import TenantDirectory, require_tenants_file
from ingest.batch_http import BatchRoutes
from ingest.batches import BatchRunner
from ingest.context import EdgeContext
from ingest.dispatch import Dispatcher
from ingest.errors import (
    AuthenticationFailed,
    HostNotAllowed,
    IngestError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    StorageFull,
    error_response,
)
from ingest.gateway import Gateway
from ingest.http import Routes
from ingest.models import ModelCatalogue
from ingest.observe import REQUEST_ID_KEY, SERVER_SPAN_KEY, note_refusal
from ingest.prepare import Preparer
from ingest.protocol import EdgeRunner, ensure_descriptors
from ingest.quota import QuotaLedger
from ingest.settings import EdgeSettings
from ingest.ws import websocket
from monitoring import tracing
from monitoring.access import PROBES, TOKEN_VARIABLE, HostAllowList, OpsAccess, route_of
from monitoring.ops import bound_port, http_url
from schemas.events import utc_now
from schemas.lifecycle import AsyncComponent

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """One SERVER span per API request (a child of the caller's ``traceparent`` when it sends one)."""
    if not request.path.startswith("/v1/"):
        return await handler(request)
    route = request.match_info.route.resource
    name = f"{request.method} {route.canonical if route is not None else request.path}"
    with tracing.current_span(
        name,
        context=tracing.context_of_headers(request.headers),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.path},
    ) as span:
        request[SERVER_SPAN_KEY] = span
        response = await handler(request)
        if span.is_recording():
            span.set_attribute("http.response.status_code", response.status)
            if response.status >= 500:
                span.set_status(Status(StatusCode.ERROR))
        return response


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves the edge in OpenAI's shape (and is counted)."""
    try:
        return await handler(request)
    except IngestError as exc:
        note_refusal(request, exc)
        return error_response(exc, request_id=request.get(REQUEST_ID_KEY))
    except web.RequestPayloadError as exc:  # a body that cannot be read as sent (bad gzip, say)
        refusal = InvalidRequest(f"The request body could not be read: {exc}", code="invalid_body")
        note_refusal(request, refusal)
        response = error_response(refusal)
        response.force_close()  # the rest of the body cannot be read either: no keep-alive after it
        return response
    except web.HTTPException as exc:
        if exc.status == 404:
            return error_response(NotFound(f"Unknown route {request.method} {request.path}."))
        if exc.status == 405:
            return error_response(MethodNotAllowed(f"Method {request.method} not allowed on {request.path}."))
        if exc.status == 413:
            return error_response(PayloadTooLarge("The request body is too large."))
        if 400 <= exc.status < 500:  # aiohttp's own refusals (a GET of /v1/ws without an upgrade, ...)
            response = error_response(InvalidRequest(exc.text or exc.reason, code="bad_request"))
            response.set_status(exc.status, exc.reason)
            return response
        raise
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            log.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(IngestError("The server had an error while processing your request."))
        # no traceback: the cause is known
        log.error("%s %s: the files disk is full (%s)", request.method, request.path, exc.strerror)  # noqa: TRY400
        full = StorageFull("The server has no room left to store this; retry later.")
        note_refusal(request, full)
        return error_response(full)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(IngestError("The server had an error while processing your request."))


def ops_guard(access: OpsAccess, hosts: HostAllowList) -> Middleware:
    """Refuse requests for a ``Host`` that is not this edge (DNS rebinding), and ``/metrics`` without the
    ops token; probes pass. Errors are raised, so they leave in OpenAI's shape (``openai_errors``)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = route_of(request)
        if route in PROBES:
            return await handler(request)
        host = request.headers.get("Host")
        if not hosts.allows(host):
            raise HostNotAllowed(
                f"This server does not answer for Host {host!r} (SLUICE_EDGE_ALLOWED_HOSTS)."
            )
        if route == "/metrics" and not access.allows(request.headers.get("Authorization")):
            raise AuthenticationFailed(
                f"/metrics needs 'Authorization: Bearer <{TOKEN_VARIABLE}>'.", code="invalid_ops_token"
            )
        return await handler(request)

    return guard


class Edge(AsyncComponent):
    def __init__(
        self,
        settings: EdgeSettings,
        gateway: Gateway,
        catalogue: ModelCatalogue,
        tenants: TenantDirectory | None = None,
        *,
        clock: Callable[[], datetime] = utc_now,
        ops_token: str | None = None,
        batches: Callable[[EdgeContext], BatchRunner] | None = None,
    ) -> None:
        """``tenants`` None: from ``SLUICE_EDGE_TENANTS_FILE``, or the demo tenant (loopback only).
        ``ops_token``: ``SLUICE_OPS_TOKEN``. ``batches`` builds the batch runner from the edge's context
        (None: the Files and Batches routes answer 503). Raises :class:`SettingsError` for an exposed edge that lacks
        either (see :func:`ingest.main.check_edge_exposure`)."""
        super().__init__()
        access = OpsAccess(
            ops_token, host=settings.edge_host, variable="SLUICE_EDGE_HOST", service="the edge"
        )
        if tenants is None:
            require_tenants_file(settings)
            tenants = TenantDirectory.load(settings.edge_tenants_file)
        source = f"ingest/{settings.edge_id}"
        admission = Admission(
            ledger=QuotaLedger(
                f"{settings.edge_id}.{secrets.token_hex(3)}",
                peer_ttl_s=max(1.0, 3 * settings.edge_quota_sync_s),
            )
        )
        self.ctx = EdgeContext(
            settings=settings,
            gateway=gateway,
            catalogue=catalogue,
            tenants=tenants,
            admission=admission,
            dispatcher=Dispatcher(
                gateway,
                source=source,
                disconnect_grace_s=settings.edge_disconnect_grace_s,
                settle=admission.settle,
                refund=admission.refund,
            ),
            preparer=Preparer(
                catalogue, settings, gateway.reply_to, clock=clock, deployments=gateway.deployment
            ),
        )
        hosts = HostAllowList(settings.edge_allowed_hosts, settings.edge_host)
        self.app = web.Application(
            middlewares=[traced, openai_errors, ops_guard(access, hosts)],
            client_max_size=settings.edge_max_body_bytes,
        )
        Routes(self.ctx, access, failure=lambda: self.failure).add_to(self.app)
        # A gateway that died serves nothing again: the edge fails with it, so that its process exits for
        # its supervisor to restart and ``/healthz`` answers 503 for a liveness probe meanwhile.
        gateway.watch(self.fail)
        self.batches = batches(self.ctx) if batches is not None else None
        BatchRoutes(self.ctx, self.batches).add_to(self.app)
        if self.batches is not None:
            self.app.cleanup_ctx.append(self._run_batches)
        self.app.cleanup_ctx.append(self._share_quota)
        self.app.router.add_get("/v1/ws", self._websocket)
        self._runner: EdgeRunner | None = None
        self._site: web.TCPSite | None = None
        self._stopped = False

    async def _share_quota(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: follow the other edges' admissions and publish this edge's own."""
        ledger = self.ctx.admission.ledger
        self.ctx.gateway.follow_quota(ledger.apply)
        task = asyncio.create_task(self._publish_quota(), name="quota-sync")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def _run_batches(self, app: web.Application) -> AsyncIterator[None]:
        """While the app runs: the batch runner (it resumes the batches this edge ran before)."""
        if self.batches is None:
            yield
            return
        async with self.batches:
            self.batches.watch(self.fail)  # a dead runner strands its batches: the edge fails, to restart
            yield

    HEARTBEATS_PER_TTL = 3
    """An idle edge still publishes this many times in the time the others keep a peer live
    (``peer_ttl_s``), so that one late or lost snapshot does not drop it from the live edges. (It published
    once per ``peer_ttl_s``, counted in sync intervals that added up to a little more: an idle edge left
    the live set for a moment every cycle.)"""

    async def _publish_quota(self) -> None:
        admission, gateway = self.ctx.admission, self.ctx.gateway
        interval = self.ctx.settings.edge_quota_sync_s
        heartbeat = admission.ledger.peer_ttl_s / self.HEARTBEATS_PER_TTL
        loop = asyncio.get_running_loop()
        last = -math.inf  # the first one at once: the other edges know this one from its start
        while True:
            await asyncio.sleep(interval)
            sync = admission.ledger.snapshot(admission.limits_of)
            if sync.usage or loop.time() - last >= heartbeat:
                last = loop.time()
                try:
                    await gateway.publish_quota(sync)
                except Exception:  # the next snapshot replaces this one; limits stay local meanwhile
                    log.warning("could not publish this edge's quota snapshot", exc_info=True)

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        return await websocket(self.ctx, request)

    @property
    def port(self) -> int:
        """The bound port once started (useful with ``edge_port=0``)."""
        return bound_port(self._runner, "the edge")

    @property
    def url(self) -> str:
        return http_url(self.ctx.settings.edge_host, self.port)

    async def _start(self) -> None:
        settings = self.ctx.settings
        ensure_descriptors(settings.edge_max_connections)
        self._runner = EdgeRunner(
            self.app,
            max_connections=settings.edge_max_connections,
            handler_cancellation=True,
            shutdown_timeout=1.0,
            access_log=None,
            keepalive_timeout=settings.edge_idle_timeout_s,
        )
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, settings.edge_host, settings.edge_port)
        await self._site.start()
        log.info("edge %s listening on %s", settings.edge_id, self.url)

    SHUTDOWN_NOTICE_S = 1.0
    """On stop, after the grace: how long the requests cut get to tell their clients (an SSE error event, a
    WebSocket error frame) before their tasks are cancelled and the WebSockets closed."""

    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        ctx = self.ctx
        ctx.admission.accepting = False
        if self._site is not None:
            await self._site.stop()
        if not await ctx.admission.wait_idle(ctx.settings.edge_shutdown_grace_s):
            flights = ctx.admission.flights
            log.info("edge stopping: cancelling %d requests still in flight", len(flights))
            for flight in flights:
                ctx.dispatcher.cancel(flight, "shutdown")
                flight.stop()
            if not await ctx.admission.wait_idle(self.SHUTDOWN_NOTICE_S):  # a client that does not read
                for flight in ctx.admission.flights:
                    if flight.task is not None:
                        flight.task.cancel()
        await asyncio.gather(*(session.shut_down(self.SHUTDOWN_NOTICE_S) for session in list(ctx.sockets)))
        await ctx.dispatcher.drain()
        if self._runner is not None:
            await self._runner.cleanup()
