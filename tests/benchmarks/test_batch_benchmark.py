"""The batch benchmark (interactive TTFT beside a batch, and without the batch lane) still runs end to end
and writes its JSON; its numbers are printed, never asserted (a benchmark is not a timed test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from schemas.settings import KafkaConnection
from tests.benchmarks.runner import run_benchmark

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_the_batch_benchmark_runs_quick_and_writes_its_json(tmp_path: Path, kafka: KafkaConnection) -> None:
    out = tmp_path / "batch.json"
    stdout, result = run_benchmark("batch.py", out, "--quick", timeout=360, kafka=kafka)
    assert result["machine"]["quick"] is True
    for phase in ("alone", "beside_batch", "no_batch_lane"):
        assert result[phase]["requests"] > 0
    assert result["beside_batch"]["background_lines_per_s"] > 0  # the batch did run beside the clients
    assert "beside a batch" in stdout
