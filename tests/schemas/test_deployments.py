"""Sticky routing, shadowing and liveness read from a model's latest ``DeploymentChanged``."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest

from schemas.codec import DecodeError, decode, encode
from schemas.deployments import BUCKETS, Deployment, bucket, sticky_key
from schemas.events import DeploymentChanged

MODEL = "demo-gpt"
KEYS = [f"tenant-{i}" for i in range(10_000)]
"""10k distinct routing keys."""


def changed(
    traffic: dict[str, float],
    *,
    stable: str = "",
    candidate: str | None = None,
    version: str = "v2",
    shadow: float = 0.0,
) -> DeploymentChanged:
    return DeploymentChanged(
        tenant="",
        model=MODEL,
        source="tests",
        time=datetime(2025, 3, 1, 12, tzinfo=UTC),
        version=version,
        action="deploy",
        traffic=traffic,
        reason="test",
        stable=stable,
        candidate=candidate,
        phase="canary" if candidate else "stable",
        shadow=shadow,
    )


def on_candidate(deployment: Deployment) -> set[str]:
    return {key for key in KEYS if deployment.route(key) == deployment.candidate}


# --- bucket and sticky_key ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "key", "salt", "expected"),
    [
        # Computed once: a different hash (or salt, or separator) moves every key and breaks stickiness
        # across processes and releases.
        ("demo-gpt", "acme", "route", 6342),
        ("demo-gpt", "globex", "route", 9944),
        ("all-minilm-l6-v2", "acme", "route", 7813),
        ("demo-gpt", "acme", "shadow", 7852),
        ("demo-gpt", "acme\0s-1", "route", 8807),
    ],
)
def test_bucket_is_pinned(model: str, key: str, salt: str, expected: int) -> None:
    assert bucket(model, key, salt) == expected


def test_bucket_defaults_to_the_route_salt() -> None:
    assert bucket("demo-gpt", "acme") == bucket("demo-gpt", "acme", "route") == 6342


def test_bucket_stays_in_range_and_spreads() -> None:
    buckets = [bucket(MODEL, key) for key in KEYS]
    assert all(0 <= b < BUCKETS for b in buckets)
    assert min(buckets) < 100
    assert max(buckets) >= BUCKETS - 100
    assert len(set(buckets)) > 5_000  # 10k keys into 10k buckets: ~63 % distinct when uniform


def test_bucket_depends_on_model_and_salt() -> None:
    same_model = sum(bucket(MODEL, k) == bucket("other-model", k) for k in KEYS[:1000])
    same_salt = sum(bucket(MODEL, k) == bucket(MODEL, k, "shadow") for k in KEYS[:1000])
    assert same_model < 10
    assert same_salt < 10


def test_sticky_key_is_the_tenant_alone_without_a_session() -> None:
    assert sticky_key("acme", None) == "acme"
    assert sticky_key("acme", "") == "acme"


def test_sticky_key_adds_the_session() -> None:
    assert sticky_key("acme", "s-1") == "acme\0s-1"
    assert sticky_key("acme", "s-1") != sticky_key("acme", "s-2")
    assert sticky_key("acme", "s-1") != sticky_key("acme-s-1", None)


# --- Deployment.of ------------------------------------------------------------------------------------------


def test_of_reads_stable_candidate_share_and_shadow() -> None:
    d = Deployment.of(changed({"v1": 0.75, "v2": 0.25}, stable="v1", candidate="v2", shadow=0.2))
    assert d == Deployment(MODEL, "v1", "v2", 0.25, 0.2)


def test_of_defaults_stable_to_the_version_with_the_largest_share() -> None:
    d = Deployment.of(changed({"v1": 0.3, "v2": 0.7}, candidate="v1"))
    assert d.stable == "v2"
    assert d.candidate == "v1"
    assert d.share == 0.3


def test_of_defaults_stable_to_the_event_version_without_traffic() -> None:
    d = Deployment.of(changed({}, version="v9"))
    assert d == Deployment(MODEL, "v9")


def test_of_has_no_candidate_when_it_is_the_stable_version() -> None:
    # A promoted deployment keeps the candidate field, but nothing is rolling out any more.
    d = Deployment.of(changed({"v2": 1.0}, stable="v2", candidate="v2", shadow=0.5))
    assert d == Deployment(MODEL, "v2", None, 0.0, 0.0)


def test_of_without_candidate_ignores_shadow_and_other_traffic() -> None:
    d = Deployment.of(changed({"v1": 0.9, "v2": 0.1}, stable="v1", shadow=0.4))
    assert d == Deployment(MODEL, "v1", None, 0.0, 0.0)


def test_of_a_candidate_absent_from_traffic_has_share_zero() -> None:
    d = Deployment.of(changed({"v1": 1.0}, stable="v1", candidate="v2", shadow=0.1))
    assert (d.candidate, d.share, d.shadow) == ("v2", 0.0, 0.1)


def test_a_warming_candidate_serves_with_no_traffic_and_no_shadow() -> None:
    event = msgspec.structs.replace(
        changed({"v1": 0.9, "v2": 0.1}, stable="v1", candidate="v2", shadow=0.5), phase="warming"
    )
    d = Deployment.of(event)
    assert d == Deployment(MODEL, "v1", "v2", 0.0, 0.0, warming=True)
    assert {d.route(key) for key in KEYS} == {"v1"}
    assert {d.shadow_to(key) for key in KEYS} == {None}
    assert d.serving == frozenset({"v1", "v2"})  # its workers start and load
    assert d.runs("v2", "v2")
    assert not d.runs("v1", "v2")  # the stable version's workers adopt nothing of the candidate's


# --- route --------------------------------------------------------------------------------------------------


def test_share_zero_routes_everything_to_stable() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.0)
    assert {d.route(key) for key in KEYS} == {"v1"}


def test_share_one_routes_everything_to_the_candidate() -> None:
    d = Deployment(MODEL, "v1", "v2", share=1.0)
    assert {d.route(key) for key in KEYS} == {"v2"}


@pytest.mark.parametrize("share", [1e308, -1e308, 1.5, -0.5, float("nan"), float("inf")])
def test_a_share_outside_zero_to_one_is_dead_lettered_and_clamped_in_code(share: float) -> None:
    """A candidate share of 1e308 decoded, and every routing of its model raised (``round(inf)``): a 500
    for each of its requests on every edge while the compacted control topic kept it (a review)."""
    for bad in (changed({"v1": 0.0, "v2": share}, stable="v1", candidate="v2"),):
        with pytest.raises(DecodeError, match="traffic"):
            decode(encode(bad))
    event = changed({"v1": 0.0, "v2": 0.5}, stable="v1", candidate="v2")
    with pytest.raises(DecodeError, match="steps"):
        decode(encode(msgspec.structs.replace(event, steps=[0.1, share])))
    clamped = Deployment(MODEL, "v1", "v2", share=share)
    expected = {"v2"} if share > 0 else {"v1"}
    assert {clamped.route(key) for key in KEYS[:500]} == expected


def test_without_candidate_everything_is_stable_whatever_the_share() -> None:
    d = Deployment(MODEL, "v1", None, share=1.0)
    assert {d.route(key) for key in KEYS} == {"v1"}


@pytest.mark.parametrize("share", [0.05, 0.25, 0.5, 0.9])
def test_the_candidate_takes_about_its_share_of_keys(share: float) -> None:
    taken = len(on_candidate(Deployment(MODEL, "v1", "v2", share=share)))
    assert abs(taken / len(KEYS) - share) <= 0.02


def test_the_candidate_takes_exactly_the_low_buckets() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.25)
    for key in KEYS[:2000]:
        assert d.route(key) == ("v2" if bucket(MODEL, key) < 2500 else "v1")


@pytest.mark.parametrize(
    ("key", "at"),
    [("key-23052", 0), ("key-6158", 2499), ("key-14559", 2500), ("key-4205", 9999)],
)
def test_boundary_buckets(key: str, at: int) -> None:
    assert bucket(MODEL, key) == at
    assert Deployment(MODEL, "v1", "v2", share=0.0).route(key) == "v1"
    assert Deployment(MODEL, "v1", "v2", share=0.25).route(key) == ("v2" if at < 2500 else "v1")
    assert Deployment(MODEL, "v1", "v2", share=1.0).route(key) == "v2"


def test_the_same_key_always_gets_the_same_version() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.5)
    first = [d.route(key) for key in KEYS[:1000]]
    again = [Deployment(MODEL, "v1", "v2", share=0.5).route(key) for key in KEYS[:1000]]
    assert first == again
    assert set(first) == {"v1", "v2"}


def test_keys_stay_on_the_candidate_as_its_share_grows() -> None:
    small = on_candidate(Deployment(MODEL, "v1", "v2", share=0.05))
    middle = on_candidate(Deployment(MODEL, "v1", "v2", share=0.25))
    large = on_candidate(Deployment(MODEL, "v1", "v2", share=0.5))
    assert small  # not vacuous
    assert small <= middle <= large
    assert len(small) < len(middle) < len(large)


def test_sessions_of_one_tenant_spread_over_versions() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.5)
    versions = {d.route(sticky_key("acme", f"s-{i}")) for i in range(100)}
    assert versions == {"v1", "v2"}


# --- shadow_to ----------------------------------------------------------------------------------------------


def test_only_requests_routed_to_stable_are_mirrored_at_about_the_shadow_share() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.25, shadow=0.3)
    stable_keys = [key for key in KEYS if d.route(key) == "v1"]
    mirrored = [key for key in stable_keys if d.shadow_to(key) == "v2"]
    assert all(d.shadow_to(key) is None for key in KEYS if d.route(key) == "v2")
    assert all(d.shadow_to(key) in (None, "v2") for key in stable_keys)
    # An independent hash: the share holds among the stable version's keys, not just overall.
    assert abs(len(mirrored) / len(stable_keys) - 0.3) <= 0.02


def test_shadow_only_rollout_mirrors_without_routing() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.0, shadow=0.1)
    assert {d.route(key) for key in KEYS} == {"v1"}
    mirrored = sum(d.shadow_to(key) == "v2" for key in KEYS)
    assert abs(mirrored / len(KEYS) - 0.1) <= 0.02


def test_shadowing_is_sticky() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.0, shadow=0.5)
    assert [d.shadow_to(k) for k in KEYS[:500]] == [d.shadow_to(k) for k in KEYS[:500]]


def test_no_shadow_without_candidate_or_share() -> None:
    no_candidate = Deployment(MODEL, "v1", None, share=0.0, shadow=1.0)
    no_shadow = Deployment(MODEL, "v1", "v2", share=0.1, shadow=0.0)
    assert all(no_candidate.shadow_to(key) is None for key in KEYS)
    assert all(no_shadow.shadow_to(key) is None for key in KEYS)


def test_full_shadow_mirrors_every_stable_request() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.25, shadow=1.0)
    assert all(d.shadow_to(key) == "v2" for key in KEYS if d.route(key) == "v1")


# --- serving and runs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("deployment", "serving"),
    [
        (Deployment(MODEL, "v1"), {"v1"}),
        (Deployment(MODEL, "v1", "v2", share=0.05), {"v1", "v2"}),
        (Deployment(MODEL, "v1", "v2", share=0.0, shadow=0.1), {"v1", "v2"}),
        (Deployment(MODEL, "v1", "v2", share=0.0, shadow=0.0), {"v1"}),  # rolled back
        (Deployment(MODEL, "v2", None), {"v2"}),  # promoted
    ],
)
def test_serving(deployment: Deployment, serving: set[str]) -> None:
    assert deployment.serving == frozenset(serving)


def test_workers_run_their_own_version() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.25)
    assert d.runs("v1", "v1")
    assert d.runs("v2", "v2")


def test_workers_do_not_run_another_serving_version() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.25)
    assert not d.runs("v1", "v2")
    assert not d.runs("v2", "v1")


def test_shadow_only_candidate_still_runs_its_own_requests() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.0, shadow=0.2)
    assert not d.runs("v1", "v2")
    assert d.runs("v2", "v2")


def test_stable_workers_run_what_a_rolled_back_candidate_left() -> None:
    d = Deployment(MODEL, "v1", "v2", share=0.0, shadow=0.0)
    assert d.runs("v1", "v2")


def test_stable_workers_run_a_retired_version() -> None:
    promoted = Deployment(MODEL, "v2")
    assert promoted.runs("v2", "v1")  # the old stable's queue is adopted
    canary = Deployment(MODEL, "v1", "v2", share=0.5)
    assert canary.runs("v1", "v0")


def test_candidate_and_retired_workers_never_adopt() -> None:
    canary = Deployment(MODEL, "v1", "v2", share=0.5)
    assert not canary.runs("v2", "v0")
    promoted = Deployment(MODEL, "v2")
    assert not promoted.runs("v1", "v0")  # a retired version's workers are not the stable one's
