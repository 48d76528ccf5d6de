"""Admission for continuous batching: which waiting generations join the running batch, and when.

A pure, synchronous object. The worker's step loop owns it (TGI's queue-as-actor), passes the monotonic
``now`` in, reports the tokens each running sequence produces (``produced``), and turns its answers into
events: ``Decision.expire`` → ``expired`` terminal events (never run), ``Decision.shed`` and a rejected
submit → ``failed``, ``expired_running`` → stop those sequences within this decode step.

Policies:

* **Token budget.** A running sequence holds ``prompt_len + max_new_tokens`` tokens of budget (the KV it
  may need) from admission until ``finish``/``cancel``. A request whose cost alone exceeds
  ``max_batch_tokens`` is rejected at submit (``too_large``): it could never run. (The generation runner
  lowers a request's ``max_new_tokens`` to what the budget leaves after its prompt first, so it sends none.)
* **Classes.** Every request is in one of three classes, and a higher class is always offered a free slot
  before a lower one: *interactive* (``priority <= 0``: the edge's default 0), *batch* (``priority > 0``:
  background work) and *shadow* (``shadow``: a rollout's mirrored copy, which the edge also gives
  ``SHADOW_PRIORITY``). Strict classes can delay lower ones indefinitely under sustained load; deadlines
  bound that.
* **Fairness within a class: VTC** (Virtual Token Counter, Sheng et al., OSDI '24). Each tenant has a
  counter per class of the service it received, ``(input tokens + 2 * output tokens) / weight``: the
  prompt is charged at admission, each output token as the engine produces it (``produced``), so a long
  generation keeps costing its tenant while it runs. A free slot goes to the waiting request of the
  tenant with the smallest counter (ties: the earlier arrival); a tenant's own requests go in
  ``priority`` order (lower value first), then FIFO. A tenant that becomes active (something waiting or
  running in the class) is lifted to the smallest counter of the active tenants, or, when none is, to the
  counter of the last tenant that went idle: idle time banks no credit, so a returning tenant cannot
  starve the others. The policy is work-conserving: a slot never stays free while a request that fits
  waits. Counters live only while a tenant is active; an idle tenant's counter is remembered only while
  it is above the lift floor (service owed to others), and at most ``max_idle_tenants`` of those per
  class, oldest forgotten first. Single-tenant traffic is served exactly as before: priority, then FIFO.
* **Head of line.** When the next request in that order does not fit the free budget, later requests that
  do fit may *overtake* it (backfill), but at most ``max_overtakes`` times. After that the scheduler admits
  nothing else until the blocked request fits, which it will once running sequences finish (its cost is at
  most the whole budget). So big requests cannot block small ones forever, and small ones cannot starve a
  big one forever. ``max_overtakes=0`` is strict order.
* **A full queue sheds the biggest holder.** With ``max_waiting`` requests waiting, a new request takes
  the place of the newest request (last in its own order) of the tenant holding the most waiting slots in
  the lowest class present; that request leaves in ``Decision.shed`` (``queue_full``). The new request is
  refused itself when it would be that request: its class is lower than everything waiting, or its tenant
  would then hold at least as many slots of the class as any other. So a flooding tenant's requests are
  the ones refused, never a light tenant's, and a tenant alone may still use the whole queue.
* **Deadlines.** An item is expired when ``now >= deadline``. Expired waiting items are removed and
  returned in ``Decision.expire`` before admission, so they are never admitted.
* **Duplicates.** A request id already waiting or running is answered ``"duplicate"`` and ignored; the
  caller must *not* emit a terminal event for it (the original is still in flight).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Generic, Literal, TypeVar

P = TypeVar("P")

Submitted = Literal["queued", "duplicate", "rejected"]
RejectCode = Literal["duplicate", "invalid", "too_large", "queue_full"]
Cancelled = Literal["waiting", "running", "unknown"]


class ServiceClass(IntEnum):
    """Admission classes, most urgent first: a lower class gets a slot only when no higher one waits."""

    INTERACTIVE = 0
    BATCH = 1
    SHADOW = 2


def service_class(priority: int, shadow: bool) -> ServiceClass:
    """Shadow copies (``shadow_of`` set) are SHADOW; otherwise ``priority > 0`` is BATCH, else INTERACTIVE."""
    if shadow:
        return ServiceClass.SHADOW
    return ServiceClass.BATCH if priority > 0 else ServiceClass.INTERACTIVE


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
    """Lower value is admitted first; ``> 0`` puts the request in the batch class."""
    tenant: str = ""
    """Whose service this is: fairness is between tenants."""
    shadow: bool = False
    """A rollout's shadow copy: the lowest class."""
    service_class: ServiceClass = field(init=False, compare=False)
    """From ``priority`` and ``shadow``; kept, since every generated token is charged to its class's flow."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "service_class", service_class(self.priority, self.shadow))

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
    """Bound of the waiting queue; beyond it the biggest holder's newest request is refused (``queue_full``)."""
    max_overtakes: int = 16
    """How often later requests may be admitted past a blocked head before it reserves the budget."""
    weights: Mapping[str, float] = field(default_factory=dict)
    """Tenant → share of service relative to others (default 1): weight 2 gets twice the tokens of 1."""
    max_idle_tenants: int = 4096
    """Counters of idle tenants remembered per class (those still owing service to others)."""

    def __post_init__(self) -> None:
        for name in ("max_running", "max_batch_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("max_overtakes", "max_idle_tenants"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0, got {getattr(self, name)}")
        for tenant, weight in self.weights.items():
            if not weight > 0:
                raise ValueError(f"the weight of tenant {tenant!r} must be positive, got {weight}")


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
    shed: list[Pending[P]] = field(default_factory=list)
    """Pushed out of the full waiting queue by another tenant's request: end them ``failed`` (``queue_full``)."""


_Key = tuple[int, int, str]  # (priority, arrival sequence, request id): a tenant's own order


@dataclass(slots=True)
class _Flow:
    """One tenant in one class while it is active: its virtual counter and what it has waiting and running."""

    counter: float
    weight: float
    waiting: list[_Key] = field(default_factory=list)  # sorted
    running: int = 0


class GenerationScheduler(Generic[P]):
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self._waiting: dict[str, tuple[_Key, Pending[P]]] = {}
        self._flows: tuple[dict[str, _Flow], ...] = tuple({} for _ in ServiceClass)  # active tenants
        self._idle: tuple[OrderedDict[str, float], ...] = tuple(OrderedDict() for _ in ServiceClass)
        self._last_left = [0.0 for _ in ServiceClass]  # counter of the tenant that last went idle
        self._deadlines: list[tuple[float, int, str]] = []  # heap over waiting; stale entries skipped
        self._costs: list[tuple[int, int, str]] = []  # (cost, seq, id) heap over waiting; stale skipped
        self._running: dict[str, Pending[P]] = {}
        self._shed: dict[str, Pending[P]] = {}  # refused after queuing, until the next ``schedule``
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

    def counter(self, tenant: str, klass: ServiceClass = ServiceClass.INTERACTIVE) -> float | None:
        """The tenant's virtual counter in ``klass``: None when it is forgotten (it would be lifted)."""
        flow = self._flows[klass].get(tenant)
        return flow.counter if flow is not None else self._idle[klass].get(tenant)

    def tenants(self) -> int:
        """Counters held, active and remembered idle, over every class (bounded)."""
        return sum(len(flows) for flows in self._flows) + sum(len(idle) for idle in self._idle)

    def check(self, item: Pending[P]) -> Rejection | None:
        """Why ``submit`` would not queue ``item`` (None: it would). Does not change state."""
        rid = item.request_id
        if rid in self._waiting or rid in self._running or rid in self._shed:
            return Rejection("duplicate", f"request {rid} is already waiting or running")
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
        if len(self._waiting) >= self.config.max_waiting and self._victim(item) is None:
            return Rejection(
                "queue_full",
                f"waiting queue is full ({self.config.max_waiting} requests) and none of it is of a lower class "
                f"or of a tenant holding more of it than tenant {item.tenant!r}",
            )
        return None

    def submit(self, item: Pending[P]) -> Submitted:
        rejection = self.check(item)
        if rejection is not None:
            return "duplicate" if rejection.code == "duplicate" else "rejected"
        if len(self._waiting) >= self.config.max_waiting:
            victim = self._victim(item)
            if victim is not None:  # always, after check: the biggest holder's newest request makes room
                self._shed[victim] = self._waiting[victim][1]
                self._remove_waiting(victim)
        self._seq += 1
        key = (item.priority, self._seq, item.request_id)
        bisect.insort(self._activate(item).waiting, key)
        self._waiting[item.request_id] = (key, item)
        if item.deadline is not None:
            heapq.heappush(self._deadlines, (item.deadline, self._seq, item.request_id))
        heapq.heappush(self._costs, (item.cost, self._seq, item.request_id))
        return "queued"

    def cancel(self, request_id: str) -> Cancelled:
        if request_id in self._waiting or request_id in self._shed:
            self.withdraw(request_id)
            return "waiting"
        if request_id in self._running:
            self.finish(request_id)
            return "running"
        return "unknown"

    def withdraw(self, request_id: str) -> bool:
        """Take a waiting request out (it never started). False if it is running or unknown."""
        if self._shed.pop(request_id, None) is not None:
            return True
        if request_id not in self._waiting:
            return False
        self._remove_waiting(request_id)
        return True

    def produced(self, request_id: str, tokens: int = 1) -> None:
        """Charge a running request's tenant for ``tokens`` output tokens (each decode step)."""
        item = self._running.get(request_id)
        if item is not None:
            flow = self._flows[item.service_class][item.tenant]
            flow.counter += 2 * tokens / flow.weight

    def finish(self, request_id: str) -> bool:
        """Free a running sequence's slot and budget. False if it was not running."""
        item = self._running.pop(request_id, None)
        if item is None:
            return False
        self._budget_in_use -= item.cost
        flow = self._flows[item.service_class][item.tenant]
        flow.running -= 1
        self._retire_if_idle(item.service_class, item.tenant, flow)
        return True

    def drain(self) -> list[Pending[P]]:
        """Remove and return every waiting item, shed ones first, then by class and order (shutdown: each
        still needs its terminal event)."""
        order = sorted(self._waiting.values(), key=lambda entry: (entry[1].service_class, entry[0]))
        items = [*self._shed.values(), *(item for _, item in order)]
        for _, item in order:
            self._remove_waiting(item.request_id)
        self._shed.clear()
        self._deadlines.clear()
        self._costs.clear()
        return items

    def expired_running(self, now: float) -> list[str]:
        """Running request ids past their deadline. They stay running until the worker calls ``finish``."""
        return [
            rid for rid, item in self._running.items() if item.deadline is not None and now >= item.deadline
        ]

    def schedule(self, now: float) -> Decision[P]:
        decision: Decision[P] = Decision(expire=self._expire_waiting(now), shed=list(self._shed.values()))
        self._shed.clear()
        if not self._waiting or len(self._running) >= self.config.max_running:
            return decision
        if self._least_cost() > self.config.max_batch_tokens - self._budget_in_use:
            return decision  # nothing waiting fits the budget left: no need to walk the queue
        # One candidate per backlogged tenant, most urgent class first, then the smallest counter, then the
        # earliest arrival; ``cursor`` walks a tenant's own queue past requests that did not fit.
        heap = [
            (klass, flow.counter, flow.waiting[0][1], tenant, 0)
            for klass, flows in enumerate(self._flows)
            for tenant, flow in flows.items()
            if flow.waiting
        ]
        heapq.heapify(heap)
        blocked: str | None = None  # the first candidate that did not fit
        limit = self.config.max_overtakes
        while heap and len(self._running) < self.config.max_running:
            klass, _, _, tenant, cursor = heapq.heappop(heap)
            flow = self._flows[klass][tenant]
            rid = flow.waiting[cursor][2]
            item = self._waiting[rid][1]
            if self._budget_in_use + item.cost <= self.config.max_batch_tokens:
                self._admit(item, flow, cursor)
                decision.admit.append(item)
                if blocked is not None:
                    self._overtaken[blocked] += 1
                    if self._overtaken[blocked] >= limit:
                        break
                if self._least_cost() > self.config.max_batch_tokens - self._budget_in_use:
                    break  # what is left cannot fit: the walk would admit nothing more
            else:
                if blocked is None:
                    blocked = rid
                    if self._overtaken.setdefault(rid, 0) >= limit:
                        break  # it reserves the budget: nothing behind it may go first
                cursor += 1
            if cursor < len(flow.waiting):
                heapq.heappush(heap, (klass, flow.counter, flow.waiting[cursor][1], tenant, cursor))
        if decision.admit:
            self._compact_deadlines()
        return decision

    # ---------------------------------------------------------------- helpers

    def _admit(self, item: Pending[P], flow: _Flow, cursor: int) -> None:
        del flow.waiting[cursor]
        del self._waiting[item.request_id]
        self._overtaken.pop(item.request_id, None)
        flow.running += 1
        flow.counter += item.prompt_len / flow.weight
        self._running[item.request_id] = item
        self._budget_in_use += item.cost

    def _activate(self, item: Pending[P]) -> _Flow:
        """The tenant's flow in the item's class; a tenant becoming active is lifted to the floor."""
        flows = self._flows[item.service_class]
        flow = flows.get(item.tenant)
        if flow is None:
            remembered = self._idle[item.service_class].pop(item.tenant, 0.0)
            floor = self._floor(item.service_class)
            weight = self.config.weights.get(item.tenant, 1.0)
            flow = flows[item.tenant] = _Flow(counter=max(remembered, floor), weight=weight)
        return flow

    def _floor(self, klass: ServiceClass) -> float:
        """What a tenant becoming active is lifted to: the least served active tenant's counter."""
        return min((flow.counter for flow in self._flows[klass].values()), default=self._last_left[klass])

    def _retire_if_idle(self, klass: ServiceClass, tenant: str, flow: _Flow) -> None:
        if flow.waiting or flow.running:
            return
        del self._flows[klass][tenant]
        self._last_left[klass] = flow.counter
        if flow.counter > self._floor(klass) and self.config.max_idle_tenants:
            idle = self._idle[klass]  # it was served more than the others: remember what it owes
            idle[tenant] = flow.counter
            idle.move_to_end(tenant)
            while len(idle) > self.config.max_idle_tenants:
                idle.popitem(last=False)

    def _victim(self, item: Pending[P]) -> str | None:
        """The waiting request ``item`` would push out of a full queue; None: ``item`` is refused itself."""
        klass = item.service_class
        lowest = max(k for k, flows in enumerate(self._flows) if any(f.waiting for f in flows.values()))
        if klass > lowest:
            return None  # it is in a lower class than everything waiting
        contest = klass == lowest  # the newcomer competes with the holders of its own class
        holders = [
            (len(flow.waiting), flow.waiting[-1][1], flow.waiting[-1][2])  # slots, newest arrival, its id
            for tenant, flow in self._flows[lowest].items()
            if flow.waiting and not (contest and tenant == item.tenant)
        ]
        biggest = max(holders, default=None)
        if biggest is None:
            return None
        if contest:
            own = self._flows[klass].get(item.tenant)
            if biggest[0] <= (len(own.waiting) if own is not None else 0) + 1:
                return None  # its tenant would hold at least as many slots as any other
        return biggest[2]

    def _expire_waiting(self, now: float) -> list[Pending[P]]:
        expired: list[Pending[P]] = []
        while self._deadlines and now >= self._deadlines[0][0]:
            _, seq, rid = heapq.heappop(self._deadlines)
            entry = self._waiting.get(rid)
            if entry is not None and entry[0][1] == seq:
                expired.append(entry[1])
                self._remove_waiting(rid, compact=False)
        if expired:
            self._compact_deadlines()  # their cost entries are stale (a full batch admits nothing)
        return expired

    def _remove_waiting(self, request_id: str, *, compact: bool = True) -> None:
        key, item = self._waiting.pop(request_id)
        klass = item.service_class
        flow = self._flows[klass][item.tenant]
        del flow.waiting[bisect.bisect_left(flow.waiting, key)]
        self._overtaken.pop(request_id, None)
        self._retire_if_idle(klass, item.tenant, flow)
        if compact:
            self._compact_deadlines()  # its deadline entry (if any) is now stale

    def _least_cost(self) -> float:
        """The smallest cost of a waiting request (infinite when none waits). A budget-bound batch with a
        long queue would otherwise walk the whole queue at every decode step to admit nothing."""
        costs, waiting = self._costs, self._waiting
        while costs:
            cost, seq, rid = costs[0]
            entry = waiting.get(rid)
            if entry is not None and entry[0][1] == seq:
                return cost
            heapq.heappop(costs)  # admitted, withdrawn or expired since
        return math.inf

    def _compact_deadlines(self) -> None:
        """Keep the deadline and cost heaps bounded by the waiting queue despite stale entries."""
        if len(self._deadlines) > 2 * len(self._waiting) + 64:
            self._deadlines = [
                (item.deadline, key[1], rid)
                for rid, (key, item) in self._waiting.items()
                if item.deadline is not None
            ]
            heapq.heapify(self._deadlines)
        if len(self._costs) > 2 * len(self._waiting) + 64:
            self._costs = [(item.cost, key[1], rid) for rid, (key, item) in self._waiting.items()]
            heapq.heapify(self._costs)
