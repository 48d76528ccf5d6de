"""The embedding runner's overlap: on a GPU each batch is launched before the one ahead of it is finished,
so that batch's terminal events are built (and published) while the device computes the next. Forced on
here: on a CPU the engine has finished when ``launch`` returns, so only the order changes; with
``SLUICEGATE_TEST_DEVICE=cuda`` the same tests run the real asynchronous pass and copy."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import numpy as np
import numpy.typing as npt
import pytest

from gpu_workers.batching import BatcherConfig
from gpu_workers.embedding import EmbeddingEngine, PendingVectors
from gpu_workers.embedding_runner import EmbeddingRunner
from gpu_workers.models import LoadedModel
from gpu_workers.runtime import Arrival
from schemas.events import utc_now
from tests.gpu_workers.test_runners import Collected, embedding, embedding_runner, run


class Recording(EmbeddingEngine):
    """MiniLM that logs when each batch is launched and when its vectors are read."""

    log: list[str]

    def launch(
        self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
    ) -> PendingVectors:
        n = sum(entry.startswith("launch") for entry in self.log) + 1
        self.log.append(f"launch {n}")
        pending = super().launch(batch, normalize)
        log = self.log

        class Read:
            def result(self) -> npt.NDArray[np.float32]:
                log.append(f"result {n}")
                return pending.result()

        return Read()


@pytest.fixture
def engine(minilm: LoadedModel) -> Recording:
    engine = Recording(minilm.model, max_length=minilm.manifest.max_context)
    engine.log = []
    return engine


TEXTS = [[101, 7592 + i, 2088, 102] for i in range(7)]


def test_the_engine_overlaps_only_on_a_gpu(minilm: LoadedModel) -> None:
    engine = EmbeddingEngine(minilm.model)
    assert engine.overlaps == (engine.device.type == "cuda")
    assert embedding_runner(minilm, engine).overlap == engine.overlaps
    assert embedding_runner(minilm, engine, overlap=True).overlap


@pytest.mark.parametrize("overlap", [False, True])
def test_each_batch_is_finished_after_the_next_is_launched_with_the_same_vectors(
    minilm: LoadedModel, engine: Recording, overlap: bool
) -> None:
    runner = embedding_runner(minilm, engine, max_batch_size=2, overlap=overlap)
    one = [embedding(inputs=[ids]) for ids in TEXTS[:4]]
    spread = embedding(inputs=TEXTS[4:])  # three inputs: its batches are the third and the fourth
    out = Collected()
    for offset, request in enumerate([*one, spread]):
        runner.accept(Arrival(request, ("requests", 0), offset), out)

    runner.tick(out)
    if overlap:
        assert not out.finished, "the first batch is still in flight"
        assert runner.wait_hint() == 0.0, "the loop comes back for it at once"
        assert runner.load().running == 2
    else:
        assert set(out.finished) == {one[0].request_id, one[1].request_id}
    for _ in range(10):
        runner.tick(out)
    done = out.finished
    assert len(done) == 5
    assert runner.wait_hint() is None, "nothing in flight or queued"

    if overlap:
        assert engine.log == [
            "launch 1",
            "launch 2",
            "result 1",
            "launch 3",
            "result 2",
            "launch 4",
            "result 3",
            "result 4",  # the last batch, with nothing behind it, is finished at the next tick
        ]
    else:
        assert engine.log == [
            "launch 1",
            "result 1",
            "launch 2",
            "result 2",
            "launch 3",
            "result 3",
            "launch 4",
            "result 4",
        ]
    alone = EmbeddingEngine(minilm.model).embed(TEXTS)
    for request, expected in zip(one, alone, strict=False):
        vectors = done[request.request_id].vectors()
        assert vectors is not None
        np.testing.assert_allclose(vectors[0], expected, atol=1e-5)
    vectors = done[spread.request_id].vectors()
    assert vectors is not None
    np.testing.assert_allclose(np.array(vectors), alone[4:], atol=1e-5)
    assert done[spread.request_id].usage.prompt_tokens == 12


def test_a_request_cancelled_or_released_in_flight_ends_once_or_not_at_all(
    minilm: LoadedModel, engine: Recording
) -> None:
    runner = embedding_runner(minilm, engine, overlap=True)
    cancelled, released, kept = (embedding(inputs=[ids]) for ids in TEXTS[:3])
    out = Collected()
    for offset, request in enumerate([cancelled, released, kept]):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    runner.tick(out)
    assert engine.log == ["launch 1"]
    assert runner.wait_hint() == 0.0, "nothing queued, but a batch to finish"

    runner.cancel(cancelled.request_id, out)
    assert out.finished[cancelled.request_id].status == "cancelled"
    assert runner.release([released.request_id, kept.request_id, "unknown"]) == {
        released.request_id,
        kept.request_id,
    }, "nothing was published for them yet: another worker runs them"
    runner.tick(out)
    assert engine.log == ["launch 1", "result 1"]
    assert set(out.finished) == {cancelled.request_id}, "their vectors landed and were dropped"
    assert runner.wait_hint() is None
    assert runner.load().running == 0


def test_a_deadline_that_passes_while_part_of_a_request_is_in_flight_ends_it_expired_once(
    minilm: LoadedModel, engine: Recording
) -> None:
    now = [100.0]
    runner = EmbeddingRunner(
        engine,
        minilm.manifest,
        source="test",
        worker_id="w",
        batching=BatcherConfig(max_batch_size=2, max_wait_s=0.0, max_batch_tokens=4096),
        overlap=True,
        clock=lambda: now[0],
    )
    late = embedding(inputs=TEXTS[:3], deadline=utc_now() + timedelta(seconds=5))  # batches of 2, then 1
    out = Collected()
    runner.accept(Arrival(late, ("requests", 0), 0), out)
    runner.tick(out)
    assert engine.log == ["launch 1"]
    now[0] += 10  # past the deadline: its third input, still queued, expires
    runner.tick(out)
    assert out.finished[late.request_id].status == "expired"
    assert engine.log == ["launch 1", "result 1"], "the in-flight batch was finished, its vectors dropped"
    runner.tick(out)
    assert runner.wait_hint() is None
    assert len(out.finished) == 1


def test_a_cancelled_or_released_request_leaves_the_queue(minilm: LoadedModel, engine: Recording) -> None:
    """Its inputs used to stay queued until their batch formed, holding places a client's request then
    found full (a review: 400 inputs of a cancelled request refused the next one ``queue_full``)."""
    runner = embedding_runner(minilm, engine)
    out = Collected()
    cancelled, released = embedding(inputs=TEXTS[:3]), embedding(inputs=TEXTS[3:5])
    for offset, request in enumerate([cancelled, released]):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    assert len(runner._batcher) == 5
    runner.cancel(cancelled.request_id, out)
    assert len(runner._batcher) == 2
    assert runner.release([released.request_id]) == {released.request_id}
    assert len(runner._batcher) == 0
    assert runner.wait_hint() is None


def test_a_request_is_queued_whole_or_refused_and_one_larger_than_the_queue_is_invalid(
    minilm: LoadedModel, engine: Recording
) -> None:
    """The queue held 1,024 inputs and took a request's inputs one by one: a request of 2,048 (what an edge
    takes) was refused ``queue_full``, a retriable 503, on every try. Then a request had to find room for
    all its inputs, so under a steady load of small requests a large one was refused where they got in (an
    audit). Now a request is queued whole while the queue is under its limit, whatever its size, refused
    (retriable) while it is full, and one that could never fit fails ``invalid_input``."""
    runner = EmbeddingRunner(
        engine,
        minilm.manifest,
        source="test",
        worker_id="w",
        batching=BatcherConfig(max_batch_size=8, max_wait_s=0.0, max_batch_tokens=4096, max_queued=6),
    )
    out = Collected()
    first, large, small, whole, huge = (embedding(inputs=TEXTS[:n]) for n in (4, 6, 1, 6, 7))
    for offset, request in enumerate([first, large]):  # 4 wait: the large one gets in whole
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    assert len(runner._batcher) == 10, "a request under the limit is queued whole, whatever its size"
    runner.accept(Arrival(small, ("requests", 0), 2), out)  # 10 wait, the limit is 6: full
    assert len(runner._batcher) == 10
    refused = out.finished[small.request_id]
    assert (refused.status, refused.error and refused.error.code) == ("failed", "queue_full")
    assert refused.error is not None
    assert refused.error.retriable
    assert "10 inputs waiting, SLUICE_WORKER_EMBED_MAX_QUEUED=6" in refused.error.message
    runner.accept(Arrival(huge, ("requests", 0), 3), out)
    invalid = out.finished[huge.request_id]
    assert invalid.error is not None
    assert invalid.error.code == "invalid_input"
    assert not invalid.error.retriable
    assert "7 inputs, more than this worker queues (6" in invalid.error.message
    while large.request_id not in out.finished:
        runner.tick(out)
    for request in (first, large):
        assert out.finished[request.request_id].status == "completed"
    runner.accept(Arrival(whole, ("requests", 0), 4), out)  # the queue is empty again: six fit
    while whole.request_id not in out.finished:
        runner.tick(out)
    done = out.finished[whole.request_id]
    assert done.status == "completed"
    vectors = done.vectors()
    assert vectors is not None
    assert len(vectors) == 6


def test_a_vector_with_nan_ends_its_request_failed_not_the_others(minilm: LoadedModel) -> None:
    """NaN travels in JSON as null: a client would read nulls for numbers and the results copy would be an
    event no consumer can decode (a review: dead-lettered by the streams sink). The request ends failed."""

    class Broken(EmbeddingEngine):
        def launch(
            self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
        ) -> PendingVectors:
            pending = super().launch(batch, normalize)

            class Read:
                def result(self) -> npt.NDArray[np.float32]:
                    vectors = pending.result().copy()
                    vectors[0, 3] = np.nan
                    return vectors

            return Read()

    runner = embedding_runner(minilm, Broken(minilm.model, max_length=minilm.manifest.max_context))
    out = Collected()
    bad, good = embedding(inputs=[TEXTS[0]]), embedding(inputs=[TEXTS[1]])
    for offset, request in enumerate([bad, good]):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    while runner.wait_hint() is not None:
        runner.tick(out)
    failed = out.finished[bad.request_id]
    assert failed.status == "failed"
    assert failed.error is not None
    assert failed.error.code == "engine_error"
    assert "NaN or inf" in failed.error.message
    assert out.finished[good.request_id].status == "completed"
    assert len(runner._batcher) == 0


def test_a_request_ended_by_one_input_leaves_its_other_inputs_nowhere_queued(minilm: LoadedModel) -> None:
    """A NaN (or a failed batch, or an input too large alone) ends the request at its first input: the
    others left the batcher too (they held places in it until batched)."""

    class NaNFirst(EmbeddingEngine):
        def launch(
            self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
        ) -> PendingVectors:
            pending = super().launch(batch, normalize)

            class Bad:
                def result(self) -> npt.NDArray[np.float32]:
                    out = np.array(pending.result(), copy=True)
                    out[0, 0] = np.nan
                    return out

            return Bad()

    engine = NaNFirst(minilm.model, max_length=minilm.manifest.max_context)
    runner = embedding_runner(minilm, engine, max_batch_size=1, overlap=False)
    request = embedding(inputs=[[101, 7592, 102], [101, 2088, 2088, 102], [101, 2000, 2000, 2000, 102]])
    out = Collected()
    runner.accept(Arrival(request, ("requests", 0), 0), out)
    runner.tick(out)
    assert out.finished[request.request_id].status == "failed"
    assert len(runner._batcher) == 0


def test_a_request_that_asks_for_pooled_vectors_gets_them_beside_one_that_asks_for_unit_ones(
    minilm: LoadedModel, engine: Recording
) -> None:
    """``EmbeddingRequested.normalize`` (the event contract; a batch line carries it too) was ignored
    before 2026-12-03 (a review): ``normalize=False`` completed with unit vectors. Both requests here run
    in one batch, each as it asked."""
    runner = embedding_runner(minilm, engine)
    pooled, unit = embedding(normalize=False), embedding()
    done = run(runner, [pooled, unit]).finished
    assert engine.log == ["launch 1", "result 1"], "one batch"
    assert {r.status for r in done.values()} == {"completed"}
    as_asked = np.array(done[pooled.request_id].vectors())
    vectors = np.array(done[unit.request_id].vectors())
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    norms = np.linalg.norm(as_asked, axis=1)
    assert (abs(norms - 1.0) > 0.1).all(), norms
    np.testing.assert_allclose(as_asked / norms[:, None], vectors, atol=1e-5)
