"""What the benchmark scripts share: a percentile and a broker for one run (run them as
``python benchmarks/<name>.py``: this directory is then on the import path)."""

from __future__ import annotations

import os
import platform
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from infra.kafka.broker import LocalKafka, free_port
from schemas.settings import KafkaConnection, PlatformSettings


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """What the cores are, as far as the machine says: ``"AMD EPYC (family 25, model 17)"`` on Linux
    (the same name covers parts a generation apart: MiniLM's batch-1 forward took 5.5 ms on family 26 and
    8.7-10.1 ms on family 25, both sold as 2 vCPUs of an "AMD EPYC"), else the processor's name. Results
    from different boxes are only comparable with it."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor describes them all
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.processor() or platform.machine()
    ids = [
        f"{label} {fields[key]}"
        for key, label in (("cpu family", "family"), ("model", "model"))
        if key in fields
    ]
    return f"{name} ({', '.join(ids)})" if ids else name


@contextmanager
def kafka(settings: PlatformSettings) -> Iterator[KafkaConnection]:
    """The configured cluster, or a local broker on free ports in a temporary directory."""
    if not settings.local_kafka:
        yield settings.kafka
        return
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        broker = LocalKafka(
            tmp, settings.cache_dir, settings.kafka_version, port=free_port(), controller_port=free_port()
        )
        with broker:
            yield broker.connection


def service_env(conn: KafkaConnection, prefix: str, **extra: str) -> dict[str, str]:
    """The environment of the ``sluice`` processes a benchmark starts: this one's without its ``SLUICE_*``
    settings (but the cache and Kafka security), on the benchmark's broker and topic prefix, plus ``extra``."""
    keep = ("SLUICE_CACHE_DIR", "SLUICE_KAFKA_")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k.startswith(keep)}
    env.update(SLUICE_KAFKA_BOOTSTRAP=conn.bootstrap, SLUICE_TOPIC_PREFIX=prefix, **extra)
    return env


def reap(proc: subprocess.Popen[Any], within: float = 30) -> None:
    """Wait for a child that was asked to end (SIGTERM, or its stdin closed) to exit; SIGKILL it after
    ``within`` seconds."""
    try:
        proc.wait(within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def cpu_seconds(*procs: psutil.Process) -> list[float]:
    """User + system CPU seconds of each process so far."""
    return [sum(p.cpu_times()[:2]) for p in procs]


def broker_process(conn: KafkaConnection) -> psutil.Process | None:
    """The local broker's JVM (the one listening on the bootstrap port), if it runs on this machine."""
    port = int(conn.bootstrap.rsplit(":", 1)[1])
    for c in psutil.net_connections("tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    return None
