"""Events into rows for async batches: a batch's states become its ``batches`` row (and ``events_raw``
rows), the latest state winning on ``seq`` in a real warehouse; a batch line's content is not stored."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from infra.warehouse.client import Client
from schemas.codec import decode, encode
from schemas.events import (
    BatchItemRequested,
    BatchRef,
    BatchStateChanged,
    DriftFeatures,
    ErrorInfo,
    GenerationRequested,
    RequestFinished,
    SamplingParams,
    Timings,
)
from schemas.ids import uuid7_from_parts
from schemas.topics import TopicNames
from streams.audit import request_entry
from streams.pricing import PriceTable
from streams.sink import BATCH_COLUMNS, Batch, Consumed, Rows, batch_row, insert, insert_rows, table_rows
from tests.streams.test_audit import finished
from tests.streams.test_queries import a_rollout, batch_state, drift_report, migrated_warehouse, rows

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def records(*events: Any, topic: str = "p.batches") -> list[Consumed]:
    return [Consumed(topic, 0, i, encode(e)) for i, e in enumerate(events)]


def test_a_batch_state_becomes_its_batches_row_and_an_events_raw_row() -> None:
    state = batch_state(3, "completed", completed=9, failed=1, errors=2)
    out = Rows(PriceTable()).batch(records(state))
    assert (len(out.raw), len(out.facts), len(out.audit)) == (1, 0, 0)
    (raw,) = out.raw
    assert (raw[1], raw[3], raw[8]) == ("batch_state_changed", "acme", "p.batches")
    assert decode(raw[7].encode()) == state  # nothing of a state is content: stored whole
    (row,) = out.batches
    got = dict(zip(BATCH_COLUMNS, row, strict=True))
    assert {k: got[k] for k in ("tenant", "batch_id", "seq", "status", "model", "total", "completed")} == {
        "tenant": "acme",
        "batch_id": "batch_1",
        "seq": 3,
        "status": "completed",
        "model": "demo-gpt",
        "total": 10,
        "completed": 9,
    }
    assert (got["failed"], got["error_count"], got["event_id"]) == (1, 2, state.id)
    assert (got["output_file_id"], got["error_file_id"]) == ("file-out-batch_1", "")
    assert (got["completed_at"], got["failed_at"], got["cancelled_at"]) == (
        T0 + timedelta(seconds=3),
        None,
        None,
    )
    assert (
        msgspec.json.decode(got["errors"])
        == [{"code": "invalid_json", "message": "line 3", "line": 3, "param": None}] * 2
    )
    assert got["metadata"] == '{"by":"ci","job":"nightly"}'  # sorted keys: the same bytes on every replay


def test_a_batch_lines_content_is_not_stored_unless_asked() -> None:
    request = GenerationRequested(
        tenant="acme",
        model="demo-gpt",
        source="ingest/edge-1",
        model_version="v1",
        input_ids=[1, 2, 3],
        prompt="the secret prompt",
        sampling=SamplingParams(max_tokens=4),
    )
    line = BatchItemRequested.of(
        request, BatchRef(batch_id="b", custom_id="c", index=0), total=1, endpoint="/v1/completions"
    )
    (raw,) = Rows(PriceTable()).batch(records(line, topic="p.requests.demo-gpt")).raw
    stored = decode(raw[7].encode())
    assert isinstance(stored, BatchItemRequested)
    assert (stored.prompt, stored.input_ids, stored.texts, stored.inputs) == (None, [], None, None)
    assert (stored.batch_id, stored.custom_id, stored.total) == ("b", "c", 1)
    (kept,) = Rows(PriceTable(), store_content=True).batch(records(line, topic="p.requests.demo-gpt")).raw
    assert decode(kept[7].encode()) == line


def test_a_batch_lines_terminal_event_is_a_fact_with_its_line() -> None:
    line = BatchRef(batch_id="batch_1", custom_id="r-1", index=4)
    out = Rows(PriceTable()).batch(records(finished(batch=line), topic="p.results"))
    (fact,) = out.facts
    assert fact[-4:] == ["batch_1", "r-1", 4, 0]
    assert out.batches == []
    assert out.drift == []  # batch lines are not live traffic: drift windows leave them out
    assert len(Rows(PriceTable()).batch(records(finished(), topic="p.results")).drift) == 1


def test_a_shadow_copy_ended_unrun_is_a_fact_but_no_drift_row() -> None:
    """A shadow copy whose candidate stopped serving ends cancelled, named after the stable version: its
    fact is kept (it ended), but it says nothing of either version's answers (a review saw 2 % of them in a
    window report the stable version drifted in status and finish reason)."""
    dropped = msgspec.structs.replace(
        finished(),
        shadow_of="0190b3f4-0000-7000-8000-000000000001",
        status="cancelled",
        finish_reason="cancelled",
    )
    out = Rows(PriceTable()).batch(records(dropped, topic="p.results"))
    assert len(out.facts) == 1
    assert out.drift == []
    answered = msgspec.structs.replace(dropped, status="completed", finish_reason="stop")
    assert len(Rows(PriceTable()).batch(records(answered, topic="p.results")).drift) == 1


# ---------------------------------------------------------------- in a warehouse


@pytest.fixture
def warehouse(tmp_path: Path) -> Iterator[Client]:
    with migrated_warehouse(tmp_path / "data") as client:
        yield client


LATEST = "SELECT batch_id, seq, status, completed, failed FROM batches FINAL ORDER BY tenant, batch_id"


def store(client: Client, *events: BatchStateChanged | RequestFinished) -> None:
    """One sink batch: its rows, inserted as the sink inserts them."""
    insert(client, Rows(PriceTable()).batch(records(*events)))


@pytest.mark.integration
def test_the_batches_table_keeps_each_batchs_latest_state(warehouse: Client) -> None:
    store(
        warehouse,
        batch_state(0, "validating", total=0),
        batch_state(0, "validating", batch_id="batch_2", total=0),
        batch_state(1, "in_progress"),
    )
    store(warehouse, batch_state(2, "in_progress", completed=4, failed=1))
    store(warehouse, batch_state(1, "in_progress", batch_id="batch_2", total=3))
    assert rows(warehouse, LATEST) == [
        {"batch_id": "batch_1", "seq": 2, "status": "in_progress", "completed": 4, "failed": 1},
        {"batch_id": "batch_2", "seq": 1, "status": "in_progress", "completed": 0, "failed": 0},
    ]
    # A redelivered older state (the sink re-doing a batch after a crash) does not win, before or after a
    # merge; the state that follows does.
    store(warehouse, batch_state(1, "in_progress"), batch_state(0, "validating", total=0))
    assert rows(warehouse, LATEST)[0] == {
        "batch_id": "batch_1",
        "seq": 2,
        "status": "in_progress",
        "completed": 4,
        "failed": 1,
    }
    warehouse.command("OPTIMIZE TABLE batches FINAL")
    assert rows(warehouse, "SELECT count() AS n FROM batches")[0]["n"] == 2
    assert rows(warehouse, LATEST)[0]["seq"] == 2
    store(warehouse, batch_state(3, "completed", completed=9, failed=1))
    (done, _) = rows(warehouse, LATEST)
    assert (done["seq"], done["status"], done["completed"], done["failed"]) == (3, "completed", 9, 1)


@pytest.mark.integration
def test_batch_rows_have_the_migrations_columns(warehouse: Client) -> None:
    insert(warehouse, Batch(batches=[batch_row(batch_state(3, "completed", completed=10, errors=1))]))
    (got,) = rows(warehouse, "SELECT * FROM batches FINAL")
    assert list(got) == list(BATCH_COLUMNS)  # every column, in the table's order
    assert got["output_file_id"] == "file-out-batch_1"
    assert got["in_progress_at"] == T0 + timedelta(seconds=1)
    assert got["expired_at"] is None
    assert got["error_count"] == 1


TRICKY = 'naïve "quoted" \\ back\nnew\ttab \x01 \u2028 🚀 日本'


def every_table(now: datetime) -> Batch:
    """Rows for all seven tables from events as the sink and replay see them: content kept (so a payload
    holds quotes, escapes, control and non-ASCII characters), times with sub-millisecond parts up to the
    last microsecond, NULLs, float32 vectors, arrays, JSON text."""
    late = now.replace(microsecond=999_999)
    features = DriftFeatures(
        prompt_chars=12, prompt_script="latin", prompt_non_ascii=0.1, mean_logprob=-1.0 / 3,
        embedding=[0.1, -0.2, 1e-7, 3.4028234663852886e38, -0.0],
    )  # fmt: skip
    events: list[Any] = [
        finished(time=late, text=TRICKY, idempotency_key=TRICKY, features=features),
        finished(
            time=now,
            request_id=uuid7_from_parts(int(now.timestamp() * 1000), 9),
            status="failed",
            finish_reason="error",
            error=ErrorInfo(code="worker_error", message=TRICKY),
            timings=Timings(accepted=now, started=now + timedelta(microseconds=999), finished=late),
            max_inter_token_s=0.0123456789,
            batch=BatchRef(batch_id="batch_1", custom_id=TRICKY, index=3),
        ),
        request_entry(None, finished(time=late), source="streams/worker", extra={"note": TRICKY}),
        drift_report(window_end=now, drifted=["prompt_tokens"], quality=[TRICKY]),
        *a_rollout(now),
        batch_state(3, "completed", completed=9, failed=1, errors=2, created_at=late),
    ]
    topics = ["p.results", "p.results", "p.audit", "p.drift", *["p.control"] * 4, "p.batches"]
    consumed = [Consumed(t, 0, i, encode(e)) for i, (t, e) in enumerate(zip(topics, events, strict=True))]
    return Rows(PriceTable(), store_content=True, decisions_from_topic=True).batch(consumed)


@pytest.mark.integration
def test_every_table_holds_what_clickhouse_connects_own_insert_writes(warehouse: Client) -> None:
    """The sink's JSON rows (``insert_rows``) against clickhouse-connect's Native ``insert``, the oracle:
    the same rows in two copies of each table, compared value for value in the engine."""
    batch = every_table(datetime.now(UTC))
    for table, table_rows_, columns in table_rows(batch):
        assert table_rows_, f"no {table} rows to compare"
        for copy in ("native", "json"):
            warehouse.command(f"CREATE TABLE {copy}_{table} AS {table} ENGINE = MergeTree ORDER BY tuple()")
        warehouse.insert(f"native_{table}", table_rows_, column_names=columns)
        insert_rows(warehouse, f"json_{table}", table_rows_, columns)
        for a, b in (("native", "json"), ("json", "native")):
            (missing,) = warehouse.query(
                f"SELECT count() FROM (SELECT * FROM {a}_{table} EXCEPT ALL SELECT * FROM {b}_{table})"
            ).result_rows[0]
            assert missing == 0, f"{table}: {missing} {a} rows differ in the {b} copy"
        assert rows(warehouse, f"SELECT count() AS n FROM json_{table}")[0]["n"] == len(table_rows_)
    (raw,) = rows(warehouse, "SELECT payload FROM json_events_raw WHERE type = 'request_finished' LIMIT 1")
    stored = decode(raw["payload"].encode())
    assert isinstance(stored, RequestFinished)
    assert stored.text == TRICKY


def test_a_terminal_event_read_off_another_topic_is_set_aside_not_billed() -> None:
    """Found by an audit: a ``RequestFinished`` produced by mistake to ``usage``, ``cancels`` or a request
    topic was billed (its ``request_facts`` row counted in the tenant's spend and budget) and audited
    nowhere (only ``results`` feeds the audit chains)."""
    sink = Rows(PriceTable(), topics=TopicNames("p"))
    for topic in ("p.usage", "p.cancels", "p.requests.demo-gpt"):
        out = sink.batch(records(finished(), topic=topic))
        assert (out.facts, out.drift, out.events) == ([], [], [])
        ((_, why),) = out.undecodable  # dead-lettered by the sink
        assert f"a terminal event on {topic}: only p.results carries them" in str(why)
    assert len(sink.batch(records(finished(), topic="p.results")).facts) == 1


def test_a_decision_read_off_another_topic_makes_no_row_of_its_table() -> None:
    """Found by an audit: a replay wrote an audit entry found on ``usage`` (misrouted, or forged) into
    ``audit_log``, where the live worker never does, and ``sluice audit verify`` failed on the rebuilt
    warehouse; drift reports, deployments and batch states were taken from any topic too."""
    when = datetime.now(UTC)
    entry = request_entry(None, finished(), source="streams/worker")
    carried = [
        (entry, "p.audit", "audit"),
        (drift_report(window_end=when), "p.drift", "reports"),
        (a_rollout(when)[0], "p.control", "deployments"),
        (batch_state(1, "in_progress"), "p.batches", "batches"),
    ]
    sink = Rows(PriceTable(), decisions_from_topic=True, topics=TopicNames("p"))
    for event, home, table in carried:
        out = sink.batch(records(event, topic="p.usage"))
        assert (getattr(out, table), out.events) == ([], []), type(event).__name__
        ((_, why),) = out.undecodable
        assert f"a {type(event).__name__} on p.usage: only {home} carries them" in str(why)
        assert len(getattr(sink.batch(records(event, topic=home)), table)) == 1, type(event).__name__


@pytest.mark.integration
def test_the_sink_writes_every_table(warehouse: Client) -> None:
    batch = every_table(datetime.now(UTC))
    insert(warehouse, batch)
    for table, table_rows_, _ in table_rows(batch):
        assert rows(warehouse, f"SELECT count() AS n FROM {table}")[0]["n"] == len(table_rows_), table


@pytest.mark.integration
def test_an_event_dated_before_1970_is_stored_and_does_not_stop_the_sink(warehouse: Client) -> None:
    """A UInt64 ``version`` from a negative timestamp failed the whole insert, on every retry."""
    from streams.drift import report_row

    early = datetime(1969, 12, 31, 23, 59, 59, tzinfo=UTC)
    event = finished(request_id=uuid7_from_parts(int(T0.timestamp() * 1000), 1), time=early)
    batch = Rows(PriceTable()).batch(records(finished(), event, topic="p.results"))
    assert len(batch.facts) == 2
    assert len(batch.drift) == 2
    batch.reports.append(report_row(drift_report(window_end=T0, published=early)))
    insert(warehouse, batch)
    assert rows(warehouse, "SELECT count() AS n FROM request_facts WHERE version = 0")[0]["n"] == 1
    assert rows(warehouse, "SELECT count() AS n FROM drift_features WHERE version = 0")[0]["n"] == 1
    assert rows(warehouse, "SELECT count() AS n FROM drift_reports WHERE version = 0")[0]["n"] == 1


@pytest.mark.integration
def test_a_batch_spanning_more_than_a_hundred_months_is_stored(warehouse: Client) -> None:
    """Found by an audit: the tables are partitioned by month, and ClickHouse refuses an insert into more
    than 100 partitions by default; the whole batch failed, again at every redelivery (a replay of years
    does it too)."""
    months = [datetime(1990 + i // 12, i % 12 + 1, 1, tzinfo=UTC) for i in range(101)]
    events = [
        finished(request_id=uuid7_from_parts(int(T0.timestamp() * 1000), i), time=at)
        for i, at in enumerate(months)
    ]
    insert(warehouse, Rows(PriceTable()).batch(records(*events, topic="p.results")))
    assert rows(warehouse, "SELECT count() AS n FROM events_raw")[0]["n"] == 101
