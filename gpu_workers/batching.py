"""Dynamic batching for embeddings: cut batches of similar length by size, token budget and wait time.

A pure, synchronous object; the worker loop passes the monotonic ``now`` in and waits
``time_until_ready(now)`` (or for new input) between calls.

Policies:

* **Length buckets.** An item goes to the first bucket whose boundary is ``>= n_tokens`` (one more bucket
  holds anything longer than the last boundary). A batch is cut from one bucket only, so it pads to a
  similar length; buckets are never mixed (padding a short input to a long one costs more compute than
  the extra forward call saves).
* **Token budget.** A batch costs ``len(batch) * max(n_tokens)`` (the padded tensor). Items are taken
  oldest first while the batch stays within ``max_batch_size`` and ``max_batch_tokens``; the first item
  is always taken, so an item over the budget on its own runs alone instead of blocking its bucket.
* **Ready.** A bucket is ready when its batch is full (``max_batch_size`` items, more items waiting than
  fit the budget, or no further item could fit) or its oldest item has waited ``max_wait_s`` since
  ``add``. Among ready buckets the one holding the request that has had the fewest of its items run goes
  first, then the one where that request's oldest item is oldest: a request that has had none run is not
  held behind the rest of a large one (before 2026-12-01 the oldest item always went first, so a one-word
  request waited 30 s behind another tenant's 100 long inputs in another bucket, an audit). Within a
  bucket, oldest first, so such a request that shares a bucket with the rest of a large one waits for
  those items, but its bucket goes first meanwhile (until 2026-12-03 a bucket was ranked by its first
  item's request only: one input behind a partly-run request waited, with it, until its deadline while
  another bucket had a request with none run ready at every batch, a review).
* **Overtaken at most ``max_overtaken`` times.** A ready bucket passed over that many batches in a row
  goes first (among several such, by the rule above), so the rest of a large request still runs under a
  steady load of small ones instead of waiting for its deadline (since 2026-12-03, the same review).
* **Deadlines.** An item is expired when ``now >= deadline``. ``next_batch`` never returns one: expired
  items are moved aside and handed out by ``take_expired`` (the worker ends them ``expired``).
* **Bounded.** ``add`` answers False when ``max_queued`` items are queued; the caller sheds the request.
  ``add_all`` queues one request's items whole while fewer than ``max_queued`` wait, so the queue holds
  at most ``max_queued - 1`` plus one request's items.
"""

from __future__ import annotations

import bisect
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

P = TypeVar("P")


@dataclass(frozen=True, slots=True, kw_only=True)
class EmbedItem(Generic[P]):
    """One input to embed. A request with several inputs may add several items with one request id."""

    request_id: str
    n_tokens: int
    arrival: float
    """Monotonic seconds the request reached the worker (for timings; the wait clock starts at ``add``)."""
    payload: P
    deadline: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class BatcherConfig:
    max_batch_size: int
    max_wait_s: float
    max_batch_tokens: int
    """Budget of padded tokens per batch: ``len(batch) * longest item``."""
    buckets: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    max_queued: int = 4096
    """Inputs waiting before requests are refused (``queue_full``). A request is queued whole while fewer
    wait, however many inputs it carries (so a large one gets in as often as a small one: refused only
    where the queue had room for all of it, a 2,048-input request starved behind a steady load of small
    ones, an audit); the most inputs one request may carry (the default: twice what an edge takes)."""

    max_overtaken: int = 4
    """Batches in a row a ready bucket may be cut from other buckets (holding a request with fewer of its
    items run, or an older one) before it goes first."""

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_batch_tokens", "max_queued"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_overtaken < 1:
            raise ValueError(f"max_overtaken must be at least 1, got {self.max_overtaken}")
        if self.max_wait_s < 0:
            raise ValueError(f"max_wait_s must be >= 0, got {self.max_wait_s}")
        if not self.buckets or any(b < 1 for b in self.buckets):
            raise ValueError(f"buckets must be positive lengths, got {self.buckets}")
        if any(a >= b for a, b in zip(self.buckets, self.buckets[1:], strict=False)):
            raise ValueError(f"buckets must be strictly increasing, got {self.buckets}")


def _check(item: EmbedItem[Any]) -> None:
    if item.n_tokens < 0:
        raise ValueError(f"n_tokens must be >= 0, got {item.n_tokens}")


@dataclass(slots=True, eq=False)
class _Entry(Generic[P]):
    seq: int
    ready_at: float  # add time + max_wait_s
    item: EmbedItem[P]


class DynamicBatcher(Generic[P]):
    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        self._buckets: list[deque[_Entry[P]]] = [deque() for _ in range(len(config.buckets) + 1)]
        self._live: dict[int, tuple[int, _Entry[P]]] = {}  # seq → (bucket index, entry)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, seq); stale entries skipped
        self._expired: list[EmbedItem[P]] = []
        self._waiting: dict[str, int] = {}
        """Items queued per request; its entry in ``_served`` goes with its last."""
        self._served: dict[str, int] = {}
        """Items of each request still waiting that ``next_batch`` has already handed out."""
        self._held: list[dict[str, int]] = [{} for _ in self._buckets]
        """Per bucket: items queued in it per request (which requests a bucket's rank looks at)."""
        self._passed = [0] * len(self._buckets)
        """Per bucket: batches in a row cut from another bucket while this one was ready."""
        self._seq = 0
        self.token_budget = config.max_batch_tokens
        """Padded tokens a batch may hold now: the configured budget, lower after an out-of-memory
        (``gpu_workers.oom``). A lone item always makes a batch, whatever its length."""

    def __len__(self) -> int:
        """Items queued for a batch (expired items awaiting ``take_expired`` not included)."""
        return len(self._live)

    def full(self) -> bool:
        """``add`` and ``add_all`` answer False."""
        return len(self._live) >= self.config.max_queued

    def bucket_of(self, n_tokens: int) -> int:
        return bisect.bisect_left(self.config.buckets, n_tokens)

    def add(self, item: EmbedItem[P], now: float) -> bool:
        _check(item)
        if self.full():
            return False
        self._put(item, now)
        return True

    def _put(self, item: EmbedItem[P], now: float) -> None:
        self._seq += 1
        index = self.bucket_of(item.n_tokens)
        entry = _Entry(self._seq, now + self.config.max_wait_s, item)
        self._buckets[index].append(entry)
        self._live[self._seq] = (index, entry)
        self._waiting[item.request_id] = self._waiting.get(item.request_id, 0) + 1
        held = self._held[index]
        held[item.request_id] = held.get(item.request_id, 0) + 1
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, self._seq))

    def add_all(self, items: Sequence[EmbedItem[P]], now: float) -> bool:
        """Queue every one of ``items`` (one request's inputs) while the queue is not full, or none of them
        (False)."""
        if self.full():
            return False
        for item in items:
            _check(item)
        for item in items:
            self._put(item, now)
        return True

    def next_batch(self, now: float) -> list[EmbedItem[P]] | None:
        """The next batch to run, or None if no bucket is ready. Never contains an expired item."""
        self._sweep(now)
        best: tuple[tuple[bool, int, float, int], int, int] | None = None  # (rank, bucket index, length)
        ready: list[int] = []
        for index, queue in enumerate(self._buckets):
            if not queue:
                self._passed[index] = 0
                continue
            fit = self._fit(queue)
            if not self._ready(queue, fit, now):
                continue
            ready.append(index)
            rank = (self._passed[index] < self.config.max_overtaken, *self._least_served(index))
            if best is None or rank < best[0]:
                best = (rank, index, fit[0])
        if best is None:
            return None
        _, index, size = best
        for other in ready:
            self._passed[other] += 1
        self._passed[index] = 0
        queue = self._buckets[index]
        batch: list[EmbedItem[P]] = []
        for _ in range(size):
            entry = queue.popleft()
            del self._live[entry.seq]
            batch.append(entry.item)
            rid = entry.item.request_id
            self._unhold(index, rid)
            self._gone(rid)
            if rid in self._waiting:
                self._served[rid] = self._served.get(rid, 0) + 1
        self._compact_deadlines()
        return batch

    def _least_served(self, index: int) -> tuple[int, float, int]:
        """(items run, ready_at, seq) of the oldest item in bucket ``index`` of the request in it that has
        had the fewest of its items run: the bucket's place among the ready ones."""
        least = min(self._served.get(rid, 0) for rid in self._held[index])
        for entry in self._buckets[index]:
            if self._served.get(entry.item.request_id, 0) == least:
                return least, entry.ready_at, entry.seq
        raise AssertionError("a bucket's held requests are the requests of its items")

    def _unhold(self, index: int, request_id: str) -> None:
        held = self._held[index]
        left = held[request_id] - 1
        if left > 0:
            held[request_id] = left
        else:
            del held[request_id]

    def _gone(self, request_id: str) -> None:
        """One item of ``request_id`` left the queue; its counts go with its last."""
        left = self._waiting.get(request_id, 0) - 1
        if left > 0:
            self._waiting[request_id] = left
        else:
            self._waiting.pop(request_id, None)
            self._served.pop(request_id, None)

    def take_expired(self, now: float) -> list[EmbedItem[P]]:
        """Remove and return every queued item past its deadline (and any ``next_batch`` set aside)."""
        self._sweep(now)
        expired, self._expired = self._expired, []
        return expired

    def time_until_ready(self, now: float) -> float | None:
        """Seconds until ``next_batch`` or ``take_expired`` may have work: 0.0 if now, None if empty."""
        if self._expired:
            return 0.0
        soonest: float | None = None
        for queue in self._buckets:
            if not queue:
                continue
            if self._ready(queue, self._fit(queue), now):
                return 0.0
            at = queue[0].ready_at
            soonest = at if soonest is None else min(soonest, at)
        while self._deadlines and self._deadlines[0][1] not in self._live:
            heapq.heappop(self._deadlines)
        if self._deadlines:
            at = self._deadlines[0][0]
            soonest = at if soonest is None else min(soonest, at)
        return None if soonest is None else max(0.0, soonest - now)

    def cancel(self, request_id: str) -> list[EmbedItem[P]]:
        """Remove and return every queued item of ``request_id`` (empty if none)."""
        hits = [seq for seq, (_, entry) in self._live.items() if entry.item.request_id == request_id]
        removed = [self._remove(seq) for seq in hits]
        removed.extend(item for item in self._expired if item.request_id == request_id)
        self._expired = [item for item in self._expired if item.request_id != request_id]
        if removed:
            self._compact_deadlines()
        return removed

    def drain(self) -> list[EmbedItem[P]]:
        """Remove and return everything queued or set aside (shutdown: each needs its terminal event)."""
        items = self._expired + [entry.item for queue in self._buckets for entry in queue]
        for queue in self._buckets:
            queue.clear()
        self._live.clear()
        self._deadlines.clear()
        self._expired = []
        self._waiting.clear()
        self._served.clear()
        for held in self._held:
            held.clear()
        self._passed = [0] * len(self._buckets)
        return items

    def _fit(self, queue: deque[_Entry[P]]) -> tuple[int, int]:
        """How many items from the front of ``queue`` make one batch, and the longest of them."""
        count, longest = 0, 0
        for entry in queue:
            if count == self.config.max_batch_size:
                break
            widest = max(longest, entry.item.n_tokens)
            if count and (count + 1) * widest > self.token_budget:
                break
            count, longest = count + 1, widest
        return count, longest

    def _ready(self, queue: deque[_Entry[P]], fit: tuple[int, int], now: float) -> bool:
        size, longest = fit
        full = (
            size == self.config.max_batch_size
            or size < len(queue)  # the next waiting item does not fit the budget
            or (size + 1) * longest > self.token_budget  # no item could join
        )
        return full or now >= queue[0].ready_at

    def _sweep(self, now: float) -> None:
        while self._deadlines and now >= self._deadlines[0][0]:
            _, seq = heapq.heappop(self._deadlines)
            if seq in self._live:
                self._expired.append(self._remove(seq))

    def _remove(self, seq: int) -> EmbedItem[P]:
        index, entry = self._live.pop(seq)
        self._buckets[index].remove(entry)
        self._unhold(index, entry.item.request_id)
        self._gone(entry.item.request_id)
        return entry.item

    def _compact_deadlines(self) -> None:
        if len(self._deadlines) > 2 * len(self._live) + 64:
            self._deadlines = [
                (entry.item.deadline, seq)
                for seq, (_, entry) in self._live.items()
                if entry.item.deadline is not None
            ]
            heapq.heapify(self._deadlines)
