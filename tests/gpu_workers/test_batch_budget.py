"""A model whose context is longer than the worker's batch-token budget (``SLUICE_WORKER_MAX_BATCH_TOKENS``):
the worker lowers a request's ``max_new_tokens`` to what the budget leaves after its prompt, as it does to
the context's room, so the answer ends with ``finish_reason: "length"`` there, and a prompt longer than the
budget ends ``context_length_exceeded`` (a 400 at the edge).

Found by a review (2026-12-03): the edge gives a request without ``max_tokens`` the room its prompt leaves
in the context, and the scheduler refused any request whose prompt + ``max_tokens`` exceeded the budget
(``too_large``, a 500): on a linked model of 32,768 positions every such request failed."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from gpu_workers.main import runner_factory
from gpu_workers.models import prepare_hf_dir
from gpu_workers.runtime import Runner
from gpu_workers.settings import WorkerSettings
from ingest.auth import Tenant
from ingest.errors import error_response
from ingest.models import ModelCatalogue
from ingest.prepare import Preparer
from ingest.settings import EdgeSettings
from schemas.events import GenerationRequested, ReplyTo, SamplingParams
from tests.gpu_workers.test_runners import generation, run
from tests.gpu_workers.test_served_context import refused_as_too_long
from tests.gpu_workers.tiny_hf import decoder_dir

BUDGET = 64  # of the model's 256 positions


@pytest.fixture(scope="module")
def linked(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A linked model's cache root and its prepared directory: a Qwen2 of 256 positions, no window."""
    source = decoder_dir(tmp_path_factory.mktemp("src") / "long-ctx", arch="qwen2")
    root = tmp_path_factory.mktemp("cache")
    return root, prepare_hf_dir("long-ctx", source, root / "models", "generation")


def worker_runner(model_dir: Path) -> Runner:
    """The runner a worker builds (``runner_factory``) with a batch budget smaller than the context."""
    worker = msgspec.convert({"worker_device": "cpu", "worker_max_batch_tokens": BUDGET}, WorkerSettings)
    return runner_factory(model_dir, worker, "gpu_workers/test", "w1")()


def test_a_request_without_max_tokens_ends_at_the_workers_budget(linked: tuple[Path, Path]) -> None:
    root, model_dir = linked
    edge = msgspec.convert({"edge_id": "e", "edge_port": 0}, EdgeSettings)
    preparer = Preparer(
        ModelCatalogue.from_cache(root, ["long-ctx"]), edge, ReplyTo(topic="r", partition=0, edge_id="e")
    )
    raw = msgspec.json.encode({"model": "long-ctx", "prompt": "hello world the quick brown fox"})
    event = preparer.prepare_sync("completion", raw, Tenant(name="t"), None, None).event
    assert isinstance(event, GenerationRequested)
    prompt = len(event.input_ids)
    assert event.sampling.max_tokens == 256 - prompt  # the edge's default: the room left in the context
    # the random model's end token would end it early; the edge's event otherwise
    event = msgspec.structs.replace(event, sampling=msgspec.structs.replace(event.sampling, ignore_eos=True))
    result = run(worker_runner(model_dir), [event]).finished[event.request_id]
    assert (result.status, result.finish_reason, result.error) == ("completed", "length", None)
    assert result.usage.prompt_tokens == prompt
    assert result.usage.total_tokens == BUDGET


def test_a_prompt_longer_than_the_budget_is_a_400_and_its_batch_mate_runs(linked: tuple[Path, Path]) -> None:
    _, model_dir = linked
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    long, short = (generation(greedy, model="long-ctx", input_ids=[5] * n) for n in (BUDGET, 10))
    done = run(worker_runner(model_dir), [long, short]).finished
    response = error_response(refused_as_too_long(done[long.request_id]))
    assert response.status == 400
    assert response.body is not None
    body = msgspec.json.decode(response.body)  # type: ignore[arg-type]
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "context_length_exceeded"
    assert str(BUDGET) in body["error"]["message"]
    assert done[short.request_id].status == "completed"
    assert done[short.request_id].usage.completion_tokens == 4
