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
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import numpy.typing as npt

from gpu_workers.batching import BatcherConfig, DynamicBatcher, EmbedItem
from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.generation import monotonic_deadline
from gpu_workers.observe import RunnerLoad
from gpu_workers.oom import OOM_CODE, MemoryBackoff, is_out_of_memory, release_memory
from gpu_workers.runtime import ENGINE_ERROR_CODE, Arrival, Emitter, FailedSteps, Origin
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

if TYPE_CHECKING:
    from gpu_workers.models import QuietTeam

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
    normalize: bool = True
    """Its request's ``normalize``: whether its vector is L2-normalised."""


@dataclass(frozen=True, slots=True)
class _Failed:
    """The batch an item was in failed with ``error`` (not out of memory); ``stop``: too many in a row."""

    error: Exception
    stop: bool


_Outcome: TypeAlias = "npt.NDArray[np.float32] | _Failed | None"
_Flight = Callable[[], list[tuple[EmbedItem[_Input], _Outcome]]]
"""A launched batch: called, it waits for the device and returns each item with its vector (None: the
item does not fit in memory even alone; :class:`_Failed`: its batch failed)."""


class EmbeddingRunner:
    def __init__(
        self,
        engine: EmbeddingEngine,
        manifest: ModelManifest,
        *,
        source: str,
        worker_id: str,
        batching: BatcherConfig,
        overlap: bool | None = None,
        team: QuietTeam | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._manifest = manifest
        self._origin = Origin(source, worker_id)
        self._batcher: DynamicBatcher[_Input] = DynamicBatcher(batching)
        self._backoff = MemoryBackoff(ceiling=batching.max_batch_tokens)
        self._failed_batches = FailedSteps()
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._last_batch = 0
        self.overlap = engine.overlaps if overlap is None else overlap
        """Launch each batch before finishing the one before it (on a GPU, the previous batch's terminal
        events are built and published while the device computes the next)."""
        self._in_flight: _Flight | None = None
        self.team = team
        """On a CPU, torch's team sized per batch: wider for a quiet box's small batches."""
        self._idle_since = clock()
        """When the model last finished a batch."""

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
        too_long = self._too_long(event)
        if too_long is not None:  # the edge's 400 too: a request too long for the model, not a failure
            emit.finish(arrival, self._origin.failed(arrival, "context_length_exceeded", too_long))
            return
        invalid = self._invalid(event)
        if invalid is not None:
            emit.finish(arrival, self._origin.failed(arrival, "invalid_input", invalid))
            return
        now, wall = self._clock(), utc_now()
        deadline = monotonic_deadline(event.deadline, wall, now)
        request = _Request(arrival, event)
        if deadline is not None and deadline <= now:
            emit.finish(arrival, self._terminal(request, "expired", "deadline"))
            return
        items = [
            EmbedItem(
                request_id=event.request_id,
                n_tokens=len(ids),
                arrival=now,
                payload=_Input(event.request_id, index, ids, event.normalize),
                deadline=deadline,
            )
            for index, ids in enumerate(event.inputs)
        ]
        if not self._batcher.add_all(items, now):  # a request is queued whole or not at all
            emit.finish(
                arrival,
                self._origin.failed(
                    arrival,
                    "queue_full",
                    f"the embedding queue is full ({len(self._batcher)} inputs waiting, "
                    f"SLUICE_WORKER_EMBED_MAX_QUEUED={self._batcher.config.max_queued}); retry later",
                ),
            )
            return
        self._requests[event.request_id] = request

    def _too_long(self, event: EmbeddingRequested) -> str | None:
        """Why ``event``'s inputs are longer than the model embeds, or None. The engine's limit too: a
        manifest prepared before 2026-12-03 says 514 for a RoBERTa encoder that embeds 512, and such an
        input would fail its whole batch; it ends ``context_length_exceeded``, which the edge answers with
        a 400 as its own refusal (it was a 500, a review)."""
        longest = min(self._manifest.max_context, self._engine.max_length)
        too_long = [i for i, ids in enumerate(event.inputs) if len(ids) > longest]
        if too_long:
            return f"This model's maximum context length is {longest} tokens; inputs {too_long} are longer."
        return None

    def _invalid(self, event: EmbeddingRequested) -> str | None:
        """Why the engine could not embed ``event``'s inputs (the edge checks them, another producer may
        not), or None: a batch with such an input would fail whole."""
        if not event.inputs:
            return "no inputs"
        if len(event.inputs) > self._batcher.config.max_queued:
            return (
                f"{len(event.inputs)} inputs, more than this worker queues "
                f"({self._batcher.config.max_queued}, SLUICE_WORKER_EMBED_MAX_QUEUED)"
            )
        empty = [i for i, ids in enumerate(event.inputs) if not ids]
        if empty:
            return f"inputs {empty} are empty"
        vocab = self._engine.vocab_size
        outside = [i for i, ids in enumerate(event.inputs) if min(ids) < 0 or max(ids) >= vocab]
        if outside:
            return f"inputs {outside} hold token ids outside the vocabulary of {vocab}"
        return None

    def release(self, request_ids: Collection[str], *, running: bool = False) -> set[str]:
        # Whatever is still here has produced nothing yet (a batch in flight included: its vectors are
        # skipped when it lands), running or not. Its queued inputs leave the batcher: they would hold
        # places in it.
        released = {r for r in request_ids if self._requests.pop(r, None) is not None}
        for request_id in released:
            self._batcher.cancel(request_id)
        return released

    def cancel(self, request_id: str, emit: Emitter) -> None:
        request = self._requests.pop(request_id, None)
        if request is not None:
            self._batcher.cancel(request_id)  # its inputs would hold places in the queue until batched
            emit.finish(request.arrival, self._terminal(request, "cancelled", "cancelled"))

    def tick(self, emit: Emitter) -> None:
        now = self._clock()
        for item in self._batcher.take_expired(now):
            request = self._requests.pop(item.request_id, None)
            if request is not None:
                emit.finish(request.arrival, self._terminal(request, "expired", "deadline"))
        previous, self._in_flight = self._in_flight, None
        batch = [item for item in self._batcher.next_batch(now) or () if item.request_id in self._requests]
        self._last_batch = len(batch)
        if batch:
            started = utc_now()
            for item in batch:
                request = self._requests[item.request_id]
                if request.started is None:
                    emit.joined(request.arrival, len(batch), 0.0)
                    request.started = started
            if self.team is not None:
                self.team.size_for(len(batch), len(self._batcher), now - self._idle_since)
            flight = self._launch(batch)
            if self.overlap:
                self._in_flight = flight  # finished at the next tick, after the batch behind it is launched
            else:
                self._finish(flight(), emit)
        if previous is not None:
            self._finish(previous(), emit)
        if batch or previous is not None:
            self._idle_since = self._clock()

    def _finish(self, embedded: list[tuple[EmbedItem[_Input], _Outcome]], emit: Emitter) -> None:
        stop: Exception | None = None
        for item, vector in embedded:
            if isinstance(vector, _Failed) and vector.stop:
                stop = vector.error
            request = self._requests.get(item.request_id)
            if request is None:
                continue  # cancelled, expired or released while its batch ran
            if vector is None:  # alone it did not fit: the request ends, its other items leave the queue
                del self._requests[item.request_id]
                self._batcher.cancel(item.request_id)
                emit.finish(request.arrival, self._out_of_memory(request, item))
                continue
            if isinstance(vector, _Failed):  # its batch failed: the request ends, its other items leave
                del self._requests[item.request_id]
                self._batcher.cancel(item.request_id)
                emit.finish(request.arrival, self._batch_failed(request, vector.error))
                continue
            if not np.isfinite(vector).all():  # a client must never get nulls for numbers, nor the log
                del self._requests[item.request_id]  # an event no consumer can read
                self._batcher.cancel(item.request_id)
                log.error("%s: NaN or inf in the vector of %s", self._manifest.model_id, item.request_id)
                emit.finish(request.arrival, self._non_finite(request, item.payload.index))
                continue
            request.vectors[item.payload.index] = vector.astype("<f4", copy=False).tobytes()
            if len(request.vectors) == len(request.event.inputs):
                del self._requests[item.request_id]
                emit.finish(request.arrival, self._terminal(request, "completed", "stop"))
        if stop is not None:
            raise stop  # every request of the batch has ended; the worker stops (FailedSteps)

    def _launch(self, batch: list[EmbedItem[_Input]]) -> _Flight:
        """Start ``batch``; the flight returns each item with its vector. A batch that does not fit in memory
        runs at once as two halves (recursively); an item that does not fit alone gets None. The batcher's
        token budget follows (:class:`~gpu_workers.oom.MemoryBackoff`)."""
        try:
            normalize = [item.payload.normalize for item in batch]
            pending = self._engine.launch(
                [item.payload.input_ids for item in batch], None if all(normalize) else normalize
            )
        except Exception as exc:
            if not is_out_of_memory(exc):
                return self._failed(batch, exc)
            pending = None
        if pending is None:  # out of memory; the halves run outside the handler, with no error in hand
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
                embedded: list[tuple[EmbedItem[_Input], _Outcome]] = [(batch[0], None)]
            else:
                half = len(batch) // 2
                embedded = self._launch(batch[:half])() + self._launch(batch[half:])()
            return lambda: embedded
        if self._backoff.succeeded():
            self._batcher.token_budget = self._backoff.limit

        def landed() -> list[tuple[EmbedItem[_Input], _Outcome]]:
            try:
                vectors = pending.result()
            except Exception as exc:
                return self._failed(batch, exc)()
            self._failed_batches.succeeded()
            return list(zip(batch, vectors, strict=True))

        return landed

    def _failed(self, batch: list[EmbedItem[_Input]], exc: Exception) -> _Flight:
        """``batch`` failed with something other than out of memory (a bug, or an input no check caught):
        each of its requests ends ``failed`` with ``engine_error`` (not retriable) when the flight is
        finished, and the worker keeps serving, unless batches keep failing (:class:`FailedSteps`)."""
        stop = self._failed_batches.failed()
        log.error(
            "%s: a batch of %d items failed; its requests end %s",
            self._manifest.model_id,
            len(batch),
            ENGINE_ERROR_CODE,
            exc_info=exc,
        )
        failed = _Failed(exc, stop)
        return lambda: [(item, failed) for item in batch]

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

    def _batch_failed(self, request: _Request, exc: Exception) -> RequestFinished:
        return self._engine_error(request, f"the model failed on this request's batch ({type(exc).__name__})")

    def _non_finite(self, request: _Request, index: int) -> RequestFinished:
        return self._engine_error(request, f"the model's vector for input {index} holds NaN or inf")

    def _engine_error(self, request: _Request, message: str) -> RequestFinished:
        return self._origin.finished(
            request.arrival,
            "failed",
            "error",
            error=ErrorInfo(code=ENGINE_ERROR_CODE, message=message),
            timings=Timings(
                accepted=request.event.time, started=request.started, first_token=None, finished=utc_now()
            ),
        )

    def wait_hint(self) -> float | None:
        if self._in_flight is not None:
            return 0.0
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
            quiet_batches=self.team.wide_batches if self.team is not None else 0,
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
