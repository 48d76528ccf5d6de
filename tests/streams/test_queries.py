"""The saved queries and the dashboard's SQL, on a real embedded warehouse (chDB) with known facts.

The helpers here (``event``, ``insert_facts``, ``migrated_warehouse``, ``rows``) build terminal events and
their ``request_facts`` rows the way the streams sink does (``streams.facts.fact_row``); the dashboard's
tests use them too.
"""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict
from collections.abc import Iterable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infra.warehouse import migrate, open_warehouse
from infra.warehouse.client import Client
from monitoring.slo import DEFAULT_TIERS, SloConfig
from schemas.events import ErrorInfo, RequestFinished, Status, Timings, Usage
from schemas.ids import uuid7_from_parts
from schemas.settings import PlatformSettings
from streams.facts import FACT_COLUMNS, fact_row
from streams.pricing import PriceTable
from streams.queries import MAX_MINUTES, SAVED, dashboard_sql, saved_queries, sql_string

PRICES = PriceTable()
_RAND = itertools.count(1)


def now_ms() -> datetime:
    """Now, to the millisecond (fact timings then come out exact: the request id holds milliseconds)."""
    now = datetime.now(UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def event(
    *,
    tenant: str = "acme",
    model: str = "demo-gpt",
    version: str = "v1",
    status: Status = "completed",
    finished: datetime,
    ttft_ms: int | None = 100,
    itl_ms: int = 10,
    prompt_tokens: int = 10,
    completion_tokens: int = 20,
    stream: bool = True,
    error_code: str | None = None,
) -> RequestFinished:
    """A terminal event whose request took ``ttft_ms`` to its first token (None: it got none) and then
    ``itl_ms`` per token; ``finished`` is when it ended."""
    decode_ms = itl_ms * max(completion_tokens - 1, 0) if ttft_ms is not None else 0
    accepted = finished - timedelta(milliseconds=(ttft_ms or 50) + decode_ms)
    request_id = uuid7_from_parts(int(accepted.timestamp() * 1000), next(_RAND))
    first_token = accepted + timedelta(milliseconds=ttft_ms) if ttft_ms is not None else None
    failed = status in ("failed", "expired")
    return RequestFinished(
        tenant=tenant,
        model=model,
        request_id=request_id,
        source="gpu/worker-0",
        time=finished,
        status=status,
        finish_reason="stop" if status == "completed" else "error" if failed else "cancelled",
        usage=Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        ),
        error=ErrorInfo(code=error_code or "worker_error", message="boom") if status == "failed" else None,
        timings=Timings(
            accepted=accepted,
            started=accepted + timedelta(milliseconds=5),
            first_token=first_token,
            finished=finished,
        ),
        worker_id="worker-0",
        model_version=version,
        kind="chat",
        stream=stream,
        edge_id="edge-0",
    )


def insert_facts(client: Client, events: Iterable[RequestFinished]) -> list[list[Any]]:
    facts = [fact_row(e, PRICES) for e in events]
    client.insert("request_facts", facts, column_names=list(FACT_COLUMNS))
    return facts


@contextlib.contextmanager
def migrated_warehouse(directory: Path) -> Iterator[Client]:
    """This process's chDB engine on a fresh, migrated directory, closed afterwards (chDB runs one engine
    per process, so the next test can open its own)."""
    client = open_warehouse(PlatformSettings(data_dir=str(directory)))
    try:
        migrate(client)
        yield client
    finally:
        client.close()


def rows(client: Client, sql: str) -> list[dict[str, Any]]:
    result = client.query(sql)
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


@pytest.fixture
def warehouse(tmp_path: Path) -> Iterator[Client]:
    with migrated_warehouse(tmp_path / "data") as client:
        yield client


# A config with a second tier that lists a model (and a quote in a model id, to check the SQL quoting).
BATCH_CONFIG = SloConfig(
    tiers=(
        DEFAULT_TIERS[0],
        msgspec.structs.replace(DEFAULT_TIERS[1], models=("batch-model", "it's"), window_days=7, ttft=None),
    ),
)


def known_mix(now: datetime) -> list[RequestFinished]:
    """demo-gpt (interactive: availability 0.995, TTFT 0.5 s for 95%), over the last hour:
    500 valid requests of which 2 bad (ratio 0.004, budget 0.005: 80% consumed); 400 streamed with a first
    token of which 10 slower than 0.5 s (ratio 0.025, budget 0.05: 50% consumed); 5 cancelled (neither);
    one failure 40 days ago (outside every window).
    batch-model: 97 completed + 3 failed in the last hour (ratio 0.03); one failure 10 days ago (inside a
    30-day window, outside the batch tier's 7 days in ``BATCH_CONFIG``)."""
    at = [now - timedelta(seconds=7 * i % 3000 + 1) for i in range(700)]
    times = iter(at)
    events = [event(finished=next(times), ttft_ms=800 if i < 10 else 100) for i in range(398)]
    events += [event(finished=next(times), status="failed"), event(finished=next(times), status="expired")]
    events += [event(finished=next(times), ttft_ms=900, stream=False) for _ in range(100)]
    events += [event(finished=next(times), status="cancelled", ttft_ms=None) for _ in range(5)]
    events.append(event(finished=now - timedelta(days=40), status="failed"))
    events += [event(model="batch-model", finished=next(times)) for _ in range(97)]
    events += [event(model="batch-model", finished=next(times), status="failed") for _ in range(3)]
    events.append(event(model="batch-model", finished=now - timedelta(days=10), status="failed"))
    return events


def by_key(found: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(r["model"], r["slo"]): r for r in found}


# ---------------------------------------------------------------- pure


def test_saved_queries_are_named_and_described() -> None:
    assert {"top-tenants-by-spend", "p99-ttft-by-model-version", "error-budget-left"} <= set(SAVED)
    for name, saved in SAVED.items():
        assert saved.description, name
        assert saved.sql.lstrip().upper().startswith("SELECT"), name
        assert ";" not in saved.sql, name


def test_error_budget_sql_follows_the_config() -> None:
    default = SAVED["error-budget-left"].sql
    assert "multiIf" not in default  # one tier holds every model
    assert "0.995 AS target" in default
    assert "0.005 AS budget" in default
    generated = saved_queries(BATCH_CONFIG)["error-budget-left"].sql
    assert "model IN ('batch-model', 'it\\'s')" in generated
    assert "toIntervalDay(multiIf(model IN ('batch-model', 'it\\'s'), 7, 30))" in generated


def test_sql_strings_are_quoted() -> None:
    assert sql_string("plain") == "'plain'"
    assert sql_string("it's \\ here") == "'it\\'s \\\\ here'"


@pytest.mark.parametrize("minutes", [0, -1, MAX_MINUTES + 1])
def test_dashboard_windows_are_bounded(minutes: int) -> None:
    with pytest.raises(ValueError, match="minutes must be between"):
        dashboard_sql(minutes)


# ---------------------------------------------------------------- on chDB


@pytest.mark.integration
def test_every_saved_query_runs_on_an_empty_warehouse(warehouse: Client) -> None:
    for name, saved in {**SAVED, **saved_queries(BATCH_CONFIG)}.items():
        assert rows(warehouse, saved.sql) == [], name
    sql = dashboard_sql(60, BATCH_CONFIG)
    for statement in (sql.latency, sql.traffic, sql.spend):
        assert rows(warehouse, statement) == []
    assert rows(warehouse, sql.drift_exists) == [{"present": False}]


@pytest.mark.integration
def test_saved_queries_on_facts(warehouse: Client) -> None:
    now = now_ms()
    insert_facts(warehouse, known_mix(now))
    for name, saved in SAVED.items():
        assert rows(warehouse, saved.sql), name

    # The built-in config: every model is interactive (30 days), so batch-model's old failure counts.
    found = by_key(rows(warehouse, SAVED["error-budget-left"].sql))
    assert set(found) == {
        ("batch-model", "availability"),
        ("batch-model", "ttft"),
        ("demo-gpt", "availability"),
        ("demo-gpt", "ttft"),
    }
    batch = found["batch-model", "availability"]
    assert (batch["tier"], batch["window_days"], batch["events"], batch["bad_events"]) == (
        "interactive",
        30,
        101,
        4,
    )


@pytest.mark.integration
def test_error_budget_left_for_a_known_mix(warehouse: Client) -> None:
    insert_facts(warehouse, known_mix(now_ms()))
    found = by_key(rows(warehouse, saved_queries(BATCH_CONFIG)["error-budget-left"].sql))
    # The batch tier has no TTFT objective in BATCH_CONFIG, so batch-model has no TTFT row.
    assert set(found) == {("batch-model", "availability"), ("demo-gpt", "availability"), ("demo-gpt", "ttft")}

    availability = found["demo-gpt", "availability"]
    assert availability["tier"] == "interactive"
    assert (availability["window_days"], availability["events"], availability["bad_events"]) == (30, 500, 2)
    assert availability["target"] == pytest.approx(0.995)
    assert availability["error_ratio"] == pytest.approx(0.004)
    assert availability["error_budget"] == pytest.approx(0.005)
    assert availability["budget_consumed"] == pytest.approx(0.8)
    assert availability["budget_left"] == pytest.approx(0.2)

    ttft = found["demo-gpt", "ttft"]
    assert (ttft["events"], ttft["bad_events"]) == (400, 10)
    assert ttft["target"] == pytest.approx(0.95)
    assert ttft["budget_consumed"] == pytest.approx(0.5)
    assert ttft["budget_left"] == pytest.approx(0.5)

    batch = found["batch-model", "availability"]
    assert (batch["tier"], batch["window_days"], batch["events"], batch["bad_events"]) == ("batch", 7, 100, 3)
    assert batch["error_budget"] == pytest.approx(0.01)
    assert batch["budget_consumed"] == pytest.approx(3.0)
    assert batch["budget_left"] == pytest.approx(-2.0)  # overspent


@pytest.mark.integration
def test_top_tenants_by_spend(warehouse: Client) -> None:
    now = now_ms()
    events = [
        event(tenant=tenant, finished=now - timedelta(minutes=i), completion_tokens=tokens)
        for i, (tenant, tokens) in enumerate(
            [("initech", 5), ("acme", 300), ("globex", 40), ("acme", 200), ("globex", 45), ("umbrella", 1)]
        )
    ]
    events.append(event(tenant="initech", finished=now - timedelta(days=45), completion_tokens=100_000))
    facts = insert_facts(warehouse, events)
    expected: dict[str, int] = defaultdict(int)
    finished_at, cost = FACT_COLUMNS.index("finished"), FACT_COLUMNS.index("cost_nanos")
    for fact in facts:
        if fact[finished_at] > now - timedelta(days=29):
            expected[fact[FACT_COLUMNS.index("tenant")]] += fact[cost]

    found = rows(warehouse, SAVED["top-tenants-by-spend"].sql)
    assert [r["tenant"] for r in found] == ["acme", "globex", "initech", "umbrella"]
    assert {r["tenant"]: r["cost_nanos"] for r in found} == expected
    assert found[0]["requests"] == 2
    assert found[0]["spend_usd"] == pytest.approx(expected["acme"] / 1e9)


@pytest.mark.integration
def test_p99_ttft_by_model_version(warehouse: Client) -> None:
    now = now_ms()
    events = [event(version="v1", finished=now - timedelta(seconds=i), ttft_ms=i + 1) for i in range(100)]
    events += [
        event(version="v2", finished=now - timedelta(seconds=i), ttft_ms=10 * (i + 1)) for i in range(100)
    ]
    events.append(event(version="v2", finished=now, status="expired", ttft_ms=None))  # no first token
    insert_facts(warehouse, events)
    found = {r["model_version"]: r for r in rows(warehouse, SAVED["p99-ttft-by-model-version"].sql)}
    # quantileExact(level) is the sorted values' element at index floor(level x n).
    assert (found["v1"]["ttft_p50_ms"], found["v1"]["ttft_p95_ms"], found["v1"]["ttft_p99_ms"]) == (
        51,
        96,
        100,
    )
    assert found["v2"]["ttft_p99_ms"] == 1000
    assert found["v2"]["requests"] == 100
    assert [r["model_version"] for r in rows(warehouse, SAVED["p99-ttft-by-model-version"].sql)] == [
        "v2",
        "v1",
    ]


@pytest.mark.integration
def test_dashboard_sql_on_facts(warehouse: Client) -> None:
    now = now_ms()
    insert_facts(warehouse, known_mix(now))
    sql = dashboard_sql(MAX_MINUTES, BATCH_CONFIG)
    traffic = rows(warehouse, sql.traffic)
    assert {r["model"] for r in traffic} == {"demo-gpt", "batch-model"}
    batch = [r for r in traffic if r["model"] == "batch-model"]
    assert sum(r["requests"] for r in batch) == 100  # the 10-day-old failure is outside a day's window
    for r in batch:
        assert r["burn_rate"] == pytest.approx(r["error_rate"] / 0.01)
    latency = rows(warehouse, sql.latency)
    assert all(isinstance(r["t"], str) and len(r["t"]) == 19 for r in latency)
    assert max(r["ttft_p99_ms"] for r in latency if r["model"] == "demo-gpt") == 900
    spend = rows(warehouse, sql.spend)
    assert [r["tenant"] for r in spend] == ["acme"]
    assert spend[0]["total_nanos"] == spend[0]["cost_nanos"]
    assert spend[0]["tenants"] == 1
