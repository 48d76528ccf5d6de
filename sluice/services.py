"""The long-running processes behind ``sluice worker``, ``sluice edge`` and ``sluice up``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote

from rich.console import Console

from bus.errors import BusError
from gpu_workers.settings import WorkerSettings
from ingest.settings import EdgeSettings
from monitoring.access import check_exposure
from monitoring.logs import MIN_SECRET_CHARS, configure_logging, register_secret
from monitoring.metrics import bound_tenants
from monitoring.settings import ObservabilitySettings
from monitoring.tracing import configure_tracing, shutdown_tracing
from schemas.settings import (
    PlatformSettings,
    SettingsError,
    load_settings,
    local_kafka_ports,
    url_password_span,
)
from sluice.autoscale import FleetSettings
from streams.settings import StreamsSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider

    from infra.kafka.broker import LocalKafkaCluster

# Every service's settings class, imported here so the settings registry knows all SLUICE_* names.
SERVICE_SETTINGS = (EdgeSettings, WorkerSettings, ObservabilitySettings, StreamsSettings, FleetSettings)


def local_broker(
    platform: PlatformSettings, console: Console, brokers: int | None = None
) -> LocalKafkaCluster:
    """The local Kafka the settings describe (data in ``$SLUICE_DATA_DIR/kafka``): ``brokers`` nodes
    (``SLUICE_KAFKA_BROKERS`` unless given) from ``SLUICE_KAFKA_PORT`` on, reporting downloads."""
    return _local_kafka(
        platform, console, local_kafka_ports(platform.kafka_port, brokers or platform.kafka_brokers)
    )


def started_broker(platform: PlatformSettings, console: Console) -> LocalKafkaCluster:
    """The local Kafka ``sluice kafka up`` started: the multi-node cluster recorded in the data dir while
    any of its nodes runs (whatever ``--brokers`` it was started with), else the one the settings describe."""
    from infra.kafka.broker import read_layout

    layout = read_layout(Path(platform.data_dir) / "kafka")
    if layout is not None:
        cluster = _local_kafka(platform, console, layout.ports)
        if any(pid is not None for pid in cluster.pids()):
            return cluster
    return local_broker(platform, console)


def _local_kafka(
    platform: PlatformSettings, console: Console, ports: list[tuple[int, int]]
) -> LocalKafkaCluster:
    from infra.kafka.broker import LocalKafkaCluster

    return LocalKafkaCluster(
        data_dir=Path(platform.data_dir) / "kafka",
        cache_dir=platform.cache_dir,
        version=platform.kafka_version,
        ports=ports,
        progress=lambda artifact: console.print(f"  [dim]downloaded {artifact}[/]"),
    )


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a service cleanly: Ctrl-C, ``kill``, and its terminal closing (SIGHUP, to the whole group)."""


def stop_on_signals() -> asyncio.Event:
    """An event set by one of :data:`STOP_SIGNALS` (call on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    return stop


def observe(service: str, platform: PlatformSettings) -> TracerProvider | None:
    """Set up what every service process shares: JSON logs (secrets scrubbed, the platform's own among
    them), the bound on the tenant label, and trace export when ``SLUICE_OTLP_ENDPOINT`` is set (the
    returned provider, to shut down)."""
    # The edge tokenises on its event loop's thread; tokenizers' own thread pool would fight the model
    # thread for this machine's cores.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = load_settings(ObservabilitySettings)
    configure_logging(settings, service)
    for secret in (platform.ops_token, platform.kafka_sasl_password, *_url_passwords(platform.warehouse_url)):
        if secret and len(secret) >= MIN_SECRET_CHARS:
            register_secret(secret)
    bound_tenants(settings.metrics_max_tenants)
    return configure_tracing(settings, service)


def _url_passwords(url: str | None) -> tuple[str, ...]:
    """The password in ``url``'s user-info (``SLUICE_WAREHOUSE_URL``'s), as written and percent-decoded:
    either form may reach a log line. A review found the warehouse password unregistered, so a line that
    quoted the URL, or the password alone, kept it."""
    span = url_password_span(url) if url else None
    if url is None or span is None:
        return ()
    password = url[span[0] : span[1]]
    return (password, unquote(password))


def check_worker_exposure(platform: PlatformSettings, worker: WorkerSettings) -> None:
    check_exposure(
        platform.ops_token, host=worker.worker_ops_host, variable="SLUICE_WORKER_OPS_HOST", service="a worker"
    )


def check_streams_exposure(platform: PlatformSettings, streams: StreamsSettings) -> None:
    check_exposure(
        platform.ops_token,
        host=streams.streams_host,
        variable="SLUICE_STREAMS_HOST",
        service="the streams worker",
    )


def run_worker_process(platform: PlatformSettings, model_id: str, console: Console) -> int:
    from gpu_workers import GpuWorkerError
    from gpu_workers.main import model_dir_of, place_worker, run_worker
    from gpu_workers.model_store import VersionFilesError
    from monitoring.ops import OpsServerError
    from schemas.manifest import ManifestError

    try:
        worker = load_settings(WorkerSettings)
        check_worker_exposure(platform, worker)
        place_worker(worker.worker_cpus)  # before its threads start: they inherit the cores
        provider = observe(f"worker/{model_id}", platform)
    except SettingsError as exc:
        console.print(f"[red]settings error:[/] {exc}")
        return 2
    if why := platform.unserved(model_id):
        console.print(f"[red]error:[/] {why}")
        return 2
    if worker.worker_version:
        try:  # a version not registered is the caller's mistake (a review: exit 1, "run models prepare")
            model_dir_of(platform, model_id, worker.worker_version)
        except ManifestError as exc:
            console.print(f"[red]error:[/] {exc}")
            return 2
    stop, join = threading.Event(), threading.Event()
    set_on_signals(stop, *STOP_SIGNALS)
    set_on_signals(join, signal.SIGUSR1)  # a warm standby (SLUICE_WORKER_STANDBY) joins
    try:
        run_worker(platform, worker, model_id, stop, join)
    except VersionFilesError as exc:  # says what restores them: `prepare` cannot, for a registered version
        console.print(f"[red]error:[/] {exc}")
        return 1
    except (GpuWorkerError, ManifestError) as exc:
        console.print(f"[red]error:[/] {exc} (run `sluice models prepare`)")
        return 1
    except OpsServerError as exc:
        console.print(f"[red]error:[/] {exc}: set SLUICE_WORKER_OPS_PORT (0 picks a free port)")
        return 2
    except BusError as exc:  # Kafka unreachable, the topics not applied: one line (a review: a traceback)
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        shutdown_tracing(provider)
    return 0


def set_on_signals(event: threading.Event, *signals: signal.Signals) -> None:
    """``event`` is set when one of ``signals`` arrives. A handler runs on the main thread between two
    bytecodes, so a second signal can arrive while the first handler is inside ``Event.set`` holding the
    event's (non-reentrant) lock: a handler calling ``set`` again there waits for itself for ever (a burst
    of SIGTERMs left workers hung, outliving ``sluice up``). The nested handler sees the first one at work
    and returns."""
    busy = False

    def handler(signum: int, frame: object) -> None:
        nonlocal busy
        if busy or event.is_set():
            return
        busy = True
        try:
            event.set()
        finally:
            busy = False

    for sig in signals:
        signal.signal(sig, handler)


def replies_partitions(platform: PlatformSettings) -> int:
    from confluent_kafka import KafkaException

    from infra.topics import quiet_admin
    from schemas.topics import TopicNames

    topic = TopicNames(platform.topic_prefix).replies
    try:
        meta = quiet_admin(platform.kafka).list_topics(topic, timeout=10).topics[topic]
    except KafkaException as exc:  # one line, not a traceback under 200 of librdkafka's (a review)
        raise BusError(
            f"cannot reach Kafka at {platform.bootstrap}: {exc.args[0]} (is it running?)"
        ) from None
    if meta.error is not None:
        raise SettingsError(f"topic {topic} does not exist: run `sluice topics apply`")
    return len(meta.partitions)


def run_edge_process(platform: PlatformSettings, console: Console, port: int | None = None) -> int:
    from ingest.errors import CatalogueError
    from ingest.main import EdgeFailed, build_edge, check_edge_exposure, serve_edge

    try:
        edge_settings = load_settings(EdgeSettings)
        check_edge_exposure(platform, edge_settings)
        provider = observe("edge", platform)
        if port is not None:
            import msgspec

            edge_settings = msgspec.structs.replace(edge_settings, edge_port=port)
        edge, gateway = build_edge(platform, edge_settings, replies_partitions(platform))
    except (SettingsError, ValueError, CatalogueError) as exc:  # a model or the tenants file not loading
        console.print(f"[red]error:[/] {exc}")
        return 2
    except BusError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1

    async def main() -> None:
        stop = stop_on_signals()
        await serve_edge(edge, gateway, stop)

    try:
        asyncio.run(main())
    except (EdgeFailed, BusError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        shutdown_tracing(provider)
    return 0


def run_streams_process(platform: PlatformSettings, console: Console) -> int:
    """``sluice streams``: the streams worker until SIGINT, SIGTERM or SIGHUP."""
    from infra.errors import InfraError
    from monitoring.runtime import tune_gc
    from monitoring.slo import SloConfigError
    from streams.control import BudgetError
    from streams.pricing import PricingError
    from streams.service import StreamsService

    try:
        settings = load_settings(StreamsSettings)
        check_streams_exposure(platform, settings)
        provider = observe("streams", platform)
    except SettingsError as exc:
        console.print(f"[red]settings error:[/] {exc}")
        return 2

    async def main() -> None:
        stop = stop_on_signals()
        async with StreamsService(platform, settings) as service:
            tune_gc()  # after start-up: what it imported and built is frozen out of the collector's sight
            console.print(f"streams: dashboard {service.url}/dashboard")
            while not stop.is_set() and service.failure is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.5)
            if service.failure is not None:
                raise StreamsFailed(str(service.failure)) from service.failure

    try:
        asyncio.run(main())
    except (InfraError, PricingError, BudgetError, SloConfigError, StreamsFailed, BusError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    finally:
        shutdown_tracing(provider)
    return 0


class StreamsFailed(RuntimeError):
    """A streams agent crashed: exit non-zero so the supervisor restarts the process."""


def run_replay(
    platform: PlatformSettings, console: Console, data_dir: str | None, timeout_s: float | None = None
) -> int:
    """``sluice replay``: rebuild the warehouse from the log into an empty one; returns the exit code.

    ``timeout_s``: how long to wait for the next record before giving up (default
    :data:`~streams.replay.DEFAULT_STALL_TIMEOUT_S`)."""
    import msgspec
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from infra.errors import InfraError
    from infra.warehouse import migrate, open_warehouse
    from streams.pricing import PricingError, load_prices
    from streams.replay import DEFAULT_STALL_TIMEOUT_S, TABLES, ReplayError, price_history, replay
    from streams.service import apply_retention, request_topics

    try:
        settings = load_settings(StreamsSettings)
        # --data-dir names the embedded warehouse to fill: a configured server URL (SLUICE_WAREHOUSE_URL) took
        # precedence over it, and a scratch rebuild went to the production database (an audit)
        target = (
            platform
            if data_dir is None
            else msgspec.structs.replace(platform, data_dir=data_dir, warehouse_url=None)
        )
        prices = load_prices(settings.streams_prices_file)
        client = open_warehouse(target)
    except (SettingsError, PricingError, InfraError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 2
    try:
        # Looked at before anything is written: a replay refused after it had migrated the warehouse and
        # applied its shell's raw-event retention (30 days against the live worker's 90) deleted the live
        # warehouse's raw events and left it migrated past the running release's code (a review: a
        # forgotten --data-dir, or SLUICE_WAREHOUSE_URL set).
        filled = {
            t: int(client.query(f"SELECT count() FROM {t}").result_rows[0][0])  # noqa: S608
            for t in TABLES
            if int(client.query(f"EXISTS TABLE {t}").result_rows[0][0])
        }
        if any(filled.values()):
            counts = ", ".join(f"{t}: {n}" for t, n in filled.items() if n)
            console.print(
                f"[red]error:[/] the target warehouse is not empty ({counts}); nothing was changed in it; "
                "replay into a new --data-dir"
            )
            return 1
        migrate(client)
        apply_retention(client, settings.streams_raw_retention_days)  # as the live worker's (an audit)
        topics = request_topics(platform)
        history = price_history(platform, prices)
        published = ", ".join(
            f"{escape(t.version)} from {at.isoformat(timespec='seconds')}" for at, t in history.tables()
        )
        console.print(
            f"prices: as the log's history says ({published})"
            if published
            else f"prices: the log holds no price table; every request is priced by {escape(prices.version)}"
        )
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
        ) as bar:
            task = bar.add_task("replaying the log", total=None)
            report = replay(
                platform,
                client,
                history,
                topics,
                store_content=settings.streams_store_content,
                batch_size=settings.streams_batch_size,
                progress=lambda done, total: bar.update(task, completed=done, total=total),
                timeout_s=DEFAULT_STALL_TIMEOUT_S if timeout_s is None else timeout_s,
            )
    except (ReplayError, InfraError, RuntimeError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}")
        return 1
    finally:
        client.close()
    console.print(
        f"replayed {report.events} events from {report.partitions} partitions in {report.seconds:.1f}s"
        + (f" ({report.undecodable} undecodable, skipped)" if report.undecodable else "")
    )
    for topic, records in sorted(report.gone.items()):
        console.print(
            f"[yellow]warning:[/] {escape(topic)} no longer holds its first {records:,} records (retention or "
            "compaction): what they made is not in the rebuilt warehouse"
        )
    for topic, records in sorted(report.compacted.items()):
        console.print(
            f"[yellow]warning:[/] {escape(topic)} holds {records:,} fewer records than its offsets span "
            "(compaction removed superseded ones, or a transactional producer's markers): their history is "
            "not in the rebuilt warehouse"
        )
    return 0
