"""The streams benchmark (catch-up and freshness of one ``sluice streams``) still runs end to end and writes
its JSON; its numbers are printed, never asserted (a benchmark is not a timed test)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.runner import run_benchmark

pytestmark = pytest.mark.integration


@pytest.mark.timeout(420)
def test_the_streams_benchmark_runs_small_and_writes_its_json(tmp_path: Path) -> None:
    out = tmp_path / "streams.json"
    stdout, result = run_benchmark(
        "streams.py",
        out,
        "--events",
        "20000",  # fewer are written before a second scrape shows progress
        "--rate",
        "500",
        "--seconds",
        "3",
        "--markers",
        "3",
        "--producer-nice",
        "5",
        "--producer-linger-ms",
        "2",
        timeout=400,
    )
    run = result["runs"]["run 1"]
    assert run["catch_up"]["complete"] is True
    # each RequestFinished and its audit entry, and the price table the worker publishes at start with its
    # own entry (both on the control topic, which the worker reads too)
    assert run["catch_up"]["warehouse_events"] == 40_000 + 2
    assert run["at_rate"]["all_written"] is True
    assert run["at_rate"]["probes_missing"] == 0
    assert "catch-up: warehouse events/s" in stdout
    assert (result["settings"]["producer_nice"], result["settings"]["producer_linger_ms"]) == (5, 2.0)
