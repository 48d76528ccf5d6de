"""Idempotency keys shared by every edge and kept across restarts: the claims on the ``idempotency`` topic.

An edge that gets a request with a new ``Idempotency-Key`` publishes a claim (key: tenant + sha256 of the
key, so every claim of one key lands on one partition, in order) and waits until its own reader of the
topic has passed it; the **first claim of the key in log order wins**, on every edge alike. The loser
replays the winner's stream (the claim names the replies partition it is answered on). A request whose
publish fails after its claim won withdraws the claim (a tombstone), so a retry with the key can run.

:class:`ClaimTable` is the reader's state: pure, per tenant bounded (one tenant cannot push out another's
keys), claims expire ``ttl_s`` after they were made.
"""

from __future__ import annotations

from collections import OrderedDict

from schemas.coordination import IdempotencyClaim

DAY_S = 24 * 3600.0


class ClaimTable:
    def __init__(self, *, per_tenant: int = 10_000, ttl_s: float = DAY_S) -> None:
        self._per_tenant = per_tenant
        self._ttl_ms = ttl_s * 1000
        self._tenants: dict[str, OrderedDict[str, IdempotencyClaim]] = {}
        self._by_request: dict[str, IdempotencyClaim] = {}

    def apply(self, claim: IdempotencyClaim) -> IdempotencyClaim:
        """A claim read from the log: it wins unless a claim of the key came before it and had not expired
        when this one was made (judged by the claims' times, so every reader of the log decides alike: by
        the time of reading, an edge started a day later handed the key to a claim that had lost, a
        review). Returns the claim that holds the key now."""
        claims = self._tenants.setdefault(claim.tenant, OrderedDict())
        held = claims.get(claim.key_sha256)
        if held is not None and not self._expired(held, claim.time_ms):
            return held
        if held is not None:  # expired: the key is free again
            del claims[claim.key_sha256]
            self._by_request.pop(held.request_id, None)
        claims[claim.key_sha256] = claim
        self._by_request[claim.request_id] = claim
        while len(claims) > self._per_tenant:
            _, oldest = claims.popitem(last=False)
            self._by_request.pop(oldest.request_id, None)
        return claim

    def withdraw(self, tenant: str, key_sha256: str) -> None:
        """A tombstone: the key is free again."""
        self._drop(tenant, key_sha256)

    def get(self, tenant: str, key_sha256: str, now_ms: float) -> IdempotencyClaim | None:
        claims = self._tenants.get(tenant)
        held = claims.get(key_sha256) if claims is not None else None
        return None if held is None or self._expired(held, now_ms) else held

    def by_request(self, tenant: str, request_id: str) -> IdempotencyClaim | None:
        """The claim that named ``request_id``, if it is ``tenant``'s (another tenant's looks unknown)."""
        claim = self._by_request.get(request_id)
        return claim if claim is not None and claim.tenant == tenant else None

    def __len__(self) -> int:
        return sum(len(claims) for claims in self._tenants.values())

    def _expired(self, claim: IdempotencyClaim, now_ms: float) -> bool:
        return now_ms - claim.time_ms > self._ttl_ms

    def _drop(self, tenant: str, key_sha256: str) -> None:
        claims = self._tenants.get(tenant)
        held = claims.pop(key_sha256, None) if claims is not None else None
        if held is not None:
            self._by_request.pop(held.request_id, None)
        if claims is not None and not claims:
            del self._tenants[tenant]
