"""The load generator's pure parts: the steady-state window the saturation phases are measured in, and the
embedding inputs the raw baseline shares with the load."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts, not a package

from loadgen import EMBED_TEXTS, embed_text, profile, steady, steady_rate  # type: ignore[import-not-found]


async def test_steady_rate_counts_only_what_completes_inside_the_window() -> None:
    """A job that ends in the ramp-up never counts. Which jobs those are is told by the clock, not by their
    numbers: on a loaded box (CI, once) the event loop ran the first jobs' ends past the ramp-up, and the
    window rightly counted them."""
    calls: list[int] = []
    started = time.perf_counter()  # before steady_rate's own start: what ends before 0.1 s here did there

    async def job(n: int) -> int:
        calls.append(n)
        await asyncio.sleep(0.01)
        return 1_000_000 if time.perf_counter() - started < 0.1 else 1

    rate = await steady_rate(2, job, warm_s=0.1, window_s=0.4)
    elapsed = time.perf_counter() - started
    assert rate < 1_000  # none of the ramp-up's units
    # two clients, one unit per ~10 ms each: about 200/s at most (sleep overshoots, never undershoots)
    assert 0 < rate <= 210, rate
    assert len(set(calls)) == len(calls)  # every job has its own number
    assert elapsed < 0.5 + 2.0  # clients stop at the window's end, each after its job in flight


async def test_the_window_opens_after_every_client_has_had_an_answer() -> None:
    """``warm_jobs``: a batching server's first wave (every client's first request, all at once) ends after
    ``warm_s``; the window must not open before it, nor count it."""
    done = 0

    async def job(n: int) -> int:
        nonlocal done
        await asyncio.sleep(0.3 if n < 4 else 0.01)  # the first wave is slow
        done += 1
        return 1_000_000 if n < 4 else 1

    rate, latencies = await steady(4, job, warm_s=0.05, window_s=0.3, warm_jobs=4)
    assert rate < 1_000, rate  # no unit of the first wave
    assert latencies
    assert max(latencies) < 300  # the first wave's took 300 ms at least: none of them is here
    assert len(latencies) == round(rate * 0.3)  # one latency for each job counted


async def test_a_profile_at_many_clients_is_the_steady_window_and_at_one_a_count() -> None:
    """Many clients: the rate and latencies of the steady window only, not the ramp-up. One client: exactly
    the requests asked for."""
    calls = 0

    async def job(n: int) -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.002)
        return 3

    one = await profile(1, job, 10, True)
    assert one["requests"] == 10
    assert one["clients"] == 1
    assert calls == 10 + 1  # the untimed warm-up, then the ten
    assert 2 <= one["p50_ms"] < 50

    many = await profile(8, job, 10, True)  # the quick window: 0.5 s of warm-up, 2 s counted
    assert many["requests"] > 100  # ~8 clients x ~2 s / ~2-3 ms, far more than the 10 asked of one client
    assert abs(many["per_s"] - 3 * many["requests"] / 2.0) < 1e-6  # units of the counted requests only


def test_embedding_inputs_cycle_through_a_fixed_set() -> None:
    assert embed_text(3) == embed_text(3 + EMBED_TEXTS) == embed_text(3 + 5 * EMBED_TEXTS)
    assert len({embed_text(n) for n in range(3 * EMBED_TEXTS)}) == EMBED_TEXTS


def test_a_server_timing_header_reads_as_durations_by_name() -> None:
    from stages import server_timing  # type: ignore[import-not-found]

    header = 'edge;dur=0.74, queue;dur=0.98, cache;desc="hit", model;desc="x";dur=5.95, total;dur=9.5'
    assert server_timing(header) == {"edge": 0.74, "queue": 0.98, "model": 5.95, "total": 9.5}
    assert server_timing("") == {}


async def test_spread_rate_shares_the_clients_between_edges_one_process_each() -> None:
    """Two stand-in edges on two ports: each gets its share of the clients, from a client process of its
    own (this module as a script), and the rates come back summed."""
    from aiohttp import web
    from loadgen import spread_rate

    hits: dict[int, int] = {}

    async def embeddings(request: web.Request) -> web.Response:
        port = request.url.port or 0
        hits[port] = hits.get(port, 0) + 1
        await asyncio.sleep(0.005)
        return web.json_response({"data": [{"embedding": [0.0]}]})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    runner = web.AppRunner(app)
    await runner.setup()
    sites = [web.TCPSite(runner, "127.0.0.1", 0) for _ in range(2)]
    for site in sites:
        await site.start()
    ports = [site._server.sockets[0].getsockname()[1] for site in sites]  # type: ignore[union-attr]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        rate = await spread_rate(urls, 4, "embeddings", warm_s=0.2, window_s=0.5, tokens=0)
    finally:
        await runner.cleanup()
    assert set(hits) == set(ports)  # both edges got load
    # 2 clients an edge, one answer per ~5 ms each: well over 100/s summed, under 800/s
    assert 100 < rate < 800, rate


def test_edges_auto_is_one_per_four_spare_cores_at_least_one() -> None:
    from online import edge_count  # type: ignore[import-not-found]

    assert [edge_count("auto", cores) for cores in (1, 3, 4, 8, 12)] == [1, 1, 1, 2, 3]
    assert edge_count("3", 1) == 3
    for bad in ("0", "17", "many"):
        with pytest.raises(SystemExit, match="--edges"):
            edge_count(bad, 8)
