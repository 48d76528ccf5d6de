"""What a refusal costs under overload (issue 11's P4: p99 of the refusal ≤ 1 ms at 10x a tenant's limit).

    python benchmarks/overload.py [--quick] [--out benchmarks/results/overload.json]

Two edges (in this process, each with its real Kafka gateway on a broker this script starts on free ports,
unless SLUICE_KAFKA_BOOTSTRAP is set) share one tenant's limit of 60 requests per minute. Closed-loop
clients, half on each edge, send that tenant's requests as fast as the edges answer. No worker runs: the
admitted requests (the limit's worth) wait for their 1 s deadline, everything else is refused. Reported:

- the refusal's cost inside the edge (from the request reaching the handler to the 429 being written),
  per refusal, from an aiohttp middleware: this is the P4 number;
- the refusal's round trip as the client sees it (loopback HTTP; the clients run in a process of their
  own, on the same 2 cores);
- how many were admitted across both edges, against the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform as host
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import msgspec
from aiohttp import web
from harness import kafka, pct

from gpu_workers.models import build_demo_gpt
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.app import Edge
from ingest.auth import hash_key
from ingest.main import build_edge
from ingest.settings import EdgeSettings
from schemas.manifest import models_root
from schemas.settings import PlatformSettings, load_settings
from schemas.topics import TopicNames

ROOT = Path(__file__).resolve().parent.parent
LIMIT_PER_MIN = 60
KEY = "sk-flood"


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def timing(refusals: list[float]) -> Middleware:
    @web.middleware
    async def timed(request: web.Request, handler: Handler) -> web.StreamResponse:
        began = time.perf_counter()
        response = await handler(request)
        if response.status == 429:
            refusals.append(time.perf_counter() - began)
        return response

    return timed


async def client(
    session: aiohttp.ClientSession, url: str, until: float, seen: list[tuple[int, float]]
) -> None:
    body = {"model": "demo-gpt", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {KEY}", "X-Request-Timeout": "1"}
    while time.monotonic() < until:
        began = time.perf_counter()
        async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as response:
            await response.read()
            seen.append((response.status, time.perf_counter() - began))


async def run(
    platform: PlatformSettings, seconds: float, clients: int, tenants_file: Path
) -> dict[str, object]:
    inside: list[float] = []
    edges: list[Edge] = []
    gateways = []
    try:
        for name in ("bench-a", "bench-b"):
            edge, gateway = build_edge(
                platform, EdgeSettings(edge_port=0, edge_id=name, edge_tenants_file=str(tenants_file)), 2
            )
            edge.app.middlewares.insert(0, timing(inside))  # type: ignore[arg-type]  # aiohttp's Protocol
            await gateway.start()
            gateways.append(gateway)
            await edge.start()
            edges.append(edge)
        await asyncio.sleep(1.5)  # the edges hear each other before the load starts
        # the clients in a process of their own: on the edges' event loop they would queue behind each other
        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            pending = pool.apply_async(load, ([edge.url for edge in edges], seconds, clients))
            seen = await asyncio.to_thread(pending.get, seconds + 60)
    finally:
        for edge in reversed(edges):
            await edge.stop()
        for gateway in reversed(gateways):
            await gateway.stop()
    refused = [t for status, t in seen if status == 429]
    admitted = sum(1 for status, _ in seen if status != 429)
    return {
        "offered": len(seen),
        "offered_per_s": len(seen) / seconds,
        "limit_per_min": LIMIT_PER_MIN,
        "admitted": admitted,
        "refused": len(refused),
        "refusal_in_edge_ms": {
            "p50": pct(inside, 50) * 1000,
            "p99": pct(inside, 99) * 1000,
            "mean": statistics.fmean(inside) * 1000,
        },
        "refusal_round_trip_ms": {"p50": pct(refused, 50) * 1000, "p99": pct(refused, 99) * 1000},
    }


def load(urls: list[str], seconds: float, clients: int) -> list[tuple[int, float]]:
    """The load generator's process: ``clients`` closed loops, alternating between the edges."""

    async def drive() -> list[tuple[int, float]]:
        seen: list[tuple[int, float]] = []
        until = time.monotonic() + seconds
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=clients)) as session:
            await asyncio.gather(*(client(session, urls[i % len(urls)], until, seen) for i in range(clients)))
        return seen

    return asyncio.run(drive())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a 3 s smoke run")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long the overload lasts")
    parser.add_argument("--clients", type=int, default=32, help="closed-loop clients, half per edge")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "overload.json")
    args = parser.parse_args()
    seconds = 3.0 if args.quick else args.seconds
    settings = load_settings(PlatformSettings)
    print("preparing demo-gpt (first run: about a minute)...", flush=True)
    build_demo_gpt(models_root(settings.cache_dir))
    with tempfile.TemporaryDirectory(prefix="sluice-overload-") as tmp:
        tenants = Path(tmp) / "tenants.json"
        tenants.write_text(
            json.dumps(
                {"tenants": {"flood": {"key_sha256": [hash_key(KEY)], "requests_per_min": LIMIT_PER_MIN}}}
            )
        )
        with kafka(settings) as connection:
            prefix = f"bench-overload-{os.getpid()}"
            platform = msgspec.structs.replace(
                settings, kafka_bootstrap=connection.bootstrap, topic_prefix=prefix, models=("demo-gpt",)
            )
            apply_topics(
                make_admin(connection),
                platform_topics(TopicNames(prefix), ["demo-gpt"], TopicSizing(replies=2)),
            )
            result = asyncio.run(run(platform, seconds, args.clients, tenants))
    inside, trip = result["refusal_in_edge_ms"], result["refusal_round_trip_ms"]
    assert isinstance(inside, dict)
    assert isinstance(trip, dict)
    rows = [
        ("offered", f"{result['offered']} ({result['offered_per_s']:.0f}/s)", ""),
        ("admitted across 2 edges", str(result["admitted"]), f"limit {LIMIT_PER_MIN}/min"),
        ("refusal in the edge p50 / p99", f"{inside['p50']:.3f} / {inside['p99']:.3f} ms", "P4: p99 <= 1 ms"),
        (
            "refusal round trip p50 / p99",
            f"{trip['p50']:.2f} / {trip['p99']:.2f} ms",
            "client on the same cores",
        ),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"\n{'metric'.ljust(width)}  value                     note")
    for name, value, note in rows:
        print(f"{name.ljust(width)}  {value.ljust(24)}  {note}")
    result["machine"] = {"cpus": os.cpu_count(), "python": host.python_version(), "quick": args.quick}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
