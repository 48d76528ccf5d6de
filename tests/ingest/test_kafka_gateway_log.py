"""The Kafka gateway's reads of the log (resumed and lagging streams), in process: the consumer stood in for
by one whose polls block, as a poll of a partition with nothing new does for its 0.2 s."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from ingest import kafka_gateway
from ingest.kafka_gateway import KafkaGateway
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames
from tests.ingest.conftest import eventually


async def test_log_readers_poll_on_the_gateways_threads_and_leave_the_default_pool_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: each resumed or lagging stream polled the log on the loop's default executor
    (``min(32, cpus + 4)`` threads), which also tokenises large bodies: 24 live streams and 72 resume
    readers made a 120 KB prompt's request take 1.5-2.6 s instead of 0.1-0.2 s."""
    release = threading.Event()
    lock = threading.Lock()
    polling: dict[int, str] = {}
    """Thread id -> name of each thread inside a poll now."""

    class Consumer:
        def __init__(self, _config: dict[str, Any]) -> None:
            pass

        def assign(self, _partitions: list[Any]) -> None:
            pass

        def consume(self, _count: int, _timeout: float) -> list[Any]:
            thread = threading.current_thread()
            with lock:
                polling[thread.ident or 0] = thread.name
            release.wait(10)
            with lock:
                polling.pop(thread.ident or 0, None)
            return []

        def close(self) -> None:
            pass

    monkeypatch.setattr(kafka_gateway, "Consumer", Consumer)
    gateway = KafkaGateway(
        kafka=KafkaConnection(bootstrap="127.0.0.1:1"), names=TopicNames("t"), edge_id="e", reply_partition=0
    )
    gateway._log_readers = ThreadPoolExecutor(  # as _start makes them (it needs a broker)
        KafkaGateway.LOG_READERS, thread_name_prefix="log-e"
    )

    async def read(request_id: str) -> None:
        async for _ in gateway.read_log(request_id, 0):
            return

    tasks = [asyncio.create_task(read(f"request-{n}")) for n in range(KafkaGateway.LOG_READERS + 1)]
    try:
        # as many polls at once as the gateway has threads (the default pool has fewer on a small box)
        await eventually(lambda: len(polling) == KafkaGateway.LOG_READERS)
        assert {name.rpartition("_")[0] for name in polling.values()} == {"log-e"}
        # and the default pool is free for the edge's other work
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), timeout=2) == "free"
    finally:
        release.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gateway.stop()
    assert gateway._log_readers is None
