"""The price history on the log: a request is priced by the table in force when it was accepted, the
streams worker puts its price file's table on the control topic once (a published version never changes),
and a table that arrives in a batch prices that batch's later requests. Before (2026-12-01) a rebuild priced
every request by whatever file it ran with."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest

import streams.app
from schemas.codec import decode, encode
from schemas.events import AuditEntry, Event, PricesChanged, RequestFinished, Usage
from schemas.ids import uuid7_from_parts
from streams.facts import FACT_COLUMNS, fact_row
from streams.pricing import ModelPrice, PriceHistory, PriceTable, PricingError, load_prices
from streams.sink import Consumed, Rows
from tests.streams.test_app import Producer, Warehouse
from tests.streams.test_audit import finished

T0 = datetime(2026, 12, 1, 8, 0, tzinfo=UTC)
OLD = PriceTable(version="2026-11", default=ModelPrice(prompt=100, completion=400), models={})
NEW = PriceTable(version="2026-12", default=ModelPrice(prompt=300, completion=900), models={})
USAGE = Usage(prompt_tokens=10, completion_tokens=20, total_tokens=30)


def published(table: PriceTable, effective: datetime) -> PricesChanged:
    return PricesChanged(
        tenant="", model="", source="streams/worker", time=effective, prices=table, effective=effective
    )


def accepted(at: datetime) -> RequestFinished:
    """A terminal event whose request the edge accepted at ``at`` (its id's UUIDv7 time)."""
    rid = uuid7_from_parts(int(at.timestamp() * 1000), 7)
    return finished(request_id=rid, time=at + timedelta(seconds=1), usage=USAGE)


def cost(event: RequestFinished, prices: Any) -> tuple[int, str]:
    fact = dict(zip(FACT_COLUMNS, fact_row(event, prices), strict=True))
    return fact["cost_nanos"], fact["price_version"]


def test_a_request_is_priced_by_the_table_in_force_when_it_was_accepted() -> None:
    history = PriceHistory(OLD, [published(NEW, T0 + timedelta(hours=1)), published(OLD, T0)])
    before = cost(accepted(T0 + timedelta(minutes=59, seconds=59)), history)
    at = cost(accepted(T0 + timedelta(hours=1)), history)
    assert before == (10 * 100 + 20 * 400, "2026-11")
    assert at == (10 * 300 + 20 * 900, "2026-12")
    # before the first table on the log: the first (the log's history starts there), not the fallback
    fallback = PriceTable(version="file", default=ModelPrice(prompt=1, completion=1), models={})
    assert (
        cost(accepted(T0 - timedelta(days=3)), PriceHistory(fallback, [published(NEW, T0)]))[1] == "2026-12"
    )
    assert cost(accepted(T0), PriceHistory(fallback)) == (30, "file")
    assert [t.version for _, t in history.tables()] == ["2026-11", "2026-12"]


def test_a_finish_after_a_change_is_priced_by_the_table_its_request_was_accepted_under() -> None:
    history = PriceHistory(OLD, [published(OLD, T0), published(NEW, T0 + timedelta(hours=1))])
    long_one = accepted(T0 + timedelta(minutes=59))
    assert long_one.time < T0 + timedelta(hours=1) < long_one.time + timedelta(minutes=5)
    late = finished(request_id=long_one.request_id, time=T0 + timedelta(hours=2), usage=USAGE)
    assert cost(late, history)[1] == "2026-11"


def test_a_version_published_again_with_other_prices_keeps_the_first(
    caplog: pytest.LogCaptureFixture,
) -> None:
    forged = PriceTable(version="2026-11", default=ModelPrice(prompt=1, completion=1), models={})
    with caplog.at_level(logging.WARNING, logger="streams.pricing"):
        history = PriceHistory(OLD, [published(OLD, T0), published(forged, T0 + timedelta(hours=1))])
    assert history.published("2026-11") == OLD
    assert cost(accepted(T0 + timedelta(hours=2)), history)[0] == 10 * 100 + 20 * 400
    assert "2026-11 was published again with other prices" in caplog.text
    assert len(history.tables()) == 1


def test_a_table_arriving_in_a_batch_prices_that_batch_s_requests_accepted_since() -> None:
    """The terminal event comes first in the batch (another partition), its request accepted after the
    table's ``effective``: priced by it, as a replay that read the table first prices it. A table on a
    topic that does not carry them is set aside to be dead-lettered, and prices nothing."""
    from schemas.topics import TopicNames

    history = PriceHistory(OLD, [published(OLD, T0)])
    rows = Rows(history, topics=TopicNames("p"))
    effective = T0 + timedelta(hours=1)
    after = accepted(effective + timedelta(seconds=1))
    stray = published(PriceTable(version="stray", models={}), effective)
    batch = rows.batch(
        [
            Consumed("p.results", 0, 5, encode(after)),
            Consumed("p.control", 0, 9, encode(published(NEW, effective))),
            Consumed("p.usage", 0, 3, encode(stray)),
        ]
    )
    (fact,) = batch.facts
    assert dict(zip(FACT_COLUMNS, fact, strict=True))["price_version"] == "2026-12"
    assert [(r.topic, r.offset) for r, _ in batch.undecodable] == [("p.usage", 3)]
    assert history.published("stray") is None


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('version = "v"\nbatch_discount = 40\n', "$.batch_discount"),
        ('version = "v"\n[default]\nprompt = 1\ncompletions = 4\n', "$.default.completions"),
        ('version = "v"\n[models.demo-gpt]\nworker_seconds = 2\n', "$.models.demo-gpt.worker_seconds"),
    ],
)
def test_a_price_file_with_a_misspelt_field_is_refused(tmp_path: Path, text: str, named: str) -> None:
    """Unknown fields in an event's table are ignored (a newer writer's); in a file they are a typo that
    would price at the defaults."""
    path = tmp_path / "prices.toml"
    path.write_text(text)
    with pytest.raises(PricingError, match=re.escape(f"unknown field(s) {named}")):
        load_prices(path)


def test_a_table_on_the_log_ignores_fields_it_does_not_know() -> None:
    value = encode(published(NEW, T0)).replace(b'"worker_second":0', b'"worker_second":0,"per_image":7', 1)
    event = decode(value)
    assert isinstance(event, PricesChanged)
    assert event.prices == NEW


# --- the streams worker puts its file's table on the log -------------------------------------------------

NOW = T0 + timedelta(days=1)


class Worker:
    """A streams app (no broker) whose price file holds ``file``, started on a control topic holding ``log``
    with ``others`` other members in its group, on a warehouse whose latest fact is of a request accepted at
    ``priced_until`` (None: it holds none); what it publishes is in ``producer.records``."""

    def __init__(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        file: PriceTable,
        *,
        others: int | None = 0,
        now: datetime = NOW,
        path: str | None = None,
        priced_until: datetime | None = None,
    ) -> None:
        from schemas.settings import PlatformSettings
        from streams.app import StreamsApp
        from streams.settings import StreamsSettings

        self.producer = Producer()
        self.app = StreamsApp(
            PlatformSettings(kafka_bootstrap="127.0.0.1:1", topic_prefix="p", data_dir=str(tmp_path)),
            StreamsSettings(streams_prices_file=path),
            Warehouse(int(priced_until.timestamp() * 1000) if priced_until else 0),  # type: ignore[arg-type]
            file,
            self.producer,  # type: ignore[arg-type]
            request_topics=["p.requests.demo-gpt"],
        )
        self.app._heads = {}  # anchored: no chain yet
        monkeypatch.setattr(streams.app, "utc_now", lambda: now)
        monkeypatch.setattr(streams.app, "group_members", lambda admin, group: others)

    async def start(self, log: list[Event]) -> list[PricesChanged]:
        """What the app's start does with the control topic's history; the tables it published."""
        await self.app._follow_prices(log)
        return [
            e for topic, e in self.producer.records if topic == "p.control" and isinstance(e, PricesChanged)
        ]

    async def priced(self, at: datetime) -> str:
        """The price version of the fact the sink writes for a request accepted at ``at``."""
        batch = await self.app.write([Consumed("p.results", 0, 0, encode(accepted(at)))])
        (fact,) = batch.facts
        return str(dict(zip(FACT_COLUMNS, fact, strict=True))["price_version"])


async def test_the_file_s_table_is_published_once_and_prices_what_is_accepted_from_then_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Worker(tmp_path, monkeypatch, NEW)
    (event,) = await worker.start([published(OLD, T0)])
    assert (event.prices, event.effective, event.model, event.tenant) == (NEW, NOW, "", "")
    assert await worker.priced(NOW) == "2026-12"
    assert await worker.priced(NOW - timedelta(seconds=1)) == "2026-11"  # a backlog keeps its prices
    # the next start finds it on the log: nothing published again
    again = Worker(tmp_path, monkeypatch, NEW)
    assert await again.start([published(OLD, T0), event]) == []
    assert await again.priced(NOW - timedelta(seconds=1)) == "2026-11"


async def test_a_start_with_no_table_on_the_log_prices_its_backlog_by_its_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start after the upgrade: requests from before are priced by the file's table, as before."""
    worker = Worker(tmp_path, monkeypatch, OLD)
    (event,) = await worker.start([])
    assert event.effective == NOW
    assert await worker.priced(T0 - timedelta(days=30)) == "2026-11"


async def test_a_table_is_dated_after_the_one_in_force_whatever_this_host_s_clock_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a host whose clock was behind the current table's ``effective`` dated the new
    one before it, where it was never in force, and its next start was refused as "replaced"."""
    ahead = T0 + timedelta(days=2)  # published by a host whose clock ran ahead
    worker = Worker(tmp_path, monkeypatch, NEW, now=NOW)
    (event,) = await worker.start([published(OLD, ahead)])
    assert event.effective == ahead + timedelta(milliseconds=1)
    assert await worker.priced(ahead + timedelta(seconds=1)) == "2026-12"
    again = Worker(tmp_path, monkeypatch, NEW, now=NOW)
    assert await again.start([published(OLD, ahead), event]) == []


async def test_a_table_is_dated_after_every_request_already_priced_whatever_the_edges_clocks_say(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a request is priced by when its edge accepted it (its id's time, the edge's clock)
    but a new table came into force at this host's clock. With an edge 3 s ahead, a request the previous
    worker priced by the old table (the only one it had) had an id dated after the new table's start, and
    a replay, which knows both tables, priced it by the new one: the rebuilt ledger differed from the live
    one. The new table comes into force after the latest request the warehouse holds a fact of."""
    accepted_then = NOW + timedelta(seconds=3)  # by an edge whose clock is 3 s ahead of this host's
    request = accepted(accepted_then)
    live = cost(request, PriceHistory(OLD, [published(OLD, T0)]))  # the previous worker's fact
    assert live[1] == "2026-11"
    worker = Worker(tmp_path, monkeypatch, NEW, now=NOW, priced_until=accepted_then)
    (event,) = await worker.start([published(OLD, T0)])
    replayed = cost(request, PriceHistory(OLD, [published(OLD, T0), event]))  # `sluice replay`
    assert replayed == live
    assert event.effective == accepted_then + timedelta(milliseconds=1)
    assert await worker.priced(accepted_then + timedelta(milliseconds=1)) == "2026-12"


async def test_a_warehouse_priced_behind_this_host_s_clock_leaves_a_new_table_dated_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    worker = Worker(tmp_path, monkeypatch, NEW, now=NOW, priced_until=NOW - timedelta(minutes=1))
    with caplog.at_level(logging.WARNING, logger="streams.app"):
        (event,) = await worker.start([published(OLD, T0)])
    assert event.effective == NOW
    assert "an edge's clock is ahead" not in caplog.text


async def test_a_table_dated_far_past_this_host_s_clock_by_a_request_already_priced_is_logged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An edge whose clock ran an hour ahead keeps the new prices off for that hour (replay still agrees):
    the operator is told why."""
    ahead = NOW + timedelta(hours=1)
    worker = Worker(tmp_path, monkeypatch, NEW, now=NOW, priced_until=ahead)
    with caplog.at_level(logging.WARNING, logger="streams.app"):
        (event,) = await worker.start([published(OLD, T0)])
    assert event.effective == ahead + timedelta(milliseconds=1)
    assert "comes into force only at" in caplog.text
    assert "an edge's clock is ahead" in caplog.text


async def test_a_new_table_is_published_only_by_a_worker_that_runs_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: another streams worker prices by the history it has until its sink reads the
    new table, so the rows it wrote meanwhile would differ from a rebuild's. A version already on the log
    needs no publishing, so that start goes on beside the other worker."""
    worker = Worker(tmp_path, monkeypatch, NEW, others=1)
    with pytest.raises(PricingError, match="runs alone: group p-streams has 1 member"):
        await worker.start([published(OLD, T0)])
    assert worker.producer.records == []
    beside = Worker(tmp_path, monkeypatch, OLD, others=1)
    assert await beside.start([published(OLD, T0)]) == []


async def test_a_file_that_changed_prices_but_not_its_version_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    changed = PriceTable(version="2026-11", default=ModelPrice(prompt=1, completion=1), models={})
    worker = Worker(tmp_path, monkeypatch, changed, path="/etc/sluice/prices.toml")
    with pytest.raises(
        PricingError,
        match=r"'2026-11' of SLUICE_STREAMS_PRICES_FILE=/etc/sluice/prices.toml is on the log with other "
        r"prices.*new version",
    ):
        await worker.start([published(OLD, T0)])
    assert worker.producer.records == []


async def test_going_back_to_a_replaced_version_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing it again would compact away when it was first in force (one key per version)."""
    worker = Worker(tmp_path, monkeypatch, OLD)
    with pytest.raises(
        PricingError,
        match=r"'2026-11' of the built-in demo prices \(SLUICE_STREAMS_PRICES_FILE unset\) was "
        "replaced by '2026-12'",
    ):
        await worker.start([published(OLD, T0), published(NEW, T0 + timedelta(hours=1))])
    assert worker.producer.records == []


async def test_a_worker_given_the_control_partition_follows_the_tables_published_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Worker(tmp_path, monkeypatch, OLD)
    assert await worker.start([published(OLD, T0)]) == []
    later = published(NEW, T0 + timedelta(hours=1))
    monkeypatch.setattr(streams.app, "read_placed", lambda kafka, topic, client_id: [(later, (0, 4))])
    await worker.app.reseed()
    assert await worker.priced(T0 + timedelta(hours=2)) == "2026-12"


async def test_a_published_table_is_audited_in_its_own_chain(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = Worker(tmp_path, monkeypatch, OLD)
    await worker.app.write([Consumed("p.control", 0, 0, encode(published(NEW, T0)))])
    entries = [decode(cast(bytes, value)) for topic, value in worker.producer.records if topic == "p.audit"]
    assert [(e.tenant, e.action, e.decision) for e in entries if isinstance(e, AuditEntry)] == [
        ("admin:prices:2026-12", "prices.publish", "2026-12")
    ]
    assert await worker.priced(T0 + timedelta(hours=1)) == "2026-12"
