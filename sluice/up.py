"""``sluice up``: bring the platform's pieces up in order, hold them until a signal, stop them in reverse."""

from __future__ import annotations

import asyncio
import signal
from contextlib import AsyncExitStack
from pathlib import Path

from rich.console import Console

from infra.errors import InfraError
from infra.kafka.broker import LocalKafka
from infra.topics import apply_topics, make_admin, platform_topics
from infra.warehouse import WarehouseQueryServer, migrate, open_warehouse
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames


def run_platform(settings: PlatformSettings, out: Console, console: Console) -> int:
    """Run until SIGINT/SIGTERM; returns the process exit code."""
    try:
        asyncio.run(_serve(settings, out, console))
    except InfraError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 1
    return 0


async def _serve(settings: PlatformSettings, out: Console, console: Console) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    async with AsyncExitStack() as stack:
        if settings.local_kafka:
            broker = LocalKafka(
                data_dir=Path(settings.data_dir) / "kafka",
                cache_dir=settings.cache_dir,
                version=settings.kafka_version,
                port=settings.kafka_port,
                progress=lambda artifact: console.print(f"  [dim]downloaded {artifact}[/]"),
            )
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

        out.print(
            f"[bold green]sluicegate is up[/]  Kafka {settings.bootstrap}  warehouse reads {server.url}"
        )
        out.print('`sluice sql "SELECT ..."` queries the warehouse; Ctrl-C stops everything.')
        await stop.wait()
        console.print("stopping...")
