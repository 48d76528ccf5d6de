"""The model manifest: what the edge and the workers agree on about a served model directory.

A model directory is a normal Hugging Face ``save_pretrained`` folder plus ``sluice-manifest.json``. The
edge reads the manifest (and ``tokenizer.json`` with the ``tokenizers`` library) to validate, tokenise and
clamp; the worker reads it to load the weights and check their hashes. Nothing here does I/O beyond
reading the manifest file (and, for an embedding model, sentence-transformers' config beside it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import msgspec

MANIFEST_FILE = "sluice-manifest.json"
MAX_CHARS_PER_TOKEN = 32
"""The most characters of text taken per token a model could read, cut or refused before it is tokenised:
~8x what ordinary text takes (about 4; CJK 1), past what code, digits, base64 or runs of spaces take.
Tokenising costs at least linear time in the text (more in a long word), so a text is never tokenised
whole when only its first tokens can count: the edge refuses an input longer than its model's context
allows (7 MB of one letter held it 17 s, an audit, 2026-12-01), and the drift embedder cuts a prompt to
what its 128 tokens need (a prompt is bounded by nothing smaller than its 8 MiB record: ~1 s of the model
thread per MB, a review, 2026-12-03)."""

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]

ModelTask = Literal["generation", "embedding"]
MODEL_TASKS: dict[str, ModelTask] = {"generation": "generation", "embedding": "embedding"}
"""A task by its name, as an operator writes it (``--task``, ``SLUICE_MODEL_PATHS``' ``id:task=/path``)."""

Pooling = Literal["mean", "cls", "lasttoken"]
"""The poolings the embedding engine implements (:attr:`ModelManifest.pooling`)."""


class SamplingDefaults(msgspec.Struct, frozen=True, kw_only=True):
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, msgspec.Meta(ge=0)] = 0
    max_tokens: PositiveInt | None = 64
    """A request's ``max_tokens`` when it names none. ``None``: the room its prompt leaves in the context, at
    most ``max_output_tokens`` (OpenAI and vLLM generate until an end token or the context's end); a model
    linked from a Hugging Face directory has it unless its generation_config.json names ``max_new_tokens``
    (before, every answer of such a model stopped at demo-gpt's 64: a review, 2026-12-03)."""


class ChatFormat(msgspec.Struct, frozen=True, kw_only=True):
    """A plain-text chat template: each message becomes ``turn.format(role=…, content=…)``, then
    ``assistant_prefix`` is appended for the model to continue."""

    turn: str = "<|{role}|>\n{content}\n"
    assistant_prefix: str = "<|assistant|>\n"
    end_of_turn_ids: tuple[int, ...] | None = None
    """Tokens that end the assistant's turn in this format: the role markers that are single special
    tokens of the model's vocabulary (demo-gpt's ``<|user|>``, ``<|assistant|>``, ``<|system|>``). A chat
    answer stops at any of them, as at an end-of-sequence token: the model went on into a turn of its own
    making (a review, 2026-12-03: 4 of 60 sampled demo-gpt answers did, and the client read a made-up user
    question as the assistant's reply). A completion of raw text does not stop at them. ``None`` in a
    manifest written before this field: the worker derives them from the tokenizer when it loads."""
    template: str | None = None
    """The model's own Jinja chat template (its ``chat_template.jinja`` or tokenizer_config.json's
    ``chat_template``, read when it was prepared): when set, the edge renders chats with it as
    transformers' ``apply_chat_template`` does (:mod:`ingest.chat_template`) and ``turn`` and
    ``assistant_prefix`` are unused. ``None``: the plain-text format above (demo-gpt, a model without a
    template, and every manifest written before this field)."""
    template_tokens: dict[str, str] = {}
    """The named special tokens the template is rendered with (``bos_token``, ``eos_token``, …)."""


class ModelManifest(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    task: ModelTask
    version: str
    """Content hash of weights + tokenizer (first 12 hex digits); part of every event as model_version."""
    max_context: PositiveInt
    """Prompt + completion tokens the model can attend to (an embedding model: the longest input it embeds,
    :func:`embedding_context`)."""
    max_output_tokens: PositiveInt = 256
    embedding_dim: int | None = None
    pooling: Pooling = "mean"
    """How an embedding model's token vectors become its vector, as its sentence-transformers pipeline
    (``modules.json``, ``1_Pooling/config.json``) says: the mean over real tokens, the first token's
    (``cls``: the BGE family) or the last real token's (``lasttoken``: e5-mistral, Qwen3-Embedding). Every
    model was mean-pooled before 2026-12-03 (a review: a CLS-pooled model's vectors had cosine 0.57 with
    its own); a manifest written before then, MiniLM's and demo-gpt's say ``mean``."""
    eos_token_id: int | None = None
    """config.json's end-of-sequence token (the first of a list): what manifests recorded before
    ``eos_token_ids``, kept for readers that know only it."""
    eos_token_ids: tuple[int, ...] | None = None
    """Every token that ends a sequence: config.json's and generation_config.json's ``eos_token_id``
    (each an int or a list), as transformers' ``generate`` stops at them. A model whose config.json names
    a list (Llama 3.1 Instruct's ``[128001, 128008, 128009]``), or whose generation_config.json names more
    (Llama 3 Instruct's ``<|eot_id|>``), stopped at none of them or not at all of them, and every answer
    ran on to ``max_tokens`` (a review, 2026-12-03). ``None`` in a manifest written before this field:
    :attr:`end_token_ids` falls back on ``eos_token_id``, and the worker reads the model's configs when it
    loads."""
    files: dict[str, str] = {}
    """file name -> sha256 of every weight and tokenizer file, checked when the worker loads."""
    sampling: SamplingDefaults = SamplingDefaults()
    chat: ChatFormat = ChatFormat()
    description: str = ""

    @property
    def end_token_ids(self) -> frozenset[int]:
        """The tokens that end any sequence of this model (the single ``eos_token_id`` of an older
        manifest)."""
        if self.eos_token_ids is not None:
            return frozenset(self.eos_token_ids)
        return frozenset() if self.eos_token_id is None else frozenset({self.eos_token_id})

    @property
    def chat_end_token_ids(self) -> frozenset[int]:
        """The tokens that end a chat answer: those that end any sequence, and the chat format's end of
        turn."""
        return self.end_token_ids | frozenset(self.chat.end_of_turn_ids or ())


SENTENCE_TRANSFORMERS_CONFIG = "sentence_bert_config.json"


class _SentenceTransformersConfig(msgspec.Struct):
    max_seq_length: PositiveInt | None = None


def embedding_context(model_dir: Path, context: int) -> int:
    """``context``, or less where sentence-transformers' config in ``model_dir`` names a shorter
    ``max_seq_length``: the reference implementation of such a model cuts its inputs there, so a longer
    one is refused rather than embedded on positions the model was not tuned on. all-MiniLM-L6-v2 was
    served with 512 tokens (its ``max_position_embeddings``) where it embeds 256: an input of 257-512
    tokens came back unlike the model's vector (cosine 0.963 at 302 tokens, a review, 2026-12-03). A
    config that cannot be read changes nothing."""
    try:
        config = msgspec.json.decode(
            (Path(model_dir) / SENTENCE_TRANSFORMERS_CONFIG).read_bytes(), type=_SentenceTransformersConfig
        )
    except (OSError, msgspec.DecodeError):
        return context
    return min(context, config.max_seq_length or context)


def read_manifest(model_dir: Path) -> ModelManifest:
    """The manifest of ``model_dir``; an embedding model's ``max_context`` at most what
    :func:`embedding_context` allows (a manifest written before 2026-12-03 said 512 for MiniLM, and a
    prepared version is kept as it is, so edges and workers take the smaller when they read it)."""
    path = Path(model_dir) / MANIFEST_FILE
    try:
        manifest = msgspec.json.decode(path.read_bytes(), type=ModelManifest)
    except FileNotFoundError:
        raise ManifestError(
            f"{model_dir} has no {MANIFEST_FILE}; is it a sluicegate model directory?"
        ) from None
    except msgspec.ValidationError as exc:
        raise ManifestError(f"{path}: {exc}") from None
    if manifest.task == "embedding":
        context = embedding_context(model_dir, manifest.max_context)
        if context < manifest.max_context:
            manifest = msgspec.structs.replace(manifest, max_context=context)
    return manifest


def write_manifest(model_dir: Path, manifest: ModelManifest) -> Path:
    path = Path(model_dir) / MANIFEST_FILE
    path.write_bytes(msgspec.json.format(msgspec.json.encode(manifest), indent=2) + b"\n")
    return path


class ManifestError(ValueError):
    """A model directory's manifest is missing or invalid."""


def models_root(cache_dir: str | Path) -> Path:
    """Prepared model directories live under here: ``<root>/<model id>/<version>/`` + ``current`` link."""
    return Path(cache_dir).expanduser() / "models"


def version_dir(cache_dir: str | Path, model_id: str, version: str) -> Path:
    """The registered directory of ``version`` of ``model_id``. A rollout of ``""``, ``current``, ``v2/`` or
    ``../m/v2`` was published (an audit): a path that exists is not a version, and a worker of it could never
    announce that version, so the rollout waited out its ready timeout."""
    if not version or version in (".", "..", "current") or "/" in version or "\\" in version:
        raise ManifestError(f"{version!r} is not a version name (`sluice models list` shows {model_id}'s)")
    directory = models_root(cache_dir) / model_id / version
    if not directory.is_dir():
        raise ManifestError(f"{model_id} has no version {version}: register it with `sluice models add`")
    found = read_manifest(directory).version
    if found != version:
        raise ManifestError(f"{directory} holds version {found}, not {version}")
    return directory


def current_model_dir(cache_dir: str | Path, model_id: str) -> Path:
    """The prepared directory in use for ``model_id`` (a symlink to its content-addressed version)."""
    return models_root(cache_dir) / model_id / "current"
