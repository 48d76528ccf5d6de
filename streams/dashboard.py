"""The dashboard: one HTML page that draws the warehouse's SLIs, spend and drift with Plotly.

:class:`Dashboard` adds four routes to an aiohttp app:

- ``GET /dashboard``: the page (static HTML; no data is ever written into it);
- ``GET /dashboard/app.js``: the page's script, which fetches ``/dashboard/data`` every ``refresh_s``
  seconds and draws the charts with ``Plotly.react``;
- ``GET /dashboard/data?minutes=60``: the series as JSON, from SQL over the facts and views
  (:func:`streams.queries.dashboard_sql`) for the last ``minutes`` (1 to 1440) whole minutes;
- ``GET /dashboard/plotly.min.js``: the plotly.js bundle that ships inside the installed ``plotly``
  Python package, read once and kept in memory (gzipped too). Nothing is loaded from elsewhere.

The drift panel reads ``drift_reports`` (when the warehouse has it): each model version's latest
all-tenant verdict as a table (a coloured badge, the window, sample sizes, the drifted features and the
data-quality findings) and a strip of its last windows' verdicts drawn with Plotly.

The batch panel reads ``batches`` (when the warehouse has it): every async batch still running and those
created in the last day (at most :data:`streams.queries.BATCH_PANEL_ROWS`), with tenant, model, status, a
progress bar (completed and failed lines of the total), when it was created and what its lines cost so far.
The latency charts leave batch lines out (they wait in the batch lane by design), as the SLI views do.

Tenant, model, batch and feature names (and quality findings) are user data: the script puts them into the page
with ``textContent`` and into Plotly's labels HTML-escaped (Plotly reads a subset of HTML in labels), and
the page's Content Security Policy allows scripts from this server only, so a name like ``<script>`` is
shown, never run.

When its first render is done the script sets ``document.body.dataset.rendered = "1"`` and
``dataset.charts`` to the number of charts drawn (``dataset.refreshes`` counts renders), so a browser
test can wait for it.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import importlib.util
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from infra.warehouse.client import JsonValue, to_json_value
from monitoring.slo import DEFAULT_CONFIG, SloConfig
from streams.queries import DEFAULT_MINUTES, MAX_MINUTES, dashboard_sql

__all__ = ["Dashboard", "Query", "parse_minutes", "plotly_js_path"]

log = logging.getLogger(__name__)

Query = Callable[[str], Awaitable[list[dict[str, Any]]]]
"""Runs one SELECT on the warehouse and returns its rows as dicts (column name -> value)."""

_MINUTE = "%Y-%m-%d %H:%M:%S"
_CSP = (
    "default-src 'none'; script-src 'self'; connect-src 'self'; img-src 'self' data:; "
    "style-src 'self' 'unsafe-inline'; font-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)  # Plotly sets inline styles; everything else comes from this server only.


def parse_minutes(raw: str | None) -> int:
    """The ``minutes`` query parameter: a whole number from 1 to :data:`MAX_MINUTES` (default 60)."""
    if raw is None or raw == "":
        return DEFAULT_MINUTES
    if raw.isascii() and raw.isdigit() and len(raw) <= 5 and 1 <= int(raw) <= MAX_MINUTES:
        return int(raw)
    shown = raw if len(raw) <= 20 else raw[:20] + "…"
    raise ValueError(f"minutes must be a whole number from 1 to {MAX_MINUTES}, got {shown!r}")


def plotly_js_path() -> Path:
    """``plotly.min.js`` inside the installed ``plotly`` package (found without importing it)."""
    spec = importlib.util.find_spec("plotly")
    locations = spec.submodule_search_locations if spec is not None else None
    if not locations:
        raise FileNotFoundError("the plotly package is not installed")
    path = Path(next(iter(locations))) / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (a plotly install without its bundled plotly.js)")
    return path


class _Asset(msgspec.Struct, frozen=True):
    body: bytes
    gzipped: bytes
    etag: str


def _load_plotly() -> _Asset:
    path = plotly_js_path()
    body = path.read_bytes()
    etag = f'"{hashlib.sha256(body).hexdigest()[:20]}"'
    return _Asset(body, gzip.compress(body, compresslevel=6, mtime=0), etag)


class Dashboard:
    def __init__(
        self,
        query: Query,
        *,
        slo: SloConfig | None = None,
        refresh_s: float = 5.0,
    ) -> None:
        if not 0.5 <= refresh_s <= 3600:
            raise ValueError(f"refresh_s must be between 0.5 and 3600 seconds, got {refresh_s}")
        self._query = query
        self._slo = slo if slo is not None else DEFAULT_CONFIG
        self._refresh_s = refresh_s
        self._plotly: _Asset | None = None
        self._plotly_lock = asyncio.Lock()

    def add_to(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self._page)
        app.router.add_get("/dashboard/app.js", self._script)
        app.router.add_get("/dashboard/data", self._data)
        app.router.add_get("/dashboard/plotly.min.js", self._plotly_js)

    async def data(self, minutes: int, *, now: datetime | None = None) -> dict[str, Any]:
        """What ``/dashboard/data?minutes=`` answers: every series of the last ``minutes`` minutes."""
        probe = dashboard_sql(minutes, self._slo)
        (rollouts_probe,) = await self._query(probe.rollouts_exist)
        rollouts_present = bool(rollouts_probe["present"])
        batches_present = bool((await self._query(probe.batches_exist))[0]["present"])
        sql = dashboard_sql(
            minutes,
            self._slo,
            shadows=rollouts_present,
            batch_lines=batches_present,
            positioned=bool(rollouts_probe.get("positioned")),
        )
        latency = await self._rows(sql.latency)
        traffic = await self._rows(sql.traffic)
        spend = await self._rows(sql.spend)
        drift_present = bool((await self._query(sql.drift_exists))[0]["present"])
        drift_status = await self._rows(sql.drift_status) if drift_present else []
        drift_history = await self._rows(sql.drift_history) if drift_status else []
        rollouts = await self._rows(sql.rollouts) if rollouts_present else []
        for row in rollouts:
            row["traffic"] = json.loads(str(row["traffic"]) or "{}")
            row["evidence"] = json.loads(str(row["evidence"]) or "[]")

        batches = await self._rows(sql.batches) if batches_present else []
        for row in spend:
            row["usd"] = _usd(row["cost_nanos"])
        for row in batches:
            row["usd"] = _usd(row["cost_nanos"])
        completed = sum(_int(r["completed"]) for r in traffic)
        errors = sum(_int(r["errors"]) for r in traffic)
        models = sorted({str(r["model"]) for r in traffic} | {str(r["model"]) for r in latency})
        until = (now or datetime.now(UTC)).replace(microsecond=0)
        since = until.replace(second=0) - timedelta(minutes=minutes - 1)
        return {
            "minutes": minutes,
            "since": since.strftime(_MINUTE),
            "until": until.strftime(_MINUTE),
            "refresh_s": self._refresh_s,
            "summary": {
                "requests": sum(_int(r["requests"]) for r in traffic),
                "completed": completed,
                "errors": errors,
                "error_rate": errors / (completed + errors) if completed + errors else 0.0,
                "completion_tokens": sum(_int(r["completion_tokens"]) for r in traffic),
                "spend_usd": _usd(spend[0]["total_nanos"]) if spend else 0.0,
                "tenants": _int(spend[0]["tenants"]) if spend else 0,
            },
            "targets": {model: self._target(model) for model in models},
            "latency": latency,
            "traffic": traffic,
            "spend": spend,
            "drift": {"available": drift_present, "status": drift_status, "history": drift_history},
            "rollouts": rollouts,
            "batches": {"available": batches_present, "batches": batches},
        }

    def _target(self, model: str) -> dict[str, Any]:
        tier = self._slo.tier_of(model)
        return {
            "tier": tier.name,
            "availability": tier.availability,
            "error_budget": round(1 - tier.availability, 10),
        }

    async def _rows(self, sql: str) -> list[dict[str, Any]]:
        return [{key: to_json_value(value) for key, value in row.items()} for row in await self._query(sql)]

    # ---------------------------------------------------------------- routes

    async def _page(self, request: web.Request) -> web.Response:
        page = _PAGE.replace("{refresh_ms}", str(round(self._refresh_s * 1000)))
        return web.Response(text=page, content_type="text/html", headers=_headers(no_store=True))

    async def _script(self, request: web.Request) -> web.Response:
        return web.Response(text=_SCRIPT, content_type="text/javascript", headers=_headers(no_store=True))

    async def _data(self, request: web.Request) -> web.Response:
        try:
            minutes = parse_minutes(request.query.get("minutes"))
        except ValueError as exc:
            return _json({"error": str(exc)}, status=400)
        try:
            body = await self.data(minutes)
        except Exception:  # whatever the warehouse raised: the page shows it and tries again
            log.exception("dashboard: a warehouse query failed")
            return _json({"error": "a warehouse query failed (the streams log has the details)"}, status=503)
        return _json(body)

    async def _plotly_js(self, request: web.Request) -> web.Response:
        asset = await self._plotly_asset()
        headers = {"Cache-Control": "public, max-age=86400", "ETag": asset.etag, "Vary": "Accept-Encoding"}
        headers.update(_headers(no_store=False))
        if request.headers.get("If-None-Match") == asset.etag:
            return web.Response(status=304, headers=headers)
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            headers["Content-Encoding"] = "gzip"
            return web.Response(body=asset.gzipped, content_type="text/javascript", headers=headers)
        return web.Response(body=asset.body, content_type="text/javascript", headers=headers)

    async def _plotly_asset(self) -> _Asset:
        async with self._plotly_lock:
            if self._plotly is None:
                try:
                    self._plotly = await asyncio.to_thread(_load_plotly)
                except FileNotFoundError as exc:
                    raise web.HTTPServiceUnavailable(text=str(exc)) from exc
            return self._plotly


def _headers(*, no_store: bool) -> dict[str, str]:
    headers = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff"}
    if no_store:
        headers["Cache-Control"] = "no-store"
    return headers


def _json(body: Mapping[str, Any], *, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        content_type="application/json",
        headers=_headers(no_store=True),
    )


def _int(value: JsonValue) -> int:
    return int(value) if isinstance(value, (int, float, str)) else 0


def _usd(nanos: JsonValue) -> float:
    return _int(nanos) / 1e9


_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>sluicegate dashboard</title>
<link rel="icon" href="data:,">
<style>
  body { margin: 0; font: 14px/1.4 system-ui, sans-serif; background: #f5f6f8; color: #1d2430; }
  header { display: flex; gap: 16px; align-items: center; padding: 12px 20px; background: #1d2430;
           color: #fff; }
  header h1 { font-size: 18px; margin: 0; font-weight: 600; }
  header label { margin-left: auto; }
  #status { font-size: 12px; opacity: .8; min-width: 16em; text-align: right; }
  #status.error { color: #ffb4a9; opacity: 1; }
  main { padding: 16px 20px; }
  .tiles { display: grid; grid-template-columns: repeat(5, 1fr); gap: 12px; margin-bottom: 12px; }
  .tile { background: #fff; border-radius: 6px; padding: 10px 14px; box-shadow: 0 1px 2px #0001; }
  .tile .label { font-size: 12px; color: #5b6575; }
  .tile .value { font-size: 22px; font-weight: 600; }
  .grid { display: grid; grid-template-columns: 1fr 1fr; gap: 12px; }
  .panel { background: #fff; border-radius: 6px; padding: 6px; box-shadow: 0 1px 2px #0001; }
  .chart { height: 320px; }
  #drift table, #rollouts table { border-collapse: collapse; width: 100%; }
  #rollouts th, #rollouts td { text-align: left; vertical-align: top; padding: 4px 8px;
                               border-bottom: 1px solid #e3e6eb; }
  #rollouts h2 { font-size: 15px; margin: 6px 8px; }
  #rollouts .empty { color: #5b6575; margin: 6px 8px 10px; }
  #drift th, #drift td { text-align: left; vertical-align: top; padding: 4px 8px;
                         border-bottom: 1px solid #e3e6eb; }
  #drift h2 { font-size: 15px; margin: 6px 8px; }
  #drift .empty { color: #5b6575; margin: 6px 8px 10px; }
  #drift .none { color: #8a93a3; }
  #drift .finding { color: #8a4b00; }
  #drift .when { white-space: nowrap; }
  .verdict { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff; font-size: 12px;
             font-weight: 600; white-space: nowrap; background: #80868b; }
  .verdict.v-drift { background: #b3261e; }
  .verdict.v-data_quality { background: #e8710a; }
  .verdict.v-insufficient_data { background: #80868b; }
  .verdict.v-no_drift, .verdict.v-reference { background: #188038; }
  #batches table { border-collapse: collapse; width: 100%; }
  #batches th, #batches td { text-align: left; vertical-align: middle; padding: 4px 8px;
                             border-bottom: 1px solid #e3e6eb; }
  #batches h2 { font-size: 15px; margin: 6px 8px; }
  #batches .empty { color: #5b6575; margin: 6px 8px 10px; }
  #batches .when { white-space: nowrap; }
  #batches .id { font-family: ui-monospace, monospace; font-size: 12px; }
  .progress { display: flex; width: 160px; height: 10px; border-radius: 5px; background: #e3e6eb;
              overflow: hidden; }
  .progress .done { background: #188038; }
  .progress .failed { background: #b3261e; }
  .progress-text { font-size: 12px; color: #5b6575; }
  .verdict.b-in_progress, .verdict.b-validating, .verdict.b-finalizing { background: #1f77b4; }
  .verdict.b-completed { background: #188038; }
  .verdict.b-failed, .verdict.b-expired { background: #b3261e; }
  .verdict.b-cancelling, .verdict.b-cancelled { background: #80868b; }
</style>
</head>
<body data-refresh-ms="{refresh_ms}">
<header>
  <h1>sluicegate</h1>
  <span>times in UTC</span>
  <label>window
    <select id="window">
      <option value="15">15 min</option>
      <option value="60">1 hour</option>
      <option value="180">3 hours</option>
      <option value="360">6 hours</option>
      <option value="1440">24 hours</option>
    </select>
  </label>
  <span id="status">loading…</span>
</header>
<main>
  <section class="tiles">
    <div class="tile"><div class="label">requests</div><div class="value" id="tile-requests">&ndash;</div></div>
    <div class="tile"><div class="label">error rate</div><div class="value" id="tile-errors">&ndash;</div></div>
    <div class="tile"><div class="label">tokens generated</div><div class="value" id="tile-tokens">&ndash;</div></div>
    <div class="tile"><div class="label">spend (USD)</div><div class="value" id="tile-spend">&ndash;</div></div>
    <div class="tile"><div class="label">tenants</div><div class="value" id="tile-tenants">&ndash;</div></div>
  </section>
  <section class="grid">
    <div class="panel"><div class="chart" id="chart-ttft"></div></div>
    <div class="panel"><div class="chart" id="chart-itl"></div></div>
    <div class="panel"><div class="chart" id="chart-throughput"></div></div>
    <div class="panel"><div class="chart" id="chart-errors"></div></div>
    <div class="panel"><div class="chart" id="chart-burn"></div></div>
    <div class="panel"><div class="chart" id="chart-spend"></div></div>
  </section>
  <section class="panel" id="drift" style="margin-top: 12px">
    <h2>Drift (all tenants; latest window per model version)</h2>
    <div id="drift-body"><p class="empty">loading…</p></div>
    <div id="chart-drift" hidden></div>
  </section>
  <section class="panel" id="rollouts" style="margin-top: 12px">
    <h2>Rollouts (decisions per model, newest first, with the gates behind them)</h2>
    <div id="rollouts-body"><p class="empty">loading…</p></div>
  </section>
  <section class="panel" id="batches" style="margin-top: 12px">
    <h2>Batches (running, then created in the last 24 hours; lines billed at the batch price)</h2>
    <div id="batches-body"><p class="empty">loading…</p></div>
  </section>
</main>
<script src="/dashboard/plotly.min.js"></script>
<script src="/dashboard/app.js"></script>
</body>
</html>
"""

_SCRIPT = r"""
"use strict";
(function () {
  const body = document.body;
  const refreshMs = Number(body.dataset.refreshMs) || 5000;
  const select = document.getElementById("window");
  const status = document.getElementById("status");
  const PLOT_CONFIG = { displaylogo: false, responsive: true, showLink: false, showSendToCloud: false };
  const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"];
  let renders = 0;

  const initial = new URLSearchParams(window.location.search).get("minutes");
  if (initial && Array.from(select.options).some((o) => o.value === initial)) {
    select.value = initial;
  } else {
    select.value = "60";
  }

  // Plotly reads a subset of HTML (tags and a few entities) in every label, so text from the data is
  // escaped before it gets there: with no "<" no tag can form, and "&" stays itself.
  function esc(value) {
    return String(value).replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;");
  }

  function byModel(rows) {
    const groups = new Map();
    for (const row of rows) {
      const key = String(row.model);
      if (!groups.has(key)) groups.set(key, []);
      groups.get(key).push(row);
    }
    return groups;
  }

  // One line per model and field: [field, label, dash].
  function lines(rows, fields, extra) {
    const traces = [];
    let i = 0;
    for (const [model, points] of byModel(rows)) {
      const color = COLORS[i++ % COLORS.length];
      for (const [field, label, dash] of fields) {
        traces.push(Object.assign({
          type: "scatter", mode: "lines+markers", connectgaps: false,
          name: esc(model) + " " + label,
          x: points.map((p) => p.t), y: points.map((p) => p[field]),
          line: { color: color, dash: dash || "solid", width: 2 }, marker: { size: 4 },
        }, extra ? extra(field) : {}));
      }
    }
    return traces;
  }

  function layout(data, title, yaxis, more) {
    return Object.assign({
      title: { text: title, font: { size: 15 }, x: 0.01, xanchor: "left" },
      margin: { l: 60, r: 20, t: 40, b: 40 },
      xaxis: { type: "date", range: [data.since, data.until] },
      yaxis: Object.assign({ rangemode: "tozero" }, yaxis),
      legend: { orientation: "h", y: -0.2 },
      annotations: [],
      showlegend: true,
      uirevision: "keep",
    }, more);
  }

  // An empty window still draws its axes, with a note instead of lines.
  function noteIfEmpty(traces, lay, data) {
    if (traces.some((t) => t.x.length > 0)) return lay;
    const note = {
      text: "no requests in the last " + data.minutes + " min", showarrow: false,
      xref: "paper", yref: "paper", x: 0.5, y: 0.5, font: { size: 14, color: "#5b6575" },
    };
    return Object.assign({}, lay, { annotations: lay.annotations.concat([note]) });
  }

  function charts(data) {
    const burnLine = {
      type: "line", xref: "paper", x0: 0, x1: 1, y0: 1, y1: 1, line: { color: "#b3261e", dash: "dot" },
    };
    const spend = data.spend.slice(0, 20);
    const spendTraces = [{
      type: "bar", name: "spend",
      x: spend.map((r) => esc(r.tenant)), y: spend.map((r) => r.usd),
      customdata: spend.map((r) => r.requests),
      hovertemplate: "%{x}<br>$%{y:.6f}<br>%{customdata} requests<extra></extra>",
      marker: { color: "#1f77b4" },
    }];
    return {
      ttft: [
        lines(data.latency, [["ttft_p50_ms", "p50", "dot"], ["ttft_p95_ms", "p95", "dash"],
                             ["ttft_p99_ms", "p99", "solid"]]),
        layout(data, "Time to first token (ms)", { title: { text: "ms" } }),
      ],
      itl: [
        lines(data.latency, [["itl_p50_ms", "p50", "dot"], ["itl_p99_ms", "p99", "solid"]]),
        layout(data, "Mean inter-token gap per request (ms; not the ITL SLO's per-token latency)",
               { title: { text: "ms" } }),
      ],
      throughput: [
        lines(data.traffic, [["requests", "requests/min", "solid"], ["tokens_per_s", "tokens/s", "dot"]],
              (field) => (field === "tokens_per_s" ? { yaxis: "y2" } : {})),
        layout(data, "Throughput", { title: { text: "requests/min" } }, {
          yaxis2: { title: { text: "tokens/s" }, overlaying: "y", side: "right", rangemode: "tozero" },
          margin: { l: 60, r: 60, t: 40, b: 40 },
        }),
      ],
      errors: [
        lines(data.traffic, [["error_rate", "error rate", "solid"]]),
        layout(data, "Error rate (failed + expired)",
               { tickformat: ".1%", title: { text: "" } }),
      ],
      burn: [
        lines(data.traffic, [["burn_rate", "burn rate", "solid"]]),
        layout(data, "Burn rate (error rate / error budget; 1 = on budget)",
               { title: { text: "x budget" } }, { shapes: [burnLine] }),
      ],
      spend: [
        spendTraces,
        Object.assign(layout(data, "Spend per tenant, top 20",
                             { title: { text: "USD" }, tickprefix: "$", tickformat: ",.6~f" }), {
          xaxis: { type: "category", title: { text: "tenant" } }, showlegend: false,
          margin: { l: 80, r: 20, t: 40, b: 40 },
        }),
      ],
    };
  }

  function setTiles(summary) {
    const pct = (x) => (100 * x).toFixed(2) + "%";
    document.getElementById("tile-requests").textContent = summary.requests.toLocaleString("en-US");
    document.getElementById("tile-errors").textContent = pct(summary.error_rate);
    document.getElementById("tile-tokens").textContent = summary.completion_tokens.toLocaleString("en-US");
    document.getElementById("tile-spend").textContent = "$" + summary.spend_usd.toFixed(6);
    document.getElementById("tile-tenants").textContent = String(summary.tenants);
  }

  function cell(row, text, className) {
    const td = document.createElement(row.parentNode && row.parentNode.tagName === "THEAD" ? "th" : "td");
    td.textContent = text;
    if (className) td.className = className;
    row.appendChild(td);
  }

  // Verdict -> [label, colour, marker in the history strip] (the colours match the .verdict classes; a
  // reference window is a green diamond, a window without drift a green square); any other verdict grey.
  const VERDICTS = {
    drift: ["drift", "#b3261e", "square"],
    data_quality: ["data quality", "#e8710a", "square"],
    insufficient_data: ["insufficient data", "#80868b", "square"],
    no_drift: ["no drift", "#188038", "square"],
    reference: ["reference", "#188038", "diamond"],
  };
  const VERDICT_ORDER = ["reference", "no_drift", "insufficient_data", "data_quality", "drift"];

  function verdictOf(value) {
    const key = String(value);
    const known = Object.prototype.hasOwnProperty.call(VERDICTS, key);
    if (!known) return { key: "", label: key, color: "#80868b", symbol: "square" };
    const [label, color, symbol] = VERDICTS[key];
    return { key: key, label: label, color: color, symbol: symbol };
  }

  function modelVersion(row) {
    return String(row.model) + " / " + String(row.model_version);
  }

  function percent(value) {
    const share = Number(value);
    return Number.isFinite(share) ? (100 * share).toFixed(1) + "%" : "\u2013";
  }

  // A cell holding one line of text per item, or a grey dash when there are none.
  function listCell(row, items, className) {
    const td = row.insertCell();
    if (!Array.isArray(items) || items.length === 0) {
      td.textContent = "\u2013";
      td.className = "none";
      return;
    }
    for (const item of items) {
      const line = document.createElement("div");
      line.textContent = String(item);
      if (className) line.className = className;
      td.appendChild(line);
    }
  }

  // One row per deployment change: who decided what, the traffic after it, and the gates behind it.
  function setRollouts(rollouts) {
    const target = document.getElementById("rollouts-body");
    target.replaceChildren();
    if (!rollouts || rollouts.length === 0) {
      const p = document.createElement("p");
      p.className = "empty";
      p.textContent = "no rollouts yet (sluice rollout start --help)";
      target.appendChild(p);
      return;
    }
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    for (const title of ["time (UTC)", "model", "action", "phase", "by", "traffic", "step", "gates", "reason"]) {
      cell(head, title);
    }
    const rows = table.createTBody();
    for (const r of rollouts) {
      const row = rows.insertRow();
      cell(row, String(r.time), "when");
      cell(row, String(r.model));
      cell(row, String(r.action));
      const badge = document.createElement("span");
      badge.className = "verdict" + (r.phase === "rolled_back" ? " v-drift" : r.phase === "canary" || r.phase === "warming" ? "" : " v-no_drift");
      badge.textContent = String(r.phase);
      row.insertCell().appendChild(badge);
      cell(row, String(r.actor));
      listCell(row, Object.entries(r.traffic).map(([v, s]) => v + " " + percent(Number(s))));
      cell(row, String(r.step) + " / " + String(r.steps));
      listCell(row, r.evidence.map((g) => g.gate + " " + g.state +
        (g.candidate === null || g.candidate === undefined ? "" :
          ": " + String(g.candidate) + " vs " + String(g.baseline) + " (limit " + String(g.limit) + ", n=" +
          String(g.candidate_n) + "/" + String(g.baseline_n) + ")")));
      cell(row, String(r.reason));
    }
    target.appendChild(table);
  }

  // One row per batch: who, which model, its status, a bar of its lines done (green: completed, red:
  // failed) of the total, when it was created and what its finished lines cost so far.
  function setBatches(batches) {
    const target = document.getElementById("batches-body");
    target.replaceChildren();
    if (!batches || !batches.available || batches.batches.length === 0) {
      const p = document.createElement("p");
      p.className = "empty";
      p.textContent = batches && batches.available ? "no batches in the last 24 hours" : "no batches yet";
      target.appendChild(p);
      return;
    }
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    for (const title of ["batch", "tenant", "model", "status", "progress", "created (UTC)", "cost so far"]) {
      cell(head, title);
    }
    const rows = table.createTBody();
    for (const b of batches.batches) {
      const row = rows.insertRow();
      cell(row, String(b.batch_id), "id");
      cell(row, String(b.tenant));
      cell(row, String(b.model));
      const badge = document.createElement("span");
      badge.className = "verdict b-" + String(b.status).replace(/[^a-z_]/g, "");
      badge.textContent = String(b.status);
      row.insertCell().appendChild(badge);
      const total = Number(b.total), done = Number(b.completed), failed = Number(b.failed);
      const share = (n) => (total > 0 ? Math.min(100, (100 * n) / total) : 0);
      const progress = row.insertCell();
      const bar = document.createElement("div");
      bar.className = "progress";
      bar.title = done + " completed, " + failed + " failed of " + total;
      for (const [name, n] of [["done", done], ["failed", failed]]) {
        const part = document.createElement("span");
        part.className = name;
        part.style.width = share(n).toFixed(2) + "%";
        bar.appendChild(part);
      }
      const text = document.createElement("div");
      text.className = "progress-text";
      text.textContent = (done + failed).toLocaleString("en-US") + " / " + total.toLocaleString("en-US") +
        (failed ? " (" + failed.toLocaleString("en-US") + " failed)" : "");
      progress.appendChild(bar);
      progress.appendChild(text);
      cell(row, String(b.created), "when");
      cell(row, "$" + Number(b.usd).toFixed(6));
    }
    target.appendChild(table);
  }

  function setDrift(drift) {
    const target = document.getElementById("drift-body");
    target.replaceChildren();
    if (!drift.available || drift.status.length === 0) {
      const p = document.createElement("p");
      p.className = "empty";
      p.textContent = drift.available ? "no drift reports in the table yet" : "no drift reports yet";
      target.appendChild(p);
      return;
    }
    const table = document.createElement("table");
    const head = table.createTHead().insertRow();
    const titles = ["model", "version", "status", "window (UTC)", "n current / reference", "requests",
                    "share drifted", "drifted features", "data quality"];
    for (const title of titles) cell(head, title);
    const rows = table.createTBody();
    for (const report of drift.status) {
      const row = rows.insertRow();
      const verdict = verdictOf(report.verdict);
      cell(row, String(report.model));
      cell(row, String(report.model_version));
      const badge = document.createElement("span");
      badge.className = "verdict" + (verdict.key ? " v-" + verdict.key : "");
      badge.textContent = verdict.label;
      row.insertCell().appendChild(badge);
      cell(row, String(report.window_start) + " \u2013 " + String(report.window_end), "when");
      cell(row, String(report.n_current) + " / " + String(report.n_reference));
      cell(row, Number(report.requests).toLocaleString("en-US"));
      cell(row, percent(report.share_drifted));
      listCell(row, report.drifted_features);
      listCell(row, report.quality, "finding");
    }
    target.appendChild(table);
  }

  // The history strip: one marker per window and model version, coloured by verdict (one trace per
  // verdict, so the legend names the colours). Returns null when there is nothing to draw.
  function driftHistory(drift) {
    if (!drift.available || drift.history.length === 0) return null;
    const keys = [];
    for (const row of drift.status.concat(drift.history)) {
      const key = esc(modelVersion(row));
      if (!keys.includes(key)) keys.push(key);
    }
    const groups = new Map();
    for (const row of drift.history) {
      const verdict = verdictOf(row.verdict);
      const name = verdict.key || String(row.verdict);
      if (!groups.has(name)) groups.set(name, { verdict: verdict, rows: [] });
      groups.get(name).rows.push(row);
    }
    const rank = (name) => {
      const at = VERDICT_ORDER.indexOf(name);
      return at < 0 ? VERDICT_ORDER.length : at;
    };
    const names = Array.from(groups.keys())
      .sort((a, b) => rank(a) - rank(b) || (a < b ? -1 : a > b ? 1 : 0));
    const traces = names.map((name) => {
      const group = groups.get(name);
      return {
        type: "scatter", mode: "markers", name: esc(group.verdict.label),
        x: group.rows.map((r) => r.window_end),
        y: group.rows.map((r) => esc(modelVersion(r))),
        customdata: group.rows.map((r) => [
          esc(r.window_start), percent(r.share_drifted), String(r.features_drifted),
          String(r.features_tested),
        ]),
        hovertemplate: "%{y}<br>" + esc(group.verdict.label) + "<br>%{customdata[0]} \u2013 %{x}<br>" +
          "%{customdata[2]} of %{customdata[3]} features drifted (%{customdata[1]})<extra></extra>",
        marker: {
          symbol: group.verdict.symbol, size: 14, color: group.verdict.color, line: { width: 1, color: "#fff" },
        },
      };
    });
    const lay = {
      title: { text: "Drift verdict per window (last windows, all tenants)", font: { size: 15 }, x: 0.01,
               xanchor: "left" },
      height: 150 + 34 * keys.length,
      margin: { l: 20, r: 20, t: 50, b: 50 },
      xaxis: { type: "date", title: { text: "window end (UTC)" } },
      yaxis: { type: "category", categoryorder: "array", categoryarray: keys.slice().reverse(),
               automargin: true },
      legend: { orientation: "h", x: 1, xanchor: "right", y: 1.02, yanchor: "bottom" },
      showlegend: true,
      uirevision: "keep",
    };
    return [traces, lay];
  }

  async function drawDriftHistory(drift) {
    const chart = document.getElementById("chart-drift");
    const history = driftHistory(drift);
    if (history === null) {
      Plotly.purge(chart);
      chart.hidden = true;
      return false;
    }
    chart.hidden = false;
    await Plotly.react(chart, history[0], history[1], PLOT_CONFIG);
    return true;
  }

  async function draw(data) {
    setTiles(data.summary);
    setDrift(data.drift);
    setRollouts(data.rollouts);
    setBatches(data.batches);
    const all = charts(data);
    let drawn = 0;
    for (const [name, [traces, lay]] of Object.entries(all)) {
      await Plotly.react("chart-" + name, traces, noteIfEmpty(traces, lay, data), PLOT_CONFIG);
      drawn += 1;
    }
    if (await drawDriftHistory(data.drift)) drawn += 1;
    return drawn;
  }

  async function refresh() {
    const minutes = select.value;
    try {
      const response = await fetch("/dashboard/data?minutes=" + encodeURIComponent(minutes),
                                    { cache: "no-store" });
      const data = await response.json();
      if (!response.ok) throw new Error(data.error || ("HTTP " + response.status));
      const drawn = await draw(data);
      renders += 1;
      body.dataset.charts = String(drawn);
      body.dataset.refreshes = String(renders);
      body.dataset.rendered = "1";
      delete body.dataset.error;
      status.className = "";
      status.textContent = "updated " + data.until + " UTC";
    } catch (err) {
      body.dataset.error = String(err && err.message ? err.message : err);
      status.className = "error";
      status.textContent = "refresh failed: " + body.dataset.error;
    }
  }

  let timer = null;
  async function loop() {
    await refresh();
    timer = window.setTimeout(loop, refreshMs);
  }

  select.addEventListener("change", () => {
    const url = new URL(window.location.href);
    url.searchParams.set("minutes", select.value);
    window.history.replaceState(null, "", url);
    if (timer !== null) window.clearTimeout(timer);
    loop();
  });

  loop();
})();
"""
