"""The continuous-batching benchmark still runs (its rates are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.runner import run_benchmark


def test_the_churn_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "churn.json"
    stdout, result = run_benchmark("churn.py", out, "--quick", "--batch", "8", "--tokens", "16", timeout=180)
    for mode in ("static", "churn"):
        assert result[mode]["tokens_per_s"] > 0
        assert result[mode]["decode_steps"] > 0
        assert result[mode]["decode_ms_by_width"], result[mode]
    assert result["static"]["prefills"] == 1  # --quick: one static batch, one prefill
    assert result["churn"]["prefills"] > result["static"]["prefills"]  # joiners, a few at a time
    assert result["churn_over_static"] > 0
    assert "churn over static" in stdout
