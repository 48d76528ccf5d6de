"""The result-encoding benchmark still runs (its times are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

from ingest.prepare import embedding_inputs_that_fit
from tests.benchmarks.runner import run_benchmark


def test_the_result_encoding_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "result_encoding.json"
    stdout, result = run_benchmark("result_encoding.py", out, "--repeat", "3", timeout=60)
    forms = result["forms"]
    assert forms["packed_float32"]["event_bytes"] * 3 < forms["json_floats"]["event_bytes"]
    assert forms["packed_float32"]["inputs_that_fit"] == embedding_inputs_that_fit(384) == 4055
    assert "packed_float32" in stdout
