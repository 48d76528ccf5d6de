"""The worker on the real broker: events in, chunks and exactly one terminal event out, offsets committed
after durability, cancels, deadlines, redelivery and dead letters."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from confluent_kafka import Consumer, Message, Producer, TopicPartition

from bus.consumer import ConsumerThread, consumer_config
from bus.control import read_control
from bus.positions import watermarks
from bus.producer import EventProducer
from gpu_workers import GpuWorkerError
from gpu_workers.main import make_worker
from gpu_workers.service import WorkerService
from gpu_workers.settings import WorkerSettings
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from schemas.codec import decode, encode, headers, kafka_key
from schemas.events import (
    CancelRequested,
    DeadLetter,
    DeploymentChanged,
    EmbeddingRequested,
    Event,
    GenerationRequested,
    ReplyTo,
    RequestFinished,
    SamplingParams,
    TokenChunk,
    Usage,
    WorkerReady,
    utc_now,
)
from schemas.ids import uuid7
from schemas.manifest import ManifestError, read_manifest
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from tests.conftest import versioned_cache

pytestmark = pytest.mark.integration

MODELS = ["demo-gpt", "all-minilm-l6-v2"]


class Log:
    """Every event on a topic, decoded, collected by a background consumer."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.lock = threading.Lock()
        self.positions: dict[int, int] = {}

    def __call__(self, batch: list[Message]) -> None:
        with self.lock:
            self.events += [decode(m.value() or b"") for m in batch]
            for m in batch:
                self.positions[m.partition() or 0] = (m.offset() or 0) + 1

    def caught_up(self, kafka: KafkaConnection, topic: str, timeout: float = 30) -> None:
        """Wait until every record the topic holds now has been read (a duplicate already produced is in)."""
        probe = Consumer(consumer_config(kafka, None, "test-probe"))
        try:
            parts = probe.list_topics(topic, timeout=10).topics[topic].partitions
            ends = {p: watermarks(probe, topic, p)[1] for p in parts}
        finally:
            probe.close()
        self.wait(lambda: all(self.positions.get(p, 0) >= end for p, end in ends.items()), timeout)

    def of(self, request_id: str) -> list[Event]:
        with self.lock:
            return [e for e in self.events if e.request_id == request_id]

    def wait(self, predicate: Callable[[], bool], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(0.02)
        raise AssertionError("condition not met in time")

    def finished(self, request_id: str, timeout: float = 60) -> RequestFinished:
        self.wait(lambda: any(isinstance(e, RequestFinished) for e in self.of(request_id)), timeout)
        (result,) = [e for e in self.of(request_id) if isinstance(e, RequestFinished)]
        return result


def featureless(event: RequestFinished) -> RequestFinished:
    """A terminal event without its drift features: only the results copy carries all of them."""
    return msgspec.structs.replace(event, features=None)


@pytest.fixture
def names(kafka: KafkaConnection, topic_prefix: str) -> TopicNames:
    names = TopicNames(topic_prefix)
    apply_topics(
        make_admin(kafka),
        platform_topics(names, MODELS, TopicSizing(requests=2, replies=2, events=2)),
    )
    return names


@pytest.fixture
def platform(
    platform_settings: PlatformSettings, kafka: KafkaConnection, names: TopicNames
) -> PlatformSettings:
    import msgspec

    return msgspec.structs.replace(
        platform_settings, kafka_bootstrap=kafka.bootstrap, topic_prefix=names.prefix
    )


def _listen(kafka: KafkaConnection, topic: str) -> Iterator[Log]:
    log = Log()
    consumer = Consumer(consumer_config(kafka, None, "test-probe"))
    parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    consumer.close()
    with ConsumerThread(
        consumer_config(kafka, None, "test"), log, assign=[TopicPartition(topic, p, 0) for p in parts]
    ):
        yield log


@pytest.fixture
def replies(kafka: KafkaConnection, names: TopicNames) -> Iterator[Log]:
    yield from _listen(kafka, names.replies)


@pytest.fixture
def results(kafka: KafkaConnection, names: TopicNames) -> Iterator[Log]:
    yield from _listen(kafka, names.results)


@pytest.fixture
def producer(kafka: KafkaConnection) -> Iterator[EventProducer]:
    with EventProducer(kafka, "test-edge") as p:
        yield p


@pytest.fixture
def gpt_worker(platform: PlatformSettings, demo_gpt_dir: Path) -> Iterator[WorkerService]:
    worker = make_worker(platform, WorkerSettings(worker_id="w1", worker_flush_tokens=4), "demo-gpt")
    with worker:
        assert worker.wait_assigned(30)
        yield worker


def _generation(
    names: TopicNames,
    prompt_ids: list[int],
    *,
    sampling: SamplingParams | None = None,
    stream: bool = False,
    deadline: datetime | None = None,
) -> GenerationRequested:
    return GenerationRequested(
        tenant="acme",
        model="demo-gpt",
        request_id=uuid7(),
        source="test",
        model_version="v",
        input_ids=prompt_ids,
        sampling=sampling or SamplingParams(max_tokens=24, temperature=0.0),
        stream=stream,
        deadline=deadline,
        reply=ReplyTo(topic=names.replies, partition=1, edge_id="e1"),
    )


PROMPT = [5, 6, 7, 8, 9, 10]


async def test_streamed_generation_ends_in_one_terminal_event(
    names: TopicNames,
    gpt_worker: WorkerService,
    producer: EventProducer,
    replies: Log,
    results: Log,
    kafka: KafkaConnection,
) -> None:
    request = _generation(names, PROMPT, stream=True)
    await producer.publish(names.requests("demo-gpt"), request)
    finished = replies.finished(request.request_id)
    assert finished.status == "completed"
    assert finished.finish_reason in ("length", "stop")
    chunks = [e for e in replies.of(request.request_id) if isinstance(e, TokenChunk)]
    assert [c.seq for c in chunks] == list(range(len(chunks)))
    offsets = [c.offset for c in chunks]
    assert offsets == [sum(len(c.token_ids) for c in chunks[:i]) for i in range(len(chunks))]
    assert "".join(c.text for c in chunks) == finished.text
    assert finished.usage.completion_tokens == sum(len(c.token_ids) for c in chunks)
    assert finished.usage.prompt_tokens == len(PROMPT)
    assert featureless(results.finished(request.request_id)) == featureless(finished)  # one event, two copies
    described = results.finished(request.request_id).features
    assert described is not None
    assert described.output_chars == len(finished.text or "")
    # the offset is committed once the terminal event is durable
    probe = Consumer(consumer_config(kafka, gpt_worker.group, "probe"))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            committed = probe.committed(
                [TopicPartition(names.requests("demo-gpt"), p) for p in (0, 1)], timeout=10
            )
            if sum(max(tp.offset, 0) for tp in committed) == 1:
                break
            await asyncio.sleep(0.1)
        assert sum(max(tp.offset, 0) for tp in committed) == 1
    finally:
        probe.close()


async def test_cancel_stops_a_running_request(
    names: TopicNames, gpt_worker: WorkerService, producer: EventProducer, replies: Log
) -> None:
    request = _generation(
        names, PROMPT, stream=True, sampling=SamplingParams(max_tokens=250, temperature=0.8, ignore_eos=True)
    )

    def cancel(request_id: str) -> CancelRequested:
        return CancelRequested(
            tenant="acme", model="demo-gpt", request_id=request_id, source="test", reason="client_disconnect"
        )

    # A long-lived edge's producer knows the cancel topic already; make this one warm the same way, so
    # the cancel below is not held up by a first metadata fetch (a cancel of an unknown id is ignored).
    await producer.publish(names.cancels, cancel(uuid7()))
    await producer.publish(names.requests("demo-gpt"), request)
    replies.wait(lambda: any(isinstance(e, TokenChunk) for e in replies.of(request.request_id)))
    await producer.publish(names.cancels, cancel(request.request_id))
    finished = replies.finished(request.request_id)
    assert finished.status == "cancelled"
    assert finished.finish_reason == "cancelled"
    assert finished.usage.completion_tokens < 250
    events = replies.of(request.request_id)
    assert isinstance(events[-1], RequestFinished)  # nothing after the terminal event
    streamed = sum(len(e.token_ids) for e in events if isinstance(e, TokenChunk))
    assert streamed == finished.usage.completion_tokens


async def test_past_deadline_expires_without_running(
    names: TopicNames, gpt_worker: WorkerService, producer: EventProducer, replies: Log
) -> None:
    request = _generation(names, PROMPT, stream=True, deadline=utc_now() - timedelta(seconds=1))
    await producer.publish(names.requests("demo-gpt"), request)
    finished = replies.finished(request.request_id)
    assert finished.status == "expired"
    assert finished.timings.started is None
    assert finished.usage.completion_tokens == 0
    assert [e for e in replies.of(request.request_id) if isinstance(e, TokenChunk)] == []


async def test_redelivered_finished_request_is_not_run_again_and_junk_is_dead_lettered(
    names: TopicNames,
    gpt_worker: WorkerService,
    producer: EventProducer,
    replies: Log,
    kafka: KafkaConnection,
) -> None:
    request = _generation(names, PROMPT)
    await producer.publish(names.requests("demo-gpt"), request, partition=0)
    replies.finished(request.request_id)
    junk = Producer(kafka.client_config())
    junk.produce(names.requests("demo-gpt"), b"{not json", partition=0)
    assert junk.flush(10) == 0
    await producer.publish(names.requests("demo-gpt"), request, partition=0)  # a redelivery
    after = _generation(names, PROMPT)
    await producer.publish(names.requests("demo-gpt"), after, partition=0)
    replies.finished(after.request_id)  # the worker kept going past the junk and the duplicate
    assert len([e for e in replies.of(request.request_id) if isinstance(e, RequestFinished)]) == 1
    (letter,) = _dead_letters(kafka, names, 1)
    assert letter.source_topic == names.requests("demo-gpt")


def _dead_letters(kafka: KafkaConnection, names: TopicNames, n: int) -> list[DeadLetter]:
    """The first ``n`` dead letters (waited for)."""
    dead = Log()
    with ConsumerThread(
        consumer_config(kafka, None, "t"), dead, assign=[TopicPartition(names.deadletter, 0, 0)]
    ):
        dead.wait(lambda: len(dead.events) >= n)
    letters = [e for e in dead.events if isinstance(e, DeadLetter)]
    assert len(letters) == len(dead.events)
    return letters


async def test_an_event_of_another_kind_on_the_request_topic_is_dead_lettered(
    names: TopicNames,
    gpt_worker: WorkerService,
    producer: EventProducer,
    replies: Log,
    kafka: KafkaConnection,
) -> None:
    """Found by an audit: a valid event that is not a request (a cancel, a result) was committed with a log
    line and no dead letter, unlike every other record the worker cannot run; and a tombstone's letter
    said "Input data was truncated"."""
    topic = names.requests("demo-gpt")
    await producer.publish(topic, _finished_elsewhere(uuid7(), 3), partition=0)
    raw = Producer(kafka.client_config())
    raw.produce(topic, None, b"acme", partition=0)
    assert raw.flush(10) == 0
    after = _generation(names, PROMPT)
    await producer.publish(topic, after, partition=0)
    assert replies.finished(after.request_id).status == "completed"
    letters = _dead_letters(kafka, names, 2)
    assert [letter.source_topic for letter in letters] == [topic, topic]
    assert "RequestFinished on the request topic" in letters[0].reason
    assert "tombstone" in letters[1].reason


async def test_a_request_asking_for_its_replies_on_another_topic_is_dead_lettered(
    names: TopicNames,
    gpt_worker: WorkerService,
    producer: EventProducer,
    replies: Log,
    kafka: KafkaConnection,
) -> None:
    """Found by an audit: the worker wrote chunks and the terminal event to whatever topic a request named
    for its replies: the results topic got the terminal event twice (one terminal event per request, broken
    for every reader of it), the compacted control topic a record under a tenant's key. Only an edge writes
    request events, and it names the replies topic; one that names another is lettered, not run."""
    topic = names.requests("demo-gpt")
    hijack = msgspec.structs.replace(
        _generation(names, PROMPT), reply=ReplyTo(topic=names.results, partition=0, edge_id="e1")
    )
    await producer.publish(topic, hijack, partition=0)
    after = _generation(names, PROMPT)
    await producer.publish(topic, after, partition=0)
    assert replies.finished(after.request_id).status == "completed"  # the worker went on past it
    (letter,) = _dead_letters(kafka, names, 1)
    assert letter.source_topic == topic
    assert f"replies asked on {names.results!r}" in letter.reason
    assert replies.of(hijack.request_id) == []


async def test_embeddings_are_batched_and_returned(
    names: TopicNames,
    platform: PlatformSettings,
    producer: EventProducer,
    replies: Log,
    shared_models_root: Path,
    minilm_source: Path,
) -> None:
    from gpu_workers.models import MINILM_ID, prepare_hf_dir

    prepare_hf_dir(MINILM_ID, minilm_source, shared_models_root, task="embedding")
    manifest = read_manifest(shared_models_root / MINILM_ID / "current")
    worker = make_worker(platform, WorkerSettings(worker_id="e1"), MINILM_ID)
    with worker:
        assert worker.wait_assigned(30)
        requests = [
            EmbeddingRequested(
                tenant="acme",
                model=MINILM_ID,
                request_id=uuid7(),
                source="test",
                model_version=manifest.version,
                inputs=[[101, 7592 + i, 2088, 102], [101, 2023, 102]],
                reply=ReplyTo(topic=names.replies, partition=0, edge_id="e1"),
            )
            for i in range(5)
        ]
        for request in requests:
            await producer.publish(names.requests(MINILM_ID), request)
        for request in requests:
            finished = replies.finished(request.request_id)
            assert finished.status == "completed"
            assert finished.embeddings_f32 is not None, "vectors travel packed as float32"
            assert finished.embeddings_f32.dim == manifest.embedding_dim
            vectors = finished.vectors()
            assert vectors is not None
            assert len(vectors) == 2
            assert all(len(v) == manifest.embedding_dim for v in vectors)
            assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-4
            assert finished.usage.prompt_tokens == 7


async def test_a_result_too_large_for_the_log_fails_that_request_and_the_worker_keeps_serving(
    names: TopicNames,
    platform: PlatformSettings,
    producer: EventProducer,
    replies: Log,
    shared_models_root: Path,
    minilm_source: Path,
) -> None:
    """Poison pill: 4,100 inputs make a terminal event of ~8.4 MB (2,048 base64 characters per 384-dim
    float32 vector), over the producer's record limit (8 MiB less the batch framing), which holds 4,055;
    the edge refuses more than 2,048 (when the limit was Kafka's default 1 MB: 600 inputs, over 480).
    Before, the publish error killed the model thread (and the redelivered request killed the restarted
    worker again); now that request fails with a reason and the next one is served."""
    from gpu_workers.models import MINILM_ID, prepare_hf_dir

    prepare_hf_dir(MINILM_ID, minilm_source, shared_models_root, task="embedding")
    manifest = read_manifest(shared_models_root / MINILM_ID / "current")
    settings = WorkerSettings(worker_id="big", drift_sample=0, worker_embed_max_queued=8192)
    worker = make_worker(platform, settings, MINILM_ID)
    with worker:
        assert worker.wait_assigned(30)

        def request(inputs: int) -> EmbeddingRequested:
            return EmbeddingRequested(
                tenant="acme",
                model=MINILM_ID,
                request_id=uuid7(),
                source="test",
                model_version=manifest.version,
                inputs=[[101, 7592 + i % 50, 2088, 102] for i in range(inputs)],
                reply=ReplyTo(topic=names.replies, partition=0, edge_id="e1"),
            )

        big, small = request(4100), request(1)
        await producer.publish(names.requests(MINILM_ID), big)
        await producer.publish(names.requests(MINILM_ID), small)
        failed = replies.finished(big.request_id)
        assert failed.status == "failed"
        assert failed.error is not None
        assert failed.error.code == "result_too_large"
        assert "bytes" in failed.error.message
        assert failed.vectors() is None
        assert failed.usage.total_tokens == 0, "nothing is billed for a result nobody got"
        served = replies.finished(small.request_id)
        assert served.status == "completed"
        assert worker.failure is None


async def test_a_request_naming_a_reply_partition_that_does_not_exist_ends_on_results_alone(
    names: TopicNames,
    gpt_worker: WorkerService,
    producer: EventProducer,
    replies: Log,
    results: Log,
) -> None:
    """Poison pill from a producer other than an edge: the replies topic has 2 partitions and the request
    names the 51st. librdkafka refuses that record at once, and the refusal killed the model thread (and
    the restarted worker again at every redelivery). Now its result goes to the results topic only, which
    commits it, and the worker keeps serving."""
    stray = msgspec.structs.replace(
        _generation(names, PROMPT, stream=True),
        reply=ReplyTo(topic=names.replies, partition=50, edge_id="gone"),
    )
    fine = _generation(names, PROMPT)
    await producer.publish(names.requests("demo-gpt"), stray)
    await producer.publish(names.requests("demo-gpt"), fine)
    assert results.finished(stray.request_id).status == "completed"
    assert replies.finished(fine.request_id).status == "completed"
    assert gpt_worker.failure is None
    assert replies.of(stray.request_id) == []


async def eventually(predicate: Callable[[], bool], within: float) -> None:
    """Poll ``predicate`` without blocking the loop until it holds or ``within`` seconds pass."""
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, f"not within {within} s"
        await asyncio.sleep(0.02)


async def test_a_cancel_that_arrives_before_its_request_still_cancels_it(
    names: TopicNames, gpt_worker: WorkerService, producer: EventProducer, replies: Log
) -> None:
    """The cancel listener and the request consumer are separate threads: a cancel can win the race.
    Before, it was dropped and the request ran to its end."""
    request = _generation(
        names, PROMPT, stream=True, sampling=SamplingParams(max_tokens=250, temperature=0.8, ignore_eos=True)
    )
    held = gpt_worker.early_cancels
    await producer.publish(
        names.cancels,
        CancelRequested(
            tenant="acme",
            model="demo-gpt",
            request_id=request.request_id,
            source="test",
            reason="client_cancel",
        ),
    )
    await eventually(lambda: gpt_worker.early_cancels != held, within=20)
    assert gpt_worker.early_cancels == held + 1, "the worker holds the cancel of a request it has not seen"
    await producer.publish(names.requests("demo-gpt"), request)
    finished = replies.finished(request.request_id)
    assert finished.status == "cancelled"
    assert finished.usage.completion_tokens == 0
    assert [e for e in replies.of(request.request_id) if isinstance(e, TokenChunk)] == []
    assert gpt_worker.early_cancels == held


async def test_a_results_copy_kafka_did_not_take_fails_the_worker_and_its_successor_runs_it_once(
    names: TopicNames,
    platform: PlatformSettings,
    gpt_worker: WorkerService,
    producer: EventProducer,
    results: Log,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Whether the log has a terminal event whose results copy timed out is unknown: a retry could end its
    request twice, and un-finishing it to wait for a redelivery left it unended until some rebalance. The
    worker fails and commits nothing past it; the worker started in its place reads the results topic and
    runs it (the group redelivers it from the last commit), once."""
    from bus.errors import BusError

    worker_producer = gpt_worker._producer
    real_produce = worker_producer.produce_raw
    dropped: list[str] = []

    def flaky(topic: str, value: bytes, **kwargs: Any) -> None:
        event = decode(value)
        if topic == names.results and isinstance(event, RequestFinished) and not dropped:
            dropped.append(event.request_id)
            kwargs["on_delivery"](BusError("broker went away"), None)  # delivery failed after retries
            return
        real_produce(topic, value, **kwargs)

    monkeypatch.setattr(worker_producer, "produce_raw", flaky)
    request = _generation(names, PROMPT)
    await producer.publish(names.requests("demo-gpt"), request)
    await eventually(lambda: gpt_worker.failure is not None, within=30)
    assert dropped == [request.request_id]
    gpt_worker.stop()
    successor = make_worker(platform, WorkerSettings(worker_id="w2", worker_flush_tokens=4), "demo-gpt")
    with successor:
        assert successor.wait_assigned(30)
        finished = results.finished(request.request_id)
        assert finished.status == "completed"
        assert finished.worker_id == "w2"
        await asyncio.sleep(1.0)
        assert len([e for e in results.of(request.request_id) if isinstance(e, RequestFinished)]) == 1


def _finished_elsewhere(request_id: str, completion_tokens: int) -> RequestFinished:
    """The terminal event another worker published for ``request_id``."""
    return RequestFinished(
        tenant="acme",
        model="demo-gpt",
        request_id=request_id,
        source="gpu_workers/another-worker",
        status="completed",
        finish_reason="length",
        usage=Usage(
            prompt_tokens=len(PROMPT),
            completion_tokens=completion_tokens,
            total_tokens=len(PROMPT) + completion_tokens,
        ),
    )


async def test_a_request_another_worker_finished_is_not_run_again_when_handed_over(
    names: TopicNames, gpt_worker: WorkerService, producer: EventProducer, replies: Log
) -> None:
    """After a rebalance a worker can be handed a record whose request another worker already finished
    (its offset not committed yet). Before, finished ids were learned only at start, so it ran again."""
    handed_over = _generation(names, PROMPT)
    elsewhere = _finished_elsewhere(handed_over.request_id, 24)
    await producer.publish(names.results, elsewhere)
    await eventually(lambda: gpt_worker.knows_finished(handed_over.request_id), within=20)
    assert gpt_worker.knows_finished(handed_over.request_id)
    after = _generation(names, PROMPT)  # same tenant: same partition, so it comes after the handed-over one
    await producer.publish(names.requests("demo-gpt"), handed_over)
    await producer.publish(names.requests("demo-gpt"), after)
    assert replies.finished(after.request_id).status == "completed"
    assert replies.of(handed_over.request_id) == [], "not run a second time"


def _put_results(kafka: KafkaConnection, topic: str, timed: list[tuple[RequestFinished, int]]) -> None:
    """Terminal events on results partition 1, in this order, each with its record time (unix ms)."""
    raw = Producer(kafka.client_config())
    for event, at in timed:
        record_headers: list[tuple[str, str | bytes | None]] = [*headers(event)]
        raw.produce(topic, encode(event), kafka_key(event), headers=record_headers, partition=1, timestamp=at)
    assert raw.flush(10) == 0


async def test_a_restarted_worker_remembers_the_newest_results_whatever_order_it_reads_them_in(
    platform: PlatformSettings,
    demo_gpt_dir: Path,
    names: TopicNames,
    kafka: KafkaConnection,
    producer: EventProducer,
    replies: Log,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by an audit: a worker learning finished requests at start kept the last ``remember_finished``
    ids in the order it read them, so older results read after a newer one (a hot tenant's partition read
    last) pushed it out, and that request, finished by a worker that died before committing its record,
    ran again when redelivered: two terminal events. It keeps the newest by record time."""
    request = _generation(names, PROMPT)
    now = int(time.time() * 1000)
    older = [(_finished_elsewhere(uuid7(), 24), now - 60_000 + i) for i in range(300)]
    _put_results(kafka, names.results, [(_finished_elsewhere(request.request_id, 24), now), *older])
    worker = make_worker(platform, WorkerSettings(worker_id="w-restarted"), "demo-gpt")
    worker._remember = 100
    with caplog.at_level(logging.INFO, logger="gpu_workers.service"), worker:
        assert worker.knows_finished(request.request_id)
        assert worker.wait_assigned(30)
        after = _generation(names, PROMPT)
        await producer.publish(names.requests("demo-gpt"), request)  # its record, handed to this worker again
        await producer.publish(names.requests("demo-gpt"), after)
        assert replies.finished(after.request_id).status == "completed"
        assert replies.of(request.request_id) == [], "not run a second time"
    said = [r.getMessage() for r in caplog.records]
    # a redelivery skips a record per request: summed up (by the stop here), not a line each at info
    assert [line for line in said if request.request_id in line] == []
    (summed,) = [line for line in said if "records skipped" in line]
    assert re.fullmatch(r"worker w-restarted \(\w+\): 1 records skipped in \d+ s: 1 already finished", summed)


async def test_a_worker_learns_results_from_the_oldest_request_it_could_be_handed(
    platform: PlatformSettings, demo_gpt_dir: Path, names: TopicNames, kafka: KafkaConnection
) -> None:
    """Found by an audit: a worker read the whole results topic at start (a week of every model's
    results, text and vectors), and the read had to end within 120 s: past ~1-8 requests a second no
    worker could start. It reads from the time of the oldest request record its group could still be
    handed, less the clocks' skew: nothing older can be a redelivered request's result."""
    now = int(time.time() * 1000)
    old, recent = _finished_elsewhere(uuid7(), 24), _finished_elsewhere(uuid7(), 24)
    _put_results(kafka, names.results, [(old, now - 3_600_000), (recent, now - 1_000)])
    worker = make_worker(platform, WorkerSettings(worker_id="w-bounded"), "demo-gpt")
    topic = names.requests("demo-gpt")
    committer = Consumer(consumer_config(kafka, worker.group, "test-committer"))
    try:  # the group has every request record of both partitions done: nothing older than now to hand
        committer.commit(offsets=[TopicPartition(topic, p, 0) for p in (0, 1)], asynchronous=False)
    finally:
        committer.close()
    with worker:
        assert worker.knows_finished(recent.request_id)
        assert not worker.knows_finished(old.request_id)  # an hour before anything it could be handed


async def test_a_request_finished_elsewhere_while_it_runs_here_ends_there_alone(
    platform: PlatformSettings,
    demo_gpt_dir: Path,
    names: TopicNames,
    producer: EventProducer,
    results: Log,
    replies: Log,
) -> None:
    """Two workers can run one request: the stable version's worker adopts a retiring version's request
    that its own worker then finishes after all, or a rebalance hands a record over while its old owner
    still runs it. The terminal event that reaches the log first ends it; the run still going learns it
    from the results tail and ends without one. Before, both ended it."""
    slow = make_worker(  # ~25 ms a step: 120 tokens take 3 s here
        platform, WorkerSettings(worker_id="w-slow", worker_flush_tokens=4, fault_delay_ms=25), "demo-gpt"
    )
    with slow:
        assert slow.wait_assigned(30)
        request = _generation(
            names, PROMPT, sampling=SamplingParams(max_tokens=120, temperature=0.0), stream=True
        )
        await producer.publish(names.requests("demo-gpt"), request)
        await asyncio.to_thread(replies.wait, lambda: bool(replies.of(request.request_id)), 30)  # running
        elsewhere = _finished_elsewhere(request.request_id, 120)
        await producer.publish(names.results, elsewhere)
        await eventually(lambda: slow.knows_finished(request.request_id), within=20)
        after = _generation(names, PROMPT)
        await producer.publish(names.requests("demo-gpt"), after)
        assert (await asyncio.to_thread(results.finished, after.request_id)).status == "completed"
        await asyncio.sleep(3.5)  # past the time the first run would have ended on its own
        ended = [e for e in results.of(request.request_id) if isinstance(e, RequestFinished)]
        assert [e.source for e in ended] == ["gpu_workers/another-worker"]
        assert not [e for e in replies.of(request.request_id) if isinstance(e, RequestFinished)]


async def test_records_of_a_revoked_partition_still_in_the_inbox_are_dropped_not_run(
    names: TopicNames, gpt_worker: WorkerService, producer: EventProducer, replies: Log
) -> None:
    """A rebalance takes a partition away while some of its records wait in the inbox. Before, they ran
    anyway (the new owner runs them too) and re-created the revoked partition's offset tracking."""
    from gpu_workers.runtime import Arrival

    topic = names.requests("demo-gpt")
    gone = (topic, 99)  # a partition this test pretends the worker owned (the real ones keep working)
    stale = _generation(names, PROMPT)
    consumed_at = gpt_worker._ledger.generation
    gpt_worker._on_revoke([gone], False)  # the rebalance happens after the record was consumed...
    gpt_worker._put(Arrival(stale, gone, 7, generation=consumed_at))  # ...and before the model thread took it
    after = _generation(names, PROMPT)
    await producer.publish(topic, after)
    assert replies.finished(after.request_id).status == "completed"
    assert replies.of(stale.request_id) == [], "the revoked partition's record did not run here"
    assert gone not in gpt_worker._ledger.partitions, "no tracking (or commit) of a partition not owned"


# ------------------------------------------------------------------------------- versions and deployments

CANDIDATE = "cand00000001"


@pytest.fixture
def two_versions(
    platform: PlatformSettings, demo_gpt_dir: Path, tmp_path: Path
) -> tuple[PlatformSettings, str]:
    """A cache with demo-gpt's stable version (``current``) and a candidate copy: (platform, stable)."""
    stable = versioned_cache(tmp_path / "cache", "demo-gpt", demo_gpt_dir, CANDIDATE)
    return msgspec.structs.replace(platform, cache_dir=str(tmp_path / "cache")), stable


def _deployment(stable: str, share: float, *, phase: str = "canary") -> DeploymentChanged:
    traffic = {stable: 1.0 - share, CANDIDATE: share}
    return DeploymentChanged(
        tenant="",
        model="demo-gpt",
        source="test",
        version=CANDIDATE,
        action="deploy" if phase == "canary" else "rollback",
        traffic=traffic,
        reason="test",
        stable=stable,
        candidate=CANDIDATE,
        phase=phase,  # type: ignore[arg-type]
        steps=[share, 1.0],
    )


def _version_worker(platform: PlatformSettings, version: str, worker_id: str, **more: Any) -> WorkerService:
    settings = WorkerSettings(
        worker_id=worker_id, worker_version=version, worker_adopt_grace_s=1.0, drift_sample=0, **more
    )
    return make_worker(platform, settings, "demo-gpt")


async def test_each_version_runs_what_is_routed_to_it_and_holds_the_rest_until_it_ends(
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    results: Log,
    kafka: KafkaConnection,
) -> None:
    platform, stable = two_versions
    await producer.publish(names.control, _deployment(stable, 0.5))
    with _version_worker(platform, stable, "ws") as ws, _version_worker(platform, CANDIDATE, "wc") as wc:
        assert ws.group != wc.group  # one consumer group per version: each reads every record
        assert ws.wait_assigned(30)
        assert wc.wait_assigned(30)
        on_stable = msgspec.structs.replace(_generation(names, PROMPT), model_version=stable)
        on_candidate = msgspec.structs.replace(_generation(names, PROMPT), model_version=CANDIDATE)
        for request in (on_stable, on_candidate):
            await producer.publish(names.requests("demo-gpt"), request)
        assert results.finished(on_stable.request_id).model_version == stable
        assert results.finished(on_candidate.request_id).model_version == CANDIDATE
        # each worker held the other's record until the results tail showed it finished, then let it go
        results.wait(lambda: ws.held == 0 and wc.held == 0, timeout=20)
        await asyncio.sleep(1.0)
        for request in (on_stable, on_candidate):  # exactly one terminal event each
            assert len([e for e in results.of(request.request_id) if isinstance(e, RequestFinished)]) == 1


def _committed(kafka: KafkaConnection, group: str, topic: str) -> dict[int, int]:
    probe = Consumer(consumer_config(kafka, group, "test-committed"))
    try:
        partitions = probe.list_topics(topic, timeout=10).topics[topic].partitions
        found = probe.committed([TopicPartition(topic, p) for p in partitions], timeout=10)
        return {tp.partition: tp.offset for tp in found}
    finally:
        probe.close()


def _ends(kafka: KafkaConnection, topic: str) -> dict[int, int]:
    probe = Consumer(consumer_config(kafka, None, "test-ends"))
    try:
        partitions = probe.list_topics(topic, timeout=10).topics[topic].partitions
        return {p: watermarks(probe, topic, p)[1] for p in partitions}
    finally:
        probe.close()


@pytest.mark.parametrize("joins", [False, True], ids=["at-start", "warm-standby-joining"])
async def test_a_candidates_first_worker_starts_where_the_stable_version_committed_not_at_the_start(
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    results: Log,
    kafka: KafkaConnection,
    caplog: pytest.LogCaptureFixture,
    joins: bool,
) -> None:
    """Found under `sluice up`: a candidate's first worker has a new consumer group, which started at the
    request topic's first retained record, so it read the whole history (every record held or skipped)
    before the rollout's first requests routed to it: they waited 330 ms behind 15 s of traffic, and
    would behind a week of retention for good. The new group starts where the stable version's has
    committed (what is behind that has ended), when the worker starts and again when it subscribes: a
    warm standby joins minutes after it loaded."""
    platform, stable = two_versions
    topic = names.requests("demo-gpt")
    await producer.publish(names.control, msgspec.structs.replace(_deployment(stable, 0.0), phase="warming"))
    with contextlib.ExitStack() as stack, caplog.at_level(logging.DEBUG, logger="gpu_workers.service"):
        ws = stack.enter_context(_version_worker(platform, stable, "ws"))
        if joins:  # loaded and waiting before any of the history was written
            wc = stack.enter_context(_version_worker(platform, CANDIDATE, "wc", worker_standby=True))
        assert ws.wait_assigned(30)
        history = [
            msgspec.structs.replace(_generation(names, PROMPT), model_version=stable) for _ in range(8)
        ]
        for request in history:
            await producer.publish(topic, request)
        for request in history:
            results.finished(request.request_id)
        ends = {p: end for p, end in _ends(kafka, topic).items() if end > 0}

        def done() -> dict[int, int]:  # the stable version's commits (none on a partition it never read)
            committed = _committed(kafka, ws.group, topic)
            return {p: committed[p] for p in ends}

        await eventually(lambda: done() == ends, within=20)
        stable_at = _committed(kafka, ws.group, topic)
        if joins:
            wc.join()
        else:
            wc = stack.enter_context(_version_worker(platform, CANDIDATE, "wc"))
        assert _committed(kafka, wc.group, topic) == stable_at, "the new group starts where the stable's is"
        assert wc.wait_assigned(30)
        await producer.publish(names.control, _deployment(stable, 0.5))
        routed = msgspec.structs.replace(_generation(names, PROMPT), model_version=CANDIDATE)
        await producer.publish(topic, routed)
        assert results.finished(routed.request_id).model_version == CANDIDATE
    said = "\n".join(record.getMessage() for record in caplog.records)
    read = [r.request_id for r in history if r.request_id in said]
    assert read == [], "the candidate read records the stable version had ended"


async def test_a_standby_joins_from_its_own_positions_where_its_peers_cannot_be_read(
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    results: Log,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review: where the serving versions' positions could not be read (a broker's outage as a warm
    standby joins), ``join`` raised and the worker's process ended, losing the warm worker a scale-out
    wanted. It joins from its group's own positions, as before the group was ever moved."""
    from confluent_kafka import KafkaError, KafkaException

    import gpu_workers.service as service

    platform, stable = two_versions
    await producer.publish(names.control, _deployment(stable, 0.5))
    with _version_worker(platform, CANDIDATE, "wc", worker_standby=True) as wc:

        def unreadable(*args: Any, **kwargs: Any) -> dict[int, int]:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT))

        monkeypatch.setattr(service, "start_at_peers", unreadable)
        wc.join()
        assert wc.wait_assigned(30)
        routed = msgspec.structs.replace(_generation(names, PROMPT), model_version=CANDIDATE)
        await producer.publish(names.requests("demo-gpt"), routed)
        assert results.finished(routed.request_id).model_version == CANDIDATE


async def test_after_a_rollback_the_stable_version_runs_what_was_routed_to_the_candidate_once(
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    results: Log,
    replies: Log,
) -> None:
    platform, stable = two_versions
    await producer.publish(names.control, _deployment(stable, 0.2))
    with _version_worker(platform, stable, "ws") as ws:  # the candidate's worker is down (or never came up)
        assert ws.wait_assigned(30)
        routed = msgspec.structs.replace(_generation(names, PROMPT), model_version=CANDIDATE)
        shadow = msgspec.structs.replace(
            _generation(names, PROMPT), model_version=CANDIDATE, reply=None, shadow_of=routed.request_id
        )
        for request in (routed, shadow):
            await producer.publish(names.requests("demo-gpt"), request)
        results.wait(lambda: ws.held == 2, timeout=20)
        await asyncio.sleep(1.5)
        assert not results.of(routed.request_id), "a serving candidate's request ran on the stable version"
        await producer.publish(names.control, _deployment(stable, 0.0, phase="rolled_back"))
        finished = results.finished(routed.request_id)  # adopted after the grace period, run once
        assert finished.status == "completed"
        assert finished.model_version == stable
        # the client still gets its answer
        assert featureless(replies.finished(routed.request_id)) == featureless(finished)
        # the shadow copy is not run but ends once, cancelled by the version that took it over
        dropped = results.finished(shadow.request_id)
        assert (dropped.status, dropped.model_version, dropped.shadow_of) == (
            "cancelled",
            stable,
            routed.request_id,
        )
        assert dropped.usage.completion_tokens == 0, "a shadow copy of a retired candidate was run"
        results.wait(lambda: ws.held == 0, timeout=20)
        await asyncio.sleep(1.0)
        for request in (routed, shadow):
            assert len([e for e in results.of(request.request_id) if isinstance(e, RequestFinished)]) == 1
        assert [e for e in results.of(shadow.request_id) if not isinstance(e, RequestFinished)] == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["client", "shadow"])
async def test_a_rollback_behind_a_backlog_ends_each_request_once(
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    results: Log,
    kind: str,
) -> None:
    """The candidate is rolled back with a backlog queued in its runner: it finishes only what it had
    started, and gives the rest back to be held; the stable version adopts (a client's request) or drops
    (a shadow copy) them after the grace. Each ends once (a review saw 48-83 of 800 end on both versions
    when the retiring worker kept running its queue past the grace)."""
    platform, stable = two_versions
    await producer.publish(names.control, _deployment(stable, 0.5))
    slow = {"fault_delay_ms": 5, "fault_versions": (CANDIDATE,)}
    with (
        _version_worker(platform, stable, "ws") as ws,
        _version_worker(platform, CANDIDATE, "wc", **slow) as wc,
    ):
        assert ws.wait_assigned(30)
        assert wc.wait_assigned(30)
        sampling = SamplingParams(max_tokens=6, temperature=0.0)
        shadow = {"reply": None, "shadow_of": uuid7(), "priority": 1000} if kind == "shadow" else {}
        backlog = [
            msgspec.structs.replace(
                _generation(names, PROMPT, sampling=sampling), model_version=CANDIDATE, **shadow
            )
            for _ in range(300)
        ]
        for request in backlog:
            await producer.publish(names.requests("demo-gpt"), request)
        ids = {r.request_id for r in backlog}

        def ends() -> list[RequestFinished]:
            with results.lock:
                return [e for e in results.events if isinstance(e, RequestFinished) and e.request_id in ids]

        results.wait(lambda: len(ends()) >= 40, timeout=120)
        await producer.publish(names.control, _deployment(stable, 0.0, phase="rolled_back"))
        results.wait(lambda: len({e.request_id for e in ends()}) == len(ids), timeout=120)
        await asyncio.sleep(3.0)  # a second end would come within the grace (1 s) and a tail's lag
        finals = ends()
        assert len(finals) == len(ids), "a request ended on both versions"
        by = {(e.model_version, e.status) for e in finals}
        taken = (stable, "cancelled" if kind == "shadow" else "completed")
        assert taken in by, "the test proves nothing: the stable version took over none of the backlog"
        assert by <= {(CANDIDATE, "completed"), taken}


def _readiness(log: Log, worker: str) -> list[tuple[str, str]]:
    """(version, deployment) of each ``WorkerReady`` of ``worker`` on the log, in order."""
    with log.lock:
        return [
            (e.version, e.deployment) for e in log.events if isinstance(e, WorkerReady) and e.worker == worker
        ]


async def test_a_worker_says_it_is_ready_at_start_and_for_each_rollout_warming_its_version(
    kafka: KafkaConnection,
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
) -> None:
    """The rollout controller gives a candidate traffic only after one of its workers says it is ready for
    that very rollout (docs/rollout.md): a worker already running says so again when a rollout of its
    version starts warming; one started during the rollout says so once it owns request partitions."""
    platform, stable = two_versions
    before = _deployment(stable, 0.0, phase="rolled_back")
    await producer.publish(names.control, before)
    with contextmanager(_listen)(kafka, names.control) as log:

        def ready(worker: str) -> list[tuple[str, str]]:
            return _readiness(log, worker)

        with _version_worker(platform, CANDIDATE, "wc") as wc:
            assert wc.wait_assigned(30)
            log.wait(lambda: ready("wc") == [(CANDIDATE, before.id)], timeout=30)
            warming = msgspec.structs.replace(_deployment(stable, 0.0), phase="warming")
            await producer.publish(names.control, warming)
            log.wait(lambda: ready("wc") == [(CANDIDATE, before.id), (CANDIDATE, warming.id)], timeout=30)
            with _version_worker(platform, CANDIDATE, "wc2") as wc2:  # started while the rollout warms
                assert wc2.wait_assigned(30)
                log.wait(lambda: ready("wc2") == [(CANDIDATE, warming.id)], timeout=30)
            with log.lock:
                keys = {kafka_key(e) for e in log.events if isinstance(e, WorkerReady)}
            assert keys == {f"ready:demo-gpt:{CANDIDATE}".encode()}  # compacted: one per version
            # A later deployment that does not warm this version asks nothing of it.
            await producer.publish(names.control, _deployment(stable, 0.1))
            await asyncio.sleep(1.0)
            assert len(ready("wc")) == 2


async def test_a_worker_that_cannot_load_its_version_says_why_before_it_fails(
    kafka: KafkaConnection,
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    tmp_path: Path,
) -> None:
    """An operator audit: a candidate whose weights were cut short crash-looped its workers until the
    rollout's ready timeout, and nothing said why. Its worker says so on the control topic
    (``WorkerReady.error``, for the deployment it read) and fails."""
    platform, stable = two_versions
    warming = msgspec.structs.replace(_deployment(stable, 0.0), phase="warming")
    await producer.publish(names.control, warming)
    (weights,) = (tmp_path / "cache").glob(f"models/demo-gpt/{CANDIDATE}/*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    with contextmanager(_listen)(kafka, names.control) as log:
        worker = _version_worker(platform, CANDIDATE, "wc")
        with pytest.raises((GpuWorkerError, ManifestError)) as failed:
            worker.start()
        worker.stop()
        log.wait(lambda: bool(_unloadable(log)), timeout=30)
        (said,) = _unloadable(log)
        assert (said.version, said.worker, said.deployment) == (CANDIDATE, "wc", warming.id)
        assert said.error
        assert said.error in str(failed.value)


def _unloadable(log: Log) -> list[WorkerReady]:
    with log.lock:
        return [e for e in log.events if isinstance(e, WorkerReady) and e.error]


async def test_a_rollout_started_while_a_worker_reads_the_control_topic_is_not_missed(
    kafka: KafkaConnection,
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The worker reads the control topic to its end, then follows it from that very end: a rollout
    published in between (as the candidate's worker starts with the rollout) still reaches it. With two
    snapshots of the ends it was skipped, and the worker never said it was ready for the rollout."""
    import bus.control

    platform, stable = two_versions
    warming = msgspec.structs.replace(_deployment(stable, 0.0), phase="warming")

    def read_then_a_rollout_starts(*args: Any, **kwargs: Any) -> list[Event]:
        events = read_control(*args, **kwargs)
        with EventProducer(kafka, "test-cli") as cli:  # durable when it stops
            cli.produce(names.control, warming)
        return events

    monkeypatch.setattr(bus.control, "read_control", read_then_a_rollout_starts)
    with (
        contextmanager(_listen)(kafka, names.control) as log,
        _version_worker(platform, CANDIDATE, "wl") as worker,
    ):
        assert worker.wait_assigned(30)
        log.wait(lambda: (CANDIDATE, warming.id) in _readiness(log, "wl"), timeout=30)


async def test_fault_injection_fails_the_chosen_share_of_requests_and_cuts_the_rest_short(
    names: TopicNames,
    two_versions: tuple[PlatformSettings, str],
    producer: EventProducer,
    results: Log,
) -> None:
    from gpu_workers.faults import fails

    platform, stable = two_versions
    settings = WorkerSettings(
        worker_id="wf", drift_sample=0, fault_fail_ratio=0.5, fault_versions=(stable,), fault_delay_ms=5,
        fault_max_tokens=2,
    )  # fmt: skip
    with make_worker(platform, settings, "demo-gpt") as worker:
        assert worker.wait_assigned(30)
        sampling = SamplingParams(max_tokens=4, ignore_eos=True)
        requests = [_generation(names, PROMPT, sampling=sampling) for _ in range(12)]
        for request in requests:
            await producer.publish(names.requests("demo-gpt"), request)
        for request in requests:
            finished = results.finished(request.request_id)
            if fails(request.request_id, 0.5):
                assert finished.status == "failed"
                assert finished.error is not None
                assert finished.error.code == "fault_injected"
            else:
                assert finished.status == "completed"
                assert (finished.usage.completion_tokens, finished.finish_reason) == (2, "length")  # cut at 2
        assert any(fails(r.request_id, 0.5) for r in requests)
        assert not all(fails(r.request_id, 0.5) for r in requests)


async def test_a_worker_joining_mid_load_takes_partitions_and_every_request_ends_once(
    names: TopicNames, platform: PlatformSettings, demo_gpt_dir: Path, producer: EventProducer, results: Log
) -> None:
    """Two workers of one version, the second joining while the first is busy: the group rebalances (a
    partition and its in-flight records move), and each request still ends exactly once."""
    # two sequences at a time, so the first worker is still busy when the second has loaded its model
    settings = {"worker_flush_tokens": 8, "drift_sample": 0, "worker_max_running": 2}
    requests = [
        msgspec.structs.replace(
            _generation(names, PROMPT, sampling=SamplingParams(max_tokens=120, ignore_eos=True)),
            tenant=f"tenant-{i % 8}",  # spread over both partitions
        )
        for i in range(64)
    ]
    first = make_worker(platform, WorkerSettings(worker_id="r1", **settings), "demo-gpt")  # type: ignore[arg-type]
    with first:
        assert first.wait_assigned(30)
        for request in requests:
            await producer.publish(names.requests("demo-gpt"), request)
        results.wait(lambda: sum(bool(results.of(r.request_id)) for r in requests) >= 6)
        second = make_worker(platform, WorkerSettings(worker_id="r2", **settings), "demo-gpt")  # type: ignore[arg-type]
        with second:
            assert second.group == first.group
            for request in requests:
                results.finished(request.request_id, timeout=120)
    # both stopped (their producers flushed): every terminal event they wrote is on the topic; read it all
    results.caught_up(platform.kafka, names.results)
    ran = {e.worker_id for e in results.events if isinstance(e, RequestFinished)}
    for request in requests:
        finals = [e for e in results.of(request.request_id) if isinstance(e, RequestFinished)]
        assert len(finals) == 1, f"{request.request_id} ended {len(finals)} times"
        assert finals[0].status == "completed"
    assert ran == {"r1", "r2"}, "the joining worker took no partition: the test proved nothing"


async def test_a_dead_cancel_listener_fails_the_worker_and_its_readiness(
    platform: PlatformSettings,
    names: TopicNames,
    demo_gpt_dir: Path,
    producer: EventProducer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before, the worker watched only its model thread: with its cancel listener dead it went on
    serving and cancels were silently ignored. Now every thread's death is the worker's failure, which
    its supervisor (``run_worker``) is woken by."""

    def broken(self: WorkerService, batch: list[Message]) -> None:
        raise RuntimeError("cancel listener bug")

    monkeypatch.setattr(WorkerService, "_on_cancels", broken)
    worker = make_worker(platform, WorkerSettings(worker_id="w-dies"), "demo-gpt")
    woken = threading.Event()
    worker.watch(lambda _: woken.set())
    worker.start()
    try:
        assert worker.wait_assigned(30)
        assert worker.readiness(100).ready
        await producer.publish(
            names.cancels,
            CancelRequested(
                tenant="acme", model="demo-gpt", request_id=uuid7(), source="test", reason="client_cancel"
            ),
        )
        assert await asyncio.to_thread(woken.wait, 30)
        assert isinstance(worker.failure, RuntimeError)
        readiness = worker.readiness(100)
        assert not readiness.ready
        assert readiness.checks["kafka"] is False
    finally:
        worker.stop()  # the other threads still stop, the requests consumer commits and leaves


def test_a_worker_whose_topic_cannot_be_read_is_not_ready(
    platform: PlatformSettings, demo_gpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: errors saying a topic cannot be read (an ACL removed, a topic gone) were logged,
    fetch after fetch, and the worker stayed ready. Any of its consumers told so for long makes it not."""
    worker = make_worker(platform, WorkerSettings(worker_id="w-refused"), "demo-gpt")
    worker.start()
    try:
        assert worker.wait_assigned(30)
        assert worker.readiness(100).ready
        cancels = worker._cancels
        assert cancels is not None
        monkeypatch.setattr(cancels, "unreadable_for", lambda: (worker.BROKERS_DOWN_S + 1, "refused"))
        readiness = worker.readiness(100)
        assert not readiness.ready
        assert readiness.checks["kafka"] is False
    finally:
        worker.stop()


async def test_a_worker_out_of_its_group_for_long_is_not_ready(
    platform: PlatformSettings, demo_gpt_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose request consumer fell out of its group (a broker stalled past its session) takes no
    requests: ``/readyz`` says so once the group has been unsettled longer than a rebalance takes."""
    worker = make_worker(platform, WorkerSettings(worker_id="w-out"), "demo-gpt")
    worker.start()
    try:
        assert worker.wait_assigned(30)
        readiness = worker.readiness(100)
        assert readiness.ready
        assert readiness.checks["group"] is True
        requests = worker._requests
        monkeypatch.setattr(requests, "unsettled_for", lambda: WorkerService.GROUP_GRACE_S - 1)
        assert worker.readiness(100).ready  # a rebalance in progress
        monkeypatch.setattr(requests, "unsettled_for", lambda: WorkerService.GROUP_GRACE_S)
        readiness = worker.readiness(100)
        assert not readiness.ready
        assert readiness.checks["group"] is False
    finally:
        worker.stop()


async def test_a_light_tenant_is_served_while_a_flooding_tenant_waits(
    names: TopicNames, platform: PlatformSettings, demo_gpt_dir: Path, producer: EventProducer, results: Log
) -> None:
    """Tenant ``flood`` queues long ignore_eos generations; tenant ``light``'s few short requests, sent
    after them, run at the next free slot and finish while most of the flood still waits."""
    settings = WorkerSettings(worker_id="wfair", worker_max_running=2, drift_sample=0)

    def requests(tenant: str, n: int, max_tokens: int) -> list[GenerationRequested]:
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [
            msgspec.structs.replace(_generation(names, PROMPT, sampling=sampling), tenant=tenant)
            for _ in range(n)
        ]

    with make_worker(platform, settings, "demo-gpt") as worker:
        assert worker.wait_assigned(30)
        # long enough that the light requests, published once the flood's first has ended, arrive while most
        # of the flood still waits, on a fast box too (with 64 tokens a fast box had started all but the last
        # few by then)
        flood = requests("flood", 12, 192)
        for request in flood:
            await producer.publish(names.requests("demo-gpt"), request)
        results.finished(flood[0].request_id, timeout=90)  # the flood is queued and being served
        light = requests("light", 3, 4)
        for request in light:
            await producer.publish(names.requests("demo-gpt"), request)
        done = {r.request_id: results.finished(r.request_id, timeout=90) for r in [*flood, *light]}

    def queue_wait(request: GenerationRequested) -> float:
        """From publish (the event's time) to joining the running batch."""
        timings = done[request.request_id].timings
        assert done[request.request_id].status == "completed"
        assert timings.started is not None
        return (timings.started - request.time).total_seconds()

    flood_started = sorted(t for r in flood if (t := done[r.request_id].timings.started) is not None)
    light_finished = [done[r.request_id].timings.finished for r in light]
    # In arrival order the light requests would start after every flood request; instead they are done
    # before the flood's last few even start, and wait a fraction of what the flood waits.
    assert all(t is not None and t < flood_started[-4] for t in light_finished)
    assert max(queue_wait(r) for r in light) < max(queue_wait(r) for r in flood) / 3


async def test_a_draining_worker_finishes_what_runs_takes_nothing_new_and_nothing_runs_twice(
    names: TopicNames,
    platform: PlatformSettings,
    demo_gpt_dir: Path,
    producer: EventProducer,
    results: Log,
    replies: Log,
) -> None:
    """Scale-in: the first worker drains (what it runs finishes there; what it fetched but never started is
    left uncommitted) and stops; the second takes the rest. Every request ends once, none on two workers."""
    settings = {"worker_flush_tokens": 8, "drift_sample": 0, "worker_max_running": 2}
    requests = [
        msgspec.structs.replace(
            _generation(names, PROMPT, sampling=SamplingParams(max_tokens=60, ignore_eos=True), stream=True),
            tenant=f"tenant-{i % 8}",  # spread over both partitions
        )
        for i in range(24)
    ]
    first = make_worker(platform, WorkerSettings(worker_id="d1", **settings), "demo-gpt")  # type: ignore[arg-type]
    second = make_worker(platform, WorkerSettings(worker_id="d2", **settings), "demo-gpt")  # type: ignore[arg-type]
    with second:
        with first:
            # a partition each before any request: no rebalance moves a running request
            results.wait(lambda: bool(first.assignment() and second.assignment()), 60)
            for request in requests:
                await producer.publish(names.requests("demo-gpt"), request)
            results.wait(lambda: sum(bool(results.of(r.request_id)) for r in requests) >= 4)
            began = time.monotonic()
            assert first.drain(30), "the worker did not drain"
            drained_in = time.monotonic() - began
        for request in requests:
            results.finished(request.request_id, timeout=120)
    results.caught_up(platform.kafka, names.results)
    replies.caught_up(platform.kafka, names.replies)
    ran: dict[str, set[str]] = {}
    for request in requests:
        finals = [e for e in results.of(request.request_id) if isinstance(e, RequestFinished)]
        assert len(finals) == 1, f"{request.request_id} ended {len(finals)} times"
        assert finals[0].status == "completed"
        sources = {e.source for e in replies.of(request.request_id) if isinstance(e, TokenChunk)}
        assert len(sources) == 1, f"{request.request_id} ran on {sources}: the drain cut it off"
        ran.setdefault(next(iter(sources)), set()).add(request.request_id)
    assert set(ran) == {"gpu_workers/d1", "gpu_workers/d2"}, "one worker ran everything: nothing was drained"
    assert drained_in < 30


_SLOW_LOADING_WORKER = """
import sys, time
import gpu_workers.models as models
from rich.console import Console
from schemas.settings import PlatformSettings, load_settings
from sluice.services import run_worker_process

def load_for_ever(*args, **kwargs):
    print("loading", flush=True)
    time.sleep(120)  # as a model load does, it cannot be interrupted
    raise AssertionError("the load was waited for")

models.load_generation_model = load_for_ever
sys.exit(run_worker_process(load_settings(PlatformSettings), "demo-gpt", Console(stderr=True)))
"""


@pytest.mark.integration
def test_a_worker_told_to_stop_while_it_loads_its_model_stops_at_once(
    platform: PlatformSettings, demo_gpt_dir: Path
) -> None:
    """Found by an audit: SIGTERM (Ctrl-C in ``sluice up``, a scale-in) while a worker loaded its model was
    only seen once the load had finished, 20 s and more here; ``sluice up`` waited, or killed it after its
    grace. The start is given up at once: nothing was taken from Kafka yet."""
    import os
    import signal
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env.update(
        SLUICE_KAFKA_BOOTSTRAP=platform.kafka.bootstrap,
        SLUICE_TOPIC_PREFIX=platform.topic_prefix,
        SLUICE_WORKER_OPS_PORT="0",
        SLUICE_CACHE_DIR=platform.cache_dir,
    )
    with subprocess.Popen(
        [sys.executable, "-c", _SLOW_LOADING_WORKER],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stderr is not None
            assert proc.stdout.readline().strip() == "loading"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0, proc.stderr.read()
            errors = proc.stderr.read()
            assert "Traceback" not in errors, errors
            assert "Fatal" not in errors, errors
            assert "stopped while loading its model" in errors  # its log line (JSON logs on stderr)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_a_worker_whose_topics_were_never_applied_says_what_to_run(
    platform: PlatformSettings, demo_gpt_dir: Path, kafka: KafkaConnection
) -> None:
    """Found by a review: a worker started before ``sluice topics apply`` failed with "give exactly one of
    subscribe= or assign=" (the results topic had no partitions to read)."""
    import msgspec

    from bus.errors import BusError

    bare = msgspec.structs.replace(platform, topic_prefix=f"{platform.topic_prefix}-bare")
    worker = make_worker(bare, WorkerSettings(worker_id="w-bare"), "demo-gpt")
    with pytest.raises(BusError, match=r"topic .*-bare\.results is missing: run `sluice topics apply`"):
        worker._learn_finished()
