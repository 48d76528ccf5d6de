"""The peer comparison's ratios (pure arithmetic over profiles; the benchmark runs are tested elsewhere)."""

from __future__ import annotations

import importlib
import sys

import pytest

from tests.benchmarks.runner import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmarks import each other as scripts do
comparison = importlib.import_module("comparison")


def profiles(p50: dict[str, float], per_s: float) -> dict[str, dict[str, dict[str, float]]]:
    """One server's profile: the given p50 at 1 client per workload, ``per_s`` everywhere, p99 = 2 x p50."""
    return {
        workload: {
            clients: {
                "clients": float(clients),
                "requests": 1.0,
                "per_s": per_s,
                "p50_ms": ms,
                "p99_ms": 2 * ms,
            }
            for clients in ("1", "64")
        }
        for workload, ms in p50.items()
    }


def test_added_latency_is_measured_from_the_model_on_the_servers_threads_and_throughput_from_raw() -> None:
    raw = profiles({"embeddings": 4.6, "generation": 68.0}, per_s=1000.0)  # the model alone on every core
    floor = profiles({"embeddings": 8.8, "generation": 72.0}, per_s=600.0)  # on the threads servers get
    platform = profiles({"embeddings": 15.0, "generation": 79.0}, per_s=450.0)
    ray = profiles({"embeddings": 23.9, "generation": 100.0}, per_s=200.0)
    everyone = {"raw": raw, "platform": platform, "ray": ray, "naive": "not run"}

    row = comparison.ratios(everyone, floor)["embeddings"]["1"]
    assert row["ray_added_p50"] == pytest.approx((15.0 - 8.8) / (23.9 - 8.8))
    assert row["raw_per_s"] == pytest.approx(450 / 1000), "throughput against the raw model at its best"
    assert row["ray_per_s"] == pytest.approx(450 / 200)
    assert row["naive_added_p50"] is None
    assert comparison.ratios(everyone, floor)["generation"]["1"]["ray_added_p50"] == pytest.approx(7 / 28)

    without = comparison.ratios(everyone)["embeddings"]["1"]  # no floor run: from the raw model's
    assert without["ray_added_p50"] == pytest.approx((15.0 - 4.6) / (23.9 - 4.6))
    assert comparison.p6(row, "1") == "missed (≤ 0.25)"
    assert comparison.p6(comparison.ratios(everyone, floor)["generation"]["1"], "1") == "met (≤ 0.25)"


def test_the_platforms_own_overhead_is_measured_from_the_model_as_it_runs_it() -> None:
    raw = profiles({"embeddings": 4.6, "generation": 68.0}, per_s=1000.0)
    floor = profiles({"embeddings": 8.8, "generation": 72.0}, per_s=600.0)
    platform = profiles({"embeddings": 11.0, "generation": 79.0}, per_s=450.0)
    ray = profiles({"embeddings": 23.9, "generation": 100.0}, per_s=200.0)
    everyone = {"raw": raw, "platform": platform, "ray": ray, "naive": "not run"}
    # one client's embeddings on the quiet team (both cores): the platform's from the two-thread call,
    # Ray's from the one-thread call it makes
    own = {**floor, "embeddings": {**floor["embeddings"], "1": raw["embeddings"]["1"]}}
    quiet = comparison.ratios(everyone, floor, own)
    assert quiet["embeddings"]["1"]["ray_added_p50"] == pytest.approx((11.0 - 4.6) / (23.9 - 8.8))
    assert quiet["generation"]["1"] == comparison.ratios(everyone, floor)["generation"]["1"]
    plain = comparison.ratios(everyone, floor)["embeddings"]["1"]["ray_added_p50"]
    assert plain == pytest.approx((11.0 - 8.8) / (23.9 - 8.8)), "without it the spare core counts as a gain"
