"""Fault injection for rollout drills: a runner that fails a share of requests, slows every step, or cuts
every answer short.

A deliberately bad candidate is what proves automated rollback works, so the faults are settings of the
worker (``SLUICE_FAULT_*``), scoped to model versions, not code paths of the model. A failed request
still ends with exactly one terminal event (``failed``, code ``fault_injected``), like any other failure.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

import msgspec

from schemas.events import GenerationRequested

if TYPE_CHECKING:
    from gpu_workers.observe import RunnerLoad
    from gpu_workers.runtime import Arrival, Emitter, Origin, Runner


def fails(request_id: str, ratio: float) -> bool:
    """Whether the request is among the ``ratio`` share chosen by its id's hash (the same on every run)."""
    digest = hashlib.blake2b(request_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < ratio


class FaultyRunner:
    """Wraps a runner: fails ``fail_ratio`` of requests at once, sleeps ``delay_s`` before each step, and
    stops every generation after ``max_tokens`` tokens (0: as asked), a model that answers differently."""

    def __init__(
        self, inner: Runner, origin: Origin, *, fail_ratio: float, delay_s: float, max_tokens: int = 0
    ) -> None:
        self._inner = inner
        self._origin = origin
        self._fail_ratio = fail_ratio
        self._delay_s = delay_s
        self._max_tokens = max_tokens

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        if fails(arrival.event.request_id, self._fail_ratio):
            emit.finish(arrival, self._origin.failed(arrival, "fault_injected", "injected failure (drill)"))
            return
        event = arrival.event
        if isinstance(event, GenerationRequested) and 0 < self._max_tokens < event.sampling.max_tokens:
            sampling = msgspec.structs.replace(event.sampling, max_tokens=self._max_tokens)
            arrival = dataclasses.replace(arrival, event=msgspec.structs.replace(event, sampling=sampling))
        self._inner.accept(arrival, emit)

    def cancel(self, request_id: str, emit: Emitter) -> None:
        self._inner.cancel(request_id, emit)

    def release(self, request_ids: Collection[str]) -> set[str]:
        return self._inner.release(request_ids)

    def tick(self, emit: Emitter) -> None:
        if self._delay_s and self._inner.wait_hint() == 0:
            time.sleep(self._delay_s)
        self._inner.tick(emit)

    def wait_hint(self) -> float | None:
        return self._inner.wait_hint()

    def load(self) -> RunnerLoad:
        return self._inner.load()
