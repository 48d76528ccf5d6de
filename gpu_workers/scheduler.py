"""Admission for continuous batching: which waiting generations join the running batch, and when.

A pure, synchronous object. The worker's step loop owns it (TGI's queue-as-actor), passes the monotonic
``now`` in, and turns its answers into events: ``Decision.expire`` → ``expired`` terminal events (never
run), a rejected submit → ``failed``, ``expired_running`` → stop those sequences within this decode step.

Policies:

* **Token budget.** A running sequence holds ``prompt_len + max_new_tokens`` tokens of budget (the KV it
  may need) from admission until ``finish``/``cancel``. A request whose cost alone exceeds
  ``max_batch_tokens`` is rejected at submit (``too_large``): it could never run.
* **Order.** Waiting requests are admitted by ``priority`` — *lower value first*, as in vLLM, so the
  default 0 outranks background work submitted with a positive priority — then FIFO. Strict priority
  can delay low-priority work indefinitely under sustained high-priority load; deadlines bound that.
* **Head of line.** When the first request in order does not fit the free budget, later requests that do
  fit may *overtake* it (backfill), but at most ``max_overtakes`` times. After that the scheduler admits
  nothing else until the blocked request fits, which it will once running sequences finish (its cost is at
  most the whole budget). So big requests cannot block small ones forever, and small ones cannot starve a
  big one forever. ``max_overtakes=0`` is strict FIFO within a priority.
* **Deadlines.** An item is expired when ``now >= deadline``. Expired waiting items are removed and
  returned in ``Decision.expire`` before admission, so they are never admitted.
* **Duplicates.** A request id already waiting or running is answered ``"duplicate"`` and ignored; the
  caller must *not* emit a terminal event for it (the original is still in flight).
"""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

P = TypeVar("P")

Submitted = Literal["queued", "duplicate", "rejected"]
RejectCode = Literal["duplicate", "invalid", "too_large", "queue_full"]
Cancelled = Literal["waiting", "running", "unknown"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Pending(Generic[P]):
    """A generation waiting for (or holding) a slot in the running batch."""

    request_id: str
    prompt_len: int
    max_new_tokens: int
    arrival: float
    payload: P
    deadline: float | None = None
    """Monotonic seconds; expired when ``now >= deadline``."""
    priority: int = 0
    """Lower value is admitted first."""

    @property
    def cost(self) -> int:
        """Tokens of budget held while running: the KV cache it may need."""
        return self.prompt_len + self.max_new_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    max_running: int
    """Sequences in the running batch at most."""
    max_batch_tokens: int
    """Budget: sum of ``prompt_len + max_new_tokens`` over running sequences at most."""
    max_waiting: int
    """Bound of the waiting queue; a submit beyond it is rejected (``queue_full``)."""
    max_overtakes: int = 16
    """How often later requests may be admitted past a blocked head before it reserves the budget."""

    def __post_init__(self) -> None:
        for name in ("max_running", "max_batch_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_overtakes < 0:
            raise ValueError(f"max_overtakes must be at least 0, got {self.max_overtakes}")


@dataclass(frozen=True, slots=True)
class Rejection:
    code: RejectCode
    message: str


@dataclass(frozen=True, slots=True)
class Decision(Generic[P]):
    admit: list[Pending[P]] = field(default_factory=list)
    """Now running, in admission order: start their prefill."""
    expire: list[Pending[P]] = field(default_factory=list)
    """Removed from the waiting queue, past their deadline: end them ``expired`` without running."""


_Key = tuple[int, int, str]  # (priority, arrival sequence, request id): the admission order


class GenerationScheduler(Generic[P]):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._order: list[_Key] = []  # waiting, sorted by admission order
        self._waiting: dict[str, tuple[_Key, Pending[P]]] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap over waiting; stale entries skipped
        self._running: dict[str, Pending[P]] = {}
        self._budget_in_use = 0
        self._overtaken: dict[str, int] = {}  # request id of a blocked waiting item → times overtaken
        self._seq = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def budget_in_use(self) -> int:
        return self._budget_in_use

    @property
    def running_ids(self) -> list[str]:
        return list(self._running)

    def check(self, item: Pending[P]) -> Rejection | None:
        """Why ``submit`` would not queue ``item`` (None: it would). Does not change state."""
        if item.request_id in self._waiting or item.request_id in self._running:
            return Rejection("duplicate", f"request {item.request_id} is already waiting or running")
        if item.prompt_len < 0 or item.max_new_tokens < 1:
            return Rejection(
                "invalid",
                f"prompt_len must be >= 0 and max_new_tokens >= 1, got {item.prompt_len} and "
                f"{item.max_new_tokens}",
            )
        if item.cost > self.config.max_batch_tokens:
            return Rejection(
                "too_large",
                f"prompt ({item.prompt_len}) + max_new_tokens ({item.max_new_tokens}) = {item.cost} tokens "
                f"exceeds this worker's batch budget of {self.config.max_batch_tokens}",
            )
        if len(self._waiting) >= self.config.max_waiting:
            return Rejection("queue_full", f"waiting queue is full ({self.config.max_waiting} requests)")
        return None

    def submit(self, item: Pending[P]) -> Submitted:
        rejection = self.check(item)
        if rejection is not None:
            return "duplicate" if rejection.code == "duplicate" else "rejected"
        self._seq += 1
        key = (item.priority, self._seq, item.request_id)
        bisect.insort(self._order, key)
        self._waiting[item.request_id] = (key, item)
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, self._seq, item.request_id))
        return "queued"

    def cancel(self, request_id: str) -> Cancelled:
        if request_id in self._waiting:
            self._remove_waiting(request_id)
            return "waiting"
        if request_id in self._running:
            self.finish(request_id)
            return "running"
        return "unknown"

    def withdraw(self, request_id: str) -> bool:
        """Take a waiting request out (it never started). False if it is running or unknown."""
        if request_id not in self._waiting:
            return False
        self._remove_waiting(request_id)
        return True

    def finish(self, request_id: str) -> bool:
        """Free a running sequence's slot and budget. False if it was not running."""
        item = self._running.pop(request_id, None)
        if item is None:
            return False
        self._budget_in_use -= item.cost
        return True

    def drain(self) -> list[Pending[P]]:
        """Remove and return every waiting item (shutdown: each still needs its terminal event)."""
        items = [self._waiting[key[2]][1] for key in self._order]
        self._order.clear()
        self._waiting.clear()
        self._deadlines.clear()
        self._overtaken.clear()
        return items

    def expired_running(self, now: float) -> list[str]:
        """Running request ids past their deadline. They stay running until the worker calls ``finish``."""
        return [
            rid for rid, item in self._running.items() if item.deadline is not None and now >= item.deadline
        ]

    def schedule(self, now: float) -> Decision[P]:
        decision: Decision[P] = Decision(expire=self._expire_waiting(now))
        admitted: set[str] = set()
        blocked: str | None = None  # the first waiting item in order that did not fit
        limit = self.config.max_overtakes
        for _, _, rid in self._order:
            if len(self._running) >= self.config.max_running:
                break
            item = self._waiting[rid][1]
            if self._budget_in_use + item.cost <= self.config.max_batch_tokens:
                self._running[rid] = item
                self._budget_in_use += item.cost
                admitted.add(rid)
                decision.admit.append(item)
                if blocked is not None:
                    self._overtaken[blocked] += 1
                    if self._overtaken[blocked] >= limit:
                        break
            elif blocked is None:
                blocked = rid
                if self._overtaken.setdefault(rid, 0) >= limit:
                    break  # it reserves the budget: nothing behind it may go first
        if admitted:
            self._order = [key for key in self._order if key[2] not in admitted]
            for rid in admitted:
                del self._waiting[rid]
                self._overtaken.pop(rid, None)
            self._compact_deadlines()
        return decision

    def _expire_waiting(self, now: float) -> list[Pending[P]]:
        expired: list[Pending[P]] = []
        while self._deadlines and now >= self._deadlines[0][0]:
            _, seq, rid = heapq.heappop(self._deadlines)
            entry = self._waiting.get(rid)
            if entry is not None and entry[0][1] == seq:
                expired.append(entry[1])
        if expired:
            gone = {item.request_id for item in expired}
            self._order = [key for key in self._order if key[2] not in gone]
            for rid in gone:
                del self._waiting[rid]
                self._overtaken.pop(rid, None)
        return expired

    def _remove_waiting(self, request_id: str) -> None:
        key, _ = self._waiting.pop(request_id)
        index = bisect.bisect_left(self._order, key)
        del self._order[index]
        self._overtaken.pop(request_id, None)
        self._compact_deadlines()  # its deadline entry (if any) is now stale

    def _compact_deadlines(self) -> None:
        """Keep the deadline heap bounded by the waiting queue despite stale entries."""
        if len(self._deadlines) > 2 * len(self._waiting) + 64:
            self._deadlines = [
                (item.deadline, key[1], rid)
                for rid, (key, item) in self._waiting.items()
                if item.deadline is not None
            ]
            heapq.heapify(self._deadlines)
