"""``sluice worker``'s one-line errors (sluice/services.py)."""

from __future__ import annotations

import os
import subprocess
import sys

# run_worker_process with the worker replaced by one whose version's files are missing.
_WORKER = """
import sys
import gpu_workers.main as worker_main
from gpu_workers.model_store import VersionFilesError
from rich.console import Console
from schemas.settings import PlatformSettings
from sluice.services import run_worker_process

def run_worker(platform, settings, model_id, stop, join):
    raise VersionFilesError("demo-gpt@abc: config.json is missing; register its files again")

worker_main.run_worker = run_worker
worker_main.place_worker = lambda cpus: None
sys.exit(run_worker_process(PlatformSettings(), "demo-gpt", Console(stderr=True, width=400)))
"""


def test_a_version_with_missing_files_is_not_told_to_run_models_prepare() -> None:
    """A review (2026-12-03): a version registered with `sluice models add` whose files had gone failed with
    "(run `sluice models prepare`)", which cannot restore it; the error's own remedy is printed alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env["SLUICE_WORKER_OPS_PORT"] = "0"
    result = subprocess.run(
        [sys.executable, "-c", _WORKER], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert result.returncode == 1, result.stderr
    assert "config.json is missing; register its files again" in result.stderr
    assert "models prepare" not in result.stderr
