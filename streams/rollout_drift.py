"""The rollout's drift gate: does the candidate answer the same requests as the stable version does?

A version's own drift reports (:mod:`streams.drift`) compare its windows with its own first one: they see a
version change, not a version that is different from the start. The gate compares the two versions on the
same requests instead, so a candidate that answers with empty outputs, refusals or another script from its
first request fails, and a change in what clients send (both versions see it) does not.

**Shadow pairs.** A shadow copy (``--shadow``) is a request the stable version served, run again on the
candidate: the pair has the same input, so any difference between the two answers is the candidate's. The
gate takes the step's pairs whose two sides both completed (the rows with the smallest hash of the
original's id, at most :data:`MAX_ROWS`) and compares the two sides' output features. Pairs, not the two
versions' live traffic, because sticky routing sends whole sessions to one side: sessions differ in
workload, so two live samples differ even when the versions answer alike (matching by tenant does not fix
that, and rows of one session are not independent). And pairs whose two sides both finished, so a version
that is slower on long answers does not look "shorter" because its long answers are still running at the
look: both sides lose the same requests. A rollout without shadow copies has no pairs: the gate is
``not_applicable`` and says so (``sluice rollout start`` warns).

**Outputs only, completed only.** The gate tests the output features (:data:`OUTPUT_FEATURES`) with the
drift evaluator's tests (:func:`drift.evaluate.evaluate`: KS, chi-square homogeneity, Bonferroni at the
drift alpha). Failures and expiries are the error gate's (with its ``max_error_delta``, and a shadow copy
that expired at its low priority is not the candidate's fault): the gate never sees them.

**Embeddings: the vectors of each pair.** An embeddings model's answer is a vector, and a candidate is a
drop-in replacement only if it puts the same input where the stable version does (an index built from the
stable version's vectors must still find it). So each pair's two vectors (of the first input) are compared
directly, no distribution test: the cosine of each pair, and at most :data:`DISAGREE_SHARE` of the pairs
may fall below the gates' ``min_cosine`` (0.99: float16 or another kernel stays above 0.999; a retrained
or different model falls far below). Vectors of another dimension fail at once. The vectors are those of
the drift sample (1 in ``SLUICE_DRIFT_SAMPLE``), which a pair shares (:func:`gpu_workers.features.sample_key`).

**One look per step.** Tested again and again as a step's sample grows, a test at alpha would raise false
alarms far more often than alpha. The controller judges drift only once every other gate passes and the
step has lasted ``step_min_s`` (:func:`streams.rollout.decide` would advance it): a pass then advances the
step at once and a fail rolls back, so each step runs one test with enough data. Until then the gate is
``insufficient_data``. It needs ``min_requests`` pairs, as the other gates need requests.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

from schemas.events import FeatureDrift, GateResult
from streams.queries import sql_string

log = logging.getLogger(__name__)

OUTPUT_FEATURES = (
    "completion_tokens", "output_chars", "mean_logprob", "mean_entropy", "output_script", "finish_reason",
    "empty_output", "refusal",
)  # fmt: skip
"""The drift features the answer determines (see :class:`schemas.events.DriftFeatures`); the status is the
error gate's."""
CATEGORICAL = ("output_script", "finish_reason", "empty_output", "refusal")
MAX_ROWS = 1000
"""Pairs at most (the evaluator's own cap per side, :data:`drift.evaluate.MAX_ROWS`)."""
NOT_YET = "judged once every other gate passes and the step has lasted step_min_s (one test per step)"
NO_SHADOW = "compares the candidate's shadow copies with their originals: this step has no shadow (--shadow)"
DISAGREE_SHARE = 0.05
"""An embeddings candidate passes when at most this share of its shadow pairs is below ``min_cosine``."""

Reader = Callable[[str], Awaitable[list[dict[str, Any]]]]


def _step(model: str, since: datetime) -> str:
    since_ms = int(since.timestamp() * 1000)
    # not after now: a few events dated in the future (a wrong clock, or hostile) were in every step
    return (
        f"model = {sql_string(model)} AND accepted >= fromUnixTimestamp64Milli({since_ms}, 'UTC') "
        "AND accepted <= now64(3)"
    )


def _facts(model: str, version: str, since: datetime, *, shadow: bool, vectors: bool = False) -> str:
    """The version's completed requests of the step (its shadow copies, or the clients' own) whose drift
    features were measured (a pair with one side unmeasured says nothing of the answers); ``vectors``: and
    whose features carry a vector."""
    step = _step(model, since)
    measured = "notEmpty(embedding)" if vectors else "has_features"
    return f"""SELECT request_id{", shadow_of" if shadow else ""} FROM request_facts FINAL
        WHERE {step} AND model_version = {sql_string(version)}
            AND shadow_of {"!=" if shadow else "="} '' AND status = 'completed'
            AND request_id IN (SELECT request_id FROM drift_features FINAL WHERE {step} AND {measured})"""  # noqa: S608


def _pairs(model: str, stable: str, candidate: str, since: datetime, *, vectors: bool = False) -> str:
    """(request_id, shadow_of) of the candidate's side of the step's pairs that both completed, the
    :data:`MAX_ROWS` with the smallest hash of the original's id."""
    return f"""SELECT request_id, shadow_of FROM (
            {_facts(model, candidate, since, shadow=True, vectors=vectors)}
        ) WHERE shadow_of IN ({_facts(model, stable, since, shadow=False, vectors=vectors)})
        ORDER BY cityHash64(shadow_of), shadow_of LIMIT {MAX_ROWS}"""  # noqa: S608


def pairs_sql(model: str, stable: str, candidate: str, since: datetime) -> str:
    """The step's shadow pairs (copy on the candidate, original on the stable version) that both completed;
    each row is one side's answer."""
    columns = ", ".join(OUTPUT_FEATURES)
    return f"""SELECT request_id, model_version, kind, {columns} FROM drift_features FINAL
WHERE model = {sql_string(model)} AND request_id IN (
    SELECT arrayJoin([request_id, shadow_of]) FROM ({_pairs(model, stable, candidate, since)})
)"""  # noqa: S608 (quoted literals and integers only)


def vector_pairs_sql(model: str, stable: str, candidate: str, since: datetime) -> str:
    """The step's shadow pairs whose two sides completed with a vector: a row per side, ``original`` naming
    the pair (the original's id), ``embedding`` that side's vector of the first input."""
    return f"""SELECT sides.original AS original, f.model_version AS model_version, f.embedding AS embedding
FROM (
    SELECT request_id, model_version, embedding FROM drift_features FINAL
    WHERE {_step(model, since)} AND notEmpty(embedding)
) AS f
INNER JOIN (
    SELECT tupleElement(side, 1) AS request_id, tupleElement(side, 2) AS original FROM (
        SELECT arrayJoin([(request_id, shadow_of), (shadow_of, shadow_of)]) AS side
        FROM ({_pairs(model, stable, candidate, since, vectors=True)})
    )
) AS sides ON f.request_id = sides.request_id"""  # noqa: S608 (quoted literals and integers only)


def judge_drift(
    rows: Sequence[Mapping[str, Any]],
    *,
    stable: str,
    candidate: str,
    min_requests: int,
    alpha: float,
    null_tolerance: float,
) -> GateResult:
    """The gate on the answers of shadow pairs (blocking: the evaluator runs here)."""
    import pandas as pd

    from drift.evaluate import DriftConfig, evaluate

    columns = ["model_version", "kind", *OUTPUT_FEATURES]
    frame = pd.DataFrame(list(rows), columns=columns)
    for name in CATEGORICAL:  # an answer with no letters has no script: "none" is a category of its own,
        frame[name] = frame[name].astype(object).where(frame[name].notna(), "none")  # tested, not a finding
    ours, theirs = (frame[frame["model_version"] == v][list(OUTPUT_FEATURES)] for v in (candidate, stable))
    sizes = {"candidate_n": len(ours), "baseline_n": len(theirs)}
    pairs = min(len(ours), len(theirs))
    needed = max(min_requests, 2)  # a two-sample test needs two of each, whatever --min-requests allows
    if pairs < needed:
        detail = f"{pairs} shadow pairs that both completed, {needed} needed"
        return GateResult(gate="drift", state="insufficient_data", detail=detail, **sizes)
    empty = _no_embeddings()
    config = DriftConfig(alpha=alpha, min_samples=needed, null_tolerance=null_tolerance)
    result = evaluate(theirs, ours, empty, empty, config)
    if result.quality:  # a numerical feature one side measures less often (an engine without logprobs)
        detail = f"answers not measured as the stable version's: {'; '.join(result.quality)} ({pairs} pairs)"
        return GateResult(gate="drift", state="fail", detail=detail, **sizes)
    drifted = [f for f in result.features if f.drifted]
    # each test's numbers in the evidence (an audit: a decision said which features differed, not by how
    # much, nor at which level, and the level is a streams setting that may change before anyone asks)
    level = f"alpha {alpha:g} over {len(result.features)} features"
    if drifted:
        detail = f"answers to the same requests differ in {_tests(drifted)} ({pairs} shadow pairs; {level})"
        return GateResult(gate="drift", state="fail", detail=detail, limit=alpha, **sizes)
    tested = _tests(result.features) or "no feature measured on both"
    return GateResult(
        gate="drift",
        state="pass",
        detail=f"answers alike ({pairs} shadow pairs; tested {tested}; {level})",
        limit=alpha,
        **sizes,
    )


def _tests(features: Sequence[FeatureDrift]) -> str:
    """Each test as ``name (method p=... < threshold)``, or its statistic against its threshold."""

    def one(f: FeatureDrift) -> str:
        if f.p_value is not None:
            return f"{f.name} ({f.method} p={f.p_value:.3g} {'<' if f.drifted else '>='} {f.threshold:.3g})"
        return f"{f.name} ({f.method} {f.statistic:.3g} {'>' if f.drifted else '<='} {f.threshold:.3g})"

    return ", ".join(one(f) for f in features)


def judge_vectors(
    rows: Sequence[Mapping[str, Any]], *, stable: str, candidate: str, min_requests: int, min_cosine: float
) -> GateResult:
    """An embeddings candidate's gate: each shadow pair's cosine between the candidate's vector and the
    stable version's for the same input; at most :data:`DISAGREE_SHARE` of the pairs below ``min_cosine``."""
    import numpy as np

    sides: dict[str, dict[str, Sequence[float]]] = {}
    for row in rows:
        sides.setdefault(row["original"], {})[row["model_version"]] = row["embedding"]
    pairs = [(two[candidate], two[stable]) for two in sides.values() if candidate in two and stable in two]
    sizes = {"candidate_n": len(pairs), "baseline_n": len(pairs)}
    if len(pairs) < min_requests:
        detail = (
            f"{len(pairs)} shadow pairs that both completed with a vector, {min_requests} needed "
            "(1 in SLUICE_DRIFT_SAMPLE pairs carries them; with 0 none does: --no-drift-gate)"
        )
        return GateResult(gate="drift", state="insufficient_data", detail=detail, **sizes)
    dims = {(len(ours), len(theirs)) for ours, theirs in pairs}
    if any(a != b for a, b in dims):
        ours_dim, theirs_dim = next((a, b) for a, b in sorted(dims) if a != b)
        detail = f"vectors of {ours_dim} dimensions where the stable version's have {theirs_dim} ({len(pairs)} shadow pairs)"
        return GateResult(gate="drift", state="fail", limit=min_cosine, detail=detail, **sizes)
    cosines = np.array([_cosine(np.asarray(a), np.asarray(b)) for a, b in pairs])
    # A vector with NaN or inf has no direction: the lowest cosine there is, never alike (and a finite
    # number on the event).
    cosines = np.sort(np.where(np.isfinite(cosines), cosines, -1.0))
    allowed = int(DISAGREE_SHARE * len(pairs))
    below = int((cosines < min_cosine).sum())
    tail = float(cosines[allowed])  # the lowest cosine once the allowed share is set aside (p05)
    shape = (
        f"cosine median {float(np.median(cosines)):.4f}, p05 {tail:.4f}, min {float(cosines[0]):.4f}; "
        f"{below} of {len(pairs)} shadow pairs below {min_cosine:g}"
    )
    differ = below > allowed
    return GateResult(
        gate="drift",
        state="fail" if differ else "pass",
        candidate=round(tail, 6),
        limit=min_cosine,
        detail=f"vectors for the same inputs differ ({shape}, at most {allowed} may be)"
        if differ
        else f"vectors alike ({shape})",
        **sizes,
    )


def _cosine(a: Any, b: Any) -> float:
    """Cosine of two vectors; 1 when both are zero, 0 when one is."""
    import numpy as np

    norms = float(np.linalg.norm(a)) * float(np.linalg.norm(b))
    if norms == 0.0:
        return 1.0 if not a.any() and not b.any() else 0.0
    return float(np.dot(a, b)) / norms


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
    shadow: float,
    embeddings: bool,
    min_requests: int,
    alpha: float,
    null_tolerance: float,
    min_cosine: float,
) -> GateResult:
    """Read the step's shadow pairs and judge them (on a thread: the evaluator blocks). ``shadow``: the
    step's shadow share; ``embeddings``: the model serves embeddings (its pairs' vectors are compared)."""
    if shadow <= 0:
        return GateResult(gate="drift", state="not_applicable", detail=NO_SHADOW)
    judge: Callable[..., GateResult]
    if embeddings:
        sql = vector_pairs_sql(model, stable, candidate, since)
        judge = functools.partial(judge_vectors, min_cosine=min_cosine)
    else:
        sql = pairs_sql(model, stable, candidate, since)
        judge = functools.partial(judge_drift, alpha=alpha, null_tolerance=null_tolerance)
    rows = await read(sql)
    # At most MAX_ROWS pairs are read: a step asking for more (--min-requests 1001) waited for ever (an audit).
    needed = min(min_requests, MAX_ROWS)
    return await asyncio.to_thread(judge, rows, stable=stable, candidate=candidate, min_requests=needed)
