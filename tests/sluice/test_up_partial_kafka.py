"""`sluice up` and a local Kafka cluster `sluice kafka up --brokers 2` started (it outlives that command by
design) with one node down: `sluice up` starts that node and stops only it on exit.

Found by a review: it registered the whole cluster's stop, so a Ctrl-C stopped the operator's running
nodes too, where a cluster found with every node running is left running. Node 1's "JVM" here is a stand-in
process carrying node 1's server.properties on its command line and listening on node 1's port, as
``LocalKafka.running()`` checks. A node whose JVM another process was starting is waited on, not
launched again, and left running on exit."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from gpu_workers.settings import WorkerSettings
from infra.kafka import broker as broker_module
from infra.kafka.broker import LocalKafka, LocalKafkaCluster, free_port, port_open
from ingest.settings import EdgeSettings
from schemas.settings import PlatformSettings
from sluice import up
from sluice.autoscale import FleetSettings
from streams.settings import StreamsSettings

_JVM = (
    "import socket, sys, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(120)\n"
)


def _fake_jvm(node: LocalKafka) -> subprocess.Popen[bytes]:
    node.data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", _JVM, str(node.port), str(node.data_dir / "server.properties")],
        start_new_session=True,
    )
    node.pid_file.write_text(str(proc.pid))
    for _ in range(100):
        if port_open(node.port):
            break
        time.sleep(0.05)
    return proc


def _starting_jvm(node: LocalKafka) -> subprocess.Popen[bytes]:
    """A JVM of ``node`` that another process launched and that does not listen yet."""
    node.data_dir.mkdir(parents=True, exist_ok=True)
    props = node.data_dir / "server.properties"
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", str(props)], start_new_session=True
    )
    while os.fsencode(props) not in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0"):
        time.sleep(0.01)  # exec'd: until then it shows its parent's command line
    node.pid_file.write_text(str(proc.pid))
    return proc


async def _serve_until_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cluster: LocalKafkaCluster) -> str:
    """Run `sluice up` on ``cluster`` (no waiting for Kafka to answer; no services) until everything is up,
    then stop it as a Ctrl-C does; what it said."""
    monkeypatch.setattr(cluster, "_wait_ready", lambda _t: None)
    monkeypatch.setattr(up, "started_broker", lambda *_a: cluster)
    stop = asyncio.Event()
    monkeypatch.setattr(up, "stop_on_signals", lambda: stop)
    loop = asyncio.get_running_loop()

    def apply_topics(*_a: object) -> list[object]:
        loop.call_soon_threadsafe(stop.set)  # the operator's Ctrl-C, once up
        return []

    class Child:
        def __init__(self, *a: object, **k: object) -> None:
            pass

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            pass

    async def never_ready(*_a: object, **_k: object) -> None:
        await asyncio.Event().wait()

    monkeypatch.setattr(up, "apply_topics", apply_topics)
    monkeypatch.setattr(up, "quiet_admin", lambda *_a: None)
    monkeypatch.setattr(up, "topics_of", lambda *_a: [])
    monkeypatch.setattr(up, "ServiceProcess", Child)
    monkeypatch.setattr(up, "_wait_ready", never_ready)
    said = io.StringIO()
    console = Console(file=said)
    await up._serve(
        PlatformSettings(
            data_dir=str(tmp_path), kafka_port=cluster.nodes[0].port, kafka_brokers=len(cluster.nodes)
        ),
        EdgeSettings(),
        FleetSettings(),
        StreamsSettings(),
        console,
        console,
        WorkerSettings(),
        {},
    )
    return said.getvalue()


async def test_up_leaves_running_the_kafka_nodes_it_did_not_start(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    ports = [(free_port(), free_port()), (free_port(), free_port())]
    cluster = LocalKafkaCluster(tmp_path / "kafka", tmp_path / "cache", "4.3.1", ports=ports)
    operators = _fake_jvm(cluster.nodes[0])  # `sluice kafka up`'s node 1, still running
    ours: list[subprocess.Popen[bytes]] = []
    try:
        assert cluster.nodes[0].running()
        assert not cluster.nodes[1].running()

        def launch() -> bool:  # node 2, started by sluice up
            ours.append(_fake_jvm(cluster.nodes[1]))
            return True

        monkeypatch.setattr(cluster.nodes[1], "launch", launch)
        said = await _serve_until_up(monkeypatch, tmp_path, cluster)
        assert ours
        assert ours[0].wait(timeout=10) == -15, said  # the node sluice up started: stopped
        assert operators.poll() is None, "sluice up stopped the Kafka node `sluice kafka up` had started"
    finally:
        for proc in (operators, *ours):
            proc.kill()
            proc.wait()


async def test_up_leaves_running_a_kafka_node_another_process_was_starting(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`sluice up` run while `sluice kafka up` still starts the broker: it waits for that JVM (it launched
    a second one on the node's data before, a review) and, not having launched it, leaves it on exit."""

    def no_fetch(*_args: object) -> Path:
        raise AssertionError("sluice up launched a second JVM on the node's data dir")

    monkeypatch.setattr(broker_module, "fetch_kafka", no_fetch)
    cluster = LocalKafkaCluster(
        tmp_path / "kafka", tmp_path / "cache", "4.3.1", ports=[(free_port(), free_port())]
    )
    (node,) = cluster.nodes
    starting = _starting_jvm(node)
    try:
        await _serve_until_up(monkeypatch, tmp_path, cluster)
        assert cluster.launched == []
        await asyncio.sleep(0.2)
        assert starting.poll() is None, "sluice up stopped, on exit, the JVM another process was starting"
    finally:
        starting.kill()
        starting.wait()
