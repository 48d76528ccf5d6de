"""How a worker publishes a terminal event: the reply copy before the bookkeeping, the results copy with
the drift features, and features that fail or do not fit never keep the request from ending."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from bus.errors import BusError
from gpu_workers.features import DriftEmbedder, FeatureProbe
from gpu_workers.observe import WorkerObserver
from gpu_workers.runtime import Arrival
from gpu_workers.service import WorkerService
from schemas.codec import decode
from schemas.events import DriftFeatures, GenerationRequested, ReplyTo, RequestFinished, Usage
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames

NAMES = TopicNames("p")


class Steps:
    """What the worker did, in order: produces (topic, value) and bookkeeping (a name)."""

    def __init__(self) -> None:
        self.done: list[tuple[str, Any]] = []
        self.callbacks: list[Any] = []

    def produce_raw(self, topic: str, value: bytes, *, on_delivery: Any = None, **_: Any) -> None:
        self.done.append((topic, value))
        self.callbacks.append(on_delivery)

    def names(self) -> list[str]:
        return [step for step, _ in self.done]

    def event(self, topic: str) -> RequestFinished:
        (value,) = [value for step, value in self.done if step == topic]
        event = decode(value)
        assert isinstance(event, RequestFinished)
        return event


class Probe:
    def __init__(self, steps: Steps, features: DriftFeatures | Exception) -> None:
        self._steps = steps
        self._features = features

    def embed_then(self, event: object, then: Any) -> None:
        then(None)  # not sampled

    def features(self, event: object, result: RequestFinished, vector: object = None) -> DriftFeatures:
        self._steps.done.append(("features", None))
        if isinstance(self._features, Exception):
            raise self._features
        return self._features


def finish(features: DriftFeatures | Exception | FeatureProbe) -> tuple[WorkerService, Steps]:
    steps = Steps()
    service = WorkerService(
        model_id="m", worker_id="w", kafka=KafkaConnection("127.0.0.1:9"), names=NAMES,
        runner_factory=lambda: None,  # type: ignore[arg-type,return-value]
    )  # fmt: skip
    service._producer = steps  # type: ignore[assignment]
    service._probe = features if isinstance(features, FeatureProbe) else Probe(steps, features)  # type: ignore[assignment]
    measure = WorkerObserver.measure

    def measured(observer: WorkerObserver, *args: Any) -> None:
        steps.done.append(("measure", None))
        measure(observer, *args)

    service._observer.measure = measured.__get__(service._observer)  # type: ignore[method-assign]
    event = GenerationRequested(
        tenant="t", model="m", request_id=uuid7(), source="edge", model_version="v", prompt="hi",
        input_ids=[1], reply=ReplyTo(topic=NAMES.replies, partition=3, edge_id="e"),
    )  # fmt: skip
    result = RequestFinished(
        tenant="t", model="m", request_id=event.request_id, source="w", status="completed",
        finish_reason="stop", text="hello", usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )  # fmt: skip
    service._publish_finish(Arrival(event, ("p.requests.m", 0), 7), result)
    return service, steps


def test_the_reply_leaves_before_the_bookkeeping_and_the_result_carries_the_features() -> None:
    _, steps = finish(DriftFeatures(prompt_chars=2, output_chars=5))
    assert steps.names() == [NAMES.replies, "measure", "features", NAMES.results]
    reply, result = steps.event(NAMES.replies), steps.event(NAMES.results)
    assert reply.features is None
    assert result.features == DriftFeatures(prompt_chars=2, output_chars=5)
    assert reply == msgspec.structs.replace(result, features=None), "one event, the features aside"
    assert (reply.status, reply.text, reply.edge_id) == ("completed", "hello", "e")


@pytest.mark.parametrize(
    "features",
    [RuntimeError("probe broke"), DriftFeatures(embedding=[0.123456] * 1_000_000)],  # ~9 MB: over a record
    ids=["failing", "too-large"],
)
def test_features_that_fail_or_do_not_fit_leave_the_result_without_them(
    features: DriftFeatures | Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        service, steps = finish(features)
    assert steps.names() == [NAMES.replies, "measure", "features", NAMES.results]
    assert steps.event(NAMES.results) == steps.event(NAMES.replies)
    assert steps.event(NAMES.results).status == "completed"
    assert "drift features of" in caplog.text
    for callback in steps.callbacks:  # both copies durable: the request's offset may be committed
        callback(None, (0, 0))
    assert service._durable.qsize() == 1


def test_a_sampled_prompt_is_embedded_after_the_reply_left_and_the_result_waits_for_it() -> None:
    """The embedding runs on the embedder's thread: the model thread publishes the reply copy and returns;
    the results copy, with the vector, follows from that thread, and the offset waits for both."""
    release, calls = threading.Event(), list[list[str]]()

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        calls.append(list(texts))
        assert release.wait(10)
        return [[0.25, -0.5] for _ in texts]

    with DriftEmbedder(embed) as embedder:
        service, steps = finish(FeatureProbe(1, embedder))
        assert steps.names() == [NAMES.replies, "measure"], "the model thread does not wait for it"
        release.set()
        embedder.stop()
    assert calls == [["hi"]]
    assert steps.names() == [NAMES.replies, "measure", NAMES.results]
    features = steps.event(NAMES.results).features
    assert features is not None
    assert (features.embedding, features.prompt_chars, features.output_chars) == ([0.25, -0.5], 2, 5)
    assert steps.event(NAMES.replies).features is None
    steps.callbacks[0](None, (0, 0))
    assert service._durable.qsize() == 0, "the reply alone is not the request's effect"
    steps.callbacks[1](None, (0, 0))
    assert service._durable.qsize() == 1


def test_a_copy_that_is_not_durable_is_reported_once() -> None:
    service, steps = finish(DriftFeatures())
    for callback in steps.callbacks:
        callback(BusError("broker down"), None)
    assert service._durable.qsize() == 1
