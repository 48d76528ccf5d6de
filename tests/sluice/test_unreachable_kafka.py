"""Services and commands with no Kafka to reach, or no topics: one line naming the address, and exit 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from infra.kafka.broker import free_port
from schemas.settings import KafkaConnection

ROOT = Path(__file__).resolve().parents[2]


def _sluice(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "SLUICE_EDGE_PORT": "0"}
    base |= {"SLUICE_WORKER_OPS_PORT": "0", "SLUICE_STREAMS_PORT": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "sluice", *command],
        env=base | env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize(
    "command", [["edge"], ["worker", "--model", "demo-gpt"], ["streams"], ["replay", "--data-dir", "rebuilt"]]
)
def test_a_service_that_cannot_reach_kafka_says_so_in_one_line(tmp_path: Path, command: list[str]) -> None:
    """Found by a review: the edge failed with librdkafka's KafkaException and the worker with BusError, each
    a traceback (and the edge's under ~190 librdkafka lines); a pod started before Kafka crash-looped on
    them. A later review: the worker's line named neither Kafka nor its address, and `replay` and `streams`
    buried their line under ~200 of librdkafka's."""
    if command[0] == "replay":
        command = [*command[:-1], str(tmp_path / command[-1])]
    bootstrap = f"127.0.0.1:{free_port()}"
    code, output = _sluice(command, {"SLUICE_DATA_DIR": str(tmp_path), "SLUICE_KAFKA_BOOTSTRAP": bootstrap})
    said = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1, output
    assert "Traceback" not in output
    assert len(said) == 1
    assert f"Kafka at {bootstrap}" in said[0]
    assert sum(line.startswith("%") for line in output.splitlines()) < 60, "librdkafka's lines bury it"


@pytest.mark.integration
def test_streams_started_before_its_topics_says_so_in_one_line(
    tmp_path: Path, kafka: KafkaConnection
) -> None:
    """Found by a review: `sluice streams` before `sluice topics apply` (a pod before its init job) was a
    60-line traceback, on every restart."""
    env = {"SLUICE_DATA_DIR": str(tmp_path), "SLUICE_KAFKA_BOOTSTRAP": kafka.bootstrap}
    code, output = _sluice(["streams"], env | {"SLUICE_TOPIC_PREFIX": "never-applied"})
    said = [line for line in output.splitlines() if line.startswith("error:")]
    assert code == 1, output
    assert "Traceback" not in output
    assert len(said) == 1
    assert "never-applied.results does not exist: run `sluice topics apply`" in said[0]
