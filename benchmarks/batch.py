"""Interactive time to first token while a batch runs (issue 13: a batch never raises interactive p99 TTFT
over its SLO), and what the same work does to it without the batch lane.

    python benchmarks/batch.py [--quick] [--seconds S] [--lines N] [--out benchmarks/results/batch.json]

It starts its own Kafka (unless SLUICE_KAFKA_BOOTSTRAP is set), one ``sluice worker`` for demo-gpt and one
``sluice edge``, as separate processes, and measures, from this process, a few closed-loop interactive
clients streaming chat completions (TTFT per request) in three phases of the same length:

1. **alone**: the interactive clients only;
2. **beside a batch**: a chat batch (OpenAI Batch API: file upload, ``POST /v1/batches``) runs at the
   same time, its lines published ``SLUICE_EDGE_BATCH_MAX_IN_FLIGHT`` at a time in the workers' batch class;
3. **same work, no batch lane**: the batch's lines sent as ordinary requests by as many concurrent clients
   as the batch's in-flight window (what a user without a batch API does).

The interactive SLO is the default tier's TTFT objective (``sluice slo show``): 95% under 0.5 s. The table
gives TTFT p50/p99 and the share under the threshold per phase, and the background's throughput (lines/s),
so the cost of the lane to the batch shows too. Numbers move with the machine's load (printed).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform as host
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from harness import cpu_model, kafka, pct, service_env
from loadgen import AUTH, client_session
from online import Services, until_ok

from infra.kafka.broker import free_port
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from monitoring.slo import DEFAULT_TIERS, LatencyObjective
from schemas.settings import PlatformSettings, load_settings
from schemas.topics import TopicNames

ROOT = Path(__file__).resolve().parent.parent
MODEL = "demo-gpt"
INTERACTIVE_CLIENTS = 4
INTERACTIVE_TOKENS = 16
BATCH_TOKENS = 48
IN_FLIGHT = 32


def _interactive_ttft() -> LatencyObjective:
    objective = DEFAULT_TIERS[0].ttft
    if objective is None:
        raise RuntimeError("the default interactive tier has no TTFT objective")
    return objective


SLO = _interactive_ttft()


def chat_body(i: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    content = f"Tell me about the river and the stone wall, part {i}."
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


async def interactive(session: aiohttp.ClientSession, url: str, seconds: float) -> list[float]:
    """TTFT (s) of every streamed request the closed-loop clients made in ``seconds``."""
    ttfts: list[float] = []
    until = time.monotonic() + seconds

    async def client(c: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            began = time.perf_counter()
            body = chat_body(c * 100_000 + n, INTERACTIVE_TOKENS, stream=True)
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as response:
                if response.status != 200:
                    raise RuntimeError(await response.text())
                first = None
                async for line in response.content:
                    if first is None and line.startswith(b"data: {"):
                        first = time.perf_counter() - began
                if first is not None:
                    ttfts.append(first)

    await asyncio.gather(*(client(c) for c in range(INTERACTIVE_CLIENTS)))
    return ttfts


async def start_batch(session: aiohttp.ClientSession, url: str, lines: int) -> str:
    body = b"".join(
        json.dumps(
            {
                "custom_id": f"b{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": chat_body(i, BATCH_TOKENS),
            }
        ).encode()
        + b"\n"
        for i in range(lines)
    )
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO(body), filename="bench.jsonl", content_type="application/jsonl")
    async with session.post(f"{url}/v1/files", data=form, headers=AUTH) as response:
        uploaded = await response.json()
    create = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    async with session.post(f"{url}/v1/batches", json=create, headers=AUTH) as response:
        batch_id: str = (await response.json())["id"]
    await until_state(session, url, batch_id, lambda state: state["status"] != "validating")
    return batch_id


async def until_state(
    session: aiohttp.ClientSession,
    url: str,
    batch_id: str,
    done: Callable[[dict[str, Any]], bool],
    within: float = 300,
) -> dict[str, Any]:
    """Poll the batch (bounded) until ``done(state)``; that state."""
    deadline = time.monotonic() + within
    while True:
        state = await batch_state(session, url, batch_id)
        if done(state):
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"batch {batch_id} did not get there within {within:.0f}s")
        await asyncio.sleep(0.2)


async def batch_state(session: aiohttp.ClientSession, url: str, batch_id: str) -> dict[str, Any]:
    async with session.get(f"{url}/v1/batches/{batch_id}", headers=AUTH) as response:
        state: dict[str, Any] = await response.json()
        return state


def settled(state: dict[str, Any]) -> int:
    counts = state["request_counts"]
    return int(counts["completed"] + counts["failed"])


async def background(session: aiohttp.ClientSession, url: str, until: float, done: list[int]) -> None:
    """The batch's lines as ordinary requests, ``IN_FLIGHT`` at a time (no batch lane)."""

    async def client(c: int) -> None:
        n = 0
        while time.monotonic() < until:
            n += 1
            body = chat_body(c * 100_000 + n, BATCH_TOKENS)
            async with session.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as response:
                await response.read()
                if response.status == 200 and time.monotonic() < until:
                    done[0] += 1

    await asyncio.gather(*(client(c) for c in range(IN_FLIGHT)))


def summary(ttfts: list[float], seconds: float, background_per_s: float | None) -> dict[str, Any]:
    within = sum(1 for t in ttfts if t <= SLO.threshold_seconds) / len(ttfts) if ttfts else 0.0
    return {
        "requests": len(ttfts),
        "ttft_p50_ms": pct(ttfts, 50) * 1000,
        "ttft_p99_ms": pct(ttfts, 99) * 1000,
        "share_within_slo": within,
        "slo_met": within >= SLO.target,
        "interactive_per_s": len(ttfts) / seconds,
        "background_lines_per_s": background_per_s,
    }


async def measure(url: str, services: Services, seconds: float, lines: int) -> dict[str, Any]:
    async with client_session() as session:

        async def ready() -> bool:
            return await services.ready(session, "edge", f"{url}/readyz")

        await until_ok(ready)
        await interactive(session, url, 3)  # warm-up
        print("phase 1: interactive alone ...", file=sys.stderr)
        alone = summary(await interactive(session, url, seconds), seconds, None)

        print("phase 2: beside a batch ...", file=sys.stderr)
        batch_id = await start_batch(session, url, lines)
        # The window opens once the batch runs (its first lines settled), so a slow start on a loaded box
        # is not counted as the batch's pace beside the clients.
        before = settled(await until_state(session, url, batch_id, lambda state: settled(state) > 0))
        ttfts = await interactive(session, url, seconds)
        after = await batch_state(session, url, batch_id)
        beside = summary(ttfts, seconds, (settled(after) - before) / seconds)
        beside["batch_status_after"] = after["status"]
        async with session.post(f"{url}/v1/batches/{batch_id}/cancel", headers=AUTH) as response:
            await response.read()
        await until_state(session, url, batch_id, lambda state: state["status"] in ("cancelled", "completed"))

        print("phase 3: the same work as interactive requests ...", file=sys.stderr)
        done = [0]
        until = time.monotonic() + seconds + 1
        flood = asyncio.create_task(background(session, url, until, done))
        await asyncio.sleep(1)  # the background is up to speed
        counted = done[0]
        ttfts = await interactive(session, url, seconds)
        no_lane = summary(ttfts, seconds, (done[0] - counted) / seconds)
        await flood
    return {"alone": alone, "beside_batch": beside, "no_batch_lane": no_lane}


def table(result: dict[str, Any]) -> str:
    rows = [
        f"interactive TTFT with a batch running (SLO: {SLO.target:.0%} under {SLO.threshold_seconds * 1000:.0f} ms)",
        "",
        "| phase | TTFT p50 ms | TTFT p99 ms | within SLO | SLO met | interactive req/s | background lines/s |",
        "|---|---|---|---|---|---|---|",
    ]
    names = {"alone": "alone", "beside_batch": "beside a batch", "no_batch_lane": "same work, no batch lane"}
    for key, label in names.items():
        r = result[key]
        bg = "" if r["background_lines_per_s"] is None else f"{r['background_lines_per_s']:.1f}"
        rows.append(
            f"| {label} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['share_within_slo']:.1%} | "
            f"{'yes' if r['slo_met'] else 'NO'} | {r['interactive_per_s']:.1f} | {bg} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="short phases and a small batch (a smoke run)")
    parser.add_argument(
        "--seconds", type=float, default=None, help="length of each phase (default 20; quick 3)"
    )
    parser.add_argument(
        "--lines", type=int, default=None, help="lines in the batch (default 3000; quick 200)"
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "batch.json")
    args = parser.parse_args()
    seconds = args.seconds or (3.0 if args.quick else 20.0)
    lines = args.lines or (200 if args.quick else 3000)
    settings = load_settings(PlatformSettings)
    load_before = os.getloadavg()
    subprocess.run(
        [sys.executable, "-m", "sluice", "models", "prepare"], check=True, stdout=subprocess.DEVNULL
    )
    with kafka(settings) as conn, tempfile.TemporaryDirectory(prefix="sluice-bench-batch-") as data:
        prefix = f"benchbatch{int(time.time())}"
        apply_topics(make_admin(conn), platform_topics(TopicNames(prefix), [MODEL], TopicSizing(replies=1)))
        port = free_port()
        env = service_env(
            conn,
            prefix,
            SLUICE_MODELS=MODEL,
            SLUICE_DATA_DIR=data,
            SLUICE_EDGE_PORT=str(port),
            SLUICE_EDGE_BATCH_MAX_IN_FLIGHT=str(IN_FLIGHT),
        )
        services = Services(env, Path(data) / "logs")
        try:
            services.start("gen", ["worker", "--model", MODEL])
            services.start("edge", ["edge"])
            result = asyncio.run(measure(f"http://127.0.0.1:{port}", services, seconds, lines))
        except BaseException:
            services.print_tails()
            raise
        finally:
            services.stop_all()
    result["slo"] = {"threshold_ms": SLO.threshold_seconds * 1000, "target": SLO.target}
    result["machine"] = {
        "cpus": os.cpu_count(),
        "cpu": cpu_model(),
        "python": host.python_version(),
        "quick": args.quick,
        "seconds_per_phase": seconds,
        "batch_lines": lines,
        "interactive_clients": INTERACTIVE_CLIENTS,
        "batch_in_flight": IN_FLIGHT,
        "load_avg_start": load_before,
        "load_avg_end": os.getloadavg(),
    }
    print(table(result))
    load = " / ".join(f"{a:.1f}" for a in load_before), " / ".join(f"{a:.1f}" for a in os.getloadavg())
    print(f"\nload average (1/5/15 min) at start {load[0]}, at end {load[1]} on {os.cpu_count()} CPUs")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
