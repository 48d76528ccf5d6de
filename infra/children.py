"""What every child process a supervisor starts shares: it dies with the process that started it."""

from __future__ import annotations

import ctypes
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before it runs (``preexec_fn``): on Linux it gets SIGTERM when the thread that started it
    dies, however that dies (a ``kill -9`` or a crash too), so no worker, streams process or Kafka JVM is
    left behind holding ports, the warehouse lock and a consumer group's partitions. Start such children
    from a thread that lives as long as the supervisor (the main thread, or an executor's). Elsewhere than
    Linux nothing happens."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
