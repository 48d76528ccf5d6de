"""What every child process a supervisor starts shares: it dies with the process that started it."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with"]

_PR_SET_PDEATHSIG = 1


def die_with(parent: int) -> Callable[[], None]:
    """The ``preexec_fn`` of a child of ``parent`` (the starter's pid, ``os.getpid()`` taken before the
    fork): on Linux the child gets SIGTERM when the thread that started it dies, however that dies (a
    ``kill -9`` or a crash too), so no worker, streams process or Kafka JVM is left behind holding ports,
    the warehouse lock and a consumer group's partitions. Start such children from a thread that lives as
    long as the supervisor (the main thread, or an executor's). Elsewhere than Linux nothing happens.

    A parent that died between the fork and the ``prctl`` sends no signal any more: the child, already
    reparented, sees another parent pid and exits at once, before it runs (a review: one started while
    ``sluice up`` was killed outlived it for good, an orphan holding what it held)."""

    def preexec() -> None:
        if not sys.platform.startswith("linux"):
            return
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:
            os._exit(1)

    return preexec
