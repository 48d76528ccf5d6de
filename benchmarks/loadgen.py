"""The one HTTP load generator every benchmark target gets: OpenAI-shaped requests (embeddings, completions,
streamed time to first token), a closed loop of N clients, and a profile (throughput, p50/p99 latency) at 1
and 64 clients. The platform, the naive peer and the Ray Serve peer are all measured with this, so their
numbers differ only by the server.

Run as a script it is one client process of :func:`spread_rate` (several edges, one such process each)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from collections.abc import Awaitable, Callable

import aiohttp
from harness import pct

KEY = "sk-sluice-demo"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "Tell me about the river and the stone wall."
NEW_TOKENS = 64
"""Tokens per completion in the profiles (``ignore_eos``: every request makes exactly this many); a quick
run asks for ``QUICK_TOKENS``."""
QUICK_TOKENS = 16
CLIENTS = (1, 64)
WORKLOADS = ("embeddings", "generation")

Profile = dict[str, float]
"""``clients``, ``requests``, ``per_s`` (embeddings/s or tokens/s), ``p50_ms``, ``p99_ms`` (per request)."""


async def completion(session: aiohttp.ClientSession, url: str, max_tokens: int) -> int:
    body = {
        "model": "demo-gpt",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with session.post(f"{url}/v1/completions", json=body, headers=AUTH) as response:
        data = await response.json()
        if response.status != 200:
            raise RuntimeError(data)
        return int(data["usage"]["completion_tokens"])


async def ttft_stamped(session: aiohttp.ClientSession, url: str) -> tuple[str, float, float]:
    """One streamed completion of 2 tokens: its request id (the edge's ``x-request-id``), and the wall-clock
    times it was sent and its first token's chunk read (time to first token is the difference; the times
    go beside the timings its terminal event carries)."""
    body = {"model": "demo-gpt", "prompt": PROMPT, "max_tokens": 2, "temperature": 0, "stream": True}
    sent, first = time.time(), None
    async with session.post(f"{url}/v1/completions", json=body, headers=AUTH) as response:
        if response.status != 200:
            raise RuntimeError(await response.text())
        async for line in response.content:
            if first is None and line.startswith(b"data: {"):
                first = time.time()
        return response.headers.get("x-request-id", ""), sent, math.nan if first is None else first


EMBED_TEXTS = 256
"""How many different embedding inputs the load cycles through: ``embed_text(n)`` for n below this are all
10 MiniLM tokens. The raw baseline embeds exactly these, so both sides do the same work per item (a load
numbered up to 1,000 would send 11-token inputs too, and a padded batch of 10 and 11 costs ~10 % more)."""


def embed_text(n: int) -> str:
    """The ``n``-th embedding input: a short sentence of 10 MiniLM tokens, one of ``EMBED_TEXTS``."""
    return f"a short sentence about rivers and stones {n % EMBED_TEXTS}"


async def embed(session: aiohttp.ClientSession, url: str, n: int) -> int:
    """One embedding request; 1 (the number of inputs embedded)."""
    body = {"model": "all-minilm-l6-v2", "input": embed_text(n)}
    async with session.post(f"{url}/v1/embeddings", json=body, headers=AUTH) as response:
        if response.status != 200:
            raise RuntimeError(await response.text())
        await response.read()
    return 1


async def embed_stamped(session: aiohttp.ClientSession, url: str, n: int) -> tuple[str, float, float, str]:
    """One embedding request: its request id (the edge's ``x-request-id``), the wall-clock times it was
    sent and its whole answer read (to set beside the timings its terminal event carries), and the answer's
    ``Server-Timing`` header ("" if none)."""
    body = {"model": "all-minilm-l6-v2", "input": embed_text(n)}
    sent = time.time()
    async with session.post(f"{url}/v1/embeddings", json=body, headers=AUTH) as response:
        if response.status != 200:
            raise RuntimeError(await response.text())
        await response.read()
        done = time.time()
        return response.headers.get("x-request-id", ""), sent, done, response.headers.get("Server-Timing", "")


async def closed_loop(
    concurrency: int, total: int, job: Callable[[int], Awaitable[object]]
) -> tuple[float, list[object]]:
    """``total`` jobs by ``concurrency`` clients, each starting its next job when the last one ends."""
    queue = iter(range(total))
    results: list[object] = []

    async def client() -> None:
        for n in queue:
            results.append(await job(n))

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return time.perf_counter() - started, results


async def steady(
    concurrency: int,
    job: Callable[[int], Awaitable[int]],
    *,
    warm_s: float,
    window_s: float,
    warm_jobs: int = 0,
) -> tuple[float, list[float]]:
    """Units per second at steady state, and the latencies (ms) of the jobs counted: ``concurrency``
    closed-loop clients run ``job`` (which returns its units) without pause; what completes in ``window_s``
    counts. The window opens at the first completion after ``warm_s`` of ramp-up and ``warm_jobs`` jobs
    done (``concurrency`` of them: every client's first request, which all arrived at once, is behind it).

    A fixed number of jobs would also time the ramp-up (every client arriving at once) and the drain (the
    last requests finishing with nobody behind them): over a phase of a few seconds that cost the platform
    10-15 % of its generation throughput against the same load measured at steady state."""
    numbers = iter(range(1 << 62))
    started = time.perf_counter()
    closes: float | None = None  # set when the window opens
    done = counted = 0
    latencies: list[float] = []

    async def client() -> None:
        nonlocal closes, done, counted
        while closes is None or time.perf_counter() < closes:
            sent = time.perf_counter()
            units = await job(next(numbers))
            now = time.perf_counter()
            done += 1
            if closes is None:
                if now - started >= warm_s and done >= warm_jobs:
                    closes = now + window_s
            elif now < closes:
                counted += units
                latencies.append((now - sent) * 1000)

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return counted / window_s, latencies


async def steady_rate(
    concurrency: int, job: Callable[[int], Awaitable[int]], *, warm_s: float, window_s: float
) -> float:
    """:func:`steady`'s units per second."""
    return (await steady(concurrency, job, warm_s=warm_s, window_s=window_s))[0]


SPREAD_START_S = 2.0
"""How far ahead :func:`spread_rate` sets its client processes' common start: time for each to import
aiohttp and open its session (~0.3 s here), so that their windows line up."""


async def spread_rate(
    urls: list[str], concurrency: int, workload: str, *, warm_s: float, window_s: float, tokens: int
) -> float:
    """:func:`steady_rate` of ``workload`` (``embeddings``, or ``generation`` of ``tokens`` a completion)
    spread over several edges: ``concurrency`` clients shared out between ``urls``, each url's share in a
    client process of its own (this module as a script), all starting at one wall-clock instant. The
    units/s of all of them, summed.

    One Python process drives ~1-2k requests/s; on a GPU the model outruns that (MiniLM at batch 64 on
    an H200: 15k embeddings/s), so one client process, like one edge, would measure Python, not the
    platform. With one url this is :func:`steady_rate` in this process."""
    if len(urls) == 1:
        async with client_session() as session:
            return await steady_rate(
                concurrency, job_for(session, urls[0], workload, tokens), warm_s=warm_s, window_s=window_s
            )
    start_at = time.time() + SPREAD_START_S
    shares = [concurrency // len(urls) + (i < concurrency % len(urls)) for i in range(len(urls))]
    procs = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *("--url", url, "--clients", str(share), "--workload", workload, "--tokens", str(tokens)),
            *("--warm-s", str(warm_s), "--window-s", str(window_s), "--start-at", repr(start_at)),
            *("--first", str(i << 40)),
            stdout=asyncio.subprocess.PIPE,
        )
        for i, (url, share) in enumerate(zip(urls, shares, strict=True))
        if share
    ]
    outs = [(await proc.communicate())[0] for proc in procs]
    if failed := [proc.returncode for proc in procs if proc.returncode != 0]:
        raise RuntimeError(f"{len(failed)} of {len(procs)} client processes failed (exit {failed[0]})")
    return sum(float(json.loads(out)["per_s"]) for out in outs)


def job_for(
    session: aiohttp.ClientSession, url: str, workload: str, tokens: int, first: int = 0
) -> Callable[[int], Awaitable[int]]:
    """One request of ``workload`` at ``url`` (the ``n``-th, numbered from ``first``), returning its units."""
    if workload == "embeddings":
        return lambda n: embed(session, url, first + n)
    if workload == "generation":
        return lambda _n: completion(session, url, tokens)
    raise ValueError(f"unknown workload {workload!r}: embeddings or generation")


PROFILE_WINDOW_S = {False: (1.0, 8.0), True: (0.5, 2.0)}
"""``{quick: (warm_s, window_s)}`` of a profile at more than one client (:func:`steady`)."""
ONE_CLIENT_REQUESTS = {"embeddings": (200, 32), "generation": (24, 6)}
"""``{workload: (requests, quick run's)}`` of a profile at one client."""


async def profile(clients: int, job: Callable[[int], Awaitable[int]], requests: int, quick: bool) -> Profile:
    """``job`` (returning its units) by ``clients`` closed-loop clients, after an untimed warm-up.

    One client makes ``requests`` requests, one after another: its latency is the point. More clients are
    measured at steady state (:func:`steady`, every peer alike): a fixed number of requests at 64 clients
    times their arrival all at once and the drain with nobody behind it, which cost a batching server more
    than a server that answers one request at a time."""
    if clients > 1:  # steady() warms up itself
        warm_s, window_s = PROFILE_WINDOW_S[quick]
        per_s, latencies = await steady(clients, job, warm_s=warm_s, window_s=window_s, warm_jobs=clients)
        if not latencies:
            raise RuntimeError(f"no request of {clients} clients ended inside the {window_s:.0f} s window")
    else:
        await job(0)  # untimed: the connection and the server's first call
        latencies = []

        async def timed(n: int) -> int:
            started = time.perf_counter()
            units = await job(n)
            latencies.append((time.perf_counter() - started) * 1000)
            return units

        wall, done = await closed_loop(clients, requests, timed)
        per_s = sum(int(x) for x in done) / wall  # type: ignore[call-overload]
    return {
        "clients": clients,
        "requests": len(latencies),
        "per_s": per_s,
        "p50_ms": statistics.median(latencies),
        "p99_ms": pct(latencies, 99),
    }


async def profile_all(session: aiohttp.ClientSession, url: str, quick: bool) -> dict[str, dict[str, Profile]]:
    """Embeddings and generation (``NEW_TOKENS`` per completion, ``QUICK_TOKENS`` if ``quick``), each at
    every count in ``CLIENTS``: ``{workload: {str(clients): profile}}``."""
    tokens = QUICK_TOKENS if quick else NEW_TOKENS
    out: dict[str, dict[str, Profile]] = {}
    for workload in WORKLOADS:
        out[workload] = {}
        for clients in CLIENTS:
            requests = ONE_CLIENT_REQUESTS[workload][quick]
            job = job_for(session, url, workload, tokens)
            out[workload][str(clients)] = await profile(clients, job, requests, quick)
    return out


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256), timeout=aiohttp.ClientTimeout(total=600)
    )


async def until_ready(
    session: aiohttp.ClientSession, url: str, within: float = 180, alive: Callable[[], None] | None = None
) -> None:
    """Poll ``url`` until it answers 200 (``alive`` raises if the server died meanwhile)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if alive is not None:
            alive()
        try:
            async with session.get(url) as response:
                if response.status == 200:
                    return
        except (aiohttp.ClientError, TimeoutError):  # a server too busy to answer one poll in time
            pass
        await asyncio.sleep(0.25)
    raise RuntimeError(f"{url} did not answer 200 within {within:.0f} s")


async def _client_process(args: argparse.Namespace) -> dict[str, float]:
    async with client_session() as session:
        job = job_for(session, args.url, args.workload, args.tokens, args.first)
        await asyncio.sleep(max(0.0, args.start_at - time.time()))
        per_s = await steady_rate(args.clients, job, warm_s=args.warm_s, window_s=args.window_s)
    return {"per_s": per_s}


def main() -> None:
    parser = argparse.ArgumentParser(
        description="One client process of spread_rate: --clients closed-loop clients of --workload "
        "against --url from the wall-clock instant --start-at; prints {per_s} as JSON."
    )
    parser.add_argument("--url", required=True)
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS)
    parser.add_argument("--warm-s", type=float, required=True)
    parser.add_argument("--window-s", type=float, required=True)
    parser.add_argument("--start-at", type=float, default=0.0, help="a time.time() to start at")
    parser.add_argument("--first", type=int, default=0, help="the first request's number")
    print(json.dumps(asyncio.run(_client_process(parser.parse_args()))))


if __name__ == "__main__":
    main()
