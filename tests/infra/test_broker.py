from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer

from infra.kafka.broker import BrokerError, LocalKafka, _ephemeral_low, free_port
from infra.topics import TopicSpec, apply_topics, make_admin
from schemas.settings import PlatformSettings
from tests.conftest import own_broker
from tests.processes import dies_with_killed_parent


def _broker(settings: PlatformSettings, data_dir: Path, port: int) -> LocalKafka:
    return LocalKafka(
        data_dir=data_dir,
        cache_dir=settings.cache_dir,
        version=settings.kafka_version,
        port=port,
        controller_port=free_port(),
    )


@pytest.mark.integration
def test_data_survives_a_restart(platform_settings: PlatformSettings, tmp_path: Path) -> None:
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: no local broker to restart")
    broker = _broker(platform_settings, tmp_path, free_port())
    with broker:
        assert broker.running()
        apply_topics(
            make_admin(broker.connection), [TopicSpec(name="keep", partitions=1, config={}, purpose="")]
        )
        producer = Producer(broker.connection.client_config(acks="all"))
        producer.produce("keep", b"survives", key=b"k")
        assert producer.flush(10) == 0
    assert not broker.running()
    assert broker.pid() is None
    with broker:
        consumer = Consumer(
            broker.connection.client_config(**{"group.id": "g", "auto.offset.reset": "earliest"})
        )
        consumer.subscribe(["keep"])
        try:
            msg = None
            for _ in range(60):
                msg = consumer.poll(0.5)
                if msg is not None and msg.error() is None:
                    break
            assert msg is not None
            assert msg.value() == b"survives"
        finally:
            consumer.close()


@pytest.mark.integration
def test_taken_port_is_a_clear_error(
    platform_settings: PlatformSettings, kafka_bootstrap: str, tmp_path: Path
) -> None:
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: its port is not ours to test")
    port = int(kafka_bootstrap.rsplit(":", 1)[1])
    with pytest.raises(BrokerError, match=f"port {port} is taken"):
        _broker(platform_settings, tmp_path, port).start()


def test_free_ports_are_below_the_kernels_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(port < low for port in ports)
    assert len(ports) > 1  # chosen at random, so parallel tests rarely meet
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free when handed out


def test_stop_reaches_a_node_another_process_started_after_a_crash(tmp_path: Path) -> None:
    """``sluice up`` started the node; it was killed with -9 and ``sluice kafka up`` started it again (a new
    pid in its pid file). Before, stopping ``sluice up`` signalled only the dead process it had started,
    and the new JVM outlived the platform (CI leaked one per failure test)."""

    node = LocalKafka(tmp_path, tmp_path / "cache", "4.3.1", port=19192, controller_port=19193)
    first = subprocess.Popen([sys.executable, "-c", "pass"])
    first.wait()
    node._proc = first  # what this object started: gone
    again = subprocess.Popen(  # named like the node's JVM: by its server.properties
        [sys.executable, "-c", "import time; time.sleep(60)", str(tmp_path / "server.properties")]
    )
    try:
        named = os.fsencode(tmp_path / "server.properties")
        deadline = (
            time.monotonic() + 10
        )  # exec'd: a process just forked still shows its parent's command line
        while named not in Path(f"/proc/{again.pid}/cmdline").read_bytes().split(b"\0"):
            assert time.monotonic() < deadline, "the stand-in JVM did not start"
            time.sleep(0.01)
        node.pid_file.write_text(str(again.pid))  # what the other process started
        began = time.monotonic()
        node.stop(stop_timeout=10)
        assert again.wait(timeout=5) is not None
        assert time.monotonic() - began < 10, "stopped by SIGTERM, not by the timeout's SIGKILL"
        assert not node.pid_file.exists()
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()


@pytest.mark.integration
def test_sluice_ups_broker_dies_with_it_even_after_a_kill_9(
    platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    """Before, a `kill -9` of `sluice up` left its Kafka JVM running, and the next `sluice up` took it for
    one `sluice kafka up` started ("left running on exit"). A broker launched with ``die_with_parent``
    gets SIGTERM when its launcher dies; `sluice kafka up`'s does not (it outlives the command)."""
    script = (
        "import sys\n"
        "from infra.kafka.broker import LocalKafka, free_port\n"
        "broker = LocalKafka(sys.argv[1], sys.argv[2], sys.argv[3], port=free_port(), controller_port=free_port())\n"
        "broker.die_with_parent = True\n"
        "broker.launch()\n"
        "print(broker._proc.pid, flush=True)\n"
        "import time; time.sleep(120)\n"
    )
    args = [str(tmp_path), platform_settings.cache_dir, platform_settings.kafka_version]
    assert dies_with_killed_parent(script, *args, within_s=20), (
        "the JVM outlived the process that launched it"
    )


@pytest.mark.integration
def test_a_second_start_while_the_node_starts_keeps_the_first_jvm(
    platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    """Two `sluice kafka up` at once, or `sluice up` beside a `sluice kafka up`: the second start launched
    another JVM on the node's data dir, and the first died of a corrupt metadata log or lost its pid file
    (a review). It waits for the first now."""
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: no local broker to start")
    port, controller = free_port(), free_port()

    def node() -> LocalKafka:
        return LocalKafka(
            tmp_path, platform_settings.cache_dir, platform_settings.kafka_version, port=port,
            controller_port=controller, start_timeout=60,
        )  # fmt: skip

    first, second = node(), node()
    try:
        first.launch()  # the first start's JVM, not listening yet
        pid = first.pid()
        assert pid is not None
        time.sleep(0.5)
        second.start()
        assert first.exit_code() is None, "the node's first JVM died (a second JVM on its data dir)"
        assert second.pid() == pid, "the pid file does not name the node's JVM"
    finally:
        first.stop()
        second.stop()


def test_the_test_suites_own_brokers_die_with_the_test_process(
    platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    """A pytest (or xdist worker) killed by a CI timeout or a cancelled job runs no fixture teardown, and
    the session broker's JVM, in a session of its own, outlived it (a review)."""
    assert own_broker(platform_settings, tmp_path).die_with_parent


@pytest.mark.integration
def test_a_test_brokers_jvm_dies_with_a_killed_test_process(
    platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: no local broker of the test's own")
    script = (
        "import sys\n"
        "from pathlib import Path\n"
        "from schemas.settings import PlatformSettings, load_settings\n"
        "from tests.conftest import own_broker\n"
        "broker = own_broker(load_settings(PlatformSettings), Path(sys.argv[1]))\n"
        "broker.launch()\n"  # what broker.start() does first, in the fixture
        "print(broker.pid(), flush=True)\n"
        "import time; time.sleep(120)\n"
    )
    gone = dies_with_killed_parent(script, str(tmp_path), within_s=20)
    if not gone:  # what the test left
        os.kill(int((tmp_path / "broker.pid").read_text()), signal.SIGKILL)
    assert gone, "the test broker's JVM outlived the killed test process"
