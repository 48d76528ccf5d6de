"""Which of a worker's request records may be committed, across rebalances (invariant 3, by construction).

A worker takes records on its model thread while its consumer thread may revoke their partitions at any
moment, and a record's effect (its terminal event, or its dead letter) becomes durable on the producer's
thread later. The ledger is the one place that state lives, behind one lock:

- every revoke bumps a **generation**; a record carries the generation it was consumed in, and one consumed
  before its partition's last revoke is **stale**: its next owner runs it, so it is neither run nor
  committed here;
- a record is **started** when taken (its offset then holds its partition's commit back) and **done** once
  its effect is durable: only then can the commit pass it (:class:`~gpu_workers.offsets.OffsetTracker`);
- a record whose effect is on its way is counted **running** per (partition, generation), so a revoke
  waits for those of its partitions to settle before their offsets are committed and the partitions move
  (otherwise their next owner, reading from the last commit, would run them a second time). Keyed by the
  generation consumed in, so a run outliving its partition's loss never settles a later assignment's.

Every method takes the lock itself and does one whole step (a record done is settled in the same step, a
skipped one started and done or counted in the same step). A record between its stale check and its count
is taken inside :meth:`RecordLedger.taking`, whose block a revoke waits for: otherwise the revoke could hand
its partition over while the record still runs here, and the next owner would run it too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

from bus.consumer import TP
from gpu_workers.offsets import OffsetTracker


class RecordLedger:
    """Shared by the model thread (takes, settles, commits) and the consumer thread (revokes)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offsets = OffsetTracker()
        self._next_commit = 0.0
        self._generation = 0
        self._revoked_at: dict[TP, int] = {}
        """Per partition, the generation it was last revoked at."""
        self._running: Counter[tuple[TP, int]] = Counter()
        self._taking = False
        """The model thread is between a record's stale check and counting it running: a revoke landing
        there waits for it."""
        self._released = 0
        """The latest revoke generation whose unstarted requests the model thread has given back."""

    @property
    def generation(self) -> int:
        """What a record consumed now carries (read on the consumer thread, which alone bumps it)."""
        return self._generation

    # ---------------------------------------------------------------- the model thread

    def stale(self, tp: TP, generation: int) -> bool:
        """Consumed before ``tp`` was last revoked: its partition's next owner runs it."""
        with self._lock:
            return self._stale(tp, generation)

    @contextmanager
    def taking(self, tp: TP, generation: int, offset: int | None) -> Iterator[bool]:
        """Whether the record is stale; if not, its ``offset`` is started (None: it already was) and a
        revoke landing while the block places the record (counting it running, or not) waits for it."""
        with self._lock:
            stale = self._stale(tp, generation)
            if not stale:
                if offset is not None:
                    self._offsets.started(tp, offset)
                self._taking = True
        try:
            yield stale
        finally:
            with self._lock:
                self._taking = False

    def take_skip(self, tp: TP, generation: int, offset: int, *, letter: bool) -> bool:
        """A record with nothing to run: done at once, or, with a dead ``letter`` to send first, running
        until that letter settles (:meth:`done`). False if it is stale (nothing recorded)."""
        with self._lock:
            if self._stale(tp, generation):
                return False
            self._offsets.started(tp, offset)
            if letter:
                self._running[(tp, generation)] += 1  # a revoke waits for its letter too
            else:
                self._offsets.done(tp, offset)
            return True

    def run(self, tp: TP, generation: int) -> None:
        """A started record now waits for a terminal event (its own request's, or one it follows)."""
        with self._lock:
            self._running[(tp, generation)] += 1

    def settle(self, tp: TP, generation: int) -> None:
        """A running record's effect was refused or given back: no longer waited for, not done."""
        with self._lock:
            self._settle(tp, generation)

    def settle_if_stale(self, tp: TP, generation: int) -> bool:
        """A running record whose partition went meanwhile is settled (its next owner takes it over)."""
        with self._lock:
            stale = self._stale(tp, generation)
            if stale:
                self._settle(tp, generation)
            return stale

    def release(self, tp: TP, generation: int, offset: int) -> None:
        """A started record this worker does not run: done, unless its partition went meanwhile."""
        with self._lock:
            if not self._stale(tp, generation):
                self._offsets.done(tp, offset)

    def done(self, tp: TP, generation: int, offset: int) -> None:
        """A running record's effect is durable. The record's own offset, whatever its generation: a
        partition lost and handed back redelivers the same record, whose offset is the one pending now."""
        with self._lock:
            self._offsets.done(tp, offset)
            self._settle(tp, generation)

    def released(self, revoked: int) -> None:
        """The model thread gave back what the revoke of generation ``revoked`` asked for."""
        with self._lock:
            self._released = max(self._released, revoked)

    def due(self, now: float, every_s: float) -> dict[TP, int]:
        """The offsets to commit now, marked committed: at most once every ``every_s`` (a revoke commits
        its partitions at once)."""
        with self._lock:
            if now < self._next_commit:
                return {}
            offsets = self._offsets.committable()
            self._offsets.mark_committed(offsets)
            if offsets:
                self._next_commit = now + every_s
            return offsets

    def commit_now(self) -> None:
        """The next :meth:`due` commits whatever it may, however soon after the last (a stopping worker's
        last commit)."""
        with self._lock:
            self._next_commit = 0.0

    def uncommit(self, offsets: Mapping[TP, int]) -> None:
        """A commit the broker refused: offered again by the next :meth:`due`."""
        with self._lock:
            self._offsets.uncommit(offsets)

    # ---------------------------------------------------------------- the consumer thread

    def revoke(self, tps: Iterable[TP]) -> int:
        """Partitions being taken away: every record of theirs consumed until now is stale. Returns the
        revoke's generation."""
        with self._lock:
            self._generation += 1
            for tp in tps:
                self._revoked_at[tp] = self._generation
            return self._generation

    def hand_over(
        self, tps: list[TP], revoked: int, *, give_up: Callable[[], bool], within_s: float
    ) -> tuple[int, dict[TP, int]]:
        """Wait (up to ``within_s``, or until ``give_up()``) for the records of ``tps`` still running here
        to settle and for the model thread to have given back what it had not started, then forget the
        partitions. Returns how many still ran and each partition's commit point, whether or not it was
        marked committed: that commit may still be queued, and would go out only after the partitions
        moved."""
        deadline = time.monotonic() + within_s
        while True:
            with self._lock:
                busy = sum(n for (tp, _), n in self._running.items() if tp in tps)
                # The model thread may be between taking a record and counting it running: once it is
                # not (or it has done this revoke's release), every record it took before is counted.
                seen = not self._taking or self._released >= revoked
                if (busy == 0 and seen) or give_up() or time.monotonic() > deadline:
                    points = self._offsets.points(tps)
                    self._offsets.revoke(tps)
                    for key in [key for key in self._running if key[0] in tps]:
                        del self._running[key]
                    return busy, points
            time.sleep(0.01)

    # ---------------------------------------------------------------- for tests and debugging

    def running(self) -> Counter[tuple[TP, int]]:
        """Records waiting for an effect, per (partition, generation consumed in): a copy."""
        with self._lock:
            return +self._running

    @property
    def partitions(self) -> list[TP]:
        """The partitions whose offsets are tracked."""
        with self._lock:
            return self._offsets.partitions

    # ---------------------------------------------------------------- lock held

    def _stale(self, tp: TP, generation: int) -> bool:
        return self._revoked_at.get(tp, -1) > generation

    def _settle(self, tp: TP, generation: int) -> None:
        key = (tp, generation)
        if self._running.get(key, 0) > 0:
            self._running[key] -= 1
