"""The contract between the worker's I/O shell (:mod:`gpu_workers.service`) and a model's runner: a request
as consumed (:class:`Arrival`), what a runner emits through (:class:`Emitter`), the runner itself
(:class:`Runner`, driven only from the model thread) and the one builder of its terminal events
(:class:`Origin`). A runner imports this, never the shell."""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from bus.consumer import TP
from gpu_workers.observe import RequestTrace, RunnerLoad
from schemas.events import (
    BatchRef,
    DriftFeatures,
    EmbeddingRequested,
    ErrorInfo,
    FinishReason,
    Float32Vectors,
    GenerationRequested,
    RequestFinished,
    Timings,
    TokenChunk,
    Usage,
)
from schemas.events import Status as RequestStatus

Request = GenerationRequested | EmbeddingRequested


@dataclass(frozen=True)
class Arrival:
    """A request as consumed: the event and where it came from (for the commit)."""

    event: Request
    tp: TP
    offset: int
    received: float = field(default_factory=time.monotonic)
    trace: RequestTrace | None = None
    generation: int = 0
    """The worker's assignment generation when the record was consumed (see ``WorkerService._stale``)."""
    batch: BatchRef | None = None
    """The batch line this request is (consumed as a :class:`BatchItemRequested`): its terminal event names it."""

    @property
    def traceparent(self) -> str | None:
        """The trace context the events a runner builds for this request carry."""
        return self.trace.traceparent if self.trace is not None else self.event.traceparent


class Emitter(Protocol):
    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None: ...
    def finish(self, arrival: Arrival, result: RequestFinished) -> None: ...
    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        """The request joined a batch of ``batch`` sequences (for its ``batch_formation`` span)."""


class Runner(Protocol):
    """The model-specific part, driven only from the model thread."""

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        """Take a new request (queue it, or finish it at once, e.g. rejected or expired)."""

    def cancel(self, request_id: str, emit: Emitter) -> None:
        """Drop the request wherever it is and emit its ``cancelled`` terminal event."""

    def tick(self, emit: Emitter) -> None:
        """Do one unit of work (one decode step, one embedding batch), emitting what it produced."""

    def release(self, request_ids: Collection[str], *, running: bool = False) -> set[str]:
        """Drop those of ``request_ids`` that have not started (no output yet) without a terminal event:
        their partition moved to another worker, which runs them. ``running``: those already running too
        (a retiring version cuts what it could not finish in time); what they streamed stays on the log,
        whoever runs them again repeats it, and the edge keeps each token once. Returns the ids dropped."""

    def wait_hint(self) -> float | None:
        """Seconds the loop may block waiting for input: 0 while there is work, None for "until input"."""

    def load(self) -> RunnerLoad:
        """How busy the runner is after the last tick (for the worker's gauges)."""


NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)


ENGINE_ERROR_CODE = "engine_error"
RETRIABLE_REFUSALS = frozenset({"queue_full"})
"""Refusals a later try may not meet: a full queue (it answered 500, its message saying to retry later)."""
"""A forward pass or sampling step failed with something other than out of memory: the requests in it end
``failed`` with this code (not retriable: the same request would fail the same way), never the worker."""


class FailedSteps:
    """Steps (or batches) in a row that failed with something other than out of memory. One is a request
    no check caught, and ends only that step's requests; ``limit`` in a row, with no good step between, is
    a device or model that no longer works (a CUDA error sticks to its context), and stops the worker so
    that its supervisor starts a fresh one instead of failing every request it is given."""

    def __init__(self, limit: int = 3) -> None:
        self.limit = limit
        self.in_a_row = 0

    def succeeded(self) -> None:
        self.in_a_row = 0

    def failed(self) -> bool:
        """Count a failure; True when the runner should stop (``limit`` in a row)."""
        self.in_a_row += 1
        return self.in_a_row >= self.limit


@dataclass(frozen=True)
class Origin:
    """Who produces a runner's events: stamped on every terminal event it builds."""

    source: str
    worker_id: str

    def finished(
        self,
        arrival: Arrival,
        status: RequestStatus,
        reason: FinishReason,
        usage: Usage = NO_USAGE,
        *,
        text: str | None = None,
        embeddings: Float32Vectors | None = None,
        error: ErrorInfo | None = None,
        timings: Timings | None = None,
        max_inter_token_s: float | None = None,
        features: DriftFeatures | None = None,
    ) -> RequestFinished:
        """The one builder of a runner's terminal events: the request's identity and trace context and this
        origin are filled in here; what the request itself said is copied in at publish (``with_request``)."""
        event = arrival.event
        return RequestFinished(
            tenant=event.tenant,
            model=event.model,
            request_id=event.request_id,
            source=self.source,
            traceparent=arrival.traceparent,
            status=status,
            finish_reason=reason,
            usage=usage,
            text=text,
            embeddings_f32=embeddings,
            error=error,
            timings=timings if timings is not None else Timings(),
            worker_id=self.worker_id,
            max_inter_token_s=max_inter_token_s,
            features=features,
        )

    def failed(self, arrival: Arrival, code: str, message: str) -> RequestFinished:
        """A ``failed`` terminal event for a request that could not run (retriable where the refusal is
        :data:`RETRIABLE_REFUSALS`: the edge answers 503, a keyed retry is told to use a new key)."""
        error = ErrorInfo(code=code, message=message, retriable=code in RETRIABLE_REFUSALS)
        return self.finished(arrival, "failed", "error", error=error)
