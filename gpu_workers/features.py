"""Drift features of a finished request, built as its terminal event is published.

Every terminal event gets :class:`~schemas.events.DriftFeatures`: a profile of the prompt and the output
(lengths, writing system, a language guess, empty/refusal flags; :mod:`schemas.features`), the engine's
mean log-probability and entropy when the runner measured them, and for 1 in ``SLUICE_DRIFT_SAMPLE``
requests a MiniLM embedding of the prompt. An embedding request's own first vector is that embedding when
the served model is MiniLM; a generation worker embeds the prompt with a small MiniLM it loads next to its
model, on a thread of its own (:class:`DriftEmbedder`).

That thread runs at idle priority (``SCHED_IDLE``) on any core the worker may use, and takes prompts only
while the model thread idles: a MiniLM forward of one short text costs ~8-10 ms of a core here, and on the
model thread it stalled the whole running batch and the next request to arrive. Measured on 2 cores
(2026-11-29, docs/perf): of 400 streamed 2-token completions from one client, 1 in 20 sampled, 8-9 had
their first token more than 5 ms after the worker read them with the embedding on the model thread, 1
with it on this thread and 0-1 with no embedding at all (their p99 end to end 12.5-12.8 ms, 8.3-10.1
and 8.5-11.2). Under load the model never idles and embeds what waited :data:`DRIFT_EMBED_HELP_AFTER_S`
itself, between steps, within the same budget as before: an idle-priority thread gets almost no core
there, and one preempted on the busy cores of the edge and Kafka while holding the GIL kept the model
thread waiting (generation at 64 clients lost ~10 % when the thread took prompts under load). The
request's ``results`` copy waits for its embedding (at most :data:`DRIFT_EMBED_MAX_WAIT_S`); its reply
copy never does.

None of this holds text: the streams worker turns the features into a ``drift_features`` row.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bus.placement import idle_thread, name_thread
from schemas.events import (
    EMBEDDING_MAX_DIM,
    DriftFeatures,
    EmbeddingRequested,
    GenerationRequested,
    RequestFinished,
)
from schemas.features import is_refusal, profile, sampled
from schemas.lifecycle import Component
from schemas.manifest import MAX_CHARS_PER_TOKEN

log = logging.getLogger(__name__)

EmbedTexts = Callable[[Sequence[str]], Sequence[Sequence[float]]]
"""Prompts' texts to unit vectors (MiniLM), in one batch."""
Vector = Sequence[float]

MAX_QUEUED = 256
"""Sampled prompts waiting for the embedder, at most: past it a sampled request goes without (counted)."""

MAX_BATCH = 32
"""Prompts embedded in one call at most."""

DRIFT_EMBED_BURST_S = 0.05
"""Embedding time the budget lets through at once after a quiet spell (a few calls)."""

DRIFT_EMBED_HELP_AFTER_S = 0.25
"""How long a sampled prompt waits for the embedder's thread before the model thread embeds it itself
(:meth:`DriftEmbedder.help`): at saturation the idle-priority thread gets no core (generation at 64
clients: none of 112 sampled prompts embedded in 15 s without the help)."""

DRIFT_EMBED_MAX_WAIT_S = 1.0
"""How long a sampled prompt may wait for the embedder before its request's ``results`` copy goes without
its embedding (counted as skipped). A request's offset is committed once both copies are durable, so this
also bounds how long a sampled request stays uncommitted, and a rebalance waits for it."""

DRIFT_THREAD_NAME = "drift:embed"
"""The name the drift embedder's thread gets (what ``/proc/<pid>/task/<tid>/comm`` and ``top -H`` show): it
runs on every core the worker may use, not only on the worker's own."""

EMBEDDING_DECIMALS = 6
"""Embeddings travel rounded: ~9 characters a component instead of ~20, and no drift test can tell."""


class FeatureProbe:
    """``features(event, result, vector)``: the drift features of one request (pure). ``embedder``: where a
    generation request's sampled prompt gets its vector (:meth:`embed_then`)."""

    def __init__(
        self,
        sample_one_in: int,
        embedder: DriftEmbedder | None = None,
        *,
        own_vectors: bool = False,
    ):
        self._one_in = sample_one_in
        self.embedder = embedder
        self._own_vectors = own_vectors
        """The served model is the drift embedder itself: a request's first vector is its embedding."""
        self._too_long_told = False
        """Whether the log has said once that the embeddings are too long to carry."""

    def embed_then(
        self, event: GenerationRequested | EmbeddingRequested, then: Callable[[Vector | None], None]
    ) -> None:
        """Call ``then`` once with the vector of the request's prompt: on the embedder's thread when it is
        sampled for one and this probe has an embedder, else here and now with None (the features have
        the vector without an embedder: :meth:`features`)."""
        prompt = event.prompt if isinstance(event, GenerationRequested) else None
        if self.embedder is not None and prompt and sampled(sample_key(event), self._one_in):
            self.embedder.submit(prompt, then)
        else:
            then(None)

    def help(self, idle: bool) -> None:
        """The model thread, between steps and while it idles: whether it is about to idle
        (:meth:`DriftEmbedder.model_idle`), and the prompts it embeds itself (:meth:`DriftEmbedder.help`)."""
        if self.embedder is not None:
            self.embedder.model_idle(idle)
            self.embedder.help()

    def close(self) -> None:
        """Stop the embedder, if any: every prompt it was given is answered first."""
        if self.embedder is not None:
            self.embedder.stop()

    def features(
        self,
        event: GenerationRequested | EmbeddingRequested,
        result: RequestFinished,
        vector: Vector | None = None,
    ) -> DriftFeatures:
        """The features; ``vector``: the prompt's embedding, for a sampled request (an embedding model's
        own first vector is taken from ``result``)."""
        measured = result.features or DriftFeatures()
        if isinstance(event, EmbeddingRequested):
            prompt = event.texts[0] if event.texts else None
        else:
            prompt = event.prompt
        fields: dict[str, object] = {}
        if prompt is not None:
            text = profile(prompt)
            fields.update(
                prompt_chars=text.chars,
                prompt_script=text.script,
                prompt_language=text.language,
                prompt_non_ascii=text.non_ascii,
            )
        if isinstance(event, GenerationRequested) and result.status == "completed":
            output = result.text or ""
            fields.update(
                output_chars=len(output),
                output_script=profile(output).script,
                empty_output=not output.strip(),
                refusal=is_refusal(output),
            )
        if sampled(sample_key(event), self._one_in):
            if self._own_vectors and isinstance(event, EmbeddingRequested):
                vectors = result.vectors()
                vector = vectors[0] if vectors else None
            if vector is not None and len(vector) <= EMBEDDING_MAX_DIM:
                fields["embedding"] = [round(float(x), EMBEDDING_DECIMALS) for x in vector]
            elif vector is not None and not self._too_long_told:
                # the contract's bound: an event carrying a longer one is refused whole (its usage too)
                self._too_long_told = True
                log.warning(
                    "drift: embeddings of %d components are left out of the drift features (at most %d)",
                    len(vector),
                    EMBEDDING_MAX_DIM,
                )
        return msgspec.structs.replace(measured, **fields)


def sample_key(event: GenerationRequested | EmbeddingRequested) -> str:
    """What decides whether a request is in the drift sample: its id, or for a shadow copy its original's,
    so a shadow pair is sampled (and carries its vectors) on both sides or on neither: the rollout's drift
    gate compares an embeddings candidate's vector with the stable version's for the same input
    (:mod:`streams.rollout_drift`)."""
    return event.shadow_of or event.request_id


class EmbedBudget:
    """The share of time the drift embeddings may take: credit earned at ``share`` per second, up to
    :data:`DRIFT_EMBED_BURST_S`, spent by what the calls take (``share`` 1: no limit)."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.share = share
        self._clock = clock
        self._credit = DRIFT_EMBED_BURST_S
        self._earned_at = clock()

    def affordable(self) -> bool:
        """Whether a call may run now."""
        if self.share >= 1.0:
            return True
        now = self._clock()
        self._credit = min(DRIFT_EMBED_BURST_S, self._credit + (now - self._earned_at) * self.share)
        self._earned_at = now
        return self._credit > 0.0

    def spend(self, seconds: float) -> None:
        self._credit -= seconds


@dataclass(slots=True)
class _Job:
    prompt: str
    then: Callable[[Vector | None], None]
    queued: float
    answered: bool = False
    """``then`` is called (or about to be): set under the embedder's lock, by whoever answers first."""


class DriftEmbedder(Component):
    """Sampled prompts embedded off the model thread, on a thread of its own.

    The thread asks the OS for idle priority (``SCHED_IDLE``, where the OS has it), runs on ``cores`` (every
    core the worker may use) and takes prompts only while the model thread says it is idle
    (:meth:`model_idle`): it runs when no other thread wants a core, and the model thread takes its core
    back the moment a request arrives. Prompts that queue up meanwhile are embedded together in the
    next call (a call costs mostly per call, not per text). Under load the model never idles and the thread
    takes nothing: the model thread embeds what has waited :data:`DRIFT_EMBED_HELP_AFTER_S` itself
    (:meth:`help`), within the budget, as it always did (a batch the thread took just before a burst of
    load finishes in the model's gaps, beside it: the embedder may be called from both threads at once).
    It does so while it idles too: an idle model whose cores other processes keep busy (the edge, Kafka,
    the streams worker on one box) leaves the thread no core either, and before, a prompt queued then
    waited for one without bound, and with it its request's ``results`` copy and offset commit (a loaded
    2-core box: 12 of 48 requests' copies missing after a minute). For the same reason a batch the thread
    took and is starved in is answered without vectors by the model thread once it waited ``max_wait_s``
    (the thread's late answer is dropped).

    A prompt goes without its vector (``then(None)``, counted by ``on_skip(n)``) when :data:`MAX_QUEUED` wait
    already, when it waited past ``max_wait_s``, when the budget (``budget``: the share of time the calls
    may take) is spent, or when the embedder has stopped; an embedder that fails gives None too (logged, not
    counted). ``on_embedded(n)``: n prompts embedded. ``then`` runs exactly once per prompt: on the thread
    that embedded it, or on the caller's where it was not queued; an error in it on the thread stops the
    thread and is the embedder's failure (:meth:`watch`: the worker fails, as it would on its model
    thread)."""

    def __init__(
        self,
        embed: EmbedTexts,
        *,
        budget: float = 1.0,
        on_skip: Callable[[int], None] | None = None,
        on_embedded: Callable[[int], None] | None = None,
        max_wait_s: float = DRIFT_EMBED_MAX_WAIT_S,
        help_after_s: float = DRIFT_EMBED_HELP_AFTER_S,
        cores: Collection[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        name: str = "drift-embedder",
    ) -> None:
        super().__init__()
        self._embed = embed
        self._budget = EmbedBudget(budget, clock)
        self._on_skip = on_skip
        self._on_embedded = on_embedded
        self._max_wait_s = max_wait_s
        self._help_after_s = help_after_s
        self._cores = frozenset(cores) if cores else None
        self._clock = clock
        self._name = name
        self._jobs: collections.deque[_Job] = collections.deque()
        self._taken: list[_Job] = []
        """The batch the thread is embedding, if any."""
        self._cond = threading.Condition()
        """Guards the queue, the budget, the counters and the states below."""
        self._model_idle = True
        self._stopping = False
        self._closed = False
        """No prompt is queued any more: the thread has ended, or never started."""
        self._thread: threading.Thread | None = None
        self.calls = 0
        """Embedder calls so far."""
        self.embedded = 0
        """Prompts embedded so far."""
        self.skipped = 0
        """Sampled prompts left without their vector (full, waited too long, over budget, stopped)."""
        self.helped = 0
        """Batches the model thread embedded itself (:meth:`help`)."""
        self.idle_priority = False
        """Whether the OS gave the thread idle priority."""

    def _start(self) -> None:
        with self._cond:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Answer every queued prompt (embedded, the budget and ``max_wait_s`` allowing), then end the
        thread; prompts given after that are answered at once, without a vector."""
        with self._cond:
            self._stopping = True
            if self._thread is None:
                self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    @property
    def waiting(self) -> int:
        """Prompts queued, not yet taken."""
        with self._cond:
            return len(self._jobs)

    def submit(self, prompt: str, then: Callable[[Vector | None], None]) -> None:
        """Queue ``prompt``; ``then`` gets its vector (or None) once. Never blocks on the embedder."""
        with self._cond:
            queued = not self._closed and len(self._jobs) < MAX_QUEUED
            if queued:
                self._jobs.append(_Job(prompt, then, self._clock()))
                self._cond.notify()
            else:
                self._count_skipped(1)
        if not queued:
            then(None)

    def model_idle(self, idle: bool) -> None:
        """The model thread: whether it is idle now (nothing running, waiting for requests); the thread
        takes prompts only while it is."""
        if idle == self._model_idle:  # (written by the model thread alone: read without the lock)
            return
        with self._cond:
            self._model_idle = idle
            if idle and self._jobs:  # else nothing to wake the thread for
                self._cond.notify()

    def help(self) -> None:
        """The model thread, between its steps or while it idles: embed what is queued here and now when
        the oldest prompt has waited :data:`DRIFT_EMBED_HELP_AFTER_S` (the thread did not take it: the model
        has not idled since, or the thread got no core), the budget allowing; answer without vectors the
        prompts of a batch the thread took that waited past ``max_wait_s``."""
        if not self._jobs and not self._taken:  # (read without the lock: the common case costs nothing)
            return
        with self._cond:
            now = self._clock()
            late = self._claim([job for job in self._taken if now - job.queued > self._max_wait_s])
            self._count_skipped(len(late))
            batch = self._take() if self._jobs and now - self._jobs[0].queued >= self._help_after_s else []
            self.helped += bool(batch)
        for job in late:
            job.then(None)
        if batch:
            self._run(batch)

    def _take(self) -> list[_Job]:
        return [self._jobs.popleft() for _ in range(min(MAX_BATCH, len(self._jobs)))]

    @staticmethod
    def _claim(jobs: list[_Job]) -> list[_Job]:
        """The jobs nobody answered yet, now this caller's to answer. Call with the lock held."""
        mine = [job for job in jobs if not job.answered]
        for job in mine:
            job.answered = True
        return mine

    def _count_skipped(self, n: int) -> None:
        """Call with the lock held."""
        self.skipped += n
        if n and self._on_skip is not None:
            self._on_skip(n)

    def _serve(self) -> None:
        name_thread(threading.get_native_id(), DRIFT_THREAD_NAME)
        self.idle_priority = idle_thread(self._cores)
        while True:
            with self._cond:
                while not self._stopping and not (self._jobs and self._model_idle):
                    self._cond.wait()
                if not self._jobs:
                    self._closed = True
                    return
                batch = self._taken = self._take()
            try:
                self._run(batch)
            except BaseException as exc:  # a ``then`` failed: what is left is answered without vectors
                log.exception("%s stopped", self._name)
                with self._cond:
                    self._closed = True
                    left = self._claim([*self._taken, *self._jobs])
                    self._jobs.clear()
                    self._taken = []
                for job in left:
                    with contextlib.suppress(Exception):
                        job.then(None)
                self.fail(exc)
                return
            with self._cond:
                self._taken = []

    def _run(self, batch: list[_Job]) -> None:
        """Embed the batch's prompts that did not wait too long, the budget allowing, in one call; answer
        every prompt of it nobody answered meanwhile (:meth:`help`)."""
        with self._cond:
            began = self._clock()
            unanswered = [job for job in batch if not job.answered]
            fresh = [job for job in unanswered if began - job.queued <= self._max_wait_s]
            if fresh and not self._budget.affordable():
                fresh = []
            self._count_skipped(len(unanswered) - len(fresh))
            if fresh:
                self.calls += 1
        vectors: Sequence[Vector | None] = [None] * len(fresh)
        embedded = False
        if fresh:
            try:
                vectors = self._embed([job.prompt for job in fresh])
                embedded = True
            except Exception:  # a feature must never fail the request it describes
                log.exception("drift embedding of %d prompts failed", len(fresh))
        answers = {id(job): vector for job, vector in zip(fresh, vectors, strict=True)}
        with self._cond:
            if fresh:
                self._budget.spend(self._clock() - began)
            mine = self._claim(batch)
            delivered = sum(id(job) in answers for job in mine) if embedded else 0
            self.embedded += delivered
        if delivered and self._on_embedded is not None:
            self._on_embedded(delivered)
        for job in mine:
            job.then(answers.get(id(job)))


def minilm_embedder(
    model_dir: Path, device: str, max_tokens: int = 128, *, traced: bool = True
) -> EmbedTexts:
    """Load MiniLM from the model cache and return a batch embedder (for :class:`DriftEmbedder`, whose thread
    and the model thread may call it at once: a forward keeps no state between calls). ``traced``: on a
    CPU, through the engine's traced graph (``EmbeddingEngine``)."""
    from gpu_workers.embedding import EmbeddingEngine
    from gpu_workers.models import load_embedding_model

    loaded = load_embedding_model(model_dir, device)
    engine = EmbeddingEngine(loaded.model, max_length=max_tokens, traced=traced)
    tokenizer = loaded.tokenizer

    # Cut before the tokenizer sees them (``truncation`` cuts only after tokenising the whole text). A prompt
    # no longer than this is tokenised whole, so its embedding is the same bit for bit; a longer one keeps
    # the same first tokens unless it is mostly whitespace, control characters or words of over 100
    # characters (one ``[UNK]`` each), where the sample embeds the tokens of its first characters.
    most = max_tokens * MAX_CHARS_PER_TOKEN

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        cut = [text[:most] for text in texts]  # a text no longer than ``most`` is itself, not a copy
        ids: list[list[int]] = tokenizer(cut, truncation=True, max_length=max_tokens)["input_ids"]
        vectors: list[list[float]] = engine.embed(ids).tolist()
        return vectors

    embed(["warm up"])
    return embed
