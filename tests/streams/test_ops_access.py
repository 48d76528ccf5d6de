"""The streams worker's HTTP server (dashboard, ``/metrics``, probes) behind the ops token and the Host
allow-list, served by aiohttp's test server with a fake warehouse."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from ingest.auth import hash_key
from monitoring.access import SESSION_COOKIE, HostAllowList, OpsAccess
from monitoring.ops import Readiness
from schemas.settings import PlatformSettings, SettingsError
from streams.dashboard import Dashboard
from streams.service import StreamsService, http_app
from streams.settings import StreamsSettings

TOKEN = "streams-ops-token-0123456789"
BEARER = {"Authorization": f"Bearer {TOKEN}"}
GUARDED = ("/metrics", "/dashboard", "/dashboard/app.js", "/dashboard/data")

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]


async def empty_warehouse(sql: str) -> list[dict[str, Any]]:
    return [{"present": 0}] if "system.tables" in sql else []


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[Client] = []

    async def make(token: str | None = None, allowed: tuple[str, ...] = ()) -> Client:
        access = OpsAccess(
            token, host="127.0.0.1", variable="SLUICE_STREAMS_HOST", service="the streams worker"
        )
        app = http_app(
            Dashboard(empty_warehouse),
            lambda: Readiness.of(kafka=True),
            access,
            HostAllowList(allowed, "127.0.0.1"),
        )
        client: Client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def test_without_a_token_loopback_stays_open(make_client: MakeClient) -> None:
    client = await make_client()
    for path in (*GUARDED, "/healthz", "/readyz"):
        response = await client.get(path)
        assert response.status == 200, path


async def test_with_a_token_the_dashboard_and_metrics_want_it(make_client: MakeClient) -> None:
    client = await make_client(TOKEN)
    for path in GUARDED:
        refused = await client.get(path)
        assert refused.status == 401, path
        assert refused.headers["WWW-Authenticate"].startswith("Bearer")
        assert "SLUICE_OPS_TOKEN" in (await refused.json())["error"]
        assert (await client.get(path, headers={"Authorization": "Bearer wrong-token"})).status == 401
        assert (await client.get(path, headers=BEARER)).status == 200, path
    metrics = await client.get("/metrics", headers=BEARER)
    assert "sluice_" in await metrics.text()
    for probe in ("/healthz", "/readyz"):
        assert (await client.get(probe)).status == 200


async def test_a_browser_opens_the_dashboard_once_with_the_token(make_client: MakeClient) -> None:
    client = await make_client(TOKEN)
    wrong = await client.get("/dashboard?token=nope", allow_redirects=False)
    assert wrong.status == 401
    assert not wrong.cookies
    opened = await client.get(f"/dashboard?token={TOKEN}&minutes=30", allow_redirects=False)
    assert opened.status == 303
    assert opened.headers["Location"] == "/dashboard?minutes=30"  # the token leaves the address bar
    cookie = opened.headers["Set-Cookie"]
    assert cookie.startswith(f"{SESSION_COOKIE}=")
    assert TOKEN not in cookie
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/dashboard"):
        assert attribute in cookie
    # the test client keeps the cookie, as a browser would
    for path in ("/dashboard", "/dashboard/app.js", "/dashboard/data?minutes=5"):
        assert (await client.get(path)).status == 200, path
    assert (await client.get("/metrics")).status == 401  # the session opens the dashboard only


async def test_the_session_redirect_keeps_query_values_encoded(make_client: MakeClient) -> None:
    """A CR/LF in a query value went into the Location header decoded (aiohttp then refused the response
    and the browser got an empty reply): it stays percent-encoded."""
    client = await make_client(TOKEN)
    opened = await client.get(f"/dashboard?token={TOKEN}&x=%0d%0aSet-Cookie:a=b", allow_redirects=False)
    assert opened.status == 303
    assert opened.headers["Location"] == "/dashboard?x=%0D%0ASet-Cookie%3Aa%3Db"
    assert "a=b" not in opened.headers.getall("Set-Cookie", [""])[0]


def test_a_token_or_key_that_is_not_utf8_is_refused_not_a_server_error() -> None:
    """aiohttp reads header bytes that are not UTF-8 as lone surrogates; encoding them raised, a 500 (and
    a logged traceback) anyone could cause without a token or an API key."""
    access = OpsAccess(TOKEN, host="127.0.0.1", variable="SLUICE_OPS_TOKEN", service="test")
    assert access.matches("\udcff\udcfe") is False
    assert access.allows_session("\udcff") is False
    assert hash_key("sk-\udcff\udcfe") != hash_key("sk-")  # an unknown key: a 401


async def test_a_foreign_host_is_refused_but_probes_answer(make_client: MakeClient) -> None:
    client = await make_client()
    rebound = {"Host": "attacker.example:8090"}
    for path in GUARDED:
        refused = await client.get(path, headers=rebound)
        assert refused.status == 421, path
        assert "attacker.example" in (await refused.json())["error"]
    for probe in ("/healthz", "/readyz"):
        assert (await client.get(probe, headers=rebound)).status == 200
    assert (await client.get("/dashboard", headers={"Host": "localhost:8090"})).status == 200


async def test_the_allow_list_setting_names_the_hosts(make_client: MakeClient) -> None:
    client = await make_client(allowed=("ops.example.com",))
    assert (await client.get("/dashboard", headers={"Host": "ops.example.com"})).status == 200
    assert (await client.get("/dashboard", headers={"Host": "127.0.0.1"})).status == 421


def test_an_exposed_streams_worker_without_a_token_does_not_start() -> None:
    exposed = StreamsSettings(streams_host="0.0.0.0")
    with pytest.raises(SettingsError, match=r"SLUICE_STREAMS_HOST='0\.0\.0\.0'.*SLUICE_OPS_TOKEN"):
        StreamsService(PlatformSettings(), exposed)
