"""An exclusive lock on a file, held across processes, around a step that two starters must not run at
once (launching a Kafka node on its data dir, fetching the Kafka jars into the shared cache)."""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["exclusive"]


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder if missing) for the ``with`` block,
    waiting for any other holder. The lock goes with the open file, so a holder that is killed never
    leaves it taken, and two threads of one process exclude each other too. The file is not inherited by
    the children started meanwhile (Python's files are close-on-exec), so a JVM launched under the lock
    does not keep it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
