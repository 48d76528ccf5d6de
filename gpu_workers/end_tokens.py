"""The tokens that end a model's answers, read from its Hugging Face directory into its manifest.

A sequence ends at any of the model's end-of-sequence tokens, which config.json and
generation_config.json each name as an int or a list (transformers' ``generate`` stops at
generation_config's). A chat answer also ends where the model begins another turn of the chat format:
at its role markers, where they are single special tokens of the vocabulary, or, for a model rendered with
its own chat template, at the special token that template writes after an answer. Only json and msgspec
are used (and transformers' template renderer for a model with a template), so preparing a model in the
CLI loads no tokenizer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from gpu_workers.model_store import ModelError
from schemas.chat_template import read_chat_template
from schemas.manifest import ChatFormat, ModelManifest

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILE = "tokenizer.json"
CHAT_ROLES = ("system", "user", "assistant")
"""The roles the edge writes turns of (an OpenAI ``developer`` message is a ``system`` turn)."""


class _AddedToken(msgspec.Struct):
    id: int
    content: str
    special: bool = False


class _TokenizerFile(msgspec.Struct):
    """The part of ``tokenizer.json`` read here; decoding skips the rest (the vocabulary) unparsed."""

    added_tokens: list[_AddedToken] = []


def _ids(value: Any) -> list[int]:
    """A config's ``eos_token_id``: an int, a list of ints, or nothing (null, absent, or not a token id)."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool) and v >= 0]


def _special_tokens(model_dir: Path) -> list[_AddedToken]:
    """The special added tokens of ``model_dir``'s ``tokenizer.json`` (``OSError``, ``DecodeError``)."""
    tokenizer = msgspec.json.decode((Path(model_dir) / TOKENIZER_FILE).read_bytes(), type=_TokenizerFile)
    return [token for token in tokenizer.added_tokens if token.special]


def end_token_ids(model_dir: Path) -> tuple[int, ...]:
    """The union of config.json's and generation_config.json's ``eos_token_id``, config.json's first. A
    file that is missing or unreadable adds none."""
    found: dict[int, None] = {}
    for name in CONFIG_FILES:
        try:
            config = json.loads((Path(model_dir) / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(config, dict):
            found.update(dict.fromkeys(_ids(config.get("eos_token_id"))))
    return tuple(found)


def end_of_turn_ids(model_dir: Path, chat: ChatFormat) -> tuple[int, ...]:
    """The special tokens of ``model_dir``'s tokenizer that mark a role in ``chat``'s turns: a special token
    whose text is in the text a role's turn begins with, and names that role (``<|user|>`` in
    ``<|user|>\\n``). Naming the role keeps out a special token that happens to be part of every turn's
    text (a newline, a begin-of-text), at which every answer would end. A model whose role markers are
    plain text (a linked model given the platform's format) has none: its own end of turn is in its
    generation_config's end tokens (Llama 3's ``<|eot_id|>``, Qwen2's ``<|im_end|>``)."""
    if chat.template is not None:
        return _template_end_of_turn_ids(model_dir, chat)
    try:
        specials = _special_tokens(model_dir)
        headers = {role: chat.turn.format(role=role, content="") for role in CHAT_ROLES}
    except (OSError, msgspec.DecodeError, KeyError, IndexError, ValueError):
        return ()
    headers["assistant"] += chat.assistant_prefix
    return tuple(
        sorted(
            {
                token.id
                for token in specials
                if any(role in token.content and token.content in header for role, header in headers.items())
            }
        )
    )


ANSWER = "\ue000answer\ue000"
"""What an assistant turn says when its end is rendered: text no template writes, at whose end the
template's own end-of-turn text follows."""


def _template_end_of_turn_ids(model_dir: Path, chat: ChatFormat) -> tuple[int, ...]:
    """The special token a model's chat template writes right after an assistant's answer (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``, Gemma's ``<end_of_turn>``): rendered for a user question
    and an answer, the longest special token the text after the answer begins with. A template that
    writes none there, refuses that conversation or has no readable tokenizer gives none; the model's
    end-of-sequence tokens (generation_config's) still end its answers."""
    assert chat.template is not None
    try:
        specials = _special_tokens(model_dir)
        text = render_template(
            chat.template, chat.template_tokens, [("user", "hello"), ("assistant", ANSWER)]
        )
    except (OSError, msgspec.DecodeError, ModelError):
        return ()
    at = text.find(ANSWER)
    if at < 0:
        return ()
    after = text[at + len(ANSWER) :]
    ends = [token for token in specials if after.startswith(token.content)]
    if not ends:
        return ()
    return (max(ends, key=lambda token: len(token.content)).id,)


def _compiled(template: str, model_dir: Path) -> None:
    """:class:`ModelError` unless ``template`` compiles (by transformers' own template environment)."""
    from jinja2.exceptions import TemplateError
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    try:
        _cached_compile_jinja_template(template)
    except TemplateError as exc:
        raise ModelError(f"{model_dir}: the chat template does not compile: {exc}") from None


def render_template(template: str, tokens: Mapping[str, str], messages: Sequence[tuple[str, str]]) -> str:
    """``messages`` (role, content) rendered by ``template`` as transformers' ``apply_chat_template``
    renders them (no generation prompt): transformers' own renderer, which the edge's
    (:mod:`ingest.chat_template`) must match. :class:`ModelError` when the template fails on them."""
    from transformers.utils.chat_template_utils import render_jinja_template

    conversation = [{"role": role, "content": content} for role, content in messages]
    try:
        variables: dict[str, Any] = dict(tokens)  # the named special tokens, as the tokenizer passes them
        found: Any = render_jinja_template([conversation], chat_template=template, **variables)
    except Exception as exc:  # a template is a program: any failure of it is this conversation's
        raise ModelError(f"the chat template fails on {len(messages)} messages: {exc}") from None
    rendered = found[0] if isinstance(found, tuple) else found  # (texts, generation indices) in 5.x
    return str(rendered[0] if isinstance(rendered, list) else rendered)


def chat_format(model_dir: Path, *, own_template: bool = True) -> ChatFormat:
    """The chat format of a linked Hugging Face directory: its own Jinja template where it has one (and
    ``own_template``), else the platform's plain-text format; with the end of turn of either.
    :class:`ModelError` for a template that does not compile."""
    template, tokens = read_chat_template(model_dir) if own_template else (None, {})
    if template is not None:
        _compiled(template, model_dir)  # refused here, not by every edge at its start
    chat = ChatFormat(template=template, template_tokens=tokens)
    return msgspec.structs.replace(chat, end_of_turn_ids=end_of_turn_ids(model_dir, chat))


def with_end_tokens(manifest: ModelManifest, model_dir: Path) -> ModelManifest:
    """``manifest`` with the end tokens a manifest written before they were recorded lacks, read from
    ``model_dir`` (a prepared version is never rewritten, so its worker derives them when it loads)."""
    if manifest.eos_token_ids is not None and manifest.chat.end_of_turn_ids is not None:
        return manifest
    ends = manifest.eos_token_ids
    if ends is None:
        recorded = () if manifest.eos_token_id is None else (manifest.eos_token_id,)
        ends = tuple(dict.fromkeys((*recorded, *end_token_ids(model_dir))))
    turns = manifest.chat.end_of_turn_ids
    if turns is None:
        turns = end_of_turn_ids(model_dir, manifest.chat)
    return msgspec.structs.replace(
        manifest,
        eos_token_ids=ends,
        chat=msgspec.structs.replace(manifest.chat, end_of_turn_ids=turns),
    )
