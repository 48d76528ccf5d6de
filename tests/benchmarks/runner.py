"""Run a benchmark script as a user would (``python benchmarks/<name>.py ... --out FILE``) and hand back its
output and JSON: the tests keep the scripts from rotting; their numbers are printed, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from schemas.settings import KafkaConnection

ROOT = Path(__file__).resolve().parents[2]


def run_benchmark(
    script: str, out: Path, *args: str, timeout: float, kafka: KafkaConnection | None = None
) -> tuple[str, dict[str, Any]]:
    """(stdout, the JSON it wrote). Only ``SLUICE_CACHE_DIR`` of the caller's ``SLUICE_*`` variables goes
    through: a benchmark starts its own broker on free ports, or with ``kafka`` uses that cluster
    (``SLUICE_KAFKA_BOOTSTRAP``, as a user points one at theirs; each run's topics have a prefix of its own),
    which saves CI a broker start per benchmark."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    if kafka is not None:
        env["SLUICE_KAFKA_BOOTSTRAP"] = kafka.bootstrap
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    result: dict[str, Any] = json.loads(out.read_text())
    return done.stdout, result
