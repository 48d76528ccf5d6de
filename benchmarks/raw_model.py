"""The raw models in-process, no platform: the baseline ``benchmarks/online.py`` compares against.

Prints one JSON object: generation tokens/s per batch size of plain batched ``model.generate`` and of the
worker's engine alone (the faster is the baseline, like for like), the prefill-to-first-token time of one
request as the worker's engine computes it (and of a plain eager forward), and MiniLM embeddings/s per batch size. Run it alone (it is
started as a child process by online.py so torch has the cores to itself); ``--threads N`` gives torch N
threads (online.py's floor: the model on the threads a worker gets). ``--serve NARROW`` instead keeps
MiniLM and demo-gpt loaded and answers batch-1 reference samples on stdin/stdout (online.py takes them
between blocks of one client's requests: the box drifts within minutes, so what a server adds is measured
against the model run beside it).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from loadgen import EMBED_TEXTS, embed_text

from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.engine import (
    GenerationEngine,
    SeqRequest,
    churn_throughput,
    engine_throughput,
    padded_generate,
    raw_generate_throughput,
    token_stats,
)
from gpu_workers.models import configure_torch_threads, load_embedding_model, load_generation_model
from gpu_workers.step_graphs import positions_of, step_graphs
from schemas.manifest import current_model_dir
from schemas.settings import PlatformSettings, load_settings


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def generation_rounds(quick: bool) -> int:
    """Batches of prompts a generation rate runs at each batch size."""
    return 2 if quick else 4


def embedding_inputs(quick: bool) -> int:
    """Inputs an embedding rate embeds at each batch size (2 batches at least)."""
    return 64 if quick else 256


IDLE_S = 0.005
"""The pause before each call of the batch-1-after-idle measurement: about what one client's request spends
outside the model on the platform (its way in and out)."""


def timed_ms(call: Callable[[int], object], n: int, idle_s: float = 0.0) -> list[float]:
    """The wall time (ms) of ``call(0)`` … ``call(n - 1)``, each after ``idle_s`` of nothing."""
    times: list[float] = []
    for i in range(n):
        if idle_s:
            time.sleep(idle_s)
        started = time.perf_counter()
        call(i)
        times.append((time.perf_counter() - started) * 1000)
    return times


def after_idle(call: Callable[[int], object], n: int) -> dict[str, float]:
    """``call``'s p50 (ms) with ``IDLE_S`` before each: an idle core starts a forward slower than a loop
    that never lets it idle (docs/perf), and one client's requests always meet one."""
    return {"ms": statistics.median(timed_ms(call, n, IDLE_S)), "idle_ms": IDLE_S * 1000}


def generation_rates(model: Any, prompt: list[int], batch: int, tokens: int, rounds: int) -> dict[str, float]:
    """demo-gpt's tokens/s at ``batch`` rows over ``rounds`` batches of ``prompt`` (``tokens`` each, greedy):
    plain batched ``generate`` and the worker's engine alone; the raw figure is the faster (like for like)."""
    prompts = [prompt] * (batch * rounds)
    return {
        "generate": raw_generate_throughput(model, prompts, tokens, batch),
        "engine": engine_throughput(model, prompts, tokens, batch),
    }


def embedding_rate(engine: EmbeddingEngine, texts: list[list[int]], batch: int, rounds: int) -> float:
    """MiniLM's embeddings/s at ``batch`` over ``rounds`` batches of the load's inputs in turn."""
    started = time.perf_counter()
    for r in range(rounds):
        first = (r * batch) % len(texts)
        engine.embed([texts[(first + i) % len(texts)] for i in range(batch)])
    return rounds * batch / (time.perf_counter() - started)


def embedding_rates(
    engine: EmbeddingEngine, texts: list[list[int]], batch: int, inputs: int = 256
) -> dict[str, float]:
    """``embedding_rate`` at ``batch`` over ``inputs`` inputs (2 batches at least), as the floor run takes it."""
    return {"embed": embedding_rate(engine, texts, batch, max(2, inputs // batch))}


def load_texts(tokenizer: Any) -> list[list[int]]:
    """Exactly the load generator's embedding inputs, tokenised: the comparison is like for like."""
    return [list(tokenizer(embed_text(n))["input_ids"]) for n in range(EMBED_TEXTS)]


def rate_for(
    seconds: float, measure: Callable[[], dict[str, float]], *, within: bool = False
) -> dict[str, float]:
    """``measure``'s figures, each the mean of its calls over ``seconds`` at least (one call at least);
    ``within``: over ``seconds`` at most instead (no call started that the last one says would end past
    it), for a sample the platform is stopped for."""
    runs: list[dict[str, float]] = []
    started = time.perf_counter()
    while True:
        began = time.perf_counter()
        runs.append(measure())
        now = time.perf_counter()
        if now - started >= seconds or (within and now - started + (now - began) > seconds):
            return {key: statistics.mean(run[key] for run in runs) for key in runs[0]}


def serve_reference(narrow: int, prompt: str) -> None:
    """``--serve``: the raw models as a reference beside a server's one-client phases. Prints ``ready``, then
    answers each line read from stdin with one JSON line of milliseconds, until end of input:

    - ``N``: MiniLM's batch 1 over the load's inputs in turn, N times in a loop on every core (``wide``, as
      the raw baseline) and on ``narrow`` threads (the worker's): ``{"wide": [...], "narrow": [...]}``;
    - ``gen N T``: demo-gpt's batch 1 of ``prompt`` (the load's), T new tokens, greedy, the faster of
      ``generate`` and the worker's engine alone, as the raw baseline runs it, N times on ``narrow`` threads (the generation worker has no wider team):
      ``{"narrow": [...]}``;
    - ``rate gen S B T quick|full``: the generation floor beside a server's saturation phase, on ``narrow``
      threads as the floor run (``--quick`` or not) measures it (``generation_rates`` at batch B, T new
      tokens), repeated within S seconds (one call at least): ``{"generate": tok/s, "engine": tok/s}``;
    - ``rate churn S B T``: the engine alone at batch B under a serving load's churn (a request joining as
      one ends, T new tokens each; ``churn_throughput``) for S seconds, on ``narrow`` threads:
      ``{"churn": tok/s}``, what continuous batching costs the engine that a static batch does not;
    - ``rate emb S B quick|full``: the embedding floor likewise (``embedding_rates`` at batch B):
      ``{"embed": per s}``.

    A floor run minutes before or after a phase drifts with the box by a third (docs/perf); one beside it,
    seconds away, drifts with it."""
    from kafka_floor import minilm_forward

    forward = minilm_forward()  # on every core, warm
    teams = {"wide": torch.get_num_threads(), "narrow": narrow}  # before another model's loader sizes them
    settings = load_settings(PlatformSettings)
    gen = load_generation_model(current_model_dir(settings.cache_dir, "demo-gpt"), device="auto")
    ids = [list(gen.tokenizer(prompt)["input_ids"])]

    engine = GenerationEngine(gen.model, max_batch_size=1)  # traced on a CPU, as the worker runs it
    churners: dict[int, GenerationEngine] = {}
    requests = itertools.count()
    emb = load_embedding_model(current_model_dir(settings.cache_dir, "all-minilm-l6-v2"), device="auto")
    embedder, texts = EmbeddingEngine(emb.model), load_texts(emb.tokenizer)

    def with_engine(tokens: int) -> None:
        engine.add(SeqRequest(request_id=str(next(requests)), input_ids=ids[0], max_new_tokens=tokens))
        while engine.has_work():
            engine.step()

    def with_generate(tokens: int) -> None:
        padded_generate(gen.model, ids, tokens, min_new_tokens=tokens)

    run = with_engine

    def generate(tokens: int) -> float:
        started = time.perf_counter()
        run(tokens)
        return (time.perf_counter() - started) * 1000

    configure_torch_threads(narrow)
    for _ in range(20):  # warm the narrow team too
        forward()
    embedding_rate(embedder, texts, 8, 2)
    # the faster of ``generate`` and the engine alone, chosen once (like for like, as the raw baseline)
    timings = {}
    for way in (with_generate, with_engine):
        run = way
        timings[way] = statistics.median(generate(8) for _ in range(5))
    run = min(timings, key=lambda way: timings[way])
    print("ready", flush=True)
    for line in sys.stdin:
        match line.split():
            case ["gen", n, tokens]:
                configure_torch_threads(narrow)
                print(json.dumps({"narrow": [generate(int(tokens)) for _ in range(int(n))]}), flush=True)
            case ["rate", "gen", seconds, batch, tokens, ("quick" | "full") as size]:
                configure_torch_threads(narrow)
                measure = functools.partial(
                    generation_rates,
                    gen.model,
                    ids[0],
                    int(batch),
                    int(tokens),
                    generation_rounds(size == "quick"),
                )
                print(json.dumps(rate_for(float(seconds), measure, within=True)), flush=True)
            case ["rate", "churn", seconds, batch, tokens]:
                configure_torch_threads(narrow)
                if int(batch) not in churners:  # one engine a batch, idle between samples
                    churners[int(batch)] = GenerationEngine(gen.model, max_batch_size=int(batch))
                    churners[int(batch)].warm_up()
                churn = churn_throughput(
                    gen.model, ids[0], int(tokens), int(batch), float(seconds), churners[int(batch)]
                )
                print(json.dumps({"churn": churn}), flush=True)
            case ["rate", "emb", seconds, batch, ("quick" | "full") as size]:
                configure_torch_threads(narrow)
                inputs = embedding_inputs(size == "quick")
                measure = functools.partial(embedding_rates, embedder, texts, int(batch), inputs)
                print(json.dumps(rate_for(float(seconds), measure, within=True)), flush=True)
            case [n]:
                out: dict[str, list[float]] = {}
                for name, threads in teams.items():
                    configure_torch_threads(threads)
                    out[name] = [forward() for _ in range(int(n))]
                print(json.dumps(out), flush=True)
            case _:
                raise SystemExit(f"raw_model.py --serve: cannot read {line!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", default="1,4,8,16,32")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt", default="Tell me about the river and the stone wall.")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--seconds",
        type=float,
        default=2.0,
        help="each rate (a batch size of generation or embeddings) is measured again and again for at least "
        "this long, the mean taken (default 2; --quick: once)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch intra-op threads (default: torch's, one per core)"
    )
    parser.add_argument(
        "--serve",
        metavar="NARROW",
        type=int,
        default=None,
        help="serve reference samples on stdin/stdout: MiniLM batch 1 (every core and NARROW threads), "
        "demo-gpt batch 1 (NARROW threads)",
    )
    args = parser.parse_args()
    if args.serve is not None:
        serve_reference(args.serve, args.prompt)
        return
    # the models' loader sizes torch's team for a worker (half the cores); the raw model alone gets them all
    configure_torch_threads(args.threads or len(os.sched_getaffinity(0)))
    settings = load_settings(PlatformSettings)
    gen = load_generation_model(current_model_dir(settings.cache_dir, "demo-gpt"), device="auto")
    prompt = list(gen.tokenizer(args.prompt)["input_ids"])
    out: dict[str, object] = {
        "device": str(gen.device),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }

    batches = [int(b) for b in args.batches.split(",")]
    generate_tps: dict[int, float] = {}
    engine_tps: dict[int, float] = {}
    raw_generate_throughput(gen.model, [prompt] * 4, 8, 4)  # warm-up
    # each batch for ``--seconds`` at least: one round of the smaller ones is a few tenths of a second, and
    # the box's drift over that picked batch 16 over 32 once (M30), which then sized the platform's batch
    least = 0.0 if args.quick else args.seconds
    for batch in batches:
        rates = rate_for(
            least,
            functools.partial(
                generation_rates, gen.model, prompt, batch, args.new_tokens, generation_rounds(args.quick)
            ),
        )
        generate_tps[batch], engine_tps[batch] = rates["generate"], rates["engine"]
    # The model at its best at each batch: transformers' ``generate``, or the worker's engine alone (in
    # process, no platform) where it is faster: on a CPU its prefill and decode are traced graphs, ~1.4x
    # ``generate`` at 32 rows. The platform's ratios are to the faster, like for like (as the embeddings'
    # raw baseline runs the embedding engine); both are reported.
    out["generate_tokens_per_s"] = generate_tps
    out["engine_tokens_per_s"] = engine_tps
    out["generation_tokens_per_s"] = {b: max(generate_tps[b], engine_tps[b]) for b in batches}

    ids = torch.tensor([prompt], device=gen.device)
    # The first token as the worker's engine computes it: on a CPU its prefill is a traced graph
    # (gpu_workers.step_graphs), which a plain forward (``eager``, also reported) spends twice as long on, in
    # transformers' Python. Like for like, as the embeddings' raw baseline runs the embedding engine.
    graph = step_graphs(gen.model, token_stats).prefill if gen.device.type == "cpu" else None
    mask = torch.ones_like(ids)
    positions = positions_of(mask)

    def eager_token(_n: int) -> None:
        int(gen.model(input_ids=ids, logits_to_keep=1).logits[0, -1].argmax())

    def first_token(_n: int) -> None:
        if graph is None:
            eager_token(_n)
        else:
            int(graph.run(ids, mask, positions)[1][0, 0])

    with torch.inference_mode():
        ttft = timed_ms(first_token, 20 if args.quick else 100)
        out["ttft_ms"] = {"p50": statistics.median(ttft), "p99": percentile(ttft, 99)}
        out["ttft_eager_ms"] = statistics.median(timed_ms(eager_token, 20 if args.quick else 100))
        # as one client's requests meet it: the core idles on their way in and out (as embeddings' below)
        out["ttft_after_idle"] = after_idle(first_token, 20 if args.quick else 100)

    emb = load_embedding_model(current_model_dir(settings.cache_dir, "all-minilm-l6-v2"), device="auto")
    engine = EmbeddingEngine(emb.model)
    texts = load_texts(emb.tokenizer)
    emb_rate: dict[int, float] = {}
    engine.embed(texts[:1])
    inputs = embedding_inputs(args.quick)
    for batch in (1, 8, 32, 64):
        measure = functools.partial(embedding_rates, engine, texts, batch, inputs)
        emb_rate[batch] = rate_for(least, measure)["embed"]
    out["embeddings_per_s"] = emb_rate
    # Batch 1 as one client meets it: the core idles between calls (the request's way in and out), and an
    # idle core here starts a forward slower than the loop above, which never lets it idle (docs/perf).
    out["embedding_batch1_after_idle"] = after_idle(
        lambda n: engine.embed([texts[n % len(texts)]]), 30 if args.quick else 100
    )
    # The engine (the worker's own) runs a traced graph on a CPU; the model's plain eager forward beside it
    eager = EmbeddingEngine(emb.model, traced=False)
    eager.embed(texts[:1])
    out["embedding_batch1_eager_ms"] = statistics.median(
        timed_ms(lambda n: eager.embed([texts[n % len(texts)]]), 30 if args.quick else 100)
    )
    out["embedding_tokens"] = statistics.mean(len(ids) for ids in texts)
    out["prompt_tokens"] = len(prompt)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
