"""The model catalogue: model id -> manifest + tokenizer, loaded once at start-up.

Each served model is a prepared directory (``current_model_dir(cache_dir, id)``) holding
``sluice-manifest.json`` and ``tokenizer.json``; the edge loads only the tokenizer (the Rust ``tokenizers``
library), never the weights. Padding and truncation configured in ``tokenizer.json`` are switched off:
an input longer than the model's context is rejected, never silently cut. Special tokens are added the way
the tokenizer's post-processor says (``[CLS] … [SEP]`` for a BERT tokenizer, nothing for GPT-2's).
"""

from __future__ import annotations

import logging
import re
import string
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Encoding, Tokenizer

from ingest.chat_template import ChatTemplate, ChatTemplateError
from ingest.errors import CatalogueError, ContextLengthExceeded, InvalidRequest, ModelNotFound
from schemas.manifest import (
    MANIFEST_FILE,
    MAX_CHARS_PER_TOKEN,
    ManifestError,
    ModelManifest,
    current_model_dir,
    models_root,
    read_manifest,
)
from schemas.settings import model_path_entry

TOKENIZER_FILE = "tokenizer.json"

log = logging.getLogger(__name__)

_MARK = "\ue000{}\ue001"
"""A content's place in a template's rendering (private-use characters no template writes)."""
_MARKS = re.compile("\ue000(\\d+)\ue001")


@dataclass(frozen=True, eq=False)
class ServedModel:
    model_id: str
    manifest: ModelManifest
    tokenizer: Tokenizer
    plain: Tokenizer
    """The same tokenizer reading special tokens as text: for what a chat message says (its content), which
    must not open a turn of another role (:meth:`encode_chat`)."""
    specials: tuple[str, ...]
    """The special tokens' texts (``<|system|>``, ``[CLS]``)."""
    created: int = 0
    """When its version was prepared (its manifest's mtime, Unix seconds): OpenAI's model ``created``."""
    template: ChatTemplate | None = None
    """The model's own chat template (:attr:`ChatFormat.template`), compiled; None: the plain-text format."""

    @classmethod
    def load(cls, model_id: str, model_dir: Path) -> ServedModel:
        try:
            manifest = read_manifest(model_dir)
            tokenizer = Tokenizer.from_file(str(model_dir / TOKENIZER_FILE))
        except ManifestError as exc:
            raise CatalogueError(f"model {model_id}: {exc}") from exc
        except Exception as exc:  # tokenizers raises plain Exception for unreadable files
            raise CatalogueError(
                f"model {model_id}: cannot load {model_dir / TOKENIZER_FILE}: {exc}"
            ) from exc
        tokenizer.no_truncation()
        tokenizer.no_padding()
        try:
            manifest.chat.turn.format(role="user", content="")
        except (KeyError, IndexError, ValueError) as exc:
            raise CatalogueError(f"model {model_id}: bad chat turn template {manifest.chat.turn!r}") from exc
        template = None
        if manifest.task == "generation" and manifest.chat.template is not None:
            try:
                template = ChatTemplate(manifest.chat.template, manifest.chat.template_tokens)
            except ChatTemplateError as exc:
                raise CatalogueError(f"model {model_id}: {exc}") from exc
        created = int((model_dir / MANIFEST_FILE).stat().st_mtime)
        plain = Tokenizer.from_str(tokenizer.to_str())
        plain.encode_special_tokens = True
        specials = tuple(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
        return cls(
            model_id=model_id,
            manifest=manifest,
            tokenizer=tokenizer,
            created=created,
            plain=plain,
            specials=specials,
            template=template,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.get_vocab_size(with_added_tokens=True))

    def chat_role(self, role: str) -> str:
        """A message's role in the model's chat format: OpenAI's ``developer`` messages are its system
        instructions (they replace ``system`` for newer models), unless the model's own template knows a
        ``developer`` role. Passed as it was, a demo-gpt prompt got ``<|developer|>``, six plain tokens it
        never saw in training (an audit)."""
        if role == "developer" and not (self.template is not None and self.template.names_developer):
            return "system"
        return role

    def chat_prompt(self, messages: Sequence[tuple[str, str]]) -> str:
        """The prompt text for (role, content) messages, by the model's own chat template or else the
        manifest's plain-text chat format. :class:`InvalidRequest` when the template refuses them."""
        if self.template is not None:
            try:
                return self.template.render(messages)
            except ChatTemplateError as exc:
                raise InvalidRequest(
                    f"The chat template of model {self.model_id} cannot render these messages: {exc}",
                    param="messages",
                ) from exc
        chat = self.manifest.chat
        return "".join(chat.turn.format(role=role, content=content) for role, content in messages) + (
            chat.assistant_prefix
        )

    def encode_chat(self, messages: Sequence[tuple[str, str]], param: str) -> tuple[str, list[int]]:
        """The prompt text of (role, content) messages and its token ids, the template's special tokens
        read as such and the messages' contents as text: a user who typed ``<|system|>`` in a message
        opened a system turn of their own (a review; the edge tokenised the whole prompt as one text).

        The model's own chat template writes its special tokens itself (``{{ bos_token }}``), so its
        rendering is tokenised without special tokens added again, as transformers'
        ``apply_chat_template(tokenize=True)`` does (adding BOS too would double it); the plain-text
        format's come from the tokenizer's post-processor."""
        text = self.chat_prompt(messages)
        self._check_length(text, param)
        added = self.template is None
        if not any(self._names_a_special(content) for _, content in messages):
            # the prompt as one text, as the model saw its training text (tokenised in pieces, a content's
            # edges would not merge with the template's newlines)
            return text, list(self.tokenizer.encode(text, add_special_tokens=added).ids)
        framing, contents = self._format_pieces(messages) if added else self._template_pieces(text, messages)
        pieces: list[Encoding] = []
        for frame, spoken in zip(
            self.tokenizer.encode_batch(framing, add_special_tokens=False),
            [*self.plain.encode_batch(contents, add_special_tokens=False), None],
            strict=True,
        ):
            pieces += [frame] if spoken is None else [frame, spoken]
        merged = Encoding.merge(pieces, growing_offsets=True)
        return text, list((self.tokenizer.post_process(merged) if added else merged).ids)

    def _format_pieces(self, messages: Sequence[tuple[str, str]]) -> tuple[list[str], list[str]]:
        """The plain-text format's text before each message's content and after the last, and the contents."""
        chat = self.manifest.chat
        formatter = string.Formatter()
        framing: list[str] = [""]
        contents: list[str] = []
        for role, content in messages:
            for literal, field, spec, conversion in formatter.parse(chat.turn):
                framing[-1] += literal
                if field == "content":
                    contents.append(content)
                    framing.append("")
                elif field is not None:  # the role (a template naming anything else fails at load)
                    framing[-1] += formatter.format_field(
                        formatter.convert_field(role, conversion), spec or ""
                    )
        framing[-1] += chat.assistant_prefix
        return framing, contents

    def _template_pieces(self, text: str, messages: Sequence[tuple[str, str]]) -> tuple[list[str], list[str]]:
        """The model's template's text (``text`` is its rendering of ``messages``) before each content and
        after the last, and the contents as it writes them: rendered again with a placeholder for each
        content, the contents spliced back in between must give ``text``."""
        assert self.template is not None
        marked = self.template.render([(role, _MARK.format(i)) for i, (role, _) in enumerate(messages)])
        parts = _MARKS.split(marked)  # framing, index, framing, index, …, framing
        framing, said = parts[0::2], [int(i) for i in parts[1::2]]
        for shape in (lambda content: content, str.strip):  # Llama 3's template trims every content
            contents = [shape(messages[i][1]) for i in said]
            if "".join(f + c for f, c in zip(framing, [*contents, ""], strict=True)) == text:
                return framing, contents
        raise InvalidRequest(
            f"A message names one of model {self.model_id}'s special tokens, and its chat template "
            "changes message contents, so it cannot be sent as text. Remove the special token text.",
            param="messages",
        )

    def _names_a_special(self, content: str) -> bool:
        normalizer = self.tokenizer.normalizer
        seen = normalizer.normalize_str(content) if normalizer is not None else content
        return any(special in content or special in seen for special in self.specials)

    def _check_length(self, text: str, param: str) -> None:
        context = self.manifest.max_context
        most = context * MAX_CHARS_PER_TOKEN
        if len(text) > most:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {context} tokens, and an input of "
                f"{len(text):,} characters is longer than any that fits it (at most {most:,} characters "
                f"for {self.model_id}). Please reduce the length of the input.",
                param=param,
            )

    def encode(self, texts: Sequence[str], param: str) -> list[list[int]]:
        """Each text's token ids; :class:`ContextLengthExceeded` at once for a text longer than any that
        fits the context could be (:data:`MAX_CHARS_PER_TOKEN`), without tokenising it."""
        for text in texts:
            self._check_length(text, param)
        return [list(enc.ids) for enc in self.tokenizer.encode_batch(list(texts), add_special_tokens=True)]

    def check_ids(self, ids: Sequence[int], param: str) -> None:
        vocab = self.vocab_size
        for token in ids:
            if not 0 <= token < vocab:
                raise InvalidRequest(
                    f"Token id {token} is out of range for model {self.model_id} (vocabulary of {vocab}).",
                    param=param,
                    code="invalid_token_id",
                )

    def check_context(self, tokens: int, param: str, *, reserve: int = 0) -> None:
        """Raise :class:`ContextLengthExceeded` unless ``tokens`` + ``reserve`` fit the context."""
        limit = self.manifest.max_context
        if tokens + reserve > limit:
            raise ContextLengthExceeded(
                f"This model's maximum context length is {limit} tokens. However, your input resulted in "
                f"{tokens} tokens{' (plus at least one to generate)' if reserve else ''}. "
                "Please reduce the length of the input.",
                param=param,
            )


class ModelCatalogue:
    def __init__(self, models: Iterable[ServedModel], root: Path | None = None) -> None:
        self._models = {model.model_id: model for model in models}
        self._root = root
        """Where other versions of a model live (``<root>/<model id>/<version>/``); None: none."""
        self._versions: dict[tuple[str, str], ServedModel] = {}
        self._lock = threading.Lock()  # the control listener preloads while the loop reads

    @classmethod
    def load(cls, dirs: Mapping[str, Path]) -> ModelCatalogue:
        """Load every ``model id -> directory``; any failure raises :class:`CatalogueError`."""
        return cls(ServedModel.load(model_id, Path(path)) for model_id, path in dirs.items())

    @classmethod
    def from_cache(
        cls, cache_dir: str | Path, model_ids: Iterable[str], model_paths: Iterable[str] = ()
    ) -> ModelCatalogue:
        """The platform's models (``PlatformSettings.models`` under ``cache_dir``) plus ``id=/path`` extras."""
        dirs = {model_id: current_model_dir(cache_dir, model_id) for model_id in model_ids}
        for entry in model_paths:
            try:
                model_id, path, _task = model_path_entry(entry)
            except ValueError as exc:
                raise CatalogueError(str(exc)) from None
            dirs[model_id] = Path(path).expanduser()
        loaded = [ServedModel.load(model_id, Path(path)) for model_id, path in dirs.items()]
        return cls(loaded, models_root(cache_dir))

    def version(self, model_id: str, version: str) -> ServedModel:
        """``model_id`` at ``version`` (the tokenizer and manifest of that version's directory), loaded once.
        Raises :class:`CatalogueError` when the version is not on this machine."""
        base = self.get(model_id)
        if version == base.manifest.version:
            return base
        with self._lock:
            found = self._versions.get((model_id, version))
        if found is not None:
            return found
        if self._root is None:
            raise CatalogueError(f"model {model_id}: version {version} is not available on this edge")
        loaded = ServedModel.load(model_id, self._root / model_id / version)
        with self._lock:
            self._versions[(model_id, version)] = loaded
        return loaded

    def preload(self, model_id: str, versions: Iterable[str]) -> None:
        """Load the versions a deployment names before requests are routed to them (control thread)."""
        for version in versions:
            try:
                self.version(model_id, version)
            except (CatalogueError, ModelNotFound) as exc:
                log.warning("deployment of %s names a version this edge cannot load: %s", model_id, exc)

    def get(self, model_id: str) -> ServedModel:
        model = self._models.get(model_id)
        if model is None:
            raise ModelNotFound(
                f"The model '{model_id}' does not exist or you do not have access to it.", param="model"
            )
        return model

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)
