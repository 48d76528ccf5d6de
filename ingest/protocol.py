"""The edge's connections: what aiohttp answers on its own, in OpenAI's shape, and a cap on how many.

aiohttp refuses a request it cannot parse (a bad ``Content-Length``, no ``Host`` on HTTP/1.1, a header
over 8 KB, an encoding it cannot decode, a bad chunk) before any middleware sees it, with a text/plain
400 and a traceback in the log at ERROR, for each such request anyone sends. The edge answers those in
OpenAI's error shape like every other refusal (code ``malformed_http``), counts them and logs one line.

A connection past ``SLUICE_EDGE_MAX_CONNECTIONS`` is answered 503 (``too_many_connections``) as soon as it
is accepted and closed, so that the edge's file descriptors and memory stay bounded however many clients
connect (uvicorn's ``--limit-concurrency``, nginx's ``worker_connections``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from ingest.errors import (
    DeadlineExceeded,
    IngestError,
    MalformedHttp,
    TooManyConnections,
    error_body,
    error_response,
)
from ingest.observe import count_refusal
from monitoring.ops import QuietConnection, QuietServer, parse_message

log = logging.getLogger(__name__)

REFUSED_LINGER_S = 1.0
"""A connection refused at the cap is closed this long after its 503 went out: closed at once, a request
it had already sent would be unread, and the reset that closing over unread data sends can destroy the
answer before the client reads it."""

FD_SPARE = 256
"""File descriptors the edge keeps for itself (Kafka's sockets, files, the batch runner) beyond its
connections when it raises its own soft limit."""


def _busy_response() -> bytes:
    """The whole 503 a connection over the cap gets, written before any request is read."""
    exc = TooManyConnections("This server holds as many connections as it may; retry shortly.")
    body = msgspec.json.encode(error_body(exc))
    head = (
        "HTTP/1.1 503 Service Unavailable\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Retry-After: 1\r\n"
        "x-should-retry: true\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


BUSY = _busy_response()


class EdgeConnection(QuietConnection):
    """One client connection: aiohttp's, with its own refusals in OpenAI's shape."""

    def __init__(self, manager: EdgeServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.refused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        manager = self._manager
        if isinstance(manager, EdgeServer) and len(manager.connections) > manager.max_connections:
            self.refused = True
            count_refusal("unknown", "", "", TooManyConnections(""))
            if manager.note_refused():
                log.warning(
                    "refusing connections: %d open, SLUICE_EDGE_MAX_CONNECTIONS=%d",
                    len(manager.connections) - 1,
                    manager.max_connections,
                )
            stream = transport if isinstance(transport, asyncio.WriteTransport) else None
            if stream is not None:
                stream.write(BUSY)
                if stream.can_write_eof():
                    stream.write_eof()
            self._loop.call_later(REFUSED_LINGER_S, self.force_close)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return  # read and dropped until the close: only the 503 is answered
        super().data_received(data)

    def answer(self, status: int, reason: str | None) -> web.Response:
        """In OpenAI's shape, counted like every other refusal (code ``malformed_http`` for a 4xx)."""
        refusal: IngestError
        if status == 504:
            refusal = DeadlineExceeded("The request timed out.")
        elif reason is not None:
            refusal = MalformedHttp(f"The request could not be parsed as HTTP: {reason}")
        else:
            refusal = IngestError("The server had an error while processing your request.")
        count_refusal("unknown", "", "", refusal)
        response = error_response(refusal)
        response.set_status(status)
        return response

    def log_exception(self, *args: Any, **kw: Any) -> None:
        exc = kw.get("exc_info")
        if isinstance(exc, (HttpProcessingError, web.RequestPayloadError)):
            # a body the handler left unread, drained after its answer, that would not decode
            log.info(
                "closed a connection whose request body could not be read: %s", parse_message(exc, None, 400)
            )
            return
        super().log_exception(*args, **kw)


class EdgeServer(QuietServer):
    """aiohttp's server for one app, making :class:`EdgeConnection` s and holding at most
    ``max_connections`` of them."""

    WARN_EVERY_S = 10.0

    def __init__(self, made: web.Server, *, max_connections: int) -> None:
        super().__init__(made)
        self.max_connections = max_connections
        self._warned_at = -self.WARN_EVERY_S

    def __call__(self) -> RequestHandler:
        return EdgeConnection(self, loop=self._loop, **self._kwargs)

    def note_refused(self) -> bool:
        """Whether this refusal should be logged (at most one line every ``WARN_EVERY_S``)."""
        now = self._loop.time()
        if now - self._warned_at < self.WARN_EVERY_S:
            return False
        self._warned_at = now
        return True


class EdgeRunner(web.AppRunner):
    """``web.AppRunner`` serving through :class:`EdgeServer`."""

    def __init__(self, app: web.Application, *, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        return EdgeServer(await super()._make_server(), max_connections=self.max_connections)


def ensure_descriptors(connections: int) -> int:
    """Raise this process's soft limit on open files towards what ``connections`` need (``FD_SPARE`` more),
    up to the hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + FD_SPARE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            log.warning("could not raise the open-file limit from %d to %d", soft, raised, exc_info=True)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        log.warning(
            "SLUICE_EDGE_MAX_CONNECTIONS=%d needs ~%d open files; this process may open %d (ulimit -n)",
            connections,
            wanted,
            soft,
        )
    return soft
