"""The dashboard: its JSON on a real embedded warehouse, its routes, and the page in a real headless
Chromium (loads, draws every chart with the facts' data, no console errors, user data shown not run).

The browser test keeps its screenshot at ``test-artifacts/dashboard.png`` under the repository root.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from infra.warehouse.client import Client
from schemas.events import Status
from streams.dashboard import Dashboard, plotly_js_path
from streams.queries import MAX_MINUTES
from tests.streams.browser import render
from tests.streams.test_queries import BATCH_CONFIG, event, insert_facts, migrated_warehouse, now_ms

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
    "requests_tile": "document.getElementById('tile-requests').textContent",
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


def create_drift_reports(client: Client, models: tuple[str, ...]) -> None:
    client.command(
        "CREATE TABLE drift_reports (window_end DateTime64(3, 'UTC'), model String, drifted Bool, "
        "share_drifted Float64) ENGINE = MergeTree ORDER BY (model, window_end)"
    )
    now = now_ms()
    rows = []
    for n, model in enumerate(models):
        rows.append([now - timedelta(hours=1), model, False, 0.0])
        rows.append([now - timedelta(minutes=n), model, n % 2 == 0, 0.25 * (n + 1)])
    client.insert("drift_reports", rows, column_names=["window_end", "model", "drifted", "share_drifted"])


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
    }
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
    assert body["drift"] == {"available": False, "reports": []}


async def test_data_with_facts_and_drift(warehouse: Client) -> None:
    a_few_minutes_of_traffic(warehouse, tenants=("acme", "globex"))
    create_drift_reports(warehouse, ("demo-gpt", "demo-small"))
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
    assert [(r["model"], r["drifted"], r["share_drifted"]) for r in drift["reports"]] == [
        ("demo-gpt", True, 0.25),
        ("demo-small", False, 0.5),
    ]


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


def test_refresh_interval_is_bounded() -> None:
    with pytest.raises(ValueError, match="refresh_s"):
        Dashboard(no_warehouse, refresh_s=0)


# ---------------------------------------------------------------- in Chromium


def served_here(url: str, requests: list[str]) -> list[str]:
    """The requests that went anywhere but the dashboard's own server."""
    return [r for r in requests if not r.startswith(url) and not r.startswith(("data:", "blob:", "about:"))]


async def test_dashboard_renders_in_chromium(warehouse: Client) -> None:
    tenants = ("acme", "globex", "initech", "umbrella")
    a_few_minutes_of_traffic(warehouse, tenants=tenants)
    async with serve(Dashboard(querier(warehouse), refresh_s=1.0)) as url:
        page = await render(
            f"{url}/dashboard?minutes=15",
            ARTIFACTS / "dashboard.png",
            wait_for_js="document.body.dataset.refreshes >= '2'",  # a refresh redraws without errors
            evaluate=PROBES,
        )
    assert page.console_errors == [], page.console
    assert served_here(url, page.requests) == []
    values = page.values
    assert values["dataset"]["rendered"] == "1"
    assert values["dataset"]["charts"] == str(len(CHARTS))
    assert "error" not in values["dataset"]
    assert values["plots"] == len(CHARTS)
    charts = {c["id"].removeprefix("chart-"): c for c in values["charts"]}
    assert set(charts) == set(CHARTS)
    for name, chart in charts.items():
        assert chart["traces"] > 0, name
        assert chart["points"] > 0, name
        assert chart["drawn"] > 0, name  # markers or bars actually drawn in the SVG
        assert chart["notes"] == [], name
    assert charts["ttft"]["traces"] == 2 * 3  # two models x p50/p95/p99
    assert charts["burn"]["shapes"] == [1]  # the budget line at 1.0
    assert sorted(values["spend_ticks"]) == sorted(tenants)
    assert values["requests_tile"] == "120"
    assert values["drift"] == "no drift reports yet"
    assert page.screenshot.stat().st_size > 10_000


async def test_empty_dashboard_renders_clean_charts(warehouse: Client, tmp_path: Path) -> None:
    async with serve(Dashboard(querier(warehouse))) as url:
        page = await render(f"{url}/dashboard?minutes=15", tmp_path / "empty.png", evaluate=PROBES)
    assert page.console_errors == [], page.console
    assert page.values["plots"] == len(CHARTS)
    for chart in page.values["charts"]:
        assert chart["points"] == 0
        assert chart["notes"] == ["no requests in the last 15 min"], chart["id"]
    assert page.values["requests_tile"] == "0"


async def test_names_from_the_data_are_shown_not_run(warehouse: Client, tmp_path: Path) -> None:
    a_few_minutes_of_traffic(warehouse, tenants=(EVIL, "acme"))
    create_drift_reports(warehouse, (EVIL,))
    async with serve(Dashboard(querier(warehouse))) as url:
        page = await render(f"{url}/dashboard", tmp_path / "evil.png", evaluate=PROBES)
    assert page.console_errors == [], page.console
    assert page.values["pwned"] == "undefined"
    assert page.values["injected"] == 0
    assert served_here(url, page.requests) == []  # the <img src=x> was never requested
    assert EVIL in page.values["spend_ticks"]  # shown as text, exactly
    assert EVIL in page.values["drift"]
