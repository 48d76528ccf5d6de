"""What edges tell each other through the log, so that limits and idempotency hold across edges.

These are coordination records, not domain events: they do not describe a request's life, the warehouse
does not keep them, and they are not in the event union (``schemas.events.Event``). Each is a frozen msgspec
struct encoded as JSON on its own topic (``TopicNames.quota``, ``TopicNames.idempotency``).
"""

from __future__ import annotations

import hashlib
from typing import Annotated

import msgspec

NonNegative = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
TimeMs = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
"""Unix milliseconds, exact as a float: ``10**400`` decoded, and the edge's float arithmetic on it raised
in the quota reader (the edge failed, again at each start within the minute) and for every request with
the claimed key (a 500): a review. A record with another is skipped like one that is not JSON."""


class QuotaUsage(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """One edge's admissions for one (tenant, model) over the trailing window, and what it runs now.
    ``model`` is ``"*"`` for the tenant's total over every model."""

    tenant: str
    model: str
    requests: NonNegative
    tokens: NonNegative
    """Reserved at admission (prompt + max_tokens), replaced by the actual usage once the request ended."""
    in_flight: NonNegative


class QuotaSync(msgspec.Struct, frozen=True, kw_only=True):
    """An edge's whole trailing-window usage, published every sync interval (a snapshot, not a delta: a
    lost or repeated record changes nothing, and the latest one of an edge replaces the ones before)."""

    edge: str
    """The edge's instance: its id plus a per-process nonce (a restarted edge is another instance)."""
    time_ms: TimeMs
    window_s: Annotated[float, msgspec.Meta(gt=0.0, le=86_400.0 * 366)]
    usage: tuple[QuotaUsage, ...] = ()


class IdempotencyClaim(msgspec.Struct, frozen=True, kw_only=True):
    """An edge claims ``key`` for ``request_id``; in log order, the first claim of a key wins."""

    tenant: str
    key_sha256: str
    request_id: str
    body_hash: str
    edge: str
    reply_partition: Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
    """The replies partition of the edge that submitted it: where any edge can replay its stream from."""
    time_ms: TimeMs


_QUOTA = msgspec.json.Decoder(QuotaSync)
_CLAIM = msgspec.json.Decoder(IdempotencyClaim)


def encode_coordination(record: QuotaSync | IdempotencyClaim) -> bytes:
    return msgspec.json.encode(record)


def decode_quota(value: bytes) -> QuotaSync:
    """Raises ``msgspec.DecodeError`` / ``msgspec.ValidationError`` for anything else."""
    return _QUOTA.decode(value)


def decode_claim(value: bytes) -> IdempotencyClaim:
    return _CLAIM.decode(value)


def claim_key(tenant: str, key: str) -> bytes:
    """The Kafka key of a claim: tenant plus the sha256 of the idempotency key (keys are never stored),
    so all claims of one key land on one partition, in order."""
    return f"{tenant}\x00{key_digest(key)}".encode()


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()
