"""Offline evaluation: logged requests through one model version in this process, with no Kafka.

``sluice rollout evaluate`` runs the same logged production requests through the stable and the
candidate versions, one after the other, with the worker's own runner (scheduler, engine, batching), and
compares the outcomes with the rollout gates before the candidate sees live traffic. Each request keeps
its tokens and sampling (seed included, so greedy and seeded sampling repeat) but gets a fresh id and no
deadline or reply: its timings start when it is handed to the runner.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from gpu_workers.main import runner_factory
from gpu_workers.runtime import Arrival, Request
from gpu_workers.settings import WorkerSettings
from gpu_workers.terminal import with_request
from schemas.events import RequestFinished, TokenChunk, utc_now
from schemas.ids import uuid7
from schemas.manifest import read_manifest

SOURCE = "gpu_workers/evaluate"


@dataclass
class _Collector:
    """The runner's emitter: keeps each terminal event, with the request's fields copied in."""

    version: str
    results: dict[str, RequestFinished] = field(default_factory=dict)

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        pass

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        self.results[arrival.event.request_id] = with_request(result, arrival.event, None, self.version)

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


@dataclass(frozen=True)
class OfflineRun:
    version: str
    results: list[RequestFinished]
    """In the order of the requests given (``results[i]`` answers ``requests[i]``)."""
    seconds: float


def run_offline(
    model_dir: Path,
    requests: Sequence[Request],
    worker: WorkerSettings,
    *,
    concurrency: int = 16,
    progress: Callable[[int], None] | None = None,
) -> OfflineRun:
    """Run ``requests`` through the model in ``model_dir``, at most ``concurrency`` at once."""
    version = read_manifest(model_dir).version
    runner = runner_factory(model_dir, worker, SOURCE, f"evaluate-{version}")()
    collector = _Collector(version)
    ids: list[str] = []
    pending = deque(enumerate(requests))
    began = time.perf_counter()
    while pending or len(collector.results) < len(ids):
        while pending and len(ids) - len(collector.results) < concurrency:
            index, logged = pending.popleft()
            event = msgspec.structs.replace(
                logged, id=uuid7(), request_id=uuid7(), time=utc_now(), deadline=None, reply=None
            )
            ids.append(event.request_id)
            runner.accept(Arrival(event, ("evaluate", 0), index), collector)
        done = len(collector.results)
        runner.tick(collector)
        if progress is not None and len(collector.results) > done:
            progress(len(collector.results) - done)
    return OfflineRun(version, [collector.results[i] for i in ids], time.perf_counter() - began)
