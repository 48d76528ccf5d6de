"""Per-tenant limits that hold across edges: requests and tokens per minute, and requests in flight.

Each edge counts its own admissions in one-second buckets over a trailing window (60 s) and publishes the
totals every sync interval on the ``quota`` topic (:class:`~schemas.coordination.QuotaSync`, a snapshot
that replaces the edge's previous one); every edge reads every other edge's latest snapshot. A request is
admitted when, for the tenant's total (model ``"*"``) and for the model it asks for,

    own window + every peer's last snapshot + this request  <=  the limit,

and when this edge has not used more than its **share** of what was left at its last sync:
``ceil(left / live edges)`` (at least one request). Peers admit against the same rule. What an edge knows
of the others is one sync interval (plus delivery) old, so the bound is: over a window the edges together
admit at most the limit plus what the other edges admitted in the last sync interval before it filled,
each at most its share of what was left then (and at least one request per edge when the share rounds
up). A burst that meets an untouched limit can pass it by up to (E - 1) / E of what was left; a steady
overload passes it by a few requests. Measured in ``tests/ingest/test_quota.py`` and the overload test.

Tokens are reserved at admission (prompt + ``max_tokens``; prompt tokens for embeddings) and replaced by
what the request really used when its terminal event arrives (``reconcile``), so a tenant with short
answers is not held to its worst case for a whole minute. Requests in flight count until the stream ends.

A peer that stops publishing keeps its requests and tokens counted until its snapshot is a window old
(conservative: its admissions were real), and its in-flight count until it is ``peer_ttl_s`` old.

Pure and synchronous (the event loop owns it); the clock is injected for tests.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec

from schemas.coordination import QuotaSync, QuotaUsage

ALL_MODELS = "*"
WINDOW_S = 60
"""The trailing window of the per-minute limits, in seconds."""
Key = tuple[str, str]
"""(tenant, model), model ``"*"`` for the tenant's total."""


Positive = Annotated[int, msgspec.Meta(ge=1)]


class Limits(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Limits of a tenant (over all its models) or of one of its models; None: unlimited."""

    requests_per_min: Positive | None = None
    tokens_per_min: Positive | None = None
    max_concurrency: Positive | None = None

    @property
    def unlimited(self) -> bool:
        return self.requests_per_min is None and self.tokens_per_min is None and self.max_concurrency is None


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str
    retry_after_s: float


class QuotaExceeded(Exception):
    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


@dataclass
class _Own:
    buckets: dict[int, list[int]] = field(default_factory=dict)
    """Second -> [requests, tokens] admitted by this edge in that second."""
    in_flight: int = 0
    since_sync: list[int] = field(default_factory=lambda: [0, 0])
    """[requests, tokens] admitted since this edge last published (its share is checked against it)."""
    in_flight_at_sync: int = 0
    """``in_flight`` when this edge last published: what it has in flight beyond that is its share of the
    concurrency left then."""

    def totals(self, oldest: int) -> tuple[int, int]:
        requests = tokens = 0
        for second, (r, t) in self.buckets.items():
            if second >= oldest:
                requests += r
                tokens += t
        return requests, tokens

    def prune(self, oldest: int) -> None:
        for second in [s for s in self.buckets if s < oldest]:
            del self.buckets[second]

    @property
    def idle(self) -> bool:
        return not self.buckets and self.in_flight == 0


@dataclass
class _Peer:
    heard: float
    usage: dict[Key, QuotaUsage]


@dataclass(eq=False)
class Reservation:
    keys: tuple[Key, ...]
    second: int
    tokens: int
    released: bool = False


class QuotaLedger:
    def __init__(
        self,
        instance: str,
        *,
        window_s: int = WINDOW_S,
        peer_ttl_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        wall_ms: Callable[[], int] = lambda: int(time.time() * 1000),
    ) -> None:
        self.instance = instance
        self.window_s = window_s
        self.peer_ttl_s = peer_ttl_s
        self._clock = clock
        self._wall_ms = wall_ms
        self._own: dict[Key, _Own] = {}
        self._peers: dict[str, _Peer] = {}
        self._left_at_sync: dict[Key, tuple[int, int]] = {}
        """Per key, the (requests, tokens) left under the limit when this edge last published; its share
        until the next sync is a part of that."""
        self._flights_left_at_sync: dict[Key, int] = {}
        """Per key, the places in flight left under ``max_concurrency`` when this edge last published."""

    # ---------------------------------------------------------------- admission

    def admit(self, checks: Iterable[tuple[Key, Limits]], tokens: int) -> Reservation:
        """Reserve one request and ``tokens`` under every ``(key, limits)``, or raise :class:`QuotaExceeded`
        without reserving anything."""
        checks = [(key, limits) for key, limits in checks if not limits.unlimited]
        now = self._clock()
        second = int(now)
        for key, limits in checks:
            refusal = self._refusal(key, limits, tokens, now)
            if refusal is not None:
                raise QuotaExceeded(refusal)
        keys = tuple(key for key, _ in checks)
        for key in keys:
            own = self._own.setdefault(key, _Own())
            bucket = own.buckets.setdefault(second, [0, 0])
            bucket[0] += 1
            bucket[1] += tokens
            own.in_flight += 1
            own.since_sync[0] += 1
            own.since_sync[1] += tokens
        return Reservation(keys=keys, second=second, tokens=tokens)

    def precheck(self, key: Key, limits: Limits, pending: int = 0) -> None:
        """Refuse before any work on the body when the tenant is already at a limit (nothing reserved).
        ``pending``: this edge's requests under ``key`` still being read and tokenised, counted as
        admitted (in flight and in the per-minute request count), so that a burst's bodies are not all
        read and tokenised for every request past the limit to be refused afterwards."""
        if not limits.unlimited:
            refusal = self._refusal(key, limits, 0, self._clock(), pending)
            if refusal is not None:
                raise QuotaExceeded(refusal)

    def reconcile(self, reservation: Reservation, actual_tokens: int) -> None:
        """Replace the tokens reserved with what the request used (if its second is still counted)."""
        delta = actual_tokens - reservation.tokens
        if delta == 0:
            return
        for key in reservation.keys:
            own = self._own.get(key)
            bucket = own.buckets.get(reservation.second) if own is not None else None
            if bucket is not None:
                bucket[1] = max(0, bucket[1] + delta)
        reservation.tokens = actual_tokens

    def refund(self, reservation: Reservation, *, request: bool) -> None:
        """Take back the tokens reserved (and with ``request`` the request itself) for a request that used
        none: one never published (the log refused it, a key in use), or a replay that generates nothing
        here. An audit: four retries in a broker outage used 92 of 100 tokens a minute with nothing on the
        log, and each idempotent replay reserved its prompt and ``max_tokens`` for good."""
        for key in reservation.keys:
            own = self._own.get(key)
            if own is None:
                continue
            bucket = own.buckets.get(reservation.second)
            if bucket is not None:
                bucket[0] = max(0, bucket[0] - int(request))
                bucket[1] = max(0, bucket[1] - reservation.tokens)
            own.since_sync[0] = max(0, own.since_sync[0] - int(request))
            own.since_sync[1] = max(0, own.since_sync[1] - reservation.tokens)
        reservation.tokens = 0

    def reacquire(self, reservation: Reservation) -> None:
        """A released request in flight again (the place of a request still running, given back by a
        flight that took it over and then did not take the request: :class:`ingest.admission.Admission`)."""
        if not reservation.released:
            return
        reservation.released = False
        for key in reservation.keys:
            self._own.setdefault(key, _Own()).in_flight += 1

    def release(self, reservation: Reservation) -> None:
        """The request is no longer in flight (idempotent)."""
        if reservation.released:
            return
        reservation.released = True
        for key in reservation.keys:
            own = self._own.get(key)
            if own is not None and own.in_flight > 0:
                own.in_flight -= 1

    def _refusal(self, key: Key, limits: Limits, tokens: int, now: float, pending: int = 0) -> Refusal | None:
        tenant, model = key
        scope = f"tenant {tenant}" if model == ALL_MODELS else f"tenant {tenant} on model {model}"
        requests, used_tokens, in_flight = self.used(key, now)
        in_flight += pending
        own = self._own.get(key) or _Own()
        edges = 1 + self._live_peers(now)
        if limits.max_concurrency is not None and in_flight + 1 > limits.max_concurrency:
            return Refusal(
                "concurrency_limit_exceeded",
                f"Too many concurrent requests for {scope} (limit {limits.max_concurrency}).",
                1.0,
            )
        if limits.max_concurrency is not None and edges > 1:
            # Between two syncs each edge takes its share of the places left at the last one, as for the
            # per-minute limits: a burst through E edges held E x the limit in flight (an audit).
            places = self._flights_left_at_sync.get(key, limits.max_concurrency)
            taken = max(0, own.in_flight - own.in_flight_at_sync) + pending
            if taken + 1 > max(1, math.ceil(places / edges)):
                return Refusal(
                    "concurrency_limit_exceeded",
                    f"Too many concurrent requests for {scope} (limit {limits.max_concurrency}, shared by "
                    f"{edges} edges).",
                    1.0,
                )
        for index, limit, need, used, unit in (
            (0, limits.requests_per_min, 1, requests, "requests"),
            (1, limits.tokens_per_min, tokens, used_tokens, "tokens"),
        ):
            if limit is None:
                continue
            if need > limit:
                return Refusal(
                    "tokens_exceed_limit",
                    f"This request needs {need} tokens, more than the {limit} per minute allowed for {scope}.",
                    float(self.window_s),
                )
            preparing = pending if index == 0 else 0
            if used + preparing + need > limit:
                over = used + need - limit  # past the limit without the requests in preparation
                return Refusal(
                    "rate_limit_exceeded",
                    f"Rate limit reached for {scope}: {limit} {unit} per minute.",
                    self._frees_in(key, index, over, now) if over > 0 else 1.0,
                )
            if edges == 1:
                continue
            left = self._left_at_sync.get(key, (limits.requests_per_min or 0, limits.tokens_per_min or 0))
            if own.since_sync[index] + preparing + need > max(need, math.ceil(left[index] / edges)):
                return Refusal(
                    "rate_limit_exceeded",
                    f"Rate limit reached for {scope}: {limit} {unit} per minute, shared by {edges} edges.",
                    1.0,
                )
        return None

    def _frees_in(self, key: Key, index: int, excess: int, now: float) -> float:
        """Seconds until this edge's oldest admissions leave the window and free ``excess`` (at least 1 s;
        a peer's part is not known by second, so a client may still be refused once more)."""
        own = self._own.get(key)
        oldest = int(now) - self.window_s + 1
        freed = 0
        if own is not None:
            for second in sorted(s for s in own.buckets if s >= oldest):
                freed += own.buckets[second][index]
                if freed >= excess:
                    return max(1.0, second + self.window_s - now)
        return float(self.window_s)

    def used(self, key: Key, now: float | None = None) -> tuple[int, int, int]:
        """(requests, tokens, in flight) for ``key`` over the window, this edge and its live peers."""
        now = self._clock() if now is None else now
        own = self._own.get(key)
        requests, tokens = own.totals(int(now) - self.window_s + 1) if own is not None else (0, 0)
        in_flight = own.in_flight if own is not None else 0
        for peer in self._peers.values():
            usage = peer.usage.get(key)
            if usage is None or now - peer.heard > self.window_s:
                continue
            requests += usage.requests
            tokens += usage.tokens
            if now - peer.heard <= self.peer_ttl_s:
                in_flight += usage.in_flight
        return requests, tokens, in_flight

    def _live_peers(self, now: float) -> int:
        return sum(1 for peer in self._peers.values() if now - peer.heard <= self.peer_ttl_s)

    # ---------------------------------------------------------------- sync

    def snapshot(self, limits_of: Callable[[Key], Limits | None]) -> QuotaSync:
        """This edge's window totals to publish now; the share of each key starts again from here."""
        now = self._clock()
        oldest = int(now) - self.window_s + 1
        usage: list[QuotaUsage] = []
        for key in list(self._own):
            own = self._own[key]
            own.prune(oldest)
            if own.idle:
                del self._own[key]
                self._left_at_sync.pop(key, None)
                self._flights_left_at_sync.pop(key, None)
                continue
            own.since_sync = [0, 0]
            own.in_flight_at_sync = own.in_flight
            requests, tokens = own.totals(oldest)
            usage.append(
                QuotaUsage(
                    tenant=key[0], model=key[1], requests=requests, tokens=tokens, in_flight=own.in_flight
                )
            )
        for key in {*self._own, *(k for p in self._peers.values() for k in p.usage)}:
            limits = limits_of(key)
            if limits is None:
                continue
            requests, tokens, in_flight = self.used(key, now)
            if limits.max_concurrency is not None:
                self._flights_left_at_sync[key] = max(0, limits.max_concurrency - in_flight)
            self._left_at_sync[key] = (
                max(0, (limits.requests_per_min or 0) - requests),
                max(0, (limits.tokens_per_min or 0) - tokens),
            )
        return QuotaSync(
            edge=self.instance, time_ms=self._wall_ms(), window_s=self.window_s, usage=tuple(usage)
        )

    def apply(self, sync: QuotaSync, age_s: float = 0.0) -> None:
        """A peer's snapshot, published ``age_s`` ago (read back at start: a restarted edge, or this edge's
        previous life, still counts for what it admitted); this edge's own ones are skipped, and the latest
        one of each peer replaces the one before."""
        if sync.edge == self.instance:
            return
        now = self._clock()
        heard = now - max(0.0, age_s)
        known = self._peers.get(sync.edge)
        if known is not None and known.heard > heard:
            return
        self._peers[sync.edge] = _Peer(heard=heard, usage={(u.tenant, u.model): u for u in sync.usage})
        for edge in [e for e, p in self._peers.items() if now - p.heard > self.window_s]:
            del self._peers[edge]

    @property
    def peers(self) -> list[str]:
        now = self._clock()
        return sorted(e for e, p in self._peers.items() if now - p.heard <= self.peer_ttl_s)
