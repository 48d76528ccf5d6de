"""The context a prepared model's manifest promises: what its workers' engines serve, no more.

The edge refuses a request longer than the manifest's ``max_context`` with a 400
``context_length_exceeded`` before anything is published; a worker can only fail a request it was given.
So the manifest must say what the engines actually serve, computed with the functions they use
(:func:`gpu_workers.step_graphs.position_limit`, :func:`gpu_workers.step_graphs.attention_span`). A
review (2026-12-03) found two ways it said more:

* a sliding-window model (Mistral-7B-v0.1: 32,768 positions, a window of 4,096) was recorded with all its
  positions while the generation engine serves only the window, and a prompt between the two was a 500;
* a RoBERTa-family encoder was recorded with ``max_position_embeddings`` (514), two more than it can
  embed, and such an input failed its whole batch.
"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

from gpu_workers.model_store import Task

TOKENIZER_CONFIG = "tokenizer_config.json"
SANE_MODEL_MAX_LENGTH = 1_000_000
"""A tokenizer's ``model_max_length`` at or above this is transformers' "no limit" placeholder (1e30 in
many configs), not a limit."""


def served_context(source: Path, config: dict[str, Any], task: Task) -> int:
    """The longest sequence the engines serve for the model in ``source`` (``config``: its config.json):
    its usable positions, and for a generation model no more than its attention window; for an embedding
    model no more than its tokenizer's ``model_max_length`` when that is a real limit (what
    sentence-transformers cuts at for a model without ``sentence_bert_config.json``)."""
    # imported here: step_graphs loads numpy, whose thread pool started at the import of gpu_workers.models
    # would keep every core, before the worker is placed (tests/gpu_workers/test_quiet_team.py)
    from gpu_workers.step_graphs import attention_span, position_limit

    if task == "generation":
        # transformers' own reading of the config, as the engine gets it: Qwen2's sliding_window is there
        # only with use_sliding_window, for instance
        resolved = _transformers_config(source) or types.SimpleNamespace(**config)
        limit = position_limit(resolved)
        span = attention_span(resolved)
        return min(limit, span) if span is not None else limit
    limit = position_limit(types.SimpleNamespace(**config))
    model_max = _tokenizer_max_length(source)
    return min(limit, model_max) if model_max is not None else limit


def _transformers_config(source: Path) -> Any:
    """``source``'s config as transformers builds it, or None where it cannot (the worker then says why
    when it loads the model)."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _tokenizer_max_length(source: Path) -> int | None:
    try:
        value = json.loads((Path(source) / TOKENIZER_CONFIG).read_text()).get("model_max_length")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, int | float) and 0 < value < SANE_MODEL_MAX_LENGTH:
        return int(value)
    return None
