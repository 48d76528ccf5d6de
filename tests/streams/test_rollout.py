"""The rollout controller: gates, decisions, the decision events and the controller loop (no Kafka)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import random
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client import REGISTRY

from bus.errors import BusError
from schemas.deployments import Deployment
from schemas.events import (
    CLIENT_ERROR_CODES,
    BurnRateCrossed,
    DeploymentChanged,
    GateResult,
    RequestFinished,
    RolloutGates,
    Timings,
    Usage,
    WorkerReady,
)
from streams.pricing import PriceTable
from streams.rollout import (
    BURN_MIN_ERRORS,
    EMBEDDING_LATENCY,
    GATE_STATES,
    SERVING_GRACE_S,
    SOURCE,
    RolloutController,
    VersionStats,
    advance,
    decide,
    judge,
    parse_stats,
    roll_back,
    start_rollout,
    stats_of,
    stats_sql,
    warm,
)
from streams.rollout_drift import NO_SHADOW, NOT_YET

T0 = datetime(2025, 3, 1, 12, tzinfo=UTC)
T0_MS = 1_740_830_400_000
MODEL = "demo-gpt"
STEPS = [0.05, 0.25, 0.5, 1.0]
GATES = RolloutGates(min_requests=100)
ALL_GATES = ["error_ratio", "ttft_p99_ms", "itl_p99_ms", "cost_per_1k_tokens", "drift", "burn"]
FAST_BURN = 14.4
"""The fast pair's (1h/5m) threshold on a 30-day budget: 2 % of it in an hour."""


def stats(
    n: int = 1000,
    errors: int = 10,
    ttft: float | None = 100.0,
    itl: float | None = 20.0,
    tokens: int = 100_000,
    cost_per_1k_usd: float = 1.0,
    embedding: float | None = None,
    samples: int | None = None,
) -> VersionStats:
    """``samples``: of each latency (default: every request's)."""
    timed = n if samples is None else samples
    return VersionStats(
        n=n,
        errors=errors,
        ttft_p99_ms=ttft,
        itl_p99_ms=itl,
        tokens=tokens,
        cost_nanos=round(cost_per_1k_usd * tokens / 1000 * 1e9),
        embedding_p99_ms=embedding,
        ttft_n=timed if ttft is not None else 0,
        itl_n=timed if itl is not None else 0,
        embedding_n=timed if embedding is not None else 0,
    )


def embeddings(n: int = 1000, errors: int = 10, e2e: float | None = 40.0) -> VersionStats:
    """An embeddings model's step: no first token, no inter-token gap; ``e2e``: its end-to-end p99."""
    return stats(n=n, errors=errors, ttft=None, itl=None, embedding=e2e)


def by_gate(results: Sequence[GateResult]) -> dict[str, GateResult]:
    return {r.gate: r for r in results}


def burn_event(
    *,
    at: datetime,
    firing: bool = True,
    threshold: float = FAST_BURN,
    model: str = MODEL,
    rate: float = 20.0,
    window: str = "1h/5m",
) -> BurnRateCrossed:
    return BurnRateCrossed(
        tenant="",
        model=model,
        source="streams/slo",
        time=at,
        slo="availability",
        window=window,
        burn_rate=rate,
        threshold=threshold,
        firing=firing,
    )


def canary(
    *,
    steps: Sequence[float] = STEPS,
    shadow: float = 0.1,
    gates: RolloutGates = GATES,
    now: datetime = T0,
    step: int = 0,
) -> DeploymentChanged:
    """A rollout at ``step`` (0: its first canary step, its candidate's worker ready)."""
    begun = warming(steps=steps, shadow=shadow, gates=gates, now=now - timedelta(milliseconds=1))
    started = advance(begun, now, "ready", [], "controller")
    for _ in range(step):
        started = advance(started, now, "test", [], "operator")
    return started


def warming(
    *,
    steps: Sequence[float] = STEPS,
    shadow: float = 0.1,
    gates: RolloutGates = GATES,
    now: datetime = T0,
) -> DeploymentChanged:
    """A rollout just started: the candidate's workers loading, no traffic."""
    return start_rollout(
        MODEL,
        stable="v1",
        candidate="v2",
        steps=steps,
        shadow=shadow,
        gates=gates,
        now=now,
        source="sluice/cli",
    )


DRIFT_PASSED = GateResult(gate="drift", state="pass", detail="answers alike")


def passing(gates: RolloutGates = GATES) -> list[GateResult]:
    return judge(gates, stats(), stats(), drift=DRIFT_PASSED)


def failing(gates: RolloutGates = GATES) -> list[GateResult]:
    return judge(gates, stats(errors=200), stats())


# --- VersionStats ---------------------------------------------------------------------------------------


def test_error_ratio() -> None:
    assert VersionStats(n=200, errors=3).error_ratio == 0.015
    assert VersionStats(n=0, errors=0).error_ratio == 0.0


def test_cost_per_1k_tokens_in_usd() -> None:
    # 2 M tokens for $3 (3e9 nanos): $0.0015 per 1k tokens
    assert VersionStats(tokens=2_000_000, cost_nanos=3_000_000_000).cost_per_1k_usd == pytest.approx(0.0015)
    assert VersionStats(tokens=1000, cost_nanos=1_250_000_000).cost_per_1k_usd == 1.25
    assert VersionStats(tokens=0, cost_nanos=5).cost_per_1k_usd is None


# --- judge ----------------------------------------------------------------------------------------------


def test_healthy_candidate_passes_every_gate_in_order() -> None:
    results = judge(GATES, stats(), stats(), drift=DRIFT_PASSED)
    assert [r.gate for r in results] == ALL_GATES
    assert {r.state for r in results} == {"pass"}
    assert all((r.candidate_n, r.baseline_n) == (1000, 1000) for r in results if r is not DRIFT_PASSED)


@pytest.mark.parametrize(
    ("errors", "baseline_errors", "state", "limit"),
    [(150, 100, "pass", 0.15), (151, 100, "fail", 0.15), (50, 0, "pass", 0.05), (51, 0, "fail", 0.05)],
)
def test_error_ratio_limit_is_baseline_plus_delta(
    errors: int, baseline_errors: int, state: str, limit: float
) -> None:
    result = by_gate(judge(GATES, stats(errors=errors), stats(errors=baseline_errors)))["error_ratio"]
    assert result.state == state
    assert (result.candidate, result.baseline, result.limit) == (errors / 1000, baseline_errors / 1000, limit)
    assert (result.candidate_n, result.baseline_n) == (1000, 1000)


def test_error_ratio_uses_the_configured_delta() -> None:
    gates = RolloutGates(min_requests=100, max_error_delta=0.0)
    result = by_gate(judge(gates, stats(errors=101), stats(errors=100)))["error_ratio"]
    assert (result.state, result.limit) == ("fail", 0.1)


def test_error_ratio_limit_is_capped_at_one() -> None:
    result = by_gate(judge(GATES, stats(errors=1000), stats(errors=980)))["error_ratio"]
    assert result.limit == 1.0


@pytest.mark.parametrize(("ttft", "state"), [(175.0, "pass"), (175.5, "fail")])
def test_ttft_limit_is_ratio_times_baseline_plus_slack(ttft: float, state: str) -> None:
    result = by_gate(judge(GATES, stats(ttft=ttft), stats(ttft=100.0)))["ttft_p99_ms"]
    assert (result.state, result.candidate, result.baseline, result.limit) == (state, ttft, 100.0, 175.0)


@pytest.mark.parametrize(("itl", "state"), [(55.0, "pass"), (55.1, "fail")])
def test_itl_limit_is_ratio_times_baseline_plus_slack(itl: float, state: str) -> None:
    result = by_gate(judge(GATES, stats(itl=itl), stats(itl=20.0)))["itl_p99_ms"]
    assert (result.state, result.limit) == (state, 55.0)


def test_latency_limits_use_the_configured_ratios_and_slack() -> None:
    gates = RolloutGates(
        min_requests=100, max_ttft_p99_ratio=2.0, max_itl_p99_ratio=3.0, latency_slack_ms=0.0
    )
    results = by_gate(judge(gates, stats(ttft=201.0, itl=60.0), stats(ttft=100.0, itl=20.0)))
    assert (results["ttft_p99_ms"].state, results["ttft_p99_ms"].limit) == ("fail", 200.0)
    assert (results["itl_p99_ms"].state, results["itl_p99_ms"].limit) == ("pass", 60.0)


@pytest.mark.parametrize(("cost", "state"), [(1.25, "pass"), (1.26, "fail"), (1.3, "fail")])
def test_cost_limit_is_a_ratio_without_slack(cost: float, state: str) -> None:
    result = by_gate(judge(GATES, stats(cost_per_1k_usd=cost), stats(cost_per_1k_usd=1.0)))[
        "cost_per_1k_tokens"
    ]
    assert (result.state, result.limit, result.baseline) == (state, 1.25, 1.0)
    assert result.candidate == pytest.approx(cost)


@pytest.mark.parametrize(
    ("candidate_n", "baseline_n", "decides"),
    [(99, 1000, False), (1000, 99, False), (0, 0, False), (100, 100, True)],
)
def test_metric_gates_need_min_requests_on_both_sides(
    candidate_n: int, baseline_n: int, decides: bool
) -> None:
    # The candidate is bad on every metric, so a deciding gate fails.
    bad = stats(n=candidate_n, errors=candidate_n, ttft=1e6, itl=1e6, cost_per_1k_usd=100.0)
    results = by_gate(judge(GATES, bad, stats(n=baseline_n, errors=0)))
    for gate in ("error_ratio", "ttft_p99_ms", "itl_p99_ms", "cost_per_1k_tokens"):
        assert results[gate].state == ("fail" if decides else "insufficient_data"), gate
        assert (results[gate].candidate_n, results[gate].baseline_n) == (candidate_n, baseline_n)


def test_missing_latency_or_cost_is_insufficient_data() -> None:
    results = by_gate(judge(GATES, stats(ttft=None), stats(itl=None)))
    assert results["ttft_p99_ms"].state == "insufficient_data"
    assert results["ttft_p99_ms"].baseline == 100.0
    assert results["itl_p99_ms"].state == "insufficient_data"
    assert results["itl_p99_ms"].candidate == 20.0
    assert results["error_ratio"].state == "pass"
    assert results["cost_per_1k_tokens"].state == "pass"
    no_tokens = by_gate(judge(GATES, stats(tokens=0), stats()))
    assert no_tokens["cost_per_1k_tokens"].state == "insufficient_data"


def test_an_embeddings_model_judges_ttft_on_end_to_end_latency_and_has_no_itl_gate() -> None:
    """An embedding has no first token and no inter-token gap: both versions' TTFT and ITL are None
    however many requests they serve. The TTFT gate judges their end-to-end p99 instead; the ITL gate
    does not apply (it used to be insufficient_data for ever, so the rollout never advanced)."""
    results = by_gate(judge(GATES, embeddings(e2e=60.0), embeddings(e2e=40.0), drift=DRIFT_PASSED))
    ttft = results["ttft_p99_ms"]
    assert (ttft.state, ttft.candidate, ttft.baseline, ttft.limit) == ("pass", 60.0, 40.0, 85.0)
    assert ttft.detail == EMBEDDING_LATENCY
    itl = results["itl_p99_ms"]
    assert (itl.state, itl.candidate, itl.baseline, itl.limit) == ("not_applicable", None, None, None)
    assert itl.detail == "not measured for this model: no request of either version has an inter-token gap"
    assert (itl.candidate_n, itl.baseline_n) == (1000, 1000)
    assert {r.state for g, r in results.items() if g != "itl_p99_ms"} == {"pass"}
    slower = by_gate(judge(GATES, embeddings(e2e=85.5), embeddings(e2e=40.0)))["ttft_p99_ms"]
    assert (slower.state, slower.detail) == ("fail", EMBEDDING_LATENCY)


@pytest.mark.parametrize(
    ("candidate", "baseline"),
    [
        (embeddings(n=99), embeddings()),  # too few requests on one side
        (embeddings(), embeddings(n=99)),
        (embeddings(e2e=None), embeddings()),  # the candidate has no completed embedding yet
        (embeddings(), embeddings(e2e=None)),
    ],
)
def test_an_embeddings_ttft_gate_without_enough_data_still_waits(
    candidate: VersionStats, baseline: VersionStats
) -> None:
    result = by_gate(judge(GATES, candidate, baseline))["ttft_p99_ms"]
    assert (result.state, result.detail) == ("insufficient_data", EMBEDDING_LATENCY)


def test_a_latency_neither_version_has_with_enough_requests_does_not_apply() -> None:
    def without(n: int = 1000) -> VersionStats:
        return stats(n=n, ttft=None, itl=None)

    results = by_gate(judge(GATES, without(), without()))
    assert (results["ttft_p99_ms"].state, results["itl_p99_ms"].state) == ("not_applicable", "not_applicable")
    assert results["ttft_p99_ms"].detail == (
        "not measured for this model: no request of either version has a first token"
    )
    # Too few requests, or samples on one side only: it may yet come, so the gate waits.
    for candidate, baseline in [
        (without(99), without()),
        (without(), without(99)),
        (without(), stats()),
        (stats(), without()),
    ]:
        waiting = by_gate(judge(GATES, candidate, baseline))
        assert waiting["ttft_p99_ms"].state == waiting["itl_p99_ms"].state == "insufficient_data"
    # Only a latency the model does not produce is not applicable; the cost gate waits for tokens.
    no_tokens = by_gate(judge(GATES, stats(tokens=0), stats(tokens=0)))
    assert no_tokens["cost_per_1k_tokens"].state == "insufficient_data"


DRIFT_FAILED = GateResult(
    gate="drift", state="fail", detail="answers to the same requests differ in output_chars"
)


def test_the_drift_gate_waits_until_it_is_judged() -> None:
    result = by_gate(judge(GATES, stats(), stats()))["drift"]
    assert (result.state, result.detail) == ("insufficient_data", NOT_YET)
    assert by_gate(judge(GATES, stats(), stats(), drift=DRIFT_FAILED))["drift"] == DRIFT_FAILED


def test_burn_gate_fails_when_the_candidate_errs_more() -> None:
    burn = burn_event(at=T0, rate=20.0)
    result = by_gate(judge(GATES, stats(errors=20), stats(errors=10), burn=burn))["burn"]
    assert result.state == "fail"
    assert (result.candidate, result.limit) == (20.0, FAST_BURN)
    assert result.detail == "availability 1h/5m burn 20.0"


@pytest.mark.parametrize("candidate_errors", [10, 5])
def test_burn_gate_passes_when_the_candidate_errs_no_more(candidate_errors: int) -> None:
    result = by_gate(judge(GATES, stats(errors=candidate_errors), stats(errors=10), burn=burn_event(at=T0)))
    assert result["burn"].state == "pass"


@pytest.mark.parametrize(("errors", "state"), [(2, "pass"), (3, "fail")])
def test_burn_gate_needs_a_few_candidate_failures(errors: int, state: str) -> None:
    assert BURN_MIN_ERRORS == 3  # docs/rollout.md: "with at least 3 failures"
    # 2 of 10 (20 %) vs 1 %: more, but one unlucky request or two are not blamed for the burn.
    results = by_gate(judge(GATES, stats(n=10, errors=errors), stats(errors=10), burn=burn_event(at=T0)))
    assert results["burn"].state == state


def test_burn_gate_acts_before_min_requests() -> None:
    # A fast burn is an emergency: 3 failures of 5 requests are enough, far below min_requests (100).
    results = by_gate(judge(GATES, stats(n=5, errors=3), stats(errors=10), burn=burn_event(at=T0)))
    assert results["error_ratio"].state == "insufficient_data"
    assert results["burn"].state == "fail"
    assert (results["burn"].candidate_n, results["burn"].baseline_n) == (5, 1000)


def test_burn_gate_passes_without_a_burn() -> None:
    result = by_gate(judge(GATES, stats(errors=40), stats(errors=10), burn=None))["burn"]
    assert (result.state, result.candidate, result.limit, result.detail) == ("pass", None, None, "")


def test_disabled_gates_are_absent() -> None:
    gates = RolloutGates(min_requests=100, drift=False, burn=False)
    results = judge(gates, stats(errors=40), stats(), drift=DRIFT_FAILED, burn=burn_event(at=T0))
    assert [r.gate for r in results] == ALL_GATES[:4]
    assert {r.state for r in results} == {"pass"}


# --- decide ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("phase", ["stable", "promoted", "rolled_back"])
def test_decide_ignores_what_is_not_a_canary(phase: str) -> None:
    current = msgspec.structs.replace(canary(), phase=phase)
    assert decide(current, failing(), T0 + timedelta(hours=1)) is None
    assert decide(current, passing(), T0 + timedelta(hours=1)) is None


def test_decide_ignores_a_canary_without_candidate() -> None:
    current = msgspec.structs.replace(canary(), candidate=None)
    assert decide(current, failing(), T0 + timedelta(hours=1)) is None


def test_a_failed_gate_rolls_back_at_once() -> None:
    current = canary(gates=RolloutGates(min_requests=100, step_min_s=600))
    results = failing()
    now = T0 + timedelta(seconds=1)  # long before step_min_s
    decision = decide(current, results, now)
    assert decision is not None
    assert decision.action == "rollback"
    assert decision.phase == "rolled_back"
    assert decision.traffic == {"v1": 1.0, "v2": 0.0}
    assert decision.shadow == 0.0
    assert decision.actor == "controller"
    assert decision.source == SOURCE
    assert decision.evidence == results
    assert decision.time == now
    assert decision.id != current.id
    assert (decision.version, decision.stable, decision.candidate) == ("v2", "v1", "v2")
    assert (decision.step, decision.steps, decision.rollout_id) == (0, STEPS, current.rollout_id)
    assert decision.reason.startswith("automatic rollback at step 1/4: ")
    assert "error_ratio 0.2 vs stable 0.01 (limit 0.06, n=1000/1000)" in decision.reason


def test_rollback_reason_names_every_failed_gate() -> None:
    results = judge(GATES, stats(ttft=500.0), stats(), drift=DRIFT_FAILED)
    decision = decide(canary(step=1), results, T0)
    assert decision is not None
    assert decision.reason.startswith("automatic rollback at step 2/4: ")
    assert "ttft_p99_ms 500 vs stable 100 (limit 175" in decision.reason
    assert "drift fail (answers to the same requests differ in output_chars)" in decision.reason
    assert "error_ratio" not in decision.reason


def test_a_failure_wins_over_insufficient_data() -> None:
    results = judge(GATES, stats(n=10, errors=0), stats(n=10), drift=DRIFT_FAILED)
    assert by_gate(results)["error_ratio"].state == "insufficient_data"
    decision = decide(canary(), results, T0)
    assert decision is not None
    assert decision.action == "rollback"


def test_insufficient_data_neither_promotes_nor_aborts() -> None:
    results = judge(GATES, stats(n=99), stats())
    assert decide(canary(), results, T0 + timedelta(days=1)) is None


def test_a_step_still_inconclusive_past_step_max_s_is_rolled_back() -> None:
    """Low traffic stalled a rollout at its step for good (its gates need ``min_requests`` of each version);
    with ``step_max_s`` a step still waiting for data then is rolled back, with what it lacked."""
    current = canary(gates=RolloutGates(min_requests=100, step_max_s=600))
    results = judge(current.gates or GATES, stats(n=10), stats())
    assert decide(current, results, T0 + timedelta(seconds=600)) is None
    back = decide(current, results, T0 + timedelta(seconds=601))
    assert back is not None
    assert (back.action, back.phase, back.actor) == ("rollback", "rolled_back", "controller")
    assert back.reason == (
        "automatic rollback at step 1/4: still inconclusive after 600s (error_ratio, ttft_p99_ms, itl_p99_ms, "
        "cost_per_1k_tokens waiting for data; 10 candidate and 1000 stable requests in the step, 100 "
        "needed of each)"
    )
    assert back.evidence == results
    # passing gates by then promote as before; without a deadline it waits as long as it takes
    assert decide(current, passing(), T0 + timedelta(seconds=601)).action == "promote"  # type: ignore[union-attr]
    assert decide(canary(), results, T0 + timedelta(days=30)) is None
    # a candidate's worker restarting (the serving gate's own grace) is no missing data: no rollback here
    restarting = [*passing(), GateResult(gate="serving", state="insufficient_data", candidate=0.0)]
    assert decide(current, restarting, T0 + timedelta(seconds=601)) is None


def test_a_gate_that_does_not_apply_counts_as_passed() -> None:
    current = canary()
    results = judge(GATES, embeddings(), embeddings(), drift=DRIFT_PASSED)
    assert "not_applicable" in {r.state for r in results}
    decision = decide(current, results, T0 + timedelta(minutes=1))
    assert decision is not None
    assert (decision.action, decision.phase, decision.step) == ("promote", "canary", 1)
    assert decision.reason.endswith(", itl_p99_ms not applicable)")
    assert f"n=1000/1000; {EMBEDDING_LATENCY})" in decision.reason
    assert decision.evidence == results


def test_a_young_step_waits_for_step_min_s() -> None:
    current = canary(gates=RolloutGates(min_requests=100, step_min_s=60))
    results = passing()
    assert decide(current, results, T0 + timedelta(seconds=59.9)) is None
    assert decide(current, results, T0 + timedelta(seconds=60)) is not None


def test_the_step_age_counts_from_the_event_time_without_step_started() -> None:
    current = msgspec.structs.replace(
        canary(gates=RolloutGates(min_requests=100, step_min_s=60)), step_started=None, time=T0
    )
    assert decide(current, passing(), T0 + timedelta(seconds=30)) is None
    assert decide(current, passing(), T0 + timedelta(seconds=60)) is not None


def test_passing_gates_move_to_the_next_step() -> None:
    current = canary()
    results = passing()
    now = T0 + timedelta(minutes=5)
    decision = decide(current, results, now)
    assert decision is not None
    assert decision.phase == "canary"
    assert decision.action == "promote"
    assert decision.traffic == {"v1": 0.75, "v2": 0.25}
    assert (decision.step, decision.step_started, decision.time) == (1, now, now)
    assert (decision.stable, decision.candidate, decision.shadow) == ("v1", "v2", 0.1)
    assert decision.actor == "controller"
    assert decision.evidence == results
    assert decision.reason.startswith("step 2/4, 25% of traffic: gates passed (")
    assert "error_ratio 0.01 vs stable 0.01" in decision.reason
    # an audit: the drift and burn gates, which carry no values, were left out of the reason
    assert "drift pass" in decision.reason
    assert "burn pass" in decision.reason


def test_each_step_takes_its_share() -> None:
    decision = decide(canary(step=1), passing(), T0)
    assert decision is not None
    assert (decision.step, decision.traffic) == (2, {"v1": 0.5, "v2": 0.5})


def test_passing_the_last_step_promotes() -> None:
    current = canary(step=2)
    assert current.traffic == {"v1": 0.5, "v2": 0.5}
    now = T0 + timedelta(minutes=5)
    decision = decide(current, passing(), now)
    assert decision is not None
    assert decision.phase == "promoted"
    assert decision.action == "promote"
    assert decision.stable == "v2"
    assert decision.traffic == {"v2": 1.0}
    assert decision.shadow == 0.0
    assert decision.step == 3
    assert decision.step_started == now
    assert decision.reason.startswith("promoted to 100% after step 3: gates passed")


def test_steps_without_a_final_100_still_promote_after_the_last() -> None:
    current = canary(steps=[0.1, 0.5], step=1)
    decision = decide(current, passing(), T0)
    assert decision is not None
    assert (decision.phase, decision.traffic, decision.step) == ("promoted", {"v2": 1.0}, 1)


# --- start_rollout, advance, roll_back ------------------------------------------------------------------


def test_start_rollout() -> None:
    gates = RolloutGates(min_requests=7)
    event = start_rollout(
        MODEL, stable="v1", candidate="v2", steps=STEPS, shadow=0.1, gates=gates, now=T0, source="sluice/cli"
    )
    assert (event.tenant, event.model, event.source, event.time) == ("", MODEL, "sluice/cli", T0)
    assert (event.version, event.stable, event.candidate) == ("v2", "v1", "v2")
    assert (event.action, event.phase, event.actor) == ("deploy", "warming", "operator")
    assert event.traffic == {"v1": 1.0, "v2": 0.0}  # nothing until a worker of v2 is ready
    assert (event.steps, event.step, event.step_started) == (STEPS, 0, T0)
    assert (event.shadow, event.gates) == (0.1, gates)
    assert event.reason == "rollout started: 5% of traffic, 10% shadowed once a worker of v2 is ready"
    assert event.rollout_id
    assert event.evidence == []
    routing = Deployment.of(event)
    assert (routing.share, routing.shadow, routing.serving) == (0.0, 0.0, frozenset({"v1", "v2"}))


def test_a_shadow_only_start_keeps_every_request_on_stable() -> None:
    event = canary(steps=[0.0, 0.25, 1.0], shadow=0.2)
    assert event.traffic == {"v1": 1.0, "v2": 0.0}
    assert (event.phase, event.shadow) == ("canary", 0.2)
    assert event.reason == "step 1/3, 0% of traffic: ready"


def test_a_start_without_shadow_does_not_mention_it() -> None:
    assert warming(shadow=0.0).reason == "rollout started: 5% of traffic once a worker of v2 is ready"


def test_rollout_ids_differ_between_rollouts() -> None:
    assert canary().rollout_id != canary().rollout_id


def test_operator_advance() -> None:
    current = canary()
    now = T0 + timedelta(minutes=1)
    event = advance(current, now, "promoted by the operator", [], "operator")
    assert (event.actor, event.source, event.version) == ("operator", "sluice/cli", "v2")
    assert (event.step, event.step_started, event.time) == (1, now, now)
    assert event.traffic == {"v1": 0.75, "v2": 0.25}
    assert event.reason == "step 2/4, 25% of traffic: promoted by the operator"
    assert event.rollout_id == current.rollout_id


def test_operator_roll_back() -> None:
    current = canary(step=1)
    now = T0 + timedelta(minutes=1)
    event = roll_back(current, now, "aborted by the operator: bad vibes", [], "operator")
    assert (event.action, event.phase, event.actor, event.source) == (
        "rollback",
        "rolled_back",
        "operator",
        "sluice/cli",
    )
    assert event.traffic == {"v1": 1.0, "v2": 0.0}
    assert (event.shadow, event.time, event.reason) == (0.0, now, "aborted by the operator: bad vibes")
    assert (event.stable, event.candidate, event.step) == ("v1", "v2", 1)


# --- SQL ------------------------------------------------------------------------------------------------


def literals(sql: str) -> tuple[list[str], str]:
    """The single-quoted string literals of ``sql`` (ClickHouse backslash escapes), and the text outside."""
    found: list[str] = []
    outside: list[str] = []
    i = 0
    while i < len(sql):
        if sql[i] != "'":
            outside.append(sql[i])
            i += 1
            continue
        i += 1
        value: list[str] = []
        while sql[i] != "'":
            if sql[i] == "\\":
                i += 1
            value.append(sql[i])
            i += 1
        found.append("".join(value))
        i += 1
    return found, "".join(outside)


HOSTILE_VERSION = "v2' OR 1=1) --\\"
HOSTILE_MODEL = "m\\'; DROP TABLE request_facts; --"


EMBEDDING_FILTERS = [*["embedding", "completed", ""] * 2, *["embedding", "completed", "", ""] * 2]
"""The literals of the end-to-end latency of completed embeddings (all, and live ones only)."""
STATS_FILTERS = [*[""] * 10, *EMBEDDING_FILTERS, "", "failed", "cancelled", "expired", ""]
"""The literals of ``stats_sql``'s filters: ``shadow_of = ''``, ``batch_id = ''``, the embeddings', and the
tokens' and cost's (neither a failure's tokens nor those of a request no model took are billed)."""
COUNTED = ["expired", "", "", "failed", *sorted(CLIENT_ERROR_CODES)]
"""The literals of the requests counted: not an expired shadow copy or batch line, nor a client's error."""
ERRORS = ["failed", *sorted(CLIENT_ERROR_CODES), "expired"]
"""The literals of the errors counted: a failure but a client's error, or an expiry (of a request a client
waited for: the ``''`` of its shadow and batch filters are the first of :data:`STATS_FILTERS`)."""


def test_stats_sql_quotes_hostile_names() -> None:
    sql = stats_sql(HOSTILE_MODEL, [HOSTILE_VERSION, "v1"], T0)
    found, outside = literals(sql)
    assert found == [*COUNTED, *ERRORS, *STATS_FILTERS, HOSTILE_MODEL, "v1", HOSTILE_VERSION]
    assert "DROP" not in outside
    assert "OR 1=1" not in outside
    assert "FROM request_facts" in outside


def test_stats_sql_lists_each_version_once_and_starts_at_since() -> None:
    sql = stats_sql(MODEL, ["v2", "v1", "v2"], T0 + timedelta(milliseconds=123))
    found, outside = literals(sql)
    assert found == [*COUNTED, *ERRORS, *STATS_FILTERS, MODEL, "v1", "v2"]
    assert f"fromUnixTimestamp64Milli({T0_MS + 123})" in outside


# --- parse_stats ----------------------------------------------------------------------------------------


def row(
    version: str,
    *,
    n: int = 1000,
    errors: int = 10,
    ttft: float | None = 100.0,
    itl: float | None = 20.0,
    tokens: int = 100_000,
    cost_nanos: int = 100_000_000_000,
) -> dict[str, Any]:
    return {
        "model_version": version,
        "n": n,
        "errors": errors,
        "ttft_p99": ttft,
        "ttft_n": n if ttft is not None else 0,
        "itl_p99": itl,
        "itl_n": n if itl is not None else 0,
        "tokens": tokens,
        "cost_nanos": cost_nanos,
    }


def test_parse_stats_maps_rows_by_version() -> None:
    parsed = parse_stats([row("v1"), row("v2", n=200, errors=7, ttft=80.5, itl=12.0, tokens=5, cost_nanos=9)])
    assert parsed == {
        "v1": VersionStats(
            n=1000,
            errors=10,
            ttft_p99_ms=100.0,
            itl_p99_ms=20.0,
            tokens=100_000,
            cost_nanos=10**11,
            ttft_n=1000,
            itl_n=1000,
        ),
        "v2": VersionStats(
            n=200, errors=7, ttft_p99_ms=80.5, itl_p99_ms=12.0, tokens=5, cost_nanos=9, ttft_n=200, itl_n=200
        ),
    }


@pytest.mark.parametrize(
    ("value", "samples"),
    [(float("nan"), 0), (None, 0), (0.0, 0), (float("nan"), 5), (float("inf"), 5), (None, 5)],
)
def test_parse_stats_has_no_latency_without_samples_or_a_finite_value(
    value: float | None, samples: int
) -> None:
    raw = row("v1") | {"ttft_p99": value, "ttft_n": samples, "itl_p99": value, "itl_n": samples}
    parsed = parse_stats([raw])["v1"]
    assert (parsed.ttft_p99_ms, parsed.itl_p99_ms) == (None, None)
    assert parsed.n == 1000


def test_parse_stats_accepts_numbers_as_text() -> None:
    # ClickHouse's JSON output quotes 64-bit integers.
    raw = row("v1") | {
        "n": "12",
        "errors": "3",
        "tokens": "40",
        "cost_nanos": "41",
        "ttft_n": "12",
        "ttft_p99": 9,
    }
    parsed = parse_stats([raw])["v1"]
    assert parsed == VersionStats(
        n=12, errors=3, ttft_p99_ms=9.0, itl_p99_ms=20.0, tokens=40, cost_nanos=41, ttft_n=12, itl_n=1000
    )


def test_parse_stats_reads_the_embeddings_end_to_end_latency_live_first() -> None:
    embedded = row("v2", ttft=None, itl=None) | {
        "embed_p99": 900.0,
        "embed_n": 50,
        "embed_live_p99": 40.0,
        "embed_live_n": 10,
    }
    parsed = parse_stats([embedded])["v2"]
    assert (parsed.ttft_p99_ms, parsed.itl_p99_ms, parsed.embedding_p99_ms) == (None, None, 40.0)
    shadow_only = embedded | {"embed_live_p99": float("nan"), "embed_live_n": 0}
    assert parse_stats([shadow_only])["v2"].embedding_p99_ms == 900.0
    no_samples = embedded | {"embed_n": 0, "embed_live_n": 0}
    assert parse_stats([no_samples])["v2"].embedding_p99_ms is None
    assert parse_stats([row("v2")])["v2"].embedding_p99_ms is None  # columns absent: none


def test_stats_of_an_embeddings_run_has_only_the_end_to_end_latency() -> None:
    def embedded(request_id: str, e2e_s: float, status: str = "completed") -> RequestFinished:
        return msgspec.structs.replace(
            finished(),
            request_id=request_id,
            kind="embedding",
            status=status,
            usage=Usage(prompt_tokens=12, completion_tokens=0, total_tokens=12),
            timings=Timings(
                accepted=T0,
                started=T0,
                first_token=T0 + timedelta(seconds=e2e_s),
                finished=T0 + timedelta(seconds=e2e_s),
            ),
        )

    results = [embedded("a", 0.03), embedded("b", 0.05), embedded("c", 9.0, "failed")]
    found = stats_of(results, PriceTable())
    assert (found.ttft_p99_ms, found.itl_p99_ms) == (None, None)
    assert found.embedding_p99_ms == pytest.approx(50.0)  # the failed one is the error gate's
    assert (found.n, found.errors) == (3, 1)
    assert stats_of([finished()], PriceTable()).embedding_p99_ms is None


def test_parse_stats_of_no_rows() -> None:
    assert parse_stats([]) == {}


def test_ttft_is_judged_on_live_requests_when_there_are_any() -> None:
    """A shadow copy waits behind every live request (lowest priority): its first token measures the
    queue. With live requests in the step they decide the TTFT gate; a shadow-only step uses the shadows."""
    live = row("v2") | {"ttft_p99": 900.0, "ttft_n": 50, "ttft_live_p99": 120.0, "ttft_live_n": 10}
    assert parse_stats([live])["v2"].ttft_p99_ms == 120.0
    shadow_only = row("v2") | {
        "ttft_p99": 900.0,
        "ttft_n": 50,
        "ttft_live_p99": float("nan"),
        "ttft_live_n": 0,
    }
    assert parse_stats([shadow_only])["v2"].ttft_p99_ms == 900.0


def test_stats_of_an_offline_run_judge_ttft_on_live_requests_too() -> None:
    def timed(request_id: str, ttft_s: float, shadow_of: str | None) -> RequestFinished:
        return msgspec.structs.replace(
            finished(),
            request_id=request_id,
            shadow_of=shadow_of,
            timings=Timings(
                accepted=T0,
                started=T0,
                first_token=T0 + timedelta(seconds=ttft_s),
                finished=T0 + timedelta(seconds=2),
            ),
        )

    results = [timed("a", 0.1, None), timed("b", 0.2, None), timed("c", 5.0, "a")]
    assert stats_of(results, PriceTable()).ttft_p99_ms == pytest.approx(200.0)
    assert (stats_of(results, PriceTable()).ttft_n, stats_of(results, PriceTable()).n) == (2, 3)
    assert stats_of(results[2:], PriceTable()).ttft_p99_ms == pytest.approx(5000.0)


def test_a_latency_gate_waits_for_samples_of_its_own_not_for_requests() -> None:
    """An audit: with ``--canary 5 --shadow 100`` a step's 330 candidate requests were 19 of clients' and
    311 shadow copies, and the TTFT gate (which leaves shadow copies out) judged a p99 over 19 at
    ``--min-requests 50``, showing n=330. A latency gate now waits for that many samples of its own."""
    gates = RolloutGates(min_requests=50)
    few = by_gate(judge(gates, stats(n=330, samples=19), stats(n=314)))
    assert few["error_ratio"].state == "pass"
    assert (few["ttft_p99_ms"].state, few["ttft_p99_ms"].candidate_n) == ("insufficient_data", 19)
    assert (few["error_ratio"].candidate_n, few["error_ratio"].baseline_n) == (330, 314)
    enough = by_gate(judge(gates, stats(n=330, samples=50), stats(n=314)))
    assert enough["ttft_p99_ms"].state == "pass"


# --- RolloutController ----------------------------------------------------------------------------------


def outputs(version: str, n: int = 100, *, empty: bool = False) -> list[dict[str, Any]]:
    """A version's side of the drift gate's shadow pairs: short answers, or empty ones."""
    rng = random.Random(version)
    return [
        {
            "model_version": version,
            "kind": "completion",
            "completion_tokens": 1 if empty else 8 + i % 5,
            "output_chars": 0 if empty else 30 + rng.randrange(20),
            "mean_logprob": -2 + rng.gauss(0, 0.2),
            "mean_entropy": 3 + rng.gauss(0, 0.2),
            "output_script": "latin",
            "finish_reason": "stop",
            "status": "completed",
            "empty_output": empty,
            "refusal": False,
        }
        for i in range(n)
    ]


def vectors(n: int = 100, *, turned: int = 0) -> list[dict[str, Any]]:
    """An embeddings model's shadow pairs, a row per side: the same vector on both, or for the first
    ``turned`` pairs a candidate vector at a right angle to the stable version's."""
    rows = []
    for i in range(n):
        stable, candidate = [1.0, 0.0, float(i)], [1.0, 0.0, float(i)]
        if i < turned:
            candidate = [-float(i), 0.0, 1.0]
        rows += [
            {"original": f"r{i}", "model_version": "v1", "embedding": stable},
            {"original": f"r{i}", "model_version": "v2", "embedding": candidate},
        ]
    return rows


class Warehouse:
    """Canned rows per query kind; records every query."""

    def __init__(self) -> None:
        self.stats: list[dict[str, Any]] = [row("v1"), row("v2")]
        self.outputs: list[dict[str, Any]] = [*outputs("v1"), *outputs("v2")]
        """The answers of the drift gate's shadow pairs (what :func:`outputs` makes)."""
        self.vectors: list[dict[str, Any]] = vectors()
        """An embeddings model's shadow pairs (what :func:`vectors` makes)."""
        self.stats_of: dict[str, list[dict[str, Any]]] = {}
        """Rows for a model other than the default one."""
        self.queries: list[str] = []
        self.error: Exception | None = None

    async def read(self, sql: str) -> list[dict[str, Any]]:
        self.queries.append(sql)
        if self.error is not None:
            raise self.error
        if "AS embedding" in sql:  # an embeddings model's drift gate: its pairs' vectors
            return list(self.vectors)
        if "FROM drift_features" in sql:  # the drift gate's pairs (its subqueries read request_facts)
            return list(self.outputs)
        if "FROM request_facts" in sql:
            for model, rows in self.stats_of.items():
                if f"model = '{model}'" in sql:
                    return list(rows)
            return list(self.stats)
        raise AssertionError(f"unexpected query: {sql}")


@dataclasses.dataclass
class Harness:
    warehouse: Warehouse
    published: list[DeploymentChanged]
    now: datetime = T0 + timedelta(minutes=5)
    mono: float = 100.0

    end: int = 100
    """The control topic's next offset: what this harness publishes is placed there."""

    async def publish(self, event: DeploymentChanged) -> tuple[int, int]:
        self.published.append(event)
        self.end += 1
        return (0, self.end - 1)

    def controller(
        self,
        interval_s: float = 1.0,
        *,
        held: asyncio.Event | None = None,
        may_decide: Callable[[], bool] = lambda: True,
    ) -> RolloutController:
        """``held``: every warehouse read waits until the event is set (an evaluation in progress);
        ``may_decide``: whether the controller's sink reads the control topic now."""

        async def read(sql: str) -> list[dict[str, Any]]:
            if held is not None:
                await held.wait()
            return await self.warehouse.read(sql)

        return RolloutController(
            read,
            self.publish,
            interval_s=interval_s,
            clock=lambda: self.now,
            monotonic=lambda: self.mono,
            may_decide=may_decide,
        )

    def later(self, seconds: float = 10.0) -> None:
        self.now += timedelta(seconds=seconds)
        self.mono += seconds


@pytest.fixture
def harness() -> Harness:
    return Harness(Warehouse(), [])


def finished(model: str = MODEL, version: str = "v2") -> RequestFinished:
    return RequestFinished(
        tenant="acme",
        model=model,
        source="gpu/worker-0",
        request_id="r-1",
        status="completed",
        finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8),
        model_version=version,
    )


def bad_candidate(warehouse: Warehouse) -> None:
    warehouse.stats = [row("v1", errors=10), row("v2", errors=200)]


def same_decision(a: DeploymentChanged, b: DeploymentChanged) -> bool:
    fields = ("action", "phase", "traffic", "stable", "candidate", "step", "shadow", "evidence", "reason")
    return all(getattr(a, f) == getattr(b, f) for f in fields)


async def test_a_seeded_canary_is_due(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed([canary()])
    (decision,) = await controller.run_due()
    assert harness.published == [decision]
    assert (decision.step, decision.traffic) == (1, {"v1": 0.75, "v2": 0.25})
    assert decision.step_started == harness.now
    assert controller.deployments[MODEL] is decision
    assert [r.state for r in controller.last_results[MODEL]] == ["pass"] * 6


# --- warming up: no traffic before a worker of the candidate is ready --------------------------------------


def ready(deployment: DeploymentChanged, version: str = "v2", worker: str = "w-1") -> WorkerReady:
    return WorkerReady(
        tenant="",
        model=deployment.model,
        source=f"gpu_workers/{worker}",
        version=version,
        worker=worker,
        deployment=deployment.id,
    )


def test_a_ready_worker_takes_a_warming_rollout_to_its_first_step() -> None:
    begun = warming()
    now = T0 + timedelta(seconds=40)
    step = warm(begun, ready(begun), now)
    assert step is not None
    assert (step.phase, step.action, step.actor, step.source) == ("canary", "deploy", "controller", SOURCE)
    assert (step.step, step.step_started, step.time) == (0, now, now)
    assert step.traffic == {"v1": 0.95, "v2": 0.05}
    assert (step.shadow, step.rollout_id, step.steps) == (0.1, begun.rollout_id, begun.steps)
    assert step.reason == "step 1/4, 5% of traffic: v2 is ready (worker w-1)"
    routing = Deployment.of(step)
    assert (routing.share, routing.shadow, routing.warming) == (0.05, 0.1, False)


def test_a_warming_rollout_waits_for_its_ready_timeout_then_rolls_back() -> None:
    begun = warming(gates=RolloutGates(ready_timeout_s=120))
    assert warm(begun, None, T0 + timedelta(seconds=120)) is None
    back = warm(begun, None, T0 + timedelta(seconds=120.5))
    assert back is not None
    assert (back.phase, back.action, back.actor) == ("rolled_back", "rollback", "controller")
    assert back.traffic == {"v1": 1.0, "v2": 0.0}
    assert back.reason == "automatic rollback: no worker of v2 was ready within 120s"
    assert Deployment.of(back).serving == frozenset({"v1"})


def test_a_candidate_a_worker_cannot_load_is_rolled_back_at_once_with_why() -> None:
    """An operator audit: a candidate whose weights were cut short crash-looped its workers for the whole
    ready timeout (10 minutes by default) while `rollout status` said only that it waited. A worker that
    cannot load the version says why (``WorkerReady.error``), and the rollout is rolled back with it."""
    begun = warming(gates=RolloutGates(ready_timeout_s=600))
    failed = msgspec.structs.replace(ready(begun), error="model.safetensors: incomplete metadata")
    back = warm(begun, failed, T0 + timedelta(seconds=5))
    assert back is not None
    assert (back.phase, back.action, back.actor) == ("rolled_back", "rollback", "controller")
    assert (
        back.reason
        == "automatic rollback: a worker of v2 cannot load it: model.safetensors: incomplete metadata"
    )
    older = msgspec.structs.replace(failed, deployment="an-older-deployment")
    assert warm(begun, older, T0 + timedelta(seconds=5)) is None, (
        "another rollout's failure is not this one's"
    )


def test_only_the_candidates_readiness_for_this_deployment_counts() -> None:
    begun = warming()
    other = msgspec.structs.replace(begun, id="an-older-deployment")
    assert warm(begun, ready(begun, version="v1"), T0 + timedelta(seconds=1)) is None
    assert warm(begun, ready(other), T0 + timedelta(seconds=1)) is None


def test_warm_leaves_a_canary_step_alone() -> None:
    current = canary()
    assert warm(current, ready(current), T0 + timedelta(hours=1)) is None


def test_an_operator_promotes_a_warming_rollout_to_its_first_step_then_on() -> None:
    step = advance(warming(), T0 + timedelta(seconds=1), "promoted by the operator", [], "operator")
    assert (step.phase, step.action, step.actor, step.step) == ("canary", "deploy", "operator", 0)
    assert step.traffic == {"v1": 0.95, "v2": 0.05}
    nxt = advance(step, T0 + timedelta(seconds=2), "promoted by the operator", [], "operator")
    assert (nxt.phase, nxt.step, nxt.traffic) == ("canary", 1, {"v1": 0.75, "v2": 0.25})


async def test_the_controller_gives_a_candidate_traffic_only_once_a_worker_is_ready(harness: Harness) -> None:
    controller = harness.controller()
    begun = warming(now=harness.now)
    controller.seed([begun])
    assert await controller.run_due() == []
    assert harness.warehouse.queries == []  # warming: no gates to compute

    harness.later(1)
    earlier = msgspec.structs.replace(begun, id="an-older-deployment")
    controller.observe([ready(earlier), ready(begun, version="v1")])  # another deployment's; the stable's
    assert await controller.run_due() == []

    harness.later(1)
    controller.observe([ready(begun)])
    (step,) = await controller.run_due()
    assert harness.published == [step]
    assert (step.phase, step.step, step.traffic) == ("canary", 0, {"v1": 0.95, "v2": 0.05})
    assert step.step_started == harness.now
    assert controller.deployments[MODEL] is step


async def test_a_ready_announcement_read_before_its_deployment_still_counts(harness: Harness) -> None:
    controller = harness.controller()
    begun = warming(now=harness.now)
    controller.seed([])
    controller.observe([ready(begun), begun])  # two partitions of the control topic, read out of order
    (step,) = await controller.run_due()
    assert step.phase == "canary"


async def test_a_restarted_controller_resumes_a_warming_rollout_from_the_log(harness: Harness) -> None:
    begun = warming(now=harness.now)
    controller = harness.controller()
    controller.seed([begun, ready(begun)])  # the control topic, read to its end at start
    (step,) = await controller.run_due()
    assert (step.phase, step.traffic) == ("canary", {"v1": 0.95, "v2": 0.05})


async def test_a_rollout_started_on_a_clock_behind_still_gets_its_ready_timeout(harness: Harness) -> None:
    """Found by an audit: the ready timeout counted from the start's own time, on the operator's clock: one
    15 minutes behind rolled the rollout back at the controller's first look, 1 s after the start."""
    controller = harness.controller()
    controller.seed([])
    begun = warming(now=harness.now - timedelta(minutes=15), gates=RolloutGates(ready_timeout_s=600))
    controller.observe([begun])
    harness.later(1)
    assert await controller.run_due() == []
    harness.later(590)
    assert await controller.run_due() == []
    controller.observe([ready(begun)])
    harness.later(1)
    (step,) = await controller.run_due()
    assert step.phase == "canary"


async def test_a_step_promoted_on_a_clock_behind_still_lasts_step_min_s(harness: Harness) -> None:
    """Found by an audit: an operator's promotion an hour behind the controller is dated just after the
    decision before it (``after``), so the new step looked an hour old: it advanced 1 s later, judged on the
    previous step's requests. The controller times a step from when it saw it start."""
    gates = RolloutGates(min_requests=100, step_min_s=600)
    controller = harness.controller()
    current = canary(now=harness.now - timedelta(minutes=20), gates=gates)
    controller.seed([current])
    promoted = advance(current, harness.now - timedelta(hours=1), "promoted by the operator", [], "operator")
    assert promoted.step_started is not None
    assert promoted.step_started < current.time + timedelta(seconds=1)
    controller.observe([promoted])
    harness.later(1)
    assert await controller.run_due() == []
    assert (
        f"fromUnixTimestamp64Milli({int(harness.now.timestamp() * 1000) - 1000}"
        in harness.warehouse.queries[-1]
    )
    harness.later(600)
    controller.observe([finished()])
    (step,) = await controller.run_due()
    assert (step.step, step.traffic) == (2, {"v1": 0.5, "v2": 0.5})


async def test_the_controller_rolls_back_a_candidate_never_ready(harness: Harness) -> None:
    controller = harness.controller()
    begun = warming(now=harness.now, gates=RolloutGates(ready_timeout_s=30))
    controller.seed([begun])
    for _ in range(3):  # the timer keeps looking while it waits, with no event to make it due
        harness.later(10)
        assert await controller.run_due() == []
    harness.later(1)
    (back,) = await controller.run_due()
    assert (back.phase, back.actor) == ("rolled_back", "controller")
    assert back.reason == "automatic rollback: no worker of v2 was ready within 30s"
    harness.later(1)
    controller.observe([ready(begun)])  # too late: the rollout has ended
    assert await controller.run_due() == []
    assert harness.published == [back]


async def test_the_controller_rolls_back_a_step_with_no_traffic_at_its_deadline(harness: Harness) -> None:
    """No outcome arrives to make the model due: the timer looks again until the step's deadline."""
    harness.warehouse.stats = [row("v1", n=5), row("v2", n=0)]
    controller = harness.controller()
    controller.seed([canary(now=harness.now, gates=RolloutGates(min_requests=100, step_max_s=30))])
    for _ in range(3):
        assert await controller.run_due() == []
        harness.later(10)
    harness.later(1)
    (back,) = await controller.run_due()
    assert (back.phase, back.actor) == ("rolled_back", "controller")
    assert "still inconclusive after 30s" in back.reason


async def test_a_step_whose_gates_passed_while_young_advances_at_step_min_s_without_more_traffic(
    harness: Harness,
) -> None:
    """Found by review: a step's gates all passed before ``--step-min-s``, then traffic stopped; the model
    was due again only with a new outcome, so the step stayed put (ten minutes in the repro), where the
    docs promise the next step once the gates have passed for that long."""
    controller = harness.controller()
    controller.seed([canary(now=harness.now, gates=RolloutGates(min_requests=100, step_min_s=60))])
    harness.later(30)
    assert await controller.run_due() == []  # every gate passes; the step is 30 s old
    states = {r.gate: r.state for r in controller.last_results[MODEL]}
    assert states.pop("drift") == "insufficient_data"  # judged once the step may advance (it is costly)
    assert set(states.values()) == {"pass"}
    for _ in range(29):
        harness.later(1)
        assert await controller.run_due() == []  # no outcome arrives; the timer looks again
    harness.later(1.5)
    (decision,) = await controller.run_due()
    assert (decision.step, decision.actor) == (1, "controller")
    harness.later(1)
    assert await controller.run_due() == []  # the next step is young again: not due without outcomes


async def test_a_deployment_the_controller_cannot_judge_costs_no_other_model_its_decision(
    harness: Harness,
) -> None:
    """Found by an audit: a deployment timed 9999-12-31T23:59:59.999Z decodes, but a decision after it
    overflows; that raised out of the run, which had already taken every model off the due set, so another
    model's rollback never happened."""
    controller = harness.controller()
    poisoned = msgspec.structs.replace(
        warming(now=harness.now), model="a-model", time=datetime(9999, 12, 31, 23, 59, 59, 999000, tzinfo=UTC)
    )
    begun = warming(now=harness.now, gates=RolloutGates(ready_timeout_s=30))
    controller.seed([poisoned, begun])
    harness.later(31)
    controller.observe([ready(poisoned)])  # the poisoned one is ready: its decision is what overflows
    (back,) = await controller.run_due()
    assert (back.model, back.phase) == (MODEL, "rolled_back")
    harness.later(1)
    assert await controller.run_due() == []  # it is still tried (and still fails), the others still judged
    assert harness.published == [back]


async def test_a_seeded_stable_deployment_is_not_due(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed([msgspec.structs.replace(canary(), phase="stable", candidate=None)])
    assert await controller.run_due() == []
    assert harness.warehouse.queries == []


async def test_the_controller_reads_the_step_since_it_saw_it_begin(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed([])
    # The step began (on its decider's clock) before the event was written, and before this controller
    # read it: the step as this controller saw it begin, not the event, bounds the window.
    current = msgspec.structs.replace(
        canary(now=T0 + timedelta(milliseconds=5)), time=T0 + timedelta(minutes=1)
    )
    controller.observe([current])
    await controller.run_due()
    stats_query, pairs_query = harness.warehouse.queries
    seen = int(harness.now.timestamp() * 1000)
    assert "FROM request_facts" in stats_query
    assert f"fromUnixTimestamp64Milli({seen})" in stats_query
    assert literals(stats_query)[0][len(COUNTED) + len(ERRORS) + len(STATS_FILTERS) :] == [MODEL, "v1", "v2"]
    assert "FROM drift_features" in pairs_query
    assert f"fromUnixTimestamp64Milli({seen}, 'UTC')" in pairs_query


@pytest.mark.parametrize("off", [timedelta(hours=-1), timedelta(hours=1)])
async def test_a_restarted_controller_times_the_step_from_its_restart(
    harness: Harness, off: timedelta
) -> None:
    """Found by an audit: a restarted controller took the step's ``step_started`` (its decider's clock) as
    when it began. An operator an hour behind: the step looked an hour old and was promoted at once, judged
    on the previous step's requests too; an hour ahead: no samples for an hour, and a fast burn of the
    candidate's ignored."""
    gates = RolloutGates(min_requests=100, step_min_s=600)
    step = canary(now=harness.now + off, gates=gates, step=1)
    assert step.step_started is not None
    assert abs(step.step_started - (harness.now + off)) < timedelta(seconds=1)  # its decider's clock
    controller = harness.controller()
    controller.seed([step])
    assert await controller.run_due() == []  # not a step 600 s old
    now_ms = int(harness.now.timestamp() * 1000)
    assert f"fromUnixTimestamp64Milli({now_ms})" in harness.warehouse.queries[0]
    candidate_errs_more(harness.warehouse)
    controller.observe([burn_event(at=harness.now + timedelta(seconds=1))])
    harness.later(1)
    (back,) = await controller.run_due()  # the candidate's fast burn is seen whichever way the clock is off
    assert back.action == "rollback"


async def test_a_restarted_controller_gives_a_warming_rollout_its_ready_timeout(harness: Harness) -> None:
    """Found by an audit: a warming rollout started on a clock 15 min behind was rolled back by a
    controller restarted a minute later, at its first look (the ready timeout timed from the start's
    own time)."""
    begun = warming(now=harness.now - timedelta(minutes=15), gates=RolloutGates(ready_timeout_s=600))
    controller = harness.controller()
    controller.seed([begun])
    assert await controller.run_due() == []
    harness.later(599)
    assert await controller.run_due() == []
    harness.later(2)
    (back,) = await controller.run_due()
    assert back.reason == "automatic rollback: no worker of v2 was ready within 600s"


async def test_no_drift_query_when_the_drift_gate_is_off(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed([canary(gates=RolloutGates(min_requests=100, drift=False))])
    await controller.run_due()
    assert len(harness.warehouse.queries) == 1


async def test_outcomes_of_the_model_make_it_due_others_do_not(harness: Harness) -> None:
    harness.warehouse.stats = [row("v1", n=10), row("v2", n=10)]  # insufficient: no decision
    controller = harness.controller(interval_s=5.0)
    controller.seed([canary()])
    assert await controller.run_due() == []
    asked = len(harness.warehouse.queries)
    assert asked > 0

    harness.mono += 5.0
    controller.observe([finished(model="all-minilm-l6-v2")])
    assert await controller.run_due() == []
    assert len(harness.warehouse.queries) == asked

    # The other model's outcome did not count as an evaluation: this one is not held back by the interval.
    harness.mono += 0.5
    controller.observe([finished()])
    assert await controller.run_due() == []
    assert len(harness.warehouse.queries) == 2 * asked
    assert harness.published == []


async def test_run_due_evaluates_at_most_once_per_interval(harness: Harness) -> None:
    harness.warehouse.stats = []  # no requests yet
    controller = harness.controller(interval_s=5.0)
    controller.seed([canary()])
    await controller.run_due()
    asked = len(harness.warehouse.queries)

    controller.observe([finished()])
    harness.mono += 4.9
    await controller.run_due()
    assert len(harness.warehouse.queries) == asked  # too soon: still due

    harness.mono += 0.1
    await controller.run_due()
    assert len(harness.warehouse.queries) == 2 * asked


async def test_the_timer_and_the_sink_evaluating_at_once_publish_one_decision(harness: Harness) -> None:
    # CI saw a step promoted twice: the timer's evaluation outlasted its interval and the sink's ran beside it.
    release = asyncio.Event()
    controller = harness.controller(interval_s=0.5, held=release)
    controller.seed([canary()])
    timer = asyncio.create_task(controller.run_due())
    await asyncio.sleep(0)
    harness.mono += 1.0  # past the interval while the first evaluation still waits on the warehouse
    controller.observe([finished()])
    sink = asyncio.create_task(controller.run_due())
    await asyncio.sleep(0)
    release.set()
    decisions = [*await timer, *await sink]
    assert len(decisions) == 1
    assert harness.published == decisions
    # What the sink made due is still due: the next run evaluates the new step, once.
    harness.later()
    (step_2,) = await controller.run_due()
    assert (decisions[0].step, step_2.step) == (1, 2)


async def test_an_operator_change_during_an_evaluation_wins(harness: Harness) -> None:
    release = asyncio.Event()
    controller = harness.controller(held=release)
    controller.seed([canary()])
    running = asyncio.create_task(controller.run_due())
    await asyncio.sleep(0)
    aborted = msgspec.structs.replace(
        canary(), action="rollback", phase="rolled_back", time=harness.now, id="operator-abort"
    )
    controller.observe([aborted])
    release.set()
    assert await running == []
    assert harness.published == []
    assert controller.deployments[MODEL] is aborted


async def test_a_failed_gate_publishes_one_rollback(harness: Harness) -> None:
    bad_candidate(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    (decision,) = await controller.run_due()
    assert harness.published == [decision]
    assert (decision.action, decision.phase, decision.actor) == ("rollback", "rolled_back", "controller")
    assert decision.time == harness.now
    assert controller.deployments[MODEL] is decision
    assert by_gate(controller.last_results[MODEL])["error_ratio"].state == "fail"

    asked = len(harness.warehouse.queries)
    harness.later()
    controller.observe([finished(), finished(version="v1")])
    assert await controller.run_due() == []
    assert harness.published == [decision]
    assert len(harness.warehouse.queries) == asked


async def test_its_own_decision_coming_back_through_the_sink_changes_nothing(harness: Harness) -> None:
    bad_candidate(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    (decision,) = await controller.run_due()
    harness.later()
    controller.observe([decision])
    assert await controller.run_due() == []
    assert controller.deployments[MODEL] is decision


def decisions(model: str, action: str, actor: str) -> float | None:
    return REGISTRY.get_sample_value(
        "sluice_rollout_decisions_total", {"model": model, "action": action, "actor": actor}
    )


async def test_the_rollback_series_exists_at_zero_and_a_restart_counts_nothing_again(
    harness: Harness,
) -> None:
    """An audit: the rollback alert is ``increase(...) > 0``, which sees nothing in a series born at 1, so a
    model's first automatic rollback never fired; and each start counted the log's latest deployments
    again (a restart after a rollback would have fired it anew)."""
    model = "rolled-model"
    bad_candidate(harness.warehouse)
    current = msgspec.structs.replace(canary(), model=model)
    controller = harness.controller()
    controller.seed([current])
    assert decisions(model, "rollback", "controller") == 0.0, "there to be increased, before any rollback"
    assert decisions(model, current.action, current.actor or "operator") is None, "seeded: not counted"
    (decision,) = await controller.run_due()
    assert (decision.action, decision.actor) == ("rollback", "controller")
    assert decisions(model, "rollback", "controller") == 1.0
    restarted = harness.controller()
    restarted.seed([decision])
    assert decisions(model, "rollback", "controller") == 1.0, "the log's rollback is not counted again"


def gate_state(model: str, gate: str, state: str) -> float | None:
    return REGISTRY.get_sample_value(
        "sluice_rollout_gate_state", {"model": model, "gate": gate, "state": state}
    )


def embeddings_rollout(harness: Harness, model: str = "all-minilm-l6-v2") -> DeploymentChanged:
    harness.warehouse.stats_of[model] = [
        row(version, ttft=None, itl=None) | {"embed_p99": 40.0, "embed_n": 1000, "embed_live_n": 0}
        for version in ("v1", "v2")
    ]
    return msgspec.structs.replace(canary(), model=model)


async def test_the_controller_advances_an_embeddings_rollout(harness: Harness) -> None:
    current = embeddings_rollout(harness)
    controller = harness.controller()
    controller.seed([current])
    (decision,) = await controller.run_due()
    assert (decision.model, decision.action, decision.phase, decision.step) == (
        current.model,
        "promote",
        "canary",
        1,
    )
    assert [r.state for r in controller.last_results[current.model]] == [
        "pass", "pass", "not_applicable", "pass", "pass", "pass"
    ]  # fmt: skip
    drift = by_gate(controller.last_results[current.model])["drift"]
    assert drift.detail.startswith("vectors alike (cosine median 1.0000")
    assert (drift.candidate_n, drift.limit) == (100, 0.99)
    assert any("AS embedding" in q for q in harness.warehouse.queries)
    assert set(GATE_STATES) == {"pass", "fail", "insufficient_data", "not_applicable"}
    for state in GATE_STATES:
        assert gate_state(current.model, "itl_p99_ms", state) == (state == "not_applicable")


async def test_an_embeddings_candidate_whose_vectors_differ_is_rolled_back(harness: Harness) -> None:
    """Every other gate passes; 6 of 100 pairs at a right angle (more than 5 %) roll it back."""
    current = embeddings_rollout(harness)
    harness.warehouse.vectors = vectors(turned=6)
    controller = harness.controller()
    controller.seed([current])
    (decision,) = await controller.run_due()
    assert (decision.action, decision.phase) == ("rollback", "rolled_back")
    assert "6 of 100 shadow pairs below 0.99" in decision.reason
    failing = [r.gate for r in decision.evidence if r.state == "fail"]
    assert failing == ["drift"]


async def test_a_candidate_whose_outputs_differ_is_rolled_back_by_the_drift_gate(harness: Harness) -> None:
    harness.warehouse.outputs = [*outputs("v1"), *outputs("v2", empty=True)]
    controller = harness.controller()
    controller.seed([canary()])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    drift = by_gate(decision.evidence)["drift"]
    assert (drift.state, drift.candidate_n, drift.baseline_n) == ("fail", 100, 100)
    assert "output_chars" in drift.detail
    assert "empty_output" in drift.detail
    assert "100 shadow pairs" in drift.detail
    assert f"drift fail ({drift.detail})" in decision.reason


async def test_the_drift_gate_tests_once_a_step_when_it_alone_decides(harness: Harness) -> None:
    """Tested at each evaluation as the step's sample grows, it would raise false alarms far more often
    than alpha: it runs only when the other gates pass and the step is old enough, so it decides."""
    harness.warehouse.outputs = [*outputs("v1"), *outputs("v2", empty=True)]
    controller = harness.controller()
    controller.seed([canary(gates=RolloutGates(min_requests=100, step_min_s=60), now=harness.now)])
    assert await controller.run_due() == []  # the step is young
    assert by_gate(controller.last_results[MODEL])["drift"].detail == NOT_YET
    harness.later(61)
    harness.warehouse.stats = [row("v1"), row("v2", ttft=900.0)]  # another gate fails: rolled back by it
    controller.observe([finished()])
    (decision,) = await controller.run_due()
    assert by_gate(decision.evidence)["drift"].state == "insufficient_data"
    assert not any("FROM drift_features" in q for q in harness.warehouse.queries)


async def test_a_decision_whose_publish_failed_is_decided_again_on_the_same_drift_test(
    harness: Harness,
) -> None:
    """A second look at the step's larger sample could turn the rollback into a promotion (and each look
    adds its own false alarms): the verdict is kept for the step."""
    harness.warehouse.outputs = [*outputs("v1"), *outputs("v2", empty=True)]
    controller = harness.controller()
    controller.seed([canary()])
    publish = harness.publish

    async def refused(event: DeploymentChanged) -> tuple[int, int]:
        raise BusError("the broker is away")

    controller._publish = refused
    assert await controller.run_due() == []
    assert sum("FROM drift_features" in q for q in harness.warehouse.queries) == 1
    harness.warehouse.outputs = [*outputs("v1", 1000), *outputs("v2", 1000)]  # more pairs, all alike
    controller._publish = publish
    harness.later()
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert "empty_output" in by_gate(decision.evidence)["drift"].detail
    assert sum("FROM drift_features" in q for q in harness.warehouse.queries) == 1


async def test_a_candidate_whose_outputs_match_passes_and_promotes(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed([canary(step=2)])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"
    drift = by_gate(decision.evidence)["drift"]
    assert drift.state == "pass"
    assert drift.detail.startswith("answers alike (100 shadow pairs; tested completion_tokens (ks p=")
    # each test's numbers and the level, in the evidence (an audit: a decision said none of them)
    assert re.search(r"output_chars \(ks p=[0-9.e-]+ >= 0\.00125\)", drift.detail)
    assert drift.detail.endswith("; alpha 0.01 over 8 features)")
    assert drift.limit == 0.01


async def test_without_shadow_copies_the_drift_gate_does_not_apply(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed([canary(shadow=0.0)])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"
    assert by_gate(decision.evidence)["drift"] == GateResult(
        gate="drift", state="not_applicable", detail=NO_SHADOW
    )
    assert "drift not applicable" in decision.reason
    assert not any("FROM drift_features" in q for q in harness.warehouse.queries)


async def test_without_shadow_copies_the_drift_gate_says_so_from_the_start_of_the_step(
    harness: Harness,
) -> None:
    """``rollout status`` showed a step without shadow copies its drift gate as waiting ("judged once every
    other gate passes"), while ``rollout start`` had said it does not apply: it is ``not_applicable`` from
    the step's first look."""
    controller = harness.controller()
    controller.seed(
        [canary(shadow=0.0, gates=RolloutGates(min_requests=100, step_min_s=60), now=harness.now)]
    )
    assert await controller.run_due() == []  # the step is young
    drift = by_gate(controller.last_results[MODEL])["drift"]
    assert (drift.state, drift.detail) == ("not_applicable", NO_SHADOW)


async def test_no_traffic_is_no_decision(harness: Harness) -> None:
    harness.warehouse.stats = []
    controller = harness.controller()
    controller.seed([canary()])
    assert await controller.run_due() == []
    assert {r.state for r in controller.last_results[MODEL][:4]} == {"insufficient_data"}
    assert controller.deployments[MODEL].phase == "canary"


@pytest.mark.parametrize("bad", [True, False])
async def test_a_restarted_controller_reaches_the_same_decision(harness: Harness, bad: bool) -> None:
    if bad:
        bad_candidate(harness.warehouse)
    mid_rollout = canary(step=1)
    first = harness.controller()
    first.seed([mid_rollout])
    (decision,) = await first.run_due()

    again = Harness(harness.warehouse, [], now=harness.now, mono=0.0).controller()
    again.seed([mid_rollout])
    (repeated,) = await again.run_due()
    assert same_decision(decision, repeated)
    assert repeated.action == ("rollback" if bad else "promote")


async def test_a_controller_restarted_after_a_rollback_does_nothing(harness: Harness) -> None:
    bad_candidate(harness.warehouse)
    first = harness.controller()
    first.seed([canary()])
    (rollback,) = await first.run_due()
    asked = len(harness.warehouse.queries)

    published: list[DeploymentChanged] = []
    restarted = Harness(harness.warehouse, published, now=harness.now + timedelta(minutes=1)).controller()
    restarted.seed([rollback])
    restarted.observe([finished()])
    assert await restarted.run_due() == []
    assert published == []
    assert len(harness.warehouse.queries) == asked
    assert restarted.deployments[MODEL] == rollback


# --- the candidate's workers: a canary whose candidate has none left is rolled back ------------------------


def with_members(harness: Harness, counts: dict[str, int | None]) -> RolloutController:
    """A controller whose ``serving`` gate reads ``counts`` (version -> workers in its group; None: unknown)."""

    async def members(model: str, version: str) -> int | None:
        assert model == MODEL
        return counts[version]

    return RolloutController(
        harness.warehouse.read,
        harness.publish,
        interval_s=1.0,
        clock=lambda: harness.now,
        monotonic=lambda: harness.mono,
        members=members,
    )


async def test_a_candidate_whose_workers_are_gone_is_rolled_back_not_promoted(harness: Harness) -> None:
    """Found by an audit: a candidate whose only worker stopped in its step was promoted on the samples of
    the step's first seconds (the requests routed to it were never answered: no rows to judge), and every
    request after the promotion timed out."""
    counts: dict[str, int | None] = {"v2": 1}
    controller = with_members(harness, counts)
    controller.seed([canary(steps=[0.5])])
    counts["v2"] = 0  # its worker stopped: the gates still pass on what it answered before
    assert await controller.run_due() == []  # not promoted: it has had no worker for 0 s
    assert controller.last_results[MODEL][-1].state == "insufficient_data"
    harness.later(SERVING_GRACE_S / 2)
    assert await controller.run_due() == []
    harness.later(SERVING_GRACE_S / 2 + 1)
    (back,) = await controller.run_due()
    assert (back.action, back.phase, back.traffic) == ("rollback", "rolled_back", {"v1": 1.0, "v2": 0.0})
    assert "serving fail (no worker of v2 for 61s: its share of the traffic goes unanswered)" in back.reason
    assert [r.gate for r in back.evidence][-1] == "serving"


async def test_a_candidate_worker_back_within_the_grace_keeps_its_rollout(harness: Harness) -> None:
    counts: dict[str, int | None] = {"v2": 0}
    controller = with_members(harness, counts)
    controller.seed([canary(steps=[0.5])])
    assert await controller.run_due() == []
    harness.later(SERVING_GRACE_S - 1)
    counts["v2"] = 2  # its worker restarted
    (promoted,) = await controller.run_due()
    assert promoted.phase == "promoted"
    assert controller.last_results[MODEL][-1] == GateResult(
        gate="serving", state="pass", candidate=2.0, detail="2 worker(s)"
    )


async def test_a_candidate_whose_workers_cannot_be_counted_does_not_advance(harness: Harness) -> None:
    controller = with_members(harness, {"v2": None})
    controller.seed([canary(steps=[0.5])])
    harness.later(SERVING_GRACE_S * 2)
    assert await controller.run_due() == []
    assert controller.last_results[MODEL][-1].state == "insufficient_data"


async def test_a_controller_that_may_not_decide_publishes_nothing_until_it_may(harness: Harness) -> None:
    """Found by an audit: two streams workers both decided (a steps published twice, and one that never
    read the operator's abort undid it). Only the one whose sink reads the control topic decides."""
    owns = False
    controller = harness.controller(may_decide=lambda: owns)
    controller.seed([canary()])
    assert await controller.run_due() == []
    assert harness.published == []
    assert harness.warehouse.queries == []
    owns = True
    harness.later(1)
    (step,) = await controller.run_due()  # what was due stayed due
    assert step.step == 1


async def test_a_controller_that_loses_the_control_partition_mid_evaluation_publishes_nothing(
    harness: Harness,
) -> None:
    """Found by a review: may it decide was asked once, before an evaluation that waits on the warehouse
    and the drift test; a rebalance meanwhile gave the control partition to another streams worker, which
    decided from the same deployment, and both published their step."""
    owns = True
    release = asyncio.Event()  # the warehouse answers after the rebalance
    controller = harness.controller(held=release, may_decide=lambda: owns)
    controller.seed([canary()])
    running = asyncio.create_task(controller.run_due())
    await asyncio.sleep(0)
    owns = False  # the control partition is revoked and handed to another streams worker
    release.set()
    assert await running == []
    assert harness.published == []
    owns = True  # handed back: what was due is due still
    harness.later(1)
    (step,) = await controller.run_due()
    assert step.step == 1


async def test_an_abort_read_back_with_the_controllers_step_before_its_ack_is_published_again(
    harness: Harness,
) -> None:
    """Found by a review: an operator's abort placed just before the controller's step, both brought back
    by the sink before the step's delivery report came (a slow ack), was taken for a deployment later
    than the controller's last: the step stood as the log's last word and the abort was undone for good."""
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    aborted = roll_back(current, T0 + timedelta(seconds=1), "aborted by the operator: test", [], "operator")

    async def slow_ack(event: DeploymentChanged) -> tuple[int, int]:
        where = await harness.publish(event)  # on the log at 100, after the abort at 99
        controller.observe([aborted, event], {aborted.id: (0, 99), event.id: where})
        return where

    controller._publish = slow_ack
    (step,) = await controller.run_due()
    assert (step.phase, step.actor) == ("canary", "controller")
    controller._publish = harness.publish
    harness.later()
    (again,) = await controller.run_due()
    assert (again.phase, again.actor) == ("rolled_back", "controller")
    assert controller.deployments[MODEL].phase == "rolled_back"


def candidate_errs_more(warehouse: Warehouse) -> None:
    # 5 % vs 1 %: within max_error_delta, so only the burn gate can fail.
    warehouse.stats = [row("v1", errors=10), row("v2", errors=50)]


async def test_a_fast_burn_rolls_back_when_the_candidate_errs_more(harness: Harness) -> None:
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    controller.observe([burn_event(at=T0 + timedelta(seconds=10), threshold=14.4)])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert by_gate(decision.evidence)["error_ratio"].state == "pass"
    assert by_gate(decision.evidence)["burn"].state == "fail"
    assert "burn fail (availability 1h/5m burn 20.0)" in decision.reason


async def test_the_slow_pair_resolving_does_not_clear_a_fast_burn_still_firing(harness: Harness) -> None:
    """Any resolved crossing of the model (here the 6h/30m pair's) cleared its fast burn: the fast pair is
    not announced again while it keeps firing, so the canary could promote during a page-level burn."""
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    fast = burn_event(at=T0 + timedelta(seconds=10))
    slow = msgspec.structs.replace(fast, window="6h/30m", threshold=6.0)
    controller.observe([fast, slow])
    controller.observe([msgspec.structs.replace(slow, time=T0 + timedelta(seconds=20), firing=False)])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert by_gate(decision.evidence)["burn"].state == "fail"
    # the fast pair resolving does clear it
    controller = harness.controller()
    controller.seed([canary()])
    controller.observe([fast, msgspec.structs.replace(fast, time=T0 + timedelta(seconds=20), firing=False)])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"


async def test_the_fast_pair_of_a_7_day_budget_counts_though_its_rate_is_lower(harness: Harness) -> None:
    """Found by an audit: a firing crossing counted only at a rate of 14.4 or more, which is the fast pair's
    on a 30-day budget only: on a 7-day tier the 1h/5m pair fires at 3.36, and never failed a candidate."""
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary(), burn_event(at=T0 + timedelta(seconds=10), threshold=3.36, rate=5.0)])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert by_gate(decision.evidence)["burn"].state == "fail"


async def test_a_restarted_controller_still_sees_a_fast_burn_firing_on_the_control_topic(
    harness: Harness,
) -> None:
    """A burn is announced once while it fires: a controller started during it read only the deployments
    and readiness from the control topic, and promoted a canary under a page-level burn."""
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary(), burn_event(at=T0 + timedelta(seconds=10))])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert by_gate(decision.evidence)["burn"].state == "fail"


async def test_without_a_burn_the_same_rows_advance(harness: Harness) -> None:
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"


@pytest.mark.parametrize(
    "burn",
    [
        burn_event(at=T0 + timedelta(seconds=10), threshold=6.0, window="6h/30m"),  # a slow burn
        # the slow pair of a 90-day budget: a rate above 14.4, counted as fast by its rate (an audit)
        burn_event(at=T0 + timedelta(seconds=10), threshold=18.0, window="6h/30m"),
        burn_event(at=T0 + timedelta(seconds=10), model="all-minilm-l6-v2"),  # another model
    ],
    ids=["slow", "slow-on-a-90-day-budget", "other-model"],
)
async def test_burns_that_do_not_count(harness: Harness, burn: BurnRateCrossed) -> None:
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    controller.observe([burn])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"
    assert by_gate(decision.evidence)["burn"].state == "pass"


async def test_a_burn_from_an_earlier_step_still_firing_counts(harness: Harness) -> None:
    """Found by a review: a burn is announced once, when it crosses, and the gate took only one that began
    in the step it judged. One read just after the controller took a step (or one that began in an earlier
    step and went on) was never seen again: a candidate failing 5x the stable version's ratio was
    promoted under a firing page. Whose the burn is, is judged on the step's own numbers."""
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary(now=T0)])
    controller.observe([burn_event(at=T0 + timedelta(seconds=10))])
    controller.observe([canary(now=T0 + timedelta(minutes=1), step=1)])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    burn = by_gate(decision.evidence)["burn"]
    assert (burn.state, burn.candidate) == ("fail", 20.0)


@pytest.mark.parametrize("seeded", [False, True], ids=["read-live", "read-at-start"])
async def test_a_burn_firing_before_the_canary_began_counts(harness: Harness, seeded: bool) -> None:
    """A burn of the stable version still firing when the rollout starts: the candidate that fails more
    than that stable version, under it, is rolled back (before, the burn was dropped while no canary was
    known, and one that fired before the step was not the step's)."""
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    burn = burn_event(at=T0 - timedelta(minutes=5))
    if seeded:
        controller.seed([burn, canary()])
    else:
        controller.observe([burn])  # no rollout known yet
        controller.seed([canary()])
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert by_gate(decision.evidence)["burn"].state == "fail"


async def test_a_burn_still_firing_from_an_earlier_step_is_not_the_candidate_that_errs_less(
    harness: Harness,
) -> None:
    """The blame rule, not the burn's start, keeps a stable version's burn off the candidate."""
    harness.warehouse.stats = [row("v1", errors=50), row("v2", errors=10)]
    controller = harness.controller()
    controller.seed([canary(now=T0)])
    controller.observe([burn_event(at=T0 + timedelta(seconds=10))])
    controller.observe([canary(now=T0 + timedelta(minutes=1), step=1)])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"
    assert by_gate(decision.evidence)["burn"].state == "pass"


async def test_a_cleared_burn_no_longer_counts(harness: Harness) -> None:
    candidate_errs_more(harness.warehouse)
    controller = harness.controller()
    controller.seed([canary()])
    controller.observe([burn_event(at=T0 + timedelta(seconds=10))])
    controller.observe([burn_event(at=T0 + timedelta(seconds=20), firing=False)])
    (decision,) = await controller.run_due()
    assert decision.action == "promote"


async def test_a_newer_deployment_replaces_the_state(harness: Harness) -> None:
    current = canary()
    controller = harness.controller()
    controller.seed([current])
    aborted = roll_back(current, T0 + timedelta(seconds=1), "aborted by the operator: test", [], "operator")
    controller.observe([aborted])
    assert controller.deployments[MODEL] is aborted
    assert await controller.run_due() == []
    assert harness.warehouse.queries == []


async def test_an_older_deployment_does_not_replace_the_state(harness: Harness) -> None:
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    stale = roll_back(current, T0 + timedelta(hours=1), "old news, a clock ahead", [], "operator")
    controller.observe([stale], {stale.id: (0, 6)})  # before it in the log: its clock does not matter
    assert controller.deployments[MODEL] is current
    (decision,) = await controller.run_due()
    assert decision.action == "promote"


async def test_the_log_order_wins_over_the_clocks(harness: Harness) -> None:
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    aborted = msgspec.structs.replace(
        roll_back(current, T0, "aborted by the operator: test", [], "operator"), time=T0 - timedelta(hours=1)
    )
    controller.observe([aborted], {aborted.id: (0, 8)})  # after it in the log, from a clock behind
    assert controller.deployments[MODEL] is aborted
    assert await controller.run_due() == []


async def test_a_new_canary_observed_later_becomes_due(harness: Harness) -> None:
    controller = harness.controller()
    controller.seed(
        [msgspec.structs.replace(canary(), phase="stable", candidate=None, time=T0 - timedelta(days=1))]
    )
    assert await controller.run_due() == []
    controller.observe([canary()])
    (decision,) = await controller.run_due()
    assert decision.step == 1


async def test_a_failed_read_publishes_nothing_and_tries_again(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    harness.warehouse.error = ConnectionError("warehouse down")
    controller = harness.controller(interval_s=5.0)
    controller.seed([canary()])
    with caplog.at_level(logging.ERROR, logger="streams.rollout"):
        assert await controller.run_due() == []
    assert harness.published == []
    assert any("evaluating demo-gpt failed" in r.getMessage() for r in caplog.records)
    assert controller.deployments[MODEL].phase == "canary"

    harness.warehouse.error = None
    harness.mono += 1.0
    assert await controller.run_due() == []  # still within the interval
    harness.mono += 4.0
    (decision,) = await controller.run_due()  # due without any new event
    assert decision.step == 1
    assert harness.published == [decision]


async def test_models_are_decided_independently(harness: Harness) -> None:
    other = msgspec.structs.replace(canary(), model="other")
    harness.warehouse.stats_of["other"] = [row("v1", errors=10), row("v2", errors=200)]
    controller = harness.controller()
    controller.seed([canary(), other])
    decisions = await controller.run_due()
    assert [(d.model, d.action) for d in decisions] == [(MODEL, "promote"), ("other", "rollback")]
    assert controller.deployments[MODEL].step == 1
    assert controller.deployments["other"].phase == "rolled_back"


async def test_a_failed_publish_is_tried_again(harness: Harness) -> None:
    bad_candidate(harness.warehouse)
    attempts: list[DeploymentChanged] = []

    async def flaky_publish(event: DeploymentChanged) -> tuple[int, int]:
        attempts.append(event)
        if len(attempts) == 1:
            raise ConnectionError("broker unreachable")
        return await harness.publish(event)

    controller = RolloutController(
        harness.warehouse.read,
        flaky_publish,
        interval_s=1.0,
        clock=lambda: harness.now,
        monotonic=lambda: harness.mono,
    )
    controller.seed([canary()])
    with contextlib.suppress(ConnectionError):  # raising or logging: either is fine
        await controller.run_due()
    assert harness.published == []
    assert controller.deployments[MODEL].phase == "canary"  # nothing moves before it is durable

    harness.later()  # no new event: the failed decision alone must bring it back
    (decision,) = await controller.run_due()
    assert decision.action == "rollback"
    assert harness.published == [decision]


async def test_the_controller_follows_its_own_decision_when_its_clock_is_behind(harness: Harness) -> None:
    bad_candidate(harness.warehouse)
    harness.now = T0 - timedelta(seconds=5)  # the operator's clock ran 5 s ahead of the streams worker's
    controller = harness.controller()
    controller.seed([canary(now=T0)])
    (decision,) = await controller.run_due()
    assert controller.deployments[MODEL] is decision
    harness.mono += 10
    controller.observe([finished(version="v1")])
    assert await controller.run_due() == []
    assert harness.published == [decision]


# --- an operator's decision and the controller's, derived from the same deployment ------------------------


def operator_abort(current: DeploymentChanged) -> DeploymentChanged:
    return roll_back(current, T0 + timedelta(seconds=1), "aborted by the operator: test", [], "operator")


async def test_an_operator_decision_the_controller_landed_after_is_published_again(harness: Harness) -> None:
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    (step,) = await controller.run_due()  # placed at 100: after the abort the sink has not brought yet
    aborted = operator_abort(current)
    controller.observe([aborted, step], {aborted.id: (0, 99), step.id: (0, 100)})
    assert controller.deployments[MODEL] is step  # the log's last word, for now

    (again,) = await controller.run_due()  # without waiting for the evaluation interval
    assert harness.published == [step, again]
    assert (again.action, again.phase, again.traffic) == ("rollback", "rolled_back", aborted.traffic)
    assert (again.actor, again.stable, again.candidate) == ("controller", "v1", "v2")
    assert again.id not in (aborted.id, step.id)
    assert again.time > step.time
    assert "the operator's rollback again" in again.reason
    assert "aborted by the operator" in again.reason
    assert controller.deployments[MODEL] is again
    controller.observe([again], {again.id: (0, 101)})  # its own, coming back
    harness.later()
    controller.observe([finished()])
    assert await controller.run_due() == []
    assert len(harness.published) == 2


async def test_an_operator_decision_before_two_unread_decisions_of_the_controller_is_published_again(
    harness: Harness,
) -> None:
    """The sink lags on the control topic: the controller has derived a second step from its first before
    the operator's abort, placed before the first, comes back. The abort sits before the second step's
    source but after the first's: it must still be the log's last word, not a promotion."""
    current = canary(gates=RolloutGates(min_requests=100, step_min_s=0))
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    (first,) = await controller.run_due()  # placed at 100, derived from the canary at 7
    aborted = operator_abort(current)  # placed at 99
    harness.later()
    controller.observe([finished()])  # outcomes; the control records are not back yet
    (second,) = await controller.run_due()  # placed at 101, derived from the first step at 100
    assert (first.step, second.step) == (1, 2)
    controller.observe(
        [aborted, first, second], {aborted.id: (0, 99), first.id: (0, 100), second.id: (0, 101)}
    )

    harness.later()
    (again,) = await controller.run_due()
    assert harness.published == [first, second, again]
    assert (again.action, again.phase, again.traffic) == ("rollback", "rolled_back", aborted.traffic)
    assert "the operator's rollback again" in again.reason
    assert controller.deployments[MODEL] is again
    controller.observe([again], {again.id: (0, 102)})
    controller.observe([aborted], {aborted.id: (0, 99)})  # redelivered: the sink is past it, done with
    harness.later()
    assert await controller.run_due() == []
    assert harness.published == [first, second, again]


async def test_an_operator_decision_read_while_the_controller_publishes_is_published_again(
    harness: Harness,
) -> None:
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    aborted = operator_abort(current)
    publish = harness.publish

    async def publish_while_the_abort_arrives(event: DeploymentChanged) -> tuple[int, int]:
        controller.observe([aborted], {aborted.id: (0, 99)})  # the sink, during the round trip
        return await publish(event)

    controller._publish = publish_while_the_abort_arrives
    (step,) = await controller.run_due()
    assert controller.deployments[MODEL] is step
    controller._publish = publish
    (again,) = await controller.run_due()
    assert (again.action, again.actor, controller.deployments[MODEL]) == ("rollback", "controller", again)


async def test_an_operator_decision_after_the_controllers_stands(harness: Harness) -> None:
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    (step,) = await controller.run_due()
    aborted = operator_abort(current)
    controller.observe([step, aborted], {step.id: (0, 100), aborted.id: (0, 101)})
    assert controller.deployments[MODEL] is aborted
    harness.later()
    assert await controller.run_due() == []
    assert harness.published == [step]


async def test_a_decision_of_another_controller_before_its_own_is_not_published_again(
    harness: Harness,
) -> None:
    bad_candidate(harness.warehouse)
    current = canary()
    controller = harness.controller()
    controller.seed([current], {current.id: (0, 7)})
    (rollback,) = await controller.run_due()
    other = advance(current, T0 + timedelta(seconds=1), "another controller's step", [], "controller")
    controller.observe([other, rollback], {other.id: (0, 99), rollback.id: (0, 100)})
    harness.later()
    assert await controller.run_due() == []
    assert harness.published == [rollback]
    assert controller.deployments[MODEL] is rollback


def test_a_latency_gate_leaves_a_fresh_workers_first_slow_requests_out(tmp_path: Path) -> None:
    """An audit: over fewer than 100 requests a p99 is the slowest one, and a candidate's freshly started
    worker's first requests (486 and 549 ms, the rest 7-25) rolled an identical candidate back on
    ``ttft_p99_ms`` in 3 of 4 tries. The gate's p99 leaves out up to 3 of each side's slowest (never
    more than a tenth); the warehouse's (``stats_sql``) and ``sluice rollout evaluate``'s (``stats_of``)
    agree, and a candidate slow throughout still fails."""
    from schemas.ids import uuid7_from_parts
    from streams.rollout import robust_p99_rank
    from streams.sink import Rows, insert
    from tests.streams.test_audit import finished
    from tests.streams.test_queries import migrated_warehouse, rows
    from tests.streams.test_sink import records

    now = datetime.now(UTC).replace(microsecond=0)

    def ended(version: str, i: int, ttft_ms: float) -> RequestFinished:
        at = now - timedelta(seconds=30) + timedelta(milliseconds=100 * i)
        return finished(
            request_id=uuid7_from_parts(int(at.timestamp() * 1000), i + 1000 * int(version[1:])),
            time=at,
            timings=Timings(accepted=at, first_token=at + timedelta(milliseconds=ttft_ms), finished=at),
            model_version=version,
        )

    assert [robust_p99_rank(n) for n in (1, 9, 10, 56, 100, 300, 1000)] == [1, 9, 9, 53, 97, 297, 991]
    stable = [ended("v1", i, 10.0 + i % 15) for i in range(71)]
    cold = [ended("v2", i, (486.0, 549.0, 300.0)[i] if i < 3 else 10.0 + i % 15) for i in range(56)]
    slow = [ended("v3", i, 80.0 + i % 15) for i in range(56)]  # over 1.5 x 24 + 25 ms throughout
    with migrated_warehouse(tmp_path / "data") as client:
        insert(client, Rows(PriceTable()).batch(records(*stable, *cold, *slow, topic="p.results")))
        found = parse_stats(
            rows(client, stats_sql("demo-gpt", ["v1", "v2", "v3"], now - timedelta(minutes=5)))
        )
    for version, events in (("v1", stable), ("v2", cold), ("v3", slow)):
        assert found[version].ttft_p99_ms == stats_of(events, PriceTable()).ttft_p99_ms, version
        assert found[version].ttft_n == stats_of(events, PriceTable()).ttft_n == len(events), version
    assert found["v2"].ttft_p99_ms == 24.0, "the three cold requests left out"
    gates = RolloutGates(min_requests=50)
    passed = by_gate(judge(gates, found["v2"], found["v1"]))["ttft_p99_ms"]
    assert passed.state == "pass", passed
    failed = by_gate(judge(gates, found["v3"], found["v1"]))["ttft_p99_ms"]
    assert failed.state == "fail", failed
