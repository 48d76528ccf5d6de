"""The CPU profile (``benchmarks/cpu_profile.py``: one model's worker and the edge under a closed-loop load,
CPU per process and per thread, batch sizes, optional flame graphs) still runs end to end on the session's
broker. Its numbers are printed, never asserted."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

from schemas.settings import KafkaConnection
from tests.benchmarks.runner import ROOT, run_benchmark

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other as scripts do
cpu_profile = importlib.import_module("cpu_profile")


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_the_cpu_profile_runs_quick_and_writes_its_json(tmp_path: Path, kafka: KafkaConnection) -> None:
    out = tmp_path / "profile.json"
    stdout, result = run_benchmark(
        "cpu_profile.py", out, "--quick", "--clients", "8", timeout=280, kafka=kafka
    )
    assert result["model"] == "all-minilm-l6-v2"
    assert result["requests"] > 0
    assert result["units_per_s"] > 0
    assert {"edge", "worker", "clients"} <= set(result["cores"])
    assert all(ms >= 0 for ms in result["cpu_ms_per_request"].values())
    assert any(t["thread"].endswith("(model)") for t in result["threads"]["worker"])
    assert any(t["thread"].endswith("(event loop)") for t in result["threads"]["edge"])
    assert sum(result["batches"].values()) > 0
    assert result["flame_graphs"] == []
    assert "edge thread" in stdout
    assert "batches by size" in stdout


def test_flame_graphs_without_py_spy_say_how_to_get_it(tmp_path: Path) -> None:
    if (Path(sys.executable).parent / "py-spy").exists():
        pytest.skip("py-spy is installed next to this Python: the refusal is for environments without it")
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cpu_profile.py"), "--flame", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
        env={**os.environ, "PATH": path},
    )
    assert done.returncode == 2
    assert "pip install py-spy" in done.stderr
    assert not list(tmp_path.iterdir())


def test_batch_sizes_are_the_window_s_batches_per_bucket() -> None:
    before = cpu_profile.batch_histogram(
        'sluice_worker_batch_size_bucket{model="m",le="1.0"} 2.0\n'
        'sluice_worker_batch_size_bucket{model="m",le="8.0"} 3.0\n'
        'sluice_worker_batch_size_bucket{model="m",le="+Inf"} 3.0\n'
    )
    after = cpu_profile.batch_histogram(
        "# HELP sluice_worker_batch_size items in a batch\n"
        'sluice_worker_batch_size_bucket{model="m",le="1.0"} 4.0\n'
        'sluice_worker_batch_size_bucket{model="m",le="8.0"} 10.0\n'
        'sluice_worker_batch_size_bucket{model="m",le="+Inf"} 11.0\n'
        'sluice_worker_batch_size_count{model="m"} 11.0\n'
    )
    assert after == {1.0: 4.0, 8.0: 10.0, float("inf"): 11.0}
    assert cpu_profile.batch_sizes(before, after) == {"1": 2.0, "8": 5.0, "+Inf": 1.0}
