"""The Kafka floor benchmark still runs (its numbers are printed, never asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.runner import run_benchmark


@pytest.mark.integration
@pytest.mark.timeout(300)  # ~25 s alone; a CI box shared with other work once took it past 110 s
def test_the_kafka_floor_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "kafka_floor.json"
    stdout, result = run_benchmark(
        "kafka_floor.py", out, "--quick", "--idle-ms", "5", "--around-forward", timeout=280
    )
    assert result["latency_ms"]["samples"] == 100
    assert result["latency_ms"]["p50"] <= result["latency_ms"]["p99"]
    saturation = result["saturation"]
    assert saturation["requests_per_s"] > 0
    assert set(saturation["cpu_ms_per_request"]) == {"broker", "echo", "driver"}
    # the lone round trips again, each after the idle time one client leaves between its two hops
    rested = result["after_idle_ms"]
    assert rested["idle_ms"] == 5
    assert rested["samples"] == 50
    assert 0 < rested["p50"] <= rested["p99"]
    assert set(rested["cpu_ms_per_request"]) == {"broker", "echo", "driver"}
    assert result["settings"] == {
        "fetch_wait_max_ms": 500,
        "acks": "all",
        "idle_ms": 5,
        "around_forward": True,
        "quick": True,
    }
    # the lone round trips through an echo that runs MiniLM's forward between the hops, each hop timed
    around = result["around_forward_ms"]
    assert around["samples"] == 50
    assert 0 < around["forward"] < around["round_trip"], around
    assert 0 < around["hop_in"] < around["round_trip"], around
    assert 0 < around["hop_back"] < around["round_trip"], around
    assert around["hops"] > 0, around
    assert "two hops around MiniLM's forward, p50" in stdout
    assert "two hops, 1 in flight, p50" in stdout
    assert "two hops, each after 5 ms idle, p50" in stdout
