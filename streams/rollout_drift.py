"""The rollout's drift gate: do the candidate's outputs look like the stable version's, over the same step?

A version's own drift reports (:mod:`streams.drift`) compare its windows with its own first one: they see a
version change, not a version that is different from the start. The gate compares the two versions over
the same period instead, so a candidate that answers with empty outputs, refusals or another script from
its first request fails, and a change in what clients send (both versions see it) does not.

**Same requests, or the same tenants.** Sticky routing gives the candidate a share of routing keys (tenant
and session), so the two versions' traffic mixes differ, and a tenant with long prompts would make the
version serving it look "drifted". The comparison is therefore matched by tenant: for each tenant both
versions served in the step, the same number of requests from each (``min`` of the two counts, the rows
with the smallest hash of their request id, scaled down together past :data:`MAX_ROWS`). Shadow copies
(``--shadow``) carry their original's tenant, so a shadowed step always has matched pairs; without them,
tenants whose requests are all on one side (no ``X-Session-Id``) are left out, and the gate says so.

**Outputs only.** The inputs are the clients' (matched above, and still not the candidate's doing): the
gate tests the output features (:data:`OUTPUT_FEATURES`) with the drift evaluator's tests
(:func:`drift.evaluate.evaluate`: KS, chi-square homogeneity, Bonferroni at the drift alpha). An
embeddings model has no output feature beyond its status (which the error gate judges): ``not_applicable``.

**One look per step.** Tested again and again as a step's sample grows, a test at alpha would raise false
alarms far more often than alpha. The controller judges drift only once every other gate passes and the
step has lasted ``step_min_s`` (:func:`streams.rollout.decide` would advance it): a pass then advances the
step at once and a fail rolls back, so each step runs one test with enough data. Until then the gate is
``insufficient_data``. It needs ``min_requests`` matched requests per version, like the other gates.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from schemas.events import GateResult
from streams.queries import sql_string

log = logging.getLogger(__name__)

OUTPUT_FEATURES = (
    "completion_tokens", "output_chars", "mean_logprob", "mean_entropy", "output_script", "finish_reason",
    "status", "empty_output", "refusal",
)  # fmt: skip
"""The drift features the candidate's own answers determine (see :class:`schemas.events.DriftFeatures`)."""
MAX_ROWS = 1000
"""Matched requests per version at most (the evaluator's own cap, :data:`drift.evaluate.MAX_ROWS`)."""
NOT_YET = "judged once every other gate passes and the step has lasted step_min_s (one test per step)"

Reader = Callable[[str], Awaitable[list[dict[str, Any]]]]


def _step(model: str, versions: Sequence[str], since: datetime) -> str:
    listed = ", ".join(sql_string(v) for v in versions)
    return (
        f"model = {sql_string(model)} AND model_version IN ({listed})"
        f" AND accepted >= fromUnixTimestamp64Milli({int(since.timestamp() * 1000)}, 'UTC')"
    )


def mix_sql(model: str, stable: str, candidate: str, since: datetime) -> str:
    """Per tenant both versions served in the step: how many requests each (the busiest pairs first)."""
    return f"""SELECT tenant, countIf(model_version = {sql_string(candidate)}) AS candidate,
    countIf(model_version = {sql_string(stable)}) AS stable
FROM drift_features FINAL
WHERE {_step(model, (stable, candidate), since)}
GROUP BY tenant HAVING candidate > 0 AND stable > 0
ORDER BY least(candidate, stable) DESC, tenant LIMIT {MAX_ROWS}"""  # noqa: S608 (quoted literals, integers)


def quotas(mix: Sequence[Mapping[str, Any]], total: int = MAX_ROWS) -> dict[str, int]:
    """Requests per tenant on each side: the smaller side's count, scaled so that they add up to about
    ``total`` (every tenant keeps at least one)."""
    matched = {str(r["tenant"]): min(int(r["candidate"]), int(r["stable"])) for r in mix}
    whole = sum(matched.values())
    if whole <= total:
        return matched
    return {tenant: max(1, n * total // whole) for tenant, n in matched.items()}


def sample_sql(model: str, stable: str, candidate: str, since: datetime, quota: Mapping[str, int]) -> str:
    """Each version's matched sample: per tenant, its ``quota`` requests with the smallest id hash."""
    tenants = sorted(quota)
    names = ", ".join(sql_string(t) for t in tenants)
    counts = ", ".join(str(int(quota[t])) for t in tenants)
    columns = ", ".join(OUTPUT_FEATURES)
    return f"""SELECT model_version, kind, {columns} FROM (
    SELECT model_version, tenant, kind, {columns}, row_number() OVER (
        PARTITION BY tenant, model_version ORDER BY cityHash64(request_id), request_id) AS rank
    FROM drift_features FINAL
    WHERE {_step(model, (stable, candidate), since)} AND tenant IN ({names})
) WHERE rank <= transform(tenant, [{names}], CAST([{counts}], 'Array(UInt64)'), toUInt64(0))"""  # noqa: S608


def judge_drift(
    rows: Sequence[Mapping[str, Any]],
    *,
    stable: str,
    candidate: str,
    tenants: int,
    min_requests: int,
    alpha: float,
    null_tolerance: float,
) -> GateResult:
    """The gate on a matched sample (blocking: the evaluator runs here). ``tenants``: how many tenants both
    versions served in the step."""
    import pandas as pd

    from drift.evaluate import DriftConfig, evaluate

    columns = ["model_version", "kind", *OUTPUT_FEATURES]
    frame = pd.DataFrame(list(rows), columns=columns)
    ours, theirs = (frame[frame["model_version"] == v][list(OUTPUT_FEATURES)] for v in (candidate, stable))
    sizes = {"candidate_n": len(ours), "baseline_n": len(theirs)}
    if len(frame) and (frame["kind"] == "embedding").all():
        detail = "embeddings: no output feature beyond the status, which the error gate judges"
        return GateResult(gate="drift", state="not_applicable", detail=detail, **sizes)
    matched = f"{len(ours)} requests per version of {tenants} tenant{'s' * (tenants != 1)} both served"
    if min(len(ours), len(theirs)) < min_requests:
        hint = "" if tenants else "; no tenant was served by both: shadow (--shadow) or send X-Session-Id"
        detail = f"{matched}, {min_requests} needed{hint}"
        return GateResult(gate="drift", state="insufficient_data", detail=detail, **sizes)
    empty = _no_embeddings()
    config = DriftConfig(alpha=alpha, min_samples=min_requests, null_tolerance=null_tolerance)
    result = evaluate(theirs, ours, empty, empty, config)
    if result.verdict == "data_quality":
        detail = f"outputs not measured as the stable version's: {'; '.join(result.quality)}"
        return GateResult(gate="drift", state="fail", detail=detail, **sizes)
    drifted = [f.name for f in result.features if f.drifted]
    if drifted:
        detail = f"outputs differ from the stable version's in {', '.join(drifted)} ({matched})"
        return GateResult(gate="drift", state="fail", detail=detail, **sizes)
    tested = ", ".join(f.name for f in result.features) or "no feature measured on both"
    detail = f"outputs alike ({matched}; tested {tested})"
    return GateResult(gate="drift", state="pass", detail=detail, **sizes)


def _no_embeddings() -> Any:
    import numpy as np

    return np.zeros((0, 0), dtype=np.float32)


async def drift_gate(
    read: Reader,
    *,
    model: str,
    stable: str,
    candidate: str,
    since: datetime,
    min_requests: int,
    alpha: float,
    null_tolerance: float,
) -> GateResult:
    """Read the step's matched sample and judge it (on a thread: the evaluator blocks)."""
    mix = await read(mix_sql(model, stable, candidate, since))
    quota = quotas(mix)
    rows = await read(sample_sql(model, stable, candidate, since, quota)) if quota else []
    return await asyncio.to_thread(
        judge_drift,
        rows,
        stable=stable,
        candidate=candidate,
        tenants=len(quota),
        min_requests=min_requests,
        alpha=alpha,
        null_tolerance=null_tolerance,
    )
