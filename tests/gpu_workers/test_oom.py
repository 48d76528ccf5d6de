"""Out of memory in a forward pass ends the requests that did not fit (``worker_oom``, retriable), never the
worker: the runners keep serving, with a lower batch limit that grows back.

The real models run here; an engine that raises ``torch.cuda.OutOfMemoryError`` (what a GPU raises, and
leaves the process usable) above a size stands in for a card that is too small."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from gpu_workers.embedding import EmbeddingEngine, PendingVectors
from gpu_workers.engine import GenerationEngine
from gpu_workers.models import LoadedModel
from gpu_workers.observe import RunnerLoad, WorkerObserver
from gpu_workers.oom import OOM_CODE, MemoryBackoff, is_out_of_memory
from gpu_workers.runtime import ENGINE_ERROR_CODE
from schemas.events import EmbeddingRequested, RequestFinished, SamplingParams
from tests.gpu_workers.test_engine import generate_alone
from tests.gpu_workers.test_runners import embedding, embedding_runner, generation, generation_runner, run


def test_what_counts_as_out_of_memory() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried 8 GB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only torch's and the interpreter's


def test_the_limit_halves_at_each_failure_and_doubles_back_after_clean_batches() -> None:
    backoff = MemoryBackoff(ceiling=64, recover_after=3)
    assert backoff.failed(40) == 20  # half of what failed, not of the ceiling
    assert backoff.failed(64) == 10  # never above the current limit
    assert backoff.failed(1) == 1  # never below the floor
    for _ in range(2):
        backoff.succeeded()
    assert backoff.limit == 1
    backoff.succeeded()
    assert backoff.limit == 2
    for _ in range(3 * 6):
        backoff.succeeded()
    assert backoff.limit == 64


class SmallCardEmbedder(EmbeddingEngine):
    """MiniLM that runs out of memory above ``fits`` padded tokens per batch."""

    fits = 20
    calls: list[int]

    def launch(
        self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
    ) -> PendingVectors:
        padded = len(batch) * max(len(item) for item in batch)
        self.calls.append(padded)
        if padded > self.fits:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {padded} rows")
        return super().launch(batch, normalize)


def assert_embedded(
    done: Mapping[str, RequestFinished], requests: Sequence[EmbeddingRequested], expected: np.ndarray
) -> None:
    """Each request completed with the vector of its one input, as the model gives it alone."""
    for request, vector in zip(requests, expected, strict=True):
        result = done[request.request_id]
        assert (result.status, result.error) == ("completed", None)
        vectors = result.vectors()
        assert vectors is not None
        np.testing.assert_allclose(vectors[0], vector, atol=1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_embedding_batch_that_does_not_fit_runs_in_halves_and_only_an_input_too_big_alone_fails(
    minilm: LoadedModel, overlap: bool
) -> None:
    engine = SmallCardEmbedder(minilm.model, max_length=minilm.manifest.max_context)
    engine.calls = []
    runner = embedding_runner(minilm, engine, overlap=overlap)
    short = [[101, 7592 + i, 2088, 102] for i in range(6)]  # 4 tokens each
    huge = [101, *range(2000, 2060), 102]  # 62 tokens: more than fits, even alone
    requests = [embedding(inputs=[ids]) for ids in short]
    doomed = embedding(inputs=[short[0], huge])
    done = run(runner, [*requests, doomed]).finished  # the runner never raised

    assert_embedded(done, requests, EmbeddingEngine(minilm.model).embed(short))
    failed = done[doomed.request_id]
    assert (failed.status, failed.finish_reason) == ("failed", "error")
    assert failed.error is not None
    assert (failed.error.code, failed.error.retriable) == (OOM_CODE, True)
    assert "input 1 (62 tokens)" in failed.error.message
    assert failed.vectors() is None
    assert engine.calls[:3] == [28, 12, 16], "7 short inputs did not fit together; their halves did"
    assert runner._batcher.token_budget <= engine.fits, "the batches that follow are smaller"
    load = runner.load()
    assert load.out_of_memory == 2  # the short inputs together, and the huge input alone
    assert load.limit_ratio == runner._batcher.token_budget / 4096

    later = [embedding(inputs=[ids]) for ids in short]
    calls_before = len(engine.calls)
    done = run(runner, later).finished
    assert all(done[r.request_id].status == "completed" for r in later)
    assert all(padded <= engine.fits for padded in engine.calls[calls_before:]), "no failed forward now"


def test_a_capture_that_fails_after_a_batch_ran_out_of_memory_runs_eagerly_and_fails_no_request(
    minilm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seen on an H200: the runner split a batch that ran out of memory and ran its halves while it still
    handled that error, so a graph capture that then failed for another reason carried it as its context,
    was taken for out of memory, and split again, down to single short inputs that failed ``worker_oom``
    (13 warnings, every request of the test failed). A capture's failure is now judged on its own: the
    engine runs eagerly and the halves complete."""
    from tests.gpu_workers.test_embedding import CaptureLog, as_on_a_gpu

    engine = SmallCardEmbedder(minilm.model, max_length=minilm.manifest.max_context)
    engine.calls = []
    broken = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    as_on_a_gpu(engine, CaptureLog(engine, broken), monkeypatch)
    runner = embedding_runner(minilm, engine, overlap=False)
    short = [[101, 7592 + i, 2088, 102] for i in range(7)]  # 28 padded tokens together: more than fits
    requests = [embedding(inputs=[ids]) for ids in short]
    done = run(runner, requests).finished
    assert_embedded(done, requests, EmbeddingEngine(minilm.model, cuda_graphs=False).embed(short))
    assert engine.calls[:3] == [28, 12, 16], "one split: the halves fit"
    assert engine.graphs == 0, "the capture failed: eager from then on"
    assert runner.load().out_of_memory == 1


class SmallCardGenerator(GenerationEngine):
    """demo-gpt that runs out of memory in a decode step of ``fits`` + 1 rows or more, once, after it has
    already changed the batch (as a forward that fails part-way does)."""

    fits = 2
    failures = 1

    def _decode(self, outputs: list) -> None:  # type: ignore[type-arg]
        if self.failures and self._batch.live > self.fits:
            self.failures -= 1
            super()._decode([])  # the cache and the rows moved on; the step's tokens are lost
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        super()._decode(outputs)


@pytest.mark.parametrize("static_cache", [False, True], ids=["growing", "ring"])
def test_a_generation_step_that_does_not_fit_ends_its_sequences_and_the_engine_starts_clean(
    demo_gpt: LoadedModel, static_cache: bool
) -> None:
    engine = SmallCardGenerator(
        demo_gpt.model,
        max_batch_size=4,
        max_context=demo_gpt.manifest.max_context,
        static_cache=static_cache,
    )
    runner = generation_runner(demo_gpt, engine, max_running=4, max_waiting=16)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = [generation(greedy, stream=True) for _ in range(4)]
    done = run(runner, first).finished  # the runner never raised
    for request in first:
        result = done[request.request_id]
        assert (result.status, result.finish_reason) == ("failed", "error")
        assert result.error is not None
        assert (result.error.code, result.error.retriable) == (OOM_CODE, True)
    assert engine.max_batch_size == 2, "half of the rows that did not fit"
    assert (runner.load().out_of_memory, runner.load().limit_ratio) == (1, 0.5)
    assert engine.running == 0

    prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 9, 14, 20, 21]]
    later = [generation(greedy, input_ids=ids) for ids in prompts]
    done = run(runner, later).finished
    for request, ids in zip(later, prompts, strict=True):
        result = done[request.request_id]
        assert (result.status, result.error) == ("completed", None)
        assert result.text == demo_gpt.tokenizer.decode(
            generate_alone(demo_gpt, ids, 8), skip_special_tokens=True
        )


def test_other_failures_are_not_out_of_memory(minilm: LoadedModel) -> None:
    """Only memory is retried and backs the batch limit off: any other exception ends its batch's requests
    ``engine_error``, not retriable (``tests/gpu_workers/test_bad_requests.py``), the limit where it was."""

    class Broken(EmbeddingEngine):
        def launch(
            self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
        ) -> PendingVectors:
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    runner = embedding_runner(minilm, Broken(minilm.model))
    request = embedding()
    error = run(runner, [request]).finished[request.request_id].error
    assert error is not None
    assert (error.code, error.retriable) == (ENGINE_ERROR_CODE, False)
    assert (runner.load().out_of_memory, runner.load().limit_ratio) == (0, 1.0)


def test_the_worker_counts_out_of_memory_and_shows_its_batch_limit() -> None:
    model = "oom-metrics-test"
    observer = WorkerObserver(model, "w")
    labels = {"model": model}
    observer.tick(RunnerLoad(running=0, waiting=0, budget_ratio=0.0, batch=0), 0.0)
    assert REGISTRY.get_sample_value("sluice_worker_batch_limit_ratio", labels) == 1.0
    for seen in (2, 2, 3):  # a runner's cumulative count, reported at every tick
        observer.tick(
            RunnerLoad(running=1, waiting=0, budget_ratio=0.0, batch=1, out_of_memory=seen, limit_ratio=0.25),
            0.01,
        )
    assert REGISTRY.get_sample_value("sluice_worker_out_of_memory_total", labels) == 3
    assert REGISTRY.get_sample_value("sluice_worker_batch_limit_ratio", labels) == 0.25
