"""Drift features of a finished request, built on the model thread as its terminal event is published.

Every terminal event gets :class:`~schemas.events.DriftFeatures`: a profile of the prompt and the output
(lengths, writing system, a language guess, empty/refusal flags; :mod:`schemas.features`), the engine's
mean log-probability and entropy when the runner measured them, and for 1 in ``SLUICE_DRIFT_SAMPLE``
requests a MiniLM embedding of the prompt. An embedding request's own first vector is that embedding when
the served model is MiniLM; a generation worker embeds the prompt with a small MiniLM it loads next to its
model (one forward of ~13 ms with one torch thread on this CPU, so 1 in 20 costs ~0.7 ms per request
on average; `benchmarks/drift_detection.py`).

None of this holds text: the streams worker turns the features into a ``drift_features`` row.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import msgspec

from schemas.events import DriftFeatures, EmbeddingRequested, GenerationRequested, RequestFinished
from schemas.features import is_refusal, profile, sampled

if TYPE_CHECKING:
    from pathlib import Path

log = logging.getLogger(__name__)

EmbedText = Callable[[str], Sequence[float]]
"""A prompt's text to a unit vector (MiniLM), run on the model thread."""

EMBEDDING_DECIMALS = 6
"""Embeddings travel rounded: ~9 characters a component instead of ~20, and no drift test can tell."""


class FeatureProbe:
    """``features(event, result)``: the drift features of one request (pure, apart from the embedder)."""

    def __init__(self, sample_one_in: int, embed: EmbedText | None = None, *, own_vectors: bool = False):
        self._one_in = sample_one_in
        self._embed = embed
        self._own_vectors = own_vectors
        """The served model is the drift embedder itself: a request's first vector is its embedding."""

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
        try:
            return self._embed(prompt)
        except Exception:  # a feature must never fail the request it describes
            log.exception("drift embedding of %s failed", event.request_id)
            return None


def minilm_embedder(model_dir: Path, device: str, max_tokens: int = 128) -> EmbedText:
    """Load MiniLM from the model cache and return a one-text embedder; call it on the model thread."""
    from gpu_workers.embedding import EmbeddingEngine
    from gpu_workers.models import load_embedding_model

    loaded = load_embedding_model(model_dir, device)
    engine = EmbeddingEngine(loaded.model, max_length=max_tokens)
    tokenizer = loaded.tokenizer

    def embed(text: str) -> Sequence[float]:
        ids: list[int] = tokenizer(text, truncation=True, max_length=max_tokens)["input_ids"]
        vector: Sequence[float] = engine.embed([ids])[0].tolist()
        return vector

    embed("warm up")
    return embed
