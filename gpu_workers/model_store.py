"""Content-addressed model directories: ``<root>/<model id>/<version>/`` plus a ``current`` symlink.

``version`` is the first 12 hex digits of a sha256 over the directory's files; publishing is serialised
per model id by an flock and the ``current`` link is swapped atomically.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

from gpu_workers import GpuWorkerError
from infra.locks import exclusive
from schemas.manifest import (
    MANIFEST_FILE,
    ModelManifest,
    ModelTask,
    write_manifest,
)

Progress = Callable[[str], None]
Task = ModelTask
CURRENT = "current"


class ModelError(GpuWorkerError):
    """A model cannot be prepared or loaded (unknown id, bad source, hash mismatch, wrong task)."""


class VersionFilesError(ModelError):
    """A version's files are missing or differ from its manifest; the message says what restores them."""


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


def model_lock(model_root: Path) -> AbstractContextManager[None]:
    """Serialise preparation of one model id across processes (two workers starting together)."""
    return exclusive(model_root / ".lock")


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
    own_files: bool = False,
) -> Path:
    """Hash ``staging``, write its manifest, move it to ``<model_root>/<version>`` and (``point``) point
    ``current`` at it; ``current`` is always created when the model has none.

    Where the version exists already (the same content prepared before) it is kept, unless ``own_files``
    (``staging`` holds copies) and some of its files are links or missing or changed: those are replaced by
    the copies. A version registered before ``sluice models add`` copied is links into the operator's
    directory, and registering the same files again is how its files become its own."""
    files = content_files(staging)
    version = version_of(files)
    target = model_root / version
    if target.exists():
        if own_files and _adopt(staging, target, files):
            write_manifest(staging, manifest_for(version, files))
            os.replace(staging / MANIFEST_FILE, target / MANIFEST_FILE)
        shutil.rmtree(staging)
    else:
        write_manifest(staging, manifest_for(version, files))
        _share(staging)
        os.replace(staging, target)
    if point or not (model_root / CURRENT).exists():
        point_current(model_root, version)
    return target


def _share(model_dir: Path) -> None:
    """Make ``model_dir``'s files readable by any user that serves the model: save_pretrained writes its
    weights 0600 (and mkdtemp makes a staging directory private), so an image prepared as root failed to
    load demo-gpt as its non-root user (an audit). A link (to a package's files) is left alone: its target
    is not ours to change."""
    for path in [model_dir, *model_dir.rglob("*")]:
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)


def _adopt(staging: Path, target: Path, files: dict[str, str]) -> bool:
    """Move each top-level entry of ``staging`` over the one of ``target`` that is a link, missing, or not
    what ``files`` lists; True if any was. Each file is swapped in with one rename, so a worker that loads
    the version meanwhile reads either the old entry or the copy, never a part-written file."""
    adopted = False
    for entry in sorted(staging.iterdir()):
        theirs = target / entry.name
        if entry.name == MANIFEST_FILE or (not theirs.is_symlink() and _intact(theirs, entry.name, files)):
            continue
        _share(entry)
        if entry.is_dir() or theirs.is_dir():  # rename(2) cannot put a directory over another entry
            aside = target / f".old-{os.getpid()}-{entry.name}"
            if theirs.is_symlink() or theirs.exists():
                os.replace(theirs, aside)
            os.replace(entry, theirs)
            if aside.is_symlink() or aside.is_file():
                aside.unlink()
            elif aside.exists():
                shutil.rmtree(aside)
        else:
            os.replace(entry, theirs)
        adopted = True
    return adopted


def _intact(path: Path, rel: str, files: dict[str, str]) -> bool:
    """Whether ``path`` (``rel`` in its version) holds what the manifest's ``files`` list for it."""
    if path.is_file():
        return sha256_file(path) == files.get(rel)
    if path.is_dir():
        listed = {name: digest for name, digest in files.items() if name.startswith(f"{rel}/")}
        return all(
            (path.parent / name).is_file() and sha256_file(path.parent / name) == digest
            for name, digest in listed.items()
        )
    return False
