"""The dashboard: its JSON on a real embedded warehouse, its routes, and the page in a real headless
Chromium (loads, draws every chart with the facts' data and the drift reports, no console errors, user
data shown not run).

The browser test keeps its screenshot at ``test-artifacts/dashboard.png`` under the repository root.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from infra.warehouse.client import Client
from schemas.events import GateResult, RolloutGates, Status
from streams.dashboard import Dashboard, plotly_js_path
from streams.queries import MAX_MINUTES
from streams.rollout import advance, roll_back, start_rollout
from streams.sink import Batch, deployment_row, insert
from tests.streams.browser import render
from tests.streams.test_queries import (
    BATCH_CONFIG,
    batch_line,
    batch_state,
    drift_report,
    event,
    insert_batches,
    insert_drift_reports,
    insert_facts,
    migrated_warehouse,
    now_ms,
)

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO_ROOT / "test-artifacts"
CHARTS = ("ttft", "itl", "throughput", "errors", "burn", "spend")
EVIL = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2"> &amp; &lt;b&gt;'

Query = Callable[[str], Awaitable[list[dict[str, Any]]]]

# What the browser tests read from the page once it has rendered.
PROBES = {
    "dataset": "Object.assign({}, document.body.dataset)",
    "plots": "document.querySelectorAll('.js-plotly-plot').length",
    "charts": """Array.from(document.querySelectorAll('.js-plotly-plot')).map((gd) => ({
        id: gd.id,
        traces: gd.data.length,
        points: gd.data.reduce((n, t) => n + (t.x ? t.x.length : 0), 0),
        drawn: gd.querySelectorAll('.point').length,
        shapes: (gd.layout.shapes || []).map((s) => s.y0),
        notes: (gd.layout.annotations || []).map((a) => a.text),
    }))""",
    "spend_ticks": "Array.from(document.querySelectorAll('#chart-spend .xtick text')).map((e) => e.textContent)",
    "drift": "document.getElementById('drift-body').textContent",
    "drift_table": """Array.from(document.querySelectorAll('#drift-body tr')).map(
        (tr) => Array.from(tr.cells).map((c) => c.textContent))""",
    "drift_badges": """Array.from(document.querySelectorAll('#drift-body .verdict')).map(
        (b) => [b.textContent, getComputedStyle(b).backgroundColor])""",
    "drift_ticks": "Array.from(document.querySelectorAll('#chart-drift .ytick text')).map((e) => e.textContent)",
    "drift_hidden": "document.getElementById('chart-drift').hidden",
    "requests_tile": "document.getElementById('tile-requests').textContent",
    "rollouts": "document.getElementById('rollouts-body').textContent",
    "rollout_table": """Array.from(document.querySelectorAll('#rollouts-body tr')).map(
        (tr) => Array.from(tr.cells).map((c) => c.textContent))""",
    "batches": "document.getElementById('batches-body').textContent",
    "batch_table": """Array.from(document.querySelectorAll('#batches-body tr')).map(
        (tr) => Array.from(tr.cells).map((c) => c.textContent))""",
    "batch_bars": """Array.from(document.querySelectorAll('#batches-body .progress')).map(
        (bar) => Array.from(bar.children).map((part) => [part.className, part.style.width,
                                                          part.getBoundingClientRect().width > 0]))""",
    "pwned": "typeof window.__pwned",
    "injected": "document.querySelectorAll('img, main script').length",
}


def querier(client: Client) -> Query:
    """The streams service's read path: one query at a time on a thread, rows as dicts."""
    lock = asyncio.Lock()

    async def query(sql: str) -> list[dict[str, Any]]:
        async with lock:
            result = await asyncio.to_thread(client.query, sql)
        return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]

    return query


async def no_warehouse(sql: str) -> list[dict[str, Any]]:
    raise AssertionError(f"no query expected, got {sql}")


@contextlib.asynccontextmanager
async def serve(dashboard: Dashboard) -> AsyncIterator[str]:
    app = web.Application()
    dashboard.add_to(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@pytest.fixture
def warehouse(tmp_path: Path) -> Iterator[Client]:
    with migrated_warehouse(tmp_path / "data") as client:
        yield client


async def get_json(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.content_type == "application/json"
        return response.status, await response.json()


def a_few_minutes_of_traffic(client: Client, *, tenants: tuple[str, ...]) -> None:
    """Several tenants and two models over the last five minutes: completions, failures, an expiry and a
    cancellation, with latencies that differ by model."""
    now = now_ms()
    events = []
    for i in range(120):
        tenant = tenants[i % len(tenants)]
        model = "demo-gpt" if i % 3 else "demo-small"
        status: Status = (
            "failed" if i % 17 == 0 else "expired" if i == 50 else "cancelled" if i == 60 else "completed"
        )
        events.append(
            event(
                tenant=tenant,
                model=model,
                version="v2" if i % 2 else "v1",
                status=status,
                finished=now - timedelta(seconds=2.5 * i),
                ttft_ms=(80 if model == "demo-gpt" else 40) + i % 25 * 7,
                itl_ms=12 + i % 5,
                completion_tokens=10 + 3 * (i % 7) * (1 + tenants.index(tenant)),
            )
        )
    insert_facts(client, events)


def some_drift(client: Client, model: str = "demo-gpt", *, feature: str = "prompt_language") -> None:
    """Drift reports of ``model`` (v1 and v2) and demo-small, through the real ``drift_reports`` table:
    ``model`` v1 for all tenants: reference, then no drift, then drift of ``feature`` and prompt_tokens (the
    latest, with a quality finding); a tenant's own report (not on the dashboard); v2: too few requests.
    demo-small v1: a data-quality verdict, after a window without drift."""
    now = now_ms()
    hour = timedelta(hours=1)
    insert_drift_reports(
        client,
        [
            drift_report(model=model, window_end=now - 3 * hour, verdict="reference"),
            drift_report(model=model, window_end=now - 2 * hour, verdict="no_drift"),
            drift_report(
                model=model,
                window_end=now - hour,
                verdict="drift",
                drifted=("prompt_tokens", feature),
                quality=(f"{feature}: 40% missing (reference 0%)",),
                requests=812,
            ),
            drift_report(model=model, window_end=now - hour, scope="acme", verdict="data_quality"),
            drift_report(
                model=model, version="v2", window_end=now - hour, verdict="insufficient_data", requests=9
            ),
            drift_report(model="demo-small", window_end=now - 2 * hour, verdict="no_drift"),
            drift_report(
                model="demo-small",
                window_end=now - hour,
                verdict="data_quality",
                quality=("embedding: not sampled (0 of 412 requests; reference 5.1%)",),
            ),
        ],
    )


# ---------------------------------------------------------------- the JSON


async def test_data_on_an_empty_warehouse(warehouse: Client) -> None:
    async with serve(Dashboard(querier(warehouse))) as url:
        status, body = await get_json(f"{url}/dashboard/data")
    assert status == 200
    assert body["minutes"] == 60
    assert set(body) == {
        "minutes",
        "since",
        "until",
        "refresh_s",
        "summary",
        "targets",
        "latency",
        "traffic",
        "spend",
        "drift",
        "rollouts",
        "batches",
    }
    assert body["rollouts"] == []
    assert body["batches"] == {"available": True, "batches": []}
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:00", body["since"])
    assert (body["latency"], body["traffic"], body["spend"], body["targets"]) == ([], [], [], {})
    assert body["summary"] == {
        "requests": 0,
        "completed": 0,
        "errors": 0,
        "error_rate": 0.0,
        "completion_tokens": 0,
        "spend_usd": 0.0,
        "tenants": 0,
    }
    assert body["drift"] == {"available": True, "status": [], "history": []}


async def test_data_on_a_warehouse_without_drift_reports(tmp_path: Path) -> None:
    """A warehouse migrated by older code, before the drift table: the panel says so, nothing fails."""
    with migrated_warehouse(tmp_path / "data", upto=2) as client:
        async with serve(Dashboard(querier(client))) as url:
            status, body = await get_json(f"{url}/dashboard/data")
    assert status == 200
    assert body["drift"] == {"available": False, "status": [], "history": []}


async def test_data_on_a_warehouse_before_the_batches_table(tmp_path: Path) -> None:
    """Migrated by older code (no batches table, no request_facts.batch_id): the latency statement does
    not name the column, and the panel says there are no batches."""
    with migrated_warehouse(tmp_path / "data", upto=4) as client:
        async with serve(Dashboard(querier(client))) as url:
            status, body = await get_json(f"{url}/dashboard/data")
    assert status == 200, body
    assert body["batches"] == {"available": False, "batches": []}


def some_batches(client: Client, *, tenant: str = "acme", batch_id: str = "batch_1") -> None:
    """``batch_id`` running (6 of 10 lines done, one failed) with its 7 finished lines (one retried), and
    another batch that completed; batch lines that waited a minute, which no latency chart shows."""
    now = now_ms()
    hour = timedelta(hours=1)
    insert_batches(
        client,
        [
            batch_state(
                4,
                "in_progress",
                batch_id=batch_id,
                tenant=tenant,
                completed=5,
                failed=1,
                created_at=now - hour,
            ),
            batch_state(9, "completed", batch_id="batch_0", completed=4, total=4, created_at=now - 2 * hour),
        ],
    )
    lines = [
        batch_line(event(tenant=tenant, finished=now - timedelta(seconds=i), ttft_ms=60_000), batch_id, i % 6)
        for i in range(7)
    ]
    insert_facts(client, lines)


async def test_data_with_batches(warehouse: Client) -> None:
    a_few_minutes_of_traffic(warehouse, tenants=("acme", "globex"))
    some_batches(warehouse)
    async with serve(Dashboard(querier(warehouse))) as url:
        status, body = await get_json(f"{url}/dashboard/data?minutes=15")
    assert status == 200
    assert body["batches"]["available"] is True
    running, done = body["batches"]["batches"]
    assert (running["batch_id"], running["tenant"], running["model"], running["status"]) == (
        "batch_1",
        "acme",
        "demo-gpt",
        "in_progress",
    )
    # 6 lines finished, one of them in two attempts (lines, not attempts: an audit)
    assert (running["total"], running["completed"], running["failed"], running["lines_finished"]) == (
        10,
        5,
        1,
        6,
    )
    assert running["usd"] == pytest.approx(running["cost_nanos"] / 1e9)
    assert running["cost_nanos"] > 0
    assert (done["batch_id"], done["status"], done["cost_nanos"]) == ("batch_0", "completed", 0)
    assert body["summary"]["requests"] == 120  # the batch lines are in no latency or traffic series
    assert max(r["ttft_p99_ms"] for r in body["latency"]) < 60_000
    assert sum(r["requests"] for r in body["latency"]) == 120


async def test_data_with_facts_and_drift(warehouse: Client) -> None:
    a_few_minutes_of_traffic(warehouse, tenants=("acme", "globex"))
    some_drift(warehouse)
    async with serve(Dashboard(querier(warehouse), slo=BATCH_CONFIG)) as url:
        status, body = await get_json(f"{url}/dashboard/data?minutes=15")
    assert status == 200
    assert body["minutes"] == 15
    assert body["summary"]["requests"] == 120
    assert body["summary"]["errors"] == 9  # i % 17 == 0 (8 of them) and one expired
    assert body["summary"]["tenants"] == 2
    assert sum(r["requests"] for r in body["traffic"]) == 120
    assert {r["model"] for r in body["latency"]} == {"demo-gpt", "demo-small"}
    assert body["targets"]["demo-gpt"] == {
        "tier": "interactive",
        "availability": 0.995,
        "error_budget": 0.005,
    }
    spend = body["spend"]
    assert [r["tenant"] for r in spend] == ["globex", "acme"]  # globex generates twice the tokens
    assert all(r["usd"] == pytest.approx(r["cost_nanos"] / 1e9) for r in spend)
    assert body["summary"]["spend_usd"] == pytest.approx(sum(r["usd"] for r in spend))
    drift = body["drift"]
    assert drift["available"] is True
    # The latest all-tenant report per model version (acme's own report is not on the dashboard).
    assert [(r["model"], r["model_version"], r["verdict"]) for r in drift["status"]] == [
        ("demo-gpt", "v1", "drift"),
        ("demo-gpt", "v2", "insufficient_data"),
        ("demo-small", "v1", "data_quality"),
    ]
    latest = drift["status"][0]
    assert latest["drifted_features"] == ["prompt_tokens", "prompt_language"]
    assert latest["quality"] == ["prompt_language: 40% missing (reference 0%)"]
    assert (latest["requests"], latest["n_reference"], latest["n_current"]) == (812, 500, 500)
    assert latest["share_drifted"] == pytest.approx(2 / 3)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", latest["window_end"])
    assert latest["window_start"] < latest["window_end"]
    # The history strip: every all-tenant window of each model version, oldest first, whatever the
    # dashboard's window (15 minutes here).
    assert [(r["model"], r["model_version"], r["verdict"]) for r in drift["history"]] == [
        ("demo-gpt", "v1", "reference"),
        ("demo-gpt", "v1", "no_drift"),
        ("demo-gpt", "v1", "drift"),
        ("demo-gpt", "v2", "insufficient_data"),
        ("demo-small", "v1", "no_drift"),
        ("demo-small", "v1", "data_quality"),
    ]
    assert drift["history"][2]["window_end"] == latest["window_end"]
    assert (drift["history"][2]["features_drifted"], drift["history"][2]["features_tested"]) == (2, 3)


@pytest.mark.parametrize("minutes", ["0", str(MAX_MINUTES + 1), "abc", "-5", "1.5", "1e3", "٣", "9" * 40])
async def test_minutes_out_of_bounds_is_a_400(minutes: str) -> None:
    async with serve(Dashboard(no_warehouse)) as url:
        status, body = await get_json(f"{url}/dashboard/data?minutes={minutes}")
    assert status == 400
    assert f"minutes must be a whole number from 1 to {MAX_MINUTES}" in body["error"]


async def test_the_window_bounds_reach_the_sql() -> None:
    seen: list[str] = []

    async def query(sql: str) -> list[dict[str, Any]]:
        seen.append(sql)
        return [{"present": 0}] if "system.tables" in sql else []

    async with serve(Dashboard(query)) as url:
        for minutes in ("1", str(MAX_MINUTES)):
            status, body = await get_json(f"{url}/dashboard/data?minutes={minutes}")
            assert (status, body["minutes"]) == (200, int(minutes))
    assert any("toIntervalMinute(0)" in sql for sql in seen)
    assert any(f"toIntervalMinute({MAX_MINUTES - 1})" in sql for sql in seen)
    assert not any("drift_reports\n" in sql or "FROM drift_reports" in sql for sql in seen)


async def test_a_failing_warehouse_is_a_503() -> None:
    async def broken(sql: str) -> list[dict[str, Any]]:
        raise RuntimeError("the warehouse is gone")

    async with serve(Dashboard(broken)) as url:
        status, body = await get_json(f"{url}/dashboard/data")
    assert status == 503
    assert "warehouse query failed" in body["error"]


async def test_page_script_and_plotly_are_served_from_here() -> None:
    async with serve(Dashboard(no_warehouse, refresh_s=2.5)) as url, aiohttp.ClientSession() as http:
        async with http.get(f"{url}/dashboard") as response:
            assert response.status == 200
            assert response.content_type == "text/html"
            assert "script-src 'self'" in response.headers["Content-Security-Policy"]
            page = await response.text()
        async with http.get(f"{url}/dashboard/app.js") as response:
            assert response.status == 200
            script = await response.text()
        async with http.get(f"{url}/dashboard/plotly.min.js", auto_decompress=False) as response:
            assert response.status == 200
            assert response.headers["Content-Encoding"] == "gzip"
            assert response.content_type == "text/javascript"
            etag = response.headers["ETag"]
            bundle = gzip.decompress(await response.read())
        async with http.get(f"{url}/dashboard/plotly.min.js", headers={"If-None-Match": etag}) as response:
            assert response.status == 304
    assert 'data-refresh-ms="2500"' in page
    assert '<script src="/dashboard/plotly.min.js"></script>' in page
    assert "<script>" not in page  # no inline script: the CSP allows none
    for text in (page, script):
        assert not re.search(r"(https?:)?//[a-z0-9]", text, re.IGNORECASE)
    assert bundle == plotly_js_path().read_bytes()


def test_the_itl_chart_says_it_shows_each_requests_mean_gap() -> None:
    """Found by review: the chart (and ``sli_minute``) takes percentiles of each request's mean gap
    (``itl_mean_ms``), not of every token's gap as the ITL SLO does: one long stall among many fast tokens
    shows as fast, so a chart titled plainly as inter-token latency invited comparing it with the SLO."""
    from streams.dashboard import _SCRIPT

    (title,) = re.findall(r'"([^"]*inter-token[^"]*)"', _SCRIPT, re.IGNORECASE)
    assert "per request" in title
    assert "not the ITL SLO" in title


def test_refresh_interval_is_bounded() -> None:
    with pytest.raises(ValueError, match="refresh_s"):
        Dashboard(no_warehouse, refresh_s=0)


# ---------------------------------------------------------------- in Chromium


def served_here(url: str, requests: list[str]) -> list[str]:
    """The requests that went anywhere but the dashboard's own server."""
    return [r for r in requests if not r.startswith(url) and not r.startswith(("data:", "blob:", "about:"))]


def a_rollback(client: Client, model: str = "demo-gpt", candidate: str = "v2") -> None:
    """A rollout of ``candidate``: warming up, 10 % once its worker was ready, rolled back by the controller
    on its error ratio."""
    now = datetime.now(UTC).replace(microsecond=0)
    started = start_rollout(
        model,
        stable="v1",
        candidate=candidate,
        steps=[0.1, 1.0],
        shadow=0.0,
        gates=RolloutGates(),
        now=now - timedelta(minutes=5),
        source="sluice/cli",
    )
    gate = GateResult(
        gate="error_ratio",
        state="fail",
        candidate=0.5,
        baseline=0.0,
        limit=0.05,
        candidate_n=60,
        baseline_n=540,
    )
    ready = advance(started, now - timedelta(minutes=4), "v2 is ready (worker w-1)", [], "controller")
    back = roll_back(ready, now, "automatic rollback: error_ratio", [gate], "controller")
    insert(client, Batch(deployments=[deployment_row(e) for e in (started, ready, back)]))


async def test_dashboard_renders_in_chromium(warehouse: Client) -> None:
    tenants = ("acme", "globex", "initech", "umbrella")
    a_few_minutes_of_traffic(warehouse, tenants=tenants)
    some_drift(warehouse)
    a_rollback(warehouse)
    some_batches(warehouse)
    async with serve(Dashboard(querier(warehouse), refresh_s=1.0)) as url:
        page = await render(
            f"{url}/dashboard?minutes=15",
            ARTIFACTS / "dashboard.png",
            wait_for_js="document.body.dataset.refreshes >= '2'",  # a refresh redraws without errors
            evaluate=PROBES,
            height=1400,
        )
    assert page.console_errors == [], page.console
    assert served_here(url, page.requests) == []
    values = page.values
    assert values["dataset"]["rendered"] == "1"
    assert values["dataset"]["charts"] == str(len(CHARTS) + 1)  # and the drift history
    assert "error" not in values["dataset"]
    assert values["plots"] == len(CHARTS) + 1
    charts = {c["id"].removeprefix("chart-"): c for c in values["charts"]}
    assert set(charts) == {*CHARTS, "drift"}
    for name, chart in charts.items():
        assert chart["traces"] > 0, name
        assert chart["points"] > 0, name
        assert chart["drawn"] > 0, name  # markers or bars actually drawn in the SVG
        assert chart["notes"] == [], name
    assert charts["ttft"]["traces"] == 2 * 3  # two models x p50/p95/p99
    assert charts["burn"]["shapes"] == [1]  # the budget line at 1.0
    assert sorted(values["spend_ticks"]) == sorted(tenants)
    assert values["requests_tile"] == "120"

    # The drift panel: the latest verdict per model version, with its window, n, features and findings.
    header, *table = values["drift_table"]
    assert header == [
        "model",
        "version",
        "status",
        "window (UTC)",
        "n current / reference",
        "requests",
        "share drifted",
        "drifted features",
        "data quality",
    ]
    assert [row[:3] for row in table] == [
        ["demo-gpt", "v1", "drift"],
        ["demo-gpt", "v2", "insufficient data"],
        ["demo-small", "v1", "data quality"],
    ]
    drifted = table[0]
    second = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d"
    assert re.fullmatch(f"{second} \u2013 {second}", drifted[3])
    assert drifted[4:7] == ["500 / 500", "812", "66.7%"]
    assert drifted[7] == "prompt_tokensprompt_language"  # one line each
    assert drifted[8] == "prompt_language: 40% missing (reference 0%)"
    assert table[1][7:] == ["\u2013", "\u2013"]  # none
    assert table[2][8] == "embedding: not sampled (0 of 412 requests; reference 5.1%)"
    assert values["drift_badges"] == [
        ["drift", "rgb(179, 38, 30)"],  # red
        ["insufficient data", "rgb(128, 134, 139)"],  # grey
        ["data quality", "rgb(232, 113, 10)"],  # orange
    ]
    # The history strip: a marker per window and model version, a trace per verdict seen.
    assert charts["drift"]["points"] == 6
    assert charts["drift"]["traces"] == 5  # reference, no drift, insufficient data, data quality, drift
    assert sorted(values["drift_ticks"]) == ["demo-gpt / v1", "demo-gpt / v2", "demo-small / v1"]
    assert values["drift_hidden"] is False

    # The rollout panel: the decisions, newest first, with the gates behind them.
    header, *decisions = values["rollout_table"]
    assert header == ["time (UTC)", "model", "action", "phase", "by", "traffic", "step", "gates", "reason"]
    assert [row[1:5] for row in decisions] == [
        ["demo-gpt", "rollback", "rolled_back", "controller"],
        ["demo-gpt", "deploy", "canary", "controller"],
        ["demo-gpt", "deploy", "warming", "operator"],
    ]
    assert decisions[0][5] == "v1 100.0%v2 0.0%"
    assert decisions[1][5] == "v1 90.0%v2 10.0%"
    assert decisions[2][5] == "v1 100.0%v2 0.0%"
    assert decisions[0][7] == "error_ratio fail: 0.5 vs 0 (limit 0.05, n=60/540)"
    assert decisions[0][8] == "automatic rollback: error_ratio"

    # The batch panel: running first, a bar of the lines done (completed, failed) of the total.
    header, *batches = values["batch_table"]
    assert header == ["batch", "tenant", "model", "status", "progress", "created (UTC)", "cost so far"]
    assert [row[:4] for row in batches] == [
        ["batch_1", "acme", "demo-gpt", "in_progress"],
        ["batch_0", "acme", "demo-gpt", "completed"],
    ]
    assert batches[0][4] == "6 / 10 (1 failed)"
    assert batches[1][4] == "4 / 4"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", batches[0][5])
    assert re.fullmatch(r"\$0\.\d{6}", batches[0][6])
    assert batches[0][6] != "$0.000000"
    assert batches[1][6] == "$0.000000"
    assert values["batch_bars"] == [
        [["done", "50%", True], ["failed", "10%", True]],
        [["done", "100%", True], ["failed", "0%", False]],
    ]
    assert page.screenshot.stat().st_size > 10_000


@pytest.mark.parametrize(
    ("upto", "drift"),
    [(None, "no drift reports in the table yet"), (2, "no drift reports yet")],
    ids=["migrated", "before-the-drift-table"],
)
async def test_empty_dashboard_renders_clean_charts(tmp_path: Path, upto: int | None, drift: str) -> None:
    with migrated_warehouse(tmp_path / "data", upto=upto) as client:
        async with serve(Dashboard(querier(client))) as url:
            page = await render(f"{url}/dashboard?minutes=15", tmp_path / "empty.png", evaluate=PROBES)
    assert page.console_errors == [], page.console
    assert page.values["plots"] == len(CHARTS)  # no drift history drawn
    assert page.values["dataset"]["charts"] == str(len(CHARTS))
    for chart in page.values["charts"]:
        assert chart["points"] == 0
        assert chart["notes"] == ["no requests in the last 15 min"], chart["id"]
    assert page.values["requests_tile"] == "0"
    assert page.values["drift"] == drift
    assert page.values["drift_hidden"] is True
    assert page.values["rollouts"] == "no rollouts yet (sluice rollout start --help)"
    assert page.values["batches"] == ("no batches yet" if upto else "no batches in the last 24 hours")


async def test_names_from_the_data_are_shown_not_run(warehouse: Client, tmp_path: Path) -> None:
    a_few_minutes_of_traffic(warehouse, tenants=(EVIL, "acme"))
    some_drift(warehouse, EVIL, feature=EVIL)  # a model, a feature and a quality finding
    a_rollback(warehouse, EVIL, candidate=EVIL)
    some_batches(warehouse, tenant=EVIL, batch_id=EVIL)
    async with serve(Dashboard(querier(warehouse))) as url:
        page = await render(f"{url}/dashboard", tmp_path / "evil.png", evaluate=PROBES)
    assert page.console_errors == [], page.console
    assert page.values["pwned"] == "undefined"
    assert page.values["injected"] == 0
    assert served_here(url, page.requests) == []  # the <img src=x> was never requested
    assert EVIL in page.values["spend_ticks"]  # shown as text, exactly
    evil = next(row for row in page.values["drift_table"] if row[0] == EVIL)
    assert evil[:3] == [EVIL, "v1", "drift"]
    assert evil[7] == "prompt_tokens" + EVIL
    assert evil[8] == f"{EVIL}: 40% missing (reference 0%)"
    assert f"{EVIL} / v1" in page.values["drift_ticks"]
    rollback = next(row for row in page.values["rollout_table"] if row[2] == "rollback")
    assert rollback[1] == EVIL
    assert rollback[5] == f"{EVIL} 0.0%v1 100.0%"  # sorted by version, shown as text
    evil_batch = next(row for row in page.values["batch_table"] if row[0] == EVIL)
    assert evil_batch[1:4] == [EVIL, "demo-gpt", "in_progress"]
