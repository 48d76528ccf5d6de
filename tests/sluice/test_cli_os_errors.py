"""What the OS refuses a command (a path it cannot create) is one line with the path and the OS's reason,
exit code 1, never a traceback (an audit found three commands that printed one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka.broker import free_port


@pytest.mark.parametrize(
    ("args", "data_dir", "path"),
    [
        (["schemas", "export", "/proc/nope"], None, "/proc/nope"),
        (["grafana", "dashboard", "--out", "/proc/x/y.json"], None, "/proc/x"),
        (["up"], "/proc/x", "/proc/x"),
    ],
    ids=["schemas-export", "grafana-dashboard", "up"],
)
def test_a_path_the_os_refuses_is_one_line(
    args: list[str], data_dir: str | None, path: str, tmp_path: Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env |= {"SLUICE_DATA_DIR": data_dir or str(tmp_path), "SLUICE_KAFKA_PORT": str(free_port())}
    env |= {"SLUICE_EDGE_PORT": str(free_port()), "SLUICE_STREAMS_PORT": str(free_port())}
    env |= {"SLUICE_WORKER_OPS_PORT": "0", "SLUICE_FLEET_WORKER_CPUS": "off"}
    result = subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == f"error: {path}: No such file or directory"
