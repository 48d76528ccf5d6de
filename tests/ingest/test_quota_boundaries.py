"""Boundaries of ingest/quota.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

import pytest

from ingest.quota import Key, Limits, QuotaExceeded, QuotaLedger
from schemas.coordination import QuotaSync, QuotaUsage
from tests.ingest.test_quota import Clock, T, ledger


def refusal(quota: QuotaLedger, checks: list[tuple[Key, Limits]], tokens: int = 0):  # type: ignore[no-untyped-def]
    with pytest.raises(QuotaExceeded) as caught:
        quota.admit(checks, tokens)
    return caught.value.refusal


def peer_sync(clock: Clock, in_flight: int = 0, requests: int = 0, edge: str = "edge-b") -> QuotaSync:
    usage = (QuotaUsage(tenant=T[0], model=T[1], requests=requests, tokens=0, in_flight=in_flight),)
    return QuotaSync(edge=edge, time_ms=int(clock.now * 1000), window_s=60, usage=usage)


def test_a_request_running_past_the_window_still_holds_its_place() -> None:
    """quota.py:100 (``idle``: no buckets AND nothing in flight): a generation longer than the 60 s window
    must keep counting against max_concurrency after a sync prunes its bucket."""
    clock = Clock()
    quota = ledger(clock)
    limits = [(T, Limits(max_concurrency=1))]
    quota.admit(limits, 0)
    clock.now += 61  # its admission left the window; it still runs
    quota.snapshot(lambda key: Limits(max_concurrency=1))
    assert refusal(quota, limits).code == "concurrency_limit_exceeded"


def test_a_replay_gives_back_its_tokens_but_still_counts_as_a_request() -> None:
    """quota.py:196/198 (``int(request)``): refund(request=False) (an idempotent replay) keeps the request
    counted; else replays bypass requests_per_min."""
    clock = Clock()
    quota = ledger(clock)
    limits = [(T, Limits(requests_per_min=1))]
    replay = quota.admit(limits, 0)
    quota.refund(replay, request=False)
    assert refusal(quota, limits).code == "rate_limit_exceeded"


def test_a_replay_refund_keeps_its_request_in_the_edges_share() -> None:
    """quota.py:198: with a live peer, the request a replay made stays in this edge's share since the sync."""
    clock = Clock()
    quota = ledger(clock)
    quota.apply(peer_sync(clock))
    limits = [(T, Limits(requests_per_min=2))]  # share: ceil(2 / 2) = 1 per edge
    replay = quota.admit(limits, 0)
    quota.refund(replay, request=False)
    assert refusal(quota, limits).code == "rate_limit_exceeded"


def test_a_second_release_of_one_request_frees_no_other_place() -> None:
    """quota.py:213 (release idempotent): releasing one request twice must not free another's place."""
    quota = ledger(Clock())
    limits = [(T, Limits(max_concurrency=2))]
    a = quota.admit(limits, 0)
    quota.admit(limits, 0)
    quota.release(a)
    quota.release(a)
    assert quota.used(T)[2] == 1
    quota.admit(limits, 0)
    assert refusal(quota, limits).code == "concurrency_limit_exceeded"


def test_an_edges_share_of_the_places_rounds_up() -> None:
    """quota.py:239 (``ceil(places / edges)``): 3 places over 2 edges: this edge may take 2, not 1."""
    clock = Clock()
    quota = ledger(clock)
    quota.apply(peer_sync(clock))
    limits = [(T, Limits(max_concurrency=3))]
    quota.admit(limits, 0)
    quota.admit(limits, 0)  # a 429 here with the tenant at 1 of 3 in flight
    assert refusal(quota, limits).code == "concurrency_limit_exceeded"


def test_the_places_left_at_a_sync_count_the_peers_in_flight() -> None:
    """quota.py:338 (``max_concurrency - in_flight``): a peer holds 2 of 4 places: this edge's share until
    the next sync is ceil(2 / 2) = 1, not ceil(4 / 2) = 2 (a burst through both edges passes the limit)."""
    clock = Clock()
    quota = ledger(clock)
    quota.apply(peer_sync(clock, in_flight=2))
    quota.snapshot(lambda key: Limits(max_concurrency=4))
    limits = [(T, Limits(max_concurrency=4))]
    quota.admit(limits, 0)
    assert refusal(quota, limits).code == "concurrency_limit_exceeded"


def test_places_taken_before_a_sync_are_not_taken_again_from_the_next_share() -> None:
    """quota.py:325 (``in_flight_at_sync``): this edge holds 2 of 6; a sync leaves 4 places, 2 per edge:
    it may take 2 more (not be refused at once for the 2 it already had)."""
    clock = Clock()
    quota = ledger(clock)
    quota.apply(peer_sync(clock))
    limits = [(T, Limits(max_concurrency=6))]
    quota.admit(limits, 0)
    quota.admit(limits, 0)
    quota.snapshot(lambda key: Limits(max_concurrency=6))
    quota.apply(peer_sync(clock))  # the peer still live
    quota.admit(limits, 0)
    quota.admit(limits, 0)
    assert refusal(quota, limits).code == "concurrency_limit_exceeded"


def test_retry_after_ignores_a_second_that_already_left_the_window() -> None:
    """quota.py:281 (``_frees_in``'s oldest second): the buckets are pruned only at a sync; one already out
    of the window freed nothing: Retry-After is when the oldest one *in* the window leaves."""
    clock = Clock()
    quota = ledger(clock)
    limits = [(T, Limits(requests_per_min=2))]
    quota.admit(limits, 0)  # second 1000
    clock.now = 1030.0
    quota.admit(limits, 0)  # second 1030
    clock.now = 1060.0  # second 1000 left the window (oldest counted: 1001)
    quota.admit(limits, 0)  # second 1060
    clock.now = 1060.5
    refused = refusal(quota, limits)
    assert refused.code == "rate_limit_exceeded"
    assert refused.retry_after_s == pytest.approx(29.5)  # second 1030 leaves at 1090


def test_a_precheck_refused_for_the_requests_in_preparation_says_retry_soon() -> None:
    """quota.py:264 (``over > 0``): at the limit only with the bodies still being prepared, a refusal's
    Retry-After is 1 s, not the time until the window frees a request."""
    clock = Clock()
    quota = ledger(clock)
    quota.admit([(T, Limits(requests_per_min=2))], 0)
    clock.now += 10
    with pytest.raises(QuotaExceeded) as caught:
        quota.precheck(T, Limits(requests_per_min=2), pending=1)
    assert caught.value.refusal.retry_after_s == 1.0


def test_the_multi_edge_precheck_counts_the_requests_in_preparation() -> None:
    """quota.py:238 (``+ pending`` in the share of places): with a live peer, a burst's bodies are refused
    before they are read, as on one edge."""
    clock = Clock()
    quota = ledger(clock)
    quota.apply(peer_sync(clock))
    with pytest.raises(QuotaExceeded):
        quota.precheck(T, Limits(max_concurrency=4), pending=2)  # share ceil(4/2) = 2 taken by the 2 pending
