"""``sluice up``: bring the platform's pieces up in order, hold them until a signal, stop them in reverse.

Kafka (unless ``SLUICE_KAFKA_BOOTSTRAP``) → topics → the streams worker (a child process that owns the
warehouse, serves reads and the dashboard) → models (built or linked) → one worker process per model →
the edge, in this process. Child processes are restarted with back-off if they die.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import sys
from contextlib import AsyncExitStack

import aiohttp
import msgspec
from rich.console import Console

from gpu_workers.settings import WorkerSettings
from infra.errors import InfraError
from infra.topics import apply_topics, make_admin, topics_of
from ingest.auth import DEMO_KEY
from ingest.main import build_edge, check_edge_exposure
from ingest.settings import EdgeSettings
from monitoring.tracing import shutdown_tracing
from schemas.settings import PlatformSettings, SettingsError, load_settings
from schemas.topics import TopicNames
from sluice.services import (
    check_streams_exposure,
    check_worker_exposure,
    observe,
    replies_partitions,
    started_broker,
    stop_on_signals,
)
from streams.settings import StreamsSettings


def run_platform(settings: PlatformSettings, out: Console, console: Console, port: int | None = None) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit code."""
    try:
        edge_settings = load_settings(EdgeSettings)
        # Every service it starts would refuse an exposed address without its credentials: say so now,
        # not after Kafka, the warehouse and the models are up (or a child in a restart loop).
        check_edge_exposure(settings, edge_settings)
        check_streams_exposure(settings, load_settings(StreamsSettings))
        check_worker_exposure(settings, load_settings(WorkerSettings))
    except SettingsError as exc:
        console.print(f"[red]settings error:[/] {exc}")
        return 2
    if port is not None:
        edge_settings = msgspec.structs.replace(edge_settings, edge_port=port)
    try:
        provider = observe("up", settings)
        asyncio.run(_serve(settings, edge_settings, out, console))
    except (InfraError, SettingsError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    shutdown_tracing(provider)
    return 0


STOP_GRACE_S = 30.0


class ServiceProcess:
    """One ``sluice <command>`` child (a worker, the streams worker), restarted with back-off if it exits
    on its own."""

    def __init__(
        self, name: str, args: list[str], console: Console, env: dict[str, str], *, backoff_s: float = 1.0
    ) -> None:
        self.name = name
        self._backoff_s = backoff_s
        self._stop_requested = asyncio.Event()
        self.exits = 0
        """How often the child exited on its own (each one is followed by a restart after a back-off)."""
        self._args = args
        self._env = env
        self._console = console
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=self.name)

    async def _supervise(self) -> None:
        backoff = self._backoff_s
        while not self._stopping:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sluice",
                *self._args,
                env={**os.environ, **self._env},
                preexec_fn=die_with_parent,
            )
            code = await self._proc.wait()
            if self.stopping:
                return
            self.exits += 1
            self._console.print(f"[yellow]{self.name} exited with {code}; restarting in {backoff:.0f}s[/]")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):  # a stop during the back-off ends it at once
                    await self._stop_requested.wait()
            backoff = min(backoff * 2, 30.0)

    async def stop(self) -> None:
        self._stopping = True
        self._stop_requested.set()
        proc = self._proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(STOP_GRACE_S):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        if self._task is not None:
            await self._task


def die_with_parent() -> None:
    """In a child, before it runs: on Linux it gets SIGTERM when ``sluice up`` dies, however that dies
    (a ``kill -9`` or a crash too), so no worker or streams process is left behind holding ports, the
    warehouse lock and a consumer group's partitions. Elsewhere nothing happens."""
    if sys.platform.startswith("linux"):
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class Fleet:
    """The worker processes of every serving model version: the stable one, and a candidate while it has
    traffic or shadow (``Deployment.serving``), or the ``current`` version of a model never rolled out.
    ``follow`` re-reads the deployments every ``interval_s`` and starts and stops workers to match; a
    stopped version's unfinished requests run on the stable version (see ``WorkerService``)."""

    def __init__(
        self, settings: PlatformSettings, console: Console, base_port: int, interval_s: float = 2.0
    ) -> None:
        self._settings = settings
        self._console = console
        self._base_port = base_port  # model i's first worker serves /metrics on base + i; others pick a port
        self._interval_s = interval_s
        self.workers: dict[tuple[str, str], tuple[ServiceProcess, int]] = {}

    def desired(self) -> set[tuple[str, str]]:
        """(model, version) pairs that should have a worker now (blocking: reads Kafka and the cache)."""
        from bus.control import latest_deployments
        from schemas.deployments import Deployment
        from schemas.manifest import current_model_dir, read_manifest

        deployments = latest_deployments(
            self._settings.kafka, TopicNames(self._settings.topic_prefix).control, "sluice-up"
        )
        wanted: set[tuple[str, str]] = set()
        for model in self._settings.served_models():
            if model in deployments:
                wanted |= {(model, v) for v in Deployment.of(deployments[model]).serving}
            else:
                wanted.add((model, read_manifest(current_model_dir(self._settings.cache_dir, model)).version))
        return wanted

    async def reconcile(self, wanted: set[tuple[str, str]]) -> None:
        models = self._settings.served_models()
        for key in sorted(wanted - self.workers.keys()):
            model, version = key
            first = not any(m == model for m, _ in self.workers)
            port = self._base_port + models.index(model) if self._base_port and first else 0
            worker = ServiceProcess(
                f"worker {model}@{version}",
                ["worker", "--model", model, "--version", version],
                self._console,
                {"SLUICE_WORKER_OPS_PORT": str(port)},
            )
            await worker.start()
            self.workers[key] = (worker, port)
            self._console.print(f"worker for {model} version {version} started")
        for key in sorted(self.workers.keys() - wanted):
            worker, _ = self.workers.pop(key)
            self._console.print(
                f"worker for {key[0]} version {key[1]} stopping: the version no longer serves"
            )
            await worker.stop()

    async def follow(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.reconcile(await asyncio.to_thread(self.desired))
            except Exception as exc:  # keep serving what runs; the next round tries again
                self._console.print(f"[yellow]could not follow the deployments: {exc}[/]")

    def ports(self) -> list[tuple[str, int]]:
        return [(f"{model}@{version}", port) for (model, version), (_, port) in sorted(self.workers.items())]

    async def stop(self) -> None:
        await asyncio.gather(*(worker.stop() for worker, _ in self.workers.values()))
        self.workers.clear()


async def _wait_ready(host: str, port: int, within_s: float) -> None:
    """Wait for a child's ``/readyz`` (so "up" means up: e.g. ``sluice sql`` finds the migrated warehouse)."""
    if port == 0:
        return  # a free port picked by the child: nothing to poll
    url = f"http://{host}:{port}/readyz"
    deadline = asyncio.get_running_loop().time() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
    raise InfraError(f"the streams worker was not ready at {url} within {within_s:.0f}s (see its log above)")


async def _serve(
    settings: PlatformSettings, edge_settings: EdgeSettings, out: Console, console: Console
) -> None:
    stop = stop_on_signals()

    async with AsyncExitStack() as stack:
        if settings.local_kafka:
            broker = started_broker(settings, console)
            if broker.running():
                console.print(f"using the Kafka already running at {broker.bootstrap} (left running on exit)")
            else:
                with console.status(f"starting Kafka {settings.kafka_version} at {broker.bootstrap}"):
                    await asyncio.to_thread(broker.start)
                stack.callback(broker.stop)
        specs = topics_of(settings)
        changes = await asyncio.to_thread(apply_topics, make_admin(settings.kafka), specs)
        created = sum(c.action != "unchanged" for c in changes)
        console.print(f"topics: {len(changes)} in spec, {created} created or changed")

        # The streams worker owns the embedded warehouse (migrates it, serves reads to other processes)
        # and the dashboard; it can be killed and restarted without losing or double counting anything.
        streams_settings = load_settings(StreamsSettings)
        streams = ServiceProcess("streams", ["streams"], console, {})
        await streams.start()
        stack.push_async_callback(streams.stop)
        with console.status("starting the streams worker (warehouse, dashboard)"):
            await _wait_ready(streams_settings.streams_host, streams_settings.streams_port, 120)

        # In a child process: torch stays out of the edge's process (and off its cores).
        console.print("preparing models (the first run builds demo-gpt, about a minute)")
        prepare = await asyncio.create_subprocess_exec(sys.executable, "-m", "sluice", "models", "prepare")
        if await prepare.wait() != 0:
            raise InfraError("`sluice models prepare` failed (see above)")
        # One worker per serving version of each model, following the deployments on the control topic.
        fleet = Fleet(settings, console, load_settings(WorkerSettings).worker_ops_port)
        stack.push_async_callback(fleet.stop)
        await fleet.reconcile(await asyncio.to_thread(fleet.desired))
        follow = asyncio.create_task(fleet.follow(), name="fleet")
        stack.push_async_callback(_cancel, follow)
        workers = fleet.ports()

        edge, gateway = build_edge(
            settings, edge_settings, await asyncio.to_thread(replies_partitions, settings)
        )
        await stack.enter_async_context(gateway)
        await edge.start()
        stack.push_async_callback(edge.stop)

        keys = f"API key: {DEMO_KEY}" if edge_settings.edge_tenants_file is None else "API keys: tenants file"
        out.print(f"[bold green]sluicegate is up[/]  {edge.url}/v1   {keys}")
        out.print(f"  Kafka {settings.bootstrap}   models: {', '.join(settings.served_models())}")
        ops = ", ".join(f"{model} http://127.0.0.1:{port or '<free port>'}" for model, port in workers)
        dashboard = f"http://{streams_settings.streams_host}:{streams_settings.streams_port}"
        out.print(f"  dashboard {dashboard}/dashboard   (streams metrics on {dashboard}/metrics)")
        out.print(f"  metrics: edge {edge.url}/metrics; workers {ops} (/metrics /healthz /readyz)")
        if settings.ops_token:
            out.print(
                "  ops token set: /metrics wants 'Authorization: Bearer $SLUICE_OPS_TOKEN'; "
                "open /dashboard?token=$SLUICE_OPS_TOKEN once in a browser"
            )
        out.print('  `sluice sql "SELECT ..."` queries the warehouse; Ctrl-C stops everything.')
        await stop.wait()
        console.print("stopping...")
