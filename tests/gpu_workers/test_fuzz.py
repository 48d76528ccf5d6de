"""Malformed records on a model's request topic with a real worker running: every one is dead-lettered,
the worker never fails, and a valid request after them completes."""

# ruff: noqa: F811 (the worker fixtures are imported from test_service, and named again as parameters)
from __future__ import annotations

import contextlib
import random

import msgspec
import pytest
from confluent_kafka import Producer, TopicPartition

from bus.consumer import ConsumerThread, consumer_config
from bus.producer import EventProducer
from gpu_workers.service import WorkerService
from schemas.codec import MAX_RECORD_BYTES, encode, headers
from schemas.events import CancelRequested, DeadLetter, GenerationRequested
from schemas.examples import example_events
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames
from tests.gpu_workers.test_service import (  # noqa: F401 (fixtures)
    PROMPT,
    Log,
    _generation,
    gpt_worker,
    names,
    platform,
    producer,
    replies,
)

pytestmark = pytest.mark.integration

Record = tuple[bytes, list[tuple[str, str | bytes | None]]]


def _junk(rng: random.Random, names: TopicNames) -> list[Record]:
    """Records no worker may run: each one must be dead-lettered."""
    events = [msgspec.json.encode(e) for e in example_events()]
    request = encode(_generation(names, PROMPT))
    request_fields = msgspec.json.decode(request)
    cancel = CancelRequested(
        tenant="acme", model="demo-gpt", request_id="x", source="t", reason="client_cancel"
    )
    records: list[Record] = []
    for _ in range(60):
        records.append((rng.randbytes(rng.randrange(1, 200)), []))  # random bytes
    for _ in range(60):
        whole = rng.choice([*events, request])
        records.append((whole[: rng.randrange(1, len(whole))], []))  # truncated JSON of real events
    wrong: list[object] = [None, 7, -1, "x", [], {}, 1e308, True, "2026-13-45T99:00:00Z", 2**64]
    for field in sorted(request_fields):
        if field == "type":
            continue
        for value in rng.sample(wrong, 4):  # valid JSON, one field of a wrong type
            body = {**request_fields, field: value}
            try:
                msgspec.json.decode(msgspec.json.encode(body), type=GenerationRequested)
            except msgspec.ValidationError:
                records.append((msgspec.json.encode(body), []))
    for size in (200_000, 600_000, MAX_RECORD_BYTES - 10_000):  # huge, near the record limit
        records.append((b'{"type":"generation_requested","pad":"' + b"x" * size + b'"', []))
    records.append((request[:-1] + b',"zz":' + b"[" * 50_000 + b"}", []))  # nested too deep
    records.append((b"", []))  # empty
    # msgspec raises UnicodeDecodeError for this, not its DecodeError: it stopped the requests consumer
    records.append((request.replace(b'"tenant":"', b'"tenant":"\xff', 1), []))
    # over the envelope's bound: its terminal event's key and headers would not fit a record
    records.append((encode(msgspec.structs.replace(_generation(names, PROMPT), tenant="t" * 300_000)), []))
    for model in ("other-model", "Demo-GPT"):  # another model's request: run here, it could run twice
        records.append((encode(msgspec.structs.replace(_generation(names, PROMPT), model=model)), []))
    for _ in range(20):  # a valid body under another event's headers
        records.append((encode(_generation(names, PROMPT)), [(k, v) for k, v in headers(cancel)]))
    return records


async def test_fuzzed_records_are_dead_lettered_and_the_worker_lives(
    names: TopicNames,
    gpt_worker: WorkerService,
    producer: EventProducer,
    replies: Log,
    kafka_bootstrap: str,
    kafka: KafkaConnection,
) -> None:
    records = _junk(random.Random(11), names)
    raw = Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": MAX_RECORD_BYTES + 100_000})
    topic = names.requests("demo-gpt")
    for i, (value, record_headers) in enumerate(records):
        raw.produce(topic, value, partition=i % 2, headers=record_headers or None)
        raw.poll(0)
    assert raw.flush(30) == 0
    valid = _generation(names, PROMPT)
    await producer.publish(topic, valid)
    assert replies.finished(valid.request_id, timeout=60).status == "completed"

    dead = Log()
    parts = [TopicPartition(names.deadletter, p, 0) for p in range(2)]
    with (
        ConsumerThread(consumer_config(kafka, None, "t"), dead, assign=parts),
        contextlib.suppress(AssertionError),  # the count below says how many are missing
    ):
        dead.wait(lambda: len(dead.events) >= len(records), 30)
    letters = [e for e in dead.events if isinstance(e, DeadLetter) and e.source_topic == topic]
    assert len(letters) == len(records)
    assert gpt_worker.failure is None
