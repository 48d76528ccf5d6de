"""The model runtime on a GPU: a CUDA smoke test, then the worker's engines against the raw model, in process.

What a worker's model thread does, without Kafka or the edge: the generation engine (continuous batching)
and the embedding engine on the device, against plain batched ``model.generate`` and the bare forward.

Smoke checks (the run exits 1 if one fails):

- both models load on the device through the normal path (manifest checked, ``from_pretrained``);
- greedy tokens on the device equal the CPU's (a tiny model's near-ties may flip; the agreement is shown);
- the engine's greedy tokens under churn (requests join and finish at staggered steps) equal ``generate``
  alone for each request, on the device: as a worker builds it (on a GPU the fixed KV ring, its decode
  captured as CUDA graphs) and with the growing cache;
- a seeded sampled request gives the same tokens alone and in a batch, on the device;
- embeddings on the device equal the CPU's (cosine);
- the embedding forward replayed as CUDA graphs (one per batch shape bucket) equals the eager one.

Then tokens/s of the engine (as a worker builds it, and with the growing cache) and of ``generate`` per
batch size, the prefill-to-first-token time of one
request, MiniLM embeddings/s per batch (CUDA graphs, as a worker runs it, and eager), and the worker's own runners (built as ``sluice worker`` builds
them: batching, scheduling, terminal events; no Kafka) against the engines at 64 and 256, streamed
generation too, the embedding runner with and without overlap; and the generation runner's host time per token
around an engine that costs nothing (what is left to the host when the device's decode is a graph replay). Each cell is the median of ``--repeats`` measurements. One table, one JSON (``--out``).

    python benchmarks/gpu.py                          # on CUDA; fails clearly without it
    python benchmarks/gpu.py --device cpu --quick     # the same on the CPU (gpu-cpu.json): CI runs it so it cannot rot
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
from loadgen import EMBED_TEXTS, embed_text

from gpu_workers.embedding import EmbeddingEngine, graph_shape
from gpu_workers.embedding_runner import EmbeddingRunner
from gpu_workers.engine import (
    GenerationEngine,
    SeqRequest,
    StepOutput,
    engine_throughput,
    padded_generate,
    raw_generate_throughput,
)
from gpu_workers.main import generation_runner, runner_factory
from gpu_workers.models import (
    LoadedModel,
    load_embedding_model,
    load_generation_model,
    memory_bytes,
    prepare_models,
)
from gpu_workers.runtime import Arrival, Request, Runner
from gpu_workers.settings import WorkerSettings
from monitoring.runtime import tune_gc
from schemas.events import (
    EmbeddingRequested,
    GenerationRequested,
    RequestFinished,
    SamplingParams,
    TokenChunk,
)
from schemas.ids import uuid7
from schemas.manifest import current_model_dir
from schemas.settings import PlatformSettings, load_settings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

RESULTS = Path(__file__).parent / "results" / "gpu.json"
CPU_RESULTS = RESULTS.with_name("gpu-cpu.json")
PROMPTS = [
    "Tell me about the river and the stone wall.",
    "Hello",
    "The sluice gate opens at dawn and the water",
    "Write a short story about a miller who",
    "Why is the sky",
    "A list of the things a river carries: stones, sand,",
    "Once",
    "The old wall by the river was built",
]


@dataclass
class Check:
    check: str
    ok: bool
    detail: str


def greedy_on(
    model: PreTrainedModel, prompts: list[list[int]], budgets: list[int], ends: frozenset[int]
) -> list[list[int]]:
    """Each prompt generated alone (no padding), greedy, up to its budget or through its first end token."""
    out = [padded_generate(model, [p], n)[0] for p, n in zip(prompts, budgets, strict=True)]
    return [tokens[: next((i + 1 for i, t in enumerate(tokens) if t in ends), len(tokens))] for tokens in out]


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """Identical sequences, and the fraction of tokens before each pair's first difference."""
    same = sum(x == y for x, y in zip(a, b, strict=True))
    prefix = 0
    for x, y in zip(a, b, strict=True):
        prefix += next((i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y)))
    return same, prefix / max(1, sum(len(x) for x in a))


def engine_under_churn(
    gen: LoadedModel, prompts: list[list[int]], budgets: list[int], static_cache: bool | None
) -> tuple[dict[str, list[int]], GenerationEngine]:
    """A closed loop at 4 slots: whenever a sequence ends the next request joins its free row."""
    stop = gen.manifest.end_token_ids
    engine = GenerationEngine(
        gen.model, max_batch_size=4, max_context=gen.manifest.max_context, static_cache=static_cache
    )

    def add(i: int) -> None:
        engine.add(
            SeqRequest(
                request_id=str(i), input_ids=prompts[i], max_new_tokens=budgets[i], stop_token_ids=stop
            )
        )

    queue = iter(range(len(prompts)))
    for i in [next(queue) for _ in range(4)]:
        add(i)
    seen: dict[str, list[int]] = {}
    while engine.has_work():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out.token_id)
            if out.finish_reason is not None and (nxt := next(queue, None)) is not None:
                add(nxt)
    return seen, engine


def sampled(gen: LoadedModel, prompt: list[int], company: list[list[int]]) -> list[int]:
    """A seeded sampled request's tokens, run with ``company`` (greedy requests) in the batch."""
    engine = GenerationEngine(gen.model, max_batch_size=8, max_context=gen.manifest.max_context)
    engine.add(
        SeqRequest(request_id="s", input_ids=prompt, max_new_tokens=24, temperature=0.9, top_p=0.9, seed=7)
    )
    for i, other in enumerate(company):
        engine.add(SeqRequest(request_id=f"g{i}", input_ids=other, max_new_tokens=16 + i))
    tokens: list[int] = []
    while engine.has_work():
        tokens += [o.token_id for o in engine.step() if o.request_id == "s"]
    return tokens


def smoke(
    gen: LoadedModel, emb: LoadedModel, cpu_gen: LoadedModel, cpu_emb: LoadedModel, texts: list[list[int]]
) -> list[Check]:
    checks = [
        Check(
            "models load on the device",
            gen.device.type == emb.device.type,
            f"{gen.device} / {emb.device}; {memory_bytes(gen) / 2**20:.1f} + {memory_bytes(emb) / 2**20:.1f} MiB",
        )
    ]
    prompts = [list(gen.tokenizer(p)["input_ids"]) for p in PROMPTS]
    on_gpu = gen.device.type == "cuda"
    ends = gen.manifest.end_token_ids
    flat = [32] * len(prompts)
    here, there = greedy_on(gen.model, prompts, flat, ends), greedy_on(cpu_gen.model, prompts, flat, ends)
    same, prefix = agreement(here, there)
    checks.append(
        Check(
            "greedy tokens equal the CPU's",
            prefix >= 0.9,
            f"{same}/{len(prompts)} sequences identical, {prefix:.1%} of tokens before a first difference",
        )
    )
    budgets = [40, 3, 9, 5, 12, 4, 7, 30]
    alone = {str(i): tokens for i, tokens in enumerate(greedy_on(gen.model, prompts, budgets, ends))}
    for static_cache in (None, not on_gpu):  # as a worker builds it (the ring and graphs on a GPU), the other
        churn, engine = engine_under_churn(gen, prompts, budgets, static_cache)
        equal = sum(churn[k] == v for k, v in alone.items())
        checks.append(
            Check(
                "engine under churn equals generate alone"
                + (" (as a worker builds it)" if static_cache is None else " (the other KV cache)"),
                equal == len(alone) and (engine.graphs > 0) == (on_gpu and engine.static_cache),
                f"{equal}/{len(alone)} requests token-identical; {'ring' if engine.static_cache else 'growing'}"
                f" cache, {engine.graphs} decode graphs",
            )
        )
    first = sampled(gen, prompts[0], [])
    again = sampled(gen, prompts[0], prompts[1:6])
    checks.append(
        Check(
            "seeded sampling is the same alone and in a batch",
            first == again and len(first) > 0,
            f"{len(first)} tokens alone, {len(again)} in a batch of 6, {'equal' if first == again else 'DIFFERENT'}",
        )
    )
    here_v = EmbeddingEngine(emb.model).embed(texts)
    there_v = EmbeddingEngine(cpu_emb.model).embed(texts)
    cosine = float(np.min(np.sum(here_v * there_v, axis=1)))
    norm = float(np.max(np.abs(np.linalg.norm(here_v, axis=1) - 1)))
    checks.append(
        Check(
            "embeddings equal the CPU's",
            cosine >= 0.9999 and norm < 1e-4,
            f"{len(texts)} texts: min cosine {cosine:.6f}, max |norm - 1| {norm:.1e}",
        )
    )
    graphed, eager = EmbeddingEngine(emb.model), EmbeddingEngine(emb.model, cuda_graphs=False)
    mixed = [texts[i][: 2 + i % 9] + texts[i][-1:] for i in range(37)]  # 3 to 11 ids, [SEP] last
    batches = (texts[:1], texts[:5], mixed, texts[:256], mixed[:3], mixed[3:7])  # the last two: one bucket
    pairs = [(graphed.embed(b), eager.embed(b)) for b in batches]
    buckets = len({graph_shape(len(b), max(map(len, b))) for b in batches}) if graphed.overlaps else 0
    cosine = min(float(np.min(np.sum(g * e, axis=1))) for g, e in pairs)
    diff = max(float(np.max(np.abs(g - e))) for g, e in pairs)
    checks.append(
        Check(
            "CUDA graphs equal the eager forward",
            cosine >= 0.99999 and diff < 1e-4 and graphed.graphs == buckets,
            f"{len(batches)} batches (1 to 256, mixed lengths), {graphed.graphs} graphs: min cosine {cosine:.6f},"
            f" max |diff| {diff:.1e}",
        )
    )
    return checks


def median_rate(repeats: int, measure: Callable[[], float]) -> float:
    """The median of ``repeats`` measurements: a cell is short and launch-bound, and one slow moment of the
    host moves a lone measurement by a third."""
    return statistics.median(measure() for _ in range(repeats))


def generation_bench(
    gen: LoadedModel, batches: list[int], new_tokens: int, rounds: int, repeats: int
) -> dict[str, dict[str, float]]:
    prompt = list(gen.tokenizer(PROMPTS[0])["input_ids"])
    rows: dict[str, dict[str, float]] = {}
    for batch in batches:
        # untimed first: each batch size's shapes pick their kernels on first use
        raw_generate_throughput(gen.model, [prompt] * batch, 8, batch)
        engine_throughput(gen.model, [prompt] * batch, 8, batch)
        engine_throughput(gen.model, [prompt] * batch, 8, batch, static_cache=False)
        prompts = [prompt] * (batch * rounds)
        raw = median_rate(repeats, partial(raw_generate_throughput, gen.model, prompts, new_tokens, batch))
        engine = median_rate(repeats, partial(engine_throughput, gen.model, prompts, new_tokens, batch))
        growing = median_rate(
            repeats, partial(engine_throughput, gen.model, prompts, new_tokens, batch, static_cache=False)
        )
        rows[str(batch)] = {
            "raw_tok_s": raw,
            "engine_tok_s": engine,
            "engine_over_raw": engine / raw,
            "growing_cache_tok_s": growing,
            "growing_over_raw": growing / raw,
        }
        print(
            f"  generation batch {batch}: generate {raw:,.0f} tok/s, engine {engine:,.0f} tok/s"
            f" (growing cache, eager: {growing:,.0f})",
            flush=True,
        )
    return rows


def ttft(gen: LoadedModel, samples: int) -> dict[str, float]:
    ids = torch.tensor([list(gen.tokenizer(PROMPTS[0])["input_ids"])], device=gen.device)
    took: list[float] = []
    with torch.inference_mode():
        for _ in range(samples + 5):
            started = time.perf_counter()
            int(gen.model(input_ids=ids).logits[0, -1].argmax())
            took.append((time.perf_counter() - started) * 1000)
    took = sorted(took[5:])
    return {"p50": statistics.median(took), "p99": took[min(len(took) - 1, math.ceil(0.99 * len(took)) - 1)]}


def embedding_bench(
    emb: LoadedModel, texts: list[list[int]], batches: list[int], items: int, repeats: int
) -> dict[str, dict[str, float]]:
    """MiniLM embeddings/s per batch: the engine as a worker builds it (CUDA graphs on a GPU) and eager."""
    engines = {"engine": EmbeddingEngine(emb.model), "eager": EmbeddingEngine(emb.model, cuda_graphs=False)}
    rates: dict[str, dict[str, float]] = {}
    for batch in batches:
        row: dict[str, float] = {}
        for label, engine in engines.items():
            engine.embed([texts[i % len(texts)] for i in range(batch)])  # untimed: kernels, graph capture
            rounds = max(3, items // batch)

            def measure(engine: EmbeddingEngine = engine, batch: int = batch, rounds: int = rounds) -> float:
                started = time.perf_counter()
                for r in range(rounds):
                    first = (r * batch) % len(texts)
                    engine.embed([texts[(first + i) % len(texts)] for i in range(batch)])
                return rounds * batch / (time.perf_counter() - started)

            row[f"{label}_per_s"] = median_rate(repeats, measure)
        rates[str(batch)] = row
        print(
            f"  embeddings batch {batch}: {row['engine_per_s']:,.0f}/s ({row['eager_per_s']:,.0f}/s eager)",
            flush=True,
        )
    return rates


class Counting:
    """The emitter the runner reports to: counts what a worker would publish."""

    def __init__(self) -> None:
        self.finished = 0
        self.tokens = 0
        self.items = 0

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        pass

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        if result.status != "completed":
            raise RuntimeError(f"{result.request_id} ended {result.status}: {result.error}")
        self.finished += 1
        self.tokens += result.usage.completion_tokens
        packed = result.packed_vectors()  # not vectors(): that makes Python floats of every one
        self.items += len(packed.data) // (4 * packed.dim) if packed is not None else 0

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


def through_runner(runner: Runner, requests: list[Request], in_flight: int) -> tuple[float, Counting]:
    """Seconds to finish ``requests`` with at most ``in_flight`` accepted and unfinished (a closed loop of
    clients in front of the worker's inbox), and what was emitted."""
    out = Counting()
    accepted = 0
    started = time.perf_counter()
    while out.finished < len(requests):
        while accepted < len(requests) and accepted - out.finished < in_flight:
            runner.accept(Arrival(requests[accepted], ("requests", 0), accepted), out)
            accepted += 1
        runner.tick(out)
    return time.perf_counter() - started, out


def generations(n: int, prompt: list[int], sampling: SamplingParams, stream: bool) -> list[Request]:
    """``n`` generation requests of ``prompt`` for the worker's runner."""
    return [
        GenerationRequested(
            tenant="bench",
            model="demo-gpt",
            request_id=uuid7(),
            source="benchmarks/gpu",
            model_version="v",
            input_ids=prompt,
            sampling=sampling,
            stream=stream,
        )
        for _ in range(n)
    ]


def runner_bench(
    device: str,
    gen_dir: Path,
    emb_dir: Path,
    prompt: list[int],
    texts: list[list[int]],
    batch: int,
    new_tokens: int,
    repeats: int,
) -> dict[str, float]:
    """The worker's own runners (built as ``sluice worker`` builds them: batching, scheduling, terminal
    events; no Kafka) at ``batch``, against the engines alone on the same work."""
    worker = load_settings(WorkerSettings)
    worker = msgspec.structs.replace(
        worker,
        worker_device=device,
        worker_max_running=batch,
        worker_embed_max_batch=batch,
        worker_max_waiting=4 * batch,
    )
    gen_runner = runner_factory(gen_dir, worker, "benchmarks/gpu", "bench-gen")()
    sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)

    def gen_rate(stream: bool) -> float:
        took, out = through_runner(gen_runner, generations(4 * batch, prompt, sampling, stream), 2 * batch)
        return out.tokens / took

    rates: dict[bool, float] = {}
    for stream in (False, True):  # streamed: coalesced into chunks, each chunk's text decoded at once
        through_runner(gen_runner, generations(batch, prompt, sampling, stream), 2 * batch)  # warm-up
        rates[stream] = median_rate(repeats, partial(gen_rate, stream))

    emb_runner = runner_factory(emb_dir, worker, "benchmarks/gpu", "bench-emb")()

    def emb_requests(n: int) -> list[Request]:
        return [
            EmbeddingRequested(
                tenant="bench",
                model="all-minilm-l6-v2",
                request_id=uuid7(),
                source="benchmarks/gpu",
                model_version="v",
                inputs=[texts[i % len(texts)]],
            )
            for i in range(n)
        ]

    def emb_rate() -> float:
        took, out = through_runner(emb_runner, emb_requests(max(16, 16 * batch)), 2 * batch)
        return out.items / took

    assert isinstance(emb_runner, EmbeddingRunner)
    overlaps = emb_runner.overlap  # the default: on where the engine returns before the device finishes
    through_runner(emb_runner, emb_requests(batch), 2 * batch)  # warm-up
    runner_eps: dict[bool, float] = {}
    for overlap in (False, True):  # each batch's requests finished after the next is launched, or not
        emb_runner.overlap = overlap
        runner_eps[overlap] = median_rate(repeats, emb_rate)
    return {
        "batch": batch,
        "generation_tok_s": rates[False],
        "generation_streamed_tok_s": rates[True],
        "embeddings_per_s": runner_eps[overlaps],
        "embeddings_serial_per_s": runner_eps[False],
        "embeddings_overlapped_per_s": runner_eps[True],
    }


class InstantEngine(GenerationEngine):
    """A generation engine whose steps cost nothing: each running sequence's next token is the next of
    ``text`` (real text's tokens, cycled; a decoder fed arbitrary ids, e.g. GPT-2's lone UTF-8 bytes, holds
    text back and re-decodes, which real output rarely makes it do). What a runner costs per token on the
    host is then all there is to time: on a GPU, where the KV ring's decode is a graph replay, that host
    time is what stands between the runner and the engine."""

    def __init__(self, gen: LoadedModel, text: list[int], max_batch_size: int) -> None:
        super().__init__(  # the growing cache, never used: no ring allocated on a GPU
            gen.model, max_batch_size=max_batch_size, max_context=gen.manifest.max_context, static_cache=False
        )
        self._text = text
        self._waiting: list[SeqRequest] = []
        self._live: dict[str, list[int]] = {}  # request id -> [tokens made, max new tokens]

    @property
    def running(self) -> int:
        return len(self._live)

    def has_work(self) -> bool:
        return bool(self._live or self._waiting)

    def add(self, req: SeqRequest) -> None:
        self._waiting.append(req)

    def cancel(self, request_id: str) -> bool:
        return self._live.pop(request_id, None) is not None

    def reset(self, *, keep_waiting: bool = False) -> list[str]:
        dropped = list(self._live)
        self._live.clear()
        if not keep_waiting:
            dropped += [req.request_id for req in self._waiting]
            self._waiting.clear()
        return dropped

    def step(self) -> list[StepOutput]:
        while self._waiting and len(self._live) < self.max_batch_size:
            req = self._waiting.pop(0)
            self._live[req.request_id] = [0, req.max_new_tokens]
        outputs = []
        text = self._text
        for request_id, seq in list(self._live.items()):
            made = seq[0] = seq[0] + 1
            done = made >= seq[1]
            outputs.append(
                StepOutput(request_id, text[made % len(text)], "length" if done else None, -0.5, 2.0)
            )
            if done:
                del self._live[request_id]
        return outputs


def host_cost(gen: LoadedModel, slots: int, new_tokens: int, requests: int, repeats: int) -> dict[str, float]:
    """Microseconds of host time per generated token in the worker's generation runner (built as a worker
    builds it: scheduler, flush policy, detokeniser, terminal events) around :class:`InstantEngine` with
    ``slots`` sequences running: unstreamed (text decoded once at the end), streamed (text decoded once a
    flushed chunk), and streamed with a stop string (text decoded token by token to look for it)."""
    worker = msgspec.structs.replace(
        load_settings(WorkerSettings), worker_max_running=slots, worker_max_waiting=4 * slots
    )
    text = list(gen.tokenizer(" ".join(PROMPTS) * 4)["input_ids"])
    engine = InstantEngine(gen, text, slots)
    runner = generation_runner(engine, gen.tokenizer, gen.manifest, worker, "benchmarks/gpu", "bench-host")
    cases = {
        "unstreamed": (False, ()),
        "streamed": (True, ()),
        "streamed_stop": (True, ("never in this text",)),
    }
    costs: dict[str, float] = {}
    for name, (stream, stop) in cases.items():
        sampling = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True, stop=stop)

        def rate(stream: bool = stream, sampling: SamplingParams = sampling) -> float:
            took, out = through_runner(runner, generations(requests, text[:8], sampling, stream), 2 * slots)
            return out.tokens / took

        through_runner(runner, generations(slots, text[:8], sampling, stream), 2 * slots)  # warm-up
        costs[name] = 1e6 / median_rate(repeats, rate)
    return costs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda", help="torch device to test (default cuda; cpu runs it anywhere)"
    )
    parser.add_argument("--quick", action="store_true", help="small batches and few rounds (CI)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"JSON results (default {RESULTS} on a GPU, {CPU_RESULTS.name} beside it with --device cpu: a "
        "check run on the CPU never replaces a GPU's committed numbers)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measurements per cell, the median kept (default 3; 1 with --quick)",
    )
    args = parser.parse_args()
    if args.repeats is None:
        args.repeats = 1 if args.quick else 3
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(
            f"no CUDA device here (torch {torch.__version__}); run with --device cpu to exercise the script"
        )
        return 2
    settings = load_settings(PlatformSettings)
    gen_dir = current_model_dir(settings.cache_dir, "demo-gpt")
    emb_dir = current_model_dir(settings.cache_dir, "all-minilm-l6-v2")
    if not (gen_dir.exists() and emb_dir.exists()):
        prepare_models(settings, print)  # as `sluice models prepare` does; a prepared cache is reused as is
    started = time.perf_counter()
    gen = load_generation_model(gen_dir, device=args.device)
    emb = load_embedding_model(emb_dir, device=args.device)
    on_cpu = gen.device.type == "cpu"
    # on the CPU the comparisons are with itself: they still run, so the script cannot rot
    cpu_gen = gen if on_cpu else load_generation_model(gen_dir, device="cpu")
    cpu_emb = emb if on_cpu else load_embedding_model(emb_dir, device="cpu")
    print(f"loaded on {gen.device} in {time.perf_counter() - started:.1f} s", flush=True)
    # as a worker does once its model is loaded: without it a full collection over torch's heap cost the
    # embedding runner ~50 us a request at batch 256 (an instant fake engine: 63 against 12.5 us)
    tune_gc()
    texts = [list(emb.tokenizer(embed_text(n))["input_ids"]) for n in range(EMBED_TEXTS)]

    checks = smoke(gen, emb, cpu_gen, cpu_emb, texts)
    for c in checks:
        print(f"  [{'ok' if c.ok else 'FAIL'}] {c.check}: {c.detail}", flush=True)

    batches = [1, 8] if args.quick else [1, 8, 32, 64, 128, 256]
    generation = generation_bench(
        gen, batches, 16 if args.quick else 64, 1 if args.quick else 5, args.repeats
    )
    first_token = ttft(gen, 10 if args.quick else 100)
    emb_batches = [1, 8] if args.quick else [1, 8, 32, 64, 128, 256, 512]
    embeddings = embedding_bench(emb, texts, emb_batches, 16 if args.quick else 1024, args.repeats)

    prompt = list(gen.tokenizer(PROMPTS[0])["input_ids"])
    runners: dict[str, dict[str, float]] = {}
    for size in [8] if args.quick else [64, 256]:
        row = runner_bench(
            args.device, gen_dir, emb_dir, prompt, texts, size, 16 if args.quick else 64, args.repeats
        )
        row["generation_over_generate"] = row["generation_tok_s"] / generation[str(size)]["raw_tok_s"]
        row["streamed_over_generate"] = row["generation_streamed_tok_s"] / generation[str(size)]["raw_tok_s"]
        engine_eps = embeddings[str(size)]["engine_per_s"]
        row["embeddings_over_engine"] = row["embeddings_per_s"] / engine_eps
        row["serial_over_engine"] = row["embeddings_serial_per_s"] / engine_eps
        row["overlapped_over_engine"] = row["embeddings_overlapped_per_s"] / engine_eps
        print(
            f"  runners at {size}: generation {row['generation_over_generate']:.2f}, streamed"
            f" {row['streamed_over_generate']:.2f} of generate; embeddings serial {row['serial_over_engine']:.2f},"
            f" overlapped {row['overlapped_over_engine']:.2f} of the engine",
            flush=True,
        )
        runners[str(size)] = row

    host = host_cost(gen, 256, 64, 256 if args.quick else 1024, args.repeats)

    name = torch.cuda.get_device_name(gen.device) if gen.device.type == "cuda" else "cpu"
    result = {
        "device": str(gen.device),
        "device_name": name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "repeats": args.repeats,
        "smoke": [asdict(c) for c in checks],
        "generation": generation,
        "ttft_ms": first_token,
        "embeddings_per_s": embeddings,
        "runners": runners,
        "runner_host_us_per_token": host,
    }
    print(f"\n{name} ({gen.device}), torch {torch.__version__}")
    print(
        f"{'batch':>6} {'generate tok/s':>15} {'engine tok/s':>13} {'engine/generate':>16}"
        f" {'growing cache':>14} {'growing/generate':>17}"
    )
    for label, row in generation.items():
        print(
            f"{label:>6} {row['raw_tok_s']:>15,.0f} {row['engine_tok_s']:>13,.0f} {row['engine_over_raw']:>16.2f}"
            f" {row['growing_cache_tok_s']:>14,.0f} {row['growing_over_raw']:>17.2f}"
        )
    print("  (the engine as a worker builds it: on a GPU the KV ring, its decode as CUDA graphs)")
    print(
        f"prefill to first token, one request: p50 {first_token['p50']:.2f} ms, p99 {first_token['p99']:.2f} ms"
    )
    print(f"{'batch':>6} {'embeddings/s':>13} {'eager':>9} {'graphs/eager':>13}")
    for label, rates in embeddings.items():
        print(
            f"{label:>6} {rates['engine_per_s']:>13,.0f} {rates['eager_per_s']:>9,.0f}"
            f" {rates['engine_per_s'] / rates['eager_per_s']:>13.2f}"
        )
    print("  (the engine as a worker runs it: CUDA graphs on a GPU, eager on a CPU)")
    print(
        "the worker's runners (batching, scheduling, terminal events; no Kafka), against the engines alone:"
    )
    print(
        f"{'batch':>6} {'generation tok/s':>17} {'streamed tok/s':>15}"
        f" {'embeddings/s serial':>20} {'overlapped':>15}"
    )
    for label, row in runners.items():
        print(
            f"{label:>6} {row['generation_tok_s']:>10,.0f} ({row['generation_over_generate']:.2f})"
            f" {row['generation_streamed_tok_s']:>8,.0f} ({row['streamed_over_generate']:.2f})"
            f" {row['embeddings_serial_per_s']:>13,.0f} ({row['serial_over_engine']:.2f})"
            f" {row['embeddings_overlapped_per_s']:>8,.0f} ({row['overlapped_over_engine']:.2f})"
        )
    print(
        "  (in parentheses: of generate / of the embedding engine alone at that batch; overlapped: each"
        " batch's requests finished while the next runs, the default on a GPU)"
    )
    print(
        "the generation runner's host time a token at 256 slots, its engine instant (all a GPU's graphed"
        " decode leaves to the host):"
    )
    print("  " + "   ".join(f"{case} {us:.2f} us" for case, us in host.items()))
    if args.out is None:
        args.out = CPU_RESULTS if args.device == "cpu" else RESULTS
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    failed = [c.check for c in checks if not c.ok]
    if failed:
        print(f"smoke checks failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
