"""The shared quota ledger as a plain object on a fake clock: windows, token reservations reconciled,
concurrency, Retry-After, and two ledgers (two edges) exchanging snapshots that together hold the limit."""

from __future__ import annotations

import pytest

from ingest.quota import ALL_MODELS, Key, Limits, QuotaExceeded, QuotaLedger

T: Key = ("acme", ALL_MODELS)
M: Key = ("acme", "demo-gpt")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ledger(clock: Clock, name: str = "edge-a") -> QuotaLedger:
    return QuotaLedger(name, clock=clock, wall_ms=lambda: int(clock.now * 1000))


def refused(ledger: QuotaLedger, checks: list[tuple[Key, Limits]], tokens: int = 0) -> str:
    with pytest.raises(QuotaExceeded) as caught:
        ledger.admit(checks, tokens)
    return caught.value.refusal.code


def test_requests_per_minute_slide_with_the_window_and_retry_after_names_when_one_frees() -> None:
    clock = Clock()
    quota = ledger(clock)
    limits = [(T, Limits(requests_per_min=3))]
    for _ in range(3):
        quota.admit(limits, 0)
        clock.now += 10
    with pytest.raises(QuotaExceeded) as caught:
        quota.admit(limits, 0)
    assert caught.value.refusal.code == "rate_limit_exceeded"
    assert caught.value.refusal.retry_after_s == pytest.approx(30.0)  # the first one leaves at t0 + 60
    clock.now += 30
    quota.admit(limits, 0)  # the oldest left the window


def test_tokens_are_reserved_at_admission_and_reconciled_with_what_was_used() -> None:
    clock = Clock()
    quota = ledger(clock)
    limits = [(T, Limits(tokens_per_min=1000))]
    first = quota.admit(limits, 600)  # prompt + max_tokens
    assert refused(quota, limits, 600) == "rate_limit_exceeded"
    quota.reconcile(first, 120)  # it stopped early
    quota.admit(limits, 600)
    assert quota.used(T)[1] == 720


def test_a_request_larger_than_the_limit_itself_says_so() -> None:
    quota = ledger(Clock())
    assert refused(quota, [(T, Limits(tokens_per_min=100))], 101) == "tokens_exceed_limit"


def test_concurrency_counts_until_release_and_release_is_idempotent() -> None:
    quota = ledger(Clock())
    limits = [(T, Limits(max_concurrency=1))]
    held = quota.admit(limits, 0)
    assert refused(quota, limits) == "concurrency_limit_exceeded"
    quota.release(held)
    quota.release(held)
    assert quota.used(T)[2] == 0
    quota.admit(limits, 0)


def test_requests_still_being_prepared_count_as_admitted_in_the_precheck() -> None:
    clock = Clock()
    quota = ledger(clock)
    narrow, slow = Limits(max_concurrency=2), Limits(requests_per_min=3)
    quota.precheck(T, narrow, pending=1)
    with pytest.raises(QuotaExceeded) as caught:
        quota.precheck(T, narrow, pending=2)
    assert caught.value.refusal.code == "concurrency_limit_exceeded"
    quota.admit([(T, narrow)], 0)
    with pytest.raises(QuotaExceeded):  # one in flight and one in preparation
        quota.precheck(T, narrow, pending=1)

    other: Key = ("globex", ALL_MODELS)
    quota.admit([(other, slow)], 0)
    quota.precheck(other, slow, pending=1)
    with pytest.raises(QuotaExceeded) as caught:
        quota.precheck(other, slow, pending=2)
    assert caught.value.refusal.code == "rate_limit_exceeded"
    assert caught.value.refusal.retry_after_s == 1.0  # the preparations decide soon; no admission leaves yet
    quota.admit([(other, slow)], 0)
    quota.admit([(other, slow)], 0)
    clock.now += 20
    with pytest.raises(QuotaExceeded) as caught:  # over without the preparation: when the oldest leaves
        quota.precheck(other, slow, pending=1)
    assert caught.value.refusal.retry_after_s == pytest.approx(40.0)


def test_a_refusal_by_the_model_limit_reserves_nothing_under_the_tenant_total() -> None:
    quota = ledger(Clock())
    checks = [(T, Limits(requests_per_min=10)), (M, Limits(requests_per_min=1))]
    quota.admit(checks, 0)
    assert refused(quota, checks) == "rate_limit_exceeded"
    assert quota.used(T)[0] == 1  # the refused one is not counted anywhere
    quota.admit([(T, Limits(requests_per_min=10)), (("acme", "other"), Limits())], 0)
    assert quota.used(T)[0] == 2


def test_two_edges_together_hold_the_limit_through_snapshots_and_shares() -> None:
    """Each edge admits its share of what was left at its last sync; what it knows of the other is one
    interval old, so together they pass the limit by at most what the other admitted in one interval."""
    clock = Clock()
    a, b = ledger(clock, "edge-a"), ledger(clock, "edge-b")
    limit = Limits(requests_per_min=100)
    limits_of = {T: limit}.get
    checks = [(T, limit)]
    per_interval = 5  # 10x overload: 100 requests/s offered against 100 per minute, over 2 edges
    admitted = 0
    for _ in range(1200):  # two minutes of 0.1 s sync intervals
        for quota in (a, b):
            for _ in range(per_interval):
                try:
                    quota.admit(checks, 0)
                    admitted += 1
                except QuotaExceeded:
                    break
        sa, sb = a.snapshot(limits_of), b.snapshot(limits_of)
        b.apply(sa)
        a.apply(sb)
        clock.now += 0.1
        requests = a.used(T)[0]
        assert requests == b.used(T)[0]
        assert requests <= 100 + per_interval  # never more than one interval of the other edge over
    assert 200 <= admitted <= 2 * (100 + per_interval)  # two windows' worth, the limit used
    assert a.peers == ["edge-b"]


def test_a_burst_over_two_edges_holds_concurrency_to_the_limit() -> None:
    """Found by an audit: in flight was checked against the limit alone, so between two syncs each edge
    admitted up to the whole limit: 16 streams over 2 edges with max_concurrency=4 left 8 open. Each edge now
    takes its share of the places left at its last sync, as for the per-minute limits."""
    clock = Clock()
    a, b = ledger(clock, "edge-a"), ledger(clock, "edge-b")
    limit = Limits(max_concurrency=4)
    limits_of = {T: limit}.get
    b.apply(a.snapshot(limits_of))
    a.apply(b.snapshot(limits_of))  # each knows the other is live, neither has anything in flight
    held, refused = [], set()
    for _ in range(8):  # a burst: eight streams on each edge before the next sync
        for quota in (a, b):
            try:
                held.append((quota, quota.admit([(T, limit)], 0)))
            except QuotaExceeded as exc:
                refused.add(exc.refusal.code)
    assert len(held) == 4
    assert refused == {"concurrency_limit_exceeded"}
    quota, first = held[0]
    quota.release(first)  # one ends: its edge may take its place again
    quota.admit([(T, limit)], 0)
    with pytest.raises(QuotaExceeded):
        quota.admit([(T, limit)], 0)


def test_a_single_edge_never_passes_the_limit() -> None:
    clock = Clock()
    quota = ledger(clock)
    checks = [(T, Limits(requests_per_min=50))]
    for _ in range(600):
        for _ in range(5):
            try:
                quota.admit(checks, 0)
            except QuotaExceeded:
                break
        quota.snapshot({T: checks[0][1]}.get)
        clock.now += 0.1
        assert quota.used(T)[0] <= 50


def test_a_peer_that_went_quiet_keeps_its_admissions_counted_for_a_window_but_not_its_flights() -> None:
    clock = Clock()
    a, b = ledger(clock, "edge-a"), ledger(clock, "edge-b")
    checks = [(T, Limits(requests_per_min=10, max_concurrency=5))]
    for _ in range(4):
        b.admit(checks, 0)
    a.apply(b.snapshot({T: checks[0][1]}.get))
    assert a.used(T) == (4, 0, 4)
    clock.now += 10  # b died: its flights no longer count, its admissions still do
    assert a.used(T) == (4, 0, 0)
    clock.now += 60
    assert a.used(T) == (0, 0, 0)


def test_a_restarted_edge_reads_back_its_previous_life_with_its_age() -> None:
    clock = Clock()
    before = ledger(clock, "edge-a.1")
    checks = [(T, Limits(requests_per_min=5))]
    for _ in range(5):
        before.admit(checks, 0)
    snapshot = before.snapshot({T: checks[0][1]}.get)
    after = ledger(clock, "edge-a.2")
    after.apply(snapshot, age_s=30.0)
    assert refused(after, checks) == "rate_limit_exceeded"
    clock.now += 31  # a window after it was published
    after.admit(checks, 0)
    older = ledger(clock, "edge-a.3")
    older.apply(snapshot, age_s=61.0)
    assert older.used(T) == (0, 0, 0)


def test_own_snapshots_are_ignored_and_idle_keys_are_dropped() -> None:
    clock = Clock()
    quota = ledger(clock)
    held = quota.admit([(T, Limits(requests_per_min=5))], 3)
    snapshot = quota.snapshot(lambda key: None)
    quota.apply(snapshot)
    assert quota.used(T) == (1, 3, 1)
    quota.release(held)
    clock.now += 61
    assert quota.snapshot(lambda key: None).usage == ()
