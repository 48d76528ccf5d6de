"""The edge's own hardening: ``/metrics`` behind the ops token, the Host allow-list (DNS rebinding), and
no public bind with the demo key or without an ops token."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from ingest.app import Edge
from ingest.auth import DEMO_KEY, TenantDirectory, hash_key
from ingest.main import check_edge_exposure
from ingest.models import ModelCatalogue
from schemas.settings import PlatformSettings, SettingsError
from tests.ingest.conftest import AUTH, EMB, GEN, Client, MakeClient, settings
from tests.ingest.fake_gateway import FakeGateway

TOKEN = "edge-ops-token-0123456789"
OPS = {"Authorization": f"Bearer {TOKEN}"}
REBOUND = {"Host": "attacker.example:8080"}


@pytest.fixture
async def guarded(
    catalogue: ModelCatalogue, gateway: FakeGateway, tenants: TenantDirectory
) -> AsyncIterator[Client]:
    edge = Edge(settings(), gateway, catalogue, tenants, ops_token=TOKEN)
    client: Client = TestClient(TestServer(edge.app))
    await client.start_server()
    yield client
    await edge.stop()
    await client.close()


def error_of(body: dict[str, Any]) -> tuple[str, str]:
    return body["error"]["type"], body["error"]["code"]


async def test_metrics_want_the_ops_token_when_one_is_set(guarded: Client) -> None:
    refused = await guarded.get("/metrics")
    assert refused.status == 401
    assert error_of(await refused.json()) == ("invalid_request_error", "invalid_ops_token")
    assert (await guarded.get("/metrics", headers=AUTH)).status == 401  # a tenant's key is no ops token
    served = await guarded.get("/metrics", headers=OPS)
    assert served.status == 200
    assert "sluice_" in await served.text()
    assert (await guarded.get("/v1/models", headers=AUTH)).status == 200  # tenants are unaffected
    for probe in ("/healthz", "/readyz"):
        assert (await guarded.get(probe)).status in (200, 503)


async def test_readyz_names_the_models_only_to_the_ops_token(guarded: Client, client: Client) -> None:
    """Found by a review: ``/readyz`` needs no key and named every model the edge serves to anyone, those
    ``/v1/models`` hides from a tenant too. It gives their number to every prober, their names only to the
    ops token, and a probe without a token set names none."""
    for probe, headers in ((guarded, {}), (guarded, AUTH), (client, {}), (client, AUTH)):
        ready = await probe.get("/readyz", headers=headers)
        assert ready.status == 200
        body = await ready.json()
        assert body == {"ready": True, "checks": body["checks"]}
        assert body["checks"]["models"] == 2
        assert EMB not in str(body)
        assert GEN not in str(body)
    named = await (await guarded.get("/readyz", headers=OPS)).json()
    assert named["models"] == [EMB, GEN]


async def test_another_spelling_of_the_metrics_path_is_checked_too(guarded: Client) -> None:
    server = guarded.server
    reader, writer = await asyncio.open_connection(server.host, server.port)
    writer.write(
        f"GET /%6Detrics HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\nConnection: close\r\n\r\n".encode()
    )
    await writer.drain()
    status_line = (await reader.read()).split(b"\r\n", 1)[0]
    writer.close()
    await writer.wait_closed()
    assert status_line == b"HTTP/1.1 401 Unauthorized"


async def test_without_a_token_metrics_stay_open_on_loopback(client: Client) -> None:
    assert (await client.get("/metrics")).status == 200


async def test_a_foreign_host_gets_421_in_openai_shape(client: Client) -> None:
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("GET", "/metrics")):
        refused = await client.request(method, path, headers={**AUTH, **REBOUND})
        assert refused.status == 421, path
        body = await refused.json()
        assert error_of(body) == ("invalid_request_error", "host_not_allowed")
        assert "attacker.example" in body["error"]["message"]
    refused_ws = await client.get("/v1/ws", headers={**AUTH, **REBOUND})
    assert refused_ws.status == 421
    assert (await client.get("/healthz", headers=REBOUND)).status == 200
    assert (await client.get("/v1/models", headers={**AUTH, "Host": "localhost:8080"})).status == 200
    assert (await client.get("/v1/models", headers={**AUTH, "Host": "[::1]:8080"})).status == 200


async def test_allowed_hosts_replace_the_default(make_client: MakeClient) -> None:
    client, _ = await make_client(edge_allowed_hosts=["api.example.com"])
    assert (await client.get("/v1/models", headers={**AUTH, "Host": "api.example.com"})).status == 200
    assert (await client.get("/v1/models", headers=AUTH)).status == 421  # 127.0.0.1 is not listed


def test_the_demo_key_is_refused_off_loopback(
    catalogue: ModelCatalogue, gateway: FakeGateway, tmp_path: Path
) -> None:
    exposed = settings(edge_host="0.0.0.0")
    with pytest.raises(
        SettingsError, match=rf"SLUICE_EDGE_TENANTS_FILE is unset: anyone could use .*{DEMO_KEY}"
    ):
        Edge(exposed, gateway, catalogue, ops_token=TOKEN)
    with pytest.raises(SettingsError, match="set SLUICE_EDGE_TENANTS_FILE"):
        check_edge_exposure(PlatformSettings(ops_token=TOKEN), exposed)
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(f'[tenants.acme]\nkey_sha256 = ["{hash_key("sk-acme-0123456789")}"]\n')
    with_file = settings(edge_host="0.0.0.0", edge_tenants_file=str(tenants))
    check_edge_exposure(PlatformSettings(ops_token=TOKEN), with_file)
    Edge(with_file, gateway, catalogue, ops_token=TOKEN)


def test_an_exposed_edge_needs_an_ops_token(catalogue: ModelCatalogue, gateway: FakeGateway) -> None:
    exposed = settings(edge_host="10.0.0.5")
    tenants = TenantDirectory({})
    with pytest.raises(SettingsError, match=r"SLUICE_EDGE_HOST='10\.0\.0\.5'.*set SLUICE_OPS_TOKEN"):
        Edge(exposed, gateway, catalogue, tenants)
    Edge(exposed, gateway, catalogue, tenants, ops_token=TOKEN)
    check_edge_exposure(PlatformSettings(), settings(edge_host="localhost"))
