"""The rollout controller: observe (the outcome stream) -> decide (gates) -> act (``DeploymentChanged``).

A rollout is a ``DeploymentChanged`` with a ``candidate`` on the compacted control topic. It starts
``warming``: the candidate's workers start and load with no traffic. A worker of the candidate that is
ready says so on the control topic (``WorkerReady``, naming the deployment it read); the controller then
moves the rollout to ``canary`` at its first step. A candidate with no ready worker within the gates'
``ready_timeout_s`` is rolled back. So no request waits for a model that is still loading.

The controller lives in the streams worker. Every sink batch that carries a terminal event of a
model under rollout (or a burn-rate change for it) triggers an evaluation, at most once per
``rollout_eval_interval_s``, over the rows that batch has just made durable: the stable and candidate
versions' requests accepted since the step began (``request_facts``), the answers of the step's shadow
pairs for the drift gate (``drift_features``, :mod:`streams.rollout_drift`: tested once a step, when it
alone decides), and the model's firing fast burn alerts.

Each gate is ``pass``, ``fail`` or ``insufficient_data`` (either side below ``min_requests``, or a
latency only one side has samples of yet): low traffic neither promotes nor aborts. A latency gate whose
metric neither side has at all, both having ``min_requests``, is ``not_applicable`` and counts as passed:
the model does not produce it (an embedding has no inter-token gap). An embedding has no first token
either: its TTFT gate judges the end-to-end p99 of the completed embedding requests instead (said in the
gate's ``detail``). One failed gate rolls back at once: the candidate's share goes to 0 and the
``DeploymentChanged`` carries the reason and every gate's numbers. All gates passing (or not applicable),
for at least ``step_min_s``, moves to the next step; passing the last step before 100 % promotes the
candidate to stable.

The controller keeps no state of its own beyond the latest deployment per model, which it reads from the
control topic at start and follows through the sink: a restarted controller resumes exactly where the
log says the rollout is, and recomputes the gates from the warehouse. Like the edges and workers, it
follows the log's order (each deployment's place on the control topic), not the deciders' clocks, and
times each step from when it saw it start (a decision's ``step_started`` is its decider's clock); a
restarted controller times the step in progress from its restart (a step may so last longer, never less).

An operator's decision outranks the controller's. Both are derived from the latest deployment the decider
has read, so the two can race: the operator aborts, and before the sink has brought the abort here the
controller publishes the next step it derived from the deployment before the abort. The log's last word
would then silently undo the operator's. The controller notices (an operator's deployment placed after
the one the earliest of its decisions the sink has not brought back yet came from, and before its latest
decision: with the sink lagging, it may have derived a second step from its first before the abort came
back) and publishes the operator's decision again, so the log ends with it; workers and edges follow the
step for the moment that takes.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from types import MappingProxyType
from typing import Any, TypedDict, get_args

import msgspec

from bus.producer import Position
from monitoring import metrics
from schemas.events import (
    BurnRateCrossed,
    DeploymentChanged,
    Event,
    GateResult,
    GateState,
    RequestFinished,
    RolloutGates,
    WorkerReady,
    utc_now,
)
from streams.facts import FACT_COLUMNS, fact_row
from streams.pricing import PriceTable
from streams.queries import FAILED_BY_CLIENT, FAILED_BY_SERVICE, sql_string
from streams.rollout_drift import NOT_YET, Reader, drift_gate

log = logging.getLogger(__name__)

SOURCE = "streams/rollout"
BURN_MIN_ERRORS = 3
"""Failed candidate requests in the step before a fast burn is blamed on it."""
FAST_WINDOWS = frozenset({"1h/5m"})
"""The burn-rate pairs whose firing fails a candidate, by default (the SLO config's fastest page pair). By
window, not by a rate: the rate of one pair depends on the model's tier (1h/5m is 3.36 for a 7-day
budget, which a fixed 14.4 never counted; 6h/30m is 18 for a 90-day one, which it counted: an audit)."""
IN_PROGRESS = ("warming", "canary")
"""The phases of a rollout that has not ended."""
READY_REMEMBERED = 1024
"""``WorkerReady`` announcements the controller keeps (by deployment and version), newest last."""
GATE_STATES: tuple[GateState, ...] = get_args(GateState)
"""Every state a gate can be in (the gate-state metric has one series per state)."""
EMBEDDING_LATENCY = "embeddings: end-to-end p99 of completed requests (no first token)"
"""The ``detail`` of a TTFT gate judged on :attr:`VersionStats.embedding_p99_ms`."""


def passes(result: GateResult) -> bool:
    """Whether ``result`` lets the step advance: it passed, or it does not apply to this model."""
    return result.state in ("pass", "not_applicable")


def in_progress(deployment: DeploymentChanged | None) -> bool:
    """Whether ``deployment`` is a rollout that has not ended (warming up or at a canary step)."""
    return deployment is not None and deployment.phase in IN_PROGRESS and deployment.candidate is not None


@dataclass(frozen=True)
class VersionStats:
    """One version's requests in a step (from :func:`stats_sql`)."""

    n: int = 0
    errors: int = 0
    ttft_p99_ms: float | None = None
    itl_p99_ms: float | None = None
    tokens: int = 0
    cost_nanos: int = 0
    embedding_p99_ms: float | None = None
    """p99 end-to-end latency (accepted to finished) of the completed embedding requests: an embedding has
    no first token (``ttft_p99_ms`` is None), its whole answer is its first output, so this stands in for
    TTFT (queue wait included, as in TTFT)."""
    ttft_n: int = 0
    """How many samples ``ttft_p99_ms`` is taken over (the clients' requests when there are any), and the
    same for the others: a latency gate judges only when both sides have ``--min-requests`` samples of
    it. With ``--shadow`` most of a canary's requests can be shadow copies, whose latencies the gate leaves
    out: counted by ``n``, a step judged a p99 over 19 requests at ``--min-requests 50`` (an audit)."""
    itl_n: int = 0
    embedding_n: int = 0

    @property
    def error_ratio(self) -> float:
        return self.errors / self.n if self.n else 0.0

    @property
    def cost_per_1k_usd(self) -> float | None:
        return self.cost_nanos / 1e9 / self.tokens * 1000 if self.tokens else None


OUTLIERS_LEFT_OUT = 3
"""A latency gate's p99 leaves out up to this many of a side's slowest samples (never more than a tenth).
Over fewer than 100 samples a p99 is the slowest one: a candidate's freshly started worker's first requests
(486 and 549 ms where the rest took 7-25) rolled an identical candidate back in 3 of 4 tries at the default
``--min-requests 50`` (an audit). From ~300 samples on this is the plain p99."""


def robust_p99_rank(n: int) -> int:
    """The 1-based rank, in ascending order, of the value a latency gate takes as ``n`` samples' p99:
    ``quantileExact``'s (floor(0.99 n) + 1), but never among the :data:`OUTLIERS_LEFT_OUT` slowest."""
    return max(1, min(int(0.99 * n) + 1, n - min(OUTLIERS_LEFT_OUT, n // 10)))


def _p99_sql(name: str, column: str, where: str) -> str:
    """Two columns: ``<name>_p99``, :func:`robust_p99_rank`'s value of ``column`` over the rows matching
    ``where`` (0 with none), and ``<name>_n``, how many rows match."""
    n = f"{name}_n"
    rank = f"greatest(1, least(toInt64(floor(0.99 * {n})) + 1, toInt64({n}) - least({OUTLIERS_LEFT_OUT}, intDiv({n}, 10))))"
    return f"arrayElement(arraySort(groupArrayIf({column}, {where})), {rank}) AS {name}_p99,\n    countIf({where}) AS {n}"


def stats_sql(model: str, versions: Iterable[str], since: datetime) -> str:
    """Per version: terminal requests accepted since ``since``, errors (failed, or expired: a shadow copy
    or a batch line that expired waited at a low priority, which is not the candidate's fault), p99 TTFT
    and inter-token gap, tokens and cost (shadow copies included: they are the candidate's outcomes too).
    TTFT is taken over the requests clients sent when there are any: a shadow copy's first token waits
    behind every live request (lowest priority), which measures the queue, not the candidate; a
    shadow-only step has nothing else to judge by. Lines of async batches count as requests and failures
    but in no latency (they wait in the batch lane by design) and not in the cost per token (they are
    billed at the batch discount, so a version that served more of them would look cheaper), nor do a
    failed request's tokens (a failure is billed nothing: a version failing more would look cheaper) nor
    those of a request cancelled or expired before any model took it (billed nothing either: a version
    whose queue was cancelled more would look cheaper). An expired shadow copy or batch line is not counted
    in ``n`` either: it is not an error of the version, and counted it would dilute the errors that are
    and fill ``--min-requests`` with requests the version never answered. Nor is a client's error (a
    prompt too long for the worker, answered 400: :data:`streams.queries.FAILED_BY_CLIENT`), as in every
    availability SLI. Embeddings
    have no first token: their end-to-end latency (completed ones, live first, like TTFT) stands in."""
    listed = ", ".join(sql_string(v) for v in sorted(set(versions)))
    since_ms = int(since.timestamp() * 1000)
    return f"""SELECT model_version,
    countIf(NOT (status = 'expired' AND (shadow_of != '' OR batch_id != '')) AND NOT {FAILED_BY_CLIENT}) AS n,
    countIf({FAILED_BY_SERVICE} OR (status = 'expired' AND shadow_of = '' AND batch_id = '')) AS errors,
    {_p99_sql("ttft", "ttft_ms", "ttft_ms IS NOT NULL AND batch_id = ''")},
    {_p99_sql("ttft_live", "ttft_ms", "ttft_ms IS NOT NULL AND shadow_of = '' AND batch_id = ''")},
    {_p99_sql("itl", "itl_max_ms", "itl_max_ms IS NOT NULL AND batch_id = ''")},
    {_p99_sql("embed", "e2e_ms", "kind = 'embedding' AND status = 'completed' AND batch_id = ''")},
    {_p99_sql("embed_live", "e2e_ms", "kind = 'embedding' AND status = 'completed' AND shadow_of = '' AND batch_id = ''")},
    sumIf(prompt_tokens + completion_tokens, batch_id = '' AND status != 'failed'
        AND NOT (status IN ('cancelled', 'expired') AND started IS NULL)) AS tokens,
    sumIf(cost_nanos, batch_id = '') AS cost_nanos
FROM request_facts FINAL
WHERE model = {sql_string(model)} AND model_version IN ({listed})
    AND accepted >= fromUnixTimestamp64Milli({since_ms}) AND accepted <= now64(3)
GROUP BY model_version"""  # noqa: S608 (quoted literals and an integer only)


def parse_stats(rows: Sequence[dict[str, Any]]) -> dict[str, VersionStats]:
    def number(value: Any, samples: Any) -> float | None:
        if not samples or value is None or not math.isfinite(float(value)):
            return None
        return float(value)

    def live_first(r: dict[str, Any], prefix: str) -> tuple[float | None, int]:
        """The p99 and its samples' count, the live requests' where there are any."""
        scope = f"{prefix}_live" if r.get(f"{prefix}_live_n") else prefix
        samples = int(r.get(f"{scope}_n") or 0)
        return number(r.get(f"{scope}_p99"), samples), samples

    def stats(r: dict[str, Any]) -> VersionStats:
        (ttft, ttft_n), (embedding, embedding_n) = live_first(r, "ttft"), live_first(r, "embed")
        return VersionStats(
            n=int(r["n"]),
            errors=int(r["errors"]),
            ttft_p99_ms=ttft,
            itl_p99_ms=number(r["itl_p99"], r["itl_n"]),
            tokens=int(r["tokens"]),
            cost_nanos=int(r["cost_nanos"]),
            embedding_p99_ms=embedding,
            ttft_n=ttft_n,
            itl_n=int(r["itl_n"] or 0),
            embedding_n=embedding_n,
        )

    return {str(r["model_version"]): stats(r) for r in rows}


class _Sizes(TypedDict):
    candidate_n: int
    baseline_n: int


def stats_of(results: Iterable[RequestFinished], prices: PriceTable) -> VersionStats:
    """The gate metrics of terminal events computed as their ``request_facts`` rows compute them (for
    runs that never reach the warehouse: ``sluice rollout evaluate``)."""
    # a client's error (answered 4xx) is no outcome of the version: stats_sql leaves it out of n and errors
    rows = [
        dict(zip(FACT_COLUMNS, fact_row(event, prices), strict=True))
        for event in results
        if not event.failed_by_client()
    ]

    def p99(column: str, of: list[dict[str, Any]] = rows) -> tuple[float | None, int]:
        values = sorted(float(r[column]) for r in of if r[column] is not None)
        return (values[robust_p99_rank(len(values)) - 1] if values else None), len(values)

    # an expired shadow copy or batch line waited at a low priority: neither an outcome nor an error
    rows = [r for r in rows if not (r["status"] == "expired" and (r["shadow_of"] or r["batch_id"]))]
    timed = [r for r in rows if not r["batch_id"]]  # batch lines: no latency, no cost per token

    def unrun(r: dict[str, Any]) -> bool:
        return r["status"] in ("cancelled", "expired") and r["started"] is None

    live = [r for r in timed if not r["shadow_of"]]
    # a failure, or a request no model took, is billed nothing: not free tokens
    billed = [r for r in timed if r["status"] != "failed" and not unrun(r)]

    def error(r: dict[str, Any]) -> bool:
        return r["status"] == "failed" or (r["status"] == "expired" and not r["shadow_of"])

    def embedded(of: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in of if r["kind"] == "embedding" and r["status"] == "completed"]

    ttft = p99("ttft_ms", live) if any(r["ttft_ms"] is not None for r in live) else p99("ttft_ms", timed)
    itl, embedding = p99("itl_max_ms", timed), p99("e2e_ms", embedded(live) or embedded(timed))
    return VersionStats(
        n=len(rows),
        errors=sum(error(r) for r in rows),
        ttft_p99_ms=ttft[0],
        itl_p99_ms=itl[0],
        tokens=sum(int(r["prompt_tokens"]) + int(r["completion_tokens"]) for r in billed),
        cost_nanos=sum(int(r["cost_nanos"]) for r in timed),
        embedding_p99_ms=embedding[0],
        ttft_n=ttft[1],
        itl_n=itl[1],
        embedding_n=embedding[1],
    )


def judge(
    gates: RolloutGates,
    candidate: VersionStats,
    baseline: VersionStats,
    *,
    drift: GateResult | None = None,
    burn: BurnRateCrossed | None = None,
) -> list[GateResult]:
    """Every gate's result for one step. ``drift``: the drift gate's result when it was judged
    (:mod:`streams.rollout_drift`; None: not yet, ``insufficient_data``); ``burn``: a firing fast-burn
    crossing for the model."""
    sizes: _Sizes = {"candidate_n": candidate.n, "baseline_n": baseline.n}
    enough = candidate.n >= gates.min_requests and baseline.n >= gates.min_requests
    results: list[GateResult] = []

    limit = min(1.0, baseline.error_ratio + gates.max_error_delta)
    results.append(
        GateResult(
            gate="error_ratio",
            state=("fail" if candidate.error_ratio > limit else "pass") if enough else "insufficient_data",
            candidate=round(candidate.error_ratio, 6),
            baseline=round(baseline.error_ratio, 6),
            limit=round(limit, 6),
            **sizes,
        )
    )
    ttft = (candidate.ttft_p99_ms, baseline.ttft_p99_ms, "", candidate.ttft_n, baseline.ttft_n)
    if ttft[:2] == (None, None) and (candidate.embedding_p99_ms, baseline.embedding_p99_ms) != (None, None):
        ttft = (
            candidate.embedding_p99_ms,
            baseline.embedding_p99_ms,
            EMBEDDING_LATENCY,
            candidate.embedding_n,
            baseline.embedding_n,
        )
    itl = (candidate.itl_p99_ms, baseline.itl_p99_ms, "", candidate.itl_n, baseline.itl_n)
    cost = (candidate.cost_per_1k_usd, baseline.cost_per_1k_usd, "", candidate.n, baseline.n)
    for gate, (cand, base, detail, cand_n, base_n), ratio, slack in (
        ("ttft_p99_ms", ttft, gates.max_ttft_p99_ratio, True),
        ("itl_p99_ms", itl, gates.max_itl_p99_ratio, True),
        ("cost_per_1k_tokens", cost, gates.max_cost_ratio, False),
    ):
        if slack and enough and cand is None and base is None:
            # A latency neither version has at all, with enough requests on both sides: this model does not
            # produce it (an embedding has no inter-token gap). Waiting for it would block the rollout for
            # ever, so the gate does not apply (and counts as passed).
            missing = "a first token" if gate == "ttft_p99_ms" else "an inter-token gap"
            detail = f"not measured for this model: no request of either version has {missing}"
            results.append(GateResult(gate=gate, state="not_applicable", detail=detail, **sizes))
            continue
        samples: _Sizes = {"candidate_n": cand_n, "baseline_n": base_n}
        judged = enough and min(cand_n, base_n) >= gates.min_requests  # its own samples, not every request
        if not judged or cand is None or base is None:
            results.append(
                GateResult(
                    gate=gate,
                    state="insufficient_data",
                    candidate=None if cand is None else round(cand, 6),
                    baseline=None if base is None else round(base, 6),
                    detail=detail,
                    **samples,
                )
            )
            continue
        bound = base * ratio + (gates.latency_slack_ms if slack else 0.0)
        results.append(
            GateResult(
                gate=gate,
                state="fail" if cand > bound else "pass",
                candidate=round(cand, 6),
                baseline=round(base, 6),
                limit=round(bound, 6),
                detail=detail,
                **samples,
            )
        )
    if gates.drift:
        results.append(drift or GateResult(gate="drift", state="insufficient_data", detail=NOT_YET, **sizes))
    if gates.burn:
        # The model's fast burn is the candidate's when the candidate fails more than the stable version
        # (and fails at all: a few errors, not one unlucky request). It acts before min_requests: a fast
        # burn is an emergency, the budget of a month going in hours.
        blamed = (
            burn is not None
            and candidate.errors >= BURN_MIN_ERRORS
            and candidate.error_ratio > baseline.error_ratio
        )
        results.append(
            GateResult(
                gate="burn",
                state="fail" if blamed else "pass",
                candidate=burn.burn_rate if burn is not None else None,
                limit=burn.threshold if burn is not None else None,
                detail=f"{burn.slo} {burn.window} burn {burn.burn_rate:.1f}" if burn is not None else "",
                **sizes,
            )
        )
    return results


def _traffic(stable: str, candidate: str | None, share: float) -> dict[str, float]:
    if candidate is None or share <= 0:
        return {stable: 1.0} if candidate is None else {stable: 1.0, candidate: 0.0}
    if share >= 1.0:
        return {candidate: 1.0}
    return {stable: round(1.0 - share, 6), candidate: round(share, 6)}


def decide(
    current: DeploymentChanged, results: Sequence[GateResult], now: datetime
) -> DeploymentChanged | None:
    """The next deployment for a canary whose gates gave ``results``: a rollback on any failure, the next
    step (or promotion) when every gate passed (or is ``not_applicable`` to the model) and the step lasted
    ``step_min_s``; otherwise None."""
    if current.phase != "canary" or current.candidate is None:
        return None
    failed = [r for r in results if r.state == "fail"]
    if failed:
        reason = "; ".join(_describe(r) for r in failed)
        step = f"{current.step + 1}/{len(current.steps)}"
        return roll_back(current, now, f"automatic rollback at step {step}: {reason}", results, "controller")
    if not ripe(current, results, now):
        return overdue(current, results, now)
    # every gate that passed, the drift and burn gates too (they carry no values: an audit read a reason
    # without the drift gate as a step whose drift was never checked), then those that do not apply
    summary = ", ".join(
        [_describe(r) for r in results if r.state != "not_applicable"]
        + [f"{r.gate} not applicable" for r in results if r.state == "not_applicable"]
    )
    return advance(current, now, f"gates passed ({summary})", results, "controller")


def step_age(current: DeploymentChanged, now: datetime) -> float:
    """Seconds ``current``'s step (or its warming) has lasted at ``now`` (from its event time without
    ``step_started``)."""
    return (now - (current.step_started or current.time)).total_seconds()


def ripe(current: DeploymentChanged, results: Sequence[GateResult], now: datetime, *, but: str = "") -> bool:
    """Whether ``current``'s step may advance: every gate (``but`` that one) passed or does not apply, and
    the step lasted ``step_min_s``."""
    gates = current.gates or RolloutGates()
    young = gates.step_min_s > 0 and step_age(current, now) < gates.step_min_s
    return not young and all(passes(r) for r in results if r.gate != but)


def overdue(
    current: DeploymentChanged, results: Sequence[GateResult], now: datetime
) -> DeploymentChanged | None:
    """A rollback of a step that waited ``step_max_s`` for its gates' data and is still inconclusive (a
    gate at ``insufficient_data``); otherwise None. Low traffic stalled a rollout at a step for good: the
    gates need ``min_requests`` of each version, which a quiet model may never send (Argo and Flagger users
    report the same)."""
    gates = current.gates or RolloutGates()
    # The serving gate's wait is its own grace (it rolls back by itself when no worker comes back), and
    # the drift gate waits for the others: named only when nothing else does.
    waiting = [r for r in results if r.state == "insufficient_data" and r.gate != "serving"]
    if any(r.gate != "drift" for r in waiting):
        waiting = [r for r in waiting if r.gate != "drift"]
    if gates.step_max_s <= 0 or not waiting or step_age(current, now) <= gates.step_max_s:
        return None
    step = f"{current.step + 1}/{len(current.steps)}"
    seen = max(((r.candidate_n, r.baseline_n) for r in waiting), default=(0, 0))
    why = (
        f"automatic rollback at step {step}: still inconclusive after {gates.step_max_s:g}s "
        f"({', '.join(r.gate for r in waiting)} waiting for data; {seen[0]} candidate and {seen[1]} stable "
        f"requests in the step, {gates.min_requests} needed of each)"
    )
    return roll_back(current, now, why, results, "controller")


def start_rollout(
    model: str,
    *,
    stable: str,
    candidate: str,
    steps: Sequence[float],
    shadow: float,
    gates: RolloutGates,
    now: datetime,
    source: str,
) -> DeploymentChanged:
    """A rollout, warming up: the candidate's workers start with no traffic; ``steps[0]`` of the traffic
    (0 for shadow only) and ``shadow`` follow once one of them is ready (:func:`warm`)."""
    from schemas.ids import uuid7

    first = f"{steps[0]:.0%} of traffic" + (f", {shadow:.0%} shadowed" if shadow else "")
    return DeploymentChanged(
        tenant="",
        model=model,
        source=source,
        time=now,
        version=candidate,
        action="deploy",
        traffic=_traffic(stable, candidate, 0.0),
        reason=f"rollout started: {first} once a worker of {candidate} is ready",
        stable=stable,
        candidate=candidate,
        phase="warming",
        steps=list(steps),
        step=0,
        step_started=now,
        shadow=shadow,
        gates=gates,
        actor="operator",
        rollout_id=uuid7(),
    )


def warm(current: DeploymentChanged, ready: WorkerReady | None, now: datetime) -> DeploymentChanged | None:
    """The next deployment of a warming rollout: its first step once a worker of the candidate said it is
    ready for this deployment (``ready``), a rollback once one said it cannot load the candidate
    (``ready.error``) or ``ready_timeout_s`` passed without either; otherwise None."""
    if current.phase != "warming" or current.candidate is None:
        return None
    if ready is not None and (ready.deployment, ready.version) == (current.id, current.candidate):
        if ready.error:
            why = f"automatic rollback: a worker of {current.candidate} cannot load it: {ready.error}"
            return roll_back(current, now, why, [], "controller")
        why = f"{current.candidate} is ready (worker {ready.worker})"
        return advance(current, now, why, [], "controller")
    gates = current.gates or RolloutGates()
    if step_age(current, now) <= gates.ready_timeout_s:
        return None
    why = f"automatic rollback: no worker of {current.candidate} was ready within {gates.ready_timeout_s:g}s"
    return roll_back(current, now, why, [], "controller")


def advance(
    current: DeploymentChanged,
    now: datetime,
    why: str,
    evidence: Sequence[GateResult],
    actor: str,
    *,
    to_end: bool = False,
) -> DeploymentChanged:
    """The next step of ``current``'s rollout (the first when it is warming up), or promotion when the
    next share is 100 % (``to_end``: promotion at once, an operator's ``promote --all``)."""
    candidate = current.candidate or current.version
    warming = current.phase == "warming"
    step = len(current.steps) if to_end else current.step if warming else current.step + 1
    share = current.steps[step] if step < len(current.steps) else 1.0
    now = after(current, now)
    common = _decision(current, now, evidence, actor)
    if share >= 1.0:
        return msgspec.structs.replace(
            current,
            **common,
            action="promote",
            traffic=_traffic(candidate, None, 0.0),
            stable=candidate,
            phase="promoted",
            step=min(step, max(len(current.steps) - 1, 0)),
            step_started=now,
            shadow=0.0,
            reason=f"promoted to 100% {'while warming up' if warming else f'after step {current.step + 1}'}: {why}",
        )
    return msgspec.structs.replace(
        current,
        **common,
        action="deploy" if warming else "promote",
        traffic=_traffic(current.stable, candidate, share),
        phase="canary",
        step=step,
        step_started=now,
        reason=f"step {step + 1}/{len(current.steps)}, {share:.0%} of traffic: {why}",
    )


def roll_back(
    current: DeploymentChanged, now: datetime, why: str, evidence: Sequence[GateResult], actor: str
) -> DeploymentChanged:
    """All traffic back on the stable version; the candidate stops serving (its workers drain, and what
    was routed to it and not finished runs on the stable version)."""
    candidate = current.candidate or current.version
    return msgspec.structs.replace(
        current,
        **_decision(current, after(current, now), evidence, actor),
        action="rollback",
        traffic=_traffic(current.stable, candidate, 0.0),
        phase="rolled_back",
        shadow=0.0,
        reason=why,
    )


class _Decision(TypedDict):
    id: str
    time: datetime
    source: str
    version: str
    evidence: list[GateResult]
    actor: str


def after(current: DeploymentChanged, now: datetime) -> datetime:
    """A decision's time: ``now``, but always after the deployment it was derived from, so the order of
    times is the causal order even when the deciding clock is behind the one that wrote ``current``."""
    return max(now, current.time + timedelta(milliseconds=1))


def _decision(
    current: DeploymentChanged, now: datetime, evidence: Sequence[GateResult], actor: str
) -> _Decision:
    from schemas.ids import uuid7

    return {
        "id": uuid7(),
        "time": now,
        "source": SOURCE if actor == "controller" else "sluice/cli",
        "version": current.candidate or current.version,
        "evidence": list(evidence),
        "actor": actor,
    }


def _describe(result: GateResult) -> str:
    if result.gate in ("drift", "burn", "serving"):
        return f"{result.gate} {result.state}" + (f" ({result.detail})" if result.detail else "")
    return (
        f"{result.gate} {result.candidate:g} vs stable {result.baseline:g} (limit {result.limit:g}, "
        f"n={result.candidate_n}/{result.baseline_n}" + (f"; {result.detail})" if result.detail else ")")
    )


Publisher = Callable[[DeploymentChanged], Awaitable[Position]]
Members = Callable[[str, str], Awaitable[int | None]]
"""(model, version) -> how many workers of that version are in its consumer group now (None: unknown)."""
SERVING_GRACE_S = 60.0
"""How long a canary's candidate may have no worker in its group before it is rolled back (a worker
restarting, or a group's session timing a dead one out, takes some of this)."""


def serving_gate(count: int | None, candidate: str, gone_s: float | None = None) -> GateResult:
    """The ``serving`` gate for ``count`` workers of ``candidate`` in its group (None: unknown) that has
    had none for ``gone_s`` (None: not known how long, as ``sluice rollout status`` sees it)."""
    if count is None:
        return GateResult(gate="serving", state="insufficient_data", detail="its workers' group is unknown")
    if count > 0:
        return GateResult(gate="serving", state="pass", candidate=float(count), detail=f"{count} worker(s)")
    if gone_s is None:
        return GateResult(
            gate="serving", state="insufficient_data", candidate=0.0, detail=f"no worker of {candidate} now"
        )
    detail = f"no worker of {candidate} for {gone_s:.0f}s"
    if gone_s < SERVING_GRACE_S:
        return GateResult(gate="serving", state="insufficient_data", candidate=0.0, detail=detail)
    return GateResult(
        gate="serving",
        state="fail",
        candidate=0.0,
        limit=SERVING_GRACE_S,
        detail=f"{detail}: its share of the traffic goes unanswered",
    )


Places = Mapping[str, Position]
"""Event id -> where it is on the control topic (an event not in it: taken as after everything known)."""
NOWHERE: Places = MappingProxyType({})


def reapply(decision: DeploymentChanged, over: DeploymentChanged, now: datetime) -> DeploymentChanged:
    """``decision`` (an operator's) published again after ``over`` (the controller's decision that landed
    after it on the log, derived from the deployment before it), so the log ends with the operator's."""
    return msgspec.structs.replace(
        decision,
        **_decision(decision, after(over, now), decision.evidence, "controller"),
        reason=(
            f"the {decision.actor}'s {decision.action} again: the controller's {over.action} was derived "
            f"from the deployment before it ({decision.reason})"
        ),
    )


class RolloutController:
    """Evaluates the canaries after sink batches and publishes the decisions (see the module docstring)."""

    def __init__(
        self,
        read: Reader,
        publish: Publisher,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], datetime] = utc_now,
        monotonic: Callable[[], float] | None = None,
        drift_alpha: float = 0.01,
        drift_null_tolerance: float = 0.2,
        fast_windows: frozenset[str] = FAST_WINDOWS,
        members: Members | None = None,
        may_decide: Callable[[], bool] = lambda: True,
    ) -> None:
        """``members``: the ``serving`` gate's count of the candidate's workers (no such gate without it).
        ``may_decide``: whether this controller may publish now (the streams worker: while its sink owns
        the control topic's partition, so that two of them never both decide)."""
        import time

        self._fast_windows = fast_windows
        self._members = members
        self._may_decide = may_decide
        self._unserved: dict[str, float] = {}
        """model -> since when (monotonic) its canary's candidate has had no worker in its group."""
        self._read = read
        self._publish = publish
        self._interval_s = interval_s
        self._drift_alpha, self._drift_null_tolerance = drift_alpha, drift_null_tolerance
        self._drift_judged: dict[str, tuple[str, GateResult]] = {}
        """model -> the deployment (step) whose drift gate was tested, and its verdict: one test a step."""
        self._clock = clock
        self._monotonic = monotonic or time.monotonic
        self._started: dict[str, tuple[str, datetime]] = {}
        """model -> (deployment id, when its step started on this controller's clock): when the controller
        followed it, or its ``step_started`` when seeded from the log at start. A decision carries the
        clock of whoever made it: an operator's 15 minutes behind rolled a warming rollout back at the first
        look, and one an hour behind (its time then only just after the previous decision's) let a promoted
        step advance at once on the previous step's requests (an audit)."""
        self._latest: dict[str, tuple[DeploymentChanged, Position | None]] = {}
        """model -> its latest deployment (the log's, or this controller's own decision) and where it is
        on the control topic (None: not known)."""
        self._mine: dict[str, tuple[DeploymentChanged, Position | None, Position]] = {}
        """model -> this controller's last decision, where the deployment it came from was, where it is."""
        self._publishing: dict[str, list[tuple[DeploymentChanged, Position | None]]] = {}
        """model -> the deployments read while this controller's decision on it is being published: the
        sink can bring that decision back, and an operator's placed just before it, before the delivery
        report comes (a slow ack); they are checked in log order once it has (a review: an abort read
        then was taken for a later deployment than the controller's, and the step undid it for good)."""
        self._unread: dict[str, list[tuple[Position | None, Position]]] = {}
        """model -> (where the deployment it came from was, where it is) for each decision of this
        controller that the sink has not brought back yet, oldest first. None of them was derived from an
        operator's deployment placed after the first one's source: when the controller decides twice before
        the sink brings an abort back, the abort sits after the first decision's source but before the
        second's, and the last decision's source alone would miss it."""
        self._outranked: dict[str, DeploymentChanged] = {}
        """model -> an operator's decision that a decision of this controller landed after (published
        again at the next evaluation)."""
        self._burning: dict[str, dict[tuple[str, str], BurnRateCrossed]] = {}
        """model -> (SLO, window pair) -> its fast burn while it fires: a crossing of another pair (the
        slow one resolving) says nothing of this one's."""
        self._ready: OrderedDict[tuple[str, str], WorkerReady] = OrderedDict()
        """(deployment id, version) -> a worker's announcement that it is ready (at most
        ``READY_REMEMBERED``): a warming rollout takes its first step once its own candidate's is here."""
        self._due: set[str] = set()
        self._last_run = -math.inf
        self._running = asyncio.Lock()
        """One evaluation at a time: the sink and the timer both call :meth:`run_due`, and two evaluations
        of one step would both publish its decision (the step promoted twice)."""
        self.last_results: dict[str, list[GateResult]] = {}
        """model -> the gates of its last evaluation (for metrics and debugging)."""

    @property
    def deployments(self) -> Mapping[str, DeploymentChanged]:
        """model -> its latest deployment (the log's, or this controller's own decision)."""
        return {model: deployment for model, (deployment, _) in self._latest.items()}

    def _known(self, model: str) -> tuple[DeploymentChanged | None, Position | None]:
        """The model's latest deployment and where it is on the control topic (None: not known)."""
        return self._latest.get(model, (None, None))

    def seed(self, control: Iterable[Event], places: Places = NOWHERE) -> None:
        """The control topic's events, read to its end at start (``places``: where each is): the latest
        deployments, and the workers' readiness announcements (a rollout that was warming resumes there)."""
        events = list(control)
        latest = {e.model: e for e in events if isinstance(e, DeploymentChanged)}
        for deployment in latest.values():
            # Its step is timed from now: when it began on this clock is not in the log (its
            # ``step_started`` is its decider's clock, maybe an operator's an hour off). An audit: a
            # restart took an operator's step an hour behind for an hour old (promoted at once, on the
            # previous step's requests too), one an hour ahead for not yet begun (an hour of no samples
            # and no burn seen), and rolled a warming rollout started 15 min behind back at once.
            self._follow(deployment, places.get(deployment.id), counted=False)
        for event in events:
            if isinstance(event, WorkerReady):
                self._remember_ready(event)
            elif isinstance(event, BurnRateCrossed):
                self._note_burn(event)  # still firing: it is not announced again while it goes on
        self._due |= {m for m, (d, _) in self._latest.items() if in_progress(d)}

    def _remember_ready(self, event: WorkerReady) -> None:
        if event.deployment:
            key = (event.deployment, event.version)
            self._ready[key] = event
            self._ready.move_to_end(key)
            while len(self._ready) > READY_REMEMBERED:
                self._ready.popitem(last=False)

    def _follow(
        self,
        event: DeploymentChanged,
        at: Position | None,
        *,
        read: bool = True,
        started: datetime | None = None,
        counted: bool = True,
    ) -> None:
        """``event`` is the model's latest deployment unless the log has it before the one known
        (``read``: it was read from the log, not just published by this controller; ``started``: when its
        step started, if not now; ``counted``: a decision taken now, counted in
        ``sluice_rollout_decisions_total``, not one the log had at start, counted when it was taken)."""
        known, known_at = self._known(event.model)
        if read:
            publishing = self._publishing.get(event.model)
            if publishing is not None:
                publishing.append((event, at))
            else:
                self._check_outranked(event, at)
        if at is not None and known_at is not None and at <= known_at:
            return  # earlier in the log (redelivered, or raced by a later decision): the state is past it
        if known is None or known.id != event.id:
            # The series the rollback alert watches exists from the model's first deployment on, at 0:
            # Prometheus' increase() sees nothing in a series born at 1 (an audit: a model's first
            # automatic rollback never fired SluiceRolloutRolledBack), nor in a restart's re-count.
            metrics.ROLLOUT_DECISIONS.labels(event.model, "rollback", "controller")
            if counted:
                metrics.ROLLOUT_DECISIONS.labels(event.model, event.action, event.actor or "operator").inc()
        if self._started.get(event.model, ("", None))[0] != event.id:
            self._started[event.model] = (event.id, started or self._clock())
        self._latest[event.model] = (event, at)
        if event.phase != "canary":
            self._unserved.pop(event.model, None)
        versions = set(event.traffic) | ({known.stable, *known.traffic} if known is not None else set())
        for version in versions:
            metrics.ROLLOUT_TRAFFIC_SHARE.labels(event.model, version).set(event.traffic.get(version, 0.0))

    def _check_outranked(self, event: DeploymentChanged, at: Position | None) -> None:
        """Whether ``event`` is an operator's decision that this controller's decisions landed after
        (placed after the deployment the earliest of them the sink has not brought back yet was derived
        from, and before the last): it is published again at the next evaluation."""
        model = event.model
        mine = self._mine.get(model)
        if mine is None:
            return
        decision, source, placed = mine
        unread = self._unread.get(model, [])
        if event.id == decision.id:
            unread.clear()  # its last decision is back: the sink has brought everything before it
            return
        if at is None or at > placed:
            self._outranked.pop(model, None)  # a later deployment than the controller's: it stands
            del self._mine[model]
            self._unread.pop(model, None)
            return
        since = unread[0][0] if unread else source
        while unread and unread[0][1] <= at:
            unread.pop(0)  # the sink is past that decision: what came before it has been checked
        if event.actor == "operator" and (since is None or at > since):
            self._outranked[model] = event
            self._due.add(model)
            log.warning(
                "rollout %s: the operator's %s (%s) came before the controller's %s on the log; "
                "publishing the operator's again",
                model,
                event.action,
                event.id,
                decision.action,
            )

    def observe(self, events: Iterable[Event], places: Places = NOWHERE) -> None:
        """A sink batch's events (``places``: where each is on the control topic): deployments are
        followed; outcomes and burns make their model due."""
        for event in events:
            if isinstance(event, DeploymentChanged):
                self._follow(event, places.get(event.id))
                self._due.add(event.model)
            elif isinstance(event, RequestFinished) and self._canary(event.model):
                self._due.add(event.model)
            elif isinstance(event, WorkerReady):
                self._remember_ready(event)
                self._due.add(event.model)
            elif isinstance(event, BurnRateCrossed):
                self._note_burn(event)  # whatever the phase: a burn goes on until it is resolved
                if self._canary(event.model):
                    self._due.add(event.model)

    def _note_burn(self, event: BurnRateCrossed) -> None:
        pair = (event.slo, event.window)
        if event.firing and event.window in self._fast_windows:
            self._burning.setdefault(event.model, {})[pair] = event
        elif not event.firing:
            self._burning.get(event.model, {}).pop(pair, None)

    def _canary(self, model: str) -> bool:
        deployment, _ = self._known(model)
        return deployment is not None and deployment.phase == "canary"

    async def run_due(self) -> list[DeploymentChanged]:
        """Evaluate the models that are due (at most once per interval); publish and return decisions."""
        if self._running.locked():
            return []  # the evaluation in progress will see what is due now, or the next one will
        async with self._running:
            return await self._run_due()

    async def _run_due(self) -> list[DeploymentChanged]:
        if not self._may_decide():
            return []  # another controller decides (what is due stays due, for when this one may again)
        decisions = await self._reapply()  # at once: it reads nothing, and the log is wrong until then
        now_mono = self._monotonic()
        if not self._due or now_mono - self._last_run < self._interval_s:
            return decisions
        self._last_run = now_mono
        due, self._due = self._due, set()
        for model in sorted(due):
            try:
                decision = await self._judge(model)
            except Exception:  # one model's deployment this cannot judge must not cost the others theirs
                log.exception("rollout: judging %s failed; trying again", model)
                self._due.add(model)
                continue
            if decision is not None:
                decisions.append(decision)
        return decisions

    async def _judge(self, model: str) -> DeploymentChanged | None:
        """The decision on ``model``'s deployment in progress, published; None when there is none (or it
        could not be published, or must wait: due again)."""
        current, _ = self._known(model)
        if current is None or not in_progress(current):
            return None
        current = self._as_started(current)
        if current.phase == "warming":
            ready = self._ready.get((current.id, current.candidate or ""))
            decision = warm(current, ready, self._clock())
            if decision is None:
                self._due.add(model)  # still loading: the timer looks again (the ready timeout)
                return None
            return decision if await self._act(model, decision) else None
        try:
            results = await self.evaluate(current)
        except Exception:
            log.exception("rollout: evaluating %s failed; trying again", model)
            self._due.add(model)
            return None
        serving = await self._serving(current)
        if serving is not None:
            results = [*results, serving]
            if serving.state != "pass":
                self._due.add(model)  # no worker: the timer looks again, outcomes or not
        self.last_results[model] = results
        for result in results:
            for state in GATE_STATES:
                metrics.ROLLOUT_GATE_STATE.labels(model, result.gate, state).set(state == result.state)
        latest, _ = self._known(model)
        if latest is None or latest.id != current.id:
            self._due.add(model)  # an operator's change arrived meanwhile: judge that one instead
            return None
        now = self._clock()
        decision = decide(current, results, now)
        gates = current.gates or RolloutGates()
        if decision is None and (gates.step_max_s > 0 or step_age(current, now) < gates.step_min_s):
            # the timer looks again: the step's deadline, or the end of its minimum, passes with no
            # outcome too (a step whose gates passed while it was young advances once it is old enough,
            # traffic or not)
            self._due.add(model)
        return decision if decision is not None and await self._act(model, decision) else None

    async def _serving(self, current: DeploymentChanged) -> GateResult | None:
        """The ``serving`` gate: the candidate has a worker in its group, or has had none for less than
        :data:`SERVING_GRACE_S` (``insufficient_data`` meanwhile: the step does not advance). An audit: a
        candidate whose only worker stopped was promoted on the samples of its step's first seconds (its
        share of requests, never answered, made no rows to judge), and every request after it timed out."""
        if self._members is None:
            return None
        model, candidate = current.model, current.candidate or current.version
        try:
            count = await self._members(model, candidate)
        except Exception:
            log.exception("rollout: counting the workers of %s %s failed", model, candidate)
            count = None
        if count == 0:
            return serving_gate(
                0, candidate, self._monotonic() - self._unserved.setdefault(model, self._monotonic())
            )
        if count is not None:
            self._unserved.pop(model, None)
        return serving_gate(count, candidate)

    def _as_started(self, current: DeploymentChanged) -> DeploymentChanged:
        """``current`` with its step started when this controller saw it start (``_started``)."""
        known_id, started = self._started.get(current.model, ("", None))
        if known_id != current.id or started is None or started == current.step_started:
            return current
        return msgspec.structs.replace(current, step_started=started)

    async def _reapply(self) -> list[DeploymentChanged]:
        """Publish again each operator's decision that one of this controller's landed after."""
        decisions: list[DeploymentChanged] = []
        for model, outranked in list(self._outranked.items()):
            del self._outranked[model]
            current, _ = self._known(model)
            if current is None:
                continue
            again = reapply(outranked, current, self._clock())
            if await self._act(model, again):
                decisions.append(again)
            elif model not in self._outranked:
                self._outranked[model] = outranked  # the publish failed: the next run tries again
        return decisions

    async def _act(self, model: str, decision: DeploymentChanged) -> bool:
        """Publish ``decision`` (durable before the state moves); False when that failed (due again)."""
        if not self._may_decide():
            # the control partition went to another streams worker while this one evaluated (the
            # warehouse, the drift test): that one decides now, from the same deployment (a review: both
            # published their step)
            self._due.add(model)
            return False
        _, source = self._known(model)
        read = self._publishing[model] = []
        try:
            placed = await self._publish(decision)
        except Exception:
            log.exception("rollout: publishing the decision for %s failed; trying again", model)
            self._due.add(model)
            for event, at in read:
                self._check_outranked(event, at)
            return False
        finally:
            del self._publishing[model]
        self._mine[model] = (decision, source, placed)
        self._unread.setdefault(model, []).append((source, placed))
        for event, at in sorted(read, key=lambda r: (r[1] is None, r[1] or (0, 0))):
            self._check_outranked(event, at)  # followed while this was published, in log order
        self._follow(decision, placed, read=False)
        # a rollback is what an operator must look at; a step or a promotion is the rollout going well
        level = logging.WARNING if decision.action == "rollback" else logging.INFO
        log.log(level, "rollout %s: %s", model, decision.reason)
        return True

    async def evaluate(self, current: DeploymentChanged) -> list[GateResult]:
        """The gates of ``current``'s step, from the warehouse."""
        # The latest fast burn still firing, whenever it began: a burn is announced once, when it crosses,
        # so one that began in an earlier step (or before the rollout, or was read just after a step was
        # taken) and goes on was never seen again (a review: a candidate failing 5x the stable version's
        # ratio under a firing page was promoted). The blame rule judges whose it is on this step's numbers.
        burn = max(self._burning.get(current.model, {}).values(), key=lambda b: b.time, default=None)
        return await step_gates(
            self._read,
            current,
            self._clock(),
            burn=burn,
            drift_alpha=self._drift_alpha,
            drift_null_tolerance=self._drift_null_tolerance,
            judged=self._drift_judged,
        )


async def step_gates(
    read: Reader,
    current: DeploymentChanged,
    now: datetime,
    *,
    burn: BurnRateCrossed | None = None,
    drift_alpha: float,
    drift_null_tolerance: float,
    judged: dict[str, tuple[str, GateResult]] | None = None,
) -> list[GateResult]:
    """Every gate of ``current``'s step as the controller judges it at ``now``, from the warehouse. The
    drift gate runs its one test of the step only when the others would let the step advance; ``judged``
    (model -> the deployment it judged, and its verdict) keeps that verdict, so that a decision whose
    publish failed is decided again on the same test, not on a second look at a larger sample."""
    candidate = current.candidate or current.version
    since = current.step_started or current.time
    gates = current.gates or RolloutGates()
    stats = parse_stats(await read(stats_sql(current.model, (current.stable, candidate), since)))
    results = judge(
        gates, stats.get(candidate, VersionStats()), stats.get(current.stable, VersionStats()), burn=burn
    )
    # without shadow copies there is nothing to wait for: the gate says so from the step's first look
    no_pairs = current.shadow <= 0
    if gates.drift and (no_pairs or (current.phase == "canary" and ripe(current, results, now, but="drift"))):
        kept = (judged or {}).get(current.model)
        drift = (
            kept[1]
            if kept is not None and kept[0] == current.id
            else await drift_gate(
                read,
                model=current.model,
                stable=current.stable,
                candidate=candidate,
                since=since,
                shadow=current.shadow,
                embeddings=any(r.detail == EMBEDDING_LATENCY for r in results),
                min_requests=gates.min_requests,
                alpha=drift_alpha,
                null_tolerance=drift_null_tolerance,
                min_cosine=gates.min_cosine,
            )
        )
        if judged is not None and drift.state in ("pass", "fail"):
            judged[current.model] = (current.id, drift)  # the same verdict again when it was kept
        results = [drift if r.gate == "drift" else r for r in results]
    return results
