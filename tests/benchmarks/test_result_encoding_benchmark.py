"""The result-encoding benchmark still runs (its times are printed, never asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_result_encoding_benchmark_runs_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "result_encoding.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "result_encoding.py"), "--repeat", "3", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    forms = json.loads(out.read_text())["forms"]
    assert forms["packed_float32"]["event_bytes"] * 3 < forms["json_floats"]["event_bytes"]
    assert forms["packed_float32"]["inputs_that_fit"] == 480
    assert "packed_float32" in done.stdout
