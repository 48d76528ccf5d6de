"""What continuous batching costs the generation engine alone, in process: a static batch (every row starts
and ends together, as the raw baseline runs it) against the same engine under a serving load's churn (a
request joining as one ends, ``gpu_workers.engine.churn_throughput``), alternated in rounds on the worker's
threads, with each decode step timed by its batch's width (the cached columns every row attends over) and
each prefill timed.

Why it exists: ``online.py --rounds 5`` put generation at saturation at 0.72-0.78 of the static floor in
every round, and at ~1.0 of the engine alone under the same churn; this shows where the engine's own gap
comes from (a joiner is right-aligned, so every row attends over the oldest row's columns, and joiners need
prefills of their own). Prints a table, writes JSON (``benchmarks/results/churn.json``)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_workers.engine import GenerationEngine, StepOutput, churn_throughput, engine_throughput  # noqa: E402
from gpu_workers.models import configure_torch_threads, load_generation_model, prepare_models  # noqa: E402
from schemas.manifest import current_model_dir  # noqa: E402
from schemas.settings import PlatformSettings, load_settings  # noqa: E402

WIDTH_BUCKET = 8


class TimedEngine(GenerationEngine):
    """The engine, each decode step's time kept by its width (in buckets of 8 columns), each prefill's too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.decodes: dict[int, list[float]] = defaultdict(list)
        self.prefills: list[float] = []
        self.skip = 0
        """Steps not to time (a churn's settling steps, whose first wave is still short)."""

    def _decode(self, outputs: list[StepOutput]) -> None:
        mask = self._batch.mask
        width = 0 if mask is None else int(mask.shape[1])
        began = time.perf_counter()
        super()._decode(outputs)
        if self.skip > 0:
            self.skip -= 1
            return
        self.decodes[width // WIDTH_BUCKET * WIDTH_BUCKET].append(time.perf_counter() - began)

    def _prefill(self, outputs: list[StepOutput], free: int) -> Any:
        began = time.perf_counter()
        joined = super()._prefill(outputs, free)
        if joined is not None and self.skip == 0:
            self.prefills.append(time.perf_counter() - began)
        return joined

    def forget(self) -> None:
        self.decodes.clear()
        self.prefills.clear()


def summary(engine: TimedEngine, rates: list[float]) -> dict[str, Any]:
    steps = [t for times in engine.decodes.values() for t in times]
    return {
        "tokens_per_s": statistics.median(rates),
        "each": rates,
        "decode_steps": len(steps),
        "decode_ms": 1000 * statistics.mean(steps),
        "decode_ms_by_width": {
            width: 1000 * statistics.median(times)
            for width, times in sorted(engine.decodes.items())
            if len(times) >= 3
        },
        "prefills": len(engine.prefills),
        "prefill_ms": 1000 * statistics.mean(engine.prefills) if engine.prefills else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--batch", type=int, default=32, help="the engine's slots (default 32, raw's best here)"
    )
    parser.add_argument(
        "--tokens", type=int, default=64, help="new tokens a request (default 64, as online.py)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, a worker's here)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated rounds of each (default 3)")
    parser.add_argument("--seconds", type=float, default=3.0, help="of churn a round (default 3)")
    parser.add_argument("--quick", action="store_true", help="one short round (a smoke run)")
    parser.add_argument("--prompt", default="Tell me about the river and the stone wall.")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "churn.json")
    args = parser.parse_args()
    rounds, seconds, batches = (1, 0.3, 1) if args.quick else (args.rounds, args.seconds, 3)
    configure_torch_threads(args.threads)
    settings = load_settings(PlatformSettings)
    if not current_model_dir(settings.cache_dir, "demo-gpt").exists():
        prepare_models(settings, print)  # as `sluice models prepare` does; a prepared cache is reused as is
    gen = load_generation_model(current_model_dir(settings.cache_dir, "demo-gpt"), device="auto")
    prompt = list(gen.tokenizer(args.prompt)["input_ids"])
    static, churn = (TimedEngine(gen.model, max_batch_size=args.batch) for _ in range(2))
    for engine in (static, churn):
        engine.warm_up()

    # static batches in turn (every row starting and ending together), as the raw baseline runs them
    def static_rate(batches: int) -> float:
        prompts = [prompt] * args.batch * batches
        return engine_throughput(gen.model, prompts, args.tokens, args.batch, engine=static)

    static_rate(1)  # every width's shapes once
    static.forget()
    rates: dict[str, list[float]] = {"static": [], "churn": []}
    for _ in range(rounds):
        rates["static"].append(static_rate(batches))
        churn.skip = args.tokens  # churn_throughput's settling steps
        rates["churn"].append(churn_throughput(gen.model, prompt, args.tokens, args.batch, seconds, churn))
    out = {
        "device": str(gen.device),
        "threads": args.threads,
        "batch": args.batch,
        "tokens": args.tokens,
        "static": summary(static, rates["static"]),
        "churn": summary(churn, rates["churn"]),
    }
    out["churn_over_static"] = out["churn"]["tokens_per_s"] / out["static"]["tokens_per_s"]
    print(
        f"demo-gpt alone, {args.batch} rows, {args.tokens} new tokens, {args.threads} thread(s), {rounds} rounds"
    )
    print("          | tok/s (median) | decode ms (mean) | steps | prefills (mean ms)")
    for mode in ("static", "churn"):
        row = out[mode]
        print(
            f"{mode:9s} | {row['tokens_per_s']:14.0f} | {row['decode_ms']:16.2f} | {row['decode_steps']:5d} |"
            f" {row['prefills']} ({row['prefill_ms']:.2f})"
        )
    print(f"churn over static: {out['churn_over_static']:.2f}")
    widths = sorted(set(out["static"]["decode_ms_by_width"]) | set(out["churn"]["decode_ms_by_width"]))
    print(
        "decode step ms (median) by cached columns: "
        + " | ".join(
            f"{w}-{w + WIDTH_BUCKET - 1}: "
            + "/".join(
                f"{out[m]['decode_ms_by_width'][w]:.2f}" if w in out[m]["decode_ms_by_width"] else "-"
                for m in ("static", "churn")
            )
            for w in widths
        )
        + " (static/churn)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
