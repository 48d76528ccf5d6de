"""Local KRaft Kafka run with the machine's JDK: one node (:class:`LocalKafka`: format, configure, start,
wait, stop) or a cluster of them (:class:`LocalKafkaCluster`), every node a broker and a controller."""

from __future__ import annotations

import base64
import contextlib
import errno
import logging
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from infra.children import die_with
from infra.errors import InfraError
from infra.kafka.dist import fetch_kafka
from infra.locks import exclusive
from schemas.lifecycle import Component
from schemas.settings import KafkaConnection

if TYPE_CHECKING:
    from confluent_kafka.admin import ClusterMetadata

# Small internal topics keep a node quick to start and quick to serve its first consumer group.
_SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id={node_id}
controller.quorum.bootstrap.servers={controllers}
listeners=PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
log.dirs={log_dir}
auto.create.topics.enable=false
num.partitions=1
offsets.topic.replication.factor={replication}
offsets.topic.num.partitions=8
transaction.state.log.replication.factor={replication}
transaction.state.log.min.isr={min_isr}
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor={replication}
share.coordinator.state.topic.min.isr={min_isr}
group.initial.rebalance.delay.ms=0
log.retention.check.interval.ms=60000
num.network.threads={network_threads}
num.io.threads={io_threads}
"""

# A cluster's own defaults: a topic created without a replication factor gets the cluster's, an acks=all
# write needs min.insync.replicas copies, and a replica that fell behind never becomes leader.
_REPLICATED_PROPERTIES = """\
default.replication.factor={replication}
min.insync.replicas={min_isr}
unclean.leader.election.enable=false
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


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on ``host:port`` now (bound as servers bind: with ``SO_REUSEADDR``, so
    a port left in TIME_WAIT counts as free). A host this machine cannot bind at all is not this check's to
    report: the server says so."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, IndexError):
        return True
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.errno != errno.EADDRINUSE
    return True


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` runs; an exited one its parent has not reaped yet (a zombie) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_fields(pid)
    return fields is None or fields[0] not in ("Z", "X")


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (1 once it is orphaned); None when it cannot be read."""
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None and fields[1].isdigit() else None


def _stat_fields(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat`` after the command name (state, ppid, ...); None when it cannot be read. The
    line is "pid (comm) state ...", and comm may hold spaces and parentheses."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if len(fields) >= 2 else None


def kafka_uuid() -> str:
    """A random Kafka ``Uuid`` in its base64 form (a cluster or directory id), never starting with "-" (as
    Kafka's own ``random-uuid``), so it reads as a value on a command line."""
    while True:
        text = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not text.startswith("-"):
            return text


def replication_for(brokers: int) -> tuple[int, int]:
    """Replication factor and ``min.insync.replicas`` of a cluster of ``brokers`` nodes: three copies (or
    as many as there are nodes), an ``acks=all`` write on all but one of them."""
    replication = min(brokers, 3)
    return replication, max(1, replication - 1)


class NodeLayout(msgspec.Struct, frozen=True, kw_only=True):
    """One node of a local cluster: its id, its client and controller ports on 127.0.0.1, and the directory
    id its metadata log dir is formatted with."""

    node_id: int
    port: int
    controller_port: int
    directory_id: str


class ClusterLayout(msgspec.Struct, frozen=True, kw_only=True):
    """A local cluster as its storage is formatted: one cluster id, and the nodes, which are all the KRaft
    controllers (the voter set is fixed when the nodes are formatted with ``--initial-controllers``)."""

    cluster_id: str
    nodes: tuple[NodeLayout, ...]

    @classmethod
    def new(cls, ports: Sequence[tuple[int, int]]) -> ClusterLayout:
        """Fresh ids for nodes 1..N on ``ports`` ((client, controller) per node)."""
        return cls(
            cluster_id=kafka_uuid(),
            nodes=tuple(
                NodeLayout(node_id=i, port=port, controller_port=controller, directory_id=kafka_uuid())
                for i, (port, controller) in enumerate(ports, start=1)
            ),
        )

    @property
    def ports(self) -> list[tuple[int, int]]:
        return [(node.port, node.controller_port) for node in self.nodes]

    @property
    def initial_controllers(self) -> str:
        """``kafka-storage format --initial-controllers``: ``id@host:port:directory-id`` of every node."""
        return ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}:{n.directory_id}" for n in self.nodes)


def request_threads(cores: int) -> tuple[int, int]:
    """A local node's network and request-handler threads for ``cores`` usable cores: one of each per 4
    and per 2 (Kafka's defaults, 3 and 8, are a server's). On 2 shared cores (``kafka_floor.py``, 3
    alternating pairs) 1 and 1 took the two-hop round trip from 1.39-1.43 to 1.15-1.17 ms p50, the broker's
    CPU a request from 2.1-2.2 to 1.9 ms at one in flight and from 0.044-0.047 to 0.032-0.034 ms at 64,
    where it served 20-21k instead of 15-16k round trips a second: fewer threads to hand a request between
    and to wake."""
    return max(1, cores // 4), max(1, cores // 2)


LAUNCH_LOCK = ".launch.lock"
"""A node's launch lock, in its data dir (see :meth:`LocalKafka.launch`)."""

LOCAL_JVM_OPTIONS = ("-XX:TieredStopAtLevel=1",)
"""JVM options of every local node: the client compiler only. A local node is short-lived (a test, a
benchmark, a development ``sluice up``) and its first minutes under load went to C2 compiling: on 2 cores
the broker took 0.45 cores at a generation load where its request handling took 0.15, and with C1 alone
0.20, with the same handling cost and 10-15 % more platform throughput (docs/perf). A production cluster
is not started by this class."""


class LocalKafka(Component):
    """One KRaft broker+controller on 127.0.0.1 whose data lives in ``data_dir`` across restarts.

    ``start()`` returns once the broker answers a metadata request; ``stop()`` sends SIGTERM and waits
    for a clean shutdown (SIGKILL after ``stop_timeout``). A broker started by another process is found
    again through its pid file, so ``sluice kafka down`` stops what ``sluice kafka up`` started, and a
    start beside it waits for it rather than launching a second JVM on its data (see :meth:`launch`).
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
        node_id: int = 1,
        cluster: ClusterLayout | None = None,
    ) -> None:
        """``extra_properties`` are appended to ``server.properties`` (a key given again wins), e.g. a
        ``SASL_PLAINTEXT`` listener beside the ``PLAINTEXT`` one this class waits on. ``cluster``: this node
        is node ``node_id`` of that layout (on that node's ports), formatted with the cluster's id and voter
        set; None: a node on its own, its controller the only voter (``--standalone``)."""
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
        self.node_id = node_id
        self.cluster = cluster
        if cluster is not None and (node_id, self.port, self.controller_port) not in {
            (n.node_id, n.port, n.controller_port) for n in cluster.nodes
        }:
            raise ValueError(
                f"node {node_id} on ports {self.port}/{self.controller_port} is not in {cluster}"
            )
        self._proc: subprocess.Popen[bytes] | None = None
        self.die_with_parent = False
        """The JVM gets SIGTERM when the process (thread) that launched it dies, a ``kill -9`` included:
        ``sluice up``'s broker; not ``sluice kafka up``'s, which outlives the command by design."""

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
        """The pid of this node's running JVM, from its pid file. A file naming a live process that is not
        this node's JVM (a reboot or a crash left it, and the pid went to another program) is stale: it is
        removed, so nothing signals that program."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if not pid_alive(pid):
            return None
        if not self._runs_this_node(pid):
            self.pid_file.unlink(missing_ok=True)
            return None
        return pid

    def _runs_this_node(self, pid: int) -> bool:
        """Whether process ``pid`` was started with this node's ``server.properties`` (see :meth:`launch`)."""
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            return not Path("/proc/self").exists()  # no procfs to ask: trust the pid file
        except OSError:
            return False
        return os.fsencode(self.data_dir / "server.properties") in args

    def running(self) -> bool:
        return self.pid() is not None and port_open(self.port)

    def server_properties(self) -> str:
        """The ``server.properties`` this node runs with."""
        nodes = (self.node_id,) if self.cluster is None else tuple(n.node_id for n in self.cluster.nodes)
        controllers = (
            [self.controller_port]
            if self.cluster is None
            else [n.controller_port for n in self.cluster.nodes]
        )
        replication, min_isr = replication_for(len(nodes))
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        network_threads, io_threads = request_threads(cores)
        text = _SERVER_PROPERTIES.format(
            network_threads=network_threads,
            io_threads=io_threads,
            node_id=self.node_id,
            controllers=",".join(f"127.0.0.1:{port}" for port in controllers),
            port=self.port,
            controller_port=self.controller_port,
            log_dir=self.data_dir / "logs",
            replication=replication,
            min_isr=min_isr,
        )
        if len(nodes) > 1:
            text += _REPLICATED_PROPERTIES.format(replication=replication, min_isr=min_isr)
        return text + "".join(f"{key}={value}\n" for key, value in self.extra_properties.items())

    def write_config(self) -> Path:
        """Write ``server.properties`` and the log4j2 config into the data dir; return the former."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        props = self.data_dir / "server.properties"
        props.write_text(self.server_properties())
        (self.data_dir / "log4j2.properties").write_text(_LOG4J2.format(level=self.log_level))
        return props

    def _format(self, home: Path, props: Path) -> None:
        log_dir = self.data_dir / "logs"
        if (log_dir / "meta.properties").exists():
            return
        if self.cluster is None:
            cluster_id, quorum = kafka_uuid(), "--standalone"
        else:  # every node of a cluster: the same cluster id and the same voters
            cluster_id = self.cluster.cluster_id
            quorum = f"--initial-controllers={self.cluster.initial_controllers}"
        result = subprocess.run(
            [
                "java",
                "-cp",
                f"{home / 'libs'}/*",
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",
                "-c",
                str(props),
                quorum,
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
        self.launch()
        self._wait_ready(self.start_timeout)

    def launch(self) -> bool:
        """Configure, format (the first time) and start the JVM, without waiting for it to answer: the nodes
        of a cluster all start before any can serve (its controllers need a majority). Whether it launched
        one: not when this node's JVM is alive already but not listening yet (starting, recovering its logs,
        shutting down), whoever launched it. A second JVM on the node's data dir corrupted its metadata log
        or died on its ports, and the failed start then stopped the first (a review), so the start waits
        for that one instead. The node's launch lock is held from that check until the pid file names the
        new JVM, so two starts at once launch one JVM between them and format the storage once."""
        if self.exit_code() is not None:
            self._proc = None  # the JVM an earlier start launched has exited: only the pid file counts
        with exclusive(self.data_dir / LAUNCH_LOCK):
            if self.pid() is not None:
                return False
            self._launch()
        return True

    def _launch(self) -> None:
        if port_open(self.port):
            raise BrokerError(f"port {self.port} is taken by another program; set SLUICE_KAFKA_PORT")
        if port_open(self.controller_port):
            raise BrokerError(
                f"port {self.controller_port} (Kafka's controller, after its client port {self.port}) is taken "
                "by another program; set SLUICE_KAFKA_PORT"
            )
        home = fetch_kafka(self.cache_dir, self.version, self.progress)
        props = self.write_config()
        self._format(home, props)
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [
                    "java",
                    f"-Xmx{self.heap}",
                    "-Xms128m",
                    "-XX:+UseG1GC",
                    *LOCAL_JVM_OPTIONS,
                    "-Djava.awt.headless=true",
                    f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
                    "-cp",
                    f"{home / 'libs'}/*",
                    "kafka.Kafka",
                    str(props),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # Ctrl-C in a terminal reaches us, and we stop it cleanly
                preexec_fn=die_with(os.getpid()) if self.die_with_parent else None,
            )
        self.pid_file.write_text(str(self._proc.pid))

    def exit_code(self) -> int | None:
        """The exit status of the JVM this object started, once it has exited; None while it runs, or when
        this object started none."""
        return None if self._proc is None else self._proc.poll()

    def runs_own_jvm(self) -> bool:
        """Whether the JVM this object launched runs (not one another process launched on its data)."""
        return self._proc is not None and self._proc.poll() is None

    def raise_if_exited(self) -> None:
        """Raise BrokerError (with the log's tail) if the JVM this object started has exited."""
        if self._proc is not None and self._proc.poll() is not None:
            raise BrokerError(
                f"Kafka node {self.node_id} exited with {self._proc.returncode}:\n{self.log_tail()}"
            )

    def keep_launched(self) -> bool:
        """During a start: raise if the JVM this object launched has exited; launch one if the node's JVM
        that another process launched has exited before it answered (it was shutting down; or it failed,
        and then ours fails and says why). Whether it launched one."""
        self.raise_if_exited()
        if self._proc is None and self.pid() is None and not port_open(self.port):
            return self.launch()
        return False

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.keep_launched()
            if port_open(self.port) and broker_answers(self.connection):
                return
            time.sleep(0.2)
        pid = self.pid()
        if self._proc is None and pid is not None:
            raise BrokerError(
                f"Kafka node {self.node_id}'s JVM (pid {pid}, launched by another process) runs but did not "
                f"answer on {self.bootstrap} within {timeout:.0f}s; it is left running (`sluice kafka down` "
                f"stops it), its log: {self.log_file}\n{self.log_tail()}"
            )
        raise BrokerError(
            f"Kafka did not answer on {self.bootstrap} within {timeout:.0f}s:\n{self.log_tail()}"
        )

    def _undo_start(self) -> None:
        """A failed start stops the JVM this object launched, and no other: a JVM of this node that another
        process launched (found starting, and waited on) stays, as does one launched after ours died."""
        if self.runs_own_jvm():
            self.stop()
        else:
            self.forget_exited()

    def forget_exited(self) -> None:
        """Drop the JVM this object launched once it has exited, with the pid file while that names it."""
        if self._proc is None or self._proc.poll() is None:
            return
        with contextlib.suppress(FileNotFoundError, ValueError):
            if int(self.pid_file.read_text().strip()) == self._proc.pid:
                self.pid_file.unlink()
        self._proc = None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no broker log)"

    def stop(self, stop_timeout: float = 30.0) -> None:
        self.terminate()
        self.wait_stopped(stop_timeout)

    def terminate(self) -> None:
        """Ask the JVM to shut down cleanly (SIGTERM) and return at once; :meth:`wait_stopped` waits."""
        self._signal(signal.SIGTERM)

    def kill(self, timeout: float = 10.0) -> None:
        """Crash the JVM (SIGKILL: no controlled shutdown, no flush) and wait until it is gone; its data
        stays, so :meth:`start` brings the node back. For failure tests."""
        self._signal(signal.SIGKILL)
        self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float) -> None:
        """Wait until the JVM has exited, SIGKILL it after ``timeout`` seconds; remove the pid file."""
        pid = self._live_pid()
        if pid is not None:
            deadline = time.monotonic() + timeout
            while not self._exited(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if not self._exited(pid):
                self._signal(signal.SIGKILL)
                while not self._exited(pid):
                    time.sleep(0.05)
        self._proc = None
        self.pid_file.unlink(missing_ok=True)

    def _live_pid(self) -> int | None:
        """The node's running JVM: the one this object started, or, once that one has died, the one its pid
        file names (a node killed and started again by another process, e.g. ``sluice kafka up``)."""
        for pid in (self._proc.pid if self._proc is not None else None, self.pid()):
            if pid is not None and not self._exited(pid):
                return pid
        return None

    def _signal(self, sig: signal.Signals) -> None:
        pid = self._live_pid()
        if pid is not None:
            with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
                os.kill(pid, sig)

    def _exited(self, pid: int) -> bool:
        if self._proc is not None and self._proc.pid == pid:
            return self._proc.poll() is not None
        return not pid_alive(pid)


CLUSTER_FILE = "cluster.json"
LAYOUT_LOCK = ".cluster.lock"
"""A cluster's layout lock, in its data dir: held while a start reads and records the layout."""


def read_layout(data_dir: str | Path) -> ClusterLayout | None:
    """The layout of the multi-node cluster formatted under ``data_dir``, or None if there is none."""
    path = Path(data_dir).expanduser() / CLUSTER_FILE
    try:
        return msgspec.json.decode(path.read_bytes(), type=ClusterLayout)
    except FileNotFoundError:
        return None
    except msgspec.DecodeError as exc:
        raise BrokerError(
            f"{path} is not a cluster layout ({exc}); delete it with the node-* folders"
        ) from None


class LocalKafkaCluster(Component):
    """``len(ports)`` KRaft nodes on 127.0.0.1, each a broker and a controller, all of them the controller
    quorum; ``ports`` gives each node's (client, controller) port.

    With one node this is exactly a :class:`LocalKafka` in ``data_dir`` (the single-node layout and config).
    With more, node ``i`` lives in ``data_dir/node-<i>``, the internal topics have three replicas (or as many
    as there are nodes) with ``min.insync.replicas`` one less, as do topics created without a replication
    factor, and unclean leader election is off; the layout (cluster id, ports, directory ids) is recorded
    in ``data_dir/cluster.json`` so the cluster restarts as it was formatted.

    ``start()`` starts every node that is not running (and waits for one whose JVM runs but does not answer
    yet) and returns once every node answers a metadata request that lists all of them as brokers; a failed
    start stops the nodes it launched, no other. ``stop()`` stops them all at once (SIGTERM, SIGKILL after
    ``stop_timeout``).
    :meth:`kill` and :meth:`restart` crash one node and bring it back, for failure tests.
    """

    def __init__(
        self,
        data_dir: str | Path,
        cache_dir: str | Path,
        version: str,
        ports: Sequence[tuple[int, int]] = ((9092, 9093),),
        heap: str = "768m",
        log_level: str = "WARN",
        progress: Callable[[str], None] | None = None,
        start_timeout: float = 90.0,
        extra_properties: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__()
        if not ports:
            raise ValueError("a cluster has at least one node")
        self.data_dir = Path(data_dir).expanduser()
        self.version = version
        self.start_timeout = start_timeout
        self.recorded = read_layout(self.data_dir) if len(ports) > 1 else None
        """The layout found in ``data_dir``: a start with other ports or another node count is refused."""
        self.layout: ClusterLayout | None = None
        if len(ports) > 1:
            matches = self.recorded is not None and self.recorded.ports == list(ports)
            self.layout = self.recorded if matches else ClusterLayout.new(ports)
        self.launched: list[LocalKafka] = []
        """The nodes whose JVM the last :meth:`start` launched: a failed start stops these and no other."""
        self.nodes = [
            LocalKafka(
                data_dir=self.data_dir if self.layout is None else self.data_dir / f"node-{node_id}",
                cache_dir=cache_dir,
                version=version,
                port=port,
                controller_port=controller_port,
                heap=heap,
                log_level=log_level,
                progress=progress,
                start_timeout=start_timeout,
                extra_properties=extra_properties,
                node_id=node_id,
                cluster=self.layout,
            )
            for node_id, (port, controller_port) in enumerate(ports, start=1)
        ]

    @property
    def bootstrap(self) -> str:
        """Every node's client listener: clients still find the cluster with any one of them down."""
        return ",".join(node.bootstrap for node in self.nodes)

    @property
    def connection(self) -> KafkaConnection:
        return KafkaConnection(self.bootstrap)

    @property
    def layout_file(self) -> Path:
        return self.data_dir / CLUSTER_FILE

    def node(self, node_id: int) -> LocalKafka:
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} in a cluster of {len(self.nodes)}")

    def pids(self) -> list[int | None]:
        """Each node's JVM pid, None for a node that is not running."""
        return [node.pid() for node in self.nodes]

    def running(self) -> bool:
        """Every node runs and listens (see :func:`live_brokers` for what the cluster's metadata says)."""
        return all(node.running() for node in self.nodes)

    def _start(self) -> None:
        self.launched = []
        if self.running():
            return
        if self.layout is not None:
            self._record_layout(self.layout)
        for node in self.nodes:
            if not node.running() and node.launch():
                self.launched.append(node)
        self._wait_ready(self.start_timeout)

    def _record_layout(self, layout: ClusterLayout) -> None:
        """Record ``layout`` in the data dir, or refuse to start on another recorded one. A layout recorded
        with the same ports since this object read the data dir (a start at once with this one, of a fresh
        cluster) is taken instead: the nodes are formatted with one cluster id."""
        with exclusive(self.data_dir / LAYOUT_LOCK):
            self.recorded = read_layout(self.data_dir)
            if self.recorded is not None and self.recorded.ports == layout.ports:
                self.layout = self.recorded
                for node in self.nodes:
                    node.cluster = self.recorded
            elif self.recorded is not None:
                raise BrokerError(
                    f"{self.data_dir} holds a {len(self.recorded.nodes)}-node cluster on ports "
                    f"{self.recorded.ports} (client, controller): start it as it was formatted (the same "
                    f"--brokers and SLUICE_KAFKA_PORT), or delete {self.layout_file} and the node-* folders"
                )
            else:
                self.layout_file.write_bytes(msgspec.json.format(msgspec.json.encode(layout)) + b"\n")
                self.recorded = layout

    def _undo_start(self) -> None:
        """A failed start stops the nodes it launched, and no other: the nodes found running (another
        process started them) stay, where before the failed repair of one node stopped them all (a review)."""
        own = [node for node in self.launched if node.runs_own_jvm()]
        for node in self.launched:
            node.forget_exited()
        self.stop(nodes=own)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for node in self.nodes:
                if node.keep_launched():
                    self.launched.append(node)
            # Each node answers on its own listener (a restarted one too, not only its old registration
            # that the others still list until its session expires), and lists every broker.
            if all(port_open(n.port) and live_brokers(n.connection) == len(self.nodes) for n in self.nodes):
                return
            time.sleep(0.2)
        tails = "\n".join(f"node {node.node_id}:\n{node.log_tail(8)}" for node in self.nodes)
        raise BrokerError(
            f"the Kafka cluster at {self.bootstrap} did not list its {len(self.nodes)} brokers within "
            f"{timeout:.0f}s:\n{tails}"
        )

    def stop(self, stop_timeout: float = 30.0, nodes: Sequence[LocalKafka] | None = None) -> None:
        """Stop ``nodes`` (default: every node). All at once: a node stopped last, alone, would wait on a
        controller quorum that is gone."""
        nodes = self.nodes if nodes is None else nodes
        for node in nodes:
            node.terminate()
        deadline = time.monotonic() + stop_timeout
        for node in nodes:
            node.wait_stopped(max(0.0, deadline - time.monotonic()))

    def kill(self, node_id: int) -> None:
        """SIGKILL one node (a crash) and wait until its process is gone."""
        self.node(node_id).kill()

    def restart(self, node_id: int) -> None:
        """Start a killed or stopped node again; return once the cluster lists all its brokers."""
        self.node(node_id).start()
        self._wait_ready(self.start_timeout)


def broker_answers(kafka: KafkaConnection, timeout: float = 2.0) -> bool:
    """True when a Kafka metadata request to ``kafka`` succeeds."""
    return _metadata(kafka, timeout) is not None


def live_brokers(kafka: KafkaConnection, timeout: float = 2.0) -> int:
    """How many brokers the cluster's metadata lists (registered and not fenced); 0 when none answers."""
    metadata = _metadata(kafka, timeout)
    return 0 if metadata is None else len(metadata.brokers)


def _metadata(kafka: KafkaConnection, timeout: float) -> ClusterMetadata | None:
    from infra.topics import make_admin

    admin = make_admin(kafka, log_level=0, logger=_SILENT)
    try:
        return admin.list_topics(timeout=timeout)
    except Exception:
        return None


_SILENT = logging.getLogger("sluice.kafka.probe")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False
