"""No single request takes a worker down: a request the model cannot run, or a step or batch that fails
with something other than out of memory, ends the requests concerned ``failed`` with one terminal event
each, and the runner keeps serving (a worker whose model thread raised stopped, every request in flight on
it was lost, and the record, never committed, stopped the next worker to read it the same way).

The real models run here; an engine that raises once stands in for a bug or an input no check caught."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt
import pytest
import torch

from gpu_workers.embedding import EmbeddingEngine, PendingVectors
from gpu_workers.engine import GenerationEngine, SeqRequest, StepOutput
from gpu_workers.models import LoadedModel
from gpu_workers.oom import OOM_CODE
from gpu_workers.runtime import ENGINE_ERROR_CODE, Arrival, Runner
from schemas.events import RequestFinished, SamplingParams
from tests.gpu_workers.test_engine import generate_alone
from tests.gpu_workers.test_runners import (
    Collected,
    embedding,
    embedding_runner,
    generation,
    generation_runner,
    run,
)

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [5, 9, 14, 20, 21], [30, 31, 32, 33]]


def assert_engine_error(result: RequestFinished) -> None:
    assert (result.status, result.finish_reason) == ("failed", "error")
    assert result.error is not None
    assert (result.error.code, result.error.retriable) == (ENGINE_ERROR_CODE, False)
    assert "RuntimeError" in result.error.message


def tick_on(runner: Runner, out: Collected, ticks: int = 100) -> None:
    for _ in range(ticks):
        runner.tick(out)


# ---------------------------------------------------------------------------------------------- generation


def test_a_tiny_temperature_samples_greedily_and_its_batch_mate_completes(demo_gpt: LoadedModel) -> None:
    engine = GenerationEngine(demo_gpt.model, max_batch_size=8, max_context=demo_gpt.manifest.max_context)
    runner = generation_runner(demo_gpt, engine, max_running=8, max_waiting=64)
    mate = generation(SamplingParams(max_tokens=8, seed=1))
    tiny = generation(msgspec.structs.replace(GREEDY, temperature=1e-40))
    done = run(runner, [mate, tiny]).finished  # the runner never raised
    assert done[mate.request_id].status == "completed"
    result = done[tiny.request_id]
    assert (result.status, result.error) == ("completed", None)
    assert result.text == demo_gpt.tokenizer.decode(
        generate_alone(demo_gpt, list(tiny.input_ids), 8), skip_special_tokens=True
    )


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1])
def test_a_seed_torch_cannot_take_fails_that_request_alone(demo_gpt: LoadedModel, seed: int) -> None:
    """The schema dead-letters such a record; an event built in this process (or an older decoder) still
    reaches the engine, which refuses it before the step."""
    engine = GenerationEngine(demo_gpt.model, max_batch_size=8, max_context=demo_gpt.manifest.max_context)
    runner = generation_runner(demo_gpt, engine, max_running=8, max_waiting=64)
    mate = generation(GREEDY)
    bad = generation(SamplingParams(max_tokens=4, temperature=1.0, seed=seed))
    done = run(runner, [mate, bad]).finished
    assert done[mate.request_id].status == "completed"
    result = done[bad.request_id]
    assert (result.status, result.error is not None and result.error.code) == ("failed", "invalid_request")
    assert result.error is not None
    assert "seed" in result.error.message


class BrokenOnce(GenerationEngine):
    """demo-gpt whose decode fails once with a plain RuntimeError (a bug, not memory) when ``rows`` rows
    run, after it has already changed the batch (as a forward that fails part-way does)."""

    rows = 2
    failures = 1

    def _decode(self, outputs: list) -> None:  # type: ignore[type-arg]
        if self.failures and self._batch.live >= self.rows:
            self.failures -= 1
            super()._decode([])  # the cache and the rows moved on; the step's tokens are lost
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        super()._decode(outputs)


@pytest.mark.parametrize("static_cache", [False, True], ids=["growing", "ring"])
def test_a_step_that_fails_ends_its_sequences_and_the_runner_keeps_serving(
    demo_gpt: LoadedModel, static_cache: bool, caplog: pytest.LogCaptureFixture
) -> None:
    engine = BrokenOnce(
        demo_gpt.model,
        max_batch_size=2,
        max_context=demo_gpt.manifest.max_context,
        static_cache=static_cache,
    )
    runner = generation_runner(demo_gpt, engine, max_running=4, max_waiting=16)
    requests = [generation(GREEDY, input_ids=ids, stream=True) for ids in PROMPTS]
    with caplog.at_level(logging.ERROR, logger="gpu_workers.generation"):
        done = run(runner, requests).finished  # the runner never raised
    # the first two were in the failed step; the other two waited in the engine and ran after it
    for request in requests[:2]:
        assert_engine_error(done[request.request_id])
    for request in requests[2:]:
        result = done[request.request_id]
        assert (result.status, result.error) == ("completed", None)
        assert result.text == demo_gpt.tokenizer.decode(
            generate_alone(demo_gpt, list(request.input_ids), 8), skip_special_tokens=True
        )
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1, "logged once"
    assert failures[0].exc_info is not None, "with the traceback"
    assert engine.max_batch_size == 2, "not out of memory: the batch limit stays"
    assert runner.load().out_of_memory == 0
    assert engine.running == 0
    assert not engine.has_work()

    later = generation(GREEDY, input_ids=PROMPTS[0])
    result = run(runner, [later]).finished[later.request_id]
    assert (result.status, result.error) == ("completed", None)


class PoisonedPrefill(GenerationEngine):
    """demo-gpt whose prefill of the request ``poison`` raises ``error`` (after its forward)."""

    poison = ""
    error: Exception = RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    def _generator(self, req: SeqRequest) -> torch.Generator | None:
        if req.request_id == self.poison:
            raise self.error
        return super()._generator(req)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (RuntimeError("probability tensor contains either `inf`, `nan` or element < 0"), ENGINE_ERROR_CODE),
        (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"), OOM_CODE),
    ],
    ids=["engine-error", "out-of-memory"],
)
def test_a_sequence_that_finished_inside_a_failed_step_still_ends(
    demo_gpt: LoadedModel, error: Exception, code: str
) -> None:
    """Its last token went with the step; it was no longer in the engine, so nothing ended it: no terminal
    event, and its request held a running slot for ever."""
    engine = PoisonedPrefill(demo_gpt.model, max_batch_size=4, max_context=demo_gpt.manifest.max_context)
    runner = generation_runner(demo_gpt, engine, max_running=4, max_waiting=16)
    short = generation(msgspec.structs.replace(GREEDY, max_tokens=2))
    joiner = generation(GREEDY, input_ids=PROMPTS[1])
    engine.poison, engine.error = joiner.request_id, error
    out = Collected()
    runner.accept(Arrival(short, ("requests", 0), 0), out)
    runner.tick(out)  # its first token
    runner.accept(Arrival(joiner, ("requests", 0), 1), out)
    runner.tick(out)  # its last token, then the joiner's prefill fails
    for request in (short, joiner):
        result = out.finished[request.request_id]
        assert result.status == "failed"
        assert result.error is not None
        assert result.error.code == code
    assert runner.load().running == 0


def test_steps_that_keep_failing_stop_the_runner_after_ending_their_requests(demo_gpt: LoadedModel) -> None:
    """A device or model that no longer works (a CUDA error sticks to its context) stops the worker, for
    its supervisor to start a fresh one, rather than failing every request it is given."""

    class Broken(GenerationEngine):
        def step(self) -> list[StepOutput]:
            super().step()  # each step admits one request (one row), then fails
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    engine = Broken(demo_gpt.model, max_batch_size=1, max_context=demo_gpt.manifest.max_context)
    runner = generation_runner(demo_gpt, engine, max_running=4, max_waiting=16)
    requests = [generation(GREEDY, input_ids=ids) for ids in PROMPTS[:3]]
    out = Collected()
    for offset, request in enumerate(requests):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    with pytest.raises(RuntimeError, match="probability tensor"):
        tick_on(runner, out)
    assert sorted(out.finished) == sorted(r.request_id for r in requests), "each ended before it stopped"
    for result in out.finished.values():
        assert_engine_error(result)


# ----------------------------------------------------------------------------------------------- embedding


@pytest.mark.parametrize(
    "inputs",
    [[[101, 102], []], [[101, 1_000_000]], [[-1]]],
    ids=["empty", "past-the-vocabulary", "negative"],
)
def test_an_input_the_encoder_cannot_take_fails_that_request_alone(
    minilm: LoadedModel, inputs: list[list[int]]
) -> None:
    runner = embedding_runner(minilm, EmbeddingEngine(minilm.model, max_length=minilm.manifest.max_context))
    good, bad = embedding(), embedding(inputs=inputs)
    done = run(runner, [good, bad]).finished  # the runner never raised
    assert done[good.request_id].status == "completed"
    result = done[bad.request_id]
    assert (result.status, result.finish_reason) == ("failed", "error")
    assert result.error is not None
    assert (result.error.code, result.error.retriable) == ("invalid_input", False)


class _Raises:
    def result(self) -> npt.NDArray[np.float32]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class BrokenEmbedder(EmbeddingEngine):
    """MiniLM whose next ``failures`` batches fail with a plain RuntimeError, at launch or at result."""

    failures = 1
    where: Literal["launch", "result"] = "launch"

    def launch(
        self, batch: Sequence[Sequence[int]], normalize: Sequence[bool] | None = None
    ) -> PendingVectors:
        if self.failures:
            self.failures -= 1
            if self.where == "launch":
                raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")
            return _Raises()
        return super().launch(batch, normalize)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("where", ["launch", "result"])
def test_a_batch_that_fails_ends_its_requests_and_the_runner_keeps_serving(
    minilm: LoadedModel, overlap: bool, where: Literal["launch", "result"]
) -> None:
    engine = BrokenEmbedder(minilm.model, max_length=minilm.manifest.max_context)
    engine.where = where
    runner = embedding_runner(minilm, engine, overlap=overlap)
    first = [embedding(), embedding()]
    done = run(runner, first).finished  # the runner never raised
    for request in first:
        assert_engine_error(done[request.request_id])
        assert done[request.request_id].vectors() is None
    later = embedding()
    result = run(runner, [later]).finished[later.request_id]
    assert (result.status, result.error) == ("completed", None)
    vectors = result.vectors()
    assert vectors is not None
    np.testing.assert_allclose(
        vectors, EmbeddingEngine(minilm.model).embed([list(ids) for ids in later.inputs]), atol=1e-5
    )


def test_batches_that_keep_failing_stop_the_runner_after_ending_their_requests(minilm: LoadedModel) -> None:
    engine = BrokenEmbedder(minilm.model, max_length=minilm.manifest.max_context)
    engine.failures = 99
    runner = embedding_runner(minilm, engine)
    for _ in range(2):
        request = embedding()
        assert_engine_error(run(runner, [request]).finished[request.request_id])
    last = embedding()
    out = Collected()
    runner.accept(Arrival(last, ("requests", 0), 0), out)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        tick_on(runner, out)
    assert_engine_error(out.finished[last.request_id])
