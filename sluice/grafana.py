"""``sluice grafana``: the Grafana dashboard generated from the metric catalogue (``monitoring/grafana.py``)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from sluice.groups import command_group

grafana_app = command_group(
    help="Grafana dashboards generated from the metric catalogue (monitoring/metrics.py)."
)


@grafana_app.command("dashboard")
def dashboard(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="write the dashboard JSON here instead of stdout", dir_okay=False),
    ] = None,
) -> None:
    """Write the platform's dashboard (Prometheus and ClickHouse datasources chosen by template variables);
    infra/grafana/sluicegate.json is this command's output."""
    from monitoring.grafana import build_dashboard, render

    text = render(build_dashboard())
    if out is None:
        sys.stdout.write(text)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}", err=True)
