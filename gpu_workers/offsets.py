"""Commit a consumed offset only after its effect is durable (invariant 3).

Records are consumed in order but finish out of order (a short generation overtakes a long one). The
tracker knows, per partition, which started offsets are not yet done; the offset to commit — Kafka's
"next offset to read" — is the lowest such offset, or one past the highest started offset when all are
done. A crash then redelivers every record whose effect may not be durable, and none whose effect is
(those redeliveries are skipped by the idempotency check). Offsets never started (gaps left by compaction
or transaction markers) do not hold the commit back.

A pure, synchronous object. The consumer calls ``started`` when it takes a record, ``done`` once the
record's terminal event is acknowledged by the broker, commits ``committable()`` and marks it with
``mark_committed`` (commits are queued to the polling thread), and ``uncommit`` with the same mapping if
the broker refuses that commit, so it is offered again. On rebalance, ``revoke`` forgets the partitions lost.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

TopicPartition = tuple[str, int]


@dataclass(slots=True)
class _Partition:
    pending: set[int] = field(default_factory=set)  # started, not done
    heap: list[int] = field(default_factory=list)  # over pending; entries no longer pending are stale
    highest: int = -1  # highest offset started
    committed: int | None = None  # last offset marked committed

    def commit_point(self) -> int | None:
        while self.heap and self.heap[0] not in self.pending:
            heapq.heappop(self.heap)
        if self.heap:
            return self.heap[0]
        return self.highest + 1 if self.highest >= 0 else None


class OffsetTracker:
    def __init__(self) -> None:
        self._partitions: dict[TopicPartition, _Partition] = {}

    def started(self, tp: TopicPartition, offset: int) -> None:
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset} for {tp}")
        part = self._partitions.get(tp)
        if part is None:
            part = self._partitions[tp] = _Partition()
        if offset in part.pending:
            return
        part.pending.add(offset)
        heapq.heappush(part.heap, offset)
        part.highest = max(part.highest, offset)

    def done(self, tp: TopicPartition, offset: int) -> bool:
        """Mark an offset's effect durable. False if it was not in flight (e.g. its partition was revoked)."""
        part = self._partitions.get(tp)
        if part is None or offset not in part.pending:
            return False
        part.pending.remove(offset)
        if len(part.heap) > 2 * len(part.pending) + 64:
            part.heap = sorted(part.pending)  # a sorted list is a valid heap
        return True

    def committable(self) -> dict[TopicPartition, int]:
        """Per partition, the offset to commit — only where it advanced past the last one marked committed."""
        out: dict[TopicPartition, int] = {}
        for tp, part in self._partitions.items():
            point = part.commit_point()
            if point is not None and (part.committed is None or point > part.committed):
                out[tp] = point
        return out

    def points(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """Each of ``tps``'s commit point, whether or not it was marked committed: a revoke commits them
        all at once (a commit marked but still queued would go out only after the partitions moved)."""
        out: dict[TopicPartition, int] = {}
        for tp in tps:
            part = self._partitions.get(tp)
            point = part.commit_point() if part is not None else None
            if point is not None:
                out[tp] = point
        return out

    def mark_committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Record a successful commit. Partitions no longer assigned are ignored; commits never go back."""
        for tp, offset in offsets.items():
            part = self._partitions.get(tp)
            if part is not None and (part.committed is None or offset > part.committed):
                part.committed = offset

    def uncommit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """A commit marked by :meth:`mark_committed` did not reach the broker: forget it where nothing
        later was marked since, so :meth:`committable` offers that partition's point again."""
        for tp, offset in offsets.items():
            part = self._partitions.get(tp)
            if part is not None and part.committed == offset:
                part.committed = None

    def revoke(self, tps: Iterable[TopicPartition]) -> None:
        """Forget partitions lost in a rebalance; late ``done`` calls for them are ignored."""
        for tp in tps:
            self._partitions.pop(tp, None)

    def in_flight(self, tp: TopicPartition | None = None) -> int:
        """Offsets started and not done: on one partition, or on all."""
        if tp is not None:
            part = self._partitions.get(tp)
            return 0 if part is None else len(part.pending)
        return sum(len(part.pending) for part in self._partitions.values())

    @property
    def partitions(self) -> list[TopicPartition]:
        return list(self._partitions)
