"""Fault injection for rollout drills: a runner that fails a share of requests, slows every step, cuts
every answer short, or embeds differently.

A deliberately bad candidate is what proves automated rollback works, so the faults are settings of the
worker (``SLUICE_FAULT_*``), scoped to model versions, not code paths of the model. A failed request
still ends with exactly one terminal event (``failed``, code ``fault_injected``), like any other failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec

from schemas.events import Float32Vectors, GenerationRequested, RequestFinished, TokenChunk

if TYPE_CHECKING:
    from gpu_workers.observe import RunnerLoad
    from gpu_workers.runtime import Arrival, Emitter, Origin, Runner


def fails(request_id: str, ratio: float) -> bool:
    """Whether the request is among the ``ratio`` share chosen by its id's hash (the same on every run)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < ratio


class FaultyRunner:
    """Wraps a runner: fails ``fail_ratio`` of requests at once, sleeps ``delay_s`` before each step, stops
    every generation after ``max_tokens`` tokens (0: as asked), a model that answers differently, and adds
    ``vector_noise`` to every embedding (:func:`noisy`), a model that embeds differently."""

    def __init__(
        self,
        inner: Runner,
        origin: Origin,
        *,
        fail_ratio: float,
        delay_s: float,
        max_tokens: int = 0,
        vector_noise: float = 0.0,
    ) -> None:
        self._inner = inner
        self._origin = origin
        self._fail_ratio = fail_ratio
        self._delay_s = delay_s
        self._max_tokens = max_tokens
        self._vector_noise = vector_noise

    def _emit(self, emit: Emitter) -> Emitter:
        return _NoisyVectors(emit, self._vector_noise) if self._vector_noise > 0 else emit

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        if fails(arrival.event.request_id, self._fail_ratio):
            emit.finish(arrival, self._origin.failed(arrival, "fault_injected", "injected failure (drill)"))
            return
        event = arrival.event
        if isinstance(event, GenerationRequested) and 0 < self._max_tokens < event.sampling.max_tokens:
            sampling = msgspec.structs.replace(event.sampling, max_tokens=self._max_tokens)
            arrival = dataclasses.replace(arrival, event=msgspec.structs.replace(event, sampling=sampling))
        self._inner.accept(arrival, self._emit(emit))

    def cancel(self, request_id: str, emit: Emitter) -> None:
        self._inner.cancel(request_id, self._emit(emit))

    def release(self, request_ids: Collection[str], *, running: bool = False) -> set[str]:
        return self._inner.release(request_ids, running=running)

    def tick(self, emit: Emitter) -> None:
        if self._delay_s and self._inner.wait_hint() == 0:
            time.sleep(self._delay_s)
        self._inner.tick(self._emit(emit))

    def wait_hint(self) -> float | None:
        return self._inner.wait_hint()

    def load(self) -> RunnerLoad:
        return self._inner.load()


def noisy(vector: list[float], noise: float, rng: random.Random) -> list[float]:
    """``vector`` plus Gaussian noise of ``noise`` per component, scaled back to its norm: for a unit vector
    of ``d`` components the cosine to the original is about ``1 / sqrt(1 + d * noise**2)`` (MiniLM, 384:
    0.05 gives ~0.71, 0.002 ~0.9992)."""
    moved = [x + rng.gauss(0.0, noise) for x in vector]
    norm = sum(x * x for x in vector) ** 0.5
    scale = norm / (sum(x * x for x in moved) ** 0.5 or 1.0)
    return [x * scale for x in moved]


class _NoisyVectors:
    """An emitter whose terminal events carry :func:`noisy` vectors (seeded by the request id: the same on
    every run)."""

    def __init__(self, inner: Emitter, noise: float) -> None:
        self._inner = inner
        self._noise = noise

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        self._inner.chunk(arrival, chunk)

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        vectors = result.vectors()
        if vectors:
            rng = random.Random(result.request_id)  # noqa: S311 (a drill's noise, not a secret)
            moved = [noisy(v, self._noise, rng) for v in vectors]
            if result.embeddings_f32 is not None:
                result = msgspec.structs.replace(
                    result, embeddings_f32=Float32Vectors.pack(moved, result.embeddings_f32.dim)
                )
            else:
                result = msgspec.structs.replace(result, embeddings=moved)
        self._inner.finish(arrival, result)

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        self._inner.joined(arrival, batch, budget_ratio)
