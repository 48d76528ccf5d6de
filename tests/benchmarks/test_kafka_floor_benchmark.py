"""The Kafka floor benchmark still runs (its numbers are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.runner import run_benchmark


@pytest.mark.integration
def test_the_kafka_floor_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "kafka_floor.json"
    stdout, result = run_benchmark("kafka_floor.py", out, "--quick", timeout=110)
    assert result["latency_ms"]["samples"] == 100
    assert result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    saturation = result["saturation"]
    assert saturation["requests_per_s"] > 0
    assert set(saturation["cpu_ms_per_request"]) == {"broker", "echo", "driver"}
    assert result["settings"] == {"fetch_wait_max_ms": 500, "acks": "all", "quick": True}
    assert "two hops, 1 in flight, p50" in stdout
