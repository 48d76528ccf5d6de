"""The online benchmark (platform vs the raw model) still runs end to end: its own broker, a worker per
model and an edge as processes, on free ports. Its ratios are printed, never asserted (a benchmark is not a
timed test); this only keeps it from rotting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.runner import run_benchmark

pytestmark = pytest.mark.integration


def test_the_online_benchmark_runs_quick_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "online.json"
    stdout, result = run_benchmark("online.py", out, "--quick", timeout=600)
    assert result["machine"]["quick"] is True
    assert result["generation"]["platform_tokens_per_s"] > 0
    assert result["embeddings"]["dynamic_per_s"] > 0
    assert "generation tok/s at saturation" in stdout
    assert "embeddings/s" in stdout
