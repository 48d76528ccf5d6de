"""The rollout's drift gate on real embedded ClickHouse: the candidate's answers to shadow copies against
the stable version's answers to the same requests (:mod:`streams.rollout_drift`)."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec

from gpu_workers.faults import noisy
from infra.warehouse.client import Client
from schemas.events import GateResult, RequestFinished
from streams.rollout_drift import (
    MAX_ROWS,
    NO_SHADOW,
    drift_gate,
    judge_drift,
    judge_vectors,
    pairs_sql,
    vector_pairs_sql,
)
from streams.sink import insert, query_rows
from tests.streams.test_drift import MODEL, T0, finished_event, rows_of, warehouse

STABLE, CANDIDATE = "v1", "v2"
HOSTILE = "x' OR 1=1 --"
Answer = tuple[bool, bool]
"""(long, empty): how a version answers one request."""


def answer(
    i: int, *, version: str, seed: int, long: bool = False, empty: bool = False, tenant: str = "acme",
    shadow_of: str | None = None, status: str = "completed",
) -> RequestFinished:  # fmt: skip
    """Request ``i`` of the step, answered by ``version``: long, empty (a broken candidate) or short."""
    rng = random.Random(seed * 7919 + i)
    event = finished_event(i, T0 + timedelta(seconds=1 + i * 0.01), tenant=tenant, seed=seed)
    assert event.features is not None
    chars = 0 if empty else (300 if long else 30) + rng.randrange(40)
    features = msgspec.structs.replace(
        event.features,
        output_chars=chars,
        empty_output=empty,
        mean_logprob=-0.05 - abs(rng.gauss(0, 0.02)) if empty else -2.0 + rng.gauss(0, 0.2),
    )
    usage = msgspec.structs.replace(event.usage, completion_tokens=1 if empty else chars // 4)
    return msgspec.structs.replace(
        event, model_version=version, features=features, usage=usage, finish_reason="stop",
        shadow_of=shadow_of, status=status,
    )  # fmt: skip


def originals(n: int, *, long: list[bool] | None = None, seed: int = 1, **kw: Any) -> list[RequestFinished]:
    return [answer(i, version=STABLE, seed=seed, long=bool(long and long[i]), **kw) for i in range(n)]


def copies(of: list[RequestFinished], *, seed: int = 2, **kw: Any) -> list[RequestFinished]:
    """The candidate's shadow copies of ``of``, answered as their originals were unless ``kw`` says."""
    made = []
    for i, original in enumerate(of):
        assert original.features is not None
        long = (original.features.output_chars or 0) >= 300
        made.append(answer(i, version=CANDIDATE, seed=seed, long=long, shadow_of=original.request_id, **kw))
    return made


def stored(client: Client, *groups: list[RequestFinished]) -> None:
    insert(client, rows_of([e for group in groups for e in group]))


async def gate(
    client: Client, *, min_requests: int = 40, shadow: float = 0.2, embeddings: bool = False,
    min_cosine: float = 0.99,
) -> GateResult:  # fmt: skip
    async def read(sql: str) -> list[dict[str, Any]]:
        return query_rows(client, sql)

    return await drift_gate(
        read, model=MODEL, stable=STABLE, candidate=CANDIDATE, since=T0, shadow=shadow, embeddings=embeddings,
        min_requests=min_requests, alpha=0.01, null_tolerance=0.2, min_cosine=min_cosine,
    )  # fmt: skip


async def judged(tmp_path: Path, *groups: list[RequestFinished], **gate_kw: Any) -> GateResult:
    """The gate over a warehouse holding ``groups``."""
    with warehouse(tmp_path) as client:
        stored(client, *groups)
        return await gate(client, **gate_kw)


def whole_step(client: Client) -> GateResult:
    """The same test on every completed request of the step, unpaired: what the pairing is for."""
    rows = query_rows(client, "SELECT * FROM drift_features FINAL WHERE status = 'completed'")
    return judge_drift(
        rows, stable=STABLE, candidate=CANDIDATE, min_requests=40, alpha=0.01, null_tolerance=0.2
    )


async def test_a_candidate_bad_from_its_first_request_fails(tmp_path: Path) -> None:
    """Empty answers from the start: its own drift reports would take them as its reference."""
    served = originals(120)
    result = await judged(tmp_path, served, copies(served[:60], empty=True))
    assert result.state == "fail"
    assert (result.candidate_n, result.baseline_n) == (60, 60)
    assert "output_chars" in result.detail
    assert "empty_output" in result.detail
    assert "60 shadow pairs" in result.detail


async def test_sessions_that_differ_on_the_two_sides_do_not_fail_a_good_candidate(tmp_path: Path) -> None:
    """Sticky routing sent the sessions with long answers to the candidate and those with short ones to
    the stable version, which answers its shadowed requests as the candidate does: the pairs pass; the
    two versions' whole traffic would not."""
    served = originals(150)
    live = [answer(i, version=CANDIDATE, seed=3, long=True) for i in range(300)]
    with warehouse(tmp_path) as client:
        stored(client, served, copies(served[:100]), live)
        result = await gate(client)
        unpaired = whole_step(client)
    assert result.state == "pass", result.detail
    assert (result.candidate_n, result.baseline_n) == (100, 100)
    assert "100 shadow pairs" in result.detail
    assert "output_chars" in result.detail
    assert unpaired.state == "fail"
    assert "output_chars" in unpaired.detail


async def test_copies_still_running_at_the_look_do_not_bias_it(tmp_path: Path) -> None:
    """The candidate's copies of long answers have not finished yet: their originals are left out too."""
    served = originals(200, long=[i % 2 == 0 for i in range(200)])
    with warehouse(tmp_path) as client:
        stored(client, served, copies([e for i, e in enumerate(served) if i % 2]))
        result = await gate(client)
        unpaired = whole_step(client)
    assert result.state == "pass", result.detail
    assert (result.candidate_n, result.baseline_n) == (100, 100)
    assert unpaired.state == "fail"


async def test_copies_that_expired_or_failed_are_the_error_gates_not_drift(tmp_path: Path) -> None:
    """A shadow copy waits at the lowest priority: one that expired is not a different answer."""
    served = originals(120)
    made = copies(served)
    ended = [
        msgspec.structs.replace(e, status="expired" if i % 3 == 0 else "failed", features=None)
        if i % 3 != 1 else e
        for i, e in enumerate(made)
    ]  # fmt: skip
    result = await judged(tmp_path, served, ended, min_requests=30)
    assert result.state == "pass", result.detail
    assert result.candidate_n == 40


def letterless(events: list[RequestFinished], every: int) -> list[RequestFinished]:
    """Every ``every``-th answer with no letters (no script measured), by position."""
    made = []
    for i, e in enumerate(events):
        assert e.features is not None
        features = msgspec.structs.replace(e.features, output_script=None) if i % every == 0 else e.features
        made.append(msgspec.structs.replace(e, features=features))
    return made


async def test_answers_without_letters_are_a_category_tested_not_a_finding(tmp_path: Path) -> None:
    """Half the answers of both versions have no script: a missing share that differs by chance at 50 pairs
    used to be a fixed-tolerance "finding" (about 2 % of identical steps failed); it is a category of the
    chi-square, inside Bonferroni. And one version with many more of them is a difference."""
    served = letterless(originals(60), 2)
    alike = await judged(tmp_path / "alike", served, letterless(copies(served), 2))
    assert alike.state == "pass", alike.detail
    served = letterless(originals(400), 5)  # 20 % without letters
    more = await judged(tmp_path / "more", served, letterless(copies(served), 2))  # 50 %
    assert more.state == "fail"
    assert more.detail.startswith("answers to the same requests differ in output_script")


async def test_a_pair_with_one_side_unmeasured_is_left_out(tmp_path: Path) -> None:
    """A copy whose features were not measured (an event too big to carry them) is not a different answer."""
    served = originals(120)
    made = [
        msgspec.structs.replace(e, features=None) if i % 4 == 0 else e for i, e in enumerate(copies(served))
    ]
    result = await judged(tmp_path, served, made)
    assert result.state == "pass", result.detail
    assert (result.candidate_n, result.baseline_n) == (90, 90)


async def test_too_few_pairs_is_insufficient_data(tmp_path: Path) -> None:
    served = originals(100)
    result = await judged(tmp_path, served, copies(served[:30], empty=True))
    assert result.state == "insufficient_data"
    assert result.detail == "30 shadow pairs that both completed, 40 needed"


async def test_min_requests_below_two_still_needs_two_pairs(tmp_path: Path) -> None:
    """Found by review: ``--min-requests 1`` (the CLI's least) made the drift gate raise once a pair had
    completed (a two-sample test needs two of each): the controller retried it forever, deciding nothing,
    not even at ``--step-max-s``, and ``sluice rollout status`` printed a traceback."""
    served = originals(3)
    one = await judged(tmp_path / "one", served, copies(served[:1]), min_requests=1)
    assert one.state == "insufficient_data"
    assert one.detail == "1 shadow pairs that both completed, 2 needed"
    three = await judged(tmp_path / "three", served, copies(served), min_requests=1)
    assert three.state == "pass", three.detail


async def test_requests_accepted_before_the_step_are_not_its(tmp_path: Path) -> None:
    served = originals(100)
    earlier = [
        msgspec.structs.replace(e, request_id="00000000" + e.request_id[8:])
        for e in copies(served, empty=True)
    ]
    result = await judged(tmp_path, served, earlier)
    assert result.state == "insufficient_data"
    assert result.candidate_n == 0


async def test_pairs_are_capped_and_stay_pairs(tmp_path: Path) -> None:
    served = originals(MAX_ROWS + 150)
    with warehouse(tmp_path) as client:
        stored(client, served, copies(served))
        rows = query_rows(client, pairs_sql(MODEL, STABLE, CANDIDATE, T0))
    by_id = {r["request_id"]: r["model_version"] for r in rows}
    assert sorted(by_id.values()).count(STABLE) == MAX_ROWS
    assert sorted(by_id.values()).count(CANDIDATE) == MAX_ROWS
    pairs = {e.request_id: e.shadow_of for e in copies(served)}
    assert all(pairs[i] in by_id for i, version in by_id.items() if version == CANDIDATE)


async def test_a_step_asking_for_more_pairs_than_are_read_is_judged_on_those_read(tmp_path: Path) -> None:
    """Found by an audit: at most MAX_ROWS pairs are read, so ``--min-requests 1001`` with ``--shadow``
    left the gate at "1000 shadow pairs that both completed, 1001 needed" for ever, and the rollout with it."""
    served = originals(MAX_ROWS + 150)
    with warehouse(tmp_path) as client:
        stored(client, served, copies(served))
        result = await gate(client, min_requests=MAX_ROWS + 1)
    assert result.state == "pass", result.detail
    assert result.candidate_n == MAX_ROWS


async def test_without_shadow_the_gate_does_not_apply(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        for embeddings in (False, True):
            assert (await gate(client, shadow=0.0, embeddings=embeddings)) == GateResult(
                gate="drift", state="not_applicable", detail=NO_SHADOW
            )


DIM = 384


def embedded(
    n: int, *, version: str, seed: int, noise: float = 0.0, dim: int = DIM, of: list[RequestFinished] | None = None,
    vectors: bool = True,
) -> list[RequestFinished]:  # fmt: skip
    """An embeddings model's answers to inputs 0..n-1 (the same vector for the same input on either side),
    ``noise`` added as the fault injection adds it; ``of``: shadow copies of those originals."""
    made = []
    for i in range(n):
        rng = random.Random(i)
        vector = [rng.gauss(0, 1) for _ in range(dim)]
        norm = sum(x * x for x in vector) ** 0.5
        vector = [x / norm for x in vector]
        if noise:
            vector = noisy(vector, noise, random.Random(seed * 7919 + i))
        event = finished_event(
            i, T0 + timedelta(seconds=1 + i * 0.01), seed=seed, embed=vector if vectors else None
        )
        shadow_of = of[i].request_id if of is not None else None
        made.append(
            msgspec.structs.replace(event, kind="embedding", model_version=version, shadow_of=shadow_of)
        )
    return made


async def test_an_embeddings_candidate_is_judged_on_each_pairs_vectors(tmp_path: Path) -> None:
    """The same vectors up to float noise pass; vectors moved as a retrained model moves them fail, with
    the numbers; the gate's statistic is the pairs' cosine, so 60 pairs decide."""
    served = embedded(120, version=STABLE, seed=1)
    alike = await judged(
        tmp_path / "alike",
        served,
        embedded(60, version=CANDIDATE, seed=2, noise=0.002, of=served),
        embeddings=True,
    )
    assert alike.state == "pass", alike.detail
    assert (alike.candidate_n, alike.baseline_n) == (60, 60)
    assert alike.candidate is not None
    assert alike.candidate > 0.99
    assert alike.detail.startswith("vectors alike (cosine median 0.999")
    assert "0 of 60 shadow pairs below 0.99" in alike.detail
    moved = await judged(
        tmp_path / "moved",
        served,
        embedded(60, version=CANDIDATE, seed=2, noise=0.05, of=served),
        embeddings=True,
    )
    assert moved.state == "fail"
    assert moved.candidate is not None
    assert 0.6 < moved.candidate < 0.8  # 1 / sqrt(1 + 384 * 0.05**2) = 0.71
    assert moved.limit == 0.99
    assert "vectors for the same inputs differ" in moved.detail
    assert "60 of 60 shadow pairs below 0.99, at most 3 may be" in moved.detail


async def test_an_embeddings_candidate_wrong_on_a_few_inputs_fails_past_five_percent(tmp_path: Path) -> None:
    served = embedded(100, version=STABLE, seed=1)
    good = embedded(100, version=CANDIDATE, seed=2, of=served)
    bad = embedded(100, version=CANDIDATE, seed=2, noise=0.05, of=served)
    few = [bad[i] if i < 5 else good[i] for i in range(100)]
    more = [bad[i] if i < 6 else good[i] for i in range(100)]
    assert (await judged(tmp_path / "few", served, few, embeddings=True)).state == "pass"
    failed = await judged(tmp_path / "more", served, more, embeddings=True)
    assert failed.state == "fail"
    assert "6 of 100 shadow pairs below 0.99, at most 5 may be" in failed.detail


def test_an_embeddings_candidate_with_nan_vectors_fails() -> None:
    """NaN compares false with any limit: such pairs once passed as "vectors alike"."""
    rows = [
        {"original": f"r{i}", "model_version": version, "embedding": vector}
        for i in range(40)
        for version, vector in ((STABLE, [1.0, 0.0]), (CANDIDATE, [float("nan"), 0.0]))
    ]
    result = judge_vectors(rows, stable=STABLE, candidate=CANDIDATE, min_requests=20, min_cosine=0.99)
    assert result.state == "fail"
    assert result.candidate == -1.0
    assert "40 of 40 shadow pairs below 0.99" in result.detail


async def test_an_embeddings_candidate_of_another_dimension_fails(tmp_path: Path) -> None:
    served = embedded(60, version=STABLE, seed=1)
    result = await judged(
        tmp_path, served, embedded(60, version=CANDIDATE, seed=2, dim=768, of=served), embeddings=True
    )
    assert result.state == "fail"
    assert result.detail == "vectors of 768 dimensions where the stable version's have 384 (60 shadow pairs)"


async def test_embeddings_pairs_need_vectors_on_both_sides(tmp_path: Path) -> None:
    """Pairs outside the drift sample carry no vector; the generation gate's pairs do not count either."""
    served = embedded(100, version=STABLE, seed=1)
    sampled = embedded(100, version=CANDIDATE, seed=2, of=served)
    unsampled = [msgspec.structs.replace(e, features=msgspec.structs.replace(e.features, embedding=None))
                 if e.features is not None and i % 4 else e for i, e in enumerate(sampled)]  # fmt: skip
    with warehouse(tmp_path) as client:
        stored(client, served, unsampled)
        result = await gate(client, embeddings=True, min_requests=30)
        rows = query_rows(client, vector_pairs_sql(MODEL, STABLE, CANDIDATE, T0))
    assert result.state == "insufficient_data"
    assert result.detail.startswith("25 shadow pairs that both completed with a vector, 30 needed")
    assert len(rows) == 50
    assert {r["original"] for r in rows} == {served[i].request_id for i in range(0, 100, 4)}


def test_the_query_quotes_hostile_names(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        assert query_rows(client, pairs_sql(HOSTILE, HOSTILE, HOSTILE, T0)) == []
        assert query_rows(client, vector_pairs_sql(HOSTILE, HOSTILE, HOSTILE, T0)) == []


def test_a_candidate_answering_without_log_probabilities_fails() -> None:
    """Found by a review: the missing share of an answer feature was taken over completed answers only, and
    the gate's pairs carry no status: none counted, so a candidate with no log-probabilities on any answer
    passed ("answers alike") where the docs say it fails."""
    from streams.rollout_drift import judge_drift

    def row(version: str, i: int, *, logprobs: bool) -> dict[str, Any]:
        rng = random.Random(i)
        return {
            "model_version": version,
            "kind": "completion",
            "completion_tokens": 8 + rng.randrange(4),
            "output_chars": 30 + rng.randrange(10),
            "mean_logprob": -2.0 + rng.gauss(0, 0.2) if logprobs else None,
            "mean_entropy": 3.0 + rng.gauss(0, 0.2) if logprobs else None,
            "output_script": "latin",
            "finish_reason": "stop",
            "empty_output": False,
            "refusal": False,
        }

    rows = [row("v1", i, logprobs=True) for i in range(200)] + [
        row("v2", i, logprobs=False) for i in range(200)
    ]
    result = judge_drift(rows, stable="v1", candidate="v2", min_requests=50, alpha=0.01, null_tolerance=0.2)
    assert result.state == "fail"
    assert "answers not measured as the stable version's" in result.detail
    assert "mean_logprob" in result.detail
    same = [row("v2", i + 1000, logprobs=True) for i in range(200)]
    alike = judge_drift(
        rows[:200] + same, stable="v1", candidate="v2", min_requests=50, alpha=0.01, null_tolerance=0.2
    )
    assert alike.state == "pass", alike.detail
