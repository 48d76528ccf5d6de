"""The drift benchmark still runs (its numbers are printed, never asserted: a benchmark is not a timed test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_drift_benchmark_runs_quick_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "drift.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "drift_detection.py"), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["per_request"]["features_us"] > 0
    assert [w["verdict"] for w in result["per_window"][:-1]] == ["drift", "drift"], "a shifted mix drifts"
    assert "per window and key" in done.stdout
