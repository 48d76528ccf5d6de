"""The generation and embedding runners in this process, without Kafka: the terminal events they build and
the seed a request without one samples with."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import msgspec
import pytest

from gpu_workers.batching import BatcherConfig
from gpu_workers.detok import detokenizer_for
from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.embedding_runner import EmbeddingRunner
from gpu_workers.engine import GenerationEngine
from gpu_workers.flush import FlushPolicy
from gpu_workers.generation import GenerationRunner
from gpu_workers.models import ROLE_TOKENS, LoadedModel
from gpu_workers.runtime import Arrival, Request, Runner
from gpu_workers.scheduler import SchedulerConfig
from schemas.events import (
    EmbeddingRequested,
    ErrorInfo,
    GenerationRequested,
    RequestFinished,
    SamplingParams,
    Timings,
    TokenChunk,
    Usage,
    utc_now,
)
from schemas.ids import derive_seed, uuid7
from tests.gpu_workers.test_engine import poison_row

SOURCE = "gpu_workers/test"
WORKER = "worker-1"
PROMPT = [5, 6, 7, 8, 9, 10]
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@dataclass
class Collected:
    chunks: list[TokenChunk] = field(default_factory=list)
    finished: dict[str, RequestFinished] = field(default_factory=dict)

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        self.chunks.append(chunk)

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        assert result.request_id not in self.finished, "one terminal event per request"
        self.finished[result.request_id] = result

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


def run(runner: Runner, requests: Sequence[Request], max_ticks: int = 2000) -> Collected:
    """Accept ``requests`` and tick until each has its terminal event."""
    out = Collected()
    for offset, request in enumerate(requests):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    for _ in range(max_ticks):
        if len(out.finished) == len(requests):
            return out
        runner.tick(out)
    raise AssertionError(f"{len(requests) - len(out.finished)} requests never finished")


EVERY_TOKEN = FlushPolicy(max_tokens=4, max_delay_s=0.0)


def generation_runner(
    lm: LoadedModel,
    engine: GenerationEngine,
    *,
    max_running: int,
    max_waiting: int,
    flush: FlushPolicy = EVERY_TOKEN,
) -> GenerationRunner:
    """demo-gpt's runner around ``engine``, as the tests configure it (by default every token is a chunk)."""
    return GenerationRunner(
        engine,
        detokenizer_for(lm.tokenizer),
        lm.manifest,
        source=SOURCE,
        worker_id=WORKER,
        scheduler=SchedulerConfig(max_running=max_running, max_batch_tokens=4096, max_waiting=max_waiting),
        flush=flush,
    )


def embedding_runner(
    lm: LoadedModel, engine: EmbeddingEngine, *, max_batch_size: int = 8, overlap: bool | None = None
) -> EmbeddingRunner:
    """MiniLM's runner around ``engine``, as the tests configure it."""
    return EmbeddingRunner(
        engine,
        lm.manifest,
        source=SOURCE,
        worker_id=WORKER,
        batching=BatcherConfig(max_batch_size=max_batch_size, max_wait_s=0.0, max_batch_tokens=4096),
        overlap=overlap,
    )


@pytest.fixture(scope="module")
def gpt_runner(demo_gpt: LoadedModel) -> GenerationRunner:
    engine = GenerationEngine(demo_gpt.model, max_batch_size=8, max_context=demo_gpt.manifest.max_context)
    return generation_runner(demo_gpt, engine, max_running=8, max_waiting=64)


@pytest.fixture(scope="module")
def minilm_runner(minilm: LoadedModel) -> EmbeddingRunner:
    return embedding_runner(minilm, EmbeddingEngine(minilm.model, max_length=minilm.manifest.max_context))


def generation(sampling: SamplingParams, **fields: object) -> GenerationRequested:
    event = GenerationRequested(
        tenant="acme",
        model="demo-gpt",
        request_id=uuid7(),
        source="test",
        model_version="v",
        input_ids=PROMPT,
        sampling=sampling,
    )
    return msgspec.structs.replace(event, **fields)


def embedding(**fields: object) -> EmbeddingRequested:
    event = EmbeddingRequested(
        tenant="globex",
        model="all-minilm-l6-v2",
        request_id=uuid7(),
        source="test",
        model_version="v",
        inputs=[[101, 7592, 102], [101, 2088, 2003, 102]],
    )
    return msgspec.structs.replace(event, **fields)


def assert_envelope(result: RequestFinished, request: Request) -> None:
    """What a runner stamps on every terminal event; the request's own fields (version, kind, edge, shadow)
    are copied in later, at publish (``with_request``), so a runner leaves them empty."""
    assert (result.tenant, result.model, result.request_id) == (
        request.tenant,
        request.model,
        request.request_id,
    )
    assert (result.source, result.worker_id) == (SOURCE, WORKER)
    assert (result.traceparent, result.tracestate) == (request.traceparent, None)
    assert (result.model_version, result.kind, result.stream, result.edge_id) == ("", "", False, "")
    assert (result.idempotency_key, result.shadow_of) == (None, None)


NO_USAGE = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)


def test_a_seedless_request_samples_with_the_seed_the_edge_would_give_it(
    gpt_runner: GenerationRunner,
) -> None:
    """A request published without a seed (not through the edge) samples the same tokens as the edge's
    copy of it, which carries ``derive_seed(request_id)``."""
    sampling = SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    seedless = generation(sampling)
    seeded = generation(msgspec.structs.replace(sampling, seed=derive_seed(seedless.request_id)))
    other = generation(msgspec.structs.replace(sampling, seed=derive_seed(uuid7())))
    done = run(gpt_runner, [seedless, seeded, other]).finished
    assert done[seedless.request_id].text == done[seeded.request_id].text
    assert done[seedless.request_id].text != done[other.request_id].text


# --- terminal events ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [(), ("never-in-this-text",)], ids=["per-chunk", "per-token"])
def test_streamed_chunks_carry_the_text_decode_gives_their_tokens(
    demo_gpt: LoadedModel, stop: tuple[str, ...]
) -> None:
    """A streamed request without stop strings has its text decoded once a chunk; with them, token by token
    (a stop string is looked for as the text grows). Either way each chunk carries all the text its
    tokens complete (none held back unless the tokens so far end inside a character, or, with stop strings,
    in what may begin one), and the chunks add up to the terminal event's text."""
    sampling = SamplingParams(max_tokens=40, temperature=0.9, ignore_eos=True, stop=stop)
    requests = [generation(sampling, stream=True) for _ in range(3)]
    engine = GenerationEngine(demo_gpt.model, max_batch_size=8, max_context=demo_gpt.manifest.max_context)
    chunked = FlushPolicy(max_tokens=3, max_delay_s=60.0, first_token_alone=True)
    out = run(generation_runner(demo_gpt, engine, max_running=8, max_waiting=8, flush=chunked), requests)
    tokenizer = demo_gpt.tokenizer
    compared = 0
    for request in requests:
        chunks = [c for c in out.chunks if c.request_id == request.request_id]
        assert [c.seq for c in chunks] == list(range(len(chunks)))
        ids: list[int] = []
        text = ""
        for chunk in chunks:
            assert chunk.offset == len(ids)
            ids += chunk.token_ids
            text += chunk.text
            so_far = str(tokenizer.decode(ids, skip_special_tokens=True))
            assert so_far.startswith(text)
            may_begin_a_stop = any(so_far.endswith(s[:n]) for s in stop for n in range(1, len(s)))
            if chunk.finish_reason is None and not so_far.endswith("\ufffd") and not may_begin_a_stop:
                assert text == so_far, "a chunk's text was held back"
                compared += 1
        sizes = [len(c.token_ids) for c in chunks]
        if sizes[-1] == 0:  # the text held back at the end (it might have begun a stop string) goes last
            assert stop
            assert chunks[-1].text
            sizes.pop()
        assert sizes == [1] + [3] * 13, "the first token alone, then 3 a chunk"
        assert (
            text == out.finished[request.request_id].text == tokenizer.decode(ids, skip_special_tokens=True)
        )
    assert compared >= 10


@pytest.mark.parametrize("span", [(6, 14), (0, 5), (3, 4)], ids=["mid-text", "from-the-start", "one-char"])
def test_a_stop_string_spanning_tokens_never_shows_in_the_stream(
    gpt_runner: GenerationRunner, demo_gpt: LoadedModel, span: tuple[int, int]
) -> None:
    """Found by an audit: each token's text went to the stream as it was decoded, and a stop string was cut
    only from the token that completed it: the tokens before it leaked their part ("The lock keeper" streamed
    where the whole answer was "The lock "). The stream now holds back what may begin a stop string, and
    its text is the whole answer's, token for token."""
    sampling = SamplingParams(max_tokens=24, temperature=0.8, ignore_eos=True, seed=7)
    plain = run(gpt_runner, [generation(sampling)]).finished
    text = next(iter(plain.values())).text or ""
    stop = text[span[0] : span[1]]
    assert len(stop) == span[1] - span[0], text
    tokenizer = demo_gpt.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    with_stop = msgspec.structs.replace(sampling, stop=(stop,))
    whole, streamed = generation(with_stop), generation(with_stop, stream=True)
    out = run(gpt_runner, [whole, streamed])
    expected = text[: text.find(stop)]
    assert out.finished[whole.request_id].text == expected
    chunks = "".join(c.text for c in out.chunks if c.request_id == streamed.request_id)
    assert chunks == expected == out.finished[streamed.request_id].text


CHAT_PROMPT = "<|system|>\nYou answer briefly.\n<|user|>\nWhy is the harbour important?\n<|assistant|>\n"
CHAT_SEED = 10
"""At demo-gpt's own sampling, this seed's answer goes on into a ``<|user|>`` turn of the model's making (4
of 60 seeds did, a review, 2026-12-03)."""


@pytest.mark.parametrize("stop", [(), ("<|user|>",)], ids=["no-stop", "client-stop-on-role"])
def test_a_chat_answer_ends_where_the_model_begins_another_turn(
    demo_gpt: LoadedModel, stop: tuple[str, ...]
) -> None:
    """The role tokens are special, so decoding drops them: the client read a made-up user question as the
    assistant's reply, with ``finish_reason: stop`` and nothing to cut it at (a client's ``<|user|>`` stop
    string never matched, as the text never holds a special token). Now a chat answer ends at a role token
    as at the end token, which is left out of its tokens, text and usage. A completion of the same prompt
    goes on: raw text may be a whole dialogue."""
    tokenizer = demo_gpt.tokenizer
    roles = {tokenizer.convert_tokens_to_ids(t) for t in ROLE_TOKENS}
    assert demo_gpt.manifest.chat.end_of_turn_ids == tuple(sorted(roles))
    sampling = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, top_k=50, seed=CHAT_SEED, stop=stop)
    ids = tokenizer(CHAT_PROMPT).input_ids
    chat = generation(sampling, input_ids=ids, chat=True, stream=True)
    completion = generation(sampling, input_ids=ids, stream=True)
    engine = GenerationEngine(demo_gpt.model, max_batch_size=2, max_context=demo_gpt.manifest.max_context)
    out = run(generation_runner(demo_gpt, engine, max_running=2, max_waiting=2), [chat, completion])
    tokens = {
        r.request_id: [t for c in out.chunks if c.request_id == r.request_id for t in c.token_ids]
        for r in (chat, completion)
    }
    went_on = tokens[completion.request_id]
    turn = next(i for i, t in enumerate(went_on) if t in roles)
    assert turn < len(went_on) - 1, "the completion goes on past the role token"
    assert tokens[chat.request_id] == went_on[:turn]
    result = out.finished[chat.request_id]
    answer = str(tokenizer.decode(went_on[:turn], skip_special_tokens=True))
    assert (result.finish_reason, result.text, result.usage.completion_tokens) == ("stop", answer, turn)
    assert "".join(c.text for c in out.chunks if c.request_id == chat.request_id) == answer


def test_generation_terminal_events(gpt_runner: GenerationRunner) -> None:
    context = gpt_runner._manifest.max_context  # demo-gpt's 512, within the runner's budget
    common = {"traceparent": TRACEPARENT, "shadow_of": uuid7(), "idempotency_key": "k"}
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    completed = generation(greedy, **common)
    expired = generation(greedy, deadline=utc_now() - timedelta(seconds=1), **common)
    no_room = generation(greedy, input_ids=[1] * context, **common)
    empty = generation(greedy, input_ids=[], **common)  # the edge refuses one; another producer may not
    wrong_kind = embedding(**common)
    began = utc_now()
    done = run(gpt_runner, [completed, expired, no_room, empty, wrong_kind]).finished
    for request in (completed, expired, no_room, empty, wrong_kind):
        assert_envelope(done[request.request_id], request)

    result = done[completed.request_id]
    assert (result.status, result.finish_reason, result.error) == ("completed", "length", None)
    assert result.usage == Usage(prompt_tokens=6, completion_tokens=6, total_tokens=12)
    assert result.text
    assert result.vectors() is None
    assert result.timings.accepted == completed.time
    assert result.timings.started
    assert result.timings.first_token
    assert result.timings.finished
    assert began <= result.timings.started <= result.timings.first_token <= result.timings.finished
    assert result.max_inter_token_s is not None
    assert result.features is not None

    result = done[expired.request_id]
    assert (result.status, result.finish_reason, result.error, result.text) == (
        "expired",
        "deadline",
        None,
        None,
    )
    assert result.usage == Usage(prompt_tokens=6, completion_tokens=0, total_tokens=6)
    assert (result.timings.accepted, result.timings.started, result.timings.first_token) == (
        expired.time,
        None,
        None,
    )
    assert result.timings.finished is not None
    assert (result.max_inter_token_s, result.features) == (None, None)

    for request, error in (
        (
            no_room,
            ErrorInfo(
                code="context_length_exceeded",
                message=f"the prompt ({context} tokens) leaves no room for a completion: this worker runs at "
                f"most {context} tokens of prompt and completion together",
            ),
        ),
        (empty, ErrorInfo(code="invalid_request", message="the prompt is empty")),
        (
            wrong_kind,
            ErrorInfo(
                code="wrong_model_kind", message="all-minilm-l6-v2 serves generation, not EmbeddingRequested"
            ),
        ),
    ):
        result = done[request.request_id]
        assert (result.status, result.finish_reason, result.usage) == ("failed", "error", NO_USAGE)
        assert result.error == error
        assert (result.text, result.vectors(), result.timings) == (None, None, Timings())
        assert (result.max_inter_token_s, result.features) == (None, None)


def test_a_cancelled_generation_ends_cancelled(gpt_runner: GenerationRunner) -> None:
    request = generation(SamplingParams(max_tokens=6), traceparent=TRACEPARENT)
    out = Collected()
    gpt_runner.accept(Arrival(request, ("requests", 0), 0), out)
    gpt_runner.cancel(request.request_id, out)
    result = out.finished[request.request_id]
    assert_envelope(result, request)
    assert (result.status, result.finish_reason, result.text, result.error) == (
        "cancelled",
        "cancelled",
        None,
        None,
    )
    assert result.usage == Usage(prompt_tokens=6, completion_tokens=0, total_tokens=6)
    assert (result.timings.accepted, result.timings.started) == (request.time, None)


def test_embedding_terminal_events(minilm_runner: EmbeddingRunner) -> None:
    common = {"traceparent": TRACEPARENT, "shadow_of": uuid7(), "idempotency_key": "k"}
    completed = embedding(**common)
    expired = embedding(deadline=utc_now() - timedelta(seconds=1), **common)
    empty = embedding(inputs=[], **common)
    wrong_kind = generation(SamplingParams(), **common)
    done = run(minilm_runner, [completed, expired, empty, wrong_kind]).finished
    for request in (completed, expired, empty, wrong_kind):
        assert_envelope(done[request.request_id], request)

    result = done[completed.request_id]
    assert (result.status, result.finish_reason, result.error, result.text) == (
        "completed",
        "stop",
        None,
        None,
    )
    assert result.usage == Usage(prompt_tokens=7, completion_tokens=0, total_tokens=7)
    assert result.embeddings is None, "vectors are packed, not JSON floats"
    vectors = result.vectors()
    assert vectors is not None
    assert len(vectors) == 2
    assert all(len(v) == 384 for v in vectors)
    assert abs(sum(x * x for x in vectors[0]) - 1.0) < 1e-4
    assert result.timings.accepted == completed.time
    assert result.timings.started
    assert result.timings.first_token
    assert result.timings.finished
    assert (result.max_inter_token_s, result.features) == (None, None)

    result = done[expired.request_id]
    assert (result.status, result.finish_reason, result.usage) == ("expired", "deadline", NO_USAGE)
    assert (result.vectors(), result.error) == (None, None)
    assert (result.timings.accepted, result.timings.started, result.timings.first_token) == (
        expired.time,
        None,
        None,
    )
    assert result.timings.finished is not None

    for request, error in (
        (empty, ErrorInfo(code="invalid_input", message="no inputs")),
        (
            wrong_kind,
            ErrorInfo(code="wrong_model_kind", message="demo-gpt serves embeddings, not GenerationRequested"),
        ),
    ):
        result = done[request.request_id]
        assert (result.status, result.finish_reason, result.usage, result.error) == (
            "failed",
            "error",
            NO_USAGE,
            error,
        )
        assert (result.text, result.vectors(), result.timings) == (None, None, Timings())


def test_a_cancelled_embedding_ends_cancelled(minilm_runner: EmbeddingRunner) -> None:
    request = embedding(traceparent=TRACEPARENT)
    out = Collected()
    minilm_runner.accept(Arrival(request, ("requests", 0), 0), out)
    minilm_runner.cancel(request.request_id, out)
    result = out.finished[request.request_id]
    assert_envelope(result, request)
    assert (result.status, result.finish_reason, result.usage) == ("cancelled", "cancelled", NO_USAGE)
    assert (result.vectors(), result.error, result.timings.started) == (None, None, None)


# --- fairness between tenants -------------------------------------------------------------------------------


def test_a_flooding_tenant_waits_its_turn_and_pays_for_the_full_queue(demo_gpt: LoadedModel) -> None:
    """The runner hands the scheduler each request's tenant and charges every token it produces: a light
    tenant runs next after the flood's running request, and a full queue refuses the flood's requests."""
    engine = GenerationEngine(demo_gpt.model, max_batch_size=1, max_context=demo_gpt.manifest.max_context)
    runner = generation_runner(demo_gpt, engine, max_running=1, max_waiting=3)
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    flood = [generation(long, tenant="flood") for _ in range(4)]
    light = generation(SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), tenant="light")
    done = run(runner, [*flood, light]).finished
    refused, shed = done[flood[3].request_id], done[flood[2].request_id]
    assert refused.error is not None
    assert refused.error.code == "queue_full"  # the flood already held the whole queue
    assert shed.error is not None
    assert shed.error.code == "queue_full"  # pushed out to make room for the light tenant
    assert refused.error.retriable, "a full queue is worth a retry: 503, not 500"
    assert shed.error.retriable
    assert "'flood' held the most of it" in shed.error.message
    first, second, quick = done[flood[0].request_id], done[flood[1].request_id], done[light.request_id]
    assert (first.status, second.status, quick.status) == ("completed", "completed", "completed")
    assert first.timings.finished is not None
    assert quick.timings.started is not None
    assert quick.timings.finished is not None
    assert second.timings.started is not None
    assert first.timings.finished <= quick.timings.started  # the light tenant took the first free slot
    assert quick.timings.finished <= second.timings.started


def test_a_request_past_the_models_output_limit_ends_at_it(demo_gpt: LoadedModel) -> None:
    """The worker holds a request to its manifest's ``max_output_tokens`` whatever its event asks: an edge
    whose catalogue still holds a version's earlier manifest, or another producer, may ask for more. The
    answer ends with finish_reason ``length`` at the limit, billed for what it produced."""
    limited = dataclasses.replace(
        demo_gpt, manifest=msgspec.structs.replace(demo_gpt.manifest, max_output_tokens=3)
    )
    engine = GenerationEngine(limited.model, max_batch_size=1, max_context=limited.manifest.max_context)
    runner = generation_runner(limited, engine, max_running=1, max_waiting=1)
    event = generation(SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    result = run(runner, [event]).finished[event.request_id]
    assert (result.status, result.finish_reason, result.usage.completion_tokens) == ("completed", "length", 3)


def two_streamed(
    lm: LoadedModel, first: SamplingParams, second: SamplingParams
) -> tuple[GenerationEngine, GenerationRunner, Collected, RequestFinished, tuple[GenerationRequested, ...]]:
    """A fresh runner of demo-gpt with two streamed requests in one batch, three tokens in, and the first
    one's terminal event as it ends alone."""
    engine = GenerationEngine(lm.model, max_batch_size=4, max_context=lm.manifest.max_context)
    runner = generation_runner(lm, engine, max_running=4, max_waiting=8)
    alone = next(iter(run(runner, [generation(first)]).finished.values()))
    requests = generation(first, stream=True), generation(second, stream=True)
    out = Collected()
    for offset, request in enumerate(requests):
        runner.accept(Arrival(request, ("requests", 0), offset), out)
    for _ in range(3):
        runner.tick(out)
    return engine, runner, out, alone, requests


def test_a_generation_whose_scores_turn_nan_fails_alone_and_the_worker_serves_on(
    demo_gpt: LoadedModel,
) -> None:
    """One streamed request's next-token scores turn NaN mid-way: it ends ``failed`` with ``engine_error``
    (once, its tokens so far streamed, no made-up token after them, no NaN in its drift features), its
    batch-mate completes as it would alone, and the runner serves the next request."""
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=12, temperature=0.8, seed=3, ignore_eos=True)
    engine, runner, out, alone, (mate, bad) = two_streamed(demo_gpt, sampled, greedy)
    poison_row(engine, bad.request_id)
    runner.tick(out)
    for _ in range(200):
        if len(out.finished) == 2:
            break
        runner.tick(out)
    failed = out.finished[bad.request_id]
    assert (failed.status, failed.finish_reason) == ("failed", "error")
    assert failed.error == ErrorInfo(
        code="engine_error", message="the model's next-token scores for this request hold NaN or inf"
    )
    streamed = [t for c in out.chunks if c.request_id == bad.request_id for t in c.token_ids]
    assert failed.usage.completion_tokens == len(streamed) == 3, "the tokens before the NaN, none after"
    assert failed.features is not None
    assert math.isfinite(failed.features.mean_logprob or 0.0), "the NaN step is not scored"
    done = out.finished[mate.request_id]
    assert (done.status, done.text) == ("completed", alone.text)
    after = run(runner, [generation(greedy)]).finished
    assert next(iter(after.values())).status == "completed"


def test_a_running_generation_given_back_ends_nowhere_and_its_batch_mate_goes_on(
    demo_gpt: LoadedModel,
) -> None:
    """``release(running=True)`` (a retiring version cutting what it could not finish in time): the running
    request leaves the engine and the scheduler without a terminal event or another chunk, and its
    batch-mate completes as it would alone; without ``running`` a started request stays."""
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    engine, runner, out, alone, (mate, cut) = two_streamed(demo_gpt, greedy, greedy)
    assert runner.release([cut.request_id]) == set(), "started: not given back without running=True"
    assert runner.release([cut.request_id], running=True) == {cut.request_id}
    chunks = len([c for c in out.chunks if c.request_id == cut.request_id])
    assert engine.running == 1
    for _ in range(100):
        if mate.request_id in out.finished:
            break
        runner.tick(out)
    assert out.finished[mate.request_id].text == alone.text
    assert cut.request_id not in out.finished
    assert len([c for c in out.chunks if c.request_id == cut.request_id]) == chunks
    assert runner.load().running == 0
    assert runner.release([cut.request_id], running=True) == set()


def test_what_is_held_back_is_the_longest_end_that_begins_a_stop_string() -> None:
    """``_held`` tries only the beginnings that end with the text's last character; against trying every
    length, on random texts and stop strings of two letters (and a third only the text has)."""
    from types import SimpleNamespace

    from gpu_workers.generation import _held

    def every_length(text: str, sent: int, stops: tuple[str, ...]) -> int:
        for size in range(min(len(text) - sent, max(map(len, stops)) - 1), 0, -1):
            if any(len(s) > size and s.startswith(text[len(text) - size :]) for s in stops):
                return size
        return 0

    rng = random.Random(11)
    for _ in range(5000):
        stops = tuple(
            "".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))
        )
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 10)))
        sent = rng.randint(0, len(text))
        live = SimpleNamespace(sent=sent, event=SimpleNamespace(sampling=SimpleNamespace(stop=stops)))
        assert _held(text, live) == every_length(text, sent, stops), (text, sent, stops)  # type: ignore[arg-type]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_earliest_stop_string_in_the_text_ends_it_whatever_their_order(
    gpt_runner: GenerationRunner, stream: bool
) -> None:
    """Found by an audit: when one token completed two stop strings, the text was cut at the first one
    listed, not the earliest in the text: ``stop=("s", "w")`` gave " wait", which holds "w", and the order
    of the list changed the answer."""
    # Greedy, or seeded sampling (the same tokens every run) where a model's greedy text is one character
    # over and over (demo-gpt as an H200 trained it: twelve newlines).
    for sampling in [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        *(SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True) for seed in range(8)),
    ]:
        text = next(iter(run(gpt_runner, [generation(sampling)]).finished.values())).text or ""
        chars = sorted(set(text))
        pairs = [(a, b) for a in chars for b in chars if a != b and a.strip() and b.strip()]
        if pairs:
            break
    assert pairs, text
    for first, second in pairs[:6]:
        expected = text[: min(text.find(first), text.find(second))]
        for stop in ((first, second), (second, first)):
            request = generation(msgspec.structs.replace(sampling, stop=stop), stream=stream)
            out = run(gpt_runner, [request])
            assert out.finished[request.request_id].text == expected, (text, stop)
            if stream:
                assert "".join(c.text for c in out.chunks if c.request_id == request.request_id) == expected
