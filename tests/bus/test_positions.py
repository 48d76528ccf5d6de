"""Reading the log by position on the real broker: a topic read to its end whatever retention left of it,
and the oldest record a group could still be handed."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from bus.consumer import consumer_config
from bus.positions import read_to_end, uncommitted_since, watermarks
from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.settings import KafkaConnection

pytestmark = pytest.mark.integration


def _topic(kafka: KafkaConnection, name: str) -> None:
    apply_topics(make_admin(kafka), [TopicSpec(name=name, partitions=2, config={}, purpose="")])


def _produce(kafka: KafkaConnection, topic: str, partition: int, n: int, timestamp_ms: int = 0) -> None:
    producer = Producer(kafka.client_config())
    for i in range(n):
        producer.produce(topic, f"r{i}".encode(), partition=partition, timestamp=timestamp_ms or 0)
    assert producer.flush(10) == 0


def test_a_partition_retention_emptied_is_read_to_its_end_at_once(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """Found by an audit: once retention had deleted every record of a partition (its first retained
    offset at its end), a reader from offset 0 waited for a record that never came, and a worker reading
    the results topic at start failed after 120 s, at every restart."""
    topic = f"{topic_prefix}.emptied"
    _topic(kafka, topic)
    _produce(kafka, topic, 0, 3)
    _produce(kafka, topic, 1, 2)
    admin = AdminClient(kafka.client_config())
    for future in admin.delete_records([TopicPartition(topic, 0, 3)]).values():
        future.result(10)  # what retention does to an idle partition
    consumer = Consumer(consumer_config(kafka, None, "test-read-to-end"))
    try:
        assert watermarks(consumer, topic, 0) == (3, 3)
        ends = {0: 3, 1: 2}
        began = time.monotonic()
        read = list(read_to_end(consumer, [TopicPartition(topic, p, 0) for p in (0, 1)], ends, timeout_s=10))
        assert time.monotonic() - began < 5
        assert [(m.partition(), m.value()) for m in read] == [(1, b"r0"), (1, b"r1")]
    finally:
        consumer.close()


def test_a_partition_ending_in_a_transaction_marker_is_read_to_its_end(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    """Found by a review: a transaction's marker at a partition's end (a tool writing transactionally, say
    MirrorMaker 2) is never handed over, and the read waited for it until it failed: workers, the CLI and
    streams could not read the control topic at start."""
    topic = f"{topic_prefix}.txn"
    _topic(kafka, topic)
    _produce(kafka, topic, 1, 1)
    producer = Producer({**kafka.client_config(), "transactional.id": f"{topic}-tx"})
    producer.init_transactions(30)
    producer.begin_transaction()
    producer.produce(topic, b"in a transaction", partition=0)
    producer.commit_transaction(30)
    consumer = Consumer(consumer_config(kafka, None, "test-read-to-end"))
    try:
        deadline = time.monotonic() + 10
        while watermarks(consumer, topic, 0)[1] < 2 and time.monotonic() < deadline:
            time.sleep(0.1)  # the marker is written after the commit returns
        ends = {0: watermarks(consumer, topic, 0)[1], 1: 1}
        assert ends[0] == 2  # the record and the marker
        began = time.monotonic()
        read = list(read_to_end(consumer, [TopicPartition(topic, p, 0) for p in (0, 1)], ends, timeout_s=10))
        assert time.monotonic() - began < 5
        assert sorted((m.partition(), m.value()) for m in read) == [(0, b"in a transaction"), (1, b"r0")]
    finally:
        consumer.close()


def test_the_oldest_record_a_group_could_be_handed(kafka: KafkaConnection, topic_prefix: str) -> None:
    topic, group = f"{topic_prefix}.handed", f"{topic_prefix}-group"
    _topic(kafka, topic)
    hour_ago = int(time.time() * 1000) - 3_600_000
    _produce(kafka, topic, 0, 2, hour_ago)
    _produce(kafka, topic, 1, 1, hour_ago + 60_000)
    # never committed: from the first record (before, None: the whole results topic was read)
    assert uncommitted_since(kafka, group, topic, "test") == hour_ago
    empty = f"{topic_prefix}.empty"
    _topic(kafka, empty)
    now = int(time.time() * 1000)
    since = uncommitted_since(kafka, group, empty, "test")  # nothing to hand at all: now
    assert since is not None
    assert now - 1000 <= since <= int(time.time() * 1000)
    committer = Consumer(consumer_config(kafka, group, "test-committer"))
    try:
        committer.commit(
            offsets=[TopicPartition(topic, 0, 1), TopicPartition(topic, 1, 0)], asynchronous=False
        )
        assert uncommitted_since(kafka, group, topic, "test") == hour_ago  # partition 0's second record
        committer.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
        assert uncommitted_since(kafka, group, topic, "test") == hour_ago + 60_000
        committer.commit(offsets=[TopicPartition(topic, 1, 1)], asynchronous=False)
        now = int(time.time() * 1000)
        since = uncommitted_since(kafka, group, topic, "test")  # all committed: nothing older than now
        assert since is not None
        assert now - 1000 <= since <= int(time.time() * 1000)
    finally:
        committer.close()


def test_a_groups_members_are_counted(kafka: KafkaConnection, topic_prefix: str) -> None:
    """What the rollout's ``serving`` gate reads: a group's members now (0 once its last one left)."""
    from bus.consumer import ConsumerThread
    from bus.positions import group_members
    from infra.topics import make_admin

    topic, group = f"{topic_prefix}.members", f"{topic_prefix}-members"
    _topic(kafka, topic)
    admin = make_admin(kafka)
    assert group_members(admin, group) == 0  # no such group yet
    member = ConsumerThread(
        consumer_config(kafka, group, "test-member"), lambda batch: None, subscribe=[topic]
    )
    with member:
        assert member.wait_assigned(30)
        assert group_members(admin, group) == 1
    deadline = time.monotonic() + 30
    while group_members(admin, group) != 0:  # a member that stops leaves its group
        assert time.monotonic() < deadline, "the stopped member is still counted"
        time.sleep(0.2)


def _commit(kafka: KafkaConnection, group: str, topic: str, offsets: dict[int, int]) -> None:
    committer = Consumer(consumer_config(kafka, group, "test-committer"))
    try:
        committer.commit(
            offsets=[TopicPartition(topic, p, offset) for p, offset in offsets.items()], asynchronous=False
        )
    finally:
        committer.close()


def _committed(kafka: KafkaConnection, group: str, topic: str) -> dict[int, int]:
    probe = Consumer(consumer_config(kafka, group, "test-committed"))
    try:
        found = probe.committed([TopicPartition(topic, p) for p in (0, 1)], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        probe.close()


def test_a_new_group_starts_where_its_peers_have_committed(kafka: KafkaConnection, topic_prefix: str) -> None:
    """A rollout candidate's first worker: its group starts where the serving versions' groups have all
    committed, not at the topic's first record; a group with members keeps its own positions."""
    from bus.consumer import ConsumerThread
    from bus.positions import start_at_peers

    topic = f"{topic_prefix}.peers"
    _topic(kafka, topic)
    _produce(kafka, topic, 0, 6)
    _produce(kafka, topic, 1, 3)
    stable, other, new = (f"{topic_prefix}-{name}" for name in ("stable", "other", "new"))
    _commit(kafka, stable, topic, {0: 6, 1: 3})
    _commit(kafka, other, topic, {0: 4, 1: 3})
    assert start_at_peers(kafka, new, topic, [stable, other], "test") == {0: 4, 1: 3}
    assert _committed(kafka, new, topic) == {0: 4, 1: 3}
    assert start_at_peers(kafka, new, topic, [stable], "test") == {0: 6}  # behind on 0 only
    assert start_at_peers(kafka, new, topic, [], "test") == {}

    busy = f"{topic_prefix}-busy"
    member = ConsumerThread(
        consumer_config(kafka, busy, "test-member"), lambda batch: None, subscribe=[topic]
    )
    with member:
        assert member.wait_assigned(30)
        began = time.monotonic()
        assert start_at_peers(kafka, busy, topic, [stable], "test", timeout_s=10) == {}
        assert time.monotonic() - began < 5, "a refused commit is an answer, not a cluster settling"
