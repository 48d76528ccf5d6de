"""The Grafana dashboard: generated from the metric catalogue, committed as infra/grafana/sluicegate.json."""

from __future__ import annotations

import json
import re
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from infra.warehouse import migrate, open_warehouse
from monitoring.grafana import (
    CLICKHOUSE_PLUGIN,
    DashboardError,
    Panel,
    Query,
    Row,
    build_dashboard,
    metric_names,
    render,
    series_names,
)
from monitoring.metrics import catalogue
from schemas.settings import PlatformSettings
from sluice.cli import app

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "infra" / "grafana" / "sluicegate.json"


def _targets(dashboard: dict[str, Any], ds_type: str) -> list[dict[str, Any]]:
    return [
        target
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
        if target["datasource"]["type"] == ds_type
    ]


def _allowed() -> set[str]:
    """Series names written out by hand from the catalogue (not through grafana.series_names)."""
    allowed: set[str] = set()
    for metric in catalogue():
        if metric.kind == "histogram":
            allowed |= {f"{metric.name}_bucket", f"{metric.name}_sum", f"{metric.name}_count"}
        elif metric.kind == "counter":
            assert metric.name.endswith("_total")
            allowed.add(metric.name)
        else:
            allowed.add(metric.name)
    return allowed


def test_committed_dashboard_is_a_fresh_generation() -> None:
    assert COMMITTED.read_text(encoding="utf-8") == render(build_dashboard()), (
        "infra/grafana/sluicegate.json is stale: run `python -m sluice grafana dashboard --out "
        "infra/grafana/sluicegate.json`"
    )


def test_every_promql_expression_names_only_catalogue_metrics() -> None:
    dashboard = json.loads(COMMITTED.read_text(encoding="utf-8"))
    allowed = _allowed()
    exprs = [t["expr"] for t in _targets(dashboard, "prometheus")]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert len(exprs) > 40
    for expr in exprs:
        # Any identifier followed by `{`, `[`, `)` or an operator is a series unless it is a PromQL function,
        # keyword or a label in a grouping clause: strip those, then every remaining sluice_ name must exist.
        unquoted = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
        names = set(re.findall(r"\bsluice_\w+", unquoted))
        assert names, expr
        assert names <= allowed, (expr, names - allowed)
        for name in names:  # histograms are only read through their series, never by their base name
            assert not any(m.kind == "histogram" and m.name == name for m in catalogue()), expr


def test_histogram_panels_take_quantiles_over_bucket_rates() -> None:
    dashboard = build_dashboard()
    histograms = {m.name for m in catalogue() if m.kind == "histogram"}
    quantile_exprs = [
        t["expr"] for t in _targets(dashboard, "prometheus") if "histogram_quantile" in t["expr"]
    ]
    read = {name.removesuffix("_bucket") for e in quantile_exprs for name in metric_names(e)}
    for wanted in (
        "sluice_time_to_first_token_seconds",
        "sluice_inter_token_latency_seconds",
        "sluice_e2e_request_latency_seconds",
        "sluice_worker_queue_wait_seconds",
        "sluice_worker_batch_size",
        "sluice_streams_freshness_seconds",
    ):
        assert wanted in read
    assert read <= histograms
    for expr in quantile_exprs:
        assert re.search(r"rate\(sluice_\w+_bucket", expr), expr
        assert re.search(r"sum by \(le\b", expr), expr


def test_dashboard_covers_the_brief() -> None:
    exprs = " ".join(t["expr"] for t in _targets(build_dashboard(), "prometheus"))
    for metric in (
        "sluice_requests_total",
        "sluice_rejections_total",
        "sluice_edge_requests_in_flight",
        "sluice_worker_running_requests",
        "sluice_worker_waiting_requests",
        "sluice_consumer_lag",
        "sluice_dead_letters_total",
        "sluice_drift_detected",
        "sluice_rollout_traffic_share",
        "sluice_batches",
        "sluice_batch_lines_in_flight",
        "sluice_batch_lines_total",
    ):
        assert re.search(rf"\b{metric}\b", exprs), metric


def test_layout_and_datasources() -> None:
    dashboard = build_dashboard()
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    assert variables["warehouse"]["query"] == CLICKHOUSE_PLUGIN
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] >= 0
        assert pos["x"] + pos["w"] <= 24
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] in ("${datasource}", "${warehouse}")
    # no two panels overlap
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


def test_an_unknown_metric_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from monitoring import grafana

    bad = [Row("x", (Panel("typo", "", (Query("rate(sluice_request_total[5m])", ""),)),))]
    monkeypatch.setattr(grafana, "rows", lambda: bad)
    with pytest.raises(DashboardError, match="sluice_request_total"):
        build_dashboard()
    # a histogram's base name is not a series
    bad[0] = Row("x", (Panel("base", "", (Query("rate(sluice_worker_batch_size[5m])", ""),)),))
    with pytest.raises(DashboardError, match="sluice_worker_batch_size"):
        build_dashboard()


def test_series_names_and_parsing() -> None:
    names = series_names(catalogue())
    assert "sluice_time_to_first_token_seconds_bucket" in names
    assert "sluice_time_to_first_token_seconds" not in names
    assert "sluice_requests_total" in names
    assert metric_names('sum(rate(sluice_requests_total{outcome="sluice_x"}[5m]))') == {
        "sluice_requests_total"
    }


def test_cli_writes_the_committed_file(tmp_path: Path) -> None:
    out = tmp_path / "dash.json"
    result = CliRunner().invoke(app, ["grafana", "dashboard", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text(encoding="utf-8") == COMMITTED.read_text(encoding="utf-8")
    stdout = CliRunner().invoke(app, ["grafana", "dashboard"])
    assert json.loads(stdout.stdout)["uid"] == "sluicegate-overview"


def test_all_models_reach_every_query_as_the_models_themselves() -> None:
    """Found by an audit: the model variable's custom "allValue" (".*") is inserted as it is, unformatted
    (Grafana formats only the values it chose): the warehouse panel read ``model IN (.*)``, a syntax error,
    in the dashboard's default state. Without it, All is every model, formatted for each query."""
    (model,) = [v for v in build_dashboard()["templating"]["list"] if v["name"] == "model"]
    assert model["includeAll"]
    assert model.get("allValue") in (None, "")


def test_clickhouse_panels_run_against_the_warehouse_schema(tmp_path: Path) -> None:
    """The SQL panels' queries, with the plugin's macros expanded, run on a migrated (empty) warehouse."""
    sqls = [t["rawSql"] for t in _targets(build_dashboard(), CLICKHOUSE_PLUGIN)]
    assert len(sqls) == 2
    client = open_warehouse(PlatformSettings(data_dir=str(tmp_path / "data")))
    try:
        migrate(client)
        for sql in sqls:
            expanded = re.sub(
                r"\$__timeFilter\((\w+)\)", r"\1 >= now() - INTERVAL 1 HOUR AND \1 <= now()", sql
            ).replace("${model:singlequote}", "'demo-gpt','all-minilm-l6-v2'")
            assert "$" not in expanded, expanded
            client.query(expanded)
    finally:
        client.close()


def test_the_warehouse_panels_count_clients_requests_and_one_row_a_batch(tmp_path: Path) -> None:
    """Found by an audit: the requests panel counted a rollout's shadow copies (4 completed and 4 failed
    where clients sent 4 that completed), and the batches panel grouped by model, so a batch's first state
    (model not known yet) showed as a second, ghost row until the table's parts merged."""
    import msgspec

    from tests.streams.test_queries import batch_state, event, insert_batches, insert_facts, now_ms

    requests_sql, batches_sql = (
        re.sub(
            r"\$__timeFilter\((\w+)\)", r"\1 >= now() - INTERVAL 1 HOUR AND \1 <= now()", t["rawSql"]
        ).replace("${model:singlequote}", "'demo-gpt'")
        for t in _targets(build_dashboard(), CLICKHOUSE_PLUGIN)
    )
    client = open_warehouse(PlatformSettings(data_dir=str(tmp_path / "data")))
    try:
        migrate(client)
        now = now_ms() - timedelta(seconds=2)  # within the panel's range (its end is now(), in seconds)
        served = [event(finished=now) for _ in range(4)]
        shadows = [
            msgspec.structs.replace(event(finished=now, status="failed"), shadow_of=s.request_id)
            for s in served
        ]
        insert_facts(client, [*served, *shadows])
        counted = client.query(requests_sql).result_rows
        assert [(status, n) for _, status, n in counted] == [("completed", 4)]
        created = now.replace(second=0, microsecond=0)
        insert_batches(client, [batch_state(0, "validating", created_at=created)])
        insert_batches(client, [batch_state(1, "in_progress", created_at=created)])  # another part
        (row,) = client.query(batches_sql).named_results()
        assert (row["model"], row["status"]) == ("demo-gpt", "in_progress")
    finally:
        client.close()


def test_the_rejections_panel_shows_refusals_made_before_the_model_was_read() -> None:
    """Found by a review: the edge counts a refusal made before it read the body's model (a bad key, a
    tenant's limit, a body that does not parse) with ``model=""``, and the Rejections panel's
    ``model=~"$model"`` (Grafana's "All" is the served models, ``(a|b)``) matched none of them: the panel
    stayed empty through a flood of 401s. Such refusals are shown whatever models are picked."""
    (panel,) = [p for p in build_dashboard()["panels"] if p.get("title") == "Rejections"]
    (target,) = panel["targets"]
    matcher = re.search(r'model=~"([^"]*)"', target["expr"])
    assert matcher is not None, target["expr"]
    for picked, shown, hidden in (
        ("(tiny\\-gpt|minilm)", "minilm", "other"),
        ("tiny\\-gpt", "tiny-gpt", "minilm"),
    ):
        regex = matcher.group(1).replace("$model", picked)
        assert re.fullmatch(regex, "")
        assert re.fullmatch(regex, shown)
        assert not re.fullmatch(regex, hidden)
