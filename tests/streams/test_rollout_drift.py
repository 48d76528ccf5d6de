"""The rollout's drift gate on real embedded ClickHouse: the candidate's outputs against the stable
version's over the same step, matched by tenant (:mod:`streams.rollout_drift`)."""

from __future__ import annotations

import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infra.warehouse.client import Client
from schemas.events import RequestFinished
from streams.rollout_drift import (
    drift_gate,
    judge_drift,
    mix_sql,
    quotas,
    sample_sql,
)
from streams.sink import insert, query_rows
from tests.streams.test_drift import MODEL, T0, finished_event, rows_of, warehouse

STABLE, CANDIDATE = "v1", "v2"
HOSTILE = "x' OR 1=1 --"


def answered(
    n: int, *, version: str, tenant: str, seed: int, long: bool = False, empty: bool = False
) -> list[RequestFinished]:
    """``n`` requests of ``tenant`` served by ``version`` in the step: long answers (``long``), or empty
    ones (``empty``: a broken candidate), else short ones."""
    rng = random.Random(seed)
    events = []
    for i in range(n):
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
        events.append(
            msgspec.structs.replace(
                event, model_version=version, features=features, usage=usage, finish_reason="stop"
            )
        )
    return events


def stored(client: Client, *groups: list[RequestFinished]) -> None:
    insert(client, rows_of([e for group in groups for e in group]))


async def gate(client: Client, min_requests: int = 40) -> Any:
    async def read(sql: str) -> list[dict[str, Any]]:
        return query_rows(client, sql)

    return await drift_gate(
        read,
        model=MODEL,
        stable=STABLE,
        candidate=CANDIDATE,
        since=T0,
        min_requests=min_requests,
        alpha=0.01,
        null_tolerance=0.2,
    )


async def test_a_candidate_bad_from_its_first_request_fails(tmp_path: Path) -> None:
    """Empty answers from the start: its own drift reports would take them as its reference."""
    with warehouse(tmp_path) as client:
        stored(
            client,
            answered(200, version=STABLE, tenant="acme", seed=1),
            answered(60, version=CANDIDATE, tenant="acme", seed=2, empty=True),
        )
        result = await gate(client)
    assert result.state == "fail"
    assert (result.candidate_n, result.baseline_n) == (60, 60)
    assert "output_chars" in result.detail
    assert "empty_output" in result.detail
    assert "1 tenant both served" in result.detail


async def test_tenants_mixed_differently_on_the_two_versions_do_not_fail_a_good_candidate(
    tmp_path: Path,
) -> None:
    """Sticky routing put acme (long answers) mostly on the stable version and globex (short ones) mostly on
    the candidate, which answers exactly as the stable version does: matched by tenant, it passes; compared
    whole, its outputs would look shorter."""
    stable = [
        *answered(300, version=STABLE, tenant="acme", seed=1, long=True),
        *answered(60, version=STABLE, tenant="globex", seed=2),
    ]
    candidate = [
        *answered(60, version=CANDIDATE, tenant="acme", seed=3, long=True),
        *answered(300, version=CANDIDATE, tenant="globex", seed=4),
    ]
    with warehouse(tmp_path) as client:
        stored(client, stable, candidate)
        result = await gate(client)
        whole = query_rows(client, "SELECT * FROM drift_features")
    assert result.state == "pass", result.detail
    assert (result.candidate_n, result.baseline_n) == (120, 120)
    assert "2 tenants both served" in result.detail
    assert "output_chars" in result.detail
    # the same test on the unmatched step fails: what the matching is for
    unmatched = judge_drift(
        whole, stable=STABLE, candidate=CANDIDATE, tenants=2, min_requests=40, alpha=0.01, null_tolerance=0.2
    )
    assert unmatched.state == "fail"
    assert "output_chars" in unmatched.detail


async def test_no_tenant_on_both_versions_is_insufficient_data_with_what_to_do(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        stored(
            client,
            answered(100, version=STABLE, tenant="acme", seed=1),
            answered(100, version=CANDIDATE, tenant="globex", seed=2),
        )
        result = await gate(client)
    assert result.state == "insufficient_data"
    assert "0 tenants both served" in result.detail
    assert "--shadow" in result.detail


async def test_too_few_matched_requests_is_insufficient_data(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        stored(
            client,
            answered(100, version=STABLE, tenant="acme", seed=1),
            answered(30, version=CANDIDATE, tenant="acme", seed=2, empty=True),
        )
        result = await gate(client)
    assert result.state == "insufficient_data"
    assert result.detail == "30 requests per version of 1 tenant both served, 40 needed"


async def test_requests_accepted_before_the_step_are_not_its(tmp_path: Path) -> None:
    earlier = [
        msgspec.structs.replace(e, request_id=e.request_id.replace(e.request_id[:8], "00000000", 1))
        for e in answered(100, version=CANDIDATE, tenant="acme", seed=5, empty=True)
    ]
    with warehouse(tmp_path) as client:
        stored(client, answered(100, version=STABLE, tenant="acme", seed=1), earlier)
        result = await gate(client)
    assert result.state == "insufficient_data"
    assert result.candidate_n == 0


async def test_an_embeddings_model_has_no_output_to_compare(tmp_path: Path) -> None:
    def embedded(events: list[RequestFinished]) -> list[RequestFinished]:
        return [msgspec.structs.replace(e, kind="embedding", finish_reason=None) for e in events]

    with warehouse(tmp_path) as client:
        stored(
            client,
            embedded(answered(60, version=STABLE, tenant="acme", seed=1)),
            embedded(answered(60, version=CANDIDATE, tenant="acme", seed=2)),
        )
        result = await gate(client)
    assert result.state == "not_applicable"


def test_quotas_take_the_smaller_side_and_scale_down_together() -> None:
    mix = [{"tenant": "a", "candidate": 10, "stable": 500}, {"tenant": "b", "candidate": 40, "stable": 20}]
    assert quotas(mix) == {"a": 10, "b": 20}
    big = [{"tenant": "a", "candidate": 3000, "stable": 3000}, {"tenant": "b", "candidate": 1, "stable": 9}]
    assert quotas(big, total=1000) == {"a": 999, "b": 1}


def test_the_queries_quote_hostile_names(tmp_path: Path) -> None:
    with warehouse(tmp_path) as client:
        for sql in (
            mix_sql(HOSTILE, HOSTILE, HOSTILE, T0),
            sample_sql(HOSTILE, HOSTILE, HOSTILE, T0, {HOSTILE: 3}),
        ):
            assert query_rows(client, sql) == []


@pytest.mark.parametrize("tenants", [1, 3])
async def test_each_tenant_gives_the_same_count_from_each_side(tmp_path: Path, tenants: int) -> None:
    groups = []
    for t in range(tenants):
        groups.append(answered(50 + 10 * t, version=STABLE, tenant=f"t{t}", seed=10 + t))
        groups.append(answered(45, version=CANDIDATE, tenant=f"t{t}", seed=20 + t))
    with warehouse(tmp_path) as client:
        stored(client, *groups)
        rows = query_rows(
            client, sample_sql(MODEL, STABLE, CANDIDATE, T0, {f"t{t}": 45 for t in range(tenants)})
        )
    assert sum(r["model_version"] == STABLE for r in rows) == sum(
        r["model_version"] == CANDIDATE for r in rows
    )
    assert len(rows) == 2 * 45 * tenants
