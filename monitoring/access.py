"""Who may read a service's operational endpoints, and which ``Host`` names a service answers.

Every service serves ``/metrics`` (tenant names in its labels) and the streams worker its dashboard (every
tenant's spend). :class:`OpsAccess` guards them with one bearer token, ``SLUICE_OPS_TOKEN``:

- set: ``/metrics`` and ``/dashboard*`` want ``Authorization: Bearer <token>`` (a browser opens
  ``/dashboard?token=<token>`` once and keeps an HttpOnly, SameSite=Strict cookie for the dashboard);
- unset: they stay open, but only while the service listens on loopback (logged at start); a service asked
  to bind any other address refuses to start, naming the setting.

``/healthz`` and ``/readyz`` (:data:`PROBES`) are always open: orchestrators probe them without secrets.

:class:`HostAllowList` answers whether a request's ``Host`` header names this service. A browser page on
another site can rebind its own DNS name to 127.0.0.1 and then read a loopback service as same-origin; the
``Host`` it sends is still its own name, so refusing unknown names stops it. Default: the loopback names
plus the bind address; a service bound to every address (``0.0.0.0``, ``::``) answers any name unless a
list is configured (its endpoints need credentials there anyway). Probes skip the check too.

The cookie holds an HMAC of the token, never the token: it opens the dashboard only, and changing the
token ends every session.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable, Sequence
from urllib.parse import urlencode

from aiohttp import web
from aiohttp.typedefs import Middleware

from schemas.settings import SettingsError, bare_host, is_loopback, is_wildcard

log = logging.getLogger(__name__)

TOKEN_VARIABLE = "SLUICE_OPS_TOKEN"  # noqa: S105 (the variable's name, not a secret)
PROBES = frozenset({"/healthz", "/readyz"})
"""Paths every caller may read, whatever its credentials or ``Host``."""
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")
SESSION_COOKIE = "sluice_ops_session"
_SESSION_CONTEXT = b"sluice dashboard session v1"


def check_exposure(token: str | None, *, host: str, variable: str, service: str) -> None:
    """Refuse (:class:`SettingsError`, naming the settings) to serve ops endpoints without a token on an
    address other than loopback. Services call it before any slow start-up work."""
    if token is None and not is_loopback(host):
        raise SettingsError(
            f"{variable}={host!r} is not a loopback address, so {service}'s ops endpoints would be open to "
            f"the network: set {TOKEN_VARIABLE} (a bearer token, at least 16 characters), or bind 127.0.0.1"
        )


class OpsAccess:
    """The ops token rule of one service that listens on ``host`` (the setting named ``variable``).

    Raises :class:`SettingsError` when no token is set and ``host`` is not a loopback address.
    """

    def __init__(self, token: str | None, *, host: str, variable: str, service: str) -> None:
        check_exposure(token, host=host, variable=variable, service=service)
        if token is None:
            log.info(
                "%s: ops endpoints are open to anyone on this machine (%s is loopback and %s is unset)",
                service,
                host,
                TOKEN_VARIABLE,
            )
        self._token = token.encode() if token is not None else None

    @property
    def required(self) -> bool:
        return self._token is not None

    def allows(self, authorization: str | None) -> bool:
        """True for ``Bearer <token>`` (or anything when no token is set)."""
        if self._token is None:
            return True
        scheme, _, value = (authorization or "").strip().partition(" ")
        return scheme.lower() == "bearer" and self.matches(value.strip())

    def matches(self, token: str) -> bool:
        """True when ``token`` is the ops token (compared in constant time)."""
        presented = token.encode("utf-8", "surrogateescape")  # a non-UTF-8 header byte: no match, not a 500
        return self._token is not None and hmac.compare_digest(presented, self._token)

    def session(self) -> str:
        """The dashboard cookie's value: derived from the token, so it cannot be used as one."""
        if self._token is None:
            raise RuntimeError("no ops token: no session to give")
        return hmac.new(self._token, _SESSION_CONTEXT, hashlib.sha256).hexdigest()

    def allows_session(self, cookie: str | None) -> bool:
        if self._token is None:
            return True
        presented = cookie.encode("utf-8", "surrogateescape") if cookie is not None else None
        return presented is not None and hmac.compare_digest(presented, self.session().encode())


def host_name(value: str) -> str:
    """The name in a ``Host`` header or allow-list entry, port dropped: ``[::1]:8080`` -> ``::1``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:  # host:port (an address with more colons is a bare IPv6 address)
        value = value.partition(":")[0]
    return bare_host(value)


class HostAllowList:
    """The ``Host`` names a service listening on ``bind_host`` answers.

    ``entries`` (a setting, e.g. ``SLUICE_EDGE_ALLOWED_HOSTS``): names or addresses, ports ignored; ``*``
    allows any name and ``.example.com`` that domain and its subdomains. Empty: the loopback names plus
    ``bind_host``, or any name when ``bind_host`` is a wildcard address.
    """

    def __init__(self, entries: Sequence[str], bind_host: str) -> None:
        names = [host_name(e) for e in entries if e.strip()]
        if not names:
            names = ["*"] if is_wildcard(bind_host) else [*LOOPBACK_NAMES, host_name(bind_host)]
        self.any = "*" in names
        self.names = frozenset(n for n in names if not n.startswith("."))
        self.domains = tuple(n for n in names if n.startswith("."))

    def allows(self, host: str | None) -> bool:
        if self.any:
            return True
        if not host:
            return False
        name = host_name(host)
        return name in self.names or any(name.endswith(d) or name == d[1:] for d in self.domains)

    def __repr__(self) -> str:
        shown = ["*"] if self.any else sorted(self.names) + list(self.domains)
        return f"HostAllowList({', '.join(shown)})"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def route_of(request: web.Request) -> str | None:
    """The path of the route that will answer ``request`` (None: no route, a 404). Checks use it rather
    than ``request.path``, so a spelling of a path that reaches a handler cannot also dodge its check."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else None


def ops_middleware(
    access: OpsAccess, hosts: HostAllowList, *, session_prefix: str = "/dashboard"
) -> Middleware:
    """An aiohttp middleware for a server whose every route but the probes is operational (the streams
    worker: ``/metrics`` and the dashboard). Answers are JSON ``{"error": ...}``.

    Under ``session_prefix`` the session cookie also admits, and ``<session_prefix>?token=<token>`` sets it
    and redirects to the same page without the token (so it leaves the address bar and the history).
    """

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = route_of(request)
        if route in PROBES:
            return await handler(request)
        if not hosts.allows(request.headers.get("Host")):
            return _refuse(421, f"this server does not answer for Host {request.headers.get('Host')!r}")
        in_session_scope = route is not None and (
            route == session_prefix or route.startswith(session_prefix + "/")
        )
        if access.required and route == session_prefix and "token" in request.query:
            return _open_session(request, access, session_prefix)
        if access.allows(request.headers.get("Authorization")):
            return await handler(request)
        if in_session_scope and access.allows_session(request.cookies.get(SESSION_COOKIE)):
            return await handler(request)
        hint = f" (or open {session_prefix}?token=<token> once in a browser)" if in_session_scope else ""
        response = _refuse(401, f"send Authorization: Bearer <{TOKEN_VARIABLE}>{hint}")
        response.headers["WWW-Authenticate"] = 'Bearer realm="sluice ops"'
        return response

    return guard


def _open_session(request: web.Request, access: OpsAccess, path: str) -> web.StreamResponse:
    if not access.matches(request.query["token"]):
        return _refuse(401, f"wrong token: open {path}?token=<{TOKEN_VARIABLE}>")
    query = urlencode([(k, v) for k, v in request.query.items() if k != "token"])  # CR/LF stay encoded
    location = request.rel_url.raw_path + (f"?{query}" if query else "")
    response = web.Response(status=303, headers={"Location": location})
    response.set_cookie(
        SESSION_COOKIE,
        access.session(),
        path=path,
        httponly=True,
        samesite="Strict",
        secure=request.secure,
    )
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["Cache-Control"] = "no-store"
    return response


def _refuse(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status, headers={"Cache-Control": "no-store"})
