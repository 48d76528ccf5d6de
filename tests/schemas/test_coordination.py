from __future__ import annotations

import msgspec
import pytest

from ingest.idempotency import ClaimTable
from schemas.codec import UNREADABLE_JSON
from schemas.coordination import (
    IdempotencyClaim,
    QuotaSync,
    QuotaUsage,
    decode_claim,
    decode_quota,
    encode_coordination,
    key_digest,
)

HUGE = 10**400
NOW_MS = 1_796_000_000_000


def claim(**change: object) -> IdempotencyClaim:
    fields: dict[str, object] = {
        "tenant": "acme",
        "key_sha256": key_digest("order-7"),
        "request_id": "r",
        "body_hash": "h",
        "edge": "e",
        "reply_partition": 0,
        "time_ms": NOW_MS,
    }
    return IdempotencyClaim(**{**fields, **change})  # type: ignore[arg-type]


def sync(**change: object) -> QuotaSync:
    usage = (QuotaUsage(tenant="acme", model="*", requests=1, tokens=10, in_flight=0),)
    fields: dict[str, object] = {"edge": "peer", "time_ms": NOW_MS, "window_s": 60.0, "usage": usage}
    return QuotaSync(**{**fields, **change})  # type: ignore[arg-type]


def test_records_round_trip() -> None:
    assert decode_claim(encode_coordination(claim())) == claim()
    assert decode_quota(encode_coordination(sync())) == sync()


@pytest.mark.parametrize(
    "change", [{"time_ms": HUGE}, {"time_ms": -1}, {"reply_partition": -1}, {"reply_partition": 2**31}]
)
def test_a_claim_out_of_bounds_is_unreadable(change: dict[str, object]) -> None:
    """``time_ms = 10**400`` decoded, and every request carrying the claimed key was a 500 (the table's
    float arithmetic raised; a review): such a record is skipped like one that is not JSON."""
    value = encode_coordination(claim(**change))
    with pytest.raises(UNREADABLE_JSON):
        decode_claim(value)
    table = ClaimTable()
    table.apply(decode_claim(encode_coordination(claim(time_ms=2**53))))
    assert table.get("acme", key_digest("order-7"), NOW_MS) is not None


@pytest.mark.parametrize(
    "change",
    [{"time_ms": HUGE}, {"time_ms": -5}, {"window_s": 0.0}, {"window_s": 1e300}, {"window_s": -60.0}],
)
def test_a_quota_snapshot_out_of_bounds_is_unreadable(change: dict[str, object]) -> None:
    """Read back at an edge's start, ``time_ms = 10**400`` stopped the quota reader, and the edge failed at
    every start within that minute (a review)."""
    with pytest.raises(UNREADABLE_JSON):
        decode_quota(encode_coordination(sync(**change)))


def test_a_usage_count_past_int64_is_unreadable() -> None:
    usage = (QuotaUsage(tenant="acme", model="*", requests=HUGE, tokens=1, in_flight=0),)
    with pytest.raises(UNREADABLE_JSON):
        decode_quota(msgspec.json.encode(sync(usage=usage)))
