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
    _layers,
    churn_throughput,
    engine_throughput,
    raw_generate_throughput,
    sample_token,
    token_stats,
)
from gpu_workers.models import LoadedModel
from gpu_workers.padding import decode_bias

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


@pytest.mark.parametrize("traced", [True, False], ids=["traced", "eager"])
def test_greedy_tokens_equal_generate_alone_while_requests_join_finish_and_cancel(
    demo_gpt: LoadedModel, static_cache: bool, traced: bool
) -> None:
    """With the prefill traced (a CPU's default) and eager (a GPU's)."""
    lm = demo_gpt
    budgets = {"chat": 24, "short": 6, "story": 30, "system": 18, "doc": 12, "mid": 40}
    ids = {name: encode(lm, text) for name, text in PROMPTS.items()}
    assert len({len(v) for v in ids.values()}) >= 5, "prompts should differ in length"
    expected = {name: generate_alone(lm, ids[name], n) for name, n in budgets.items()}
    engine = GenerationEngine(lm.model, max_batch_size=4, static_cache=static_cache, traced=traced)
    assert engine.traced == (
        traced and lm.device.type == "cpu",
        traced and lm.device.type == "cpu" and not static_cache,
    )
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
        SeqRequest(request_id="nan", input_ids=[5], max_new_tokens=1, temperature=float("nan")),
        # torch.Generator.manual_seed raised on these inside the step, stopping the worker
        SeqRequest(request_id="big-seed", input_ids=[5], max_new_tokens=1, temperature=1.0, seed=2**64),
        SeqRequest(
            request_id="low-seed", input_ids=[5], max_new_tokens=1, temperature=1.0, seed=-(2**63) - 1
        ),
    ]
    for req in bad:
        with pytest.raises(EngineError, match=req.request_id):
            engine.add(req)
    engine.add(SeqRequest(request_id="dup", input_ids=[5], max_new_tokens=1))
    with pytest.raises(EngineError, match="already"):
        engine.add(SeqRequest(request_id="dup", input_ids=[5], max_new_tokens=1))
    for seed in (2**64 - 1, -(2**63)):  # torch's own bounds
        engine.add(
            SeqRequest(request_id=str(seed), input_ids=[5], max_new_tokens=1, temperature=1.0, seed=seed)
        )
    while engine.has_work():
        engine.step()


def test_a_temperature_too_small_to_divide_by_samples_greedily(
    demo_gpt: LoadedModel, static_cache: bool
) -> None:
    """1e-40 (the edge takes 0..2) made the logits infinite, the softmax NaN and ``torch.multinomial``
    raise inside the step: a crash loop of every worker the record reached."""
    engine = GenerationEngine(demo_gpt.model, max_batch_size=4, static_cache=static_cache)
    prompts = {name: encode(demo_gpt, PROMPTS[name]) for name in ("story", "mid", "doc")}
    joins = {
        0: [
            request(demo_gpt, "tiny", prompts["story"], 12, temperature=1e-40, seed=3),
            request(demo_gpt, "denormal", prompts["mid"], 12, temperature=5e-324, top_k=5, top_p=0.5),
            request(demo_gpt, "eps", prompts["doc"], 12, temperature=1e-6, seed=9),
        ]
    }
    seen = run(engine, joins)
    for rid, name in (("tiny", "story"), ("denormal", "mid"), ("eps", "doc")):
        assert [o.token_id for o in seen[rid]] == generate_alone(demo_gpt, prompts[name], 12), rid


def test_sample_token_never_overflows_whatever_the_temperature_or_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    for temperature in (1e-40, 5e-324, 1e-5):
        req = SeqRequest(request_id="t", input_ids=[1], max_new_tokens=1, temperature=temperature)
        assert {sample_token(logits, req, gen) for _ in range(20)} == {1}
    huge = torch.tensor([-3e38, 3e38, 2.9e38, float("-inf")])  # divided first, these overflowed too
    req = SeqRequest(request_id="h", input_ids=[1], max_new_tokens=1, temperature=0.5)
    assert {sample_token(huge, req, gen) for _ in range(20)} == {1}


def test_sample_token_filters() -> None:
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    top1 = SeqRequest(request_id="k", input_ids=[1], max_new_tokens=1, temperature=1.0, top_k=1)
    assert {sample_token(logits, top1, gen) for _ in range(20)} == {1}
    nucleus = SeqRequest(request_id="p", input_ids=[1], max_new_tokens=1, temperature=1.0, top_p=0.01)
    assert {sample_token(logits, nucleus, gen) for _ in range(20)} == {1}
    two = SeqRequest(request_id="p", input_ids=[1], max_new_tokens=1, temperature=1.0, top_p=0.9)
    assert {sample_token(logits, two, gen) for _ in range(200)} == {1, 2}


def test_a_top_p_that_is_zero_in_float32_keeps_the_best_token() -> None:
    """Found by a fuzz audit: 1e-300 passes every check (> 0) but is 0.0 in float32, and the nucleus then
    dropped every token: ``multinomial`` raised and the step failed for the whole batch."""
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0])
    gen = torch.Generator().manual_seed(0)
    for top_p in (1e-300, 5e-324, 1e-45):
        req = SeqRequest(request_id="p", input_ids=[1], max_new_tokens=1, temperature=1.0, top_p=top_p)
        assert {sample_token(logits, req, gen) for _ in range(20)} == {1}


def test_a_request_whose_sampling_raises_ends_alone_and_the_batch_goes_on(
    demo_gpt: LoadedModel, static_cache: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever one request's sampling raises ends that request with ``error``; the others in its batch
    are untouched (it failed the whole step, and three such steps the model thread)."""
    from gpu_workers import engine as engine_module

    real = engine_module.sample_token

    def sample(logits: torch.Tensor, req: SeqRequest, generator: torch.Generator) -> int:
        if req.request_id == "bad":
            raise RuntimeError("invalid multinomial distribution")
        return real(logits, req, generator)

    monkeypatch.setattr(engine_module, "sample_token", sample)
    lm = demo_gpt
    ids = {name: encode(lm, PROMPTS[name]) for name in ("story", "mid")}
    engine = GenerationEngine(lm.model, max_batch_size=2, static_cache=static_cache)
    seen = run(
        engine,
        {
            0: [
                request(lm, "keep", ids["story"], 12),
                request(lm, "bad", ids["mid"], 12, temperature=0.9, seed=1),
            ]
        },
    )
    assert [o.finish_reason for o in seen["bad"]] == ["error"]
    assert [o.token_id for o in seen["keep"]] == generate_alone(lm, ids["story"], 12)


def reference_stats(logits: torch.Tensor) -> list[tuple[int, float, float]]:
    """Each row's first best column, its log-probability and the entropy, in float64 from the definitions."""
    out = []
    for row in logits.double():
        best = max(range(len(row)), key=lambda i: (row[i].item(), -i))  # the first of equal bests
        logp = row.log_softmax(dim=-1)
        p = logp.exp()
        entropy = -(p[p > 0] * logp[p > 0]).sum().item()
        out.append((best, logp[best].item(), entropy))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_stats_are_the_greedy_token_its_logprob_and_the_entropy(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn((6, 97), generator=gen) * 4
    logits[1, 10] = logits[1, 40] = logits[1].max() + 1  # a tie: the first column wins, as argmax
    logits[2, 5:60] = float("-inf")  # masked columns: no probability, no entropy
    logits[3, :] = float("-inf")
    logits[3, 17] = 0.5  # one candidate: log-probability 0, entropy 0
    logits[4, :] = 2.0  # all equal: column 0, uniform
    logits = logits.to(dtype)
    stats = token_stats(logits)
    assert stats.shape == (3, 6)
    assert stats.dtype == torch.float32
    for row, (token, logprob, entropy) in enumerate(reference_stats(logits)):
        assert int(stats[0, row]) == token
        assert stats[1, row].item() == pytest.approx(logprob, abs=1e-4)
        assert stats[2, row].item() == pytest.approx(entropy, abs=1e-4)
    assert [int(t) for t in stats[0, 1:5]] == [10, int(logits[2].float().argmax()), 17, 0]
    assert stats[1, 3].item() == pytest.approx(0.0, abs=1e-6)
    assert stats[2, 3].item() == 0.0


def test_token_stats_of_a_nan_row_is_still_a_token_of_the_vocabulary() -> None:
    logits = torch.randn(2, 50)
    logits[0, 7] = float("nan")
    tokens = token_stats(logits)[0]
    assert 0 <= int(tokens[0]) < 50
    assert int(tokens[1]) == int(logits[1].argmax())


@pytest.mark.parametrize("attend_dtype", [torch.bool, torch.long])
def test_decode_bias_is_zero_where_a_row_attends_and_the_lowest_value_elsewhere(
    attend_dtype: torch.dtype,
) -> None:
    attend = torch.tensor([[0, 1, 1], [1, 1, 1]]).to(attend_dtype)
    bias = decode_bias(attend, torch.float16)
    lowest = torch.finfo(torch.float16).min
    assert bias.shape == (2, 1, 1, 3)
    assert bias.dtype == torch.float16
    assert bias[:, 0, 0, :].tolist() == [[lowest, 0.0, 0.0], [0.0, 0.0, 0.0]]


def test_throughput_helpers_measure(demo_gpt: LoadedModel) -> None:
    prompts = [encode(demo_gpt, PROMPTS[name]) for name in ("chat", "story", "short")]
    assert raw_generate_throughput(demo_gpt.model, prompts, max_new_tokens=4, batch_size=2) > 0
    assert engine_throughput(demo_gpt.model, prompts, max_new_tokens=4, batch_size=2) > 0


def test_churn_throughput_keeps_every_slot_busy_joining_a_request_as_one_ends(
    demo_gpt: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The continuous-batching floor: a first wave of staggered lengths, then a full-length joiner for
    every request that ends, for as long as it measures."""
    added: list[int] = []
    add = GenerationEngine.add

    def counted(self: GenerationEngine, req: SeqRequest) -> None:
        if req.request_id.startswith("churn-"):  # not the warm-up's
            added.append(req.max_new_tokens)
        add(self, req)

    monkeypatch.setattr(GenerationEngine, "add", counted)
    prompt = encode(demo_gpt, PROMPTS["chat"])
    assert churn_throughput(demo_gpt.model, prompt, max_new_tokens=8, batch_size=4, seconds=0.05) > 0
    assert added[:4] == [1, 3, 5, 7]  # ends spread over the steps
    assert set(added[4:]) == {8}
    assert len(added) >= 4 + 4 + 1, "joiners through the settling steps and the window"
    engine = GenerationEngine(demo_gpt.model, max_batch_size=4)
    engine.warm_up()
    for _ in range(2):  # the same engine again: left idle each time
        assert churn_throughput(demo_gpt.model, prompt, 8, 4, 0.05, engine) > 0
        assert not engine.has_work()
    with pytest.raises(EngineError, match="an idle engine of 2 slots"):
        churn_throughput(demo_gpt.model, prompt, 8, 2, 0.05, engine)


def test_leading_columns_go_once_the_rows_that_attended_to_them_are_freed(demo_gpt: LoadedModel) -> None:
    """The growing cache keeps only the columns some row attends to: while every row runs, a decode adds
    one column; once the long prompt's row is freed its columns go, and the batch is as wide as the short
    row's own span."""
    engine = GenerationEngine(demo_gpt.model, max_batch_size=2, static_cache=False)
    engine.add(SeqRequest(request_id="long", input_ids=list(range(5, 35)), max_new_tokens=3))
    engine.add(SeqRequest(request_id="short", input_ids=[5, 6, 7], max_new_tokens=12))
    engine.step()  # both prefilled together: 30 columns
    widths = []
    while engine.has_work():
        finished = {out.request_id for out in engine.step() if out.finish_reason is not None}
        mask = engine._batch.mask
        if mask is None:
            break
        widths.append(mask.shape[1])
        if finished == {"long"}:
            short_row = next(i for i, seq in enumerate(engine._batch.seqs) if seq is not None)
            assert mask.shape[1] == int(mask[short_row].sum()) < 30
    # one column a decode while both run; when the long one ends (its 3rd token, the 2nd decode) its
    # columns go: the short row's 3 prompt columns and 2 decoded ones stay, then one a decode again
    assert widths == [31, *range(5, 5 + len(widths) - 1)]


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


def poison_row(engine: GenerationEngine, request_id: str) -> None:
    """``request_id``'s row's values in the first layer become NaN: a numeric blow-up in one sequence (an
    fp16 overflow, say). Its next decode reads them: its scores turn NaN, and so do the keys and values it
    writes in every later layer. Written into the cache itself, so a decode replayed as a CUDA graph reads
    them too (a forward hook would not run there)."""
    rows = [i for i, seq in enumerate(engine._batch.seqs) if seq and seq.req.request_id == request_id]
    assert len(rows) == 1
    with torch.inference_mode():
        if engine._ring is not None:
            engine._ring.values[0][rows[0]] = float("nan")
        else:
            _layers(engine._batch.cache)[0][1][rows[0]] = float("nan")


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_sequence_whose_scores_turn_nan_ends_alone_and_its_row_serves_the_next_one_cleanly(
    demo_gpt: LoadedModel, static_cache: bool, sampled: bool
) -> None:
    """Non-finite next-token scores in one row end that sequence with ``error`` (no token from them), while
    the others in its batch go on untouched (a sampled one too: ``multinomial`` raises on a NaN
    distribution, which failed the whole step), and the row's NaN keys and values are not left for the
    sequence that takes the row next: masked columns still enter attention (NaN + the mask's lowest value is
    NaN), so they poisoned every later tenant of the row."""
    lm = demo_gpt
    ids = {name: encode(lm, PROMPTS[name]) for name in ("story", "mid", "short")}
    engine = GenerationEngine(lm.model, max_batch_size=2, static_cache=static_cache)
    extra = {"temperature": 0.9, "seed": 5} if sampled else {}
    keep = request(lm, "keep", ids["story"], 40, **extra)
    reference = {0: [keep]}
    expected_keep = [o.token_id for o in run(GenerationEngine(lm.model, max_batch_size=2), reference)["keep"]]
    expected_next = generate_alone(lm, ids["short"], 12)
    engine.add(keep)
    engine.add(request(lm, "bad", ids["mid"], 30, **extra))
    seen: dict[str, list[StepOutput]] = {}
    for out in engine.step() + engine.step():  # both prefilled, then one decode each
        seen.setdefault(out.request_id, []).append(out)
    poison_row(engine, "bad")
    for out in engine.step():
        seen.setdefault(out.request_id, []).append(out)
    assert seen["bad"][-1].finish_reason == "error"
    assert (seen["bad"][-1].logprob, seen["bad"][-1].entropy) == (0.0, 0.0), "no NaN for the drift features"
    assert engine.running == 1
    for _ in range(3):  # the row's NaN columns now older than the next prompt: masked, not overwritten
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    engine.add(request(lm, "next", ids["short"], 12))  # takes the bad sequence's row
    for step, outs in run(engine, {}).items():
        seen.setdefault(step, []).extend(outs)
    assert [o.token_id for o in seen["keep"]] == expected_keep
    assert [o.token_id for o in seen["next"]] == expected_next
    assert all(o.finish_reason != "error" for name in ("keep", "next") for o in seen[name])


def test_a_step_that_fails_after_a_nan_leaves_no_nan_for_the_next_sequences(
    demo_gpt: LoadedModel, static_cache: bool
) -> None:
    """A step failing part-way after a row's scores turned NaN (before the row was freed and scrubbed: an
    out-of-memory while sampling the others, say) is reset: the ring kept its rows' keys and values, so a
    later sequence placed in that row read the NaN and failed (found by a review)."""
    lm = demo_gpt
    ids = {name: encode(lm, PROMPTS[name]) for name in ("story", "mid", "short", "doc")}
    engine = GenerationEngine(lm.model, max_batch_size=2, static_cache=static_cache)
    engine.add(request(lm, "keep", ids["story"], 40))
    engine.add(request(lm, "bad", ids["mid"], 40))
    engine.step()
    engine.step()
    poison_row(engine, "bad")
    sample = engine._sample

    def failing(*args: object, **kwargs: object) -> object:
        raise RuntimeError("out of memory, say")

    engine._sample = failing  # type: ignore[method-assign,assignment]
    with pytest.raises(RuntimeError):
        engine.step()
    engine._sample = sample  # type: ignore[method-assign]
    assert sorted(engine.reset(keep_waiting=True)) == ["bad", "keep"]
    outputs = run(engine, {0: [request(lm, "a", ids["doc"], 12)], 5: [request(lm, "b", ids["short"], 12)]})
    assert [o.token_id for o in outputs["a"]] == generate_alone(lm, ids["doc"], 12)
    assert [o.token_id for o in outputs["b"]] == generate_alone(lm, ids["short"], 12)


def test_seeds_that_differ_above_32_bits_sample_differently_on_a_cpu(demo_gpt: LoadedModel) -> None:
    """An audit: torch's CPU generator keeps a seed's low 32 bits, so 7, 2**32 + 7 and -(2**32) + 7 wrote
    the same text at temperature 2. Seeds in [0, 2**32) draw what they did."""
    from gpu_workers.engine import cpu_seed

    assert [cpu_seed(s) for s in (0, 7, 2**32 - 1)] == [0, 7, 2**32 - 1]
    folded = {cpu_seed(s) for s in (2**32 + 7, -(2**32) + 7, 2**40 + 7, 2**64 - 1, -(2**63), -1, -5)}
    assert len(folded) == 7
    assert cpu_seed(-1) != 2**32 - 1, "torch keeps -1's low 32 bits: 2**32 - 1's (a review)"
    assert all(0 <= s < 2**32 for s in folded)
    engine = GenerationEngine(demo_gpt.model, max_batch_size=4)
    ids = encode(demo_gpt, PROMPTS["story"])
    seeds = (7, 2**32 + 7, -(2**32) + 7)
    joins = {
        0: [
            SeqRequest(request_id=str(s), input_ids=ids, max_new_tokens=24, temperature=2.0, seed=s)
            for s in seeds
        ]
    }
    out = run(engine, joins)
    texts = {s: [o.token_id for o in out[str(s)]] for s in seeds}
    assert len({tuple(t) for t in texts.values()}) == 3, texts
