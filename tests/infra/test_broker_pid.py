"""A local node's pid file and ports, checked before anything is signalled or started (found by an audit:
``sluice kafka down`` killed an unrelated process a stale ``broker.pid`` named, and a taken controller port
was a Java stack trace)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.kafka import broker as broker_module
from infra.kafka.broker import BrokerError, LocalKafka, free_port


@pytest.fixture
def unrelated() -> Iterator[subprocess.Popen[bytes]]:
    """A program that is not Kafka, alive, with a pid a stale pid file may name."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_stale_pid_file_naming_another_program_is_removed_and_nothing_is_signalled(
    tmp_path: Path, unrelated: subprocess.Popen[bytes]
) -> None:
    node = LocalKafka(tmp_path, tmp_path / "cache", "4.3.1", port=free_port(), controller_port=free_port())
    node.pid_file.write_text(str(unrelated.pid))
    assert node.pid() is None
    assert not node.pid_file.exists()
    node.pid_file.write_text(str(unrelated.pid))
    node.stop(stop_timeout=1)
    assert unrelated.poll() is None, "stop signalled a process that is not the node's JVM"
    assert not node.pid_file.exists()


def test_kafka_down_leaves_a_program_a_stale_pid_file_names_alone(
    tmp_path: Path, unrelated: subprocess.Popen[bytes]
) -> None:
    (tmp_path / "kafka").mkdir()
    (tmp_path / "kafka" / "broker.pid").write_text(str(unrelated.pid))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env |= {"SLUICE_DATA_DIR": str(tmp_path), "SLUICE_KAFKA_PORT": str(free_port())}
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "kafka", "down"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Kafka is not running"
    assert unrelated.poll() is None, "`sluice kafka down` killed a process that is not Kafka"


def test_a_taken_controller_port_is_a_clear_error_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_fetch(*_args: object) -> Path:
        raise AssertionError("went on to fetch and start Kafka")

    monkeypatch.setattr(broker_module, "fetch_kafka", no_fetch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        controller = taken.getsockname()[1]
        node = LocalKafka(tmp_path, tmp_path / "cache", "4.3.1", port=free_port(), controller_port=controller)
        with pytest.raises(
            BrokerError, match=rf"^port {controller} \(Kafka's controller.*set SLUICE_KAFKA_PORT$"
        ):
            node.launch()
