"""``/metrics``, ``/healthz`` and ``/readyz`` for a process without a web app (a model worker runs plain
threads): a small threaded HTTP server on a daemon thread.

``Readiness`` is what every service's ``/readyz`` answers, the edge's aiohttp route included.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, cast
from urllib.parse import urlsplit

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from monitoring import MonitoringError
from monitoring.access import PROBES, TOKEN_VARIABLE, HostAllowList, OpsAccess
from monitoring.metrics import CONTENT_TYPE, exposition
from schemas.lifecycle import Component

log = logging.getLogger(__name__)

CheckValue = bool | int | float | str
JSON_TYPE = "application/json"


class Readiness(msgspec.Struct, frozen=True, kw_only=True):
    """Whether a service should get traffic, with the checks that decided it (``/readyz``'s body)."""

    ready: bool
    checks: dict[str, CheckValue] = msgspec.field(default_factory=dict)

    @classmethod
    def of(cls, **checks: CheckValue) -> Readiness:
        """Ready when every boolean check is true; other values (a lag, a version) are shown only."""
        ready = all(value for value in checks.values() if isinstance(value, bool))
        return cls(ready=ready, checks=dict(checks))

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)


ReadinessProbe = Callable[[], Readiness]


MESSAGE_CHARS = 200
"""aiohttp's messages quote what it could not parse after the first line (the bytes and a caret), and a
line too long in full: an answer or a log line keeps the first line, cut to this."""


def parse_message(exc: BaseException | None, message: str | None, status: int) -> str:
    """The first line of what aiohttp says of a request it could not parse, without the bytes it quotes."""
    text = message or (exc.message if isinstance(exc, HttpProcessingError) else str(exc or ""))
    line = text.strip().splitlines()[0] if text.strip() else f"HTTP {status}"
    for quote in (": b'", ': b"', ": bytearray(", ". Please install"):  # the last: advice for the server
        line = line.split(quote, 1)[0]
    return line.rstrip(": ")[:MESSAGE_CHARS]


class QuietConnection(RequestHandler):
    """aiohttp's connection, but a request it cannot parse (no ``Host``, a bad ``Content-Length``, a header
    over 8 KB) is logged in one line at INFO, not with a traceback at ERROR: anyone who can connect could
    otherwise fill the log. The edge answers those in OpenAI's shape (``ingest.protocol``)."""

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: a response started cannot be replaced
            raise ConnectionError("Response is sent already, cannot send another response with the error")
        reason = None
        if 400 <= status < 500:
            reason = parse_message(exc, message, status)
            log.info("refused a malformed request from %s: %s", request.remote, reason)
        elif status != 504:  # 504: the request timed out, nothing went wrong here
            log.error("error handling a request from %s", request.remote, exc_info=exc)
        response = self.answer(status, reason)
        response.force_close()
        return response

    def answer(self, status: int, reason: str | None) -> web.Response:
        """What a request aiohttp could not handle gets: ``reason``, why it could not be parsed (a 4xx), or
        None (a timeout, an error here)."""
        return web.Response(status=status, text=f"{status}: {reason or 'the request could not be handled'}\n")


class QuietServer(web.Server):
    """aiohttp's server for one app, as aiohttp made it, making :class:`QuietConnection` s."""

    def __init__(self, made: web.Server) -> None:
        self.__dict__.update(vars(made))  # its handler, request factory and options

    def __call__(self) -> RequestHandler:
        return QuietConnection(self, loop=self._loop, **self._kwargs)


class QuietRunner(web.AppRunner):
    """``web.AppRunner`` serving through :class:`QuietServer` (the streams worker's dashboard and ops)."""

    async def _make_server(self) -> web.Server:
        return QuietServer(await super()._make_server())


def url_host(host: str) -> str:
    """``host`` as a URL's authority wants it: an IPv6 address in brackets (``::1`` -> ``[::1]``), anything
    else as it is. Every URL the platform builds from a bind host goes through here (a review found
    ``http://::1:8090/readyz``, which no client can reach, polled until ``sluice up`` gave up)."""
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    return f"[{bare}]" if ":" in bare else bare


def http_url(host: str, port: int) -> str:
    """``http://host:port`` with ``host`` as :func:`url_host` writes it."""
    return f"http://{url_host(host)}:{port}"


def bound_port(runner: web.AppRunner | None, what: str) -> int:
    """The port an aiohttp runner listens on once started (its config may have said 0)."""
    if runner is None or not runner.addresses:
        raise RuntimeError(f"{what} is not started")
    return int(runner.addresses[0][1])


class OpsServerError(MonitoringError):
    """The ops endpoints could not be served (e.g. the port is taken)."""


class OpsServer(Component):
    """Serve the operational routes on ``host:port`` (port 0: an ephemeral one, see ``port``).

    ``readiness`` is called on each ``/readyz``, on a request thread: it must be quick and thread-safe.
    ``/metrics`` wants ``Authorization: Bearer <token>`` when ``token`` (``SLUICE_OPS_TOKEN``) is set; without
    one, a ``host`` other than loopback is refused here (a :class:`SettingsError` naming ``host_setting``).
    Requests whose ``Host`` is not this server's are refused with 421 (``/healthz`` and ``/readyz`` excepted);
    see :mod:`monitoring.access`. ``start()``/``stop()`` or ``with``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        readiness: ReadinessProbe,
        *,
        service: str,
        token: str | None = None,
        host_setting: str = "SLUICE_WORKER_OPS_HOST",
    ) -> None:
        super().__init__()
        self._access = OpsAccess(token, host=host, variable=host_setting, service=service)
        self._hosts = HostAllowList((), host)
        self.host = host
        self._port = port
        self._readiness = readiness
        self.service = service
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        """The bound port once started (the configured one before)."""
        server = self._server
        return int(server.server_address[1]) if server is not None else self._port

    @property
    def url(self) -> str:
        return http_url(self.host, self.port)

    def _start(self) -> None:
        with self._lock:
            if self._server is not None:
                return
            server_cls = _Server6 if ":" in self.host else _Server
            try:
                server = server_cls((self.host, self._port), _Handler)
            except OSError as exc:
                raise OpsServerError(
                    f"{self.service}: cannot serve /metrics on {self.host}:{self._port}: {exc.strerror} "
                    "(another process there? choose another port)"
                ) from exc
            server.ops = self
            self._server = server
            self._thread = threading.Thread(
                target=server.serve_forever,
                kwargs={"poll_interval": 0.05},
                name=f"ops-{self.service}",
                daemon=True,
            )
            self._thread.start()
        log.info("%s serves /metrics, /healthz, /readyz on %s", self.service, self.url)

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        with self._lock:
            server, thread = self._server, self._thread
            self._server = self._thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()

    def respond(
        self, path: str, *, host: str | None, authorization: str | None = None
    ) -> tuple[int, str, bytes]:
        """(status, content type, body) for a GET of ``path`` with these ``Host`` and ``Authorization``."""
        if path not in PROBES and not self._hosts.allows(host):
            return 421, JSON_TYPE, msgspec.json.encode({"error": f"this server does not answer for {host!r}"})
        if path == "/metrics" and not self._access.allows(authorization):
            return (
                401,
                JSON_TYPE,
                msgspec.json.encode({"error": f"send Authorization: Bearer <{TOKEN_VARIABLE}>"}),
            )
        match path:
            case "/metrics":
                return 200, CONTENT_TYPE, exposition()
            case "/healthz":
                return 200, JSON_TYPE, msgspec.json.encode({"status": "ok", "service": self.service})
            case "/readyz":
                return self._ready()
            case _:
                return 404, JSON_TYPE, msgspec.json.encode({"error": "not found", "path": path})

    def _ready(self) -> tuple[int, str, bytes]:
        try:
            readiness = self._readiness()
        except Exception as exc:  # an unready answer, not a crashed request
            log.warning("%s readiness check failed", self.service, exc_info=True)
            body = {"ready": False, "checks": {}, "error": f"{type(exc).__name__}: {exc}"}
            return 503, JSON_TYPE, msgspec.json.encode(body)
        return (200 if readiness.ready else 503), JSON_TYPE, readiness.to_json()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    ops: OpsServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, BrokenPipeError | ConnectionResetError):  # a scrape or probe that timed out
            log.debug("ops client %s went away: %s", client_address, exc)
            return
        log.exception("ops request from %s failed", client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _Handler(BaseHTTPRequestHandler):
    timeout = 10.0  # a client that stops sending does not hold a thread forever
    server_version = "sluice-ops"

    def do_GET(self) -> None:
        ops = cast(_Server, self.server).ops
        status, content_type, body = ops.respond(
            urlsplit(self.path).path,
            host=self.headers.get("Host"),
            authorization=self.headers.get("Authorization"),
        )
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)
