"""A single-node KRaft Kafka broker run with the machine's JDK: format, configure, start, wait, stop."""

from __future__ import annotations

import base64
import logging
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path

from infra.errors import InfraError
from infra.kafka.dist import fetch_kafka
from schemas.lifecycle import Component
from schemas.settings import KafkaConnection

# Small internal topics keep a one-node broker quick to start and quick to serve its first consumer group.
_SERVER_PROPERTIES = """\
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
"""

_LOG4J2 = """\
status = warn
appender.console.type = Console
appender.console.name = STDOUT
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = {level}
rootLogger.appenderRef.stdout.ref = STDOUT
logger.kafka.name = kafka
logger.kafka.level = {level}
logger.apache.name = org.apache.kafka
logger.apache.level = {level}
"""


class BrokerError(InfraError):
    """The local broker failed to start, answer or stop."""


def _ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections (``ip_local_port_range``)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A loopback port nothing listens on now, for a server started a moment later.

    Chosen below the kernel's ephemeral range: a port the kernel picks (``bind(0)``) is one it may also give
    the next outgoing connection of any process, which then holds it when the server binds (CI saw a
    broker's controller fail with "Address already in use" that way)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(10_000, low - 1) if low > 11_000 else 0  # port + 1 too (a default controller)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    with socket.socket() as sock:  # everything tried was taken: let the kernel choose
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class LocalKafka(Component):
    """One KRaft broker+controller on 127.0.0.1 whose data lives in ``data_dir`` across restarts.

    ``start()`` returns once the broker answers a metadata request; ``stop()`` sends SIGTERM and waits
    for a clean shutdown (SIGKILL after ``stop_timeout``). A broker started by another process is found
    again through its pid file, so ``sluice kafka down`` stops what ``sluice kafka up`` started.
    """

    def __init__(
        self,
        data_dir: str | Path,
        cache_dir: str | Path,
        version: str,
        port: int = 9092,
        controller_port: int | None = None,
        heap: str = "768m",
        log_level: str = "WARN",
        progress: Callable[[str], None] | None = None,
        start_timeout: float = 90.0,
        extra_properties: Mapping[str, str] | None = None,
    ) -> None:
        """``extra_properties`` are appended to ``server.properties`` (a key given again wins), e.g. a
        ``SASL_PLAINTEXT`` listener beside the ``PLAINTEXT`` one this class waits on."""
        super().__init__()
        self.data_dir = Path(data_dir).expanduser()
        self.cache_dir = Path(cache_dir).expanduser()
        self.version = version
        self.port = port
        self.controller_port = controller_port if controller_port is not None else port + 1
        self.heap = heap
        self.log_level = log_level
        self.progress = progress
        self.start_timeout = start_timeout
        self.extra_properties = dict(extra_properties or {})
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def connection(self) -> KafkaConnection:
        """How clients reach this broker (its ``PLAINTEXT`` listener)."""
        return KafkaConnection(self.bootstrap)

    @property
    def log_file(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def pid_file(self) -> Path:
        return self.data_dir / "broker.pid"

    def pid(self) -> int | None:
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def running(self) -> bool:
        return self.pid() is not None and port_open(self.port)

    def _format(self, home: Path, props: Path) -> None:
        log_dir = self.data_dir / "logs"
        if (log_dir / "meta.properties").exists():
            return
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        result = subprocess.run(
            [
                "java",
                "-cp",
                f"{home / 'libs'}/*",
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",  # one token: an id may start with "-"
                "-c",
                str(props),
                "--standalone",
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            raise BrokerError(f"formatting KRaft storage in {log_dir} failed:\n{result.stderr[-2000:]}")

    def _start(self) -> None:
        if self.running():
            return
        if port_open(self.port):
            raise BrokerError(f"port {self.port} is taken by another program; set SLUICE_KAFKA_PORT")
        home = fetch_kafka(self.cache_dir, self.version, self.progress)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self.data_dir / "server.properties"
        extra = "".join(f"{key}={value}\n" for key, value in self.extra_properties.items())
        props.write_text(
            _SERVER_PROPERTIES.format(
                port=self.port, controller_port=self.controller_port, log_dir=self.data_dir / "logs"
            )
            + extra
        )
        log4j = self.data_dir / "log4j2.properties"
        log4j.write_text(_LOG4J2.format(level=self.log_level))
        self._format(home, props)
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [
                    "java",
                    f"-Xmx{self.heap}",
                    "-Xms128m",
                    "-XX:+UseG1GC",
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={log4j}",
                    "-cp",
                    f"{home / 'libs'}/*",
                    "kafka.Kafka",
                    str(props),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it cleanly
            )
        self.pid_file.write_text(str(self._proc.pid))
        self._wait_ready(self.start_timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise BrokerError(f"Kafka exited with {self._proc.returncode}:\n{self.log_tail()}")
            if port_open(self.port) and broker_answers(self.connection):
                return
            time.sleep(0.2)
        self.stop()
        raise BrokerError(
            f"Kafka did not answer on {self.bootstrap} within {timeout:.0f}s:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no broker log)"

    def stop(self, stop_timeout: float = 30.0) -> None:
        pid = self._proc.pid if self._proc is not None else self.pid()
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + stop_timeout
            while self._exited(pid) is False and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self._exited(pid):
                os.kill(pid, signal.SIGKILL)
                while not self._exited(pid):
                    time.sleep(0.05)
        self._proc = None
        self.pid_file.unlink(missing_ok=True)

    def _exited(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is not None
        return not pid_alive(pid)


def broker_answers(kafka: KafkaConnection, timeout: float = 2.0) -> bool:
    """True when a Kafka metadata request to ``kafka`` succeeds."""
    from infra.topics import make_admin

    admin = make_admin(kafka, log_level=0, logger=_SILENT)
    try:
        admin.list_topics(timeout=timeout)
    except Exception:
        return False
    return True


_SILENT = logging.getLogger("sluice.kafka.probe")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False
