"""``sluice edge`` and ``sluice worker`` with no Kafka to reach, or no topics: one line and exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka.broker import free_port


@pytest.mark.parametrize("command", [["edge"], ["worker", "--model", "demo-gpt"]])
def test_a_service_that_cannot_reach_kafka_says_so_in_one_line(tmp_path: Path, command: list[str]) -> None:
    """Found by a review: the edge failed with librdkafka's KafkaException and the worker with BusError, each
    a traceback (and the edge's under ~190 librdkafka lines); a pod started before Kafka crash-looped on
    them."""
    env = {
        "PATH": "/usr/bin:/bin",
        "SLUICE_DATA_DIR": str(tmp_path),
        "SLUICE_KAFKA_BOOTSTRAP": f"127.0.0.1:{free_port()}",
        "SLUICE_EDGE_PORT": "0",
        "SLUICE_WORKER_OPS_PORT": "0",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "sluice", *command], env=env, capture_output=True, text=True, timeout=120
    )
    said = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith("error:")]
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert len(said) == 1
    assert "cannot" in said[0]
