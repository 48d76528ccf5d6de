"""``sluice up``: bring the platform's pieces up in order, hold them until a signal, stop them in reverse.

Kafka (unless ``SLUICE_KAFKA_BOOTSTRAP``) → topics → warehouse (migrated, served to other processes) →
models (built or linked) → one worker process per model (restarted if it dies) → the edge, in this process.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from contextlib import AsyncExitStack

import msgspec
from rich.console import Console

from gpu_workers.settings import WorkerSettings
from infra.errors import InfraError
from infra.topics import apply_topics, make_admin, platform_topics
from infra.warehouse import WarehouseQueryServer, migrate, open_warehouse
from ingest.auth import DEMO_KEY
from ingest.main import build_edge
from ingest.settings import EdgeSettings
from monitoring.tracing import shutdown_tracing
from schemas.settings import PlatformSettings, SettingsError, load_settings
from schemas.topics import TopicNames
from sluice.services import local_broker, observe, replies_partitions


def run_platform(settings: PlatformSettings, out: Console, console: Console, port: int | None = None) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit code."""
    try:
        edge_settings = load_settings(EdgeSettings)
    except SettingsError as exc:
        console.print(f"[red]settings error:[/] {exc}")
        return 2
    if port is not None:
        edge_settings = msgspec.structs.replace(edge_settings, edge_port=port)
    try:
        provider = observe("up")
        asyncio.run(_serve(settings, edge_settings, out, console))
    except (InfraError, SettingsError) as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    shutdown_tracing(provider)
    return 0


STOP_GRACE_S = 30.0


class WorkerProcess:
    """One ``sluice worker --model M`` child, restarted with back-off if it exits on its own."""

    def __init__(self, model_id: str, console: Console, ops_port: int) -> None:
        self.model_id = model_id
        self.ops_port = ops_port
        self._console = console
        self._proc: asyncio.subprocess.Process | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    @property
    def stopping(self) -> bool:
        return self._stopping

    async def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"worker-{self.model_id}")

    async def _supervise(self) -> None:
        backoff = 1.0
        while not self._stopping:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sluice",
                "worker",
                "--model",
                self.model_id,
                env={**os.environ, "SLUICE_WORKER_OPS_PORT": str(self.ops_port)},
            )
            code = await self._proc.wait()
            if self.stopping:
                return
            self._console.print(
                f"[yellow]worker {self.model_id} exited with {code}; restarting in {backoff:.0f}s[/]"
            )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30.0)

    async def stop(self) -> None:
        self._stopping = True
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


async def _serve(
    settings: PlatformSettings, edge_settings: EdgeSettings, out: Console, console: Console
) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async with AsyncExitStack() as stack:
        if settings.local_kafka:
            broker = local_broker(settings, console)
            if broker.running():
                console.print(f"using the Kafka already running at {broker.bootstrap} (left running on exit)")
            else:
                with console.status(f"starting Kafka {settings.kafka_version} at {broker.bootstrap}"):
                    await asyncio.to_thread(broker.start)
                stack.callback(broker.stop)
        specs = platform_topics(TopicNames(settings.topic_prefix), settings.served_models())
        changes = await asyncio.to_thread(apply_topics, make_admin(settings.bootstrap), specs)
        created = sum(c.action != "unchanged" for c in changes)
        console.print(f"topics: {len(changes)} in spec, {created} created or changed")

        client = await asyncio.to_thread(open_warehouse, settings)
        stack.callback(client.close)
        applied = await asyncio.to_thread(migrate, client)
        console.print(f"warehouse: {len(applied)} migration(s) applied")
        server = await stack.enter_async_context(WarehouseQueryServer(client, settings))

        # In a child process: torch stays out of the edge's process (and off its cores).
        console.print("preparing models (the first run builds demo-gpt, about a minute)")
        prepare = await asyncio.create_subprocess_exec(sys.executable, "-m", "sluice", "models", "prepare")
        if await prepare.wait() != 0:
            raise InfraError("`sluice models prepare` failed (see above)")
        workers: list[WorkerProcess] = []
        base = load_settings(WorkerSettings).worker_ops_port  # worker i serves /metrics on base + i
        for index, model_id in enumerate(settings.served_models()):
            worker = WorkerProcess(model_id, console, base + index if base else 0)
            await worker.start()
            stack.push_async_callback(worker.stop)
            workers.append(worker)

        edge, gateway = build_edge(
            settings, edge_settings, await asyncio.to_thread(replies_partitions, settings)
        )
        await stack.enter_async_context(gateway)
        await edge.start()
        stack.push_async_callback(edge.stop)

        out.print(f"[bold green]sluicegate is up[/]  {edge.url}/v1   API key: {DEMO_KEY}")
        out.print(
            f"  Kafka {settings.bootstrap}   warehouse reads {server.url}   models: {', '.join(settings.served_models())}"
        )
        ops = ", ".join(f"{w.model_id} http://127.0.0.1:{w.ops_port or '<free port>'}" for w in workers)
        out.print(f"  metrics: edge {edge.url}/metrics; workers {ops} (/metrics /healthz /readyz)")
        out.print('  `sluice sql "SELECT ..."` queries the warehouse; Ctrl-C stops everything.')
        await stop.wait()
        console.print("stopping...")
