"""A model's own Jinja chat template: read from its Hugging Face directory, rendered as transformers does.

An instruct model was tuned on prompts its chat template writes (ChatML's ``<|im_start|>user``, Llama 3's
``<|start_header_id|>``); a linked model given the platform's plain-text format got prompts it never saw
and answered badly (a review, 2026-12-03). The edge may not import transformers, so it renders the template
here with jinja2 the way ``apply_chat_template(messages, add_generation_prompt=True)`` does: a sandboxed,
immutable environment with ``trim_blocks`` and ``lstrip_blocks``, transformers' ``tojson``,
``raise_exception`` and ``strftime_now``, and the tokenizer's named special tokens as variables. jinja2 is
imported only when a template is compiled, so a process serving none never loads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template

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


class ChatTemplateError(ValueError):
    """A chat template cannot be compiled, or it refused a conversation (``raise_exception``)."""


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


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: jinja's own escapes HTML characters, which no prompt wants
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)  # local time, as transformers gives


@lru_cache(maxsize=64)
def _compile(source: str) -> Template:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, tokens: Mapping[str, str]) -> None:
        from jinja2.exceptions import TemplateError

        try:
            self._template = _compile(source)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self._tokens = dict(tokens)
        self.names_developer = re.search(r"\bdeveloper\b", source) is not None
        """Whether the template knows OpenAI's ``developer`` role (else such a message is a system one)."""

    def render(self, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = True) -> str:
        """The prompt text of (role, content) messages. :class:`ChatTemplateError` when the template
        refuses them ("roles must alternate", "system role not supported") or fails on them."""
        conversation = [{"role": role, "content": content} for role, content in messages]
        try:
            return str(
                self._template.render(
                    messages=conversation,
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self._tokens,
                )
            )
        except Exception as exc:  # a template is a program: any failure of it is this conversation's
            raise ChatTemplateError(str(exc) or type(exc).__name__) from exc
