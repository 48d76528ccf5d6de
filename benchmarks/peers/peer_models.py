"""What both peer servers run: the platform's own models, loaded the way its workers load them
(``gpu_workers.models``: same prepared directories, float32, same torch thread setup, including
``SLUICE_WORKER_TORCH_THREADS``), called the way the
raw baseline calls them (``EmbeddingEngine.embed`` and ``padded_generate``), behind OpenAI-shaped bodies.
A peer differs from the platform only in how requests reach these calls.

Not thread-safe: call it from one thread (torch's OpenMP team, see ``configure_torch_threads``).
"""

from __future__ import annotations

import time
from typing import Any

from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.engine import padded_generate
from gpu_workers.models import (
    MINILM_ID,
    LoadedModel,
    configure_torch_threads,
    load_embedding_model,
    load_generation_model,
)
from gpu_workers.settings import WorkerSettings
from schemas.manifest import current_model_dir
from schemas.settings import PlatformSettings, load_settings

GENERATION_ID = "demo-gpt"
Body = dict[str, Any]


class PeerModels:
    def __init__(self, *, embeddings: bool = True, generation: bool = True) -> None:
        cache = load_settings(PlatformSettings).cache_dir
        configure_torch_threads(load_settings(WorkerSettings).worker_torch_threads)  # as `sluice worker`
        self.emb: LoadedModel | None = None
        self.engine: EmbeddingEngine | None = None
        self.gen: LoadedModel | None = None
        if embeddings:
            self.emb = load_embedding_model(current_model_dir(cache, MINILM_ID), device="auto")
            self.engine = EmbeddingEngine(self.emb.model)
        if generation:
            self.gen = load_generation_model(current_model_dir(cache, GENERATION_ID), device="auto")

    def warm_up(self) -> None:
        """A call of each model from the calling thread (the thread that will run them)."""
        configure_torch_threads()
        if self.engine is not None:
            self.embed_many([{"input": "warm up"}])
        if self.gen is not None:
            self.complete_many([{"prompt": "warm up", "max_tokens": 4}])

    def embed_many(self, bodies: list[Body]) -> list[Body]:
        """One forward pass over every input of every body; one OpenAI embeddings response per body."""
        if self.emb is None or self.engine is None:
            raise RuntimeError("this peer serves no embedding model")
        inputs = [[b["input"]] if isinstance(b["input"], str) else list(b["input"]) for b in bodies]
        ids = [list(self.emb.tokenizer(text)["input_ids"]) for texts in inputs for text in texts]
        vectors = self.engine.embed(ids).tolist()
        out: list[Body] = []
        start = 0
        for body, texts in zip(bodies, inputs, strict=True):
            rows = vectors[start : start + len(texts)]
            tokens = sum(len(i) for i in ids[start : start + len(texts)])
            start += len(texts)
            out.append(
                {
                    "object": "list",
                    "model": body.get("model", MINILM_ID),
                    "data": [
                        {"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)
                    ],
                    "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                }
            )
        return out

    def complete_many(self, bodies: list[Body]) -> list[Body]:
        """One batched greedy ``generate`` for every body's prompt (as long as the longest ``max_tokens``
        asks; each is cut at its own ``max_tokens`` and, unless ``ignore_eos``, at the model's first end token)."""
        if self.gen is None:
            raise RuntimeError("this peer serves no generation model")
        tokenizer = self.gen.tokenizer
        prompts = [list(tokenizer(b["prompt"])["input_ids"]) for b in bodies]
        limits = [int(b.get("max_tokens", 16)) for b in bodies]
        at_least = min(limit if b.get("ignore_eos") else 0 for b, limit in zip(bodies, limits, strict=True))
        rows = padded_generate(self.gen.model, prompts, max(limits), min_new_tokens=at_least)
        ends = self.gen.manifest.end_token_ids
        out: list[Body] = []
        for body, prompt, limit, row in zip(bodies, prompts, limits, rows, strict=True):
            tokens = row[:limit]
            finish = "length"
            end = next((i for i, t in enumerate(tokens) if t in ends), None)
            if not body.get("ignore_eos") and end is not None:
                tokens = tokens[:end]
                finish = "stop"
            out.append(
                {
                    "id": f"cmpl-peer-{time.monotonic_ns()}",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": body.get("model", GENERATION_ID),
                    "choices": [
                        {
                            "index": 0,
                            "text": tokenizer.decode(tokens),
                            "finish_reason": finish,
                            "logprobs": None,
                        }
                    ],
                    "usage": {
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(tokens),
                        "total_tokens": len(prompt) + len(tokens),
                    },
                }
            )
        return out
