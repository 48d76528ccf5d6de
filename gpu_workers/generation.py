"""The generation runner: scheduler + engine + flush policy, driven by the worker's model thread.

Each tick: expire and admit waiting requests (``GenerationScheduler``: fair between tenants, so requests
that a full queue pushed out end ``failed`` with ``queue_full``), stop running ones past their deadline,
run ONE decode step for the whole running batch (``GenerationEngine.step``), charge each token to its
tenant (``GenerationScheduler.produced``), coalesce tokens into chunks (``ChunkCoalescer``), decode each chunk's text in one call (token by token only
where stop strings need the text as it grows) and finish sequences that stopped. A cancel
removes a sequence between two steps, so it never produces another token.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace
from datetime import datetime

from gpu_workers import GpuWorkerError
from gpu_workers.detok import Detokenizer
from gpu_workers.engine import GenerationEngine, SeqRequest
from gpu_workers.flush import ChunkCoalescer, Flush, FlushPolicy
from gpu_workers.observe import RunnerLoad
from gpu_workers.oom import OOM_CODE, MemoryBackoff, is_out_of_memory, release_memory
from gpu_workers.runtime import ENGINE_ERROR_CODE, Arrival, Emitter, FailedSteps, Origin
from gpu_workers.scheduler import GenerationScheduler, Pending, SchedulerConfig
from schemas.events import (
    DriftFeatures,
    ErrorInfo,
    FinishReason,
    GenerationRequested,
    RequestFinished,
    Status,
    Timings,
    TokenChunk,
    Usage,
    utc_now,
)
from schemas.ids import derive_seed
from schemas.manifest import ModelManifest

log = logging.getLogger(__name__)


@dataclass
class _Live:
    arrival: Arrival
    event: GenerationRequested
    detok: Detokenizer
    max_new_tokens: int
    end_ids: frozenset[int] = frozenset()
    """The tokens that end this sequence and are left out of its text and usage: the model's end tokens,
    and for a chat request its chat format's end of turn; none with ``ignore_eos``."""
    started: datetime | None = None
    first_token: datetime | None = None
    stop_hit: bool = False
    stop_cut: int | None = None  # text length to keep when a stop string matched
    sent: int = 0
    """Characters of the text released to the stream so far (a request with stop strings holds back what
    may begin one)."""
    chars: int = 0
    """Characters of the text in the chunks emitted so far (a chunk's ``chars``)."""
    next_seq: int = 0
    next_offset: int = 0
    last_token_at: float | None = None
    max_gap: float = 0.0
    logprob_sum: float = 0.0
    entropy_sum: float = 0.0
    scored: int = 0


def _held(text: str, live: _Live) -> int:
    """Characters at the end of ``text`` (past what was streamed) that begin one of the request's stop
    strings: the longest such end, held back until a later token shows whether the stop string follows.
    Only the beginnings that end with the text's last character are tried (a token's work stays a few
    string compares, not one per length of a 256-character stop string)."""
    unsent = len(text) - live.sent
    if not unsent:
        return 0
    last, best = text[-1], 0
    for stop in live.event.sampling.stop:
        size = min(len(stop) - 1, unsent)
        while size > best:
            size = stop.rfind(last, 0, size) + 1  # the longest beginning up to ``size`` ending with ``last``
            if size <= best:
                break
            if text.endswith(stop[:size]):
                best = size
                break
            size -= 1
    return best


def monotonic_deadline(deadline: datetime | None, now_wall: datetime, now: float) -> float | None:
    return None if deadline is None else now + (deadline - now_wall).total_seconds()


class GenerationRunner:
    def __init__(
        self,
        engine: GenerationEngine,
        detokenizer: Callable[[], Detokenizer],
        manifest: ModelManifest,
        *,
        source: str,
        worker_id: str,
        scheduler: SchedulerConfig,
        flush: FlushPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._engine = engine
        self._detokenizer = detokenizer
        self._manifest = manifest
        # built once: a request takes one of them, and each token is one set lookup
        self._end_ids = manifest.end_token_ids
        self._chat_end_ids = manifest.chat_end_token_ids
        self._origin = Origin(source, worker_id)
        self._scheduler: GenerationScheduler[_Live] = GenerationScheduler(scheduler)
        self._budget = scheduler.max_batch_tokens
        # What one sequence may hold, prompt and completion together: ``accept`` lowers each request's
        # max_new_tokens to what its prompt leaves of it, and a prompt that leaves nothing ends
        # context_length_exceeded (a 400 at the edge). The engine's context, not only the manifest's: a
        # sliding-window model's manifest prepared before 2026-12-03 names all its positions, where the
        # engine serves only its window (its refusal was a 500). And the batch budget: the edge gives a
        # request without max_tokens the room its prompt leaves in the context, so on a model whose context
        # is longer than the budget (32,768 positions, 16,384 by default) the scheduler refused every such
        # request ``too_large``, a 500 (a review, 2026-12-03); now it ends with finish_reason "length".
        context = min(manifest.max_context, engine.max_context)
        self._span = min(context, scheduler.max_batch_tokens)
        if self._span < context:
            log.warning(
                "%s: the batch budget (SLUICE_WORKER_MAX_BATCH_TOKENS=%d) is smaller than the model's context "
                '(%d): an answer ends with finish_reason "length" where prompt and completion reach the '
                "budget, and a longer prompt is refused context_length_exceeded",
                manifest.model_id,
                self._span,
                context,
            )
        self._last_batch = 0
        self._coalescer = ChunkCoalescer(flush)
        self._clock = clock
        self._live: dict[str, _Live] = {}
        self._backoff = MemoryBackoff(ceiling=engine.max_batch_size)
        self._failed_steps = FailedSteps()

    # ---------------------------------------------------------------- Runner protocol

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        event = arrival.event
        if not isinstance(event, GenerationRequested):
            emit.finish(
                arrival,
                self._origin.failed(
                    arrival,
                    "wrong_model_kind",
                    f"{event.model} serves generation, not {type(event).__name__}",
                ),
            )
            return
        now, wall = self._clock(), utc_now()
        room = self._span - len(event.input_ids)
        live = _Live(
            arrival=arrival,
            event=event,
            detok=self._detokenizer(),
            max_new_tokens=max(0, min(event.sampling.max_tokens, room, self._manifest.max_output_tokens)),
            end_ids=self._end_ids_of(event),
        )
        if not event.input_ids:  # the edge refuses one; another producer may not (it read "no room")
            emit.finish(arrival, self._origin.failed(arrival, "invalid_request", "the prompt is empty"))
            return
        if live.max_new_tokens == 0:
            emit.finish(
                arrival,
                self._origin.failed(
                    arrival,
                    "context_length_exceeded",
                    f"the prompt ({len(event.input_ids)} tokens) leaves no room for a completion: this worker "
                    f"runs at most {self._span} tokens of prompt and completion together",
                ),
            )
            return
        deadline = monotonic_deadline(event.deadline, wall, now)
        if deadline is not None and deadline <= now:
            emit.finish(arrival, self._terminal(live, "expired", "deadline"))
            return
        item = Pending(
            request_id=event.request_id,
            prompt_len=len(event.input_ids),
            max_new_tokens=live.max_new_tokens,
            arrival=now,
            payload=live,
            deadline=deadline,
            priority=event.priority,
            tenant=event.tenant,
            shadow=event.shadow_of is not None,
        )
        rejection = self._scheduler.check(item)
        if rejection is not None:
            if rejection.code != "duplicate":
                emit.finish(arrival, self._origin.failed(arrival, rejection.code, rejection.message))
            return
        self._scheduler.submit(item)
        self._live[event.request_id] = live

    def release(self, request_ids: Collection[str], *, running: bool = False) -> set[str]:
        released: set[str] = set()
        for request_id in request_ids:
            if request_id not in self._live:
                continue
            if self._scheduler.withdraw(request_id):
                released.add(request_id)
            elif running and self._scheduler.finish(request_id):
                self._engine.cancel(request_id)
                released.add(request_id)
        for request_id in released:
            del self._live[request_id]
            self._coalescer.drop(request_id)  # tokens not yet streamed: the next run makes them again
        return released

    def cancel(self, request_id: str, emit: Emitter) -> None:
        live = self._live.get(request_id)
        where = self._scheduler.cancel(request_id)
        if live is None or where == "unknown":
            return
        if where == "running":
            self._engine.cancel(request_id)
        self._end(live, "cancelled", "cancelled", emit)

    def tick(self, emit: Emitter) -> None:
        now = self._clock()
        decision = self._scheduler.schedule(now)
        for item in decision.expire:
            self._end(item.payload, "expired", "deadline", emit)
        for item in decision.shed:
            self._live.pop(item.request_id, None)
            emit.finish(
                item.payload.arrival,
                self._origin.failed(
                    item.payload.arrival,
                    "queue_full",
                    f"the waiting queue is full ({self._scheduler.config.max_waiting} requests) and tenant "
                    f"{item.tenant!r} held the most of it: its newest request made room for another tenant's",
                ),
            )
        started = utc_now()
        for item in decision.admit:
            self._start(item.payload, started, emit)
        for request_id in self._scheduler.expired_running(now):
            self._scheduler.cancel(request_id)
            self._engine.cancel(request_id)
            self._end(self._live[request_id], "expired", "deadline", emit)
        self._last_batch = 0
        if self._engine.has_work():
            try:
                outputs = self._engine.step()
            except Exception as exc:
                if is_out_of_memory(exc):
                    self._out_of_memory(emit)
                else:
                    self._step_failed(exc, emit)
                    if self._failed_steps.failed():
                        raise
                return
            self._failed_steps.succeeded()
            if self._backoff.succeeded():
                self._engine.max_batch_size = self._backoff.limit
            self._last_batch = len(outputs)
            stamp = utc_now()
            now = self._clock()
            for out in outputs:
                live = self._live.get(out.request_id)
                if live is None:
                    continue
                if out.finish_reason == "error":  # NaN or inf scores: the engine dropped it, no token came
                    self._non_finite(live, emit)
                    continue
                self._scheduler.produced(out.request_id)
                live.first_token = live.first_token or stamp
                live.logprob_sum += out.logprob
                live.entropy_sum += out.entropy
                live.scored += 1
                self._token(live, out.token_id, now, emit)
                reason: FinishReason | None = "stop" if live.stop_hit else out.finish_reason
                if reason is not None:
                    if live.stop_hit:
                        self._engine.cancel(out.request_id)
                    self._scheduler.finish(out.request_id)
                    self._end(live, "completed", reason, emit)
        for flush in self._coalescer.due(self._clock()):
            self._emit_chunk(self._live[flush.request_id], flush, None, emit)

    def wait_hint(self) -> float | None:
        if self._engine.has_work() or self._scheduler.waiting:
            return 0.0
        deadline = self._coalescer.next_deadline()
        return None if deadline is None else max(0.0, deadline - self._clock())

    def load(self) -> RunnerLoad:
        scheduler = self._scheduler
        return RunnerLoad(
            running=scheduler.running,
            waiting=scheduler.waiting,
            budget_ratio=scheduler.budget_in_use / self._budget,
            batch=self._last_batch,
            out_of_memory=self._backoff.failures,
            limit_ratio=self._backoff.ratio,
        )

    def _out_of_memory(self, emit: Emitter) -> None:
        """The step did not fit in memory: every sequence in the engine ends ``worker_oom`` (retriable; a
        retry is a new request), the engine starts empty with half the rows, and requests still waiting
        in the scheduler run as before."""
        rows = self._engine.running
        dropped = self._engine.reset()
        release_memory(self._engine.device)
        self._engine.max_batch_size = self._backoff.failed(max(rows, len(dropped)))
        log.warning(
            "%s: out of memory in a step of %d rows; %d requests end %s, the batch now holds at most %d",
            self._manifest.model_id,
            rows,
            len(dropped),
            OOM_CODE,
            self._engine.max_batch_size,
        )
        error = ErrorInfo(
            code=OOM_CODE,
            message=f"the batch did not fit in the memory of {self._engine.device}; retry the request",
            retriable=True,
        )
        self._fail_all(dropped, error, emit)

    def _step_failed(self, exc: Exception, emit: Emitter) -> None:
        """The step raised something other than out of memory (a bug, or a request no check caught): the
        sequences it ran end ``failed`` with ``engine_error`` (not retriable: the same request would fail
        the same way), the engine drops them with the batch and its cache, and the worker keeps serving
        (unless steps keep failing: :class:`~gpu_workers.runtime.FailedSteps`). Requests the step did not
        prefill stay queued; the batch limit stays where it was."""
        dropped = self._engine.reset(keep_waiting=True)
        log.error(
            "%s: a step failed; its %d requests end %s",
            self._manifest.model_id,
            len(dropped),
            ENGINE_ERROR_CODE,
            exc_info=exc,
        )
        error = ErrorInfo(
            code=ENGINE_ERROR_CODE,
            message=f"the model failed on a step of this request's batch ({type(exc).__name__})",
        )
        self._fail_all(dropped, error, emit)

    def _non_finite(self, live: _Live, emit: Emitter) -> None:
        """The model's next-token scores for this request held NaN or inf: it ends ``failed`` with
        ``engine_error`` (not retriable: the same request would blow up the same way), alone; the rest of
        its batch goes on. A version whose every request does this (bad weights) fails its rollout's
        error-rate gate instead of answering with made-up tokens."""
        request_id = live.event.request_id
        log.error("%s: NaN or inf in the next-token scores of %s", self._manifest.model_id, request_id)
        error = ErrorInfo(
            code=ENGINE_ERROR_CODE, message="the model's next-token scores for this request hold NaN or inf"
        )
        self._fail_all([request_id], error, emit)

    # ---------------------------------------------------------------- helpers

    def _end_ids_of(self, event: GenerationRequested) -> frozenset[int]:
        """The tokens ``event``'s sequence stops at. A chat answer is the assistant's turn, so it also stops
        where the model begins another turn. A completion continues raw text, which may hold a whole
        dialogue (demo-gpt was trained on such documents), so it stops at the end tokens only, as
        ``generate``, vLLM and OpenAI's completions do."""
        if event.sampling.ignore_eos:
            return frozenset()
        return self._chat_end_ids if event.chat else self._end_ids

    def _fail_all(self, request_ids: Iterable[str], error: ErrorInfo, emit: Emitter) -> None:
        """End each of these requests still live ``failed`` with ``error``."""
        for request_id in request_ids:
            live = self._live.get(request_id)
            if live is None:
                continue
            self._scheduler.finish(request_id)
            self._end(live, "failed", "error", emit, error)

    def _start(self, live: _Live, started: datetime, emit: Emitter) -> None:
        live.started = started
        event = live.event
        try:
            self._engine.add(
                SeqRequest(
                    request_id=event.request_id,
                    input_ids=list(event.input_ids),
                    max_new_tokens=live.max_new_tokens,
                    temperature=event.sampling.temperature,
                    top_p=event.sampling.top_p,
                    top_k=event.sampling.top_k,
                    seed=event.sampling.seed
                    if event.sampling.seed is not None
                    else derive_seed(event.request_id),
                    stop_token_ids=live.end_ids,
                )
            )
        except GpuWorkerError as exc:  # e.g. token ids outside the vocabulary
            self._scheduler.finish(event.request_id)
            self._live.pop(event.request_id, None)
            emit.finish(live.arrival, self._origin.failed(live.arrival, "invalid_request", str(exc)))
            return
        emit.joined(live.arrival, self._scheduler.running, self._scheduler.budget_in_use / self._budget)

    def _token(self, live: _Live, token_id: int, now: float, emit: Emitter) -> None:
        if live.last_token_at is not None:
            live.max_gap = max(live.max_gap, now - live.last_token_at)
        live.last_token_at = now
        if token_id in live.end_ids:
            return  # ends the sequence; not part of the completion
        if not live.event.sampling.stop:
            # No stop string needs the text token by token: a streamed request's text is decoded a chunk
            # at a time (_emit_chunk), any other's once at the end.
            live.detok.ids.append(token_id)
            if live.event.stream:
                flush = self._coalescer.push(live.event.request_id, token_id, "", now)
                if flush is not None:
                    self._emit_chunk(live, flush, None, emit)
            return
        delta = live.detok.push(token_id)
        text = live.detok.text
        # the earliest match of any stop string, not the first listed that matches: a token completing two
        # cut at the later one, and the answer held the other (an audit: stop=("s", "w") gave " wait")
        cuts = [
            cut
            for stop in live.event.sampling.stop
            if (cut := text.find(stop, max(0, len(text) - len(delta) - len(stop)))) >= 0
        ]
        if cuts:
            live.stop_hit, live.stop_cut = True, min(cuts)
        if live.event.stream:
            # Streamed text never shows a stop string's beginning: what may still grow into one is held
            # back until a later token rules it out (a stop string spanning tokens leaked its first tokens
            # into the stream, where the whole answer left it out: an audit; vLLM holds back the same way).
            end = live.stop_cut if live.stop_cut is not None else len(text) - _held(text, live)
            released = text[live.sent : max(live.sent, end)]
            live.sent += len(released)
            flush = self._coalescer.push(live.event.request_id, token_id, released, now)
            if flush is not None:
                self._emit_chunk(live, flush, None, emit)

    def _emit_chunk(self, live: _Live, flush: Flush, reason: FinishReason | None, emit: Emitter) -> None:
        event = live.event
        live.next_seq, live.next_offset = flush.seq + 1, flush.offset + len(flush.token_ids)
        text = flush.text if event.sampling.stop else flush.text + live.detok.catch_up()
        chars, live.chars = live.chars, live.chars + len(text)
        emit.chunk(
            live.arrival,
            TokenChunk(
                tenant=event.tenant,
                model=event.model,
                request_id=event.request_id,
                source=self._origin.source,
                traceparent=live.arrival.traceparent,
                seq=flush.seq,
                offset=flush.offset,
                token_ids=list(flush.token_ids),
                text=text,
                finish_reason=reason,
                chars=chars,
            ),
        )

    def _end(
        self, live: _Live, status: Status, reason: FinishReason, emit: Emitter, error: ErrorInfo | None = None
    ) -> None:
        request_id = live.event.request_id
        self._live.pop(request_id, None)
        # what was held back: text that might have begun a stop string, and an incomplete character's
        held = live.detok.text[live.sent :] if live.event.sampling.stop else ""  # others stream by chunk
        tail = "" if live.stop_hit else held + live.detok.flush()
        if live.event.stream:
            last = self._coalescer.finish(request_id, self._clock())
            if last is None and tail:
                last = Flush(
                    request_id=request_id, seq=live.next_seq, offset=live.next_offset, token_ids=(), text=""
                )
            if last is not None:
                self._emit_chunk(live, replace(last, text=last.text + tail), reason, emit)
        else:
            self._coalescer.drop(request_id)
        emit.finish(live.arrival, self._terminal(live, status, reason, error))

    def _terminal(
        self, live: _Live, status: Status, reason: FinishReason, error: ErrorInfo | None = None
    ) -> RequestFinished:
        event = live.event
        text = live.detok.text if live.stop_cut is None else live.detok.text[: live.stop_cut]
        completion = len(live.detok.ids)
        prompt = len(event.input_ids)
        return self._origin.finished(
            live.arrival,
            status,
            reason,
            Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
            text=text if status == "completed" or text else None,
            error=error,
            timings=Timings(
                accepted=event.time, started=live.started, first_token=live.first_token, finished=utc_now()
            ),
            max_inter_token_s=live.max_gap if completion >= 2 else None,
            features=DriftFeatures(
                # at most 0 by construction; the contract refuses a positive one, and the event with it
                mean_logprob=min(0.0, live.logprob_sum / live.scored),
                mean_entropy=live.entropy_sum / live.scored,
            )
            if live.scored
            else None,
        )
