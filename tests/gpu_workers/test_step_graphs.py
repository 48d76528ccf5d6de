"""A generation step's prefill and decode as traced graphs on a CPU (``gpu_workers.step_graphs``): the
eager forward's scores and keys and values at every shape, or, where they cannot be traced or differ, the
eager forward."""

from __future__ import annotations

import weakref
from typing import Any

import msgspec
import pytest
import torch

from gpu_workers import step_graphs as graphs_module
from gpu_workers.engine import EngineError, GenerationEngine, SeqRequest, token_stats
from gpu_workers.models import LoadedModel
from gpu_workers.padding import decode_bias, pad_rows, prefill_bias
from gpu_workers.step_graphs import eager_prefill, positions_of, step_graphs
from tests.gpu_workers.conftest import BreakTracing

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
    monkeypatch.setattr(graphs_module, "_GRAPHS", weakref.WeakKeyDictionary())


@pytest.mark.parametrize("rows", BATCHES, ids=lambda rows: f"{len(rows)}x{max(map(len, rows))}")
def test_the_traced_prefill_gives_the_eager_scores_and_every_real_tokens_keys_and_values(
    demo_gpt: LoadedModel, cpu_only: None, rows: list[list[int]]
) -> None:
    graph = step_graphs(demo_gpt.model, token_stats).prefill
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


DECODES = [(1, 1), (1, 63), (4, 10), (7, 129), (32, 70)]
"""(rows, cached columns) of decode steps the graph was not traced on."""


@pytest.mark.parametrize(("rows", "columns"), DECODES, ids=lambda v: str(v))
def test_the_traced_decode_gives_the_eager_scores_and_writes_the_new_keys_and_values_in_place(
    demo_gpt: LoadedModel, cpu_only: None, rows: int, columns: int
) -> None:
    """The step's slots are views of a bigger buffer, as the growing cache reserves them; the graph writes
    the new token's keys and values into their last column and leaves the others alone."""
    from transformers import DynamicCache

    model = demo_gpt.model
    config = model.config
    graph = step_graphs(model, token_stats).decode
    assert graph is not None, "demo-gpt's decode should trace"
    heads, width = config.num_attention_heads, config.hidden_size // config.num_attention_heads
    g = torch.Generator().manual_seed(rows * 1000 + columns)
    buffers = [
        torch.randn(rows, heads, columns + 9, width, generator=g) for _ in range(2 * config.num_hidden_layers)
    ]
    before = [b.clone() for b in buffers]
    slots = [b[:, :, 3 : 3 + columns + 1] for b in buffers]  # live columns 3.., one reserved after them
    mask = torch.ones(rows, columns + 1, dtype=torch.long)
    mask[0, : columns // 2] = 0
    ids = torch.randint(1, 100, (rows, 1), generator=g)
    positions = torch.randint(columns, columns + 5, (rows, 1), generator=g)
    bias = decode_bias(mask, torch.float32)
    with torch.inference_mode():
        scores, stats = graph.run(ids, positions, bias, slots)
        cache = DynamicCache(config=config)
        for layer in range(config.num_hidden_layers):
            cache.update(
                before[2 * layer][:, :, 3 : 3 + columns], before[2 * layer + 1][:, :, 3 : 3 + columns], layer
            )
        eager = model(input_ids=ids, attention_mask=bias, position_ids=positions, past_key_values=cache)
    torch.testing.assert_close(scores, eager.logits[:, -1, :], atol=1e-4, rtol=0)
    torch.testing.assert_close(stats, token_stats(eager.logits[:, -1, :]), atol=1e-4, rtol=0)
    layers: list[Any] = list(cache.layers)
    eager_kv = [t for layer in layers for t in (layer.keys, layer.values)]
    for buffer, old, new in zip(buffers, before, eager_kv, strict=True):
        torch.testing.assert_close(buffer[:, :, 3 + columns], new[:, :, -1], atol=1e-5, rtol=0)
        untouched = torch.ones(columns + 9, dtype=torch.bool)
        untouched[3 + columns] = False
        assert torch.equal(buffer[:, :, untouched], old[:, :, untouched]), (
            "only the reserved column is written"
        )


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
        ("cannot trace", "could not be traced (Tracer cannot infer type of output): it runs eagerly"),
        ("differs", "traced is "),
    ],
)
def test_a_model_whose_step_cannot_be_traced_or_differs_runs_eagerly(
    demo_gpt: LoadedModel,
    cpu_only: None,
    untraced: None,
    caplog: pytest.LogCaptureFixture,
    break_tracing: BreakTracing,
    failure: str,
    logged: str,
) -> None:
    break_tracing(failure, graphs_module, "ATOL")
    engine = GenerationEngine(demo_gpt.model, max_batch_size=4)
    for forward in ("prefill", "decode"):
        assert f"GPT2LMHeadModel's {forward} {logged}" in caplog.text
    assert "it runs eagerly" in caplog.text
    assert engine.traced == (False, False)
    reference = GenerationEngine(demo_gpt.model, max_batch_size=4, traced=False)
    tokens = {}
    for name, e in (("fallback", engine), ("eager", reference)):
        e.add(SeqRequest(request_id=name, input_ids=[3, 4, 5, 6], max_new_tokens=12))
        out = []
        while e.has_work():
            out += [o.token_id for o in e.step()]
        tokens[name] = out
    assert tokens["fallback"] == tokens["eager"]
    assert len(tokens["eager"]) == 12


def test_a_worker_traces_its_generation_steps_on_a_cpu_unless_told_not_to(demo_gpt: LoadedModel) -> None:
    from gpu_workers.main import runner_factory
    from gpu_workers.settings import WorkerSettings
    from schemas.settings import load_settings

    assert WorkerSettings().worker_generation_traced
    off = load_settings(WorkerSettings, {"SLUICE_WORKER_GENERATION_TRACED": "false"})
    assert not off.worker_generation_traced
    for worker, traced in ((WorkerSettings(), True), (off, False)):
        runner = runner_factory(
            demo_gpt.path, msgspec.structs.replace(worker, worker_device="cpu"), "test", "w"
        )()
        engine = runner._engine  # type: ignore[attr-defined]
        assert isinstance(engine, GenerationEngine)
        assert engine.traced == (traced, traced)


# --- other architectures: tiny random models built from transformers' own configs ----------------------


def tiny_model(kind: str, **overrides: Any) -> Any:
    """A 2-layer, 32-wide causal LM of ``kind`` (llama, mistral, gpt2) with random weights and no end token
    (so ``generate`` makes every token asked for), in eval mode."""
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig

    common: dict[str, Any] = {"vocab_size": 100, "eos_token_id": None, "bos_token_id": None}
    if kind == "gpt2":
        config: Any = GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, **common, **overrides)
    else:
        cls = LlamaConfig if kind == "llama" else MistralConfig
        sizes: dict[str, Any] = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
        }
        sizes |= {"num_key_value_heads": 4, "max_position_embeddings": 128} | overrides
        config = cls(**sizes, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()  # type: ignore[no-untyped-call]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def greedy(model: Any, prompt: list[int], n: int, engine: GenerationEngine) -> tuple[list[int], list[int]]:
    """(the engine's tokens, ``generate``'s) for ``prompt`` and ``n`` new tokens, greedy."""
    engine.add(SeqRequest(request_id=f"r{len(prompt)}-{n}", input_ids=prompt, max_new_tokens=n))
    tokens: list[int] = []
    while engine.has_work():
        tokens += [out.token_id for out in engine.step()]
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n)
    return tokens, out[0, len(prompt) :].tolist()


def test_a_grouped_query_model_with_its_own_head_width_is_traced_and_equals_generate(cpu_only: None) -> None:
    """The decode's probes are shaped as the model's cache is: key/value heads, not query heads, and the
    model's own head width where it names one."""
    model = tiny_model("llama", num_key_value_heads=2, head_dim=16)
    engine = GenerationEngine(model, max_batch_size=4)
    assert engine.traced == (True, True)
    for prompt, n in (([5], 12), (list(range(1, 31)), 20), ([7] * 90, 30)):
        mine, theirs = greedy(model, prompt, n, engine)
        assert mine == theirs


def test_a_model_whose_rotary_scaling_depends_on_the_length_runs_eagerly(
    cpu_only: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A trace keeps the branch its probes took, and dynamic rope scaling picks one by the sequence's
    length: such a model is not traced."""
    model = tiny_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    engine = GenerationEngine(model, max_batch_size=2)
    assert engine.traced == (False, False)
    assert "rotary embedding's scaling (dynamic) depends on the sequence's length" in caplog.text
    mine, theirs = greedy(model, list(range(1, 20)), 10, engine)
    assert mine == theirs


def test_a_sliding_window_model_runs_eagerly_and_only_within_its_window(
    cpu_only: None, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine gives transformers a ready mask, which it uses as it is, so a window would not be applied:
    the engine serves no longer a context than the window, where full attention is the same thing."""
    model = tiny_model("mistral", sliding_window=16)
    engine = GenerationEngine(model, max_batch_size=2)
    assert engine.max_context == 16
    assert engine.traced == (False, False)
    assert "attends to at most 16 tokens at a time" in caplog.text
    assert "attends to a sliding window or in chunks" in caplog.text
    mine, theirs = greedy(model, list(range(1, 7)), 9, engine)
    assert mine == theirs
    with pytest.raises(EngineError):
        engine.add(SeqRequest(request_id="long", input_ids=list(range(1, 17)), max_new_tokens=1))


def test_the_graphs_do_not_keep_their_model_alive(cpu_only: None) -> None:
    import gc

    model = tiny_model("gpt2")
    assert step_graphs(model, token_stats).prefill is not None
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_model_in_training_mode_runs_eagerly_until_it_is_not(
    cpu_only: None, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_model("gpt2")
    model.train()
    assert GenerationEngine(model).traced == (False, False)
    assert "is in training mode: its steps run eagerly" in caplog.text
    model.eval()
    assert GenerationEngine(model).traced == (True, True)
