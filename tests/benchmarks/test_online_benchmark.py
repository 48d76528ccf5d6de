"""The online benchmark (platform vs the raw model) still runs end to end: its own broker, a worker per
model and an edge as processes, on free ports. Its ratios are printed, never asserted (a benchmark is not a
timed test); this only keeps it from rotting."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def test_the_online_benchmark_runs_quick_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "online.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "online.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(out.read_text())
    assert result["machine"]["quick"] is True
    assert result["generation"]["platform_tokens_per_s"] > 0
    assert result["embeddings"]["dynamic_per_s"] > 0
    assert "generation tok/s at saturation" in done.stdout
    assert "embeddings/s" in done.stdout
