"""The drift benchmark still runs (its numbers are printed, never asserted: a benchmark is not a timed test)."""

from __future__ import annotations

from pathlib import Path

from tests.benchmarks.runner import run_benchmark


def test_the_drift_benchmark_runs_quick_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    stdout, result = run_benchmark("drift_detection.py", out, "--quick", timeout=110)
    assert result["per_request"]["features_us"] > 0
    assert [w["verdict"] for w in result["per_window"][:-1]] == ["drift", "drift"], "a shifted mix drifts"
    assert "per window and key" in stdout
