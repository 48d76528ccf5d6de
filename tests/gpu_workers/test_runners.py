"""The generation and embedding runners in this process, without Kafka: the terminal events they build and
the seed a request without one samples with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import pytest

from gpu_workers.engine import GenerationEngine
from gpu_workers.flush import FlushPolicy
from gpu_workers.generation import GenerationRunner
from gpu_workers.models import LoadedModel
from gpu_workers.scheduler import SchedulerConfig
from gpu_workers.service import Arrival, Request, Runner
from schemas.events import GenerationRequested, RequestFinished, SamplingParams, TokenChunk
from schemas.ids import derive_seed, uuid7

SOURCE = "gpu_workers/test"
WORKER = "worker-1"
PROMPT = [5, 6, 7, 8, 9, 10]


@dataclass
class Collected:
    chunks: list[TokenChunk] = field(default_factory=list)
    finished: dict[str, RequestFinished] = field(default_factory=dict)

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        self.chunks.append(chunk)

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        assert result.request_id not in self.finished, "one terminal event per request"
        self.finished[result.request_id] = result

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


def run(runner: Runner, requests: Sequence[Request], max_ticks: int = 2000) -> Collected:
    """Accept ``requests`` and tick until each has its terminal event."""
    out = Collected()
    for offset, request in enumerate(requests):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    for _ in range(max_ticks):
        if len(out.finished) == len(requests):
            return out
        runner.tick(out)
    raise AssertionError(f"{len(requests) - len(out.finished)} requests never finished")


@pytest.fixture(scope="module")
def gpt_runner(demo_gpt: LoadedModel) -> GenerationRunner:
    tokenizer = demo_gpt.tokenizer
    return GenerationRunner(
        GenerationEngine(demo_gpt.model, max_batch_size=8, max_context=demo_gpt.manifest.max_context),
        lambda ids: str(tokenizer.decode(ids, skip_special_tokens=True)),
        demo_gpt.manifest,
        source=SOURCE,
        worker_id=WORKER,
        scheduler=SchedulerConfig(max_running=8, max_batch_tokens=4096, max_waiting=64),
        flush=FlushPolicy(max_tokens=4, max_delay_s=0.0),
    )


def generation(sampling: SamplingParams, request_id: str | None = None) -> GenerationRequested:
    return GenerationRequested(
        tenant="acme",
        model="demo-gpt",
        request_id=request_id or uuid7(),
        source="test",
        model_version="v",
        input_ids=PROMPT,
        sampling=sampling,
    )


def test_a_seedless_request_samples_with_the_seed_the_edge_would_give_it(
    gpt_runner: GenerationRunner,
) -> None:
    """A request published without a seed (not through the edge) samples the same tokens as the edge's
    copy of it, which carries ``derive_seed(request_id)``."""
    sampling = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    seedless = generation(sampling)
    seeded = generation(msgspec.structs.replace(sampling, seed=derive_seed(seedless.request_id)))
    other = generation(msgspec.structs.replace(sampling, seed=derive_seed(uuid7())))
    done = run(gpt_runner, [seedless, seeded, other]).finished
    assert done[seedless.request_id].text == done[seeded.request_id].text
    assert done[seedless.request_id].text != done[other.request_id].text
