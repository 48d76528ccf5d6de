"""An embedding model's sentence-transformers pipeline, read when a directory is prepared.

A sentence-transformers model directory says in ``modules.json`` what turns the transformer's token
vectors into the model's vector: a ``Pooling`` module (``1_Pooling/config.json`` names the mode), often a
``Normalize`` module, sometimes more (``Dense`` projections, ...). The embedding engine implements the
transformer, mean / CLS / last-token pooling and L2 normalisation; a directory whose pipeline needs
anything else is refused here, when it is prepared, rather than served with vectors unlike its own (a
review, 2026-12-03: every model was mean-pooled, and a CLS-pooled BGE-style model's vectors had cosine
0.57 with those of ``SentenceTransformer(dir).encode``).

A directory without ``modules.json`` is a plain transformer, which sentence-transformers itself mean-pools.
Vectors come back L2-normalised whether or not the pipeline ends in ``Normalize`` (the API's vectors are
unit vectors, as OpenAI's are; an ``EmbeddingRequested`` with ``normalize`` false gets them as pooled):
the direction, which cosine similarity compares, is the model's either way.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpu_workers.model_store import ModelError
from schemas.manifest import Pooling

MODULES_FILE = "modules.json"

_TYPES = "sentence_transformers.models."
TRANSFORMER = _TYPES + "Transformer"
POOLING = _TYPES + "Pooling"
NORMALIZE = _TYPES + "Normalize"

POOLING_MODES: dict[str, Pooling] = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
}
"""``1_Pooling/config.json``'s flags for the poolings the engine implements."""

UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
"""Flags for poolings it does not: a model that sets one is refused."""


def sentence_pooling(source: Path) -> Pooling:
    """The pooling the sentence-transformers pipeline in ``source`` asks for (``mean`` where it has none);
    :class:`ModelError` when the pipeline holds a module or a pooling mode the engine does not implement,
    or cannot be read."""
    path = Path(source) / MODULES_FILE
    if not path.is_file():
        return "mean"
    try:
        modules = json.loads(path.read_text())
        kinds = [(str(m["type"]), str(m.get("path", ""))) for m in modules]
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise ModelError(f"{path} cannot be read as a sentence-transformers pipeline: {exc}") from None
    other = [kind for kind, _ in kinds if kind not in (TRANSFORMER, POOLING, NORMALIZE)]
    if other:
        raise ModelError(
            f"{source}: its sentence-transformers pipeline ({MODULES_FILE}) holds {', '.join(other)}, "
            "which this platform does not implement (it serves a transformer, mean, CLS or last-token "
            "pooling and normalisation): its vectors would not be the model's"
        )
    if not kinds or kinds[0][0] != TRANSFORMER or [k for k, _ in kinds].count(TRANSFORMER) != 1:
        raise ModelError(f"{source}: {MODULES_FILE} does not start with its one Transformer module")
    poolings = [p for kind, p in kinds if kind == POOLING]
    if len(poolings) != 1 or kinds[1][0] != POOLING:
        raise ModelError(
            f"{source}: {MODULES_FILE} needs one Pooling module right after its Transformer "
            f"(it lists {[kind for kind, _ in kinds]})"
        )
    return _pooling_mode(Path(source) / poolings[0] / "config.json")


def _pooling_mode(path: Path) -> Pooling:
    try:
        config: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path} is not a pooling configuration")
    unsupported = [flag for flag in UNSUPPORTED_MODES if config.get(flag)]
    chosen = [mode for flag, mode in POOLING_MODES.items() if config.get(flag)]
    if unsupported or len(chosen) != 1:
        named = [flag for flag in (*POOLING_MODES, *UNSUPPORTED_MODES) if config.get(flag)]
        raise ModelError(
            f"{path} pools with {named or 'no mode'}: this platform implements exactly one of "
            f"{', '.join(POOLING_MODES)}"
        )
    return chosen[0]
