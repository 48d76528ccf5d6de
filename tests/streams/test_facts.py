"""A terminal event's fact row and its price: a batch line carries its line and the batch price, exactly;
every other request's row is what it was."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from schemas.events import BatchRef, RequestFinished, Timings, Usage
from schemas.ids import uuid7_unix_ms
from streams.facts import FACT_COLUMNS, fact_row, usage_record
from streams.pricing import ModelPrice, PriceTable, PricingError, load_prices
from tests.streams.test_audit import REQUEST_ID, finished

PRICES = PriceTable(default=ModelPrice(prompt=150, completion=601, worker_second=0), models={})
LINE = BatchRef(batch_id="batch_42", custom_id="request-7", index=7, attempt=1)
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def row(event: RequestFinished, prices: PriceTable = PRICES) -> dict[str, object]:
    return dict(zip(FACT_COLUMNS, fact_row(event, prices), strict=True))


def test_a_request_that_is_no_batch_line_is_priced_in_full_and_names_no_batch() -> None:
    fact = row(finished(usage=Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10)))
    assert fact["cost_nanos"] == 3 * 150 + 7 * 601  # 4657
    assert (fact["batch_id"], fact["batch_custom_id"], fact["batch_index"], fact["batch_attempt"]) == (
        "",
        "",
        -1,
        0,
    )


def test_a_batch_line_names_its_line_and_is_billed_at_the_batch_price() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10)
    plain = row(finished(usage=usage))
    fact = row(finished(usage=usage, batch=LINE))
    assert (fact["batch_id"], fact["batch_custom_id"], fact["batch_index"], fact["batch_attempt"]) == (
        "batch_42",
        "request-7",
        7,
        1,
    )
    # Half of 4657 nano-USD, rounded down to the nano-USD: an exact integer.
    assert fact["cost_nanos"] == 2328
    assert isinstance(fact["cost_nanos"], int)
    assert {k: v for k, v in fact.items() if not k.startswith("batch_") and k != "cost_nanos"} == {
        k: v for k, v in plain.items() if not k.startswith("batch_") and k != "cost_nanos"
    }


@pytest.mark.parametrize(
    ("status", "cost"), [("completed", 4657), ("cancelled", 4657), ("expired", 4657), ("failed", 0)]
)
def test_a_failed_request_is_billed_nothing_and_keeps_its_tokens(status: str, cost: int) -> None:
    """Found by an audit: a batch line that failed out of memory and completed on its retry was billed for
    both runs, where the docs promise a line once; an interactive failure (a 5xx to its client) was billed
    too. A failure is the platform's: nothing billed, as OpenAI bills no 5xx. A cancelled or expired
    request used what it used."""
    usage = Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10)
    ran = Timings(started=datetime(2026, 11, 30, 12, 0, tzinfo=UTC))
    for line in (None, LINE):
        fact = row(finished(usage=usage, status=status, batch=line, timings=ran))
        assert fact["cost_nanos"] == (cost if line is None else cost // 2)
        assert (fact["prompt_tokens"], fact["completion_tokens"]) == (3, 7)


@pytest.mark.parametrize("status", ["cancelled", "expired"])
def test_a_request_no_model_ever_took_is_billed_nothing(status: str) -> None:
    """Found by an audit: a cancelled batch's queued lines (and an expired batch's) were billed for their
    prompt tokens, which the worker counts but no model processed; the docs say lines not yet run never
    run, and a cancelled request is billed for what it used."""
    usage = Usage(prompt_tokens=3, completion_tokens=0, total_tokens=3)
    for line in (None, LINE):
        fact = row(finished(usage=usage, status=status, batch=line))  # no started time: never run
        assert fact["cost_nanos"] == 0
        assert fact["prompt_tokens"] == 3


@pytest.mark.parametrize(("percent", "cost"), [(0, 4657), (25, 3492), (50, 2328), (100, 0)])
def test_the_discount_comes_from_the_price_table(percent: int, cost: int) -> None:
    prices = msgspec.structs.replace(PRICES, batch_discount_percent=percent)
    assert prices.cost_nanos("demo-gpt", 3, 7, batch=True) == cost
    assert prices.cost_nanos("demo-gpt", 3, 7) == 4657  # requests that are no batch line: never
    usage = Usage(prompt_tokens=3, completion_tokens=7, total_tokens=10)
    assert row(finished(usage=usage, batch=LINE), prices)["cost_nanos"] == cost


def test_sums_of_discounted_lines_stay_exact() -> None:
    lines = [PRICES.cost_nanos("demo-gpt", p, c, batch=True) for p in range(0, 40) for c in range(0, 40)]
    full = [PRICES.cost_nanos("demo-gpt", p, c) for p in range(0, 40) for c in range(0, 40)]
    assert all(isinstance(cost, int) for cost in lines)
    assert all(f // 2 == cost for f, cost in zip(full, lines, strict=True))  # each line rounds down
    assert sum(full) // 2 - sum(lines) <= len(lines)  # at most a nano-USD per line in the client's favour


def test_the_discount_is_read_from_the_price_file(tmp_path: Path) -> None:
    path = tmp_path / "prices.toml"
    path.write_text('version = "v"\nbatch_discount_percent = 40\n[default]\nprompt = 100\ncompletion = 400\n')
    assert load_prices(path).batch_discount_percent == 40
    assert load_prices(None).batch_discount_percent == 50
    path.write_text('version = "v"\nbatch_discount_percent = 101\n')
    with pytest.raises(PricingError, match="batch_discount_percent"):
        load_prices(path)
    path.write_text('version = "v"\nbatch_discount_percent = 12.5\n')
    with pytest.raises(PricingError, match="batch_discount_percent"):
        load_prices(path)


def test_a_price_past_what_a_cost_can_hold_is_refused(tmp_path: Path) -> None:
    """Found by an audit: a price of 1e23 micro-USD loaded, and a cost past UInt64 was stored wrapped."""
    path = tmp_path / "prices.toml"
    path.write_text('version = "v"\n[default]\nprompt = 99999999999999999999999\ncompletion = 400\n')
    with pytest.raises(PricingError, match="prompt"):
        load_prices(path)
    path.write_text('version = "v"\n[default]\nprompt = 1000000000\ncompletion = 400\n')
    biggest = load_prices(path)
    assert biggest.cost_nanos("m", 2**32 - 1, 2**32 - 1, 86_400_000) < 2**64


def test_an_event_dated_before_1970_versions_0_not_a_negative_number() -> None:
    """``version`` is a UInt64 column: a negative one fails the sink's whole insert, on every retry."""
    from datetime import UTC, datetime

    early = row(finished(time=datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)))
    assert early["version"] == 0
    epoch = row(finished(time=datetime(1970, 1, 1, 0, 0, 1, tzinfo=UTC)))
    assert epoch["version"] == 1000


def test_a_worker_time_off_a_wrong_clock_cannot_price_past_what_a_cost_can_hold() -> None:
    """Found by review: worker time is read off the worker's clock; a start stamped in 1970 at the highest
    price made a cost of ~1.8e21 nano-USD, stored wrapped in the UInt64 column. It is priced for a week at
    most (``MAX_WORKER_MS``)."""
    from schemas.prices import MAX_MICROS
    from streams.facts import MAX_WORKER_MS

    prices = PriceTable(default=ModelPrice(worker_second=MAX_MICROS), models={})
    now = datetime(2026, 11, 22, 9, 30, tzinfo=UTC)
    wrong = finished(timings=Timings(started=datetime(1970, 1, 1, tzinfo=UTC), finished=now))
    fact = row(wrong, prices)
    assert fact["worker_ms"] == MAX_WORKER_MS
    assert isinstance(fact["cost_nanos"], int)
    assert fact["cost_nanos"] < 2**64
    biggest = prices.cost_nanos("m", 2**32 - 1, 2**32 - 1, MAX_WORKER_MS)
    assert biggest < 2**64


def test_a_usage_record_names_its_batch_and_carries_its_requests_trace() -> None:
    """A billing consumer reconciles a batch's lines by the batch id of their records, and follows a charge
    to its request through the trace context: a record without them matches neither."""
    traced = {"traceparent": TRACEPARENT, "tracestate": "vendor=1"}
    line = usage_record(finished(batch=LINE, **traced), PRICES, source="streams/test")
    plain = usage_record(finished(**traced), PRICES, source="streams/test")
    assert line is not None
    assert plain is not None
    assert (line.batch_id, plain.batch_id) == ("batch_42", None)
    assert (line.traceparent, line.tracestate) == (TRACEPARENT, "vendor=1")


def test_a_usage_records_id_is_a_pinned_function_of_its_tenant_and_request() -> None:
    """A billing consumer drops a copy of a record (a redelivery, a replay by a later release) by its id,
    so the id must be the same on every build; it is dated when the request was accepted."""
    record = usage_record(finished(), PRICES, source="streams/a")
    again = usage_record(finished(time=datetime(2026, 12, 1, tzinfo=UTC)), PRICES, source="streams/b")
    other = usage_record(finished(tenant="globex"), PRICES, source="streams/a")
    assert record is not None
    assert again is not None
    assert other is not None
    assert record.id == again.id == "01a1ee56-5e00-7215-8e8b-9a524ca1d2da"
    assert uuid7_unix_ms(record.id) == uuid7_unix_ms(REQUEST_ID)
    assert other.id != record.id  # the key names the tenant, as the audit entry's does
