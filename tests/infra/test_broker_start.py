"""A start beside a node whose JVM is alive but not listening yet (starting, recovering its logs, shutting
down), two starts at once, and a failed start of one node of a cluster. Found by a review: such a start
launched a second JVM on the node's data dir (which corrupted its metadata log, or died on its ports and
took the pid file with it), or called the node's own controller port "taken by another program" and then
SIGTERMed the node; and a failed start of one missing node stopped the nodes that were serving.

The "JVMs" here are stand-ins: Python processes named by the node's ``server.properties`` (as
``LocalKafka.pid`` checks), and a fake ``java`` on PATH that formats nothing and listens on the node's
client port, recording every launch."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from infra.kafka import broker as broker_module
from infra.kafka.broker import BrokerError, LocalKafka, LocalKafkaCluster, free_port, port_open, read_layout
from schemas.settings import KafkaConnection

# Listens on the port given (0: none) after a delay, for a while, then exits: a JVM starting, or stopping.
_STAND_IN = (
    "import socket, sys, time\n"
    "port, delay, life = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])\n"
    "time.sleep(delay)\n"
    "if port:\n"
    "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "    s.bind(('127.0.0.1', port)); s.listen()\n"
    "time.sleep(life - delay)\n"
)

# `java`: the storage format succeeds at once (after $FAKE_FORMAT_S), and a node's JVM listens on the
# client port its server.properties names.
_FAKE_JAVA = """#!{python}
import os, re, socket, sys, time
if "kafka.tools.StorageTool" in sys.argv:
    time.sleep(float(os.environ.get("FAKE_FORMAT_S", "0")))
    sys.exit(0)
props = open(sys.argv[-1]).read()
port = int(re.search(r"^listeners=PLAINTEXT://127.0.0.1:(\\d+)", props, re.M).group(1))
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port)); s.listen()
time.sleep(60)
"""


def _wait_until(check: Callable[[], bool], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.02)


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def _stand_in(
    procs: list[subprocess.Popen[bytes]],
    node: LocalKafka,
    port: int = 0,
    delay: float = 0.0,
    life: float = 60.0,
) -> subprocess.Popen[bytes]:
    """A JVM of ``node`` that another process launched: named by its server.properties, in its pid file."""
    props = node.data_dir / "server.properties"
    proc = subprocess.Popen([sys.executable, "-c", _STAND_IN, str(port), str(delay), str(life), str(props)])
    procs.append(proc)
    named = os.fsencode(props)
    _wait_until(lambda: named in Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0"))
    node.data_dir.mkdir(parents=True, exist_ok=True)
    node.pid_file.write_text(str(proc.pid))
    return proc


@pytest.fixture
def no_fetch(monkeypatch: pytest.MonkeyPatch) -> None:
    def fetch(*_args: object) -> Path:
        raise AssertionError("went on to launch a second JVM on the node's data dir")

    monkeypatch.setattr(broker_module, "fetch_kafka", fetch)


@pytest.fixture
def answers_when_listening(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in that listens answers a metadata request."""

    def answers(kafka: KafkaConnection, timeout: float = 2.0) -> bool:
        return port_open(int(kafka.bootstrap.rsplit(":", 1)[1]))

    monkeypatch.setattr(broker_module, "broker_answers", answers)


@pytest.fixture
def fake_java(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fake ``java`` first on PATH and a fake Kafka home; what a test left of its launches is killed."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    java = bin_dir / "java"
    java.write_text(_FAKE_JAVA.format(python=sys.executable))
    java.chmod(java.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(broker_module, "fetch_kafka", lambda *_a: tmp_path / "fake-kafka")
    yield
    for pid in _launched(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _launched(under: Path) -> list[int]:
    """The live fake JVMs of the nodes whose data is under ``under``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            args = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:  # not a process, or gone
            continue
        named = any(arg.startswith(os.fsencode(under)) for arg in args)
        if b"kafka.Kafka" in args and named and broker_module.pid_alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def _node(tmp_path: Path, start_timeout: float = 1.0) -> LocalKafka:
    return LocalKafka(
        tmp_path / "kafka", tmp_path / "cache", "4.3.1", port=free_port(), controller_port=free_port(),
        start_timeout=start_timeout,
    )  # fmt: skip


def test_a_start_beside_a_node_that_does_not_answer_yet_launches_nothing_and_leaves_it_running(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], no_fetch: None
) -> None:
    """The node's JVM is up to its controller port (as when it starts or recovers its logs) but does not
    answer on its client port within the start's wait."""
    node = _node(tmp_path)
    jvm = _stand_in(procs, node, port=node.controller_port)
    _wait_until(lambda: port_open(node.controller_port))
    with pytest.raises(BrokerError) as raised:
        node.start()
    message = str(raised.value)
    assert f"pid {jvm.pid}, launched by another process" in message
    assert "left running" in message
    assert "another program" not in message, "its own JVM was called another program"
    time.sleep(0.2)
    assert jvm.poll() is None, "the failed start stopped the node's JVM"
    assert node.pid() == jvm.pid, "the pid file no longer names the node's JVM"


def test_a_start_beside_a_starting_node_waits_until_it_answers(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], no_fetch: None, answers_when_listening: None
) -> None:
    node = _node(tmp_path, start_timeout=20)
    jvm = _stand_in(procs, node, port=node.port, delay=0.5)
    node.start()  # what a second `sluice kafka up`, or `sluice up` beside one, does
    assert node.running()
    assert node.pid() == jvm.pid
    assert not node.runs_own_jvm()


def test_a_start_beside_a_node_shutting_down_launches_its_own_once_that_one_is_gone(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]], fake_java: None, answers_when_listening: None
) -> None:
    node = _node(tmp_path, start_timeout=20)
    stopping = _stand_in(procs, node, life=0.5)
    try:
        node.start()
        assert stopping.poll() is not None
        assert node.runs_own_jvm()
        assert _launched(tmp_path) == [node.pid()]
    finally:
        node.stop(stop_timeout=5)
    assert not node.pid_file.exists()


def test_two_launches_at_once_start_one_jvm(
    tmp_path: Path, fake_java: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two `sluice kafka up` on a fresh data dir: both formatted the storage and launched a JVM, and the
    second's clean-up SIGTERMed the first (the review saw nothing left running)."""
    monkeypatch.setenv("FAKE_FORMAT_S", "0.5")  # both would pass the pid check before either writes it
    first = _node(tmp_path)
    second = LocalKafka(
        first.data_dir, first.cache_dir, first.version, port=first.port, controller_port=first.controller_port
    )
    together = threading.Barrier(2)
    results: list[bool | None] = []

    def launch(node: LocalKafka) -> None:
        together.wait()
        results.append(node.launch())

    threads = [threading.Thread(target=launch, args=(node,)) for node in (first, second)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(_launched(tmp_path)) == 1, "two JVMs were launched on one data dir"
        assert sorted(results, key=bool) == [False, True]
        assert first.pid() == _launched(tmp_path)[0]
    finally:
        for node in (first, second):
            node.stop(stop_timeout=5)


def test_two_starts_of_a_fresh_cluster_format_it_with_one_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each made its own cluster id and directory ids before either recorded them: the second overwrote
    the first's record while the first formatted its nodes with its own."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    first = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports)
    second = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports)
    assert first.layout != second.layout
    for cluster in (first, second):
        monkeypatch.setattr(cluster, "_wait_ready", lambda _t: None)
        for node in cluster.nodes:
            monkeypatch.setattr(node, "launch", lambda: False)
    first.start()
    second.start()
    assert second.layout == first.layout == read_layout(tmp_path)
    assert all(node.cluster == first.layout for node in second.nodes), "its nodes format with another id"


def test_a_failed_start_of_one_node_leaves_the_nodes_that_were_serving(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """A 3-node cluster with node 3 down, brought back by `sluice kafka up --brokers 3` (or `sluice up`):
    node 3 cannot start (another program holds its port), and the failed start stopped nodes 1 and 2."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    cluster = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports, start_timeout=5)
    serving = [_stand_in(procs, cluster.node(i), port=ports[i - 1][0]) for i in (1, 2)]
    _wait_until(lambda: all(cluster.node(i).running() for i in (1, 2)))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[2][0]))
        taken.listen()
        with pytest.raises(BrokerError, match="is taken by another program"):
            cluster.start()
    time.sleep(0.2)
    assert [p.poll() for p in serving] == [None, None], "the failed start stopped the nodes that served"
    assert [cluster.node(i).pid() for i in (1, 2)] == [p.pid for p in serving]


def test_a_failed_start_still_stops_the_nodes_it_launched(
    tmp_path: Path, fake_java: None, procs: list[subprocess.Popen[bytes]]
) -> None:
    ports = [(free_port(), free_port()) for _ in range(2)]
    cluster = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports, start_timeout=5)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[1][0]))
        taken.listen()
        with pytest.raises(BrokerError, match=rf"port {ports[1][0]} is taken by another program"):
            cluster.start()
    assert cluster.launched == [cluster.node(1)]
    assert _launched(tmp_path) == [], "node 1, which the failed start launched, still runs"
    assert not cluster.node(1).pid_file.exists()


def test_kafka_status_says_a_node_that_does_not_answer_yet_is_not_down(
    tmp_path: Path, procs: list[subprocess.Popen[bytes]]
) -> None:
    """It said "down; `sluice kafka up` starts it", and that start launched a second JVM."""
    port = free_port()
    node = LocalKafka(tmp_path / "kafka", tmp_path / "cache", "4.3.1", port=port, controller_port=port + 1)
    jvm = _stand_in(procs, node)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env |= {"SLUICE_DATA_DIR": str(tmp_path), "SLUICE_KAFKA_PORT": str(port)}
    result = subprocess.run(
        [sys.executable, "-m", "sluice", "kafka", "status"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert re.search(rf"not answering yet at 127\.0\.0\.1:{port} \(pid {jvm.pid}\)", result.stdout), (
        result.stdout
    )
    assert "down" not in result.stdout
