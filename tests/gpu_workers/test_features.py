"""Drift features of finished requests, as the worker attaches them to the terminal event."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from gpu_workers.features import DRIFT_EMBED_BURST_S, MAX_BATCH, MAX_HELD, FeatureProbe
from schemas.events import (
    DriftFeatures,
    EmbeddingRequested,
    Float32Vectors,
    GenerationRequested,
    RequestFinished,
    Usage,
)
from schemas.features import sampled

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


def test_sampled_prompts_are_embedded_others_not() -> None:
    seen: list[list[str]] = []

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        seen.append(list(texts))
        return [[0.1234567891, -0.5] for _ in texts]

    probe = FeatureProbe(4, embed)
    assert probe.features(request(sampled_id()), finished()).embedding == [0.123457, -0.5]
    assert probe.features(request(unsampled_id()), finished()).embedding is None
    assert seen == [[PROMPT]]


def test_prompts_sampled_while_others_run_are_embedded_in_one_call() -> None:
    """A MiniLM call costs mostly per call: prompts queued at their requests' start are embedded together
    when the first of them finishes, and the others find their vectors ready."""
    seen: list[list[str]] = []

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        seen.append(list(texts))
        return [[float(len(text)), 0.0] for text in texts]

    probe = FeatureProbe(1, embed)
    events = [request(f"r-{i}", prompt="x" * (i + 1)) for i in range(3)]
    for event in events:
        probe.expect(event)
    probe.expect(request("never-ends", prompt="gone"))  # e.g. its partition moved: held, bounded
    got = {e.request_id: probe.features(e, finished()).embedding for e in reversed(events)}
    assert got == {"r-0": [1.0, 0.0], "r-1": [2.0, 0.0], "r-2": [3.0, 0.0]}
    assert probe.calls == 1
    assert sorted(seen[0]) == ["gone", "x", "xx", "xxx"]
    for i in range(MAX_HELD + 10):  # bounded however many start and never finish here
        probe.expect(request(f"q-{i}", prompt="p"))
    assert probe.features(events[0], finished()).embedding == [1.0, 0.0]
    assert len(seen[-1]) == MAX_BATCH


def test_an_embedder_that_fails_costs_the_feature_not_the_request() -> None:
    def broken(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        raise RuntimeError("out of memory")

    got = FeatureProbe(1, broken).features(request(), finished())
    assert got.embedding is None
    assert got.prompt_language == "en"


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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def saturated(budget: float, requests: int = 2000) -> tuple[FeatureProbe, float, float]:
    """Every request sampled, 5 ms of model work between them, 10 ms per embedding call (a MiniLM call on
    one CPU thread): the probe, then the seconds spent embedding and in all."""
    clock, spent = Clock(), [0.0]

    def embed(texts: Sequence[str]) -> Sequence[Sequence[float]]:
        clock.now += 0.010
        spent[0] += 0.010
        return [[1.0, 0.0] for _ in texts]

    skips: list[None] = []
    probe = FeatureProbe(1, embed, budget=budget, on_skip=lambda: skips.append(None), clock=clock)
    for i in range(requests):
        clock.now += 0.005
        event = request(f"r-{i}")
        probe.expect(event)
        probe.features(event, finished())
    assert len(skips) == probe.skipped
    return probe, spent[0], clock.now


def test_prompt_embeddings_keep_to_their_share_of_the_model_thread() -> None:
    """Unbounded, a 10 ms embedding per 5 ms of work would take two thirds of the thread; with a budget of
    5 % it takes 5 % (plus one burst), and the requests past it go without an embedding, counted."""
    probe, spent, total = saturated(budget=0.05)
    assert spent <= 0.05 * total + DRIFT_EMBED_BURST_S + 0.010
    assert spent >= 0.05 * total - 0.010, "the budget is used, not left idle"
    assert probe.skipped == 2000 - probe.calls > 0
    unbounded, spent, total = saturated(budget=1.0)
    assert unbounded.skipped == 0
    assert unbounded.calls == 2000
    assert spent > 0.6 * total


def test_under_the_budget_every_sampled_prompt_is_embedded() -> None:
    clock = Clock()
    probe = FeatureProbe(1, lambda texts: [[0.5, 0.5] for _ in texts], budget=0.02, clock=clock)
    for i in range(100):  # one request a second, embedding instantly: far under 2 %
        clock.now += 1.0
        assert probe.features(request(f"r-{i}"), finished()).embedding == [0.5, 0.5]
    assert probe.skipped == 0
