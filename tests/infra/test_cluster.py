"""A local multi-broker KRaft cluster from the same jars: replicated topics, and a broker killed with -9
and brought back without losing or duplicating an acknowledged record."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import ConfigResource

from bus.consumer import consumer_config
from bus.errors import BusError
from bus.producer import EventProducer, Position
from infra.kafka.broker import (
    BrokerError,
    LocalKafka,
    LocalKafkaCluster,
    _ephemeral_low,
    free_port,
    live_brokers,
    pid_alive,
    read_layout,
    request_threads,
)
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics, under_replicated
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from tests.sluice.test_cli import sluice

# The single-node server.properties as it was before clusters existed (node 1, its own controller the
# only voter, one copy of everything) and the request threads sized to the cores: a cluster of one must keep
# writing exactly this.
SINGLE_NODE = """\
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs={log_dir}
auto.create.topics.enable=false
num.partitions=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=8
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
log.retention.check.interval.ms=60000
num.network.threads={network_threads}
num.io.threads={io_threads}
"""
THREADS = dict(
    zip(("network_threads", "io_threads"), request_threads(len(os.sched_getaffinity(0))), strict=True)
)


def _properties(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_one_node_writes_the_single_node_config_as_before(tmp_path: Path) -> None:
    cluster = LocalKafkaCluster(tmp_path / "kafka", tmp_path / "cache", "4.3.1", ports=[(19092, 19093)])
    (node,) = cluster.nodes
    assert node.data_dir == tmp_path / "kafka"  # no node-1 folder: the same data dir as before
    assert cluster.layout is None
    assert cluster.bootstrap == "127.0.0.1:19092"
    written = node.write_config().read_text()
    assert written == SINGLE_NODE.format(
        port=19092, controller_port=19093, log_dir=tmp_path / "kafka" / "logs", **THREADS
    )
    # the class the single-node callers (the session fixture, benchmarks) use writes the same
    plain = LocalKafka(tmp_path / "plain", tmp_path / "cache", "4.3.1", port=19092, controller_port=19093)
    assert plain.server_properties() == SINGLE_NODE.format(
        port=19092, controller_port=19093, log_dir=tmp_path / "plain" / "logs", **THREADS
    )
    assert not (tmp_path / "kafka" / "cluster.json").exists()


def test_a_local_node_sizes_its_request_threads_to_its_cores() -> None:
    # a 2-core box: one of each (measured on the two hops: docs/perf); a server's count stays near Kafka's
    assert request_threads(1) == (1, 1)
    assert request_threads(2) == (1, 1)
    assert request_threads(4) == (1, 2)
    assert request_threads(16) == (4, 8)


def test_three_nodes_share_one_quorum_and_replicate_by_three(tmp_path: Path) -> None:
    ports = [(19100, 19101), (19102, 19103), (19104, 19105)]
    cluster = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports)
    assert cluster.bootstrap == "127.0.0.1:19100,127.0.0.1:19102,127.0.0.1:19104"
    assert cluster.layout is not None
    assert len({node.directory_id for node in cluster.layout.nodes}) == 3
    for node_id, node in enumerate(cluster.nodes, start=1):
        assert node.data_dir == tmp_path / f"node-{node_id}"
        props = _properties(node.write_config().read_text())
        assert props["node.id"] == str(node_id)
        assert (
            props["controller.quorum.bootstrap.servers"] == "127.0.0.1:19101,127.0.0.1:19103,127.0.0.1:19105"
        )
        assert props["listeners"] == (
            f"PLAINTEXT://127.0.0.1:{node.port},CONTROLLER://127.0.0.1:{node.controller_port}"
        )
        assert props["log.dirs"] == str(tmp_path / f"node-{node_id}" / "logs")
        assert "controller.quorum.voters" not in props  # the voters are formatted in: --initial-controllers
        for key in ("offsets.topic", "transaction.state.log", "default", "share.coordinator.state.topic"):
            assert props[f"{key}.replication.factor"] == "3"
        assert props["transaction.state.log.min.isr"] == "2"
        assert props["min.insync.replicas"] == "2"
        assert props["unclean.leader.election.enable"] == "false"
    assert cluster.layout.initial_controllers == ",".join(
        f"{n.node_id}@127.0.0.1:{n.controller_port}:{n.directory_id}" for n in cluster.layout.nodes
    )


def test_a_cluster_restarts_as_formatted_and_refuses_another_layout(tmp_path: Path) -> None:
    ports = [(19110, 19111), (19112, 19113), (19114, 19115)]
    first = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports)
    assert first.layout is not None
    (tmp_path / "cluster.json").write_bytes(msgspec.json.encode(first.layout))  # what a start records
    again = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports)
    assert again.layout == first.layout == read_layout(tmp_path)  # same cluster id and directory ids
    other = LocalKafkaCluster(tmp_path, tmp_path / "cache", "4.3.1", ports=ports[:2])
    with pytest.raises(BrokerError, match="holds a 3-node cluster"):
        other.start()  # refused before any JVM starts (nothing listens on these ports)
    assert read_layout(tmp_path) == first.layout


def test_settings_bootstrap_from_every_local_node() -> None:
    assert PlatformSettings().bootstrap == "127.0.0.1:9092"
    three = PlatformSettings(kafka_port=9200, kafka_brokers=3)
    assert three.bootstrap == "127.0.0.1:9200,127.0.0.1:9202,127.0.0.1:9204"
    assert PlatformSettings(kafka_bootstrap="k:9092", kafka_brokers=3).bootstrap == "k:9092"
    with pytest.raises(ValueError, match="lower SLUICE_KAFKA_PORT"):
        PlatformSettings(kafka_port=65531, kafka_brokers=3)


# ---------------------------------------------------------------- sluice kafka, on a cluster of its own
# (before the module's cluster starts: never six JVMs at once on this box)


def _free_run(ports: int) -> int:
    """The first of ``ports`` consecutive free loopback ports (a cluster's nodes take pairs from one)."""
    for _ in range(50):
        first = free_port()
        if first + ports < _ephemeral_low() and all(_bindable(first + i) for i in range(ports)):
            return first
    pytest.fail(f"no {ports} consecutive free ports")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_sluice_kafka_up_brokers_3_status_down(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    port = _free_run(6)
    env.update(SLUICE_DATA_DIR=str(tmp_path / "data"), SLUICE_KAFKA_PORT=str(port))
    bootstrap = ",".join(f"127.0.0.1:{port + 2 * i}" for i in range(3))
    try:
        up = sluice("kafka", "up", "--brokers", "3", env=env)
        assert up.returncode == 0, up.stderr
        assert f"up at {bootstrap} (3 brokers, pids " in up.stdout
        assert "SLUICE_KAFKA_BROKERS=3" in up.stderr  # how to point every other command at all three
        status = sluice("kafka", "status", env=env)  # SLUICE_KAFKA_BROKERS unset: found by its layout
        assert status.returncode == 0, status.stdout
        assert f"is up at {bootstrap}, 3 brokers" in status.stdout
        again = sluice("kafka", "up", "--brokers", "3", env=env)
        assert "already running" in again.stdout
        single = sluice("kafka", "up", env=env)
        assert single.returncode == 1
        assert "3 broker(s) runs at" in single.stderr
        # a node crashes: status says which part is missing, `up` brings back only that one
        layout = read_layout(tmp_path / "data" / "kafka")
        assert layout is not None
        third = int((tmp_path / "data" / "kafka" / "node-3" / "broker.pid").read_text())
        os.kill(third, signal.SIGKILL)
        _wait_for("the killed node's exit", lambda: not pid_alive(third), 10, every=0.05)
        degraded = sluice("kafka", "status", env=env)
        assert degraded.returncode == 1
        assert "is degraded: " in degraded.stdout
        assert "`sluice kafka up --brokers 3` restarts the missing ones" in degraded.stdout
        back = sluice("kafka", "up", "--brokers", "3", env=env)
        assert back.returncode == 0, back.stderr
        pids = [
            int((tmp_path / "data" / "kafka" / f"node-{i}" / "broker.pid").read_text()) for i in (1, 2, 3)
        ]
        assert pids[2] != third
        assert sluice("kafka", "status", env=env).returncode == 0
        assert read_layout(tmp_path / "data" / "kafka") == layout  # restarted as formatted
    finally:
        down = sluice("kafka", "down", env=env)
    assert down.returncode == 0, down.stderr
    assert "Kafka stopped (3 brokers)" in down.stdout
    status = sluice("kafka", "status", env=env)
    assert status.returncode == 1
    assert "down" in status.stdout
    kept = (tmp_path / "data" / "kafka").iterdir()
    assert sorted(p.name for p in kept if p.name != ".cluster.lock") == [  # the layout's lock: empty
        "cluster.json",
        "node-1",
        "node-2",
        "node-3",
    ]


# ---------------------------------------------------------------- a real three-node cluster


@pytest.fixture(scope="module")
def cluster(
    platform_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LocalKafkaCluster]:
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: no local cluster to run")
    nodes = LocalKafkaCluster(
        data_dir=tmp_path_factory.mktemp("cluster"),
        cache_dir=platform_settings.cache_dir,
        version=platform_settings.kafka_version,
        ports=[(free_port(), free_port()) for _ in range(3)],
        heap="512m",
        start_timeout=60,
    )
    started = time.monotonic()
    nodes.start()
    print(f"3-node cluster up in {time.monotonic() - started:.1f}s")
    try:
        yield nodes
    finally:
        stopping = time.monotonic()
        nodes.stop()
        print(f"3-node cluster stopped in {time.monotonic() - stopping:.1f}s")


def _wait_for(what: str, check: Callable[[], bool], within: float, every: float = 0.2) -> float:
    """Poll ``check`` until it holds; return the seconds it took, fail the test after ``within``."""
    started = time.monotonic()
    while not check():
        if time.monotonic() - started > within:
            pytest.fail(f"{what} did not happen within {within:.0f}s")
        time.sleep(every)
    return time.monotonic() - started


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_replicated_topics_on_three_brokers(cluster: LocalKafkaCluster, topic_prefix: str) -> None:
    assert cluster.running()
    assert live_brokers(cluster.connection) == 3
    for node in cluster.nodes:  # every node answers on its own, with the whole cluster's metadata
        assert live_brokers(node.connection) == 3
    specs = platform_topics(TopicNames(topic_prefix), ["m"], TopicSizing(replication=3))
    admin = make_admin(cluster.connection)
    changes = apply_topics(admin, specs)
    assert [c.action for c in changes] == ["created"] * len(specs)
    names = [spec.name for spec in specs]
    # Created by the controller; the broker answering a metadata request may learn of them a moment later,
    # and the next request may go to another broker that has not yet (CI saw a topic listed, then not):
    # the checks read the one answer that listed them all, each partition with its leader.
    seen: list[Any] = []

    def listed() -> bool:
        answer = admin.list_topics(timeout=10)
        topics = [answer.topics.get(name) for name in names]
        if any(t is None or any(p.leader < 0 for p in t.partitions.values()) for t in topics):
            return False
        seen.append(answer)
        return True

    _wait_for("every topic in the metadata, with its leaders", listed, 30)
    metadata = seen[-1]
    for spec in specs:
        partitions = metadata.topics[spec.name].partitions
        assert len(partitions) == spec.partitions
        assert all(sorted(p.replicas) == [1, 2, 3] for p in partitions.values())
        assert {p.leader for p in partitions.values()} <= {1, 2, 3}
    assert under_replicated(admin, names) == []
    resources = [ConfigResource(ConfigResource.Type.TOPIC, name) for name in names]
    configs: dict[Any, Any] = {}

    def described() -> bool:  # the broker asked may not know a new topic yet either (CI saw it once)
        for resource, future in admin.describe_configs(resources, request_timeout=10).items():
            try:
                configs[resource] = future.result()
            except KafkaException as exc:
                if exc.args[0].code() != KafkaError.UNKNOWN_TOPIC_OR_PART:
                    raise
                return False
        return True

    _wait_for("every topic's configuration", described, 30)
    for resource, config in configs.items():
        assert config["min.insync.replicas"].value == "2", resource
        assert config["unclean.leader.election.enable"].value == "false", resource
    # Leadership is spread: one broker's loss moves some partitions, not all of them.
    leaders = {p.leader for spec in specs for p in metadata.topics[spec.name].partitions.values()}
    assert leaders == {1, 2, 3}


class _Acks:
    """Delivery reports of an EventProducer: value -> (partition, offset), and every error."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.delivered: dict[bytes, Position] = {}
        self.errors: list[BusError] = []

    def produce(self, producer: EventProducer, topic: str, values: list[bytes], partitions: int) -> None:
        for i, value in enumerate(values):

            def report(err: BusError | None, where: Position | None, value: bytes = value) -> None:
                with self.lock:
                    if err is not None:
                        self.errors.append(err)
                    elif where is not None:
                        self.delivered[value] = where

            producer.produce_raw(topic, value, key=value, partition=i % partitions, on_delivery=report)

    def settled(self, count: int) -> bool:
        with self.lock:
            return len(self.delivered) + len(self.errors) >= count


class _Reader:
    """A consumer group member reading the topic as it is written (committing as it goes): the values it
    has seen, by partition and offset."""

    def __init__(self, cluster: LocalKafkaCluster, topic: str, group: str) -> None:
        self.consumer = Consumer(consumer_config(cluster.connection, group, "cluster-test-reader"))
        self.consumer.subscribe([topic])
        self.read: dict[tuple[int, int], bytes] = {}

    def values(self) -> set[bytes]:
        return set(self.read.values())

    def read_until(self, count: int) -> bool:
        messages = [m for m in self.consumer.consume(500, 0.2) if m.error() is None]
        for msg in messages:
            where = (msg.partition() or 0, msg.offset() or 0)
            assert self.read.setdefault(where, msg.value() or b"") == msg.value(), where  # re-read: the same
            self.consumer.store_offsets(msg)
        if messages:
            self.consumer.commit(asynchronous=True)
        return len(self.values()) >= count


def _scan(cluster: LocalKafkaCluster, topic: str, partitions: int) -> dict[int, list[tuple[int, bytes]]]:
    """Every record of ``topic`` from the start to the end of each partition, as (offset, value)."""
    consumer = Consumer(consumer_config(cluster.connection, None, "cluster-test-scan"))
    try:
        ends = [
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions)
        ]
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        log: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(partitions)}

        def read_to_the_end() -> bool:
            for msg in consumer.consume(500, 0.2):
                if msg.error() is None:
                    log[msg.partition() or 0].append((msg.offset() or 0, msg.value() or b""))
            return all(len(log[p]) >= ends[p] for p in range(partitions))

        _wait_for("reading the topic back from the start", read_to_the_end, 30)
        return log
    finally:
        consumer.close()


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_a_broker_killed_with_sigkill_loses_nothing_and_rejoins(
    cluster: LocalKafkaCluster, topic_prefix: str
) -> None:
    names = TopicNames(topic_prefix)
    specs = platform_topics(names, ["m"], TopicSizing(replication=3))
    admin = make_admin(cluster.connection)
    apply_topics(admin, specs)
    topic = names.requests("m")
    partitions = next(spec.partitions for spec in specs if spec.name == topic)
    acks = _Acks()
    reader = _Reader(cluster, topic, f"{topic_prefix}-readers")
    producer = EventProducer(cluster.connection, "cluster-test")
    batch = 300
    try:
        with producer:
            before = [f"before-{i}".encode() for i in range(batch)]
            acks.produce(producer, topic, before, partitions)
            _wait_for("acks before the kill", lambda: acks.settled(batch), 30)
            _wait_for("reading what was sent before the kill", lambda: reader.read_until(batch), 30)

            # Kill the broker that leads the most partitions of the topic: their leadership must move.
            meta = admin.list_topics(topic, timeout=10).topics[topic].partitions.values()
            victim = max((1, 2, 3), key=lambda node: sum(p.leader == node for p in meta))
            killed_at = time.monotonic()
            cluster.kill(victim)
            assert cluster.node(victim).pid() is None
            assert not cluster.running()
            after = [f"after-{i}".encode() for i in range(batch)]
            acks.produce(producer, topic, after, partitions)
            during = _wait_for("acks while a broker is down", lambda: acks.settled(2 * batch), 45)
            _wait_for("reading while a broker is down", lambda: reader.read_until(2 * batch), 30)
            assert live_brokers(cluster.connection) == 2
            print(f"killed node {victim}; every write acknowledged {during:.1f}s after the kill")

            cluster.restart(victim)
            restarted = time.monotonic() - killed_at
            names_all = [spec.name for spec in specs]
            caught_up = _wait_for(
                "no under-replicated partition after the restart",
                lambda: under_replicated(admin, names_all) == [],
                45,
                every=0.5,
            )
            print(f"node {victim} back {restarted:.1f}s after the kill; in sync {caught_up:.1f}s after that")
            assert cluster.running()
            assert live_brokers(cluster.connection) == 3

            rejoined = [f"rejoined-{i}".encode() for i in range(batch)]
            acks.produce(producer, topic, rejoined, partitions)
            _wait_for("acks after the rejoin", lambda: acks.settled(3 * batch), 30)
            _wait_for("reading after the rejoin", lambda: reader.read_until(3 * batch), 30)
    finally:
        reader.consumer.close()

    assert acks.errors == []
    sent = before + after + rejoined
    assert set(acks.delivered) == set(sent)
    assert reader.values() == set(sent)  # the group read on through the kill and the rejoin
    # Exactly once, in order, per partition: each partition holds what was acknowledged there, nothing else.
    log = _scan(cluster, topic, partitions)
    for partition in range(partitions):
        acknowledged = sorted(
            (offset, value) for value, (p, offset) in acks.delivered.items() if p == partition
        )
        assert log[partition] == acknowledged, f"partition {partition}"
        held = [value for _, value in acknowledged]
        for phase in (before, after, rejoined):  # sent in order, kept in order
            in_phase, here = set(phase), set(held)
            assert [v for v in held if v in in_phase] == [v for v in phase if v in here]
    assert sum(len(records) for records in log.values()) == len(sent)
