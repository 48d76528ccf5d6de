"""The embedding runner: dynamic batching across requests (and across one request's inputs).

Every input of every request becomes one batcher item; each tick runs at most ONE forward pass over a
batch of similar-length items. A request finishes when all its inputs are embedded, or at once when it
is cancelled or past its deadline (its remaining items are dropped unrun).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import numpy.typing as npt

from gpu_workers.batching import BatcherConfig, DynamicBatcher, EmbedItem
from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.generation import monotonic_deadline
from gpu_workers.observe import RunnerLoad
from gpu_workers.oom import OOM_CODE, MemoryBackoff, is_out_of_memory, release_memory
from gpu_workers.service import Arrival, Emitter, Origin
from schemas.events import (
    FLOAT32_BYTES,
    EmbeddingRequested,
    ErrorInfo,
    FinishReason,
    Float32Vectors,
    RequestFinished,
    Status,
    Timings,
    Usage,
    utc_now,
)
from schemas.manifest import ModelManifest

log = logging.getLogger(__name__)


@dataclass
class _Request:
    arrival: Arrival
    event: EmbeddingRequested
    vectors: dict[int, bytes] = field(default_factory=dict)
    """Input index -> its vector's little-endian float32 bytes."""
    started: datetime | None = None


@dataclass(frozen=True, slots=True)
class _Input:
    request_id: str
    index: int
    input_ids: list[int]


class EmbeddingRunner:
    def __init__(
        self,
        engine: EmbeddingEngine,
        manifest: ModelManifest,
        *,
        source: str,
        worker_id: str,
        batching: BatcherConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._manifest = manifest
        self._origin = Origin(source, worker_id)
        self._batcher: DynamicBatcher[_Input] = DynamicBatcher(batching)
        self._backoff = MemoryBackoff(ceiling=batching.max_batch_tokens)
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._last_batch = 0

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        event = arrival.event
        if not isinstance(event, EmbeddingRequested):
            emit.finish(
                arrival,
                self._origin.failed(
                    arrival,
                    "wrong_model_kind",
                    f"{event.model} serves embeddings, not {type(event).__name__}",
                ),
            )
            return
        if event.request_id in self._requests:
            return  # a duplicate delivery of a request still in flight
        too_long = [i for i, ids in enumerate(event.inputs) if len(ids) > self._manifest.max_context]
        if not event.inputs or too_long:
            emit.finish(
                arrival,
                self._origin.failed(
                    arrival,
                    "invalid_input",
                    f"inputs {too_long} exceed {self._manifest.max_context} tokens"
                    if too_long
                    else "no inputs",
                ),
            )
            return
        now, wall = self._clock(), utc_now()
        deadline = monotonic_deadline(event.deadline, wall, now)
        request = _Request(arrival, event)
        if deadline is not None and deadline <= now:
            emit.finish(arrival, self._terminal(request, "expired", "deadline"))
            return
        for index, ids in enumerate(event.inputs):
            item = EmbedItem(
                request_id=event.request_id,
                n_tokens=len(ids),
                arrival=now,
                payload=_Input(event.request_id, index, ids),
                deadline=deadline,
            )
            if not self._batcher.add(item, now):
                self._requests.pop(event.request_id, None)
                emit.finish(
                    arrival,
                    self._origin.failed(
                        arrival,
                        "queue_full",
                        "the embedding queue is full; retry later",
                    ),
                )
                return  # items already queued are skipped when their batch runs
            self._requests[event.request_id] = request

    def release(self, request_ids: Collection[str]) -> set[str]:
        # A batch runs within one tick: whatever is still here has not started.
        return {r for r in request_ids if self._requests.pop(r, None) is not None}

    def cancel(self, request_id: str, emit: Emitter) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            emit.finish(request.arrival, self._terminal(request, "cancelled", "cancelled"))

    def tick(self, emit: Emitter) -> None:
        now = self._clock()
        for item in self._batcher.take_expired(now):
            request = self._requests.pop(item.request_id, None)
            if request is not None:
                emit.finish(request.arrival, self._terminal(request, "expired", "deadline"))
        batch = [item for item in self._batcher.next_batch(now) or () if item.request_id in self._requests]
        self._last_batch = len(batch)
        if not batch:
            return
        started = utc_now()
        for item in batch:
            request = self._requests[item.request_id]
            if request.started is None:
                emit.joined(request.arrival, len(batch), 0.0)
        for item, vector in self._forward(batch):
            request = self._requests.get(item.request_id)
            if request is None:
                continue
            request.started = request.started or started
            if vector is None:  # alone it did not fit: the request ends, its other items are skipped
                del self._requests[item.request_id]
                emit.finish(request.arrival, self._out_of_memory(request, item))
                continue
            request.vectors[item.payload.index] = vector.astype("<f4", copy=False).tobytes()
            if len(request.vectors) == len(request.event.inputs):
                del self._requests[item.request_id]
                emit.finish(request.arrival, self._terminal(request, "completed", "stop"))

    def _forward(
        self, batch: list[EmbedItem[_Input]]
    ) -> list[tuple[EmbedItem[_Input], npt.NDArray[np.float32] | None]]:
        """Each item with its vector. A batch that does not fit in memory runs as two halves (recursively);
        an item that does not fit alone gets None. The batcher's token budget follows
        (:class:`~gpu_workers.oom.MemoryBackoff`)."""
        try:
            vectors = self._engine.embed([item.payload.input_ids for item in batch])
        except Exception as exc:
            if not is_out_of_memory(exc):
                raise
            release_memory(self._engine.device)
            padded = len(batch) * max(item.n_tokens for item in batch)
            self._batcher.token_budget = self._backoff.failed(padded)
            log.warning(
                "%s: out of memory embedding %d items (%d padded tokens); batches now hold at most %d",
                self._manifest.model_id,
                len(batch),
                padded,
                self._batcher.token_budget,
            )
            if len(batch) == 1:
                return [(batch[0], None)]
            half = len(batch) // 2
            return self._forward(batch[:half]) + self._forward(batch[half:])
        if self._backoff.succeeded():
            self._batcher.token_budget = self._backoff.limit
        return list(zip(batch, vectors, strict=True))

    def _out_of_memory(self, request: _Request, item: EmbedItem[_Input]) -> RequestFinished:
        return self._origin.finished(
            request.arrival,
            "failed",
            "error",
            error=ErrorInfo(
                code=OOM_CODE,
                message=f"input {item.payload.index} ({item.n_tokens} tokens) does not fit in the memory of "
                f"{self._engine.device} even alone; retry later or send it shorter",
                retriable=True,
            ),
            timings=Timings(
                accepted=request.event.time, started=request.started, first_token=None, finished=utc_now()
            ),
        )

    def wait_hint(self) -> float | None:
        return self._batcher.time_until_ready(self._clock())

    def load(self) -> RunnerLoad:
        running = sum(1 for request in self._requests.values() if request.started is not None)
        return RunnerLoad(
            running=running,
            waiting=len(self._requests) - running,
            budget_ratio=0.0,
            batch=self._last_batch,
            out_of_memory=self._backoff.failures,
            limit_ratio=self._backoff.ratio,
        )

    def _packed(self, request: _Request) -> Float32Vectors:
        rows = [request.vectors[i] for i in range(len(request.event.inputs))]
        return Float32Vectors(dim=len(rows[0]) // FLOAT32_BYTES, data=b"".join(rows))

    def _terminal(self, request: _Request, status: Status, reason: FinishReason) -> RequestFinished:
        event = request.event
        tokens = sum(len(ids) for ids in event.inputs)
        done = status == "completed"
        return self._origin.finished(
            request.arrival,
            status,
            reason,
            Usage(
                prompt_tokens=tokens if done else 0, completion_tokens=0, total_tokens=tokens if done else 0
            ),
            embeddings=self._packed(request) if done else None,
            timings=Timings(
                accepted=event.time,
                started=request.started,
                first_token=utc_now() if done else None,
                finished=utc_now(),
            ),
        )
