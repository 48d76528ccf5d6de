"""An edge whose Kafka gateway died (its producer, reply listener or control listener thread) serves nothing
again: it fails with it, so ``serve_edge`` ends with :class:`EdgeFailed` (``sluice edge`` exits 1 for its
supervisor to restart it) and ``/healthz`` answers 503 (a liveness probe restarts the pod). A review found
the edge answering 503 to every request for good, with ``/healthz`` at 200 and the process never ending."""

from __future__ import annotations

import asyncio
from typing import Self

import pytest

from ingest.app import Edge
from ingest.auth import TenantDirectory
from ingest.main import EdgeFailed, serve_edge
from ingest.models import ModelCatalogue
from tests.ingest.conftest import MakeClient, settings
from tests.ingest.fake_gateway import FakeGateway


class DyingGateway(FakeGateway):
    """The fake gateway run as ``serve_edge`` runs the real one (``async with``); ``fail`` is what a dying
    thread of the real one calls."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def test_an_edge_whose_gateway_died_exits_so_its_supervisor_restarts_it(
    catalogue: ModelCatalogue, tenants: TenantDirectory
) -> None:
    gateway = DyingGateway()
    edge = Edge(settings(), gateway, catalogue, tenants)
    stop = asyncio.Event()
    served = asyncio.create_task(serve_edge(edge, gateway, stop))  # type: ignore[arg-type]
    await asyncio.sleep(0.2)
    assert not served.done()
    gateway.fail(RuntimeError("reply listener died: KafkaException(_FATAL)"))
    done, _ = await asyncio.wait({served}, timeout=10)
    if not done:
        stop.set()
        await served
        pytest.fail("serve_edge still ran 10 s after the gateway died: `sluice edge` would never exit")
    with pytest.raises(EdgeFailed, match="reply listener died"):
        await served


async def test_healthz_fails_once_the_gateway_died(make_client: MakeClient, gateway: FakeGateway) -> None:
    client, edge = await make_client()
    assert (await client.get("/healthz")).status == 200
    gateway.fail(RuntimeError("producer fatal error"))
    assert edge.failure is not None
    response = await client.get("/healthz")
    assert response.status == 503
    assert await response.json() == {"status": "failed"}  # the probe needs no key: no internals said
