"""The overload benchmark (refusal cost at 10x a tenant's limit, two edges) still runs end to end and
writes its JSON; its numbers are printed, never asserted (a benchmark is not a timed test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_the_overload_benchmark_runs_quick_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "overload.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "overload.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["machine"]["quick"] is True
    assert result["refused"] > 0
    assert result["admitted"] >= result["limit_per_min"]  # the limit was used, not refused from the start
    assert "refusal in the edge p50 / p99" in done.stdout
