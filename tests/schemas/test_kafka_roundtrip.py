"""Every event type travels through the real broker and decodes back equal, via both Kafka clients.

confluent-kafka is what the edge and workers use; aiokafka is what Faust (streams) uses underneath.
"""

from __future__ import annotations

import time

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from confluent_kafka import Consumer, Producer

from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.codec import DecodeError, HeaderValue, decode, encode, headers, kafka_key
from schemas.events import Event
from schemas.examples import example_events
from schemas.settings import KafkaConnection

pytestmark = pytest.mark.integration


def _topic(kafka: KafkaConnection, name: str) -> str:
    apply_topics(make_admin(kafka), [TopicSpec(name=name, partitions=1, config={}, purpose="test")])
    return name


def _consume_confluent(
    kafka: KafkaConnection, topic: str, count: int
) -> list[tuple[bytes, list[tuple[str, HeaderValue]]]]:
    consumer = Consumer(
        {
            **kafka.client_config(),
            "group.id": f"{topic}-reader",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    consumer.subscribe([topic])
    got: list[tuple[bytes, list[tuple[str, HeaderValue]]]] = []
    deadline = time.monotonic() + 30
    try:
        while len(got) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            assert msg.error() is None, msg.error()
            raw = msg.headers() or []
            got.append((msg.value() or b"", list(raw.items() if isinstance(raw, dict) else raw)))
    finally:
        consumer.close()
    return got


def test_every_event_round_trips_through_confluent_kafka(kafka: KafkaConnection, topic_prefix: str) -> None:
    topic = _topic(kafka, f"{topic_prefix}.events")
    events = example_events()
    producer = Producer({**kafka.client_config(), "acks": "all", "enable.idempotence": True})
    for event in events:
        producer.produce(topic, encode(event), key=kafka_key(event), headers=list(headers(event)))
    assert producer.flush(15) == 0
    received = _consume_confluent(kafka, topic, len(events))
    decoded: list[Event] = [decode(value, hdrs) for value, hdrs in received]
    assert decoded == events
    assert {type(e) for e in decoded} == {type(e) for e in events}


async def test_every_event_round_trips_through_aiokafka(kafka: KafkaConnection, topic_prefix: str) -> None:
    topic = _topic(kafka, f"{topic_prefix}.events")
    events = example_events()
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for event in events:
            await producer.send_and_wait(topic, encode(event), key=kafka_key(event), headers=headers(event))
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka.bootstrap,
        group_id=f"{topic}-aio",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    decoded: list[Event] = []
    try:
        deadline = time.monotonic() + 30
        while len(decoded) < len(events) and time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=500)
            for records in batches.values():
                decoded += [decode(r.value or b"", list(r.headers)) for r in records]
    finally:
        await consumer.stop()
    assert decoded == events


def test_malformed_bytes_from_the_broker_raise_the_decoding_error(
    kafka: KafkaConnection, topic_prefix: str
) -> None:
    topic = _topic(kafka, f"{topic_prefix}.junk")
    junk = [b"\x00\xff\xfe binary junk", b'{"type": "no_such_event"}', b'{"type": "token_chunk"}', b"[1,2"]
    producer = Producer(kafka.client_config())
    for value in junk:
        producer.produce(topic, value)
    assert producer.flush(15) == 0
    received = _consume_confluent(kafka, topic, len(junk))
    assert [value for value, _ in received] == junk
    for value, hdrs in received:
        with pytest.raises(DecodeError):
            decode(value, hdrs)
