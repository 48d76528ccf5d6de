"""Admission: per-tenant rate (token bucket) and concurrency limits, and the registry of in-flight requests
that graceful shutdown drains and cancels."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ingest.auth import Tenant
from ingest.errors import BudgetExceeded, RateLimited, Unavailable
from monitoring import metrics


@dataclass(eq=False)
class Flight:
    """One request this edge is serving (a submission, or a reader of an existing request's stream)."""

    tenant: str
    model: str
    request_id: str
    owner: bool
    """True when this edge submitted it: only the owner cancels it on disconnect, timeout or shutdown."""
    task: asyncio.Task[object] | None = None
    cancel_sent: bool = False


@dataclass
class _Bucket:
    tokens: float
    stamp: float


@dataclass
class Admission:
    clock: Callable[[], float] = time.monotonic
    accepting: bool = True
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _flights: set[Flight] = field(default_factory=set)
    _per_tenant: dict[str, int] = field(default_factory=dict)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def check_budget(self, tenant: Tenant, exhausted: bool) -> None:
        if exhausted:
            raise BudgetExceeded(
                f"Tenant {tenant.name} has used up its spending budget; new requests are refused until "
                "the budget is raised or renewed."
            )

    def check_rate(self, tenant: Tenant) -> None:
        """Take one token from the tenant's bucket, or raise :class:`RateLimited`."""
        if tenant.requests_per_s is None:
            return
        capacity = float(tenant.burst or max(1, round(tenant.requests_per_s)))
        now = self.clock()
        bucket = self._buckets.setdefault(tenant.name, _Bucket(tokens=capacity, stamp=now))
        bucket.tokens = min(capacity, bucket.tokens + (now - bucket.stamp) * tenant.requests_per_s)
        bucket.stamp = now
        if bucket.tokens < 1.0:
            raise RateLimited(f"Rate limit reached for tenant {tenant.name}: {tenant.requests_per_s}/s.")
        bucket.tokens -= 1.0

    @contextmanager
    def flight(self, tenant: Tenant, model: str, request_id: str, *, owner: bool) -> Iterator[Flight]:
        """Register a request for its lifetime; refuse it when shutting down or over the tenant's limit."""
        if not self.accepting:
            raise Unavailable("The server is shutting down; retry on another instance.", code="shutting_down")
        running = self._per_tenant.get(tenant.name, 0)
        if tenant.max_concurrency is not None and running >= tenant.max_concurrency:
            raise RateLimited(
                f"Too many concurrent requests for tenant {tenant.name} (limit {tenant.max_concurrency}).",
                code="concurrency_limit_exceeded",
            )
        current = asyncio.current_task()
        entry = Flight(tenant=tenant.name, model=model, request_id=request_id, owner=owner, task=current)
        self._flights.add(entry)
        self._per_tenant[tenant.name] = running + 1
        self._idle.clear()
        gauge = metrics.IN_FLIGHT.labels(model)
        gauge.inc()
        try:
            yield entry
        finally:
            gauge.dec()
            self._flights.discard(entry)
            left = self._per_tenant[tenant.name] - 1
            if left:
                self._per_tenant[tenant.name] = left
            else:
                del self._per_tenant[tenant.name]
            if not self._flights:
                self._idle.set()

    @property
    def flights(self) -> list[Flight]:
        return list(self._flights)

    async def wait_idle(self, within_s: float) -> bool:
        """True when no request is in flight any more, False when ``within_s`` ran out first."""
        try:
            async with asyncio.timeout(within_s):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True
