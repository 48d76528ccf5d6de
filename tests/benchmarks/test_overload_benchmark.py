"""The overload benchmark (refusal cost at 10x a tenant's limit, two edges) still runs end to end and
writes its JSON; its numbers are printed, never asserted (a benchmark is not a timed test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.settings import KafkaConnection
from tests.benchmarks.runner import run_benchmark

pytestmark = pytest.mark.integration


def test_the_overload_benchmark_runs_quick_and_writes_its_json(
    tmp_path: Path, kafka: KafkaConnection
) -> None:
    out = tmp_path / "overload.json"
    stdout, result = run_benchmark("overload.py", out, "--quick", timeout=300, kafka=kafka)
    assert result["machine"]["quick"] is True
    assert result["refused"] > 0
    assert result["admitted"] >= result["limit_per_min"]  # the limit was used, not refused from the start
    assert "refusal in the edge p50 / p99" in stdout
