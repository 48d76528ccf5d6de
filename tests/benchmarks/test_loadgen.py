"""The load generator's pure parts: the steady-state window the saturation phases are measured in, and the
embedding inputs the raw baseline shares with the load."""

from __future__ import annotations

import asyncio
import heapq
import itertools
import sys
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts, not a package

import loadgen  # type: ignore[import-not-found]
from loadgen import EMBED_TEXTS, embed_text, profile, steady, steady_rate

T = TypeVar("T")


class VirtualClock:
    """loadgen's ``time.perf_counter`` for the window tests: it moves only when every job waits on it, to the
    next wake-up. A job's :meth:`sleep` takes exactly its length, and a stall of the box takes no time at
    all: on the wall clock, CI (a loaded 2-core box) once held the loop past a ramp-up, and any stall longer
    than a 0.3-2 s window decided a bound on the rate or the latencies."""

    def __init__(self) -> None:
        self.now = 0.0
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    def perf_counter(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), woken))
        await woken

    async def run(self, work: Awaitable[T], *, stop_by: float = 60.0) -> T:
        """``work``'s result. Once every task has run to its next :meth:`sleep` (nothing here waits on
        anything else), the clock moves to the earliest wake-up and wakes whoever sleeps until then; past
        ``stop_by`` (virtual) seconds it is an error: the clients did not stop."""
        task = asyncio.ensure_future(work)
        while True:
            for _ in range(10):  # a woken job runs to its next sleep in one step; a gather ends in three
                await asyncio.sleep(0)
            if task.done():
                return task.result()
            assert self._sleepers, "nothing sleeps and nothing ends"
            self.now = self._sleepers[0][0]
            assert self.now <= stop_by, f"still running {self.now:.1f} s in: the clients did not stop"
            while self._sleepers and self._sleepers[0][0] == self.now:
                heapq.heappop(self._sleepers)[2].set_result(None)


class _Time:
    """The ``time`` module as loadgen sees it: the virtual clock's ``perf_counter``, the rest real."""

    def __init__(self, clock: VirtualClock) -> None:
        self.perf_counter = clock.perf_counter

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    made = VirtualClock()
    monkeypatch.setattr(loadgen, "time", _Time(made))
    return made


async def test_steady_rate_counts_only_what_completes_inside_the_window(clock: VirtualClock) -> None:
    """A job that ends in the ramp-up never counts, nor one that ends past the window, and the clients stop
    at the window's end. Which jobs those are is told by the clock, not by their numbers (on a loaded box,
    CI once, the event loop ran the first jobs' ends past the ramp-up, and the window rightly counted them);
    on the virtual clock a stall of the box moves nothing."""
    calls: list[int] = []

    async def job(n: int) -> int:
        calls.append(n)
        await clock.sleep(0.01)
        return 1_000_000 if clock.now < 0.1 else 1  # what ends in the ramp-up

    rate = await clock.run(steady_rate(2, job, warm_s=0.1, window_s=0.4))
    assert rate < 1_000  # none of the ramp-up's units
    # two clients, one unit per 10 ms each, for 0.4 s: 80 jobs, give or take the one at each edge
    assert 195 <= rate <= 205, rate
    assert len(set(calls)) == len(calls)  # every job has its own number
    # the window opened at the first end from 0.1 s and closed 0.4 s later; each client ends the job it has
    # in flight then, and starts no other
    assert clock.now <= 0.1 + 0.01 + 0.4 + 0.01 + 1e-9, clock.now


async def test_the_window_opens_after_every_client_has_had_an_answer(clock: VirtualClock) -> None:
    """``warm_jobs``: a batching server's first wave (every client's first request, all at once) ends after
    ``warm_s``; the window must not open before it, nor count it."""

    async def job(n: int) -> int:
        await clock.sleep(0.3 if n < 4 else 0.01)  # the first wave is slow
        return 1_000_000 if n < 4 else 1

    rate, latencies = await clock.run(steady(4, job, warm_s=0.05, window_s=0.3, warm_jobs=4))
    assert rate < 1_000, rate  # no unit of the first wave
    assert latencies
    assert max(latencies) == pytest.approx(10)  # the first wave's took 300 ms: none of them is here
    assert len(latencies) == round(rate * 0.3)  # one latency for each job counted
    assert 4 * 29 <= len(latencies) <= 4 * 30  # the window opened at the wave's end, at 0.3 s, not at 0.05 s


async def test_a_profile_at_many_clients_is_the_steady_window_and_at_one_a_count(clock: VirtualClock) -> None:
    """Many clients: the rate and latencies of the steady window only, not the ramp-up. One client: exactly
    the requests asked for."""
    calls = 0

    async def job(n: int) -> int:
        nonlocal calls
        calls += 1
        await clock.sleep(0.002)
        return 3

    one = await clock.run(profile(1, job, 10, True))
    assert one["requests"] == 10
    assert one["clients"] == 1
    assert calls == 10 + 1  # the untimed warm-up, then the ten
    assert one["p50_ms"] == pytest.approx(2)

    many = await clock.run(profile(8, job, 10, True))  # the quick window: 0.5 s of warm-up, 2 s counted
    # 8 clients x 2 s / 2 ms (and the 7 that end with the one that opens the window): far more than the 10
    # asked of one client, and no more than the window holds
    assert 8 * 999 <= many["requests"] <= 8 * 1000 + 7, many["requests"]
    assert abs(many["per_s"] - 3 * many["requests"] / 2.0) < 1e-6  # units of the counted requests only
    assert many["p50_ms"] == pytest.approx(2)


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
    # 2 clients an edge, one answer per ~5 ms each: under 800/s summed. No lower bound but some: the windows
    # are 0.5 s of three processes' wall clock, and a stall of the loaded box (CI) decides how much of them
    # is served. Each process counts only answers the stand-ins gave: the sum is no more than all of them.
    assert 0 < rate < 800, rate
    assert rate <= sum(hits.values()) / 0.5, (rate, hits)


def test_edges_auto_is_one_per_four_spare_cores_at_least_one() -> None:
    from online import edge_count  # type: ignore[import-not-found]

    assert [edge_count("auto", cores) for cores in (1, 3, 4, 8, 12)] == [1, 1, 1, 2, 3]
    assert edge_count("3", 1) == 3
    for bad in ("0", "17", "many"):
        with pytest.raises(SystemExit, match="--edges"):
            edge_count(bad, 8)
