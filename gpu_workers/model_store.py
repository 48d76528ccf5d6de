"""Content-addressed model directories: ``<root>/<model id>/<version>/`` plus a ``current`` symlink.

``version`` is the first 12 hex digits of a sha256 over the directory's files; publishing is serialised
per model id by an flock and the ``current`` link is swapped atomically.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from gpu_workers import GpuWorkerError
from schemas.manifest import (
    MANIFEST_FILE,
    ModelManifest,
    write_manifest,
)

if TYPE_CHECKING:
    pass


Progress = Callable[[str], None]
Task = Literal["generation", "embedding"]
CURRENT = "current"


class ModelError(GpuWorkerError):
    """A model cannot be prepared or loaded (unknown id, bad source, hash mismatch, wrong task)."""


# ------------------------------------------------------------------------------------- content addressing


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def content_files(model_dir: Path) -> dict[str, str]:
    """Relative posix path -> sha256 of every file (links followed) except the manifest and dotfiles."""
    files: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(model_dir, followlinks=True):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(model_dir).as_posix()
            if not name.startswith(".") and rel != MANIFEST_FILE and path.is_file():
                files[rel] = sha256_file(path)
    return dict(sorted(files.items()))


def version_of(files: dict[str, str]) -> str:
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()[:12]


@contextmanager
def model_lock(model_root: Path) -> Iterator[None]:
    """Serialise preparation of one model id across processes (two workers starting together)."""
    model_root.mkdir(parents=True, exist_ok=True)
    with (model_root / ".lock").open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def point_current(model_root: Path, version: str) -> None:
    tmp = model_root / f".current-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(version)  # relative, so the cache directory can move
    os.replace(tmp, model_root / CURRENT)


def publish(
    staging: Path,
    model_root: Path,
    manifest_for: Callable[[str, dict[str, str]], ModelManifest],
    *,
    point: bool = True,
) -> Path:
    """Hash ``staging``, write its manifest, move it to ``<model_root>/<version>`` and (``point``) point
    ``current`` at it; ``current`` is always created when the model has none."""
    files = content_files(staging)
    version = version_of(files)
    target = model_root / version
    if target.exists():  # same content prepared before: keep the existing directory untouched
        shutil.rmtree(staging)
    else:
        write_manifest(staging, manifest_for(version, files))
        staging.chmod(0o755)  # mkdtemp made it private
        for path in staging.rglob("*"):
            # readable by any user that serves the model: save_pretrained writes its weights 0600, so an
            # image prepared as root failed to load demo-gpt as its non-root user (an audit). A link (to a
            # package's files) is left alone: its target is not ours to change.
            if not path.is_symlink():
                path.chmod(0o755 if path.is_dir() else 0o644)
        os.replace(staging, target)
    if point or not (model_root / CURRENT).exists():
        point_current(model_root, version)
    return target
