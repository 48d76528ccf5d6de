"""``sluice replay`` reads the ``batches`` topic: from the log alone it rebuilds the same ``batches`` table
and batch-line facts the live sink wrote (a real broker and chDB); its timeout bounds a stall, not the
replay (a fake broker on a fake clock)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from datetime import datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition

import streams.replay
from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from infra.warehouse.client import Client
from schemas.codec import encode
from schemas.events import BatchStateChanged, Event, PricesChanged, RequestFinished
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams.facts import FACT_COLUMNS
from streams.pricing import ModelPrice, PriceHistory, PriceTable
from streams.replay import ReplayError, replay
from streams.sink import Consumed, Rows, insert
from tests.streams.test_queries import batch_line, batch_state, event, migrated_warehouse, now_ms, rows

PRICES = PriceTable()
FROM_LOG = PriceHistory(PRICES)
"""A fake broker has no control topic to read the price history from: given, as ``run_replay`` gives it."""
CHECKSUMS = {
    table: f"SELECT count() AS n, sum(cityHash64(*)) AS h FROM (SELECT * FROM {table})"
    for table in ("batches FINAL", "request_facts FINAL", "spend_day", "sli_minute")
}


@pytest.mark.integration
def test_a_replay_of_a_topic_ending_in_a_transactions_marker_ends(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """Found by a review: a replay waited for a record at a partition's last offset, and a transaction's
    commit marker there (a topic a transactional tool wrote) is never handed over: it failed after its
    timeout, saying "1 of 2 read"."""
    from confluent_kafka import Producer

    settings = PlatformSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topic_prefix)
    names = TopicNames(topic_prefix)
    apply_topics(
        make_admin(settings.kafka),
        platform_topics(names, ["demo-gpt"], TopicSizing(requests=1, replies=1, events=1)),
    )
    producer = Producer({**settings.kafka.client_config(), "transactional.id": f"{topic_prefix}-tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(names.results, encode(event(finished=now_ms())), partition=0)
    producer.commit_transaction(30)
    with migrated_warehouse(tmp_path / "replay") as client:
        report = replay(
            settings, client, PriceHistory(PriceTable()), [names.requests("demo-gpt")], timeout_s=20
        )
    assert (report.events, report.undecodable) == (1, 0)


def checksums(client: Client) -> dict[str, Any]:
    return {table: rows(client, sql)[0] for table, sql in CHECKSUMS.items()}


@pytest.mark.integration
def test_a_replay_rebuilds_the_batches_table_and_the_batch_lines_facts(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    settings = PlatformSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topic_prefix)
    names = TopicNames(topic_prefix)
    sizing = TopicSizing(requests=1, replies=1, events=2)
    apply_topics(make_admin(settings.kafka), platform_topics(names, ["demo-gpt"], sizing))
    now = now_ms()
    created = now - timedelta(minutes=5)
    log: list[tuple[str, BatchStateChanged | RequestFinished]] = [
        (names.batches, batch_state(0, "validating", total=0, created_at=created)),
        (names.batches, batch_state(1, "in_progress", created_at=created)),
        (names.batches, batch_state(0, "validating", batch_id="batch_2", total=0, created_at=created)),
        (names.batches, batch_state(2, "completed", completed=9, failed=1, created_at=created)),
        (names.batches, batch_state(1, "in_progress", created_at=created)),  # published again, late
        *(
            (names.results, batch_line(event(finished=now - timedelta(seconds=i)), "batch_1", i))
            for i in range(10)
        ),
        (names.results, event(finished=now)),
    ]
    with EventProducer(settings.kafka, "test-replay") as producer:
        for topic, item in log:
            producer.produce(topic, item)

    # What the live sink writes: the same rows, a batch of one record at a time.
    with migrated_warehouse(tmp_path / "live") as client:
        for offset, (topic, item) in enumerate(log):
            insert(client, Rows(PRICES).batch([Consumed(topic, 0, offset, encode(item))]))
        live = checksums(client)

    with migrated_warehouse(tmp_path / "replay") as client:
        report = replay(settings, client, PRICES, [names.requests("demo-gpt")], timeout_s=120)
        replayed = checksums(client)
        latest = rows(client, "SELECT batch_id, seq, status FROM batches FINAL ORDER BY batch_id")
        (spent,) = rows(client, "SELECT sum(cost_nanos) AS c FROM request_facts FINAL WHERE batch_id != ''")
    assert report.events == len(log)
    assert replayed == live
    assert live["batches FINAL"]["n"] == 2
    assert latest == [
        {"batch_id": "batch_1", "seq": 2, "status": "completed"},
        {"batch_id": "batch_2", "seq": 0, "status": "validating"},
    ]
    lines = [item for _, item in log if isinstance(item, RequestFinished) and item.batch is not None]
    full = sum(PRICES.cost_nanos(e.model, e.usage.prompt_tokens, e.usage.completion_tokens) for e in lines)
    assert spent["c"] == sum(
        PRICES.cost_nanos(e.model, e.usage.prompt_tokens, e.usage.completion_tokens, batch=True)
        for e in lines
    )
    assert spent["c"] < full


@pytest.mark.integration
def test_a_replay_prices_each_request_by_the_table_in_force_when_it_was_accepted(
    kafka_bootstrap: str, topic_prefix: str, tmp_path: Path
) -> None:
    """The live worker priced the requests before a price change by the old table and those after by the
    new one; a replay run with yet another price file gives the same facts and spend, from the history on
    the control topic. Before (2026-12-01), a rebuild priced every request by its own file's table."""
    settings = PlatformSettings(kafka_bootstrap=kafka_bootstrap, topic_prefix=topic_prefix)
    names = TopicNames(topic_prefix)
    apply_topics(
        make_admin(settings.kafka),
        platform_topics(names, ["demo-gpt"], TopicSizing(requests=1, replies=1, events=2)),
    )
    old = PriceTable(version="2026-11", default=ModelPrice(prompt=100, completion=400), models={})
    new = PriceTable(version="2026-12", default=ModelPrice(prompt=300, completion=900), models={})
    now = now_ms()
    change = now - timedelta(minutes=1)

    def table(prices: PriceTable, effective: datetime) -> PricesChanged:
        return PricesChanged(
            tenant="", model="", source="streams/worker", time=effective, prices=prices, effective=effective
        )

    log: list[tuple[str, Event]] = [
        (names.control, table(old, now - timedelta(hours=1))),
        *((names.results, event(finished=change - timedelta(seconds=10 + i))) for i in range(3)),
        (names.control, table(new, change)),
        *((names.results, event(finished=change + timedelta(seconds=5 + i))) for i in range(4)),
    ]
    with EventProducer(settings.kafka, "test-replay") as producer:
        for topic, item in log:
            producer.produce(topic, item)

    with migrated_warehouse(tmp_path / "live") as client:  # the live sink: a record at a time, as it came
        live_rows = Rows(PriceHistory(old), topics=names)
        for offset, (topic, item) in enumerate(log):
            insert(client, live_rows.batch([Consumed(topic, 0, offset, encode(item))]))
        live = checksums(client)
        versions = rows(
            client, "SELECT price_version AS v, count() AS n FROM request_facts GROUP BY v ORDER BY v"
        )
    assert versions == [{"v": "2026-11", "n": 3}, {"v": "2026-12", "n": 4}]

    elsewhere = PriceTable(version="the file today", default=ModelPrice(prompt=7, completion=7), models={})
    with migrated_warehouse(tmp_path / "replay") as client:
        replay(settings, client, elsewhere, [names.requests("demo-gpt")], timeout_s=120)
        assert checksums(client) == live


# --- the timeout, on a fake broker and a fake clock ---------------------------------------------------------


class FakeLog:
    """One partition of the results topic holding ``records`` records, handed out ``per_poll`` per poll
    (each poll a second on the fake clock) until ``stall_after`` records, and then nothing."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        records: int,
        *,
        per_poll: int = 1,
        stall_after: int | None = None,
        first: int = 0,
    ) -> None:
        """``first``: the partition's first offset still held (retention removed those before it)."""
        self.records, self.per_poll = records, per_poll
        self.stall_after = records if stall_after is None else stall_after
        self.clock = 0.0
        self.next: dict[str, int] = {}
        self.unreachable = False
        self.value = encode(event(finished=now_ms()))
        monkeypatch.setattr(streams.replay, "Consumer", lambda config: self)
        monkeypatch.setattr(
            streams.replay, "watermarks", lambda consumer, topic, partition: (first, self.records)
        )
        monkeypatch.setattr(streams.replay, "monotonic", lambda: self.clock)

    def list_topics(self, topic: str, timeout: float) -> Any:
        if self.unreachable:
            raise KafkaException(
                KafkaError(KafkaError._TRANSPORT, "Failed to get metadata: transport failure")
            )
        error = None if topic.endswith(".results") else KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
        return SimpleNamespace(topics={topic: SimpleNamespace(error=error, partitions={0: None})})

    def assign(self, partitions: Sequence[TopicPartition]) -> None:
        self.next = {tp.topic: tp.offset for tp in partitions}

    def consume(self, count: int, timeout: float) -> list[Any]:
        self.clock += 1.0
        batch = []
        for topic, offset in self.next.items():
            upto = min(offset + self.per_poll, self.stall_after)
            batch += [self.message(topic, o) for o in range(offset, upto)]
            self.next[topic] = max(offset, upto)
        return batch

    def position(self, partitions: Sequence[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.next[tp.topic]) for tp in partitions]

    def message(self, topic: str, offset: int) -> Any:
        return SimpleNamespace(
            error=lambda: None,
            topic=lambda: topic,
            partition=lambda: 0,
            offset=lambda: offset,
            value=lambda: self.value,
        )

    def close(self) -> None:
        pass


class NullWriter:
    def raw_insert(self, *args: Any, **kwargs: Any) -> None:
        pass


def test_a_long_replay_that_keeps_moving_outlasts_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    log = FakeLog(monkeypatch, 700)  # one record a second: 700 s in all, past a 600 s timeout
    done: list[int] = []
    report = replay(PlatformSettings(), NullWriter(), FROM_LOG, [], progress=lambda d, t: done.append(d))
    assert report.events == 700
    assert done[-1] == 700
    assert log.clock >= 700


def test_a_stalled_replay_gives_up_after_the_timeout_since_the_last_record(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = FakeLog(monkeypatch, 100, per_poll=10, stall_after=40)
    with pytest.raises(ReplayError, match=r"no record arrived for 30s with 40 of up to 100 read") as caught:
        replay(PlatformSettings(topic_prefix="p"), NullWriter(), FROM_LOG, [], timeout_s=30)
    assert "p.results[0]" in str(caught.value)
    assert "--timeout" in str(caught.value)
    assert 34 <= log.clock <= 36  # 4 polls brought records, then 30 s of nothing


def test_kafka_that_cannot_say_where_the_log_ends_is_a_replay_error(monkeypatch: pytest.MonkeyPatch) -> None:
    log = FakeLog(monkeypatch, 10)
    log.unreachable = True
    with pytest.raises(
        ReplayError, match=r"cannot read the topics' ends on Kafka at 127.0.0.1:1: .*transport failure"
    ):
        replay(PlatformSettings(kafka_bootstrap="127.0.0.1:1"), NullWriter(), FROM_LOG, [])


def test_a_replay_says_what_history_retention_took_and_counts_only_what_is_held(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by an audit: after retention had removed the start of ``results``, a replay exited 0 with no
    word of the history it could not rebuild, and its progress bar stopped short of a total that counted
    the records gone."""
    FakeLog(monkeypatch, 100, first=40, per_poll=100)
    totals: list[tuple[int, int]] = []
    report = replay(
        PlatformSettings(topic_prefix="p"),
        NullWriter(),
        FROM_LOG,
        [],
        progress=lambda d, t: totals.append((d, t)),
    )
    assert report.events == 60
    assert totals[-1] == (60, 60)
    assert report.gone == {"p.results": 40}
    FakeLog(monkeypatch, 100, first=100)  # retention emptied the partition: all of it is gone
    emptied = replay(PlatformSettings(topic_prefix="p"), NullWriter(), FROM_LOG, [])
    assert (emptied.events, emptied.gone) == (0, {"p.results": 100})


def test_a_replay_reads_the_price_history_before_the_first_request_it_prices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The history is read from the control topic before the first record is priced: here the log's
    records are all terminal events, priced by the table on the control topic, not by the file's. (The
    integration test above, with a real broker, has the order the partitions come in decide nothing.)"""
    FakeLog(monkeypatch, 5, per_poll=5)
    effective = now_ms() - timedelta(days=1)
    table = PriceTable(version="2026-12", default=ModelPrice(prompt=300, completion=900), models={})
    on_log = PricesChanged(
        tenant="", model="", source="streams/worker", time=effective, prices=table, effective=effective
    )
    read: list[str] = []

    def read_control(kafka: Any, topic: str, client_id: str) -> list[Event]:
        read.append(topic)
        return [on_log]

    batches: list[Any] = []
    monkeypatch.setattr(streams.replay, "read_control", read_control)
    monkeypatch.setattr(streams.replay, "insert", lambda writer, batch: batches.append(batch))
    replay(PlatformSettings(topic_prefix="p"), NullWriter(), PRICES, [])
    assert read == ["p.control"]
    facts = [dict(zip(FACT_COLUMNS, row, strict=True)) for batch in batches for row in batch.facts]
    assert [f["price_version"] for f in facts] == ["2026-12"] * 5


def test_replay_into_a_data_dir_fills_that_directory_whatever_server_is_configured(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by an audit: with ``SLUICE_WAREHOUSE_URL`` set, ``sluice replay --data-dir DIR`` ignored DIR and
    rebuilt into the configured server's database (a scratch rebuild aimed at production). The gone
    history is said too."""
    import io

    from rich.console import Console

    import infra.warehouse
    import streams.service
    from sluice.services import run_replay
    from streams.replay import ReplayReport

    targets: list[PlatformSettings] = []

    def fake_replay(platform: PlatformSettings, writer: Any, *args: Any, **kwargs: Any) -> ReplayReport:
        return ReplayReport(3, 0, 1, 0.1, {"p.results": 40})

    real_open = infra.warehouse.open_warehouse

    def opened(platform: PlatformSettings) -> Any:
        targets.append(platform)
        return real_open(platform)

    monkeypatch.setattr(streams.replay, "replay", fake_replay)
    monkeypatch.setattr(streams.replay, "price_history", lambda platform, fallback: PriceHistory(fallback))
    monkeypatch.setattr(streams.service, "request_topics", lambda platform: [])
    monkeypatch.setattr(infra.warehouse, "open_warehouse", opened)
    printed = io.StringIO()
    configured = PlatformSettings(warehouse_url="http://127.0.0.1:1/prod", topic_prefix="p")
    code = run_replay(configured, Console(file=printed, width=200), str(tmp_path / "scratch"))
    assert code == 0, printed.getvalue()
    (target,) = targets
    assert (target.warehouse_url, target.data_dir) == (None, str(tmp_path / "scratch"))
    assert "p.results no longer holds its first 40 records" in printed.getvalue()
    with contextlib.closing(real_open(target)) as client:  # events_raw keeps its days, as the live one
        (engine,) = client.query(
            "SELECT engine_full FROM system.tables WHERE name = 'events_raw'"
        ).result_rows[0]
    assert "TTL toDateTime(time) + toIntervalDay(30)" in engine


def test_a_topic_the_replay_may_not_read_is_an_error_not_an_absent_topic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review: any metadata error was taken for a topic that does not exist, so a principal without an
    ACL on, say, ``audit`` got exit 0 and an empty ``audit_log``, with no word said."""
    log = FakeLog(monkeypatch, 10, per_poll=10)

    def list_topics(topic: str, timeout: float) -> Any:
        code = (
            KafkaError.TOPIC_AUTHORIZATION_FAILED if topic.endswith(".results") else KafkaError._UNKNOWN_TOPIC
        )
        return SimpleNamespace(topics={topic: SimpleNamespace(error=KafkaError(code), partitions={0: None})})

    monkeypatch.setattr(log, "list_topics", list_topics)
    with pytest.raises(ReplayError, match=r"cannot read p\.results: .*(?i:authori)"):
        replay(PlatformSettings(topic_prefix="p"), NullWriter(), FROM_LOG, [], timeout_s=30)


class CompactedLog(FakeLog):
    """The results partition as a compacted topic leaves it: every other offset's record removed."""

    def consume(self, count: int, timeout: float) -> list[Any]:
        return [message for message in super().consume(count, timeout) if message.offset() % 2]


def test_a_compacted_topics_progress_reaches_its_total_and_its_holes_are_reported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review: over a compacted topic (``control``, ``batches``) the progress counted records against a
    total of offsets and ended at 3/8, and nothing said the history compaction removed is not rebuilt."""
    CompactedLog(monkeypatch, 8, per_poll=4)
    seen: list[tuple[int, int]] = []
    report = replay(
        PlatformSettings(topic_prefix="p"),
        NullWriter(),
        FROM_LOG,
        [],
        progress=lambda d, t: seen.append((d, t)),
    )
    assert report.events == 4
    assert seen[-1] == (8, 8)
    assert report.compacted == {"p.results": 4}
    assert report.gone == {}
