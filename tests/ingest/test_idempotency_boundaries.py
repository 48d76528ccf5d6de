"""Boundaries of ingest/idempotency.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

from ingest.idempotency import ClaimTable
from tests.ingest.test_idempotency import _claim


def test_a_claim_pushed_out_of_its_tenants_bound_is_forgotten_by_request_too() -> None:
    """idempotency.py:45: the per-tenant bound holds for the request-id index as well (else it grows for
    ever in a long-lived edge, and an evicted claim still answers a resume)."""
    table = ClaimTable(per_tenant=2)
    for i in range(5):
        table.apply(_claim("acme", f"k{i}", f"r{i}"))
    assert len(table) == 2
    assert table.by_request("acme", "r0") is None
    assert table.by_request("acme", "r4") is not None
    assert len(table._by_request) == 2


def test_an_expired_claim_taken_over_is_forgotten_by_request() -> None:
    """idempotency.py:40: a key claimed again after its claim expired: the old request id no longer names a
    claim (its replies are not resumable through the table, nor kept in it)."""
    table = ClaimTable(ttl_s=60)
    table.apply(_claim("acme", "k", "r1", time_ms=1_000))
    table.apply(_claim("acme", "k", "r2", time_ms=1_000 + 61_000))
    assert table.by_request("acme", "r1") is None
    assert table.by_request("acme", "r2") is not None
