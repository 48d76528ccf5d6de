"""A generation model's prefill as a traced graph on a CPU (``gpu_workers.prefill``): the eager forward's
scores and keys and values at every shape, or, where it cannot be traced or differs, the eager forward."""

from __future__ import annotations

import weakref

import msgspec
import pytest
import torch

from gpu_workers import prefill
from gpu_workers.engine import GenerationEngine, SeqRequest, token_stats
from gpu_workers.models import LoadedModel
from gpu_workers.padding import pad_rows, prefill_bias
from gpu_workers.prefill import eager_prefill, positions_of, prefill_graph

BATCHES = [
    [[7]],
    [[11, 12]],
    [list(range(1, 60))],
    [[1, 2, 3], [4] * 25],
    [[9] * 5, [3], [1, 2, 3, 4, 5, 6, 7, 8]],
    [list(range(20, 20 + n)) for n in (13, 2, 2, 31, 8)],
    [[5] * 300, [6] * 120],
]
"""Heights, widths and padding the graph was not traced on (one row, one token, long prompts, 5 rows)."""


@pytest.fixture
def cpu_only(demo_gpt: LoadedModel) -> None:
    if demo_gpt.device.type != "cpu":
        pytest.skip(
            "the prefill is traced on a CPU only; a GPU runs it eagerly (and the decode as CUDA graphs)"
        )


@pytest.fixture
def untraced(monkeypatch: pytest.MonkeyPatch) -> None:
    """No model traced yet in this test (the session's demo-gpt is traced by the engine tests)."""
    monkeypatch.setattr(prefill, "_GRAPHS", weakref.WeakKeyDictionary())


@pytest.mark.parametrize("rows", BATCHES, ids=lambda rows: f"{len(rows)}x{max(map(len, rows))}")
def test_the_traced_prefill_gives_the_eager_scores_and_every_real_tokens_keys_and_values(
    demo_gpt: LoadedModel, cpu_only: None, rows: list[list[int]]
) -> None:
    graph = prefill_graph(demo_gpt.model, token_stats)
    assert graph is not None, "demo-gpt's prefill should trace"
    ids, mask = pad_rows(rows, 0, demo_gpt.device, left=True)
    positions = positions_of(mask)
    with torch.inference_mode():
        scores, stats, cache = graph.run(ids, mask, positions)
        eager_scores, eager_cache = eager_prefill(demo_gpt.model, ids, mask, positions)
    torch.testing.assert_close(scores, eager_scores, atol=1e-4, rtol=0)
    torch.testing.assert_close(stats, token_stats(eager_scores), atol=1e-4, rtol=0)
    assert stats[0].tolist() == eager_scores.argmax(dim=-1).float().tolist()
    real = mask.bool()
    for layer, eager_layer in zip(cache.layers, eager_cache.layers, strict=True):
        for got, want in ((layer.keys, eager_layer.keys), (layer.values, eager_layer.values)):
            assert got.shape == want.shape
            assert torch.isfinite(got).all(), "a padding token's keys and values must not be NaN either"
            for row in range(len(rows)):
                torch.testing.assert_close(got[row][:, real[row]], want[row][:, real[row]], atol=1e-4, rtol=0)


def test_the_prefill_mask_lets_a_token_see_itself_and_the_real_tokens_before_it() -> None:
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    bias = prefill_bias(mask, torch.float32)
    assert bias.shape == (2, 1, 4, 4)
    allowed = (bias == 0)[:, 0]
    assert allowed[1].tolist() == torch.ones(4, 4, dtype=torch.bool).tril().tolist()
    assert allowed[0].tolist() == [
        [False, False, False, False],  # padding attends to nothing (an even softmax, never NaN)
        [False, False, False, False],
        [False, False, True, False],
        [False, False, True, True],
    ]
    assert (bias[~(bias == 0)] == torch.finfo(torch.float32).min).all()
    assert torch.isfinite(torch.softmax(bias, dim=-1)).all()


@pytest.mark.parametrize(
    ("failure", "logged"),
    [
        ("cannot trace", "prefill could not be traced (Tracer cannot infer type of output): it runs eagerly"),
        ("differs", "prefill traced is "),
    ],
)
def test_a_model_whose_prefill_cannot_be_traced_or_differs_runs_eagerly(
    demo_gpt: LoadedModel,
    cpu_only: None,
    untraced: None,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    failure: str,
    logged: str,
) -> None:
    if failure == "cannot trace":

        def trace(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Tracer cannot infer type of output")

        monkeypatch.setattr(torch.jit, "trace", trace)
    else:
        monkeypatch.setattr(prefill, "ATOL", -1.0)  # any difference, even none, is too far
    engine = GenerationEngine(demo_gpt.model, max_batch_size=4)
    assert logged in caplog.text
    assert "it runs eagerly" in caplog.text
    assert not engine.traced
    reference = GenerationEngine(demo_gpt.model, max_batch_size=4, traced=False)
    tokens = {}
    for name, e in (("fallback", engine), ("eager", reference)):
        e.add(SeqRequest(request_id=name, input_ids=[3, 4, 5, 6], max_new_tokens=6))
        out = []
        while e.has_work():
            out += [o.token_id for o in e.step()]
        tokens[name] = out
    assert tokens["fallback"] == tokens["eager"]
    assert len(tokens["eager"]) == 6


def test_a_worker_traces_its_prefill_on_a_cpu_unless_told_not_to(demo_gpt: LoadedModel) -> None:
    from gpu_workers.main import runner_factory
    from gpu_workers.settings import WorkerSettings
    from schemas.settings import load_settings

    assert WorkerSettings().worker_prefill_traced
    off = load_settings(WorkerSettings, {"SLUICE_WORKER_PREFILL_TRACED": "false"})
    assert not off.worker_prefill_traced
    for worker, traced in ((WorkerSettings(), True), (off, False)):
        runner = runner_factory(
            demo_gpt.path, msgspec.structs.replace(worker, worker_device="cpu"), "test", "w"
        )()
        engine = runner._engine  # type: ignore[attr-defined]
        assert isinstance(engine, GenerationEngine)
        assert engine.traced is traced
