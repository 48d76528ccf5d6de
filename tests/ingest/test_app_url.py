"""The edge's own URL (``sluice up`` prints it and polls the edges it starts at it)."""

from __future__ import annotations

import aiohttp
import pytest

from ingest.app import Edge
from ingest.auth import TenantDirectory
from ingest.models import ModelCatalogue
from tests.ingest.conftest import settings
from tests.ingest.fake_gateway import FakeGateway


@pytest.mark.parametrize(("host", "shown"), [("::1", "[::1]"), ("127.0.0.1", "127.0.0.1")])
async def test_the_edge_url_brackets_an_ipv6_host_and_answers(
    catalogue: ModelCatalogue, gateway: FakeGateway, host: str, shown: str
) -> None:
    """A review found ``http://::1:8080`` printed for an edge on the IPv6 loopback: no client reaches it."""
    edge = Edge(settings(edge_host=host), gateway, catalogue, TenantDirectory.demo())
    await edge.start()
    try:
        assert edge.url == f"http://{shown}:{edge.port}"
        async with aiohttp.ClientSession() as session, session.get(f"{edge.url}/healthz") as response:
            assert response.status == 200
    finally:
        await edge.stop()
