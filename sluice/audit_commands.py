"""``sluice audit ...``: verify and show the tamper-evident audit log (docs/streams.md).

The checks live in :mod:`streams.audit` and :mod:`streams.anchor`; this module is only the command line, and
imports them when a command runs, so ``sluice --help`` stays quick.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from sluice.groups import command_group
from sluice.printable import printable

audit_app = command_group(
    help="The tamper-evident audit log: one hash chain per tenant in the warehouse's audit_log table, "
    "anchored on the audit topic (docs/streams.md)."
)


AuditTenantOption = Annotated[
    str | None, typer.Option("--tenant", "-t", help="only this tenant's chain (default: every tenant)")
]


@audit_app.command("verify")
def audit_verify(
    tenant: AuditTenantOption = None,
    warehouse_only: Annotated[
        bool,
        typer.Option(
            "--warehouse-only",
            help="check the table's own chains only, without the audit topic (cannot see a cut tail)",
        ),
    ] = False,
) -> None:
    """Check every tenant's hash chain in the warehouse's audit_log table, and against the audit topic.

    Per tenant, in seq order: seq counts 0, 1, 2 ... without gaps (a gap means deleted rows);
    each prev_hash is the previous entry's entry_hash (64 zeros for seq 0);
    each entry_hash is the SHA-256 of the row's canonical form (an altered row no longer matches).

    Then against the audit topic, where the streams worker publishes every entry before storing its row:
    a cut tail (the topic's chain goes past the warehouse's last seq, or the whole chain is gone), rows past
    the topic's last entry, rows that differ from the topic's entry of the same seq, and a topic chain that
    forks. Chains older than the topic's retention are checked by their hashes alone (said on stderr).

    Exit status: 0 every chain holds; 1 problems found (each printed), or --tenant names a tenant with no
    chain; 2 the warehouse or the topic cannot be read.
    """
    from rich.markup import escape

    from bus.errors import BusError
    from infra.warehouse import WarehouseError
    from sluice.cli import console, fail, out, settings, warehouse_failure
    from streams.anchor import AnchorError, verify_anchored
    from streams.audit import verify_warehouse

    try:
        if warehouse_only:
            report = verify_warehouse(settings(), tenant=tenant)
            problems, entries, tenants = report.problems, report.entries, report.tenants
            anchored = ""
        else:
            checked = verify_anchored(settings(), tenant=tenant)
            problems, entries, tenants = (
                checked.problems,
                checked.warehouse.entries,
                checked.warehouse.tenants,
            )
            anchored = f"; {checked.anchored} chains checked against the audit topic ({checked.topic_entries} entries)"
            if checked.unanchored:
                console.print(
                    f"[yellow]{len(checked.unanchored)} chain(s) have no entry on the audit topic (older than "
                    f"its retention): checked by their hashes alone: {escape(', '.join(checked.unanchored[:10]))}"
                    f"{' …' if len(checked.unanchored) > 10 else ''}[/]"
                )
    except WarehouseError as exc:
        raise warehouse_failure(exc) from None
    except (AnchorError, BusError) as exc:
        raise fail(f"{exc} (--warehouse-only checks the table alone)", 2) from None
    if not problems and tenant is not None and entries == 0:
        # A review: `--tenant acmee` (a typo) said "audit log verified" and exited 0, so a script checking
        # one tenant's chain was told it holds. No row in the warehouse and no problem means the topic has
        # no chain of the tenant either (a chain on the topic alone is a cut tail, reported above): nothing
        # was verified, and a tenant that has done nothing audited yet has no chain to vouch for.
        where = "in the warehouse" if warehouse_only else "in the warehouse or on the audit topic"
        raise fail(f"no audit chain for tenant {tenant!r} {where}: nothing verified (check the tenant id)")
    if not problems:
        out.print(f"audit log verified: {entries} entries in {tenants} tenant chains{anchored}")
        return
    for problem in problems:
        out.print(f"[red]tenant {escape(problem.tenant)!r} seq {problem.seq}: {escape(problem.reason)}[/]")
    chains = len({problem.tenant for problem in problems})
    out.print(
        f"[red]audit log verification FAILED:[/] {len(problems)} problem(s) in {chains} chain(s); "
        f"{entries} entries in {tenants} tenant chains{anchored}"
    )
    raise typer.Exit(1)


@audit_app.command("show")
def audit_show(
    tenant: AuditTenantOption = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, max=10_000, help="how many entries")] = 20,
) -> None:
    """Show the latest audit entries, newest first (hashes shortened to 12 characters)."""
    from infra.warehouse import WarehouseError
    from sluice.cli import console, out, settings, warehouse_failure
    from streams.audit import latest_entries

    try:
        result = latest_entries(settings(), tenant=tenant, limit=limit)
    except WarehouseError as exc:
        raise warehouse_failure(exc) from None
    from rich.text import Text

    columns = ("tenant", "seq", "actor", "action", "resource", "model_version", "request_id", "decision")
    table = Table(
        "time (UTC)", *columns, "details", "prev_hash", "entry_hash", title="audit log, latest first"
    )
    for values in result.rows:
        row = {column: str(value) for column, value in zip(result.columns, values, strict=True)}
        try:
            details = " ".join(f"{k}={v}" for k, v in json.loads(row["details"]).items())
        except (ValueError, AttributeError):
            details = row["details"]  # not a JSON object: show it as stored (verify reports it)
        time_text = row["time"].replace("T", " ").removesuffix("+00:00").removesuffix("000")
        cells = [time_text, *(row[column] for column in columns), details]
        table.add_row(
            *(Text(printable(cell)) for cell in cells),
            f"{row['prev_hash'][:12]}…",
            f"{row['entry_hash'][:12]}…",
        )
    out.print(table)
    if not result.rows:
        console.print("[yellow]no audit entries[/]")
