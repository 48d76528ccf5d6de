"""The batch log's Kafka adapter on the real broker: it reads the results topic only between ``follow`` and
``unfollow``; following again ``from_end`` skips what was written in between, following without it goes on
from the group's committed offsets (an edge restarted with batches running)."""

from __future__ import annotations

import asyncio
import time

import pytest

from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.batch_log import KafkaBatchLog
from schemas.events import BatchRef, RequestFinished, Usage
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames

pytestmark = pytest.mark.integration


def result(index: int) -> RequestFinished:
    return RequestFinished(
        tenant="acme",
        model="demo-gpt",
        request_id=uuid7(),
        source="worker",
        status="completed",
        finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
        text=f"line {index}",
        batch=BatchRef(batch_id="batch_1", custom_id=f"req-{index}", index=index, attempt=0),
    )


def following(log: KafkaBatchLog) -> bool:
    return log.following  # read afresh: mypy would narrow the property across awaits


async def read(log: KafkaBatchLog, want: int, within_s: float = 20.0) -> list[int]:
    """Batch line indexes returned by ``results`` until ``want`` came (or the time is up), marked handled."""
    got: list[int] = []
    deadline = time.monotonic() + within_s
    while len(got) < want and time.monotonic() < deadline:
        found = await log.results(0.2)
        got += [r.batch.index for r in found if r.batch is not None]
        log.handled()
    return got


async def test_results_are_read_only_while_following(kafka: KafkaConnection, topic_prefix: str) -> None:
    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, ["demo-gpt"], TopicSizing(replies=1)))
    with EventProducer(kafka, "worker") as worker:

        async def publish(*indexes: int) -> None:
            for index in indexes:
                await worker.publish(names.results, result(index))

        await publish(0)  # before the edge ever followed: history, not its lines
        async with KafkaBatchLog(kafka, names, "edge-f") as log:
            assert not following(log)
            await log.follow(from_end=True)
            assert following(log)
            assert log.caught_up  # from the end: nothing written before is its
            await publish(1, 2)
            assert sorted(await read(log, 2)) == [1, 2]  # partitions apart: in any order

            await log.unfollow()
            assert not following(log)
            await publish(3)  # written while it did not follow
            await asyncio.sleep(0.5)
            assert await log.results(0.2) == []
            await log.follow(from_end=True)  # nothing of its own in flight: 3 is skipped
            await publish(4)
            assert await read(log, 1) == [4]

            await log.unfollow()
            await publish(5)
        # a restarted edge with batches running goes on from the committed offsets: 5 is read
        async with KafkaBatchLog(kafka, names, "edge-f") as log:
            await log.follow(from_end=False)
            assert not log.caught_up, "5 was written before: not read yet"
            await publish(6)
            assert sorted(await read(log, 2)) == [5, 6]
            assert log.caught_up


async def test_a_backlog_retention_removed_is_not_waited_for(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """Found by a review: a restarted edge whose group's offset was behind a partition that retention had
    emptied counted it as unread for good (no record would ever come to read), and its ending batches
    never ended."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    names = TopicNames(topic_prefix)
    apply_topics(make_admin(kafka), platform_topics(names, ["demo-gpt"], TopicSizing(replies=1)))
    async with KafkaBatchLog(kafka, names, "edge-r") as log:
        await log.follow(from_end=True)
        await log.unfollow()
    with EventProducer(kafka, "worker") as worker:
        for index in range(3):
            await worker.publish(names.results, result(index))
    admin = AdminClient(kafka.client_config())
    consumer_meta = make_admin(kafka).list_topics(names.results, timeout=10).topics[names.results]
    ends = []
    for partition in consumer_meta.partitions:
        ends.append(TopicPartition(names.results, partition, -1))  # -1: up to the end (what retention does)
    for future in admin.delete_records(ends).values():
        future.result(10)
    async with KafkaBatchLog(kafka, names, "edge-r") as log:
        await log.follow(from_end=False)
        assert log.caught_up, "nothing is left to read behind the group's offsets"
