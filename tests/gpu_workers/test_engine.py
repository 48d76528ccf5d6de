from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from gpu_workers.engine import (
    COMPACT_AFTER_STEPS,
    EngineError,
    GenerationEngine,
    GenerationRuntime,
    SeqRequest,
    StepOutput,
    _growing_cache,
    engine_throughput,
    raw_generate_throughput,
    sample_token,
)
from gpu_workers.models import LoadedModel

PROMPTS = {
    "chat": "<|user|>\nTell me about the river.\n<|assistant|>\n",
    "short": "Return",
    "story": "The old mill listens to the lantern in the fog. The baker counts",
    "system": "<|system|>\nYou answer briefly.\n<|user|>\nWhy is the harbour important?\n<|assistant|>\n",
    "doc": "Return a new list containing",
    "mid": "The ferry carries the",
}


@pytest.fixture(params=[False, True], ids=["growing", "ring"])
def static_cache(request: pytest.FixtureRequest) -> bool:
    """The engine's two KV caches: the growing one (the CPU's default) and the fixed ring (a GPU's, where
    its decode is a CUDA graph; here it runs eagerly). Every engine contract holds for both."""
    return bool(request.param)


def encode(lm: LoadedModel, text: str) -> list[int]:
    ids: list[int] = lm.tokenizer(text).input_ids
    return ids


def generate_alone(lm: LoadedModel, ids: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers' own greedy generate for this prompt alone (stops at eos)."""
    with torch.inference_mode():
        out = lm.model.generate(  # type: ignore[operator]
            torch.tensor([ids], device=lm.device),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=lm.manifest.eos_token_id,
        )
    tokens: list[int] = out[0, len(ids) :].tolist()
    return tokens


def request(lm: LoadedModel, rid: str, ids: list[int], n: int, **sampling: float) -> SeqRequest:
    eos = lm.manifest.eos_token_id
    stop = frozenset({eos}) if eos is not None else frozenset()
    return SeqRequest(request_id=rid, input_ids=ids, max_new_tokens=n, stop_token_ids=stop, **sampling)  # type: ignore[arg-type]


def run(
    engine: GenerationRuntime,
    joins: dict[int, list[SeqRequest]],
    *,
    on_step: Callable[[int], None] | None = None,
    max_steps: int = 500,
) -> dict[str, list[StepOutput]]:
    """Step until idle, adding ``joins[step]`` before that step; outputs per request id in order."""
    seen: dict[str, list[StepOutput]] = {}
    last_join = max(joins, default=0)
    for step in range(max_steps):
        for req in joins.get(step, []):
            engine.add(req)
        if on_step is not None:
            on_step(step)
        if not engine.has_work() and step > last_join:
            return seen
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not drain")


def test_greedy_tokens_equal_generate_alone_while_requests_join_finish_and_cancel(
    demo_gpt: LoadedModel, static_cache: bool
) -> None:
    lm = demo_gpt
    budgets = {"chat": 24, "short": 6, "story": 30, "system": 18, "doc": 12, "mid": 40}
    ids = {name: encode(lm, text) for name, text in PROMPTS.items()}
    assert len({len(v) for v in ids.values()}) >= 5, "prompts should differ in length"
    expected = {name: generate_alone(lm, ids[name], n) for name, n in budgets.items()}
    engine: GenerationRuntime = GenerationEngine(lm.model, max_batch_size=4, static_cache=static_cache)
    joins = {
        0: [request(lm, name, ids[name], budgets[name]) for name in ("chat", "short")],
        2: [request(lm, "story", ids["story"], budgets["story"]), request(lm, "victim", ids["mid"], 50)],
        3: [request(lm, "system", ids["system"], budgets["system"])],  # waits: batch is full
        9: [request(lm, name, ids[name], budgets[name]) for name in ("doc", "mid")],
    }
    cancelled_at: dict[str, int] = {}

    def cancel_victim(step: int) -> None:
        if step == 6:
            before = engine.running
            assert engine.cancel("victim")
            assert engine.running == before - 1
            cancelled_at["victim"] = step

    outputs = run(engine, joins, on_step=cancel_victim)
    for name in budgets:
        tokens = [o.token_id for o in outputs[name]]
        assert tokens == expected[name], name
        reasons = [o.finish_reason for o in outputs[name]]
        assert reasons[:-1] == [None] * (len(reasons) - 1)
        assert reasons[-1] == ("stop" if tokens[-1] == lm.manifest.eos_token_id else "length")
    assert len(outputs["victim"]) == cancelled_at["victim"] - 2  # one token per step from its join, then none
    assert all(o.finish_reason is None for o in outputs["victim"])
    assert engine.running == 0
    assert not engine.cancel("victim")


def test_rows_are_reused_in_place_under_churn_and_tokens_still_equal_generate_alone(
    demo_gpt: LoadedModel, static_cache: bool
) -> None:
    """A closed loop at a full batch: whenever a sequence ends, the next request joins and takes the free row
    in place, so the batch is copied once to build it and once to drop the free rows nobody takes (after
    COMPACT_AFTER_STEPS), never per join. Every request's tokens are still exactly ``generate``'s alone."""
    lm = demo_gpt
    names = ["story", "short", "doc", "mid", "chat", "short", "mid", "doc", "chat", "short", "mid", "doc"]
    budgets = [50, 3, 9, 5, 12, 4, 7, 6, 10, 8, 5, 11]  # "story" outlives the others (no eos within 50)
    ids = [encode(lm, PROMPTS[name]) for name in names]
    expected = {str(i): generate_alone(lm, ids[i], budgets[i]) for i in range(len(names))}
    assert len(expected["0"]) == budgets[0]
    engine = GenerationEngine(lm.model, max_batch_size=4, static_cache=static_cache)
    assert engine.static_cache == static_cache
    queue = iter(range(len(names)))
    for i in itertools.islice(queue, 4):
        engine.add(request(lm, str(i), ids[i], budgets[i]))
    seen: dict[str, list[int]] = {}
    alone: list[int] = []  # engine.rows at each step while "story" runs alone
    while engine.has_work():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.token_id)
            if out.finish_reason is not None and (nxt := next(queue, None)) is not None:
                engine.add(request(lm, str(nxt), ids[nxt], budgets[nxt]))
        assert engine.rows <= 4
        if engine.running == 1 and not engine.waiting:
            alone.append(engine.rows)
    assert seen == expected
    assert engine.rebuilds == 2, f"{engine.rebuilds} rebuilds for {len(names) - 4} joins: rows not reused"
    assert alone[0] > 1, "free rows are kept a while for joiners"
    assert alone.index(1) <= COMPACT_AFTER_STEPS, "then dropped"
    assert engine.rows == 0


def test_seeded_sampling_reproduces_tokens_alone_and_in_a_batch(
    demo_gpt: LoadedModel, static_cache: bool
) -> None:
    lm = demo_gpt
    ids = encode(lm, PROMPTS["chat"])

    def sampled(seed: int, company: bool) -> list[int]:
        engine = GenerationEngine(lm.model, max_batch_size=8, static_cache=static_cache)
        joins = {0: [request(lm, "r", ids, 40, temperature=0.9, top_p=0.95, top_k=50, seed=seed)]}
        if company:
            joins[0].append(request(lm, "other", encode(lm, PROMPTS["story"]), 40, temperature=1.0, seed=7))
            joins[3] = [request(lm, "late", encode(lm, PROMPTS["short"]), 10)]
        return [o.token_id for o in run(engine, joins)["r"]]

    first = sampled(42, company=False)
    assert sampled(42, company=False) == first
    assert sampled(42, company=True) == first
    assert sampled(43, company=False) != first


def test_cancel_frees_the_slot_and_stops_output(demo_gpt: LoadedModel, static_cache: bool) -> None:
    lm = demo_gpt
    engine = GenerationEngine(lm.model, max_batch_size=2, static_cache=static_cache)
    for rid in ("a", "b", "c"):
        engine.add(SeqRequest(request_id=rid, input_ids=encode(lm, PROMPTS["mid"]), max_new_tokens=100))
    assert {o.request_id for o in engine.step()} == {"a", "b"}
    assert (engine.running, engine.waiting) == (2, 1)
    assert engine.cancel("a")
    assert (engine.running, engine.waiting) == (1, 1)
    assert engine.cancel("c")  # a waiting request is simply dropped
    assert engine.waiting == 0
    engine.add(SeqRequest(request_id="d", input_ids=encode(lm, PROMPTS["short"]), max_new_tokens=100))
    for _ in range(3):
        assert {o.request_id for o in engine.step()} == {"b", "d"}
    assert engine.cancel("b")
    assert engine.cancel("d")
    assert not engine.has_work()
    assert engine.step() == []


def test_finish_reasons_length_and_stop(demo_gpt: LoadedModel, static_cache: bool) -> None:
    lm = demo_gpt
    ids = encode(lm, PROMPTS["story"])
    greedy = generate_alone(lm, ids, 5)
    engine = GenerationEngine(lm.model, static_cache=static_cache)
    engine.add(SeqRequest(request_id="len", input_ids=ids, max_new_tokens=3))
    engine.add(
        SeqRequest(request_id="stop", input_ids=ids, max_new_tokens=10, stop_token_ids=frozenset({greedy[1]}))
    )
    engine.add(SeqRequest(request_id="one", input_ids=ids, max_new_tokens=1))
    out = run(engine, {})
    assert [(o.token_id, o.finish_reason) for o in out["len"]] == [
        (greedy[0], None),
        (greedy[1], None),
        (greedy[2], "length"),
    ]
    assert [(o.token_id, o.finish_reason) for o in out["stop"]] == [(greedy[0], None), (greedy[1], "stop")]
    assert [(o.token_id, o.finish_reason) for o in out["one"]] == [(greedy[0], "length")]


def test_context_limit_ends_with_length(demo_gpt: LoadedModel, static_cache: bool) -> None:
    engine = GenerationEngine(demo_gpt.model, max_context=12, static_cache=static_cache)
    engine.add(SeqRequest(request_id="r", input_ids=list(range(10, 20)), max_new_tokens=50))
    out = run(engine, {})["r"]
    assert [o.finish_reason for o in out] == [None, "length"]


def test_the_ring_wraps_many_times_and_tokens_still_equal_generate_alone(demo_gpt: LoadedModel) -> None:
    """A ring of 32 columns under a closed loop of 3 slots for ~200 steps: every column is rewritten
    several times, joiners land on any ring position (their prompt's columns wrapping past the end), rows
    free and fill, the batch grows and shrinks between graph heights; each request's tokens are still
    ``generate``'s alone, cut where the 32-token context ends."""
    lm = demo_gpt
    context = 32
    names = list(itertools.islice(itertools.cycle(PROMPTS), 30))
    ids = [encode(lm, PROMPTS[name]) for name in names]
    budgets = [3 + (7 * i) % 23 for i in range(len(names))]
    expected = {
        str(i): generate_alone(lm, ids[i], min(budgets[i], context - len(ids[i]))) for i in range(len(names))
    }
    engine = GenerationEngine(lm.model, max_batch_size=3, max_context=context, static_cache=True)
    queue = iter(range(len(names)))
    for i in itertools.islice(queue, 3):
        engine.add(request(lm, str(i), ids[i], budgets[i]))
    seen: dict[str, list[int]] = {}
    steps = 0
    heights: set[int] = set()
    while engine.has_work():
        steps += 1
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.token_id)
            if out.finish_reason is not None and (nxt := next(queue, None)) is not None:
                engine.add(request(lm, str(nxt), ids[nxt], budgets[nxt]))
        heights.add(engine.rows)
    assert steps > 4 * context, f"{steps} steps: the ring should wrap several times"
    assert seen == expected
    assert heights >= {4}, "3 slots run in the ring's graph height of 4 (one free row)"


def test_the_last_row_moves_up_when_free_rows_are_dropped(demo_gpt: LoadedModel, static_cache: bool) -> None:
    """Three requests start together; the first two end early, and once their rows have been free for
    COMPACT_AFTER_STEPS the batch shrinks to the third, which moves from row 2 to row 0 with its cache."""
    lm = demo_gpt
    ids = {name: encode(lm, PROMPTS[name]) for name in ("short", "doc", "story")}
    budgets = {"short": 2, "doc": 3, "story": 45}
    expected = generate_alone(lm, ids["story"], budgets["story"])
    engine = GenerationEngine(lm.model, max_batch_size=3, static_cache=static_cache)
    rows: list[int] = []
    out = run(
        engine,
        {0: [request(lm, name, ids[name], n) for name, n in budgets.items()]},
        on_step=lambda _: rows.append(engine.rows),
    )
    assert [o.token_id for o in out["story"]] == expected
    assert max(rows) >= 3, rows
    assert 1 in rows, rows


def test_a_reset_ring_engine_serves_again(demo_gpt: LoadedModel) -> None:
    """After ``reset`` (a step that ran out of memory) the ring's rows are free and new requests' tokens
    are ``generate``'s alone; ``warm_up`` leaves the engine empty (its graphs captured on a GPU)."""
    lm = demo_gpt
    engine = GenerationEngine(lm.model, max_batch_size=4, static_cache=True)
    assert engine.warm_up() == (3 if lm.device.type == "cuda" else 0), "heights 1, 2, 4 on a GPU"
    assert not engine.has_work()
    ids = encode(lm, PROMPTS["story"])
    engine.add(request(lm, "a", ids, 30))
    engine.add(request(lm, "b", encode(lm, PROMPTS["chat"]), 30))
    for _ in range(5):
        engine.step()
    assert sorted(engine.reset()) == ["a", "b"]
    out = run(engine, {0: [request(lm, "c", ids, 12)]})
    assert [o.token_id for o in out["c"]] == generate_alone(lm, ids, 12)


@pytest.mark.parametrize("error", ["too large", "out of memory"])
def test_a_ring_that_does_not_fit_leaves_the_growing_cache(
    demo_gpt: LoadedModel, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, error: str
) -> None:
    """A ring past half the free device memory, or one whose allocation runs out of memory, is not made:
    the engine warns and serves with the growing cache. Any other failure is a bug and is raised."""
    from gpu_workers import ring

    def refuse(*args: object, **kwargs: object) -> None:
        if error == "too large":
            raise ring.RingTooLarge("a KV ring of 4 rows x 512 columns needs 9,999 MiB")
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 9.77 GiB")

    monkeypatch.setattr(ring, "RingCache", refuse)
    lm = demo_gpt
    engine = GenerationEngine(lm.model, max_batch_size=4, static_cache=True)
    assert not engine.static_cache
    assert "the growing KV cache instead" in caplog.text
    ids = encode(lm, PROMPTS["story"])
    out = run(engine, {0: [request(lm, "r", ids, 10)]})
    assert [o.token_id for o in out["r"]] == generate_alone(lm, ids, 10)

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("a bug")

    monkeypatch.setattr(ring, "RingCache", broken)
    with pytest.raises(ValueError, match="a bug"):
        GenerationEngine(lm.model, static_cache=True)


def test_add_rejects_bad_requests(demo_gpt: LoadedModel) -> None:
    engine = GenerationEngine(demo_gpt.model)
    vocab = demo_gpt.model.config.vocab_size
    bad = [
        SeqRequest(request_id="empty", input_ids=[], max_new_tokens=1),
        SeqRequest(request_id="long", input_ids=[5] * engine.max_context, max_new_tokens=1),
        SeqRequest(request_id="vocab", input_ids=[vocab], max_new_tokens=1),
        SeqRequest(request_id="zero", input_ids=[5], max_new_tokens=0),
        SeqRequest(request_id="temp", input_ids=[5], max_new_tokens=1, temperature=-1.0),
    ]
    for req in bad:
        with pytest.raises(EngineError, match=req.request_id):
            engine.add(req)
    engine.add(SeqRequest(request_id="dup", input_ids=[5], max_new_tokens=1))
    with pytest.raises(EngineError, match="already"):
        engine.add(SeqRequest(request_id="dup", input_ids=[5], max_new_tokens=1))


def test_sample_token_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    top1 = SeqRequest(request_id="k", input_ids=[1], max_new_tokens=1, temperature=1.0, top_k=1)
    assert {sample_token(logits, top1, gen) for _ in range(20)} == {1}
    nucleus = SeqRequest(request_id="p", input_ids=[1], max_new_tokens=1, temperature=1.0, top_p=0.01)
    assert {sample_token(logits, nucleus, gen) for _ in range(20)} == {1}
    two = SeqRequest(request_id="p", input_ids=[1], max_new_tokens=1, temperature=1.0, top_p=0.9)
    assert {sample_token(logits, two, gen) for _ in range(200)} == {1, 2}


def test_throughput_helpers_measure(demo_gpt: LoadedModel) -> None:
    prompts = [encode(demo_gpt, PROMPTS[name]) for name in ("chat", "story", "short")]
    assert raw_generate_throughput(demo_gpt.model, prompts, max_new_tokens=4, batch_size=2) > 0
    assert engine_throughput(demo_gpt.model, prompts, max_new_tokens=4, batch_size=2) > 0


def test_the_growing_cache_layer_matches_concatenation_through_growth_and_trims() -> None:
    """The decode cache's layers write each step into a buffer (doubling when full) instead of
    concatenating; what the model sees must be exactly what concatenation gives, trims included."""
    gen = torch.Generator().manual_seed(0)
    keys, values = torch.randn(3, 2, 5, 4, generator=gen), torch.randn(3, 2, 5, 4, generator=gen)
    cache = _growing_cache([(keys, values)])
    layer = cache.layers[0]
    ref_k, ref_v = keys, values
    for step in range(150):  # past 64, 2x and 4x the first buffer
        k, v = torch.randn(3, 2, 1, 4, generator=gen), torch.randn(3, 2, 1, 4, generator=gen)
        ref_k, ref_v = torch.cat([ref_k, k], dim=-2), torch.cat([ref_v, v], dim=-2)
        out_k, out_v = cache.update(k, v, 0)
        if step % 40 == 39:  # leading columns nobody attends to go
            layer.trim(7)
            ref_k, ref_v = ref_k[:, :, 7:], ref_v[:, :, 7:]
            out_k, out_v = layer.keys, layer.values
        assert torch.equal(out_k, ref_k)
        assert torch.equal(out_v, ref_v)
        assert cache.get_seq_length() == ref_k.shape[-2]
    assert layer.kbuf.shape[2] > 64, "the buffer grew (moved) on the way"
