"""``sluice replay`` reads the ``batches`` topic: from the log alone it rebuilds the same ``batches`` table
and batch-line facts the live sink wrote (a real broker and chDB)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from infra.warehouse.client import Client
from schemas.codec import encode
from schemas.events import BatchStateChanged, RequestFinished
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams.pricing import PriceTable
from streams.replay import replay
from streams.sink import Consumed, Rows, insert
from tests.streams.test_queries import batch_line, batch_state, event, migrated_warehouse, now_ms, rows

pytestmark = pytest.mark.integration

PRICES = PriceTable()
CHECKSUMS = {
    table: f"SELECT count() AS n, sum(cityHash64(*)) AS h FROM (SELECT * FROM {table})"
    for table in ("batches FINAL", "request_facts FINAL", "spend_day", "sli_minute")
}


def checksums(client: Client) -> dict[str, Any]:
    return {table: rows(client, sql)[0] for table, sql in CHECKSUMS.items()}


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
