"""``sluice drift ...``: the latest drift verdicts, one report feature by feature, and an operator's
acceptance of a shift as the new normal (``rebaseline``; docs/drift.md).

The detection lives in :mod:`streams.drift` and :mod:`drift`; this module is only the command line, and
imports them when a command runs, so ``sluice --help`` stays quick.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.table import Table

from sluice.groups import command_group

if TYPE_CHECKING:
    from schemas.events import DeploymentChanged

drift_app = command_group(
    help="Drift detection: per model version and window, evidently tests of request features against a "
    "reference window (docs/drift.md)."
)


@drift_app.command("status")
def drift_status(
    model: Annotated[str | None, typer.Option("--model", "-m", help="only this model")] = None,
) -> None:
    """The latest verdict per model, version and scope ('*' = all tenants): drift, no_drift, reference,
    insufficient_data or data_quality, with the drifted features and data-quality findings."""
    from infra.warehouse import WarehouseError, query_warehouse
    from sluice.cli import _cell, out, settings, warehouse_failure
    from streams.queries import SAVED

    try:
        result = query_warehouse(settings(), SAVED["drift-status"].sql)
    except WarehouseError as exc:
        raise warehouse_failure(exc) from None
    rows = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
    rows = [r for r in rows if model is None or r["model"] == model]
    if not rows:
        out.print("no drift reports yet" + (f" for {model}" if model else "") + " (see docs/drift.md)")
        return
    colour = {"drift": "red", "data_quality": "yellow", "insufficient_data": "dim"}
    table = Table(*result.columns, title="drift: latest verdict per model, version and scope")
    for row in rows:
        cells = [_cell(row[c]) for c in result.columns]
        style = colour.get(str(row.get("verdict")), "green")
        table.add_row(*cells, style=style)
    out.print(table)


@drift_app.command("report")
def drift_report(
    model: Annotated[str, typer.Argument(help="the model id, e.g. demo-gpt")],
    version: Annotated[
        str | None,
        typer.Option(
            "--version",
            help="model version (default: the newest window's, of the version with the most requests in it)",
        ),
    ] = None,
    tenant: Annotated[str, typer.Option("--tenant", help="a tenant's own report; '*' = all tenants")] = "*",
    window: Annotated[
        str | None, typer.Option("--window", help="window start, ISO 8601 UTC (default: the latest window)")
    ] = None,
    html: Annotated[
        Path | None, typer.Option("--html", help="write evidently's HTML report for that window here")
    ] = None,
    no_embeddings: Annotated[
        bool, typer.Option("--no-embeddings", help="leave the embedding widgets out of the HTML (faster)")
    ] = False,
) -> None:
    """Show one drift report (the latest by default) feature by feature; with --html, sample the same
    reference and current windows again from the warehouse and write evidently's report."""
    import asyncio
    from datetime import UTC, datetime

    from rich.markup import escape

    from infra.warehouse import WarehouseError, query_warehouse
    from schemas.settings import load_settings
    from sluice.cli import console, fail, out, settings, warehouse_failure
    from streams.drift import StoredReport, findings, latest_report_sql, recompute_html
    from streams.settings import StreamsSettings

    if html is not None and not html.parent.is_dir():  # before evidently's minute of work, not after
        what = "is not a directory" if html.parent.exists() else "does not exist"
        raise fail(f"--html {html}: {html.parent} {what}", 2)
    if html is not None and html.is_dir():
        raise fail(f"--html {html} is a directory: name the file to write", 2)
    start = None
    if window is not None:
        try:
            start = datetime.fromisoformat(window)
        except ValueError:
            raise fail(f"--window {window!r} is not an ISO 8601 time", 2) from None
        start = start if start.tzinfo is not None else start.replace(tzinfo=UTC)
    platform = settings()

    def rows(sql: str) -> list[dict[str, Any]]:
        result = query_warehouse(platform, sql, max_rows=100_000)
        return [dict(zip(result.columns, row, strict=True)) for row in result.rows]

    try:
        found = rows(latest_report_sql(model, version, tenant, start))
    except WarehouseError as exc:
        raise warehouse_failure(exc) from None
    if not found:
        raise fail(f"no drift report for {model} (scope {tenant}); `sluice drift status` lists them", 1)
    report = StoredReport.of(found[0])
    reference = (
        f"{report.reference.start:%Y-%m-%d %H:%M:%S} - {report.reference.end:%H:%M:%S}"
        if report.reference is not None
        else "none yet"
    )
    out.print(
        f"[bold]{escape(model)}[/] {escape(report.key.model_version)} scope {escape(tenant)}: window "
        f"{report.window.start:%Y-%m-%d %H:%M:%S} - {report.window.end:%H:%M:%S} UTC, reference {reference}: "
        f"[bold]{report.verdict}[/] ({report.requests} requests, sampled {report.n_reference} vs "
        f"{report.n_current}, alpha {report.alpha})"
    )
    table = Table("feature", "kind", "test", "statistic", "threshold", "drifted", "missing")
    for feature in report.features:
        table.add_row(
            feature.name,
            feature.kind,
            feature.method,
            f"{feature.statistic:.4g}",
            f"{feature.threshold:.4g}",
            "[red]yes[/]" if feature.drifted else "no",
            f"{feature.null_share:.0%}",
        )
    if report.features:
        out.print(table)
    real = findings(report.quality)
    for line in report.quality:
        out.print(f"[yellow]data quality:[/] {escape(line)}" if line in real else f"note: {escape(line)}")
    if html is None:
        return

    async def query(sql: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(rows, sql)

    with console.status("sampling the windows again and running evidently…"):
        try:
            made = asyncio.run(
                recompute_html(query, report, load_settings(StreamsSettings), embeddings=not no_embeddings)
            )
        except (WarehouseError, ValueError) as exc:
            raise fail(str(exc)) from None
    try:
        html.write_text(made.html, encoding="utf-8")
    except OSError as exc:
        raise fail(f"cannot write {html}: {exc.strerror or exc}") from None
    out.print(
        f"wrote {html} (evidently report: {made.n_reference} reference vs {made.n_current} current rows)"
    )
    if (made.n_reference, made.n_current) != (report.n_reference, report.n_current):
        out.print(
            f"[yellow]warning:[/] the verdict saw {report.n_reference} reference vs {report.n_current} current "
            "rows: the warehouse holds other rows of these windows now (retention, a rebuild), so the page may "
            "disagree with it"
        )


class DriftError(ValueError):
    """An operator request that cannot be carried out (the message says why and what to do)."""


def rebaseline_version(
    model: str, requested: str | None, known: Sequence[str], deployment: DeploymentChanged | None
) -> str:
    """The version ``sluice drift rebaseline`` moves: the one asked for, which must have drift reports or
    serve ``model``; by default the one the deployment calls stable, else the only one with reports."""
    serving = sorted(v for v, share in deployment.traffic.items() if share > 0) if deployment else []
    candidates = sorted({*known, *serving})
    if not candidates:
        raise DriftError(f"{model} has no drift reports and no deployment: nothing to rebaseline "
                         "(`sluice drift status` lists what is monitored)")  # fmt: skip
    if requested is not None:
        if requested not in candidates:
            raise DriftError(f"{model} has no version {requested!r} with drift reports or traffic; "
                             f"known: {', '.join(candidates)}")  # fmt: skip
        return requested
    if deployment is not None and deployment.stable in candidates:
        return deployment.stable
    if len(candidates) == 1:
        return candidates[0]
    raise DriftError(f"{model} has several versions ({', '.join(candidates)}): pass --version")


@drift_app.command("rebaseline")
def drift_rebaseline(
    model: Annotated[str, typer.Argument(help="the model id, e.g. demo-gpt")],
    reason: Annotated[
        str, typer.Option("--reason", help="why the shift is expected (kept in the audit log)")
    ],
    version: Annotated[
        str | None,
        typer.Option("--version", help="model version (default: the stable one the deployment serves)"),
    ] = None,
) -> None:
    """Accept a shift in a model version's traffic as its new normal: its drift references (all tenants'
    and each tenant's) taken before now are dropped, and the first window after now becomes the reference
    later windows are compared with. Published as a DriftRebaselined on the control topic (audited); the
    streams worker acts on it at its next drift evaluation."""
    from bus.errors import BusError
    from infra.warehouse import WarehouseError, query_warehouse
    from schemas.events import DriftRebaselined
    from sluice.cli import fail, out, settings, warehouse_failure
    from sluice.rollout import RolloutError, deployment_of, publish
    from streams.drift import versions_sql

    if not reason.strip():
        raise fail("--reason must say why the shift is expected", 2)
    platform = settings()
    try:
        result = query_warehouse(platform, versions_sql(model))
        known = [str(row[0]) for row in result.rows]
    except WarehouseError as exc:
        raise warehouse_failure(exc) from None
    try:
        chosen = rebaseline_version(model, version, known, deployment_of(platform, model))
        event = DriftRebaselined(
            tenant="",
            model=model,
            source="sluice/cli",
            version=chosen,
            reason=reason.strip(),
            actor="operator",
        )
        publish(platform, event)
    except (DriftError, RolloutError) as exc:
        raise fail(str(exc), 2) from None
    except BusError as exc:
        raise fail(f"cannot reach Kafka at {platform.bootstrap}: {exc} (is `sluice up` running?)") from None
    out.print(
        f"[bold]{model}[/] {chosen}: rebaselined at {event.time:%Y-%m-%d %H:%M:%S} UTC; the first drift window "
        "that starts after it becomes the reference (the windows before are reported as `reference` too, "
        "with a note). `sluice drift status` shows the verdicts."
    )
