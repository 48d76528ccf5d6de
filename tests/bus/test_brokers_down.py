"""A consumer tells how long it has seen no broker: what ``/readyz`` of the edge and the workers reads.
Found by an audit: the broker killed under ``sluice up``, both kept answering 200 with ``kafka: true`` (a
request then waited 30 s for a 503)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from confluent_kafka import TopicPartition

from bus.consumer import ConsumerThread, consumer_config
from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.settings import PlatformSettings
from tests.conftest import own_broker

pytestmark = pytest.mark.integration

TOPIC = "brokers-down"


async def _until(check: object, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the time"
        await asyncio.sleep(0.1)


async def test_a_consumer_says_how_long_it_has_seen_no_broker(
    platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    broker = own_broker(platform_settings, tmp_path)
    broker.start()
    try:
        conn = broker.connection
        apply_topics(make_admin(conn), [TopicSpec(name=TOPIC, partitions=1, config={}, purpose="")])
        polled = ConsumerThread(
            consumer_config(conn, "down-group", "down-polled"),
            lambda batch: None,
            subscribe=[TOPIC],
            stats_interval_ms=200,
        )
        served = ConsumerThread(  # as an edge's reply listener: on the loop, woken by librdkafka
            consumer_config(conn, None, "down-served"),
            lambda batch: None,
            assign=[TopicPartition(TOPIC, 0, 0)],
            stats_interval_ms=200,
            serve_on=asyncio.get_running_loop(),
        )
        with polled, served:
            assert polled.wait_assigned(30)
            await asyncio.sleep(1.0)  # a few statistics with the broker up
            assert (polled.brokers_down_for(), served.brokers_down_for()) == (0.0, 0.0)
            await asyncio.to_thread(broker.stop)
            await _until(lambda: min(polled.brokers_down_for(), served.brokers_down_for()) > 1.0, 30)
            await asyncio.to_thread(broker.start)
            await _until(lambda: max(polled.brokers_down_for(), served.brokers_down_for()) == 0.0, 60)
    finally:
        broker.stop()
