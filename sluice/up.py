"""``sluice up``: bring the platform's pieces up in order, hold them until a signal, stop them in reverse.

Kafka (unless ``SLUICE_KAFKA_BOOTSTRAP``) → topics → the streams worker (a child process that owns the
warehouse, serves reads and the dashboard) → models (built or linked) → worker processes per model (a
fixed count, or autoscaled on lag: ``sluice/autoscale.py``) → the edge, in this process, and any more edges
as children. Child processes are restarted with back-off if they die; if the edge in this process fails
(:class:`EdgeLoss`), the platform stops and ``sluice up`` exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import aiohttp
import msgspec
from confluent_kafka import KafkaException
from rich.console import Console

from bus.errors import BusError
from bus.placement import place_box
from bus.producer import EventProducer
from gpu_workers.settings import WorkerSettings
from infra.children import die_with
from infra.errors import InfraError
from infra.kafka.broker import free_port, parent_pid, port_free
from infra.locks import LockHeld, hold
from infra.topics import apply_topics, quiet_admin, topics_of
from infra.warehouse.errors import WarehouseLockedError
from ingest.auth import DEMO_KEY
from ingest.errors import CatalogueError
from ingest.main import EdgeFailed, build_edge, check_edge_exposure, more_edge_ids
from ingest.settings import EdgeSettings
from monitoring.ops import http_url
from monitoring.tracing import shutdown_tracing
from schemas.events import DeploymentChanged, Event, WorkersScaled, utc_now
from schemas.settings import (
    PlatformSettings,
    SettingsError,
    is_wildcard,
    load_settings,
    local_kafka_ports,
)
from schemas.topics import TopicNames, worker_group
from sluice.autoscale import Decision, FleetSettings, GroupLag, ScalePolicy, fleet_of
from sluice.services import (
    check_streams_exposure,
    check_worker_exposure,
    observe,
    replies_partitions,
    started_broker,
    stop_on_signals,
)
from streams.settings import StreamsSettings

if TYPE_CHECKING:
    from infra.kafka.broker import LocalKafka
    from schemas.lifecycle import AsyncComponent


def run_platform(
    settings: PlatformSettings,
    out: Console,
    console: Console,
    port: int | None = None,
    fleet_overrides: dict[str, object] | None = None,
) -> int:
    """Run until SIGINT, SIGTERM or SIGHUP; returns the process exit code. ``fleet_overrides`` (the command's flags)
    win over ``SLUICE_FLEET_*``."""
    try:
        edge_settings = load_settings(EdgeSettings)
        fleet_settings = fleet_of(fleet_overrides or {})
        if "fleet_max_workers" in (fleet_overrides or {}) and not fleet_settings.fleet_autoscale:
            console.print(
                "[yellow]warning:[/] --max-workers bounds autoscaling, which is off (--autoscale): "
                f"{fleet_settings.fleet_workers_per_model} worker(s) per model"
            )
        # Every service it starts would refuse an exposed address without its credentials: say so now,
        # not after Kafka, the warehouse and the models are up (or a child in a restart loop).
        check_edge_exposure(settings, edge_settings)
        streams_settings = load_settings(StreamsSettings)
        check_streams_exposure(settings, streams_settings)
        worker_settings = load_settings(WorkerSettings)
        check_worker_exposure(settings, worker_settings)
    except (SettingsError, msgspec.ValidationError) as exc:
        console.print(f"[red]settings error:[/] {exc}")
        return 2
    try:
        claim = claim_data_dir(settings)
    except (DataDirInUse, WarehouseLockedError) as exc:  # an OSError (a data dir the OS refuses) goes up
        console.print(f"[red]error:[/] {exc}")
        return 2
    with claim:  # held until this run ends, however it ends
        return _start(
            settings, edge_settings, fleet_settings, streams_settings, worker_settings, out, console, port
        )


def claim_data_dir(settings: PlatformSettings) -> IO[str]:
    """Hold ``$SLUICE_DATA_DIR/up.lock`` for the run (the returned file: closing it lets go), and refuse a
    data dir another ``sluice up`` runs on (:class:`DataDirInUse`), or whose embedded warehouse another
    process holds (:class:`WarehouseLockedError`), naming that process. A review: a second ``sluice up`` on
    the same data dir used the first one's Kafka, then crash-looped its streams worker on the warehouse's
    lock for 120 s."""
    from infra.warehouse.client import check_warehouse_free

    path = Path(settings.data_dir).expanduser() / "up.lock"
    try:
        claim = hold(path)
    except LockHeld as exc:
        raise DataDirInUse(
            f"the data dir {path.parent} is in use by another `sluice up` (process {exc.pid}); stop it, or "
            "give this one a data dir of its own (SLUICE_DATA_DIR)"
        ) from None
    deadline = time.monotonic() + ORPHAN_RELEASE_S
    while True:
        try:
            check_warehouse_free(settings)
        except WarehouseLockedError as exc:
            # The holder may be the streams worker of a `sluice up` just killed (kill -9, an OOM kill), still
            # draining after its parent-death signal: an immediate restart (a supervisor's) was refused
            # (a review). An orphan is given a few seconds to let go; a live owner is refused at once.
            if not (_orphaned(exc.owner_pid) and time.monotonic() < deadline):
                claim.close()
                raise
            time.sleep(0.25)
            continue
        except InfraError:
            claim.close()
            raise
        return claim


ORPHAN_RELEASE_S = 15.0
"""How long ``sluice up`` waits for an orphaned process (its parent gone) to let go of the warehouse."""


def _orphaned(pid: int | None) -> bool:
    """Whether process ``pid`` runs with no parent of its own (re-parented to init, as the children of a
    killed ``sluice up`` are while they drain)."""
    return pid is not None and parent_pid(pid) == 1


class DataDirInUse(InfraError):
    """Another ``sluice up`` runs on this data dir."""


def _start(
    settings: PlatformSettings,
    edge_settings: EdgeSettings,
    fleet_settings: FleetSettings,
    streams_settings: StreamsSettings,
    worker_settings: WorkerSettings,
    out: Console,
    console: Console,
    port: int | None,
) -> int:
    """``run_platform`` once its settings are checked and its data dir is its own."""
    if port is not None:
        edge_settings = msgspec.structs.replace(edge_settings, edge_port=port)
    try:
        # before anything starts: each port it listens on is one service's, and free
        taken = platform_ports(settings, worker_settings, streams_settings)
        edges = extra_edges(edge_settings, fleet_settings.fleet_edges, 1, taken)
        kafka = kafka_to_start(settings, console)
        check_free(listeners(settings, edge_settings, edges, worker_settings, streams_settings, kafka))
        # this process and what it starts onto the cores the workers do not get
        placed, worker_env = place_box(fleet_settings.fleet_worker_cpus, worker_settings.worker_cpus)
    except SettingsError as exc:
        console.print(f"[red]settings error:[/] {exc}")
        return 2
    except InfraError as exc:  # the local Kafka's recorded layout
        console.print(f"[red]error:[/] {exc}")
        return 1
    if placed:
        console.print(f"{placed} (the edge, Kafka, the streams worker; --worker-cpus)")
    try:
        provider = observe("up", settings)
        asyncio.run(
            _serve(
                settings,
                edge_settings,
                fleet_settings,
                streams_settings,
                out,
                console,
                worker_settings,
                worker_env,
            )
        )
    except (InfraError, SettingsError, EdgeFailed, CatalogueError) as exc:  # Catalogue: the edge's models
        console.print(f"[red]error:[/] {exc}")
        return 1
    shutdown_tracing(provider)
    return 0


STOP_GRACE_S = 30.0


def edge_stop_grace_s(edge_settings: EdgeSettings) -> float:
    """How long an edge child may take to stop after SIGTERM before it is killed: its shutdown grace for
    requests in flight, the notice to clients, and room to drain its cancels. A review: edges 2..N were
    killed 30 s after SIGTERM whatever ``SLUICE_EDGE_SHUTDOWN_GRACE_S`` said (streams cut by a reset, no
    ``shutdown`` cancels published), where edge 1 honoured it."""
    from ingest.app import Edge

    return max(STOP_GRACE_S, edge_settings.edge_shutdown_grace_s + Edge.SHUTDOWN_NOTICE_S + 15.0)


Publish = Callable[[str, Event], Awaitable[object]]


class ServiceProcess:
    """One ``sluice <command>`` child (a worker, the streams worker), restarted with back-off if it exits
    on its own."""

    def __init__(
        self,
        name: str,
        args: list[str],
        console: Console,
        env: dict[str, str],
        *,
        backoff_s: float = 1.0,
        halt: asyncio.Event | None = None,
        healthy_s: float = 60.0,
        stop_grace_s: float = STOP_GRACE_S,
    ) -> None:
        """``halt`` is the whole platform's stop: a child that exits once it is set (a Ctrl-C reaches the
        whole process group, so children exit on their own as ``sluice up`` starts stopping) is not
        restarted. A child that ran ``healthy_s`` before it exited is restarted after the first back-off
        again, not the last one (an audit: a worker that crashed twice at start waited 30 s to come back
        from a crash days later). ``stop_grace_s``: how long :meth:`stop` waits after SIGTERM before it
        kills (a worker's covers its drain)."""
        self.name = name
        self._stop_grace_s = stop_grace_s
        self._backoff_s = backoff_s
        self._healthy_s = healthy_s
        self._halt = halt
        self._stop_requested = asyncio.Event()
        self.exits = 0
        """How often the child exited on its own (each one is followed by a restart after a back-off)."""
        self.backoffs: list[float] = []
        """The back-off before each restart, in order."""
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
            began = time.monotonic()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "sluice",
                    *self._args,
                    env={**os.environ, **self._env},
                    preexec_fn=die_with(os.getpid()),
                )
            except OSError as exc:
                # a fork refused (a pids limit, memory, descriptors): tried again after the back-off like
                # an exit (a review: the supervisor ended on it, the child was never started again, the
                # fleet still counted it, and the stop re-raised it)
                self._proc = None
                why = f"could not start ({exc.strerror or exc})"
            else:
                if self.stopping:
                    # stopped while this child was being spawned: ``stop`` signalled the one before it, or
                    # none, and waited for this task for good (a review: a worker retired while it
                    # restarted hung its retirement and served on, uncounted)
                    await self._end(self._proc)
                    return
                why = f"exited with {await self._proc.wait()}"
            if self.stopping or self._halting():
                return
            self.exits += 1
            if time.monotonic() - began >= self._healthy_s:
                backoff = self._backoff_s
            self.backoffs.append(backoff)
            self._console.print(f"[yellow]{self.name} {why}; restarting in {backoff:.0f}s[/]")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(backoff):  # a stop during the back-off ends it at once
                    await self._stop_requested.wait()
            if self._halting():
                return
            backoff = min(backoff * 2, 30.0)

    def _halting(self) -> bool:
        return self._halt is not None and self._halt.is_set()

    def send_signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(sig)

    def serve(self) -> None:
        """A warm standby joined: if it exits, it restarts as a serving worker (it was counted as one)."""
        self._env.pop("SLUICE_WORKER_STANDBY", None)

    async def stop(self) -> None:
        self._stopping = True
        self._stop_requested.set()
        proc = self._proc
        if proc is not None:
            await self._end(proc)
        if self._task is not None:
            await self._task

    async def _end(self, proc: asyncio.subprocess.Process) -> None:
        """SIGTERM, then SIGKILL past the grace."""
        if proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self._stop_grace_s):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def _unless_stopped(stop: asyncio.Event, waiting: Awaitable[object]) -> bool:
    """Run ``waiting`` unless Ctrl-C (``stop``) comes first: then cancel it and return False. A start-up
    wait (the warehouse, the models loading) must not hold a Ctrl-C for minutes."""
    task = asyncio.ensure_future(waiting)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((task, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # its error, if it failed
        return True
    await _cancel(task)
    return False


async def _cancel(task: asyncio.Future[Any]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


@dataclass(slots=True)
class _Worker:
    process: ServiceProcess
    port: int
    """Its ops port (``/metrics``, ``/healthz``), or 0 when the child picked a free one."""
    model: str
    version: str
    serial: int


class Fleet:
    """The worker processes of every serving model version: the stable one, and a candidate while it has
    traffic or shadow (``Deployment.serving``), or the ``current`` version of a model never rolled out.

    The stable (or current) version runs ``SLUICE_FLEET_WORKERS_PER_MODEL`` workers, or with autoscaling
    the count of the latest ``WorkersScaled`` this fleet published (``sluice/autoscale.py``); a candidate
    runs one. ``follow`` re-reads the control topic every ``SLUICE_FLEET_SCALE_INTERVAL_S``, decides, and
    starts and stops workers to match; a stopping worker drains first, and a stopped version's unfinished
    requests run on the stable version (see ``WorkerService``)."""

    def __init__(
        self,
        settings: PlatformSettings,
        fleet: FleetSettings,
        console: Console,
        base_port: int,
        halt: asyncio.Event | None = None,
        worker_env: dict[str, str] | None = None,
        ops_host: str = "127.0.0.1",
        worker_drain_s: float = 0.0,
    ) -> None:
        self._settings = settings
        # A worker stopped drains first (SLUICE_WORKER_DRAIN_S), then flushes and commits: killed at a fixed
        # 30 s, one given a longer drain lost its flush and commits at every scale-in (a review).
        self._stop_grace_s = max(STOP_GRACE_S, worker_drain_s + 15.0)
        self._ops_host = ops_host  # SLUICE_WORKER_OPS_HOST: where a warm standby is asked /healthz
        self._worker_env = worker_env or {}
        self._halt = halt
        self._fleet = fleet
        self._console = console
        self._base_port = base_port  # model i's first worker serves /metrics on base + i; others pick a port
        self._names = TopicNames(settings.topic_prefix)
        self._started_at = utc_now()
        self.policy = ScalePolicy(
            min_workers=fleet.fleet_workers_per_model,
            max_workers=fleet.fleet_max_workers if fleet.fleet_autoscale else fleet.fleet_workers_per_model,
            target_lag=fleet.fleet_target_lag,
            scale_in_after_s=fleet.fleet_scale_in_after_s,
        )
        self.workers: dict[tuple[str, str], list[_Worker]] = {}
        self.standby: dict[tuple[str, str], list[_Worker]] = {}
        self.decisions: list[WorkersScaled] = []
        """What this fleet decided, in order (also on the control topic)."""
        self._scaled: dict[str, WorkersScaled] = {}
        self.changes: list[DeploymentChanged] = []
        """Every deployment change ``desired`` last read, in log order."""
        self._told: set[str] = set()
        """Ids of the deployment changes this fleet printed."""
        self._stopping: set[asyncio.Task[None]] = set()
        self._retiring: dict[asyncio.Task[None], _Worker] = {}
        """Workers being stopped, until they have exited (they hold their ops ports while they drain)."""
        self._serial = itertools.count(1)
        self._lag = GroupLag(settings.kafka)

    def desired(self) -> tuple[dict[tuple[str, str], int], dict[str, str]]:
        """(model, version) -> workers wanted now, and each model's stable version (blocking: reads Kafka
        and the cache)."""
        from bus.control import deployments_in, read_control
        from schemas.deployments import Deployment
        from schemas.manifest import current_model_dir, read_manifest

        changes: list[DeploymentChanged] = []
        for event in read_control(self._settings.kafka, self._names.control, "sluice-up"):
            if isinstance(event, DeploymentChanged):
                changes.append(event)
            elif isinstance(event, WorkersScaled) and event.time >= self._started_at:
                self._scaled[event.model] = event  # decisions of an earlier run do not carry over
        self.changes = changes
        deployments = deployments_in(changes)
        wanted: dict[tuple[str, str], int] = {}
        stable: dict[str, str] = {}
        for model in self._settings.served_models():
            if model in deployments:
                deployment = Deployment.of(deployments[model])
                stable[model] = deployment.stable
                for version in deployment.serving:
                    wanted[(model, version)] = 1
            else:
                stable[model] = read_manifest(current_model_dir(self._settings.cache_dir, model)).version
            wanted[(model, stable[model])] = self.replicas(model, stable[model])
        return wanted, stable

    def replicas(self, model: str, version: str) -> int:
        """Workers for the stable version: the latest decision about the model, within today's bounds. One
        about an earlier stable version carries over to a promoted one (:meth:`autoscale` publishes that):
        the traffic the old version's workers served is now the new one's. A review: a promotion under load
        dropped the model to ``--workers-per-model`` at once, with no ``WorkersScaled`` saying so."""
        scaled = self._scaled.get(model)
        count = scaled.replicas if scaled is not None else self.policy.min_workers
        return min(self.policy.max_workers, max(self.policy.min_workers, count))

    async def reconcile(self, wanted: dict[tuple[str, str], int], stable: dict[str, str]) -> None:
        for key in sorted(wanted):
            running = self.workers.setdefault(key, [])
            while len(running) < wanted[key]:
                running.append(await self._add(key))
            while len(running) > wanted[key]:
                self._retire(key, running.pop(), "scaled in")
        for key in sorted(self.workers.keys() - wanted.keys()):
            for worker in self.workers.pop(key):
                self._retire(key, worker, "the version no longer serves")
        warm = {(m, v) for m, v in stable.items()} if self._fleet.fleet_autoscale else set()
        for key in sorted(warm):
            pool = self.standby.setdefault(key, [])
            # none past --max-workers: such a standby could never join, and held a model's memory (and a
            # worker core while it loaded) for nothing (an audit)
            room = max(0, self.policy.max_workers - len(self.workers.get(key, [])))
            wanted_warm = min(self._fleet.fleet_warm_workers, room)
            while len(pool) < wanted_warm:
                pool.append(await self._spawn(key, standby=True))
            while len(pool) > wanted_warm:
                self._retire(key, pool.pop(), "a standby past --max-workers")
        for key in sorted(self.standby.keys() - warm):
            for worker in self.standby.pop(key):
                self._retire(key, worker, "standby of a version no longer stable")

    async def _add(self, key: tuple[str, str]) -> _Worker:
        """A warm standby joins at once when one is up; otherwise a new worker starts (and loads)."""
        pool = self.standby.get(key, [])
        for worker in list(pool):
            if await _answers(worker.port, self._ops_host):
                pool.remove(worker)
                worker.process.serve()  # a restart after this starts it serving, not warm again
                worker.process.send_signal(signal.SIGUSR1)
                self._console.print(
                    f"worker for {worker.model} version {worker.version} joins from the warm pool (#{worker.serial})"
                )
                return worker
        return await self._spawn(key, standby=False)

    async def _spawn(self, key: tuple[str, str], *, standby: bool) -> _Worker:
        model, version = key
        fixed = self._base_port + self._settings.served_models().index(model) if self._base_port else 0
        # A retiring worker holds its port while it drains (a review: after a promotion the next scale-out
        # was given the fixed port the old version's worker still held, and crash-looped until it left).
        held = [*self._retiring.values(), *(w for pool in self.standby.values() for w in pool)]
        taken = {w.port for running in self.workers.values() for w in running} | {w.port for w in held}
        if standby:
            port = free_port()  # polled for /healthz before it is told to join
        elif fixed and fixed not in taken:
            port = fixed
        else:
            port = 0
        serial = next(self._serial)
        name = f"worker #{serial}"
        what = f"worker for {model} version {version}" + (" (warm standby)" if standby else "")
        env = {**self._worker_env, "SLUICE_WORKER_OPS_PORT": str(port)}
        if standby:
            env["SLUICE_WORKER_STANDBY"] = "true"
        process = ServiceProcess(
            name,
            ["worker", "--model", model, "--version", version],
            self._console,
            env,
            halt=self._halt,
            stop_grace_s=self._stop_grace_s,
        )
        await process.start()
        self._console.print(f"{what} started (#{serial})")
        return _Worker(process, port, model, version, serial)

    def _retire(self, key: tuple[str, str], worker: _Worker, why: str) -> None:
        """Stop a worker in the background (it drains first), so the fleet keeps deciding meanwhile."""
        self._console.print(
            f"worker for {worker.model} version {worker.version} stopping: {why} (#{worker.serial})"
        )
        task = asyncio.create_task(worker.process.stop(), name=f"stop {worker.process.name}")
        self._stopping.add(task)
        self._retiring[task] = worker
        task.add_done_callback(self._stopping.discard)
        task.add_done_callback(lambda done: self._retiring.pop(done, None))

    async def autoscale(self, stable: dict[str, str], publish: Publish) -> None:
        """Decide each model's worker count from its lag; a change is published before it is acted on."""
        await asyncio.to_thread(self._lag.keep, {worker_group(m, v) for m, v in stable.items()})
        for model, version in sorted(stable.items()):
            current = len(self.workers.get((model, version), []))
            scaled = self._scaled.get(model)
            if scaled is not None and scaled.version != version:  # promoted since the last decision
                carried = self.replicas(model, version)
                why = f"{version} promoted: the {scaled.replicas} worker(s) of {scaled.version} carried over"
                await self._decided(publish, model, version, Decision(carried, current, why), 0)
                current = carried  # what this round's decision starts from: reconcile starts them next
            topic = self._names.requests(model)
            try:
                lag = await asyncio.to_thread(self._lag, topic, model, version)
            except (KafkaException, BusError) as exc:  # this model waits for the next round, not every model
                self._console.print(
                    f"[yellow]autoscaler: no lag for {model}@{version} this round ({exc}); "
                    "its workers stay as they are[/]"
                )
                continue
            decision = self.policy.decide(model, current, lag, time.monotonic(), self._lag.lagging.get(topic))
            if decision is not None:
                await self._decided(publish, model, version, decision, lag)

    async def _decided(
        self, publish: Publish, model: str, version: str, decision: Decision, lag: int
    ) -> None:
        """Publish ``decision`` about ``model``'s ``version``, then hold it as the fleet's target."""
        event = WorkersScaled(
            tenant="",
            model=model,
            source="sluice/autoscaler",
            version=version,
            replicas=decision.replicas,
            previous=decision.previous,
            reason=decision.reason,
            lag=lag,
            target_lag=self.policy.target_lag,
            bounds=(self.policy.min_workers, self.policy.max_workers),
            actor="autoscaler",
        )
        await publish(self._names.control, event)
        self._scaled[model] = event
        self.decisions.append(event)
        self._console.print(
            f"autoscaler: {model}@{version} {decision.previous} -> {decision.replicas} workers ({decision.reason})"
        )

    async def follow(self, publish: Publish) -> None:
        while True:
            await asyncio.sleep(self._fleet.fleet_scale_interval_s)
            try:
                wanted, stable = await asyncio.to_thread(self.desired)
                self.tell_rollouts()
                if self._fleet.fleet_autoscale:
                    await self.autoscale(stable, publish)
                    wanted.update({(m, v): self.replicas(m, v) for m, v in stable.items()})
                await self.reconcile(wanted, stable)
            except Exception as exc:  # keep serving what runs; the next round tries again
                self._console.print(f"[yellow]could not follow the control topic: {exc}[/]")

    def tell_rollouts(self) -> None:
        """Print each deployment change made since this fleet started, once, in log order (read every
        ``SLUICE_FLEET_SCALE_INTERVAL_S``): the operator watching `sluice up` sees a rollout warm up, step,
        promote or roll back."""
        from sluice.rollout import PHASE_COLOURS

        for event in self.changes:
            if event.id in self._told or event.time < self._started_at:
                continue
            self._told.add(event.id)
            colour = PHASE_COLOURS.get(event.phase, "cyan")
            by = f" by the {event.actor}" if event.actor else ""
            self._console.print(f"[{colour}]rollout {event.model}: {event.phase}{by}[/]: {event.reason}")

    def ports(self) -> list[tuple[str, int]]:
        return [
            (f"{model}@{version}", worker.port)
            for (model, version), running in sorted(self.workers.items())
            for worker in running
        ]

    async def stop(self) -> None:
        everyone = [w for group in (self.workers, self.standby) for ws in group.values() for w in ws]
        await asyncio.gather(*(w.process.stop() for w in everyone), *self._stopping)
        self._lag.close()
        self.workers.clear()
        self.standby.clear()


class KafkaWatch:
    """``sluice up``'s local Kafka nodes, watched: a node whose JVM exits on its own (a crash, the OOM
    killer, a ``kill``) is named, with its exit code and its log, and how to start it again (``sluice kafka
    up``, on its data; clients reconnect by themselves, and ``/readyz`` of the edges and workers says
    ``kafka: false`` meanwhile). Not restarted here: a node restarted by this watch and by the operator's
    ``sluice kafka up`` at once ran two JVMs on one node's data, and the cluster's start stopped the other
    nodes (seen in the scale-out test). ``halt`` is the platform's stop: nothing is reported once it is set."""

    def __init__(
        self, nodes: Sequence[LocalKafka], console: Console, halt: asyncio.Event, *, poll_s: float = 1.0
    ) -> None:
        self._nodes = list(nodes)
        self._console = console
        self._halt = halt
        self._poll_s = poll_s
        self._stopping = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(n), name=f"kafka node {n.node_id}") for n in self._nodes
        ]

    async def stop(self) -> None:
        self._stopping.set()
        await asyncio.gather(*self._tasks)

    async def _watch(self, node: LocalKafka) -> None:
        while not await self._ended_within(self._poll_s):
            code = node.exit_code()
            if code is None:
                continue
            self._console.print(
                f"[yellow]Kafka node {node.node_id} exited with {code} (its log: {node.log_file}); "
                "`sluice kafka up` starts it again on its data[/]"
            )
            return

    async def _ended_within(self, seconds: float) -> bool:
        """Wait ``seconds`` unless the watch stops first; whether it stopped (or the platform halts)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        return self._stopping.is_set() or self._halt.is_set()


class EdgeLoss:
    """Edge 1, the one in the ``sluice up`` process, watched: once its Kafka gateway or its batch runner
    died it serves nothing more, so the platform stops (``halt``) and :meth:`check` raises
    :class:`EdgeFailed`, for ``sluice up`` to exit 1 and whoever runs it to start it again. A review: it sat
    "up" with every request refused until someone noticed; edges 2..N exit and are restarted instead."""

    def __init__(self, halt: asyncio.Event) -> None:
        self._halt = halt
        self._loop = asyncio.get_running_loop()
        self.failure: BaseException | None = None

    def watch(self, edge: AsyncComponent) -> None:
        edge.watch(self._failed)

    def _failed(self, exc: BaseException) -> None:
        """On the failing thread."""
        self.failure = exc
        self._loop.call_soon_threadsafe(self._halt.set)

    def check(self) -> None:
        if self.failure is not None:
            raise EdgeFailed(
                f"the edge failed ({self.failure}): sluicegate stopped; start it again (under a process "
                "manager, restart `sluice up` when it exits 1)"
            ) from self.failure


async def _listen(edge: AsyncComponent, settings: EdgeSettings) -> None:
    """Start the edge; a port taken since the check at start-up is one line, not a traceback."""
    try:
        await edge.start()
    except OSError as exc:
        raise InfraError(
            f"the edge cannot listen on {settings.edge_host}:{settings.edge_port}: {exc.strerror or exc}; "
            "pick another --port"
        ) from exc


def reachable(host: str) -> str:
    """Where this machine reaches a service bound on ``host``: itself, or for a wildcard bind (``0.0.0.0``,
    ``::``, empty) the loopback address of that family."""
    if is_wildcard(host):
        return "::1" if ":" in host else "127.0.0.1"
    return host


async def _answers(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a child's ops server on ``host`` (its bind host) answers ``/healthz`` (so it runs and has its
    signal handlers)."""
    if port == 0:
        return False
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1)) as session,
            session.get(f"{http_url(reachable(host), port)}/healthz") as response,
        ):
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


READY_POLL_S = 2.0
"""How long one ``/readyz`` poll may take; a child too busy to answer in time (a model loading on a shared
box) is polled again, not taken for dead."""


async def _wait_ready(host: str, port: int, within_s: float, what: str = "the streams worker") -> None:
    """Wait for a child's ``/readyz`` (so "up" means up: e.g. ``sluice sql`` finds the migrated warehouse).
    ``host`` is the child's bind host (an IPv6 one is bracketed, a wildcard polled at loopback)."""
    if port == 0:
        return  # a free port picked by the child: nothing to poll
    url = f"{http_url(reachable(host), port)}/readyz"
    deadline = asyncio.get_running_loop().time() + within_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=READY_POLL_S)) as session:
        while asyncio.get_running_loop().time() < deadline:
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            await asyncio.sleep(0.25)
    raise InfraError(f"{what} was not ready at {url} within {within_s:.0f}s (see its log above)")


WORKERS_READY_S = 300.0
"""How long ``sluice up`` waits for its workers' ``/readyz`` before it says "up" anyway, with a warning."""


async def _wait_workers(
    workers: list[tuple[str, int]], within_s: float, console: Console, host: str = "127.0.0.1"
) -> None:
    """Wait for each worker's ``/readyz`` (model loaded, consuming, caught up) on ``host``, their
    ``SLUICE_WORKER_OPS_HOST`` (a review found them always polled at 127.0.0.1, never ready when bound on
    ``::1``). One not ready in time is named and left to come up (its requests wait on its topic
    meanwhile); a worker on a port it picked itself (0) cannot be polled."""

    async def one(name: str, port: int) -> None:
        try:
            await _wait_ready(host, port, within_s, what=f"the worker for {name}")
        except InfraError as exc:
            console.print(f"[yellow]{exc}; its requests wait for it[/]")

    await asyncio.gather(*(one(name, port) for name, port in workers))


def extra_edges(
    settings: EdgeSettings, edges: int, partitions: int, taken: Mapping[int, str] | None = None
) -> list[tuple[str, int]]:
    """(id, port) of the edges after the first: ids from :func:`more_edge_ids` (each its own replies
    partition while partitions last), on the ports after the first edge's. ``taken``: port -> what else
    of the platform listens there (an edge there would crash-loop while another service answered its
    readiness check)."""
    if edges > 1 and settings.edge_port == 0:
        raise SettingsError("several edges need a fixed SLUICE_EDGE_PORT (they take the ports after it)")
    ids = more_edge_ids(settings.edge_id, edges, partitions)
    placed = [(edge_id, settings.edge_port + index) for index, edge_id in enumerate(ids, 1)]
    last = settings.edge_port + len(placed)
    if last > 65535:
        raise SettingsError(f"{edges} edges need ports {settings.edge_port} to {last}; lower --port")
    for port in (settings.edge_port, *(port for _, port in placed)):
        if port and port in (taken or {}):
            given = (
                "--port or SLUICE_EDGE_PORT"
                if port == settings.edge_port
                else f"--edges {edges} from --port {settings.edge_port}"
            )
            raise SettingsError(f"edge port {port} ({given}) is {(taken or {})[port]}'s; pick another --port")
    return placed


def platform_ports(
    settings: PlatformSettings, worker: WorkerSettings, streams: StreamsSettings
) -> dict[int, str]:
    """The fixed ports ``sluice up``'s other services listen on: port -> which. :class:`SettingsError` when
    two of them would share one: the second to bind would crash-loop while the first answered its
    readiness poll, and ``sluice up`` said "up" (a review: a model's worker ops port on the streams port,
    or on Kafka's)."""
    taken: dict[int, str] = {}
    setting: dict[int, str] = {}

    def claim(port: int, who: str, variable: str) -> None:
        if port > 65535:
            raise SettingsError(f"{who} would listen on port {port} ({variable}), past 65535; lower it")
        if port in taken:
            raise SettingsError(
                f"port {port} would be both {taken[port]}'s ({setting[port]}) and {who}'s ({variable}); "
                "change one of them"
            )
        taken[port], setting[port] = who, variable

    if streams.streams_port:
        claim(streams.streams_port, "the streams worker", "SLUICE_STREAMS_PORT")
    if worker.worker_ops_port:
        for index, model in enumerate(settings.served_models()):
            offset = f" + {index}" if index else ""
            claim(worker.worker_ops_port + index, f"the {model} worker", f"SLUICE_WORKER_OPS_PORT{offset}")
    if settings.local_kafka:
        for node, (port, controller) in enumerate(
            local_kafka_ports(settings.kafka_port, settings.kafka_brokers)
        ):
            client = f"SLUICE_KAFKA_PORT + {2 * node}" if node else "SLUICE_KAFKA_PORT"
            claim(port, "Kafka", client)
            claim(controller, "Kafka", f"its controller, SLUICE_KAFKA_PORT + {2 * node + 1}")
    return taken


Listener = tuple[str, int, str, str]
"""(host, port, who listens there, what to change when another program holds the port)."""


def listeners(
    settings: PlatformSettings,
    edge: EdgeSettings,
    more_edges: Sequence[tuple[str, int]],
    worker: WorkerSettings,
    streams: StreamsSettings,
    kafka: Sequence[LocalKafka],
) -> list[Listener]:
    """Every fixed port ``sluice up`` will listen on: the edges (``more_edges``: :func:`extra_edges`), the
    streams worker, each model's first worker, and the local Kafka nodes it starts (``kafka``)."""
    found: list[Listener] = [
        (edge.edge_host, edge.edge_port, "the edge", "pick another --port (SLUICE_EDGE_PORT)")
    ]
    found += [
        (edge.edge_host, port, f"edge {edge_id}", "pick another --port or fewer --edges")
        for edge_id, port in more_edges
    ]
    found.append(
        (streams.streams_host, streams.streams_port, "the streams worker", "set SLUICE_STREAMS_PORT")
    )
    if worker.worker_ops_port:
        found += [
            (worker.worker_ops_host, worker.worker_ops_port + index, f"the {model} worker's /metrics",
             "set SLUICE_WORKER_OPS_PORT (model i's first worker listens on it + i; 0: free ports)")
            for index, model in enumerate(settings.served_models())
        ]  # fmt: skip
    for node in kafka:
        found.append(("127.0.0.1", node.port, f"Kafka node {node.node_id}", "set SLUICE_KAFKA_PORT"))
        found.append(
            ("127.0.0.1", node.controller_port, f"Kafka node {node.node_id}'s controller",
             "set SLUICE_KAFKA_PORT (its controller listens on the port after it)")
        )  # fmt: skip
    return found


def kafka_to_start(settings: PlatformSettings, console: Console) -> list[LocalKafka]:
    """The local Kafka nodes ``sluice up`` will start: none with an external cluster, else those of the local
    one that do not run (a running one is left as it is)."""
    if not settings.local_kafka:
        return []
    return [node for node in started_broker(settings, console).nodes if not node.running()]


def check_free(wanted: Sequence[Listener]) -> None:
    """:class:`SettingsError` naming the first of ``wanted`` whose port another program holds (0: a port the
    service picks itself)."""
    for host, port, who, fix in wanted:
        if port and not port_free(port, host):
            raise SettingsError(f"port {port} ({who}) is taken by another program; {fix}")


async def _serve(
    settings: PlatformSettings,
    edge_settings: EdgeSettings,
    fleet_settings: FleetSettings,
    streams_settings: StreamsSettings,
    out: Console,
    console: Console,
    worker_settings: WorkerSettings,
    worker_env: dict[str, str],
) -> None:
    stop = stop_on_signals()
    lost = EdgeLoss(stop)

    async with AsyncExitStack() as stack:
        stack.callback(lost.check)  # the last step of the unwinding: once everything has stopped
        if settings.local_kafka:
            broker = started_broker(settings, console)
            if broker.running():
                console.print(f"using the Kafka already running at {broker.bootstrap} (left running on exit)")
            else:
                # Only the nodes this run starts are its own to stop: a cluster `sluice kafka up` started
                # and found with a node down had its running nodes stopped on exit too (a review)
                launched = [node for node in broker.nodes if not node.running()]
                if len(launched) < len(broker.nodes):
                    console.print(
                        f"starting Kafka node(s) {', '.join(str(n.node_id) for n in launched)} of the cluster "
                        f"at {broker.bootstrap}; the nodes already running are left running on exit"
                    )
                for node in launched:
                    node.die_with_parent = True  # a `kill -9` of sluice up leaves no JVM behind
                with console.status(f"starting Kafka {settings.kafka_version} at {broker.bootstrap}"):
                    try:
                        await asyncio.to_thread(broker.start)
                    except InfraError:
                        if not stop.is_set():
                            raise
                        # a Ctrl-C reaches the whole group: the first run's storage format fails with it
                        console.print("stopping...")
                        return
                # The nodes this start launched: not one whose JVM another process was starting (waited on)
                stack.callback(broker.stop, 30.0, list(broker.launched))
                watch = KafkaWatch(broker.nodes, console, stop)
                await watch.start()
                stack.push_async_callback(watch.stop)  # before the nodes stop: that is no crash
        specs = topics_of(settings)
        changes = await asyncio.to_thread(apply_topics, quiet_admin(settings.kafka), specs)
        created = sum(c.action != "unchanged" for c in changes)
        console.print(f"topics: {len(changes)} in spec, {created} created or changed")

        # The streams worker owns the embedded warehouse (migrates it, serves reads to other processes)
        # and the dashboard; it can be killed and restarted without losing or double counting anything.
        streams = ServiceProcess("streams", ["streams"], console, {}, halt=stop)
        await streams.start()
        stack.push_async_callback(streams.stop)
        with console.status("starting the streams worker (warehouse, dashboard)"):
            ready = _wait_ready(streams_settings.streams_host, streams_settings.streams_port, 120)
            if not await _unless_stopped(stop, ready):
                console.print("stopping...")
                return

        # In a child process: torch stays out of the edge's process (and off its cores).
        console.print("preparing models (the first run builds demo-gpt, about a minute)")
        prepare = await asyncio.create_subprocess_exec(sys.executable, "-m", "sluice", "models", "prepare")
        prepared = await _unless_stopped(stop, prepare.wait())
        if not prepared or stop.is_set():  # a terminal's Ctrl-C reaches the child too: it fails as we stop
            if prepare.returncode is None:
                prepare.terminate()
                await prepare.wait()
            console.print("stopping...")
            return
        if prepare.returncode != 0:
            raise InfraError("`sluice models prepare` failed (see above)")
        # Workers per serving version of each model, following the deployments (and with autoscaling the
        # scaling decisions) on the control topic.
        producer = EventProducer(settings.kafka, "sluice-up")
        stack.enter_context(producer)
        fleet = Fleet(
            settings,
            fleet_settings,
            console,
            worker_settings.worker_ops_port,
            stop,
            worker_env,
            ops_host=worker_settings.worker_ops_host,
            worker_drain_s=worker_settings.worker_drain_s,
        )
        stack.push_async_callback(fleet.stop)
        await fleet.reconcile(*await asyncio.to_thread(fleet.desired))
        follow = asyncio.create_task(fleet.follow(producer.publish), name="fleet")
        stack.push_async_callback(_cancel, follow)
        workers = fleet.ports()

        partitions = await asyncio.to_thread(replies_partitions, settings)
        edge, gateway = build_edge(settings, edge_settings, partitions)
        await stack.enter_async_context(gateway)
        await _listen(edge, edge_settings)
        stack.push_async_callback(edge.stop)
        lost.watch(edge)
        # More edges: `sluice edge` children on the next ports, each with its own replies partition.
        edges = [edge.url]
        for edge_id, port in extra_edges(edge_settings, fleet_settings.fleet_edges, partitions):
            child = ServiceProcess(
                f"edge {edge_id}",
                ["edge"],
                console,
                {"SLUICE_EDGE_ID": edge_id, "SLUICE_EDGE_PORT": str(port)},
                halt=stop,
                stop_grace_s=edge_stop_grace_s(edge_settings),
            )
            await child.start()
            stack.push_async_callback(child.stop)
            ready = _wait_ready(edge_settings.edge_host, port, 120, what=f"edge {edge_id}")
            if not await _unless_stopped(stop, ready):
                console.print("stopping...")
                return
            edges.append(http_url(edge_settings.edge_host, port))

        # "up" means a first request is served, not queued behind a model still loading
        with console.status("loading models: waiting for the workers' /readyz"):
            waiting = _wait_workers(workers, WORKERS_READY_S, console, worker_settings.worker_ops_host)
            if not await _unless_stopped(stop, waiting):
                console.print("stopping...")
                return

        keys = f"API key: {DEMO_KEY}" if edge_settings.edge_tenants_file is None else "API keys: tenants file"
        out.print(f"[bold green]sluicegate is up[/]  {edge.url}/v1   {keys}")
        if len(edges) > 1:
            out.print(f"  edges: {'   '.join(f'{url}/v1' for url in edges)}")
        if fleet_settings.fleet_autoscale:
            policy = fleet.policy
            out.print(
                f"  autoscaling workers {policy.min_workers}..{policy.max_workers} per model on lag "
                f"(target {policy.target_lag} per worker, {fleet_settings.fleet_warm_workers} warm)"
            )
        out.print(f"  Kafka {settings.bootstrap}   models: {', '.join(settings.served_models())}")
        ops_host = worker_settings.worker_ops_host
        ops = ", ".join(
            f"{model} {http_url(ops_host, port) if port else 'on a free port'}" for model, port in workers
        )
        dashboard = http_url(streams_settings.streams_host, streams_settings.streams_port)
        out.print(f"  dashboard {dashboard}/dashboard   (streams metrics on {dashboard}/metrics)")
        out.print(f"  metrics: edge {edge.url}/metrics; workers {ops} (/metrics /healthz /readyz)")
        if settings.ops_token:
            out.print(
                "  ops token set: /metrics wants 'Authorization: Bearer $SLUICE_OPS_TOKEN'; "
                "open /dashboard?token=$SLUICE_OPS_TOKEN once in a browser"
            )
        out.print('  `sluice sql "SELECT ..."` queries the warehouse; Ctrl-C stops everything.')
        await stop.wait()
        console.print(
            f"[red]the edge failed ({lost.failure}); stopping...[/]" if lost.failure else "stopping..."
        )
