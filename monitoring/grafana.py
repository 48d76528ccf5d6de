"""The Grafana dashboard of the platform, generated from the metric catalogue (``sluice grafana dashboard``).

The dashboard is a Grafana JSON model (schema version 39): rows of time-series panels over Prometheus, each
query built here from a metric of :func:`monitoring.metrics.catalogue` (histograms as
``histogram_quantile`` over the rate of their ``_bucket`` series, counters as rates), plus two panels of
SQL over the warehouse through the ClickHouse datasource plugin (``grafana-clickhouse-datasource``).

Datasources are template variables (``$datasource`` for Prometheus, ``$warehouse`` for ClickHouse), so the
same file imports into any Grafana whatever its datasources' uids. :func:`build_dashboard` refuses a query
that names a metric the catalogue lacks; ``infra/grafana/sluicegate.json`` is its committed output and a
test keeps the two equal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monitoring.metrics import MetricInfo, catalogue

UID = "sluicegate-overview"
TITLE = "sluicegate"
PROMETHEUS_VAR = "datasource"
CLICKHOUSE_VAR = "warehouse"
CLICKHOUSE_PLUGIN = "grafana-clickhouse-datasource"

RATE = "$__rate_interval"
MODEL = 'model=~"$model"'
MODEL_OR_NONE = 'model=~"$model|"'
"""For counts a request may join before its model is known (most rejections: a bad key, a tenant's limit,
a body that does not parse, all counted with ``model=""``): those are shown whatever models are picked. A
review found the Rejections panel empty through a flood of 401s, its filter matching no empty model."""

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_METRIC_TOKEN = re.compile(r"\bsluice_[a-zA-Z0-9_]+")
_QUOTED = re.compile(r'"(?:[^"\\]|\\.)*"')

GRID_WIDTH = 24
PANEL_HEIGHT = 8


def series_names(metrics: Iterable[MetricInfo]) -> frozenset[str]:
    """Every series name a query may use: gauges and counters (``_total``) as scraped, histograms as their
    ``_bucket``, ``_sum`` and ``_count`` series."""
    names: set[str] = set()
    for metric in metrics:
        if metric.kind == "histogram":
            names.update(metric.name + suffix for suffix in HISTOGRAM_SUFFIXES)
        else:
            names.add(metric.name)
    return frozenset(names)


def metric_names(expr: str) -> set[str]:
    """The ``sluice_*`` series names a PromQL expression reads (label values in quotes are skipped)."""
    return set(_METRIC_TOKEN.findall(_QUOTED.sub('""', expr)))


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[Query, ...]
    unit: str = "short"
    width: int = 8
    stack: bool = False


@dataclass(frozen=True)
class SqlPanel:
    title: str
    description: str
    sql: str
    kind: str
    """``timeseries`` (the query returns a time column first) or ``table``."""
    width: int = 12


@dataclass(frozen=True)
class Row:
    title: str
    panels: Sequence[Panel | SqlPanel] = field(default_factory=tuple)


def quantiles(
    metric: str, by: str = "model", qs: Sequence[float] = (0.5, 0.9, 0.99), match: str = MODEL
) -> tuple[Query, ...]:
    """``histogram_quantile`` at each of ``qs`` over the rate of ``metric``'s buckets, grouped by ``by``."""
    selector = f"{{{match}}}" if match else ""
    group = f"le, {by}" if by else "le"
    legend = f"{{{{{by}}}}} " if by else ""
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({group}) (rate({metric}_bucket{selector}[{RATE}])))",
            f"{legend}p{round(q * 100)}",
        )
        for q in qs
    )


def rate_by(metric: str, by: str, match: str = MODEL) -> Query:
    selector = f"{{{match}}}" if match else ""
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Query(f"sum by ({by}) (rate({metric}{selector}[{RATE}]))", legend)


def gauge_by(metric: str, by: str, match: str = MODEL) -> Query:
    selector = f"{{{match}}}" if match else ""
    legend = " ".join(f"{{{{{label.strip()}}}}}" for label in by.split(","))
    return Query(f"sum by ({by}) ({metric}{selector})", legend)


def rows() -> list[Row]:
    """The dashboard's content, top to bottom."""
    return [
        Row(
            "Edge: what clients see",
            (
                Panel(
                    "Requests by outcome",
                    "Requests that ended per second, by outcome (completed, failed, cancelled, expired, shed).",
                    (rate_by("sluice_requests_total", "outcome"),),
                    "reqps",
                    stack=True,
                ),
                Panel(
                    "Rejections",
                    "Requests refused at the edge (4xx/5xx before running) per second, by status and reason;"
                    " those refused before their model was read (a bad key, a tenant's limit) are always shown.",
                    (rate_by("sluice_rejections_total", "status, reason", MODEL_OR_NONE),),
                    "reqps",
                ),
                Panel(
                    "In flight",
                    "Requests each model has on the edges now (streams submitted or resumed).",
                    (gauge_by("sluice_edge_requests_in_flight", "model"),),
                ),
                Panel(
                    "Time to first token",
                    "Streamed requests: request reaching the edge to its first token written.",
                    quantiles("sluice_time_to_first_token_seconds"),
                    "s",
                ),
                Panel(
                    "Inter-token latency",
                    "Streamed requests: gap between chunks per token.",
                    quantiles("sluice_inter_token_latency_seconds"),
                    "s",
                ),
                Panel(
                    "End-to-end latency",
                    "Completed requests: request reaching the edge to its terminal event.",
                    quantiles("sluice_e2e_request_latency_seconds"),
                    "s",
                ),
                Panel(
                    "Tokens per second",
                    "Prompt and completion tokens of requests that ended, as reported to clients.",
                    (
                        Query(
                            f"sum by (model) (rate(sluice_prompt_tokens_total{{{MODEL}}}[{RATE}]))",
                            "{{model}} prompt",
                        ),
                        Query(
                            f"sum by (model) (rate(sluice_generation_tokens_total{{{MODEL}}}[{RATE}]))",
                            "{{model}} completion",
                        ),
                    ),
                ),
                Panel(
                    "Cancels",
                    "Cancels the edges published per second, by reason.",
                    (rate_by("sluice_cancels_total", "reason"),),
                    "reqps",
                ),
            ),
        ),
        Row(
            "Workers: what the models do",
            (
                Panel(
                    "Queue wait",
                    "From a worker consuming a request to the request joining a batch.",
                    quantiles("sluice_worker_queue_wait_seconds"),
                    "s",
                ),
                Panel(
                    "Batch size",
                    "Sequences per forward pass (decode step or embedding batch).",
                    quantiles("sluice_worker_batch_size", qs=(0.5, 0.99)),
                ),
                Panel(
                    "Running and waiting",
                    "Requests in the running batch and waiting for a slot, summed over a model's workers.",
                    (
                        Query(
                            f"sum by (model) (sluice_worker_running_requests{{{MODEL}}})", "{{model}} running"
                        ),
                        Query(
                            f"sum by (model) (sluice_worker_waiting_requests{{{MODEL}}})", "{{model}} waiting"
                        ),
                    ),
                ),
                Panel(
                    "Token budget in use",
                    "Share of the running batch's token budget in use, the fullest worker of each model.",
                    (
                        Query(
                            f"max by (model) (sluice_worker_token_budget_usage_ratio{{{MODEL}}})", "{{model}}"
                        ),
                    ),
                    "percentunit",
                ),
                Panel(
                    "Step duration",
                    "One unit of model work (a decode step for the whole batch, or one embedding batch).",
                    quantiles("sluice_worker_step_seconds", qs=(0.5, 0.99)),
                    "s",
                ),
                Panel(
                    "Worker terminal events",
                    "Terminal events the workers produced per second, by status.",
                    (rate_by("sluice_worker_requests_total", "model, status"),),
                    "reqps",
                ),
                Panel(
                    "Workers serving",
                    "Worker processes serving each model version (sluice_model_info).",
                    (gauge_by("sluice_model_info", "model, version"),),
                ),
                Panel(
                    "Model memory",
                    "Memory held by the loaded models, by device.",
                    (gauge_by("sluice_model_memory_bytes", "model, device"),),
                    "bytes",
                ),
                Panel(
                    "Out of memory",
                    "Forward passes that ran out of device memory per second (an embedding batch then runs in "
                    "halves; a generation step's sequences end worker_oom). SluiceWorkerOutOfMemory alerts.",
                    (rate_by("sluice_worker_out_of_memory_total", "model"),),
                    "ops",
                ),
                Panel(
                    "Batch limit",
                    "The batch limit over the configured one, the lowest worker of each model: below 1 for a "
                    "while after running out of memory (it doubles back after 1,000 clean batches).",
                    (Query(f"min by (model) (sluice_worker_batch_limit_ratio{{{MODEL}}})", "{{model}}"),),
                    "percentunit",
                ),
            ),
        ),
        Row(
            "Kafka",
            (
                Panel(
                    "Consumer lag by group",
                    "Records between each partition's end and the group's committed offset, summed per "
                    "group (workers: sluice-workers.<model>.<version>; the KEDA scaler reads the same lag).",
                    (Query("sum by (group) (sluice_consumer_lag)", "{{group}}"),),
                    width=12,
                ),
                Panel(
                    "Dead letters",
                    "Records sent to the dead-letter topic per second, by source topic and reason.",
                    (rate_by("sluice_dead_letters_total", "topic, reason", match=""),),
                    width=12,
                ),
            ),
        ),
        Row(
            "Streams: the log into the warehouse",
            (
                Panel(
                    "Warehouse freshness",
                    "From an event's time to its rows being queryable in the warehouse.",
                    quantiles("sluice_streams_freshness_seconds", by="", qs=(0.5, 0.99), match=""),
                    "s",
                ),
                Panel(
                    "Events written",
                    "Events the streams worker wrote to the warehouse per second, by topic.",
                    (rate_by("sluice_streams_events_total", "topic", match=""),),
                    "ops",
                ),
                Panel(
                    "Warehouse writes",
                    "Duration of one warehouse write and events per write.",
                    (
                        *quantiles("sluice_streams_insert_seconds", by="", qs=(0.99,), match=""),
                        Query(
                            f"rate(sluice_streams_batch_size_sum[{RATE}]) / "
                            f"rate(sluice_streams_batch_size_count[{RATE}])",
                            "events per write",
                        ),
                    ),
                ),
                Panel(
                    "Audit chain",
                    "Audit entries appended per second, entries healed from the topic, chains in conflict.",
                    (
                        Query(f"rate(sluice_streams_audit_entries_total[{RATE}])", "appended/s"),
                        Query("sluice_streams_audit_healed_total", "healed (total)"),
                        Query("sluice_streams_audit_conflicts", "chains in conflict"),
                    ),
                ),
            ),
        ),
        Row(
            "Drift",
            (
                Panel(
                    "Drift verdict",
                    "1 while the latest all-tenant report of the model version says drift.",
                    (gauge_by("sluice_drift_detected", "model, version"),),
                ),
                Panel(
                    "Data-quality findings",
                    "Findings in the latest all-tenant drift report of the model version.",
                    (gauge_by("sluice_drift_quality_issues", "model, version"),),
                ),
                Panel(
                    "Age of the latest report",
                    "Seconds since the end of the window the latest drift report covers.",
                    (
                        Query(
                            f"time() - max by (model) (sluice_drift_last_report_timestamp_seconds{{{MODEL}}})",
                            "{{model}}",
                        ),
                    ),
                    "s",
                ),
            ),
        ),
        Row(
            "Rollouts",
            (
                Panel(
                    "Traffic share",
                    "Share of each model's traffic routed to each version by its latest deployment.",
                    (gauge_by("sluice_rollout_traffic_share", "model, version"),),
                    "percentunit",
                ),
                Panel(
                    "Gate state",
                    "The rollout gates' current state (one series per gate at 1).",
                    (
                        Query(
                            f"max by (model, gate, state) (sluice_rollout_gate_state{{{MODEL}}}) == 1",
                            "{{model}} {{gate}} {{state}}",
                        ),
                    ),
                ),
                Panel(
                    "Deployment decisions",
                    "Deployment changes seen by the rollout controller, by action and actor.",
                    (
                        Query(
                            f"sum by (model, action, actor) (increase(sluice_rollout_decisions_total{{{MODEL}}}[$__range]))",
                            "{{model}} {{action}} ({{actor}})",
                        ),
                    ),
                ),
            ),
        ),
        Row(
            "Async batches",
            (
                Panel(
                    "Batches running",
                    "Async batches the edges run now, by status.",
                    (gauge_by("sluice_batches", "status", match=""),),
                    stack=True,
                ),
                Panel(
                    "Batch lines in flight",
                    "Batch lines published and not ended yet (each edge at most SLUICE_EDGE_BATCH_MAX_IN_FLIGHT).",
                    (gauge_by("sluice_batch_lines_in_flight", "model"),),
                ),
                Panel(
                    "Batch lines ended",
                    "Batch lines that ended per second: completed, failed for good, retried.",
                    (rate_by("sluice_batch_lines_total", "model, outcome"),),
                    "ops",
                ),
            ),
        ),
        Row(
            "Warehouse (ClickHouse)",
            (
                SqlPanel(
                    "Requests per minute by status (warehouse)",
                    "Terminal requests per minute from request_facts (batch lines included, a rollout's shadow "
                    "copies not: they are no client's requests).",
                    "SELECT toStartOfMinute(finished) AS time, status, count() AS requests\n"
                    "FROM request_facts FINAL\n"
                    "WHERE $__timeFilter(finished) AND model IN (${model:singlequote}) AND shadow_of = ''\n"
                    "GROUP BY time, status\n"
                    "ORDER BY time",
                    "timeseries",
                ),
                SqlPanel(
                    "Latest batches",
                    "The newest async batches and their progress, from the batches table.",
                    "SELECT batch_id, tenant, argMax(model, seq) AS model, argMax(status, seq) AS status,\n"
                    "       argMax(completed, seq) AS completed, argMax(failed, seq) AS failed,\n"
                    "       max(total) AS total, min(created_at) AS created\n"
                    "FROM batches\n"
                    "WHERE $__timeFilter(created_at)\n"
                    "GROUP BY batch_id, tenant\n"
                    "ORDER BY created DESC\n"
                    "LIMIT 50",
                    "table",
                ),
            ),
        ),
    ]


class DashboardError(ValueError):
    """A panel's query names a metric that is not in the catalogue."""


def _check(panels: Iterable[Panel | SqlPanel], known: frozenset[str]) -> None:
    for panel in panels:
        if isinstance(panel, SqlPanel):
            continue
        for query in panel.queries:
            names = metric_names(query.expr)
            if not names:
                raise DashboardError(f"panel {panel.title!r}: {query.expr!r} names no sluice metric")
            unknown = sorted(names - known)
            if unknown:
                raise DashboardError(f"panel {panel.title!r}: unknown metrics {', '.join(unknown)}")


def _prometheus() -> dict[str, str]:
    return {"type": "prometheus", "uid": f"${{{PROMETHEUS_VAR}}}"}


def _clickhouse() -> dict[str, str]:
    return {"type": CLICKHOUSE_PLUGIN, "uid": f"${{{CLICKHOUSE_VAR}}}"}


def _timeseries(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never"}
    if panel.stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    return {
        "id": panel_id,
        "type": "timeseries",
        "title": panel.title,
        "description": panel.description,
        "datasource": _prometheus(),
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit, "custom": custom}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [
            {
                "datasource": _prometheus(),
                "expr": query.expr,
                "legendFormat": query.legend,
                "range": True,
                "refId": chr(ord("A") + index),
            }
            for index, query in enumerate(panel.queries)
        ],
    }


def _sql(panel: SqlPanel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": _clickhouse(),
        "gridPos": {"h": PANEL_HEIGHT, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {}, "overrides": []},
        "options": {},
        "targets": [
            {
                "datasource": _clickhouse(),
                "editorType": "sql",
                "queryType": "table" if panel.kind == "table" else "timeseries",
                # The plugin's formats: 0 time series, 1 table.
                "format": 1 if panel.kind == "table" else 0,
                "rawSql": panel.sql,
                "refId": "A",
            }
        ],
    }


def _templating() -> dict[str, Any]:
    return {
        "list": [
            {
                "name": PROMETHEUS_VAR,
                "label": "Prometheus",
                "type": "datasource",
                "query": "prometheus",
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
            },
            {
                "name": CLICKHOUSE_VAR,
                "label": "ClickHouse",
                "type": "datasource",
                "query": CLICKHOUSE_PLUGIN,
                "current": {},
                "hide": 0,
                "refresh": 1,
                "regex": "",
            },
            {
                "name": "model",
                "label": "model",
                "type": "query",
                "datasource": _prometheus(),
                "query": {"query": "label_values(sluice_model_info, model)", "refId": "models"},
                "definition": "label_values(sluice_model_info, model)",
                "includeAll": True,
                "multi": True,
                # No custom "allValue": Grafana does not format one, so All reached the warehouse panel's
                # SQL as a bare ".*" (a syntax error on every fresh load: an audit). Without it All is
                # every value, as a regex alternation for PromQL and a quoted list for the SQL.
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "refresh": 2,
                "sort": 1,
                "hide": 0,
                "regex": "",
            },
        ]
    }


def build_dashboard(metrics: Sequence[MetricInfo] | None = None) -> dict[str, Any]:
    """The dashboard's JSON model; raises :class:`DashboardError` if a query names an unknown metric."""
    known = series_names(catalogue() if metrics is None else metrics)
    layout = rows()
    panels: list[dict[str, Any]] = []
    panel_id, y = 1, 0
    for row in layout:
        _check(row.panels, known)
        panels.append(
            {
                "id": panel_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": GRID_WIDTH, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id, y, x, line_height = panel_id + 1, y + 1, 0, 0
        for panel in row.panels:
            if x + panel.width > GRID_WIDTH:
                x, y = 0, y + line_height
            made = (
                _sql(panel, panel_id, x, y)
                if isinstance(panel, SqlPanel)
                else _timeseries(panel, panel_id, x, y)
            )
            panels.append(made)
            panel_id, x, line_height = panel_id + 1, x + panel.width, PANEL_HEIGHT
        y += line_height
    return {
        "uid": UID,
        "title": TITLE,
        "description": "Generated by `sluice grafana dashboard` from monitoring/metrics.py; do not edit by hand.",
        "tags": ["sluicegate", "generated"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "utc",
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "annotations": {"list": []},
        "links": [],
        "templating": _templating(),
        "panels": panels,
    }


def render(dashboard: dict[str, Any]) -> str:
    """The dashboard as the committed file has it: indented JSON, sorted keys, a final newline."""
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
