"""``sluice``: the one command line for running, provisioning and querying the platform."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from schemas.settings import PlatformSettings, SettingsError, describe, display, load_settings
from sluice.audit_commands import audit_app
from sluice.batch import batch_app
from sluice.capacity import capacity
from sluice.drift_commands import drift_app
from sluice.grafana import grafana_app
from sluice.groups import command_group
from sluice.printable import printable
from sluice.rollout_commands import rollout_app
from sluice.services import SERVICE_SETTINGS, local_broker, started_broker

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

    from infra.kafka.broker import LocalKafkaCluster
    from monitoring.slo import SloConfig

# Piped output (scripts, tests) gets wide lines instead of rich's 80-column default. No emoji codes: rich
# turned the data ``root:x:0:0`` into ``root❌0:0`` (``escape`` covers markup only).
console = Console(stderr=True, soft_wrap=True, width=None if sys.stderr.isatty() else 200, emoji=False)
out = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200, emoji=False)

app = command_group(
    help="sluicegate: event-sourced, observability-first online model serving on Kafka.",
    name="sluice",
    add_completion=False,
    pretty_exceptions_enable=False,
)
kafka_app = command_group(help="Run the local Kafka broker, or a local cluster of them (KRaft).")
topics_app = command_group(help="Create and inspect the platform's topics (declared in infra/topics.py).")
schemas_app = command_group(help="Event contracts for downstream teams.")
warehouse_app = command_group(help="The ClickHouse warehouse (embedded chDB by default).")
app.add_typer(kafka_app, name="kafka")
app.add_typer(topics_app, name="topics")
app.add_typer(schemas_app, name="schemas")
app.add_typer(warehouse_app, name="warehouse")
models_app = command_group(help="The served models (built or linked into $SLUICE_CACHE_DIR/models).")
app.add_typer(models_app, name="models")
slo_app = command_group(
    help="Service level objectives per model tier, and the Prometheus alerting rules generated from them."
)
app.add_typer(slo_app, name="slo")
app.add_typer(audit_app, name="audit")
app.add_typer(drift_app, name="drift")
app.add_typer(batch_app, name="batch")
app.add_typer(grafana_app, name="grafana")
app.add_typer(rollout_app, name="rollout")
app.command("capacity")(capacity)


def settings() -> PlatformSettings:
    """The platform settings, read once per process."""
    global _settings
    if _settings is None:
        try:
            _settings = load_settings(PlatformSettings)
        except SettingsError as exc:
            console.print(f"[red]settings error:[/] {escape(str(exc))}")
            raise typer.Exit(2) from None
    return _settings


_settings: PlatformSettings | None = None


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print ``message`` (plain text, never markup) as an error; the exit to raise with ``code``."""
    console.print(f"[red]error:[/] {escape(message)}")
    return typer.Exit(code)


# ---------------------------------------------------------------- kafka


@kafka_app.command("up")
def kafka_up(
    brokers: Annotated[
        int | None,
        typer.Option(
            "--brokers",
            min=1,
            max=9,
            help="Nodes of the local cluster, each a broker and a KRaft controller (default "
            "$SLUICE_KAFKA_BROKERS, 1). With 3: replication factor 3, min.insync.replicas 2.",
        ),
    ] = None,
) -> None:
    """Start the local broker, or a cluster of them, in the background (data kept in $SLUICE_DATA_DIR/kafka
    across restarts)."""
    from infra.errors import InfraError
    from infra.kafka.broker import replication_for

    s = settings()
    if not s.local_kafka:
        raise fail(
            f"SLUICE_KAFKA_BOOTSTRAP={s.kafka_bootstrap} points at an existing cluster; nothing to start"
        )
    wanted = brokers or s.kafka_brokers
    try:
        broker = started_broker(s, console)
        if any(pid is not None for pid in broker.pids()):
            if len(broker.nodes) != wanted:
                raise fail(
                    f"a local Kafka of {len(broker.nodes)} broker(s) runs at {broker.bootstrap}; "
                    "`sluice kafka down` stops it"
                )
            if broker.running():
                out.print(f"Kafka already running at {escape(broker.bootstrap)} ({_pids(broker)})")
                return
        else:
            broker = local_broker(s, console, wanted)
        with console.status(f"starting Kafka {s.kafka_version} (first run fetches jars from Maven Central)"):
            broker.start()
    except InfraError as exc:
        raise fail(str(exc)) from None
    out.print(
        f"Kafka {s.kafka_version} up at {escape(broker.bootstrap)} ({_pids(broker)}), "
        f"data in {escape(str(broker.data_dir))}"
    )
    if wanted != s.kafka_brokers:
        console.print(
            f"set SLUICE_KAFKA_BROKERS={wanted} (and SLUICE_KAFKA_REPLICATION_FACTOR="
            f"{replication_for(wanted)[0]}) so that every sluice command bootstraps from all the brokers "
            "and replicates its topics"
        )


def _pids(broker: LocalKafkaCluster) -> str:
    pids = ", ".join("-" if pid is None else str(pid) for pid in broker.pids())
    return f"pid {pids}" if len(broker.nodes) == 1 else f"{len(broker.nodes)} brokers, pids {pids}"


@kafka_app.command("down")
def kafka_down() -> None:
    """Stop the local broker, or every node of the local cluster, cleanly (their data stays)."""
    from infra.errors import InfraError

    try:
        broker = started_broker(settings(), console)
    except InfraError as exc:
        raise fail(str(exc)) from None
    if all(pid is None for pid in broker.pids()):
        out.print("Kafka is not running")
        return
    broker.stop()
    out.print("Kafka stopped" if len(broker.nodes) == 1 else f"Kafka stopped ({len(broker.nodes)} brokers)")


@kafka_app.command("status")
def kafka_status() -> None:
    """Say whether Kafka answers, and where (with a local cluster: how many of its brokers the metadata
    lists). Exit code 1 when it does not answer, or when a local cluster misses a broker."""
    from infra.errors import InfraError
    from infra.kafka.broker import broker_answers, live_brokers

    s = settings()
    if s.local_kafka:
        try:
            broker = started_broker(s, console)
        except InfraError as exc:
            raise fail(str(exc)) from None
        pids = broker.pids()
        live = live_brokers(broker.connection) if any(pid is not None for pid in pids) else 0
        if live == 0 and any(pid is not None for pid in pids):
            # Its JVM runs but does not answer: starting, recovering its logs or shutting down. Not "down":
            # `sluice kafka up` waits for it rather than starting another (a review).
            out.print(
                f"Kafka (local) is not answering yet at {escape(broker.bootstrap)} ({_pids(broker)}): "
                f"starting, recovering or stopping; its log is in {escape(str(broker.data_dir))}"
            )
            raise typer.Exit(1)
        if live == 0:
            out.print(f"Kafka (local) is down; `sluice kafka up` starts it at {escape(broker.bootstrap)}")
            raise typer.Exit(1)
        where = escape(f"{broker.bootstrap}, {_pids(broker)}, data {broker.data_dir}")
        if live < len(broker.nodes) or None in pids:
            out.print(
                f"Kafka (local, {s.kafka_version}) is degraded: {live} of {len(broker.nodes)} brokers "
                f"listed at {where}; `sluice kafka up --brokers {len(broker.nodes)}` restarts the missing ones"
            )
            raise typer.Exit(1)
        out.print(f"Kafka (local, {s.kafka_version}) is up at {where}")
    elif broker_answers(s.kafka, timeout=5):
        out.print(f"Kafka (external) answers at {escape(s.bootstrap)}")
    else:
        out.print(f"Kafka (external) does not answer at {escape(s.bootstrap)}")
        raise typer.Exit(1)


@kafka_app.command("fetch")
def kafka_fetch() -> None:
    """Download the Kafka jars into the cache without starting anything (CI warms this)."""
    from infra.kafka.dist import KafkaFetchError, fetch_kafka

    s = settings()
    try:
        with console.status(f"resolving Kafka {s.kafka_version} from Maven Central"):
            home = fetch_kafka(
                s.cache_dir,
                s.kafka_version,
                lambda artifact: console.print(f"  [dim]downloaded {artifact}[/]"),
            )
    except KafkaFetchError as exc:
        raise fail(str(exc)) from None
    out.print(f"Kafka {s.kafka_version} jars in {escape(str(home))}")


# ---------------------------------------------------------------- topics


def _admin(s: PlatformSettings) -> AdminClient:
    """An admin client whose librdkafka log lines stay out of the terminal (:func:`quiet_admin`)."""
    from infra.topics import quiet_admin

    return quiet_admin(s.kafka)


@topics_app.command("apply")
def topics_apply() -> None:
    """Create or update every platform topic to match the spec; idempotent. Reports each change."""
    from infra.errors import InfraError
    from infra.topics import TopicSpecError, apply_topics, topics_of

    s = settings()
    try:
        changes = apply_topics(_admin(s), topics_of(s))
    except TopicSpecError as exc:  # the cluster answered: no "is Kafka running?"
        raise fail(str(exc)) from None
    except InfraError as exc:
        raise fail(f"{exc} (is Kafka running at {s.bootstrap}? `sluice up` or `sluice kafka up`)") from None
    table = Table("topic", "action", "detail", title=escape(f"topics on {s.bootstrap}"))
    for change in changes:
        style = "dim" if change.action == "unchanged" else "green"
        table.add_row(escape(change.name), f"[{style}]{change.action}[/]", escape(change.detail))
    out.print(table)


@topics_app.command("list")
def topics_list() -> None:
    """List the cluster's platform topics with partitions, and the spec's purpose of each."""
    from infra.errors import InfraError
    from infra.topics import describe_topics, topics_of

    s = settings()
    purposes = {t.name: t for t in topics_of(s)}
    try:
        listed = describe_topics(_admin(s), s.topic_prefix)
    except InfraError as exc:
        raise fail(f"{exc} (is Kafka running at {s.bootstrap}? `sluice up` or `sluice kafka up`)") from None
    table = Table("topic", "partitions", "cleanup", "purpose", title=escape(f"topics on {s.bootstrap}"))
    for name, partitions in listed:
        spec = purposes.get(name)
        table.add_row(
            escape(name),
            str(partitions),
            spec.config.get("cleanup.policy", "") if spec else "",
            spec.purpose if spec else "[yellow]not in spec[/]",
        )
    out.print(table)


# ---------------------------------------------------------------- schemas


@schemas_app.command("export")
def schemas_export(directory: Annotated[Path, typer.Argument(help="folder to write into")]) -> None:
    """Write one JSON Schema per event type (plus index.json) into DIRECTORY."""
    from schemas.jsonschema import export_json_schemas

    paths = export_json_schemas(directory)
    out.print(f"wrote {len(paths)} files to {escape(str(directory))}")


# ---------------------------------------------------------------- warehouse


@warehouse_app.command("migrate")
def warehouse_migrate() -> None:
    """Apply pending DDL migrations (idempotent; recorded in schema_migrations)."""
    from infra.warehouse import WarehouseError, migrate, open_warehouse

    try:
        client = open_warehouse(settings())
        try:
            applied = migrate(client, progress=lambda name: console.print(f"  applying {name}"))
        finally:
            client.close()
    except WarehouseError as exc:
        raise fail(str(exc)) from None
    if applied:
        out.print(f"applied {len(applied)} migration(s): " + ", ".join(m.name for m in applied))
    else:
        out.print("warehouse is up to date")


@app.command("sql")
def sql(
    query: Annotated[
        str | None, typer.Argument(help='e.g. "SELECT count() FROM request_facts FINAL" (or use --saved)')
    ] = None,
    fmt: Annotated[
        str,
        typer.Option(
            "--format",
            "-f",
            help="table, json (one JSON array of row objects), jsonl (one JSON object per line) or csv",
        ),
    ] = "table",
    max_rows: Annotated[int, typer.Option("--max-rows", min=1, help="stop after this many rows")] = 10_000,
    saved: Annotated[
        str | None, typer.Option("--saved", "-s", help="run a saved query by name (see --list-saved)")
    ] = None,
    list_saved: Annotated[bool, typer.Option("--list-saved", help="list the saved queries and exit")] = False,
) -> None:
    """Run one read-only SQL statement on the warehouse (through the running platform if it owns chDB).

    One SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS statement; several statements and INTO OUTFILE
    are refused. Tables: request_facts (one row per request; read with FINAL), batches (one row per async
    batch; read with FINAL), audit_log, events_raw, drift_features, drift_reports, deployments,
    schema_migrations; views sli_minute, errors_minute, spend_minute, spend_day (see docs/streams.md)."""
    from infra.warehouse import WarehouseError, WarehouseQueryError, query_warehouse
    from infra.warehouse.client import DEFAULT_MAX_RESULT_BYTES, check_query_text
    from streams.queries import saved_queries

    # the SLO targets and windows of SLUICE_STREAMS_SLO_FILE, as the dashboard and the burn events use
    # (error-budget-left said the built-in defaults' whatever the file said: a review)
    named = saved_queries(_slo_config(None)[0]) if list_saved or saved is not None else {}
    if list_saved:
        listing = Table("name", "what it answers", title="saved queries (sluice sql --saved NAME)")
        for name, entry in named.items():
            listing.add_row(escape(name), escape(entry.description))
        out.print(listing)
        return
    if saved is not None:
        if query is not None:
            raise fail("give either a query or --saved NAME, not both", 2)
        if saved not in named:
            raise fail(f"no saved query {saved!r}; saved: {', '.join(named)}", 2)
        query = named[saved].sql
    if query is None:
        raise fail("give a query, or --saved NAME (--list-saved shows them)", 2)
    if fmt not in ("table", "json", "jsonl", "csv"):
        raise fail("--format must be table, json, jsonl or csv", 2)
    try:
        check_query_text(query)
    except WarehouseQueryError as exc:
        raise fail(str(exc), 2) from None
    try:
        result = query_warehouse(settings(), query, max_rows=max_rows)
    except WarehouseError as exc:
        raise fail(str(exc)) from None
    if fmt in ("json", "jsonl"):
        # Plain text on stdout, never rich's coloured, indented print_json: a review found each row printed
        # as an indented object after the other, which neither ``json.load`` nor a line reader could parse.
        # ``json`` is one document (``[]`` for no rows), one row a line; ``jsonl`` is JSON Lines.
        lines = [_json_row(dict(zip(result.columns, row, strict=True))) for row in result.rows]
        if fmt == "json":
            sys.stdout.write("[\n" + ",\n".join(lines) + "\n]\n" if lines else "[]\n")
        else:
            sys.stdout.writelines(line + "\n" for line in lines)
    elif fmt == "csv":
        import csv

        writer = csv.writer(sys.stdout)
        if result.columns:
            writer.writerow(result.columns)
        writer.writerows(result.rows)
    elif result.columns:
        table = Table(*(escape(column) for column in result.columns))
        for row in result.rows:
            table.add_row(*(escape(printable(str(v))) for v in row))
        out.print(table)
    if not result.rows:
        console.print("0 rows")
    limit = result.row_limit or max_rows
    if result.size_limited:
        console.print(
            f"[yellow]result stopped after {len(result.rows)} rows at the {DEFAULT_MAX_RESULT_BYTES >> 20} MiB "
            "result size limit[/]; rows may be missing (select fewer or narrower columns, or add a LIMIT)"
        )
    elif result.truncated and limit < max_rows:
        console.print(
            f"[yellow]result cut at {limit} rows[/]: the running platform's query server returns at most "
            f"{limit} rows per query (--max-rows {max_rows} cannot raise it; add a LIMIT/OFFSET to page)"
        )
    elif result.truncated:
        console.print(f"[yellow]result cut at {limit} rows[/] (--max-rows raises the limit)")


def _json_row(row: dict[str, object]) -> str:
    """One result row as compact JSON; a value JSON has no type for (a date, a UUID, a decimal) is its text,
    and a float that is not finite (ClickHouse's ``nan`` of 0/0, ``inf``) is null, which a JSON reader
    accepts where ``NaN`` is not JSON at all."""

    def finite(value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, list | tuple):
            return [finite(v) for v in value]
        if isinstance(value, dict):
            return {k: finite(v) for k, v in value.items()}
        return value

    return json.dumps(finite(row), default=str, ensure_ascii=False, allow_nan=False)


# ---------------------------------------------------------------- SLOs

SloConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="SLO config TOML (format: docs/slo.md). Default: the file SLUICE_STREAMS_SLO_FILE names (the "
        "streams worker's, whose burn-rate events then match these alerts), else the built-in tiers.",
        dir_okay=False,
    ),
]


def _slo_config(path: Path | None) -> tuple[SloConfig, str]:
    """The SLO configuration and where it came from: ``path``, else the streams worker's
    ``SLUICE_STREAMS_SLO_FILE``, else the built-in defaults (one source for its events and these rules)."""
    from monitoring.slo import SloConfigError, load_slo_config
    from schemas.settings import SettingsError, load_settings
    from streams.settings import StreamsSettings

    source = str(path)
    if path is None:
        try:
            path = load_settings(StreamsSettings).slo_path
        except SettingsError as exc:
            raise fail(str(exc), 2) from None
        source = "the built-in defaults" if path is None else f"{path} (SLUICE_STREAMS_SLO_FILE)"
    try:
        return load_slo_config(path), source
    except SloConfigError as exc:
        raise fail(str(exc), 2) from None


@slo_app.command("rules")
def slo_rules(
    config: SloConfigOption = None,
    out_file: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="write the rules file here instead of stdout", dir_okay=False),
    ] = None,
) -> None:
    """Generate Prometheus recording and alerting rules (YAML) for the SLOs and the Kafka alerts.

    By default pages when the 1h and 5m burn rates exceed 14.4x or 6h and 30m exceed 6x; tickets at 1d/2h
    3x, 3d/6h 1x ([[alerts.burn]] in the config changes the pairs).
    Drift tickets: a drift verdict persisting, a broken feature pipeline, reports gone stale
    (SLUICE_DRIFT_WINDOW_S, SLUICE_DRIFT_LATENESS_S and SLUICE_DRIFT_INTERVAL_S, when set, give the
    streams worker's window length, lateness and interval).

    Point Prometheus' rule_files at the output (example: infra/prometheus/prometheus.yml, docs/slo.md).
    """
    from monitoring.slo import render_rules

    window, lateness, interval = _streams_drift()
    cfg, source = _slo_config(config)
    text = render_rules(
        cfg, source=source, drift_window_s=window, drift_lateness_s=lateness, drift_interval_s=interval
    )
    if out_file is None:
        sys.stdout.write(text)
        return
    try:
        out_file.write_text(text)
    except OSError as exc:
        raise fail(f"cannot write {out_file}: {exc.strerror or exc}") from None
    console.print(f"wrote {escape(str(out_file))}")


def _streams_drift() -> tuple[float | None, float | None, float | None]:
    """The drift window, lateness and interval the streams worker runs with, each where its variable is
    set (None: the SLO config's ``[alerts.drift]`` holds): they win over the config, for the rules and for
    what ``slo show`` says of them (a report's age when healthy is a window, the lateness and an interval)."""
    import os

    from schemas.settings import load_settings
    from streams.settings import StreamsSettings

    streams = load_settings(StreamsSettings)
    return (
        streams.drift_window_s if "SLUICE_DRIFT_WINDOW_S" in os.environ else None,
        streams.drift_lateness_s if "SLUICE_DRIFT_LATENESS_S" in os.environ else None,
        streams.drift_interval_s if "SLUICE_DRIFT_INTERVAL_S" in os.environ else None,
    )


@slo_app.command("show")
def slo_show(config: SloConfigOption = None) -> None:
    """Show the tiers with their models, objectives and error budgets, and the alerts' thresholds."""
    from monitoring.slo import SloConfigError, budget_minutes, burn_alerts, drift_settings

    cfg, source = _slo_config(config)
    table = Table(
        "tier", "models", "availability", "time to first token", "inter-token latency", "budget window",
        title=escape(f"SLOs ({source})"),
    )  # fmt: skip
    for tier in cfg.tiers:
        models = escape(", ".join(tier.models))
        if tier.name == cfg.default_tier:
            models = f"{models}, any other model" if models else "every model"
        downtime = _minutes_text(budget_minutes(tier.availability, tier.window_days))
        latency = [
            f"{_pct(o.target)} within {o.threshold_seconds:g} s\n[dim]budget {_pct(1 - o.target)}[/]"
            if o
            else "-"
            for o in (tier.ttft, tier.itl)
        ]
        table.add_row(
            escape(tier.name),
            models or "[dim]none[/]",
            f"{_pct(tier.availability)}\n[dim]budget {_pct(1 - tier.availability)} = {downtime} down[/]",
            *latency,
            f"{tier.window_days} days",
        )
    out.print(table)
    days = sorted({t.window_days for t in cfg.tiers})
    alerts = Table(
        "alert", "severity", "windows", "burn rate above", "budget spent at that rate", title="alerts"
    )
    for a in burn_alerts(cfg):
        rates = ", ".join(f"{a.threshold(d):.3g}" + (f" ({d} days)" if len(days) > 1 else "") for d in days)
        alerts.add_row(
            a.alert, a.severity, f"{a.long} and {a.short}", rates, f"{a.budget_share:.0%} in {a.long}"
        )
    lag, dead = cfg.alerts.consumer_lag, cfg.alerts.dead_letters
    alerts.add_row(
        "SluiceConsumerLag",
        lag.severity,
        f"{lag.for_minutes}m",
        f"{lag.max_records} records (max per group, topic)",
        "",
    )
    alerts.add_row(
        "SluiceDeadLetters", dead.severity, f"{dead.window_minutes}m", "any record dead-lettered", ""
    )
    oom = cfg.alerts.out_of_memory
    alerts.add_row(
        "SluiceWorkerOutOfMemory",
        oom.severity,
        f"{oom.window_minutes}m",
        "any forward pass out of memory (per model)",
        "",
    )
    window_s, lateness_s, interval_s = _streams_drift()
    try:
        drift = drift_settings(cfg, window_s, lateness_s=lateness_s, interval_s=interval_s)
    except SloConfigError as exc:
        raise fail(str(exc)) from None
    window = f"{drift.window_s:g} s drift windows"
    alerts.add_row(
        "SluiceDriftDetected", drift.severity, window, f"{drift.drift_windows} windows in a row say drift", ""
    )
    alerts.add_row(
        "SluiceDriftFeaturePipeline",
        drift.severity,
        f"{drift.for_minutes}m",
        "any data-quality finding (features missing, out of range)",
        "",
    )
    alerts.add_row(
        "SluiceDriftReportsStale",
        drift.severity,
        window,
        f"no report for {drift.stale_after_windows} windows and the monitor's {drift.lateness_s:g} s lateness "
        f"and {drift.interval_s:g} s interval ({drift.stale_after_s:g} s) while serving",
        "",
    )
    alerts.add_row("SluiceRolloutRolledBack", "ticket", "30m", "the rollout controller rolled back", "")
    out.print(alerts)
    # an objective whose budget caps its burn rate under a pair's threshold: the pair alerts lower for it
    for lowered in cfg.lowered_thresholds():
        out.print(f"[yellow]lowered:[/] {escape(lowered.text)}")


def _pct(share: float) -> str:
    return f"{100 * share:.4g}%"


def _minutes_text(minutes: float) -> str:
    hours, rest = divmod(round(minutes), 60)
    return f"{hours}h {rest:02d}m" if hours else f"{rest}m"


# ---------------------------------------------------------------- audit


def warehouse_failure(exc: Exception) -> typer.Exit:
    """A warehouse error as one line, exit code 2."""
    message = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
    if "UNKNOWN_TABLE" in message:
        message = "the warehouse is missing a table: run `sluice warehouse migrate` or `sluice up`"
    return fail(message, 2)


# ---------------------------------------------------------------- models and services


@models_app.command("prepare")
def models_prepare() -> None:
    """Build demo-gpt (first time: ~1 min) and link MiniLM and SLUICE_MODEL_PATHS into the model cache."""
    from gpu_workers import GpuWorkerError
    from gpu_workers.models import prepare_models

    try:
        prepared = prepare_models(settings(), progress=lambda msg: console.print(f"  [dim]{escape(msg)}[/]"))
    except GpuWorkerError as exc:
        raise fail(str(exc)) from None
    for model_id, path in prepared.items():
        out.print(escape(f"{model_id}: {path}"))


@models_app.command("add")
def models_add(
    model: Annotated[str, typer.Argument(help="the model id, e.g. demo-gpt")],
    path: Annotated[
        Path, typer.Option("--path", help="a local Hugging Face model directory (save_pretrained)")
    ],
    task: Annotated[
        str | None, typer.Option("--task", help="generation or embedding (default: the model's, or inferred)")
    ] = None,
) -> None:
    """Register DIR as a new immutable version of MODEL (content-addressed: the same files give the same
    version). Its files are copied into the model cache, so DIR may change or go afterwards. What serves
    does not change: roll it out with `sluice rollout start`."""
    from gpu_workers import GpuWorkerError
    from gpu_workers.models import add_version, list_versions
    from schemas.manifest import MODEL_TASKS, models_root, read_manifest

    if task is not None and task not in MODEL_TASKS:
        raise fail(f"--task {task!r}: expected generation or embedding", 2)
    if why := settings().unserved(model):  # a review: a typo registered an orphan model and exited 0
        raise fail(f"{why}: add it there first, or check the id", 2)
    try:
        added = add_version(
            model, path, models_root(settings().cache_dir), None if task is None else MODEL_TASKS[task]
        )
    except GpuWorkerError as exc:
        raise fail(str(exc)) from None
    version = read_manifest(added).version
    out.print(f"{escape(model)}: version [bold]{escape(version)}[/] ({escape(str(added))})")
    _, stables, _ = _live_shares(settings())
    stable = stables.get(model) or next(
        (v.version for v in list_versions(models_root(settings().cache_dir), model) if v.current), None
    )
    if version == stable:  # the same files as what serves: a rollout of it is refused (a review)
        out.print(escape(f"  the same files as the stable version of {model}: nothing to roll out"))
        return
    out.print(escape(f"  next: sluice rollout evaluate {model} --version {version} --from-log 1h"))
    out.print(escape(f"        sluice rollout start {model} --version {version} --canary 5"))


@models_app.command("list")
def models_list(
    model: Annotated[str | None, typer.Argument(help="only this model")] = None,
) -> None:
    """Every version of the served models: task, when it was registered, whether it is the stable version
    (the latest deployment's on the control topic; before any rollout, the registry's `current`), and its
    share of live traffic from that deployment."""
    from datetime import UTC, datetime

    from gpu_workers.models import list_versions
    from schemas.manifest import models_root

    s = settings()
    if model is not None and (why := s.unserved(model)):  # an audit: an empty table and exit 0
        raise fail(why, 2)
    live, stables, note = _live_shares(s)
    table = Table("model", "version", "task", "registered (UTC)", "stable", "live", "description")
    for model_id in s.served_models():
        if model is not None and model_id != model:
            continue
        versions = list_versions(models_root(s.cache_dir), model_id)
        if not versions:
            table.add_row(
                escape(model_id), "[yellow]not prepared[/] (sluice models prepare)", "", "", "", "", ""
            )
            continue
        shares = live.get(model_id)
        for v in versions:
            share = (shares or {}).get(v.version, 0.0) if shares is not None else (1.0 if v.current else 0.0)
            registered = datetime.fromtimestamp(v.created, UTC).strftime("%Y-%m-%d %H:%M")
            # a promotion makes another version stable; the registry's `current` is only the first one
            # (an audit read `current: yes` on a version at 0 % after three promotions)
            stable = stables[model_id] == v.version if model_id in stables else v.current
            table.add_row(
                escape(model_id),
                escape(v.version),
                escape(v.task),
                registered,
                "yes" if stable else "",
                f"{share:.0%}",
                escape(v.description),
                style="bold" if share > 0 else "",
            )
    out.print(table)
    if note:
        console.print(f"[dim]{escape(note)}[/]")


def _live_shares(s: PlatformSettings) -> tuple[dict[str, dict[str, float]], dict[str, str], str]:
    """model -> version -> traffic share from the control topic, and model -> its stable version; models
    without a deployment are absent (their `current` version takes everything). A note when the broker
    could not be read."""
    from confluent_kafka import KafkaException

    from bus.control import latest_deployments
    from bus.errors import BusError
    from schemas.topics import TopicNames

    if s.local_kafka and not any(node.running() for node in started_broker(s, console).nodes):
        return {}, {}, "live shares assume no rollout: Kafka is not running (`sluice up`)"
    try:
        latest = latest_deployments(s.kafka, TopicNames(s.topic_prefix).control, "sluice-cli-models")
    except (BusError, KafkaException) as exc:
        return {}, {}, f"live shares assume no rollout: the control topic could not be read ({exc})"
    note = "" if latest else "no rollout yet: the registry's `current` version serves"
    return {m: dict(d.traffic) for m, d in latest.items()}, {m: d.stable for m, d in latest.items()}, note


@app.command("worker")
def worker(
    model: Annotated[str, typer.Option("--model", "-m", help="model id to serve, e.g. demo-gpt")],
    version: Annotated[
        str | None,
        typer.Option("--version", help="model version to serve (see `sluice models list`); default: current"),
    ] = None,
) -> None:
    """Serve one model version from its request topic until SIGTERM/Ctrl-C (one process per replica).
    Workers of each version form their own consumer group and run the requests routed to their version."""
    from sluice.services import run_worker_process

    if version:
        os.environ["SLUICE_WORKER_VERSION"] = version

    raise typer.Exit(run_worker_process(settings(), model, console))


@app.command("edge")
def edge() -> None:
    """Run one edge (OpenAI-compatible HTTP + WebSocket) until SIGTERM/Ctrl-C."""
    from sluice.services import run_edge_process

    raise typer.Exit(run_edge_process(settings(), console))


@app.command("streams")
def streams() -> None:
    """Run the streams worker until SIGTERM/Ctrl-C: the event log into the warehouse (facts, SLIs, cost
    ledger, audit chain), budget and burn-rate events, and the dashboard on SLUICE_STREAMS_PORT."""
    from sluice.services import run_streams_process

    raise typer.Exit(run_streams_process(settings(), console))


@app.command("replay")
def replay(
    data_dir: Annotated[
        str | None,
        typer.Option(
            "--data-dir",
            help="embedded warehouse to rebuild (under DIR/warehouse); default: the configured warehouse, "
            "the server of SLUICE_WAREHOUSE_URL if set, else SLUICE_DATA_DIR's. Must be empty (a warehouse "
            "that is not is refused untouched).",
        ),
    ] = None,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            min=1.0,
            metavar="SECONDS",
            help="give up when no new record has arrived for this long (a stall: Kafka gone, a partition "
            "without a leader); the whole replay of a long log may take longer",
        ),
    ] = 600.0,
) -> None:
    """Rebuild the warehouse from the topics, from offset 0, into an empty warehouse (same rows as the
    live streams worker writes: compare them with `sluice sql`)."""
    from sluice.services import run_replay

    if data_dir is not None and not data_dir.strip():  # an unset shell variable: not this directory
        raise fail("--data-dir is empty: name a directory, or leave it out for SLUICE_DATA_DIR", 2)
    raise typer.Exit(run_replay(settings(), console, data_dir, timeout))


def _cell(value: object) -> str:
    if isinstance(value, list):
        return printable(", ".join(str(v) for v in value)) or "-"
    return printable(str(value))


# ---------------------------------------------------------------- settings and up


@app.command("settings")
def show_settings() -> None:
    """Show every SLUICE_* setting: its type, default and the value in effect (secrets hidden)."""
    for cls in (PlatformSettings, *SERVICE_SETTINGS):
        values = settings() if cls is PlatformSettings else load_settings(cls)
        table = Table("variable", "type", "default", "in effect", title=cls.__name__)
        for name, type_name, default in describe(cls):
            field = name.removeprefix("SLUICE_").lower()
            table.add_row(
                name, escape(type_name), escape(default), escape(display(field, getattr(values, field)))
            )
        out.print(table)


@app.command("up")
def up(
    port: Annotated[
        int | None,
        typer.Option(
            "--port", "-p", min=0, max=65535, help="the edge's port (default SLUICE_EDGE_PORT, 8080)"
        ),
    ] = None,
    edges: Annotated[
        int | None,
        typer.Option(
            "--edges",
            min=1,
            max=64,
            help="edges to run, on the port and those after it (SLUICE_FLEET_EDGES, 1)",
        ),
    ] = None,
    workers_per_model: Annotated[
        int | None,
        typer.Option(
            "--workers-per-model",
            min=1,
            max=64,
            help="workers per model (sharing its consumer group); with --autoscale the fewest "
            "(SLUICE_FLEET_WORKERS_PER_MODEL, 1)",
        ),
    ] = None,
    autoscale: Annotated[
        bool | None,
        typer.Option(
            "--autoscale/--no-autoscale",
            help="scale workers on each model's queue in Kafka (SLUICE_FLEET_AUTOSCALE, off)",
        ),
    ] = None,
    max_workers: Annotated[
        int | None,
        typer.Option("--max-workers", min=1, max=64, help="autoscaling's most workers per model (4)"),
    ] = None,
    warm_workers: Annotated[
        int | None,
        typer.Option(
            "--warm-workers", min=0, max=8, help="autoscaling's loaded standby workers per model (0)"
        ),
    ] = None,
    worker_cpus: Annotated[
        str | None,
        typer.Option(
            "--worker-cpus",
            help="cores for the workers, e.g. '1' or '4-7'; the edge, Kafka and the streams worker get the "
            "others; 'auto' (default): the upper half; 'off': no pinning (SLUICE_FLEET_WORKER_CPUS)",
        ),
    ] = None,
) -> None:
    """Run the platform on embedded defaults until Ctrl-C: Kafka, topics, the streams worker (warehouse,
    dashboard, drift monitor), models, workers per model (fixed or autoscaled on lag), and edges. It says
    "sluicegate is up" once the workers answer /readyz (their models loaded)."""
    from sluice.up import run_platform

    flags = {
        "fleet_edges": edges,
        "fleet_workers_per_model": workers_per_model,
        "fleet_autoscale": autoscale,
        "fleet_max_workers": max_workers,
        "fleet_warm_workers": warm_workers,
        "fleet_worker_cpus": worker_cpus,
    }
    overrides: dict[str, object] = {k: v for k, v in flags.items() if v is not None}
    raise typer.Exit(run_platform(settings(), out, console, port, overrides))


def main() -> None:
    """The CLI; what a command's environment or files get wrong is one line and a non-zero exit, never a
    traceback: its service's settings (``SLUICE_EDGE_PORT=abc``: 2), a path that is a directory or a file
    where the other is wanted, one it may not use or cannot create (1)."""
    try:
        app()
    except SettingsError as exc:
        console.print(f"[red]settings error:[/] {escape(str(exc))}")
        raise SystemExit(2) from None
    except OSError as exc:
        console.print(f"[red]error:[/] {escape(_os_error(exc))}")
        raise SystemExit(1) from None


def _os_error(exc: OSError) -> str:
    """``<path>: <the OS's reason>`` (both paths of a rename or link), else the error as Python says it."""
    if exc.filename is None or exc.strerror is None:
        return str(exc)
    paths = " -> ".join(str(p) for p in (exc.filename, exc.filename2) if p is not None)
    return f"{paths}: {exc.strerror}"
