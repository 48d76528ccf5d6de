"""A model's own Jinja chat template, read from its Hugging Face directory as transformers reads it.

An instruct model was tuned on prompts its chat template writes (ChatML's ``<|im_start|>user``, Llama 3's
``<|start_header_id|>``); a linked model given the platform's plain-text format got prompts it never saw
and answered badly (a review, 2026-12-03). The template is recorded in the manifest when a model is
prepared; the edge renders it (:mod:`ingest.chat_template`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""The tokens transformers passes to a template by name (its ``special_tokens_map``)."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an added token's ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_chat_template(model_dir: Path) -> tuple[str | None, dict[str, str]]:
    """``model_dir``'s chat template and the named special tokens it is rendered with, as transformers
    loads them: ``chat_template.jinja`` first, else tokenizer_config.json's ``chat_template`` (a string, or
    named templates of which "default" is used). No template: ``(None, {})``."""
    model_dir = Path(model_dir)
    config = _read_json(model_dir / TOKENIZER_CONFIG)
    template: str | None = None
    try:
        template = (model_dir / TEMPLATE_FILE).read_text()
    except OSError:
        found = config.get("chat_template")
        if isinstance(found, str):
            template = found
        elif isinstance(found, list):
            named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
            default = named.get("default")
            template = default if isinstance(default, str) else None
        elif isinstance(found, dict) and isinstance(found.get("default"), str):
            template = found["default"]
    if not template:
        return None, {}
    legacy = _read_json(model_dir / SPECIAL_TOKENS_MAP)
    tokens: dict[str, str] = {}
    for name in NAMED_SPECIAL_TOKENS:
        text = _token_text(config.get(name))
        if text is None:
            text = _token_text(legacy.get(name))
        if text is not None:
            tokens[name] = text
    return template, tokens
