"""A closed terminal (SIGHUP to the whole process group) stops `sluice up`, its edges, streams worker and
workers as Ctrl-C does: before, SIGHUP killed them at once, with no drain and no clean stop (an audit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

# The loop-based services (`sluice up`, `sluice edge`, `sluice streams`) wait on stop_on_signals.
_LOOP_SERVICE = """
import asyncio
from sluice.services import stop_on_signals

async def main() -> None:
    stop = stop_on_signals()
    print("serving", flush=True)
    await asyncio.wait_for(stop.wait(), 30)
    print("stopped cleanly", flush=True)

asyncio.run(main())
"""

# `sluice worker`: run_worker_process with the worker itself replaced by one that waits for its stop.
_WORKER = """
import sys
import gpu_workers.main as worker_main
from rich.console import Console
from schemas.settings import PlatformSettings
from sluice.services import run_worker_process

def run_worker(platform, settings, model_id, stop, join):
    print("serving", flush=True)
    if stop.wait(30):
        print("stopped cleanly", flush=True)

worker_main.run_worker = run_worker
worker_main.place_worker = lambda cpus: None
sys.exit(run_worker_process(PlatformSettings(), "demo-gpt", Console(stderr=True)))
"""


@pytest.mark.parametrize("script", [_LOOP_SERVICE, _WORKER], ids=["loop-service", "worker"])
def test_sighup_stops_a_service_cleanly(script: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env["SLUICE_WORKER_OPS_PORT"] = "0"
    with subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "serving"
            proc.send_signal(signal.SIGHUP)
            assert proc.wait(timeout=10) == 0, "SIGHUP killed the service"
            assert proc.stdout.read().strip() == "stopped cleanly"
        finally:
            if proc.poll() is None:
                proc.kill()
