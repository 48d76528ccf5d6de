"""The floor under the platform's two Kafka hops: what a request costs when nothing else runs.

    python benchmarks/kafka_floor.py [--quick] [--fetch-wait-ms 500] [--acks all] [--idle-ms 20]
        [--around-forward] [--out benchmarks/results/kafka_floor.json]

A request crosses Kafka twice: the edge publishes it (``requests``), a worker consumes it and publishes
the reply (``replies``), the edge consumes that. This benchmark runs exactly that with no model, no HTTP
and no platform code in the way: an echo process (consume ``req``, produce ``rep``) and a driver in this
process (produce ``req``, consume ``rep``), both with the platform's own producer and consumer settings
(``bus.producer.producer_config``, ``bus.consumer.consumer_config``) and records of a request's size.

1. latency: one request in flight at a time, on a warm broker (after 5 s at 64 in flight and 300 lone round
   trips: a fresh JVM compiles through its first thousands of requests); p50/p99 of the two hops (what TTFT
   can never go under), back to back, and again with ``--idle-ms`` of nothing between round trips: one
   client leaves the broker and the cores idle while the model runs between its two hops, and an idle
   JVM on an idle vCPU answers slower (on the 2-core development box 1.3-1.8 ms back to back, 2.5-3.1 ms
   after 16-50 ms idle, with twice the broker CPU a round trip: docs/perf);
   With ``--around-forward`` a third run puts MiniLM's forward of batch 1 (on every core, as
   ``raw_model.py`` runs it) in the echo between its two hops, as one client's embedding meets them: the
   forward leaves the cores to the next hop cold (``hops_around_forward``: each hop timed on the box's one
   monotonic clock, and the round trip over the raw forward in a loop, the floor ``online.py`` sets beside
   one client's embedding);
2. throughput: 64 in flight for a few seconds; requests/s and CPU milliseconds per request of the broker
   JVM, the echo process and the driver (what every request costs on a shared box before any model runs).

It starts its own broker on free ports (unless SLUICE_KAFKA_BOOTSTRAP is set). The numbers are this
machine's (2 cores shared by everything): the ratios in ``online.py`` are judged against them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform as host
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import psutil
from confluent_kafka import Consumer, KafkaException, Message, Producer, TopicPartition
from harness import broker_process, cpu_model, cpu_seconds, kafka, pct

from bus.consumer import FETCH_WAIT_MAX_MS, consumer_config
from bus.placement import format_cpus, parse_cpus
from bus.producer import producer_config
from infra.topics import make_admin
from schemas.settings import KafkaConnection, PlatformSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent
RECORD = b"x" * 900
"""About a chat request's event (prompt tokens, sampling, trace context)."""
IN_FLIGHT = 64
STAMPS = struct.Struct("ddd")
"""The head of an echo's reply around a forward: when it read the request, its forward (ms), when it produced
the reply (``time.perf_counter``: CLOCK_MONOTONIC, one clock for every process on the box)."""


def producer(conn: KafkaConnection, role: str, acks: str) -> Producer:
    idempotence = {} if acks == "all" else {"enable.idempotence": False}
    return Producer(producer_config(conn, f"floor-{role}", acks=acks, **idempotence))


def consumer(conn: KafkaConnection, role: str, fetch_wait_ms: int) -> Consumer:
    return Consumer(consumer_config(conn, None, f"floor-{role}", **{"fetch.wait.max.ms": fetch_wait_ms}))


def minilm_forward() -> Callable[[], float]:
    """MiniLM's forward of batch 1 on every core, as ``raw_model.py`` runs it (the load generator's inputs in
    turn), warm: a call that returns its milliseconds."""
    from loadgen import EMBED_TEXTS, embed_text

    from gpu_workers.embedding import EmbeddingEngine
    from gpu_workers.models import configure_torch_threads, load_embedding_model
    from schemas.manifest import current_model_dir

    configure_torch_threads(len(os.sched_getaffinity(0)))
    settings = load_settings(PlatformSettings)
    model = load_embedding_model(current_model_dir(settings.cache_dir, "all-minilm-l6-v2"), device="auto")
    engine = EmbeddingEngine(model.model)
    texts = [list(model.tokenizer(embed_text(n))["input_ids"]) for n in range(EMBED_TEXTS)]
    for ids in texts:
        engine.embed([ids])
    turn = iter(range(1 << 62))

    def forward() -> float:
        began = time.perf_counter()
        engine.embed([texts[next(turn) % len(texts)]])
        return (time.perf_counter() - began) * 1000

    return forward


def echo(
    bootstrap: str, fetch_wait_ms: int, acks: str, req: str, rep: str, work: str = "none", cores: str = ""
) -> None:
    """The worker's half: every record of ``req`` goes back on ``rep``, until a record says ``stop``. With
    ``work="forward"`` each runs :func:`minilm_forward` first and the reply starts with its :data:`STAMPS`.
    ``cores`` (``0-1``, ...): this process there first, its threads to come with it (else where it started)."""
    if cores:
        os.sched_setaffinity(0, parse_cpus(cores))
    forward = minilm_forward() if work == "forward" else None
    conn = KafkaConnection(bootstrap)
    out, source = producer(conn, "echo", acks), consumer(conn, "echo", fetch_wait_ms)
    source.assign([TopicPartition(req, 0, 0)])
    print("ready", flush=True)
    while True:
        first = source.poll(0.05)
        out.poll(0)
        if first is None or first.error() is not None:
            continue
        for message in [first, *source.consume(num_messages=499, timeout=0)]:
            if message.error() is not None:
                continue
            if message.value() == b"stop":
                out.flush(10)
                source.close()
                return
            if forward is None:
                out.produce(rep, message.value(), key=message.key())
                continue
            read = time.perf_counter()
            stamps = STAMPS.pack(read, forward(), time.perf_counter())
            out.produce(rep, stamps + RECORD[len(stamps) :], key=message.key())


class Driver:
    """The edge's half: publish to ``req``, wait for the echo on ``rep``."""

    def __init__(self, conn: KafkaConnection, fetch_wait_ms: int, acks: str, req: str, rep: str) -> None:
        self.producer = producer(conn, "driver", acks)
        self.consumer = consumer(conn, "driver", fetch_wait_ms)
        self.consumer.assign([TopicPartition(rep, 0, 0)])
        self.req = req
        self.sent = 0

    def send(self) -> int:
        self.sent += 1
        self.producer.produce(self.req, RECORD, key=str(self.sent).encode())
        self.producer.poll(0)
        return self.sent

    def received(self, timeout: float) -> list[Message]:
        first = self.consumer.poll(timeout)
        self.producer.poll(0)
        if first is None:
            return []
        return [m for m in [first, *self.consumer.consume(num_messages=499, timeout=0)] if m.error() is None]

    def latency(self, n: int, idle_s: float = 0.0) -> list[float]:
        """Two hops, one request at a time (ms), each after ``idle_s`` of nothing."""
        out = []
        for _ in range(n):
            if idle_s:
                time.sleep(idle_s)
            began = time.perf_counter()
            self.answer(began)
            out.append((time.perf_counter() - began) * 1000)
        return out

    def answer(self, began: float) -> Message:
        """Send one request and wait for its echo."""
        key = str(self.send()).encode()
        while True:
            for message in self.received(5.0):
                if message.key() == key:
                    return message
            if time.perf_counter() - began > 30:
                raise RuntimeError("the echo did not answer within 30 s")

    def around_forward(self, n: int) -> list[tuple[float, float, float, float]]:
        """One request at a time through an echo with a forward (ms each): the round trip, the hop in (sent
        to read by the echo), the forward, the hop back (the reply produced to read here)."""
        out = []
        for _ in range(n):
            began = time.perf_counter()
            reply = self.answer(began)
            ended = time.perf_counter()
            read, forward_ms, produced = STAMPS.unpack_from(reply.value() or b"")
            out.append(((ended - began) * 1000, (read - began) * 1000, forward_ms, (ended - produced) * 1000))
        return out

    def saturate(self, seconds: float) -> int:
        """Keep IN_FLIGHT requests in flight for ``seconds``; the number answered."""
        for _ in range(IN_FLIGHT):
            self.send()
        answered = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for _ in self.received(0.5):
                answered += 1
                self.send()
        return answered

    def warm(self, seconds: float) -> None:
        """``seconds`` at IN_FLIGHT, every answer read, then the count starts again: the phases before are
        all answered, so the drain would otherwise wait out its 30 s counting theirs as still in flight."""
        self.sent = 0
        self.drain(self.saturate(seconds))
        self.sent = 0

    def drain(self, answered: int) -> None:
        """Read the answers still in flight so the next phase starts clean."""
        deadline = time.monotonic() + 30
        while answered < self.sent and time.monotonic() < deadline:
            answered += len(self.received(0.5))


@contextmanager
def echo_pair(
    conn: KafkaConnection,
    fetch_wait_ms: int,
    acks: str,
    warm_s: float,
    work: str = "none",
    echo_cores: Collection[int] | None = None,
) -> Iterator[tuple[Driver, subprocess.Popen[bytes]]]:
    """The driver here and the echo in a child process, on two topics of their own (deleted afterwards, so a
    shared cluster keeps nothing of the run), connected and warmed: ``warm_s`` at IN_FLIGHT, because a
    fresh broker's JIT is still compiling through its first few thousand requests (300 lone round trips at
    a time on 2 cores: 2.7-5.0 ms p50 and 4-7 ms of broker CPU each for the first 300, 1.3-1.9 ms and
    1.2-2.0 ms once warm), and the floor is what a running broker costs. ``echo_cores``: the echo on these
    cores (else on this process's): one set beside a placed platform runs where the raw model does."""
    from confluent_kafka.admin import NewTopic

    run_id = f"{os.getpid()}-{time.time_ns()}"
    req, rep = f"floor-req-{run_id}", f"floor-rep-{run_id}"
    admin = make_admin(conn)
    for future in admin.create_topics([NewTopic(req, 1, 1), NewTopic(rep, 1, 1)]).values():
        future.result()
    child = subprocess.Popen(
        [sys.executable, __file__, "--echo", conn.bootstrap, str(fetch_wait_ms), acks, req, rep, work]
        + ([format_cpus(echo_cores)] if echo_cores else []),
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])},
    )
    driver: Driver | None = None
    try:
        assert child.stdout is not None
        if child.stdout.readline().strip() != b"ready":  # (a forward's echo loads its model first)
            raise RuntimeError("the echo process did not start")
        driver = Driver(conn, fetch_wait_ms, acks, req, rep)
        driver.latency(20)  # connections, metadata
        driver.warm(warm_s)
        yield driver, child
        driver.producer.produce(req, b"stop")
        driver.producer.flush(10)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
        if driver is not None:
            driver.consumer.close()
            # The producer too, now: kept by the caller's reference, it outlived the broker and logged a
            # refused connection twice a second into the benchmark's output.
            del driver.producer
        for future in admin.delete_topics([req, rep]).values():
            with suppress(KafkaException):
                future.result()


def hops_after_idle(conn: KafkaConnection, idle_ms: float, n: int) -> dict[str, float]:
    """Only the floor's lone round trips after ``idle_ms`` of nothing (p50, p99 ms), with the platform's
    settings, on ``conn``'s cluster: what a benchmark of the platform sets beside one client's latency."""
    with echo_pair(conn, FETCH_WAIT_MAX_MS, "all", warm_s=2.0) as (driver, _):
        driver.latency(100)
        hops = driver.latency(n, idle_ms / 1000)
    return {**latency_summary(hops), "idle_ms": idle_ms}


def hops_around_forward(conn: KafkaConnection, n: int) -> dict[str, float]:
    """The floor's lone round trips through an echo that runs MiniLM's forward of batch 1 between its hops,
    with the platform's settings, on ``conn``'s cluster (p50 ms): the round trip, the forward, the hops
    (the round trip less the forward), the hop in and the hop back. The echo warms with the platform's
    embeddings' forward at IN_FLIGHT as the other floors warm (each record a forward: fewer round trips)."""
    with around_forward_echo(conn) as driver:
        return around_summary(driver.around_forward(n))


@contextmanager
def around_forward_echo(conn: KafkaConnection, echo_cores: Collection[int] | None = None) -> Iterator[Driver]:
    """A driver of an echo with MiniLM's forward between its hops (``echo_cores``: :func:`echo_pair`), with
    the platform's settings, on ``conn``'s cluster, warmed as the other floors warm (each record a forward:
    fewer round trips) and by 50 lone round trips; its :meth:`Driver.around_forward` samples go to
    :func:`around_summary`."""
    with echo_pair(conn, FETCH_WAIT_MAX_MS, "all", warm_s=2.0, work="forward", echo_cores=echo_cores) as (
        driver,
        _,
    ):
        driver.around_forward(50)
        yield driver


def around_summary(runs: list[tuple[float, float, float, float]]) -> dict[str, float]:
    """:meth:`Driver.around_forward`'s samples as p50 ms: the round trip, the forward, the hops (the round
    trip less the forward), the hop in and the hop back, and how many."""
    trip, hop_in, forward, hop_back = (statistics.median(column) for column in zip(*runs, strict=True))
    return {
        "round_trip": trip,
        "forward": forward,
        "hops": statistics.median(r[0] - r[2] for r in runs),
        "hop_in": hop_in,
        "hop_back": hop_back,
        "samples": len(runs),
    }


def latency_summary(hops: list[float]) -> dict[str, float]:
    """p50, p99 and mean (ms) of lone round trips, and how many."""
    return {
        "p50": statistics.median(hops),
        "p99": pct(hops, 99),
        "mean": statistics.fmean(hops),
        "samples": len(hops),
    }


def run(conn: KafkaConnection, args: argparse.Namespace) -> dict[str, Any]:
    with echo_pair(conn, args.fetch_wait_ms, args.acks, 1.0 if args.quick else 5.0) as (driver, child):
        driver.latency(50 if args.quick else 300)
        broker = broker_process(conn)
        procs = [p for p in (broker, psutil.Process(child.pid), psutil.Process()) if p is not None]
        names = (["broker"] if broker is not None else []) + ["echo", "driver"]

        def lone_round_trips(n: int, idle_s: float = 0.0) -> dict[str, Any]:
            """``n`` lone round trips (each after ``idle_s``): their latency and CPU a round trip."""
            before = cpu_seconds(*procs)
            hops = driver.latency(n, idle_s)
            spent = [b - a for a, b in zip(before, cpu_seconds(*procs), strict=True)]
            return {
                **latency_summary(hops),
                "cpu_ms_per_request": {k: 1000 * v / len(hops) for k, v in zip(names, spent, strict=True)},
            }

        latency = lone_round_trips(100 if args.quick else 500)
        after_idle = {
            "idle_ms": args.idle_ms,
            **lone_round_trips(50 if args.quick else 300, args.idle_ms / 1000),
        }

        idle_before, idle_began = cpu_seconds(*procs), time.perf_counter()
        time.sleep(2 if args.quick else 5)
        idle = [
            (b - a) / (time.perf_counter() - idle_began)
            for a, b in zip(idle_before, cpu_seconds(*procs), strict=True)
        ]
        driver.warm(1.0)
        before, began = cpu_seconds(*procs), time.perf_counter()
        answered = driver.saturate(3 if args.quick else 10)
        wall = time.perf_counter() - began
        spent = [b - a for a, b in zip(before, cpu_seconds(*procs), strict=True)]
        driver.drain(answered)
    return {
        "latency_ms": latency,
        "after_idle_ms": after_idle,
        "saturation": {
            "in_flight": IN_FLIGHT,
            "requests_per_s": answered / wall,
            "cpu_ms_per_request": {n: 1000 * s / answered for n, s in zip(names, spent, strict=True)},
            "cpu_cores": {n: s / wall for n, s in zip(names, spent, strict=True)},
        },
        "idle_cpu_cores": dict(zip(names, idle, strict=True)),
    }


def table(result: dict[str, Any]) -> str:
    sat, rested = result["saturation"], result["after_idle_ms"]

    def lone(label: str, run: dict[str, Any]) -> list[tuple[str, str]]:
        return [
            (f"two hops, {label}, p50", f"{run['p50']:.2f} ms"),
            (f"two hops, {label}, p99", f"{run['p99']:.2f} ms"),
            *(
                (f"CPU per request, {label}: {name}", f"{ms:.3f} ms")
                for name, ms in run["cpu_ms_per_request"].items()
            ),
        ]

    rows = [
        *lone("1 in flight", result["latency_ms"]),
        *lone(f"each after {rested['idle_ms']:g} ms idle", rested),
        (f"requests/s, {sat['in_flight']} in flight", f"{sat['requests_per_s']:.0f}"),
        *((f"CPU per request: {name}", f"{ms:.3f} ms") for name, ms in sat["cpu_ms_per_request"].items()),
        *((f"idle CPU: {name}", f"{cores:.3f} cores") for name, cores in result["idle_cpu_cores"].items()),
    ]
    if around := result.get("around_forward_ms"):
        rows += [
            ("two hops around MiniLM's forward, p50", f"{around['hops']:.2f} ms"),
            ("  the hop in / the hop back, p50", f"{around['hop_in']:.2f} / {around['hop_back']:.2f} ms"),
            ("  the forward between them, p50", f"{around['forward']:.2f} ms"),
        ]
    width = max(len(r[0]) for r in rows)
    return "\n".join(f"{name.ljust(width)} | {value}" for name, value in rows)


def main() -> None:
    if len(sys.argv) in (8, 9) and sys.argv[1] == "--echo":
        echo(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5], sys.argv[6], *sys.argv[7:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument(
        "--fetch-wait-ms",
        type=int,
        default=FETCH_WAIT_MAX_MS,
        help="consumers' fetch.wait.max.ms (default: the platform's)",
    )
    parser.add_argument("--acks", choices=("all", "1"), default="all", help="producers' acks (platform: all)")
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=20.0,
        help="idle time before each lone round trip of the second latency run, as one client leaves the "
        "broker while the model runs (default 20: about one client's MiniLM call on the 2-core box)",
    )
    parser.add_argument(
        "--around-forward",
        action="store_true",
        help="a third latency run with MiniLM's forward of batch 1 in the echo between the hops (loads the "
        "model from the cache, as raw_model.py)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kafka_floor.json")
    args = parser.parse_args()
    settings = load_settings(PlatformSettings)
    with kafka(settings) as conn:
        result = run(conn, args)
        if args.around_forward:
            result["around_forward_ms"] = hops_around_forward(conn, 50 if args.quick else 300)
    result["settings"] = {
        "fetch_wait_max_ms": args.fetch_wait_ms,
        "acks": args.acks,
        "idle_ms": args.idle_ms,
        "around_forward": args.around_forward,
        "quick": args.quick,
    }
    result["machine"] = {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "python": host.python_version(),
        "load_avg_1m": os.getloadavg()[0],
    }
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
