"""An exclusive lock on a file, held across processes, around a step that two starters must not run at
once (launching a Kafka node on its data dir, fetching the Kafka jars into the shared cache), or for as
long as a process uses something no other may (``sluice up``'s data dir)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

__all__ = ["LockHeld", "exclusive", "hold"]


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


class LockHeld(Exception):
    """Another process holds the lock (its pid, as it wrote it, or None when unreadable)."""

    def __init__(self, path: Path, pid: int | None) -> None:
        super().__init__(f"{path} is held by process {pid if pid is not None else '(unknown)'}")
        self.path = path
        self.pid = pid


def hold(path: Path) -> IO[str]:
    """Take an exclusive ``flock`` on ``path`` (created with its folder if missing) without waiting, and
    write this process's pid into it; the lock lasts until the returned file is closed, or the process
    ends however it ends. :class:`LockHeld` naming the holder's pid if another process has it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        text = handle.read().strip()
        handle.close()
        raise LockHeld(path, int(text) if text.isdigit() else None) from None
    except BaseException:
        handle.close()
        raise
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
