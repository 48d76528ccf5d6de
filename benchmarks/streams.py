"""The streams worker into the warehouse: events/s one worker sustains, and freshness at a fixed rate.

    python benchmarks/streams.py [--events 200000] [--rate R] [--seconds 20]
        [--repeat 1] [--producer-nice 10] [--producer-linger-ms 5] [--out benchmarks/results/streams.json]

It starts its own Kafka (unless SLUICE_KAFKA_BOOTSTRAP is set) on free ports and, per run (``--repeat``),
one ``sluice streams`` process (embedded chDB in a temporary data dir, ``SLUICE_STREAMS_*`` taken from
this environment) on fresh topics, then:

1. catch-up: ``--events`` terminal events (``RequestFinished``, like the workers publish on ``results``:
   ~50 tenants, chat/completion/embedding with their text or vector, usage, timings, trace context) are
   produced before the worker starts. Each becomes two warehouse events: itself (``events_raw`` +
   ``request_facts``) and its audit entry (``audit_log`` and ``events_raw``, written by the worker as it
   publishes the entry on the ``audit`` topic). Events/s counts every event written (``sluice_streams_events_total``) between the
   first scrape of ``/metrics`` that shows progress and the one where all of them are written.
2. freshness: with the worker caught up, a thread produces at ``--rate`` warehouse events/s (half as many
   terminal events/s) for ``--seconds``. p50/p99 come from ``sluice_streams_freshness_seconds`` (event time
   to rows written), the difference of its buckets after/before the phase, interpolated within a bucket
   like Prometheus' ``histogram_quantile``. ~20 marker requests spread over the phase are polled every
   50 ms in ``request_facts`` through the owner's query server: produce -> row queryable, end to end.

Everything shares this machine's cores. The producer of the freshness phase stands in for the workers,
which run on other machines: it runs at niceness ``--producer-nice`` (10) and sends each 5 ms burst as one
produce request per partition (``--producer-linger-ms`` 5), as a worker publishing a finished batch does.
With ``--producer-nice 0 --producer-linger-ms 0`` it competes with the worker as an equal, and the broker
takes a produce request per record (on 2 cores: broker 0.6 cores instead of 0.35, the worker ~15 % slower).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform as host
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib.metadata import version
from pathlib import Path
from typing import Any, Literal

import msgspec
from harness import cpu_model, reap
from prometheus_client.parser import text_string_to_metric_families

from bus.producer import EventProducer
from infra.kafka.broker import LocalKafka, free_port
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from infra.warehouse import WarehouseError, query_warehouse
from schemas.events import FinishReason, Float32Vectors, RequestFinished, Status, Timings, Usage
from schemas.ids import uuid7_from_parts
from schemas.settings import KafkaConnection, PlatformSettings, load_settings
from schemas.topics import TopicNames

ROOT = Path(__file__).resolve().parent.parent
Kind = Literal["chat", "completion", "embedding"]
GENERATION_MODEL = "demo-gpt"
EMBEDDING_MODEL = "all-minilm-l6-v2"
SIZING = TopicSizing(requests=2, replies=1, events=4)
TARGET_EVENTS_PER_S = 20_000
TARGET_P99_S = 5.0
KINDS: tuple[Kind, ...] = ("chat", "completion", "embedding")
KIND_WEIGHTS = (0.6, 0.25, 0.15)

# --------------------------------------------------------------------------------------------- traffic


class Traffic:
    """Terminal events shaped like the workers' (``gpu_workers``: ``_terminal`` + ``with_request``)."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.tenants = [f"tenant-{i:02d}" for i in range(50)]
        self.weights = [1 / (i + 1) for i in range(50)]  # a few hot tenants, a long tail
        words = ("the", "river", "ran", "past", "old", "stone", "wall", "and", "gate", "held", "water")
        self.texts = [" ".join(self.rng.choices(words, k=n)) for n in (8, 24, 64, 128, 256) for _ in range(4)]
        self.vectors = [
            Float32Vectors.pack([[self.rng.uniform(-0.2, 0.2) for _ in range(384)]], 384) for _ in range(8)
        ]

    def event(self, now: datetime | None = None) -> RequestFinished:
        rng = self.rng
        now = now or datetime.now(UTC)
        kind = rng.choices(KINDS, KIND_WEIGHTS)[0]
        embedding = kind == "embedding"
        e2e = rng.uniform(0.02, 0.2) if embedding else rng.uniform(0.3, 6.0)
        accepted = now - timedelta(seconds=e2e)
        started = accepted + timedelta(seconds=rng.uniform(0.001, 0.05))
        prompt = rng.randint(4, 400)
        roll = rng.random()
        status: Status = "completed" if roll < 0.97 else "failed" if roll < 0.99 else "cancelled"
        completed = status == "completed"
        reason: FinishReason = "error" if status == "failed" else "cancelled" if not completed else "stop"
        if completed and rng.random() < 0.3:
            reason = "length"
        completion = 0 if embedding or not completed else rng.randint(1, 256)
        first = None if embedding else started + timedelta(seconds=rng.uniform(0.01, 0.2))
        return RequestFinished(
            tenant=rng.choices(self.tenants, self.weights)[0],
            model=EMBEDDING_MODEL if embedding else GENERATION_MODEL,
            request_id=uuid7_from_parts(int(accepted.timestamp() * 1000), rng.getrandbits(74)),
            source=f"worker/{'minilm' if embedding else 'demo-gpt'}-1",
            traceparent=f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01",
            status=status,
            finish_reason=reason,
            usage=Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion),
            text=rng.choice(self.texts) if completed and not embedding else None,
            embeddings_f32=rng.choice(self.vectors) if completed and embedding else None,
            timings=Timings(accepted=accepted, started=started, first_token=first, finished=now),
            worker_id=f"{'minilm' if embedding else 'demo-gpt'}-1",
            model_version="v3" if rng.random() < 0.9 else "v4",
            kind=kind,
            stream=kind == "chat" and rng.random() < 0.7,
            edge_id=f"edge-{rng.randint(1, 2)}",
            max_inter_token_s=rng.uniform(0.01, 0.08) if completion >= 2 else None,
            time=now,
        )


# --------------------------------------------------------------------------------------------- metrics


@dataclass
class Scrape:
    at: float
    written: int = 0
    by_type: dict[str, int] = field(default_factory=dict)
    freshness: list[tuple[float, float]] = field(default_factory=list)
    """Cumulative (upper bound, count) buckets, +Inf last."""
    insert_sum: float = 0.0
    insert_count: float = 0.0
    batch_sum: float = 0.0
    batch_count: float = 0.0
    cpu_s: float = 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(url: str, pid: int) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    out = Scrape(at=time.monotonic(), cpu_s=cpu_seconds(pid))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "sluice_streams_events_total":
                out.written += int(sample.value)
                kind = sample.labels["type"]
                out.by_type[kind] = out.by_type.get(kind, 0) + int(sample.value)
            elif sample.name == "sluice_streams_freshness_seconds_bucket":
                out.freshness.append((float(sample.labels["le"]), sample.value))
            elif sample.name == "sluice_streams_insert_seconds_sum":
                out.insert_sum = sample.value
            elif sample.name == "sluice_streams_insert_seconds_count":
                out.insert_count = sample.value
            elif sample.name == "sluice_streams_batch_size_sum":
                out.batch_sum = sample.value
            elif sample.name == "sluice_streams_batch_size_count":
                out.batch_count = sample.value
    out.freshness.sort()
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding the rank."""
    total = buckets[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, cumulative in buckets:
        if cumulative >= rank:
            if upper == float("inf"):
                return lower
            return lower + (upper - lower) * (rank - below) / max(cumulative - below, 1e-12)
        lower, below = upper, cumulative
    return lower


def bucket_delta(after: Scrape, before: Scrape) -> list[tuple[float, float]]:
    earlier = dict(before.freshness)
    return [(le, count - earlier.get(le, 0.0)) for le, count in after.freshness]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ------------------------------------------------------------------------------------------- processes


@contextmanager
def kafka(settings: PlatformSettings, data: Path) -> Iterator[KafkaConnection]:
    if not settings.local_kafka:
        yield settings.kafka
        return
    broker = LocalKafka(
        data / "kafka",
        settings.cache_dir,
        settings.kafka_version,
        port=free_port(),
        controller_port=free_port(),
    )
    with broker:
        yield broker.connection


@contextmanager
def streams_process(env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "streams"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        yield proc
    except Exception:
        state = "running" if proc.poll() is None else f"exited {proc.returncode}"
        print(f"sluice streams ({state}) logged:\n{log.read_text()[-4000:]}", file=sys.stderr)
        raise
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            reap(proc)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, within: float = 120) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sluice streams exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"sluice streams not ready within {within:.0f}s:\n{log.read_text()[-3000:]}")


# ------------------------------------------------------------------------------------------------ phases


def produce_backlog(conn: KafkaConnection, topic: str, traffic: Traffic, n: int) -> float:
    """``n`` terminal events on ``topic``, durable before returning; returns events/s produced."""
    producer = EventProducer(conn, "bench-backlog", log_level=3)
    producer.start()
    began = time.perf_counter()
    try:
        for _ in range(n):
            producer.produce(topic, traffic.event())
    finally:
        producer.stop(120)
    return n / (time.perf_counter() - began)


AT_START = 2
"""Warehouse events a fresh worker writes of its own: the price table it publishes on the control topic
(a new prefix holds none) and that table's audit entry."""


def catch_up(url: str, proc: subprocess.Popen[bytes], expect: int, started: float) -> dict[str, Any]:
    """Scrape until ``expect`` warehouse events are written; the rate between first progress and the end.
    Gives up (``complete: false``, the rate so far) after 120 s plus 5 ms per event."""
    deadline = time.monotonic() + 120 + expect / 200
    first: Scrape | None = None
    finished_at: float | None = None
    last = scrape(url, proc.pid)
    while last.written < expect and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
        last = scrape(url, proc.pid)
        if first is None and last.written > 0:
            first = last
        if finished_at is None and last.by_type.get("request_finished", 0) >= (expect - AT_START) // 2:
            finished_at = last.at
    if first is None or last.at <= first.at:
        raise RuntimeError(f"no measurable progress ({last.written}/{expect} written): raise --events")
    wall = last.at - first.at
    batches = last.batch_count - first.batch_count
    return {
        "complete": last.written >= expect,
        "warehouse_events": last.written,
        "seconds": wall,
        "warehouse_events_per_s": (last.written - first.written) / wall,
        "request_finished_per_s": (last.written - first.written) / 2 / wall,
        "from_start_seconds": last.at - started,
        "first_write_after_start_s": first.at - started,
        "request_finished_done_s": (finished_at or last.at) - first.at,
        "mean_batch_events": (last.batch_sum - first.batch_sum) / batches if batches else float("nan"),
        "mean_insert_ms": 1000 * (last.insert_sum - first.insert_sum) / batches if batches else float("nan"),
        "inserts_per_s": batches / wall,
        "worker_cpu_cores": (last.cpu_s - first.cpu_s) / wall,
        "load_avg_1m_at_end": os.getloadavg()[0],
    }


class Prober(threading.Thread):
    """Polls ``request_facts`` every 50 ms for the marker requests; records produce -> queryable."""

    def __init__(self, settings: PlatformSettings) -> None:
        super().__init__(name="bench-prober", daemon=True)
        self.settings = settings
        self.pending: dict[str, float] = {}
        self.seen: dict[str, float] = {}
        self.query_ms: list[float] = []
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.done = threading.Event()

    def mark(self, request_id: str, produced: float) -> None:
        with self.lock:
            self.pending[request_id] = produced

    def run(self) -> None:
        while not self.done.is_set():
            with self.lock:
                ids = list(self.pending)
            if ids:
                began = time.time()
                ins = ", ".join(f"'{i}'" for i in ids)
                try:
                    result = query_warehouse(
                        self.settings, f"SELECT request_id FROM request_facts WHERE request_id IN ({ins})"
                    )
                except WarehouseError as exc:
                    self.errors.append(str(exc))
                    time.sleep(0.05)
                    continue
                visible = time.time()
                self.query_ms.append(1000 * (visible - began))
                with self.lock:
                    for (request_id,) in result.rows:
                        produced = self.pending.pop(str(request_id), None)
                        if produced is not None:
                            self.seen[str(request_id)] = visible - produced
            time.sleep(0.05)


@dataclass(frozen=True)
class Load:
    """How the freshness phase's producer runs (``--producer-nice``, ``--producer-linger-ms``)."""

    nice: int = 10
    linger_ms: float = 5.0


def paced(
    conn: KafkaConnection,
    topic: str,
    traffic: Traffic,
    per_s: float,
    seconds: float,
    prober: Prober,
    markers: int,
    stop: threading.Event,
    load: Load,
) -> dict[str, float]:
    """Produce ``per_s`` terminal events/s for ``seconds`` in 5 ms bursts; every ``seconds/markers`` one
    of them is a marker the prober looks for (its clock starts just before it is produced)."""
    # The load stands in for workers on other machines: on this box it yields the cores to the worker it
    # measures (its librdkafka threads, started below, inherit the niceness), and batches what it
    # produces in each burst like a worker publishing a finished batch (linger) instead of one produce
    # request per record, which the broker here pays for.
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), load.nice)
    producer = EventProducer(conn, "bench-paced", log_level=3, **{"linger.ms": load.linger_ms})
    producer.start()
    sent = 0
    next_marker = seconds / markers / 2
    began = time.monotonic()
    try:
        while (elapsed := time.monotonic() - began) < seconds and not stop.is_set():
            due = int(per_s * elapsed)
            while sent < due:
                event = traffic.event()
                if elapsed >= next_marker:
                    prober.mark(event.request_id, time.time())
                    next_marker += seconds / markers
                producer.produce(topic, event)
                sent += 1
            time.sleep(0.005)
        ended = time.monotonic()
    finally:
        producer.stop(60)
    return {"produced": sent, "seconds": ended - began, "per_s": sent / (ended - began)}


def at_rate(
    url: str,
    proc: subprocess.Popen[bytes],
    settings: PlatformSettings,
    conn: KafkaConnection,
    topic: str,
    traffic: Traffic,
    rate: float,
    seconds: float,
    markers: int,
    load: Load,
) -> dict[str, Any]:
    before = scrape(url, proc.pid)
    prober = Prober(settings)
    prober.start()
    result: dict[str, float] = {}
    stop = threading.Event()
    producing = threading.Thread(
        target=lambda: result.update(
            paced(conn, topic, traffic, rate / 2, seconds, prober, markers, stop, load)
        ),
        name="bench-producer",
        daemon=True,
    )
    producing.start()
    try:
        while producing.is_alive():
            producing.join(0.5)
    finally:
        stop.set()
    if "produced" not in result:
        raise RuntimeError("the paced producer failed")
    at_end = scrape(url, proc.pid)
    expect = before.written + 2 * int(result["produced"])
    deadline = time.monotonic() + 120
    after = at_end
    while after.written < expect and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.25)
        after = scrape(url, proc.pid)
    drain = after.at - at_end.at
    deadline = time.monotonic() + 10
    while prober.pending and time.monotonic() < deadline:
        time.sleep(0.05)
    prober.done.set()
    prober.join(5)
    buckets = bucket_delta(after, before)
    probes = sorted(prober.seen.values())
    wall = at_end.at - before.at
    batches = after.batch_count - before.batch_count
    return {
        "target_warehouse_events_per_s": rate,
        "request_finished_per_s": result["per_s"],
        "warehouse_events_per_s_produced": 2 * result["per_s"],
        "warehouse_events_per_s_written": (at_end.written - before.written) / wall,
        "seconds": result["seconds"],
        "lag_at_end_events": expect - at_end.written,
        "drained_s": drain,
        "all_written": after.written >= expect,
        "freshness_events": buckets[-1][1] if buckets else 0,
        "freshness_p50_s": histogram_quantile(0.5, buckets),
        "freshness_p99_s": histogram_quantile(0.99, buckets),
        "mean_batch_events": (after.batch_sum - before.batch_sum) / max(batches, 1),
        "mean_insert_ms": 1000 * (after.insert_sum - before.insert_sum) / max(batches, 1),
        "worker_cpu_cores": (at_end.cpu_s - before.cpu_s) / wall,
        "probes": len(probes),
        "probes_missing": len(prober.pending),
        "probe_p50_s": statistics.median(probes) if probes else float("nan"),
        "probe_max_s": probes[-1] if probes else float("nan"),
        "probe_query_ms_mean": statistics.fmean(prober.query_ms) if prober.query_ms else float("nan"),
        "probe_errors": prober.errors[:3],
        "load_avg_1m_at_end": os.getloadavg()[0],
    }


def run_once(
    settings: PlatformSettings, conn: KafkaConnection, work: Path, label: str, args: argparse.Namespace
) -> dict[str, Any]:
    prefix = f"bench{int(time.time())}"
    names = TopicNames(prefix)
    apply_topics(make_admin(conn), platform_topics(names, [GENERATION_MODEL], SIZING))
    traffic = Traffic()
    print(f"[{label}] producing {args.events} terminal events ...", file=sys.stderr)
    backlog_rate = produce_backlog(conn, names.results, traffic, args.events)
    data = work / f"data-{prefix}"
    port = free_port()
    keep = ("SLUICE_CACHE_DIR", "SLUICE_STREAMS_", "SLUICE_KAFKA_")  # tuning and Kafka security pass through
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k.startswith(keep)}
    env.update(
        SLUICE_KAFKA_BOOTSTRAP=conn.bootstrap,
        SLUICE_TOPIC_PREFIX=prefix,
        SLUICE_DATA_DIR=str(data),
        SLUICE_STREAMS_PORT=str(port),
        SLUICE_LOG_LEVEL="warning",
    )
    url = f"http://127.0.0.1:{port}"
    log = work / f"streams-{prefix}.log"
    local = msgspec.structs.replace(
        settings, kafka_bootstrap=conn.bootstrap, topic_prefix=prefix, data_dir=str(data)
    )
    print(f"[{label}] catch-up ...", file=sys.stderr)
    with streams_process(env, log) as proc:
        started = time.monotonic()
        wait_ready(url, proc, log)
        caught = catch_up(url, proc, 2 * args.events + AT_START, started)
        rate = args.rate or min(TARGET_EVENTS_PER_S, 0.8 * caught["warehouse_events_per_s"])
        print(f"[{label}] {rate:.0f} warehouse events/s for {args.seconds:.0f}s ...", file=sys.stderr)
        fresh = at_rate(
            url,
            proc,
            local,
            conn,
            names.results,
            traffic,
            rate,
            args.seconds,
            args.markers,
            Load(args.producer_nice, args.producer_linger_ms),
        )
    return {
        "code": code_version(),
        "backlog_produce_per_s": backlog_rate,
        "catch_up": caught,
        "at_rate": fresh,
    }


# ------------------------------------------------------------------------------------------------ report


ROWS: list[tuple[str, str, str, str, str]] = [
    # phase, key, label, format, target
    ("catch_up", "warehouse_events_per_s", "catch-up: warehouse events/s", ".0f", f"≥ {TARGET_EVENTS_PER_S}"),
    ("catch_up", "request_finished_per_s", "catch-up: RequestFinished/s (2 events each)", ".0f", ""),
    ("catch_up", "seconds", "catch-up: seconds measured", ".1f", ""),
    ("catch_up", "mean_batch_events", "catch-up: mean batch (events/insert)", ".0f", ""),
    ("catch_up", "mean_insert_ms", "catch-up: mean insert ms", ".1f", ""),
    ("catch_up", "worker_cpu_cores", "catch-up: worker CPU (cores)", ".2f", ""),
    ("at_rate", "target_warehouse_events_per_s", "at rate: target warehouse events/s", ".0f", ""),
    ("at_rate", "warehouse_events_per_s_produced", "at rate: produced warehouse events/s", ".0f", ""),
    ("at_rate", "warehouse_events_per_s_written", "at rate: written warehouse events/s", ".0f", ""),
    ("at_rate", "lag_at_end_events", "at rate: lag when producing stopped (events)", ".0f", ""),
    ("at_rate", "drained_s", "at rate: then drained in (s)", ".1f", ""),
    ("at_rate", "freshness_p50_s", "at rate: freshness p50 s (histogram)", ".2f", ""),
    ("at_rate", "freshness_p99_s", "at rate: freshness p99 s (histogram)", ".2f", f"≤ {TARGET_P99_S:.0f}"),
    ("at_rate", "probe_p50_s", "at rate: produce→queryable p50 s (markers)", ".2f", ""),
    ("at_rate", "probe_max_s", "at rate: produce→queryable max s (markers)", ".2f", ""),
    ("at_rate", "worker_cpu_cores", "at rate: worker CPU (cores)", ".2f", ""),
]


def table(runs: dict[str, dict[str, Any]]) -> str:
    rows: list[tuple[str, ...]] = [("metric", *runs, "target")]
    for phase, key, label, fmt, target in ROWS:
        rows.append((label, *(format(float(run[phase][key]), fmt) for run in runs.values()), target))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def code_version() -> dict[str, str | bool]:
    """The commit measured, and whether the streams worker's code differed from it."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False).stdout

    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "streams_dirty": bool(git("status", "--porcelain", "streams")),
    }


def streams_settings() -> dict[str, Any]:
    """``SLUICE_STREAMS_*`` as the worker reads them. Imported here, after dropping this file's folder
    from ``sys.path``: run as a script, ``benchmarks/streams.py`` would shadow the ``streams`` package.
    Importing it also registers those variables, so :func:`load_settings` accepts them here."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    module = importlib.import_module("streams.settings")
    return msgspec.to_builtins(load_settings(module.StreamsSettings))  # type: ignore[no-any-return]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=200_000, help="terminal events in the catch-up backlog")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="warehouse events/s in the freshness phase (default: min(20000, 0.8 x catch-up rate))",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="length of the freshness phase")
    parser.add_argument("--markers", type=int, default=20, help="produce→queryable probes in that phase")
    parser.add_argument(
        "--repeat", type=int, default=1, help="measure this many times (fresh topics, worker)"
    )
    parser.add_argument(
        "--producer-nice",
        type=int,
        default=Load.nice,
        choices=range(20),
        metavar="{0..19}",
        help="niceness of the freshness phase's producer thread: the load stands in for workers on other "
        "machines and yields the shared cores to the worker measured (0: same priority)",
    )
    parser.add_argument(
        "--producer-linger-ms",
        type=float,
        default=Load.linger_ms,
        help="that producer's linger.ms: each 5 ms burst goes out as one produce request per partition, "
        "like a worker publishing a finished batch (0: one request as each record comes)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "streams.json")
    args = parser.parse_args()
    streams = streams_settings()
    settings = load_settings(PlatformSettings)
    runs: dict[str, dict[str, Any]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="sluice-bench-streams-") as tmp,
        kafka(settings, Path(tmp)) as conn,
    ):
        for n in range(1, args.repeat + 1):
            runs[f"run {n}"] = run_once(settings, conn, Path(tmp), f"run {n}", args)
            write(args, runs, streams, settings)  # what is measured so far survives a later failure
    print(table(runs))
    print(
        "\nwarehouse events: every event the worker wrote (a RequestFinished and its AuditEntry each);"
        " freshness: event time -> rows written, p50/p99 interpolated within the phase's histogram"
        " buckets like Prometheus' histogram_quantile; markers: produce -> row seen in request_facts"
        " (polled every 50 ms). Load average (1 min) at the end of catch-up / at-rate:"
        + ";".join(
            f" {label} {r['catch_up']['load_avg_1m_at_end']:.1f} / {r['at_rate']['load_avg_1m_at_end']:.1f}"
            for label, r in runs.items()
        )
    )
    print(f"wrote {args.out}", file=sys.stderr)


def write(
    args: argparse.Namespace,
    runs: dict[str, dict[str, Any]],
    streams: dict[str, Any],
    settings: PlatformSettings,
) -> None:
    result = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(["python", "benchmarks/streams.py", *sys.argv[1:]]),
        "code": code_version(),
        "targets": {"warehouse_events_per_s": TARGET_EVENTS_PER_S, "freshness_p99_s": TARGET_P99_S},
        "runs": runs,
        "settings": {
            "events": args.events,
            "rate": args.rate,
            "seconds": args.seconds,
            "markers": args.markers,
            "producer_nice": args.producer_nice,
            "producer_linger_ms": args.producer_linger_ms,
            "streams": {k: v for k, v in streams.items() if k != "streams_port"},
            "partitions": msgspec.to_builtins(SIZING),
            "traffic": "RequestFinished on results: 50 tenants (1/rank weights), 60% chat / 25% completion / "
            "15% embedding (one 384-d vector), 97% completed, with text, usage, timings, traceparent",
            "freshness": "histogram_quantile-style linear interpolation within the phase's bucket deltas",
        },
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "python": host.python_version(),
            "platform": host.platform(),
            "faust": version("faust-streaming"),
            "chdb": version("chdb"),
            "kafka": settings.kafka_version,
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
