"""The load generator's pure parts: the steady-state window the saturation phases are measured in, and the
embedding inputs the raw baseline shares with the load."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # scripts, not a package

from loadgen import EMBED_TEXTS, embed_text, steady_rate  # type: ignore[import-not-found]


async def test_steady_rate_counts_only_what_completes_inside_the_window() -> None:
    calls: list[int] = []

    async def job(n: int) -> int:
        calls.append(n)
        await asyncio.sleep(0.01)
        return 1_000_000 if n < 4 else 1  # the first jobs end during the ramp-up: never counted

    started = time.perf_counter()
    rate = await steady_rate(2, job, warm_s=0.1, window_s=0.4)
    elapsed = time.perf_counter() - started
    assert rate < 1_000  # none of the ramp-up's units
    # two clients, one unit per ~10 ms each: about 200/s (sleep overshoots, never undershoots)
    assert 60 <= rate <= 210, rate
    assert len(set(calls)) == len(calls)  # every job has its own number
    assert elapsed < 0.5 + 0.2  # clients stop at the window's end, each after its job in flight


def test_embedding_inputs_cycle_through_a_fixed_set() -> None:
    assert embed_text(3) == embed_text(3 + EMBED_TEXTS) == embed_text(3 + 5 * EMBED_TEXTS)
    assert len({embed_text(n) for n in range(3 * EMBED_TEXTS)}) == EMBED_TEXTS


def test_a_server_timing_header_reads_as_durations_by_name() -> None:
    from stages import server_timing  # type: ignore[import-not-found]

    header = 'edge;dur=0.74, queue;dur=0.98, cache;desc="hit", model;desc="x";dur=5.95, total;dur=9.5'
    assert server_timing(header) == {"edge": 0.74, "queue": 0.98, "model": 5.95, "total": 9.5}
    assert server_timing("") == {}
