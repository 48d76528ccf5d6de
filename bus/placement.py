"""Which cores a process's threads run on: a worker's model thread on cores of its own, everything else on
the others (Linux; elsewhere nothing is pinned).

Measured on 2 shared cores (docs/perf/README.md, findings): unpinned, the worker's model thread
waited on the run queue 10 % (generation) to 20 % (embeddings) of the time, preempted ~700 times a second
by the edge, the broker and the clients while the other core sat partly idle. Pinning the whole worker
to one core and everything else to the other raised embeddings/s by ~15 % and generation tokens/s by
~13 %; moving librdkafka's native threads (``rdk:*``, which never take the GIL) off the model's core as
well made generation ~+22 %. Pinning ONLY the model thread and leaving the worker's other Python threads
on the busy core stalled the pipeline (60 embeddings/s instead of 300): a thread preempted there while it
holds the GIL stops the model thread too. So a worker's Python threads share its model's cores, and its
Kafka clients' native threads run on the rest (:func:`native_threads`). vllm-ascend's CPU binding
(on by default) does the same for its workers' key threads, to cut preemption on busy hosts.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator
from pathlib import Path

from schemas.settings import SettingsError

log = logging.getLogger(__name__)

_native: frozenset[int] | None = None
"""Cores the Kafka clients' native threads get (:func:`place_native_threads`); None: wherever their
creator runs."""


class PlacementError(SettingsError):
    """A core list that cannot be parsed or used here."""


def parse_cpus(text: str) -> frozenset[int]:
    """``"1"``, ``"0-3,6"`` (``taskset -c`` syntax) to a set of core numbers."""
    cores: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, dash, high = part.partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise PlacementError(f"{text!r} is not a core list like '1' or '0-3,6'") from None
        if first < 0 or last < first:
            raise PlacementError(f"{part!r} in {text!r} is not a core range")
        cores.update(range(first, last + 1))
    if not cores:
        raise PlacementError(f"{text!r} names no cores")
    return frozenset(cores)


def format_cpus(cores: Collection[int]) -> str:
    """The inverse of :func:`parse_cpus`, with ranges folded: ``{0, 1, 2, 6}`` -> ``"0-2,6"``."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and runs[-1][1] == core - 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split_box(available: Collection[int]) -> tuple[frozenset[int], frozenset[int]] | None:
    """A box shared by workers and everything else: ``(model cores, other cores)``, the workers taking the
    upper half (at least one core), or None with fewer than two cores (nothing to split)."""
    cores = sorted(available)
    if len(cores) < 2:
        return None
    half = len(cores) // 2
    return frozenset(cores[-half:]), frozenset(cores[:-half])


def available_cpus() -> frozenset[int]:
    """The cores this thread may run on."""
    return frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()


def pin_process(cores: Collection[int]) -> None:
    """Every thread of this process (and every thread or child it starts later) onto ``cores``."""
    if not hasattr(os, "sched_setaffinity"):
        return
    allowed = available_cpus()
    try:
        os.sched_setaffinity(0, cores)  # this thread first: a failure names the cores
    except OSError as exc:
        raise PlacementError(
            f"cannot run on cores {format_cpus(cores)} (this process has {format_cpus(allowed)}): "
            f"{exc.strerror}"
        ) from None
    for task in thread_ids():
        with contextlib.suppress(OSError):  # a thread that just ended
            os.sched_setaffinity(task, cores)


def place_box(choice: str, workers: str = "") -> tuple[str, dict[str, str]]:
    """Split a shared box (``sluice up``, the benchmarks): this process and whatever it starts from now on
    (Kafka, the edge, the streams worker) onto the cores the workers do not get. ``choice``: ``auto`` (the
    upper half of the cores, :func:`split_box`), ``off`` or a core list; ``workers``, when set
    (``SLUICE_WORKER_CPUS``), names the workers' cores instead. Returns a line that says what went where
    and the workers' extra environment."""
    available = available_cpus()
    if choice == "off" or not available:
        return "", {}
    if workers:
        cores = parse_cpus(workers)
    elif choice == "auto":
        split = split_box(available)
        if split is None:
            return "", {}
        cores = split[0]
    else:
        cores = parse_cpus(choice)
    if cores - available:
        raise PlacementError(
            f"cannot give the workers cores {format_cpus(cores - available)}: this process has "
            f"{format_cpus(available)}"
        )
    rest = available - cores
    if rest:
        pin_process(rest)
    line = f"cores: workers {format_cpus(cores)}; the rest {format_cpus(rest) if rest else 'the same'}"
    return line, {"SLUICE_WORKER_CPUS": format_cpus(cores)}


def place_native_threads(cores: Collection[int] | None) -> None:
    """Where the Kafka clients built from now on (:func:`native_threads`) run their native threads."""
    global _native
    _native = frozenset(cores) if cores else None


def native_cores() -> frozenset[int] | None:
    """The cores set by :func:`place_native_threads` (a placed worker's: those it was started with beyond
    its own), or None."""
    return _native


@contextlib.contextmanager
def on_cores(cores: Collection[int] | None) -> Iterator[None]:
    """This thread on ``cores`` inside, back on its own after (None, or no affinity here: it stays where it
    is). A thread started inside inherits ``cores``: that is how threads another library starts are
    placed (librdkafka's, OpenMP's)."""
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield
        return
    own = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, own)


@contextlib.contextmanager
def threads_started_on(cores: Collection[int] | None) -> Iterator[set[int]]:
    """:func:`on_cores`, and the set it yields holds, on the way out, the threads started inside that are
    still on ``cores`` (a library's threads placed there; empty when nothing moved)."""
    started: set[int] = set()
    if cores is None or not hasattr(os, "sched_setaffinity"):
        yield started
        return
    before = thread_ids()
    with on_cores(cores):
        yield started
    for tid in thread_ids() - before:
        with contextlib.suppress(OSError):  # a thread that already ended
            if os.sched_getaffinity(tid) == set(cores):
                started.add(tid)


@contextlib.contextmanager
def native_threads() -> Iterator[None]:
    """Build a Kafka client inside: librdkafka's threads inherit the affinity and the scheduling policy of
    the thread that creates the client (and those it creates later, from its own), so this thread moves to
    the native-thread cores and to ``SCHED_BATCH`` (:func:`batch_policy`) for the construction, and back."""
    with on_cores(_native), batch_policy():
        yield


@contextlib.contextmanager
def batch_policy() -> Iterator[None]:
    """This thread under ``SCHED_BATCH`` inside, and the threads it starts there for good (Linux; elsewhere
    nothing changes). A thread woken under it does not preempt the one running on its core; it runs at
    that thread's next block or tick, with its fair share of the core as before.

    For librdkafka's threads: every ``produce`` wakes the client's broker thread, which took the core from
    the caller on the spot. At 64 clients the edge's event loop spent ~0.33 ms of wall (12 us of CPU) in
    each ``produce`` call, and its records went out one produce request each. Under ``SCHED_BATCH`` the
    call took 0.14-0.21 ms and records queued meanwhile go out together: at 64 clients (``cpu_profile.py``,
    alternating) the broker's CPU a request fell from 0.48-0.50 to 0.31-0.38 ms and the edge's from
    0.59-0.69 to 0.51-0.57 ms for embeddings (3 pairs), from 0.73-0.84 to 0.50-0.64 and 0.69-0.88 to
    0.55-0.72 ms for generation (3 pairs), throughput inside the noise (the worker's core is the limit
    there); one client's embedding did not move (4 pairs, p50 10.5 against 11.0 ms). docs/perf/."""
    if not _to_batch():
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def _to_batch() -> bool:
    """Put this thread under ``SCHED_BATCH`` if it is under the default policy; whether it was."""
    if not hasattr(os, "SCHED_BATCH"):
        return False
    try:
        if os.sched_getscheduler(0) != os.SCHED_OTHER:  # real-time or idle: the caller's choice stands
            return False
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    except OSError as exc:  # a sandbox that refuses policies: the threads start under the caller's
        log.debug("scheduling policy unchanged: %s", exc)
        return False
    return True


def name_thread(tid: int, name: str) -> None:
    """Name this process's thread ``tid`` for the OS (what ``top -H`` and ``/proc/<pid>/task/<tid>/comm``
    show; up to 15 characters). Linux; elsewhere, or for a thread that ended, nothing happens."""
    with contextlib.suppress(OSError):
        Path(f"/proc/self/task/{tid}/comm").write_text(name)


def idle_thread(cores: Collection[int] | None) -> bool:
    """This thread onto ``cores`` (None: where it is) for good, under ``SCHED_IDLE``: it runs only where no
    other thread wants a core, and any thread woken there takes the core from it. A thread may always lower
    its own priority; whether the OS has the policy and gave it."""
    if cores is not None and hasattr(os, "sched_setaffinity"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)
    if not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError:
        return False
    return True


def thread_ids() -> set[int]:
    """This process's threads (Linux)."""
    return {int(task) for task in os.listdir("/proc/self/task")}


__all__ = [
    "PlacementError",
    "available_cpus",
    "batch_policy",
    "format_cpus",
    "idle_thread",
    "name_thread",
    "native_cores",
    "native_threads",
    "on_cores",
    "parse_cpus",
    "pin_process",
    "place_box",
    "place_native_threads",
    "split_box",
    "thread_ids",
    "threads_started_on",
]
