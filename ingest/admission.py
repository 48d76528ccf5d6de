"""Admission: per-tenant limits shared by every edge (:mod:`ingest.quota`), the budget gate, and the
registry of in-flight requests that graceful shutdown drains and cancels."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from ingest.auth import Tenant
from ingest.errors import BudgetExceeded, InvalidRequest, RateLimited, Unavailable
from ingest.prepare import Shape
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
    idempotency_key: str | None = None
    held_until: asyncio.Future[None] | None = None
    """Set while the request runs on after its client left (a cancel delayed by the disconnect grace): its
    place in flight is kept until this is done (the cancel sent, or the request taken back), not given
    back as the client leaves. An audit: with a grace, a client that opened streams and left at once had
    any number running past its ``max_concurrency``."""
    resumed: bool = False
    """A reader of a request submitted before (a resume): its deadline is the reader's own, not the
    request's, so passing it ends the reading alone, even when the reader took the request back."""
    stopping: bool = False
    """Cut by the edge's shutdown (:meth:`stop`)."""
    took_over: bool = False
    """Its reservation is the held place of the request it came back for, not one of its own: a refund
    (a replay, a key reused with another body) takes nothing back from it."""
    deadline: asyncio.Timeout | None = None
    """The deadline of the guard the request waits in (:meth:`ingest.dispatch.Dispatcher.guard`), if any."""
    ends_at: float | None = None
    """The loop time of the request's own deadline, where this flight knows it: its submitter's guard sets
    it, and a resume that takes the request back keeps it (:meth:`take_back`)."""
    shape: Shape | None = None
    """How the request's client asked for its replies (an embeddings result's ``encoding_format``), where
    this flight knows it: set as it is submitted (:meth:`ingest.dispatch.Dispatcher.open`), and kept by a
    resume that takes the request back."""

    def stop(self) -> None:
        """Cut the request for the edge's shutdown: its guard ends it with :class:`ShuttingDown` now (or as
        it enters one), which its handler tells the client (an SSE error event, a WebSocket error frame, a
        503). Its task cancelled instead, a stream just broke off: no error event, no ``[DONE]`` (an audit)."""
        self.stopping = True
        if self.deadline is not None and not self.deadline.expired():
            self.deadline.reschedule(asyncio.get_running_loop().time())

    def take_back(self, left: Flight) -> None:
        """Go on as ``left``, the flight whose client left this request running on this edge within the
        disconnect grace (its delayed cancel just dropped, :meth:`ingest.dispatch.Dispatcher.resume`): this
        reader owns the request now, its cancels name the request's model, and it reads until the request's
        own deadline at the latest (:meth:`time_left`), its replies rendered as its client asked (:attr:`shape`; an
        embeddings result asked in base64 came back as float lists). A review: a resume's flight
        (model ``""``) that cancelled before any reply named the model published ``model=""``, a cancel no
        worker takes (each acts on its own model's alone): the request ran on unread and billed."""
        self.owner = True
        self.name_model(left.model)
        self.ends_at = left.ends_at
        self.shape = left.shape

    def render_vectors_as(self, encoding_format: str) -> None:
        """Render an embeddings result in ``encoding_format``, as a resume's reader asked: a resume that did
        not take its request back knows nothing of how the request asked (the stream does not say), and
        gave base64 requests float lists back (a review)."""
        if self.shape is not None:
            self.shape = dataclasses.replace(self.shape, encoding_format=encoding_format)
        else:
            self.shape = Shape("embedding", self.model, self.request_id, "", encoding_format=encoding_format)

    def time_left(self) -> float | None:
        """Seconds to the request's own deadline (:attr:`ends_at`), where this flight knows it."""
        if self.ends_at is None:
            return None
        return self.ends_at - asyncio.get_running_loop().time()

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
    _preparing: dict[str, int] = field(default_factory=dict)
    """Per tenant, its requests this edge is reading and tokenising (:meth:`preparing`)."""
    _held: dict[tuple[str, str, str], _Held] = field(default_factory=dict)
    """The places of requests running on after their clients left (:attr:`Flight.held_until`), by
    ``("request", tenant, request id)`` and ``("key", tenant, Idempotency-Key)``: a client coming back for
    one (a resume, or a retry with its key) takes its place over instead of needing a second."""

    def __post_init__(self) -> None:
        self._idle.set()

    def check_budget(self, tenant: Tenant, exhausted: bool) -> None:
        if exhausted:
            raise BudgetExceeded(
                f"Tenant {tenant.name} has used up its spending budget; new requests are refused until "
                "the budget is raised or renewed."
            )

    @contextmanager
    def preparing(
        self, tenant: Tenant, *, request_id: str | None = None, idempotency_key: str | None = None
    ) -> Iterator[None]:
        """Around reading, validating and tokenising a request's body: refuse it first when the tenant is
        already at one of its limits (429), counting the tenant's requests this edge is still preparing as
        admitted ones, in flight and in its requests per minute; not a client coming back for a request
        that holds its place (by ``request_id`` or ``idempotency_key``): its flight takes that place over.
        The preparation counts until the block ends; the request's :meth:`flight` then takes its place
        (with no await between the two, nothing else is admitted in the gap). Before: a tenant with
        ``max_concurrency`` 1 that sent 12 requests at once had all 12 bodies read and tokenised (those under
        64 KiB on the event loop every tenant shares) before 11 were refused (the test of this)."""
        held = [("request", tenant.name, request_id), ("key", tenant.name, idempotency_key)]
        if any(key in self._held for key in held):  # its place is counted already
            yield
            return
        try:
            self.ledger.precheck((tenant.name, ALL_MODELS), tenant.total, self._preparing.get(tenant.name, 0))
        except QuotaExceeded as exc:
            raise _refused(exc) from None
        self._preparing[tenant.name] = self._preparing.get(tenant.name, 0) + 1
        try:
            yield
        finally:
            left = self._preparing.pop(tenant.name) - 1
            if left:
                self._preparing[tenant.name] = left

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
        if flight.reservation is not None and not flight.took_over:
            self.ledger.refund(flight.reservation, request=request)

    @contextmanager
    def flight(
        self,
        tenant: Tenant,
        model: str,
        request_id: str,
        *,
        owner: bool,
        tokens: int = 0,
        idempotency_key: str | None = None,
        resumed: bool = False,
        embedding: bool = False,
    ) -> Iterator[Flight]:
        """Register a request for its lifetime, reserving one request, ``tokens`` tokens and one place in
        flight under the tenant's limits (a resume reserves no tokens, but counts); refuse it when shutting
        down or over a limit (429 with ``Retry-After``; ``embedding``: its tokens are its inputs', no ``max_tokens``). The place is given back when the flight ends, or,
        when its request runs on after its client left, once that ends (:attr:`Flight.held_until`)."""
        if not self.accepting:
            raise Unavailable("The server is shutting down; retry on another instance.", code="shutting_down")
        self.tenants[tenant.name] = tenant
        taken = self._take_over(("request", tenant.name, request_id))
        if taken is None and idempotency_key is not None:
            taken = self._take_over(("key", tenant.name, idempotency_key))
        if taken is not None:
            # The request's own place, taken over: it still runs, counted once under the keys it was
            # admitted under. A review: admitted afresh, a resume (model "") held the place outside the
            # model's limits (its max_concurrency passed), and a keyed retry's tokens were charged twice.
            reservation = taken.reservation
            self.ledger.reacquire(reservation)
        else:
            try:
                reservation = self.ledger.admit(tenant.checks(model), tokens)
            except QuotaExceeded as exc:
                raise _refused(exc, embedding) from None
        current = asyncio.current_task()
        entry = Flight(
            tenant=tenant.name,
            model=model,
            request_id=request_id,
            owner=owner,
            task=current,
            reservation=reservation,
            idempotency_key=idempotency_key,
            resumed=resumed,
            took_over=taken is not None,
        )
        self._flights.add(entry)
        self._idle.clear()
        metrics.IN_FLIGHT.labels(model).inc()
        try:
            yield entry
        finally:
            metrics.IN_FLIGHT.labels(entry.model).dec()
            if entry.held_until is None or entry.held_until.done():
                self.ledger.release(reservation)
            else:
                self._hold(entry, reservation, entry.held_until)
            self._give_back(taken)
            self._flights.discard(entry)
            if not self._flights:
                self._idle.set()

    def _hold(self, flight: Flight, reservation: Reservation, until: asyncio.Future[None]) -> None:
        keys = [("request", flight.tenant, flight.request_id)]
        if flight.idempotency_key is not None:
            keys.append(("key", flight.tenant, flight.idempotency_key))
        held = _Held(reservation, tuple(keys), until)
        for key in keys:
            self._held[key] = held

        def ended(_: object) -> None:
            if self._held.get(keys[0]) is not held:
                return  # taken over: the flight that took it holds the reservation now
            self.ledger.release(reservation)
            for key in keys:
                if self._held.get(key) is held:
                    del self._held[key]

        until.add_done_callback(ended)

    def _take_over(self, key: tuple[str, str, str]) -> _Held | None:
        """A held place given back for the flight coming back for its request (which then holds one of
        its own); returned, for :meth:`_give_back` when the flight ends without the request."""
        held = self._held.pop(key, None)
        if held is not None:
            self.ledger.release(held.reservation)
            for other in held.keys:
                self._held.pop(other, None)
        return held

    def _give_back(self, taken: _Held | None) -> None:
        """The place a flight took over, held again when the flight ended without taking its request back
        (its delayed cancel still pending): a resume refused for a bad cursor, a retry with the key and
        another body (422), one over another limit. An audit: each of those freed the place of a request
        still running, and the tenant ran that many more past its ``max_concurrency``."""
        if taken is None or taken.until.done() or _cancelling(taken.until):
            return  # ended meanwhile, or taken back (its cancel dropped): the flight's place is the one
        self.ledger.reacquire(taken.reservation)
        for key in taken.keys:
            self._held[key] = taken

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


@dataclass(frozen=True)
class _Held:
    """The place of a request that runs on after its client left, until ``until`` is done."""

    reservation: Reservation
    keys: tuple[tuple[str, str, str], ...]
    until: asyncio.Future[None]


def _cancelling(until: asyncio.Future[None]) -> bool:
    """Whether a delayed cancel was dropped (:meth:`ingest.dispatch.Dispatcher._reclaim` cancels its task;
    the task is done only once it has run again)."""
    return isinstance(until, asyncio.Task) and until.cancelling() > 0


def _refused(exc: QuotaExceeded, embedding: bool = False) -> RateLimited | InvalidRequest:
    refusal = exc.refusal
    if refusal.code == "tokens_exceed_limit":  # can never fit: not a rate limit, a request to change
        if embedding:  # an audit: it named max_tokens, which the embeddings endpoint does not have
            return InvalidRequest(
                f"{refusal.message} Send fewer or shorter inputs.", code=refusal.code, param="input"
            )
        return InvalidRequest(
            f"{refusal.message} Lower max_tokens or the prompt.", code=refusal.code, param="max_tokens"
        )
    return RateLimited(refusal.message, code=refusal.code, retry_after_s=refusal.retry_after_s)
