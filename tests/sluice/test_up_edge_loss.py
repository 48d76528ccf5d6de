"""``sluice up``'s edge 1 runs in its process: once its Kafka gateway died, the platform stops and ``sluice
up`` exits 1 (:class:`EdgeFailed`) for whoever runs it to start it again. A review found it sitting "up"
with every request refused, nothing watching the edge or its gateway."""

from __future__ import annotations

import asyncio

import pytest

from ingest.app import Edge
from ingest.auth import TenantDirectory
from ingest.main import EdgeFailed
from ingest.models import ModelCatalogue
from sluice.up import EdgeLoss
from tests.ingest.conftest import catalogue, model_cache, settings, tenants  # noqa: F401  (fixtures)
from tests.ingest.fake_gateway import FakeGateway


async def test_up_stops_and_fails_once_edge_1s_gateway_died(
    catalogue: ModelCatalogue,  # noqa: F811
    tenants: TenantDirectory,  # noqa: F811
) -> None:
    gateway = FakeGateway()
    edge = Edge(settings(), gateway, catalogue, tenants)
    halt = asyncio.Event()
    lost = EdgeLoss(halt)
    lost.watch(edge)
    lost.check()  # nothing failed: the platform stops quietly on a Ctrl-C
    # the dying thread is not the loop's: the halt comes through the loop
    await asyncio.to_thread(gateway.fail, RuntimeError("control listener died"))
    async with asyncio.timeout(5):
        await halt.wait()
    with pytest.raises(EdgeFailed, match="control listener died"):
        lost.check()
