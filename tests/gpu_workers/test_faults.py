"""Fault injection for rollout drills (:mod:`gpu_workers.faults`): what a faulty candidate answers."""

from __future__ import annotations

import math
import random
from collections.abc import Collection

from gpu_workers.faults import FaultyRunner, noisy
from gpu_workers.observe import RunnerLoad
from gpu_workers.runtime import Arrival, Emitter, Origin
from schemas.events import EmbeddingRequested, Float32Vectors, RequestFinished, TokenChunk, Usage

ORIGIN = Origin("gpu_workers/test", "w1")


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True)) / math.hypot(*a) / math.hypot(*b)


class Embedder:
    """A runner that answers every accepted request at the next tick with fixed unit vectors."""

    def __init__(self, vectors: list[list[float]]) -> None:
        self.vectors = vectors
        self.waiting: list[Arrival] = []

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        self.waiting.append(arrival)

    def cancel(self, request_id: str, emit: Emitter) -> None:
        pass

    def tick(self, emit: Emitter) -> None:
        for arrival in self.waiting:
            packed = Float32Vectors.pack(self.vectors, len(self.vectors[0]))
            usage = Usage(prompt_tokens=2, completion_tokens=0, total_tokens=2)
            emit.finish(arrival, ORIGIN.finished(arrival, "completed", "stop", usage, embeddings=packed))
        self.waiting = []

    def release(self, request_ids: Collection[str], *, running: bool = False) -> set[str]:
        return set()

    def wait_hint(self) -> float | None:
        return 0 if self.waiting else None

    def load(self) -> RunnerLoad:
        raise NotImplementedError


class Kept:
    def __init__(self) -> None:
        self.finished: list[RequestFinished] = []

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        raise AssertionError("an embedding has no chunks")

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        self.finished.append(result)

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


def unit(rng: random.Random, dim: int = 384) -> list[float]:
    v = [rng.gauss(0, 1) for _ in range(dim)]
    norm = math.hypot(*v)
    return [x / norm for x in v]


def answers(noise: float, request_id: str = "r1") -> tuple[list[list[float]], list[list[float]]]:
    """What the runner computed and what the faulty runner emitted, for one request."""
    rng = random.Random(7)
    computed = [unit(rng), unit(rng)]
    kept = Kept()
    runner = FaultyRunner(Embedder(computed), ORIGIN, fail_ratio=0.0, delay_s=0.0, vector_noise=noise)
    event = EmbeddingRequested(
        tenant="acme", model="all-minilm-l6-v2", request_id=request_id, source="test", model_version="v1",
        inputs=[[1, 2], [3]],
    )  # fmt: skip
    runner.accept(Arrival(event, ("requests", 0), 0), kept)
    runner.tick(kept)
    (result,) = kept.finished
    emitted = result.vectors()
    assert emitted is not None
    return [list(map(float, v)) for v in computed], emitted


def test_vector_noise_moves_every_embedding_by_the_stated_cosine_and_keeps_its_norm() -> None:
    computed, emitted = answers(0.05)
    for before, after in zip(computed, emitted, strict=True):
        assert 0.65 < cosine(before, after) < 0.77  # 1 / sqrt(1 + 384 * 0.05**2) = 0.71
        assert math.isclose(math.hypot(*after), 1.0, rel_tol=1e-4)
    assert answers(0.05) == (computed, emitted), "seeded by the request id: the same on every run"
    assert answers(0.05, "r2")[1] != emitted
    small = answers(0.002)
    assert all(cosine(a, b) > 0.999 for a, b in zip(*small, strict=True))


def test_without_noise_the_vectors_are_the_runners() -> None:
    computed, emitted = answers(0.0)
    assert all(cosine(a, b) > 0.999999 for a, b in zip(computed, emitted, strict=True))


def test_noisy_keeps_a_zero_vector_zero() -> None:
    assert noisy([0.0, 0.0], 0.1, random.Random(1)) == [0.0, 0.0]
