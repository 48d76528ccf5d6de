"""Where the platform's CPU goes under load: one model's worker and the edge, a closed-loop load of 64
clients, and what each process and each of the worker's threads spent per request while it ran.

    python benchmarks/cpu_profile.py [--model embeddings|generation] [--clients 64] [--seconds 15]
                                 [--flame DIR] [--rate 20] [--worker-cpus auto] [--set NAME=VALUE]
                                 [--quick] [--out FILE]

It starts its own Kafka (unless SLUICE_KAFKA_BOOTSTRAP is set), one ``sluice worker`` for the model and one
``sluice edge``, placed as ``sluice up`` places them (``--worker-cpus``), warms them up, then measures a
steady window of ``--seconds``:

- throughput and latency (p50, p99) of the window;
- CPU per process (the broker, the edge, the worker, this process's clients), in cores and in
  milliseconds a request;
- each busy thread of the worker and of the edge: on the CPU (in cores and in milliseconds a request),
  runnable but waiting for a core, context switches a second (``/proc/<pid>/task/*/schedstat``); the
  worker's model thread and the edge's event loop are their busiest Python threads;
- the worker's batch sizes over the window (its ``sluice_worker_batch_size`` histogram);
- a generation worker's drift-sampled prompts embedded and left without over the window (its drift
  embedder's counters);
- with ``--flame DIR``: a py-spy flame graph of the edge and of the worker over the window
  (``DIR/<model>-edge.svg``, ``DIR/<model>-worker.svg``, one root per thread). py-spy is a tool of the
  profiling session, not a dependency of the project: ``pip install py-spy``.

Generation requests are 64 tokens, not streamed; the worker runs 32 sequences at most.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from harness import broker_process, cpu_seconds, kafka, pct, service_env
from loadgen import closed_loop, completion, embed
from online import QUIET_BATCHES, ROOT, Services, counter_total, until_ok

from bus.placement import place_box
from infra.kafka.broker import free_port
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from schemas.settings import KafkaConnection, PlatformSettings, load_settings
from schemas.topics import TopicNames

MODELS = {"embeddings": "all-minilm-l6-v2", "generation": "demo-gpt"}
NEW_TOKENS = 64


@dataclass(frozen=True)
class ThreadTimes:
    name: str
    on_cpu_ns: int
    waiting_ns: int
    switches: int


def thread_times(pid: int) -> dict[int, ThreadTimes]:
    """Per thread of ``pid``: its name, ns on the CPU and runnable but waiting (``schedstat``), switches."""
    times: dict[int, ThreadTimes] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            on_cpu, waiting, _ = map(int, Path(f"{base}/schedstat").read_text().split())
            status = Path(f"{base}/status").read_text()
        except OSError:
            continue  # it ended meanwhile
        switches = sum(int(line.split()[1]) for line in status.splitlines() if "ctxt_switches" in line)
        times[int(tid)] = ThreadTimes(name, on_cpu, waiting, switches)
    return times


def batch_histogram(metrics: str) -> dict[float, float]:
    """``le`` -> cumulative count of the worker's batch-size histogram, summed over its label sets."""
    buckets: dict[float, float] = {}
    for line in metrics.splitlines():
        if line.startswith("sluice_worker_batch_size_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return buckets


def batch_sizes(before: dict[float, float], after: dict[float, float]) -> dict[str, float]:
    """Batches run in the window per bucket (``<= le``, not cumulative) and their count."""
    bounds = sorted(after)
    cumulative = [after[b] - before.get(b, 0.0) for b in bounds]
    counts = [c - (cumulative[i - 1] if i else 0.0) for i, c in enumerate(cumulative)]
    return {("+Inf" if b == float("inf") else f"{b:g}"): n for b, n in zip(bounds, counts, strict=True) if n}


DRIFT_COUNTERS = {
    "embedded": "sluice_worker_drift_embeddings_total",
    "skipped": "sluice_worker_drift_embeddings_skipped_total",
}
"""The worker's drift embedder over the window: prompts embedded and left without (a generation worker)."""


async def profile(
    args: argparse.Namespace, conn: KafkaConnection, url: str, services: Services, name: str
) -> dict[str, Any]:
    worker_ops = f"http://127.0.0.1:{services.ops[name]}"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:

        async def job(n: int) -> int:
            if args.model == "embeddings":
                return await embed(session, url, n)
            return await completion(session, url, NEW_TOKENS)

        async def ready() -> bool:
            if not await services.ready(session, name, f"{worker_ops}/readyz"):
                return False
            if not await services.ready(session, "edge", f"{url}/readyz"):
                return False
            await job(0)
            return True

        await until_ok(ready)
        await closed_loop(args.clients, args.clients * (1 if args.quick else 4), job)  # warm-up

        async def worker_metrics() -> str:
            async with session.get(f"{worker_ops}/metrics") as response:
                return await response.text()

        worker = psutil.Process(services.procs[name].pid)
        broker = broker_process(conn)  # not on this machine: not counted
        processes = {"broker": broker} if broker is not None else {}
        processes |= {"edge": psutil.Process(services.procs["edge"].pid), "worker": worker}
        processes["clients"] = psutil.Process()
        spies = flame_graphs(args, {"edge": processes["edge"], "worker": worker})
        metrics_before = await worker_metrics()
        cpu_before = cpu_seconds(*processes.values())
        watched = {"worker": worker.pid, "edge": services.procs["edge"].pid}
        threads_before = {label: thread_times(pid) for label, pid in watched.items()}
        latencies: list[float] = []
        units = 0
        started = time.perf_counter()

        async def client() -> None:
            nonlocal units
            n = 0
            while time.perf_counter() - started < args.seconds:
                n += 1
                sent = time.perf_counter()
                done = await job(n)  # not `units += await ...`: that reads units before the wait
                units += done
                latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(client() for _ in range(args.clients)))
        wall = time.perf_counter() - started
        cpu_after = cpu_seconds(*processes.values())
        threads_after = {label: thread_times(pid) for label, pid in watched.items()}
        metrics_after = await worker_metrics()
    for spy in spies:
        spy.wait(60)
    requests = len(latencies)
    cores = {k: (b - a) / wall for k, a, b in zip(processes, cpu_before, cpu_after, strict=True)}
    busiest = {"worker": "model", "edge": "event loop"}
    threads = {
        label: thread_rows(threads_before[label], threads_after[label], wall, requests, busiest[label])
        for label in watched
    }
    return {
        "model": MODELS[args.model],
        "clients": args.clients,
        "settings": args.overrides,
        "window_s": wall,
        "requests": requests,
        "units_per_s": units / wall,
        "unit": "embeddings" if args.model == "embeddings" else "tokens",
        "p50_ms": pct(latencies, 50) * 1000,
        "p99_ms": pct(latencies, 99) * 1000,
        "cores": cores,
        "cpu_ms_per_request": {k: c * wall / requests * 1000 for k, c in cores.items()},
        "threads": threads,
        "batches": batch_sizes(batch_histogram(metrics_before), batch_histogram(metrics_after)),
        "quiet_batches": counter_total(metrics_after, QUIET_BATCHES)
        - counter_total(metrics_before, QUIET_BATCHES),
        "drift_embeddings": {
            key: counter_total(metrics_after, name) - counter_total(metrics_before, name)
            for key, name in DRIFT_COUNTERS.items()
        },
        "flame_graphs": [str(path) for path in flame_paths(args)],
        "load_average": os.getloadavg()[0],
    }


def thread_rows(
    before: dict[int, ThreadTimes], after: dict[int, ThreadTimes], wall: float, requests: int, busiest: str
) -> list[dict[str, Any]]:
    """The threads busy over the window (>= 0.5 % of a core), busiest first; the OS names every Python
    thread "python", so the busiest of those is labelled ``busiest`` (the model thread, the event loop)."""
    rows: list[dict[str, Any]] = []
    for tid, now in after.items():
        then = before.get(tid, ThreadTimes(now.name, 0, 0, 0))
        on_cpu = (now.on_cpu_ns - then.on_cpu_ns) / 1e9 / wall
        if on_cpu >= 0.005:
            rows.append(
                {
                    "thread": now.name if now.name.startswith("rdk:") else f"{now.name} {tid}",
                    "on_cpu": on_cpu,
                    "cpu_ms_per_request": on_cpu * wall / requests * 1000,
                    "waiting": (now.waiting_ns - then.waiting_ns) / 1e9 / wall,
                    "switches_per_s": (now.switches - then.switches) / wall,
                }
            )
    rows.sort(key=lambda t: -t["on_cpu"])
    python = [t for t in rows if not t["thread"].startswith("rdk:")]
    if python:
        python[0]["thread"] += f" ({busiest})"
    return rows


def flame_paths(args: argparse.Namespace) -> list[Path]:
    return (
        []
        if args.flame is None
        else [args.flame / f"{args.model}-{label}.svg" for label in ("edge", "worker")]
    )


def flame_graphs(
    args: argparse.Namespace, processes: dict[str, psutil.Process]
) -> list[subprocess.Popen[bytes]]:
    """py-spy recording each process over the window (none without ``--flame``)."""
    if args.flame is None:
        return []
    args.flame.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                args.py_spy,
                "record",
                "--pid",
                str(proc.pid),
                "--duration",
                str(max(1, round(args.seconds))),
                "--rate",
                str(args.rate),
                "--threads",
                "--nonblocking",
                "--format",
                "flamegraph",
                "--output",
                str(path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for path, proc in zip(flame_paths(args), (processes["edge"], processes["worker"]), strict=True)
    ]


def table(result: dict[str, Any]) -> str:
    rows = [
        f"{result['model']} at {result['clients']} clients over {result['window_s']:.1f} s: "
        f"{result['units_per_s']:,.0f} {result['unit']}/s, p50 {result['p50_ms']:.1f} ms, "
        f"p99 {result['p99_ms']:.1f} ms ({result['requests']} requests, load {result['load_average']:.1f})",
        f"{'process':>10} {'cores':>6} {'CPU ms a request':>17}",
    ]
    cores, per_request = result["cores"], result["cpu_ms_per_request"]
    rows += [f"{k:>10} {cores[k]:>6.2f} {per_request[k]:>17.3f}" for k in cores]
    for label, threads in result["threads"].items():
        rows.append(
            f"{label + ' thread':>26} {'on CPU':>7} {'ms a request':>13} {'waiting':>8} {'switches/s':>11}"
        )
        rows += [
            f"{t['thread']:>26} {t['on_cpu']:>7.3f} {t['cpu_ms_per_request']:>13.3f} {t['waiting']:>8.3f}"
            f" {t['switches_per_s']:>11,.0f}"
            for t in threads
        ]
    batches = result["batches"]
    rows.append(
        "batches by size (<= bound: count): "
        + ", ".join(f"{b}: {n:.0f}" for b, n in batches.items())
        + f"; on the quiet team: {result['quiet_batches']:.0f}"
    )
    drift = result["drift_embeddings"]
    if any(drift.values()):
        rows.append(
            f"drift-sampled prompts: {drift['embedded']:.0f} embedded, {drift['skipped']:.0f} skipped"
        )
    for path in result["flame_graphs"]:
        rows.append(f"flame graph: {path}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="embeddings", help="the load (default embeddings)"
    )
    parser.add_argument("--clients", type=int, default=64, help="closed-loop clients (default 64)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="the measured window (default 15; 2 with --quick)"
    )
    parser.add_argument(
        "--flame", type=Path, default=None, help="write py-spy flame graphs of the edge and the worker here"
    )
    parser.add_argument(
        "--rate", type=int, default=20, help="py-spy samples a second (default 20; 50 stalled the box here)"
    )
    parser.add_argument(
        "--worker-cpus",
        default="auto",
        help="cores for the worker, as `sluice up --worker-cpus` (default auto; 'off': no pinning)",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="SLUICE_NAME=VALUE",
        help="a setting for the edge and the worker (repeatable; for A/B runs: the benchmark otherwise drops "
        "this shell's SLUICE_* settings)",
    )
    parser.add_argument("--quick", action="store_true", help="a short warm-up and window (a smoke run)")
    parser.add_argument(
        "--out", type=Path, default=None, help="JSON (default benchmarks/results/profile-<model>.json)"
    )
    args = parser.parse_args()
    if args.clients < 1:
        parser.error("--clients must be at least 1")
    if args.seconds is None:
        args.seconds = 2.0 if args.quick else 15.0
    if args.seconds <= 0:
        parser.error("--seconds must be positive")
    args.overrides = overrides = dict(item.partition("=")[::2] for item in args.set)
    if bad := [k for k in overrides if not k.startswith("SLUICE_") or not overrides[k]]:
        parser.error(f"--set takes SLUICE_NAME=VALUE, not {', '.join(bad)}")
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results" / f"profile-{args.model}.json"
    args.py_spy = shutil.which("py-spy") if args.flame is not None else None
    if args.flame is not None and args.py_spy is None:
        parser.error("--flame needs py-spy on the PATH: pip install py-spy")
    settings = load_settings(PlatformSettings)
    subprocess.run(
        [sys.executable, "-m", "sluice", "models", "prepare"], check=True, stdout=subprocess.DEVNULL
    )
    placed, worker_env = place_box(args.worker_cpus)
    print(placed or "no CPU placement", file=sys.stderr)
    name = "worker"
    with kafka(settings) as conn:
        prefix = f"profile{int(time.time())}"
        apply_topics(
            make_admin(conn),
            platform_topics(TopicNames(prefix), settings.served_models(), TopicSizing(replies=1)),
        )
        port = free_port()
        env = service_env(
            conn, prefix, SLUICE_EDGE_PORT=str(port), SLUICE_WORKER_MAX_RUNNING="32", **overrides
        )
        services = Services(env, Path(tempfile.mkdtemp(prefix="sluice-profile-logs-")), worker_env)
        try:
            services.start(name, ["worker", "--model", MODELS[args.model]])
            services.start("edge", ["edge"])
            print(f"{MODELS[args.model]} under {args.clients} clients ...", file=sys.stderr)
            result = asyncio.run(profile(args, conn, f"http://127.0.0.1:{port}", services, name))
        except BaseException:
            services.print_tails()
            raise
        finally:
            services.stop_all()
    print(table(result))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
