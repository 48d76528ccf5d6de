"""The GPU benchmark (CUDA smoke checks, the engines against the raw model, the worker's runners) still runs
end to end on the CPU and writes its JSON. CI has no GPU: ``--device cpu`` runs the same code; the smoke
checks there compare the CPU with itself, so what this asserts is that every check ran and passed, and
that the tables are complete. Numbers are printed, never asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.runner import ROOT, run_benchmark


@pytest.mark.timeout(300)
def test_the_gpu_benchmark_runs_on_the_cpu_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    stdout, result = run_benchmark("gpu.py", out, "--device", "cpu", "--quick", timeout=280)
    assert result["device"] == "cpu"
    checks = {c["check"]: c["ok"] for c in result["smoke"]}
    assert checks == {
        "models load on the device": True,
        "greedy tokens equal the CPU's": True,
        "engine under churn equals generate alone (as a worker builds it)": True,
        "engine under churn equals generate alone (the other KV cache)": True,
        "seeded sampling is the same alone and in a batch": True,
        "embeddings equal the CPU's": True,
        "CUDA graphs equal the eager forward": True,
    }
    assert set(result["generation"]) == {"1", "8"}
    assert all(
        row["raw_tok_s"] > 0 and row["engine_tok_s"] > 0 and row["growing_cache_tok_s"] > 0
        for row in result["generation"].values()
    )
    details = [c["detail"] for c in result["smoke"] if c["check"].startswith("engine under churn")]
    assert "growing cache, 0 decode graphs" in details[0], "a CPU's default: the growing cache"
    assert "ring cache, 0 decode graphs" in details[1], "the ring runs eagerly on a CPU"
    assert set(result["embeddings_per_s"]) == {"1", "8"}
    assert all(
        row["engine_per_s"] > 0 and row["eager_per_s"] > 0 for row in result["embeddings_per_s"].values()
    )
    runner = result["runners"]["8"]
    assert runner["generation_tok_s"] > 0
    assert runner["generation_streamed_tok_s"] > 0
    assert runner["embeddings_per_s"] == runner["embeddings_serial_per_s"], "no overlap on a CPU by default"
    assert runner["embeddings_overlapped_per_s"] > 0
    assert "the worker's runners" in stdout
    host = result["runner_host_us_per_token"]
    assert set(host) == {"unstreamed", "streamed", "streamed_stop"}
    assert all(us > 0 for us in host.values())
    assert "host time a token at 256 slots" in stdout


def test_without_cuda_it_says_how_to_run_it_anyway(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--out", str(tmp_path / "gpu.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 2
    assert "no CUDA device here" in done.stdout
    assert "--device cpu" in done.stdout
    assert not (tmp_path / "gpu.json").exists()
