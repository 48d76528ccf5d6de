"""The live sink reads the request topics of models added while it runs.

Found by a review: the sink subscribed to the request topics there at its start. A model added later (its
topic made by ``sluice topics apply`` while the streams worker ran) never reached ``events_raw`` until a
restart, and never once the topic's 7-day retention had passed, while ``sluice replay`` of the same log
had it: the rebuild differed from the live warehouse."""

from __future__ import annotations

import uuid
from pathlib import Path

import msgspec
import pytest

import streams.app
from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from infra.warehouse import migrate
from schemas.events import GenerationRequested
from schemas.examples import example_events
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from streams.app import requests_pattern
from tests.streams.test_audit_rebalance import MODEL, until, worker, writer

LATE = "late-model"


def test_the_pattern_takes_every_request_topic_and_no_other() -> None:
    import re

    names = TopicNames("p.x")
    pattern = re.compile(requests_pattern(names))
    assert pattern.match(names.requests("demo-gpt"))
    assert pattern.match(names.requests(LATE))
    for other in ("p.x.results", "p.x.requests", "pAx.requests.demo-gpt", "q.p.x.requests.demo-gpt"):
        assert not pattern.match(other), other


@pytest.mark.integration
@pytest.mark.timeout(150)
async def test_requests_of_a_model_added_while_the_sink_runs_reach_events_raw(
    kafka: KafkaConnection,
    platform_settings: PlatformSettings,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(streams.app, "SINK_METADATA_REFRESH_MS", 1_000)
    names = TopicNames(f"late-{uuid.uuid4().hex[:8]}")
    admin = make_admin(kafka)
    sizing = TopicSizing(requests=1, replies=1, events=1)
    apply_topics(admin, platform_topics(names, [MODEL], sizing))
    settings = msgspec.structs.replace(
        platform_settings,
        kafka_bootstrap=kafka.bootstrap,
        topic_prefix=names.prefix,
        data_dir=str(tmp_path),
        models=(MODEL,),
    )
    with writer(settings) as client:
        migrate(client)
    async with worker(settings, "one") as app:
        await until(lambda: bool(app.assigned), "assignment")
        apply_topics(admin, platform_topics(names, [MODEL, LATE], sizing))  # a model added
        request = next(e for e in example_events() if isinstance(e, GenerationRequested))
        request = msgspec.structs.replace(request, model=LATE)
        with EventProducer(settings.kafka, "test-late") as producer:
            producer.produce(names.requests(LATE), request)

        def held() -> bool:
            with writer(settings) as client:
                sql = f"SELECT count() FROM events_raw WHERE topic = '{names.requests(LATE)}'"
                return int(client.query(sql).result_rows[0][0]) == 1

        await until(held, f"request of {LATE} in events_raw", within=60)
