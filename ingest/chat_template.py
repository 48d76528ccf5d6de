"""A model's own Jinja chat template, rendered as transformers' ``apply_chat_template`` renders it.

The edge may not import transformers, so it renders the template (:mod:`schemas.chat_template` reads it)
with jinja2 the way ``apply_chat_template(messages, add_generation_prompt=True)`` does: a sandboxed,
immutable environment with ``trim_blocks`` and ``lstrip_blocks``, transformers' ``tojson``,
``raise_exception`` and ``strftime_now``, and the tokenizer's named special tokens as variables. jinja2 is
imported only when a template is compiled, so an edge serving none never loads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jinja2 import Template


class ChatTemplateError(ValueError):
    """A chat template cannot be compiled, or it refused a conversation (``raise_exception``)."""


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
