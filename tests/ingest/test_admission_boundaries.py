"""Boundaries of ingest/admission.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

from ingest.admission import Admission
from ingest.auth import Tenant


async def test_the_edge_is_not_idle_while_another_request_is_in_flight() -> None:
    """Graceful shutdown waits with wait_idle(): one of two requests ending must not make the edge idle
    (else the drain returns at once and cuts the other request's stream)."""
    admission = Admission()
    tenant = Tenant(key_sha256=["x"])
    with admission.flight(tenant, "m", "req-1", owner=True):
        with admission.flight(tenant, "m", "req-2", owner=True):
            pass
        assert await admission.wait_idle(0.05) is False
    assert await admission.wait_idle(0.05) is True
