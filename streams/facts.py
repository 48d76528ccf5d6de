"""A terminal event becomes its request's row in ``request_facts``: timings, tokens, cost, ids.

``RequestFinished`` carries everything (the worker copies what the request said into it), so a fact is a
pure function of one event and the prices (the table in force when the request was accepted, from the
price history on the log: :class:`streams.pricing.PriceHistory`): a redelivered event gives the same row,
and a replay of the log gives the same table.

A batch line's terminal event names its line (``RequestFinished.batch``): its row carries the batch id,
custom id, index and attempt, and its cost is the batch price (:meth:`PriceTable.cost_nanos`, ``batch``).
Other rows have batch id ``''``, index -1 and attempt 0.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NamedTuple

from schemas.events import RequestFinished, UsageRecorded
from schemas.ids import derived_uuid7, uuid7_unix_ms
from streams.pricing import Prices

FACT_COLUMNS = (
    "request_id", "tenant", "model", "model_version", "kind", "stream", "edge_id", "worker_id", "status",
    "finish_reason", "error_code", "accepted", "started", "first_token", "finished", "queue_wait_ms",
    "ttft_ms", "itl_mean_ms", "itl_max_ms", "e2e_ms", "prompt_tokens", "completion_tokens", "worker_ms",
    "cost_nanos", "price_version", "idempotency_key", "trace_id", "version", "shadow_of", "batch_id",
    "batch_custom_id", "batch_index", "batch_attempt",
)  # fmt: skip


def accepted_at(event: RequestFinished) -> datetime:
    """When the edge accepted the request: the request id's UUIDv7 time (the same in every copy)."""
    try:
        return datetime.fromtimestamp(uuid7_unix_ms(event.request_id) / 1000, UTC)
    except ValueError:
        return event.timings.accepted or event.time


def _ms(later: datetime | None, earlier: datetime | None) -> float | None:
    if later is None or earlier is None:
        return None
    return max(0.0, (later - earlier).total_seconds() * 1000)


def trace_id(traceparent: str | None) -> str:
    parts = (traceparent or "").split("-")
    return parts[1] if len(parts) == 4 else ""


MAX_WORKER_MS = 7 * 86_400 * 1000
"""The most worker time a request is priced for (the longest batch window): with the prices' and the
token counts' bounds, its cost stays within ``request_facts.cost_nanos`` (UInt64)."""


class Billed(NamedTuple):
    """What a terminal event is billed, by the table in force when its request was accepted."""

    accepted: datetime
    worker_ms: int
    cost_nanos: int
    price_version: str


def billed(event: RequestFinished, prices: Prices) -> Billed:
    """The cost of a terminal event's request (its fact row's and its usage record's)."""
    timings = event.timings
    accepted = accepted_at(event)
    table = prices.at(accepted)
    finished = timings.finished or event.time
    # Never past a week: read off the worker's clock, a start stamped in 1970 priced a request past UInt64,
    # stored wrapped (a review).
    worker_ms = round(min(_ms(finished, timings.started) or 0.0, MAX_WORKER_MS))
    # A request that failed (the platform's failure: out of memory, a retired version, an engine error) is
    # not billed, as OpenAI bills no 5xx; its tokens are still counted. A batch line retried after such a
    # failure was billed for each attempt, where the docs promised once a line (an audit). A cancelled or
    # expired request is billed for what it used: nothing if no model ever took it (its prompt tokens are
    # counted, not processed; an audit found a cancelled batch's queued lines billed for them).
    unrun = event.status in ("cancelled", "expired") and timings.started is None
    cost = (
        0
        if event.status == "failed" or unrun
        else table.cost_nanos(
            event.model,
            event.usage.prompt_tokens,
            event.usage.completion_tokens,
            worker_ms,
            batch=event.batch is not None,
        )
    )
    return Billed(accepted, worker_ms, cost, table.version)


def usage_record(event: RequestFinished, prices: Prices, *, source: str) -> UsageRecorded | None:
    """The cost ledger's entry for a terminal event, for the ``usage`` topic; ``None`` for a shadow copy
    (never billed). Its id is the same for every build (a redelivery, a replay)."""
    if event.shadow_of is not None:
        return None
    bill = billed(event, prices)
    return UsageRecorded(
        id=derived_uuid7(
            int(bill.accepted.timestamp() * 1000), f"usage\x00{event.tenant}\x00{event.request_id}"
        ),
        time=event.time,
        tenant=event.tenant,
        model=event.model,
        request_id=event.request_id,
        source=source,
        traceparent=event.traceparent,
        tracestate=event.tracestate,
        prompt_tokens=event.usage.prompt_tokens,
        completion_tokens=event.usage.completion_tokens,
        worker_seconds=bill.worker_ms / 1000,
        cost_micros=bill.cost_nanos // 1000,
        cost_nanos=bill.cost_nanos,
        price_version=bill.price_version,
        model_version=event.model_version,
        status=event.status,
        batch_id=event.batch.batch_id if event.batch is not None else None,
    )


def fact_row(event: RequestFinished, prices: Prices) -> list[Any]:
    """The ``request_facts`` row of a terminal event, in :data:`FACT_COLUMNS` order, priced by the table in
    force when the request was accepted."""
    timings = event.timings
    accepted, worker_ms, cost, price_version = billed(event, prices)
    finished = timings.finished or event.time
    generation = event.kind != "embedding"
    first_token = timings.first_token if generation else None
    completion = event.usage.completion_tokens
    decode_ms = _ms(finished, first_token)
    line = event.batch
    return [
        event.request_id,
        event.tenant,
        event.model,
        event.model_version,
        event.kind,
        event.stream,
        event.edge_id,
        event.worker_id,
        event.status,
        event.finish_reason or "",
        event.error.code if event.error is not None else "",
        accepted,
        timings.started,
        first_token,
        finished,
        _ms(timings.started, accepted),
        _ms(first_token, accepted),
        decode_ms / (completion - 1) if decode_ms is not None and completion >= 2 else None,
        event.max_inter_token_s * 1000 if event.max_inter_token_s is not None else None,
        _ms(finished, accepted) or 0.0,
        event.usage.prompt_tokens,
        completion,
        float(worker_ms),
        cost,
        price_version,
        event.idempotency_key or "",
        trace_id(event.traceparent),
        max(0, int(event.time.timestamp() * 1000)),  # a UInt64 column: an event before 1970 versions 0
        event.shadow_of or "",
        line.batch_id if line is not None else "",
        line.custom_id if line is not None else "",
        line.index if line is not None else -1,
        line.attempt if line is not None else 0,
    ]
