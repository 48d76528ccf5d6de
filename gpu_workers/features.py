"""Drift features of a finished request, built on the model thread as its terminal event is published.

Every terminal event gets :class:`~schemas.events.DriftFeatures`: a profile of the prompt and the output
(lengths, writing system, a language guess, empty/refusal flags; :mod:`schemas.features`), the engine's
mean log-probability and entropy when the runner measured them, and for 1 in ``SLUICE_DRIFT_SAMPLE``
requests a MiniLM embedding of the prompt. An embedding request's own first vector is that embedding when
the served model is MiniLM; a generation worker embeds the prompt with a small MiniLM it loads next to its
model. A MiniLM forward of one short text costs ~8 ms on one thread here, most of it per call, not per
text, and it stalls the whole running batch: so sampled prompts are queued when their request starts
(:meth:`FeatureProbe.expect`) and embedded together when the first of them finishes; the others find
their vectors ready. Under saturation a request runs ~0.5 s, long enough for a few sampled companions.

None of this holds text: the streams worker turns the features into a ``drift_features`` row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import msgspec

from schemas.events import DriftFeatures, EmbeddingRequested, GenerationRequested, RequestFinished
from schemas.features import is_refusal, profile, sampled

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)
T = TypeVar("T")

EmbedTexts = Callable[[Sequence[str]], Sequence[Sequence[float]]]
"""Prompts' texts to unit vectors (MiniLM), in one batch, run on the model thread."""

MAX_HELD = 256
"""Prompts queued and vectors computed ahead, at most (a request that never ends here, e.g. its partition
moved, must not leak): past it the oldest go."""

MAX_BATCH = 32
"""Prompts embedded in one call at most."""

DRIFT_EMBED_BURST_S = 0.05
"""Embedding time the budget lets through at once after a quiet spell (a few calls)."""

EMBEDDING_DECIMALS = 6
"""Embeddings travel rounded: ~9 characters a component instead of ~20, and no drift test can tell."""


class FeatureProbe:
    """``features(event, result)``: the drift features of one request (pure, apart from the embedder)."""

    def __init__(
        self,
        sample_one_in: int,
        embed: EmbedTexts | None = None,
        *,
        own_vectors: bool = False,
        budget: float = 1.0,
        on_skip: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """``budget``: the share of the (model thread's) time ``embed`` may take, 1 for no limit; a sampled
        request past it goes without its embedding and ``on_skip()`` is called."""
        self._one_in = sample_one_in
        self._embed = embed
        self._budget = budget
        self._on_skip = on_skip
        self._clock = clock
        self._credit = DRIFT_EMBED_BURST_S
        """Seconds of embedding the budget allows now: it earns ``budget`` per second, spends what calls take."""
        self._earned_at = clock()
        self.skipped = 0
        """Sampled requests left without their embedding by the budget."""
        self._own_vectors = own_vectors
        """The served model is the drift embedder itself: a request's first vector is its embedding."""
        self._queued: dict[str, str] = {}
        """Sampled prompts of requests that started, by request id, to embed together."""
        self._ready: dict[str, Sequence[float]] = {}
        """Vectors embedded with another request's, waiting for their own request to finish."""
        self.calls = 0
        """Embedder calls so far."""

    def expect(self, event: GenerationRequested | EmbeddingRequested) -> None:
        """The request starts here: if it is sampled for an embedding, queue its prompt."""
        if self._embed is None or self._own_vectors or not isinstance(event, GenerationRequested):
            return
        if event.prompt and sampled(event.request_id, self._one_in):
            _hold(self._queued, event.request_id, event.prompt)

    def features(
        self, event: GenerationRequested | EmbeddingRequested, result: RequestFinished
    ) -> DriftFeatures:
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
        if sampled(event.request_id, self._one_in):
            vector = self._vector(event, result, prompt)
            if vector is not None:
                fields["embedding"] = [round(float(x), EMBEDDING_DECIMALS) for x in vector]
        return msgspec.structs.replace(measured, **fields)

    def _vector(
        self, event: GenerationRequested | EmbeddingRequested, result: RequestFinished, prompt: str | None
    ) -> Sequence[float] | None:
        if self._own_vectors and isinstance(event, EmbeddingRequested):
            vectors = result.vectors()
            return vectors[0] if vectors else None
        if self._embed is None or not prompt:
            return None
        request_id = event.request_id
        ready = self._ready.pop(request_id, None)
        if ready is not None:
            return ready
        self._queued.pop(request_id, None)
        if not self._affordable():
            self.skipped += 1
            if self._on_skip is not None:
                self._on_skip()
            return None
        ids = [request_id, *self._queued][:MAX_BATCH]
        texts = [prompt, *(self._queued.pop(other) for other in ids[1:])]
        self.calls += 1
        started = self._clock()
        try:
            embedded = self._embed(texts)
        except Exception:  # a feature must never fail the request it describes
            log.exception("drift embedding of %s failed", request_id)
            return None
        finally:
            self._credit -= self._clock() - started
        for other, vector in zip(ids[1:], embedded[1:], strict=True):
            _hold(self._ready, other, vector)
        return embedded[0]

    def _affordable(self) -> bool:
        """Whether the budget allows an embedding call now (always, without a limit)."""
        if self._budget >= 1.0:
            return True
        now = self._clock()
        self._credit = min(DRIFT_EMBED_BURST_S, self._credit + (now - self._earned_at) * self._budget)
        self._earned_at = now
        return self._credit > 0.0


def _hold(held: dict[str, T], key: str, value: T) -> None:
    held[key] = value
    while len(held) > MAX_HELD:
        del held[next(iter(held))]


def minilm_embedder(
    model_dir: Path, device: str, max_tokens: int = 128, *, traced: bool = True
) -> EmbedTexts:
    """Load MiniLM from the model cache and return a batch embedder; call it on the model thread. ``traced``:
    on a CPU, through the engine's traced graph (``EmbeddingEngine``)."""
    from gpu_workers.embedding import EmbeddingEngine
    from gpu_workers.models import load_embedding_model

    loaded = load_embedding_model(model_dir, device)
    engine = EmbeddingEngine(loaded.model, max_length=max_tokens, traced=traced)
    tokenizer = loaded.tokenizer

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        ids: list[list[int]] = tokenizer(list(texts), truncation=True, max_length=max_tokens)["input_ids"]
        vectors: list[list[float]] = engine.embed(ids).tolist()
        return vectors

    embed(["warm up"])
    return embed
