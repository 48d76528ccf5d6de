"""Admission: per-tenant limits shared by every edge (:mod:`ingest.quota`), the budget gate, and the
registry of in-flight requests that graceful shutdown drains and cancels."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ingest.auth import Tenant
from ingest.errors import BudgetExceeded, InvalidRequest, RateLimited, Unavailable
from ingest.quota import ALL_MODELS, Key, Limits, QuotaExceeded, QuotaLedger, Reservation
from monitoring import metrics
from schemas.events import EmbeddingRequested, GenerationRequested, RequestFinished


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
    reservation: Reservation | None = None

    def name_model(self, model: str) -> None:
        """The model of a resumed stream, once its replies name it: counted under it from here on (it was
        counted under ``model=""`` for good: an audit)."""
        if model == self.model:
            return
        metrics.IN_FLIGHT.labels(self.model).dec()  # a flight is counted from its start (Admission.flight)
        metrics.IN_FLIGHT.labels(model).inc()
        self.model = model


def reserved_tokens(event: GenerationRequested | EmbeddingRequested) -> int:
    """What a request may use, reserved at admission: prompt + ``max_tokens``, or every input's tokens."""
    if isinstance(event, GenerationRequested):
        return len(event.input_ids) + event.sampling.max_tokens
    return sum(len(tokens) for tokens in event.inputs)


@dataclass
class Admission:
    accepting: bool = True
    ledger: QuotaLedger = field(default_factory=lambda: QuotaLedger(f"edge-{secrets.token_hex(4)}"))
    tenants: dict[str, Tenant] = field(default_factory=dict)
    """The tenants seen (name -> its limits), for the sync to know every key's limits."""
    _flights: set[Flight] = field(default_factory=set)
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
        """Refuse before any work on the body when the tenant is already at one of its limits."""
        try:
            self.ledger.precheck((tenant.name, ALL_MODELS), tenant.total)
        except QuotaExceeded as exc:
            raise _refused(exc) from None

    def limits_of(self, key: Key) -> Limits | None:
        tenant = self.tenants.get(key[0])
        return tenant.limits(key[1]) if tenant is not None else None

    def settle(self, flight: Flight, finished: RequestFinished) -> None:
        """Replace the flight's token reservation with what its request used."""
        if flight.reservation is not None and finished.usage is not None:
            self.ledger.reconcile(flight.reservation, finished.usage.total_tokens)

    def refund(self, flight: Flight, *, request: bool) -> None:
        """What the flight reserved, taken back: its request was never published (``request``: its count
        too), or it replays a request that ran before (its tokens)."""
        if flight.reservation is not None:
            self.ledger.refund(flight.reservation, request=request)

    @contextmanager
    def flight(
        self, tenant: Tenant, model: str, request_id: str, *, owner: bool, tokens: int = 0
    ) -> Iterator[Flight]:
        """Register a request for its lifetime, reserving one request, ``tokens`` tokens and one place in
        flight under the tenant's limits (a resume reserves no tokens, but counts); refuse it when shutting
        down or over a limit (429 with ``Retry-After``)."""
        if not self.accepting:
            raise Unavailable("The server is shutting down; retry on another instance.", code="shutting_down")
        self.tenants[tenant.name] = tenant
        try:
            reservation = self.ledger.admit(tenant.checks(model), tokens)
        except QuotaExceeded as exc:
            raise _refused(exc) from None
        current = asyncio.current_task()
        entry = Flight(
            tenant=tenant.name,
            model=model,
            request_id=request_id,
            owner=owner,
            task=current,
            reservation=reservation,
        )
        self._flights.add(entry)
        self._idle.clear()
        metrics.IN_FLIGHT.labels(model).inc()
        try:
            yield entry
        finally:
            metrics.IN_FLIGHT.labels(entry.model).dec()
            self.ledger.release(reservation)
            self._flights.discard(entry)
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


def _refused(exc: QuotaExceeded) -> RateLimited | InvalidRequest:
    refusal = exc.refusal
    if refusal.code == "tokens_exceed_limit":  # can never fit: not a rate limit, a request to change
        return InvalidRequest(refusal.message, code=refusal.code, param="max_tokens")
    return RateLimited(refusal.message, code=refusal.code, retry_after_s=refusal.retry_after_s)
