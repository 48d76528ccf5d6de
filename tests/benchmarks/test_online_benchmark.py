"""The online benchmark (platform vs the raw model and its peers) still runs end to end: on the session's
broker (as on a user's cluster), a worker per model and an edge as processes, on free ports, then the naive peer. Its ratios are printed, never
asserted (a benchmark is not a timed test); this only keeps it from rotting. Ray is an optional extra that
CI does not install: the run is pointed at a Python that has none, so its columns say so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from bus.placement import available_cpus, format_cpus, split_box
from schemas.settings import KafkaConnection
from tests.benchmarks.runner import run_benchmark

pytestmark = pytest.mark.integration


@pytest.mark.timeout(600)  # the run's own limit: raw model, platform and naive peer, each loading models
def test_the_online_benchmark_runs_quick_and_writes_its_json(tmp_path: Path, kafka: KafkaConnection) -> None:
    out = tmp_path / "online.json"
    stdout, result = run_benchmark(
        "online.py", out, "--quick", "--ray-python", "/nonexistent/python", timeout=600, kafka=kafka
    )
    assert result["machine"]["quick"] is True
    assert result["machine"]["cpu"]  # which box's numbers these are, in the JSON and under the table
    assert f"({result['machine']['cpu']})" in stdout
    assert result["generation"]["platform_tokens_per_s"] > 0
    assert result["embeddings"]["dynamic_per_s"] > 0
    assert result["edges"] >= 1  # --edges auto: the saturation phases' edges, one client process each
    floor = result["floor"]  # the raw model again, on the threads a worker gets
    assert floor["threads"] == result["machine"]["worker_torch_threads"] >= 1
    # the raw model alone gets every core (the models' loader sizes torch for a worker: half of them)
    assert result["machine"]["raw_torch_threads"] == len(os.sched_getaffinity(0))
    assert floor["generation_tokens_per_s"] > 0
    assert floor["embeddings_per_s"] > 0
    # run before and after the platform; the ratios are to the mean of the two
    for key in ("generation_tokens_per_s", "embeddings_per_s"):
        runs = [floor["before"][key], floor["after"][key]]
        assert min(runs) > 0
        assert floor[key] == pytest.approx(sum(runs) / 2)
    # what batching alone buys the model on those threads, printed beside P3
    assert floor["embeddings_batching"] == pytest.approx(
        floor["embeddings_per_s"]
        / ((floor["before"]["embeddings_batch1_per_s"] + floor["after"]["embeddings_batch1_per_s"]) / 2)
    )
    assert "best/b1 " in stdout
    # the ratios are to the floor sampled just before and just after each saturation phase, the platform
    # idle: two generation rates (``generate`` and the engine alone; the faster counts) and two embeddings'
    near = floor["beside"]
    assert floor["judged_against"] == "beside"
    assert len(near["generation"]) == len(near["embeddings"]) == 2, near
    # the platform stopped for each sample, a few seconds at most (a quick run's one round)
    assert len(near["paused_s"]) == 4, near
    assert all(0 < s < 10 for s in near["paused_s"]), near
    assert all(min(run.values()) > 0 for run in near["generation"]), near
    assert min(near["embeddings"]) > 0, near
    # continuous batching's floor, sampled with each generation sample and judged against in the table
    assert len(near["generation_churn"]) == 2, near
    assert min(near["generation_churn"]) > 0, near
    assert floor["generation_churn_ratio"] > 0
    assert "the engine alone under the load's churn beside it" in stdout
    assert near["generation_tokens_per_s"] == pytest.approx(
        sum(max(run.values()) for run in near["generation"]) / 2
    )
    assert floor["generation_ratio"] == pytest.approx(
        result["generation"]["platform_tokens_per_s"] / near["generation_tokens_per_s"]
    )
    assert floor["embeddings_ratio"] == pytest.approx(
        result["embeddings"]["dynamic_per_s"] / near["embeddings_per_s"]
    )
    # and to the runs minutes apart, kept beside them
    assert floor["generation_ratio_apart"] == pytest.approx(
        result["generation"]["platform_tokens_per_s"] / floor["generation_tokens_per_s"]
    )
    assert "(before " in stdout
    assert "(just before " in stdout
    assert result["generation"]["platform_concurrency"] == 2 * result["generation"]["raw_best_batch"]
    # placed as `sluice up` places it: on 2+ cores the workers get the upper half (bus/placement.py)
    split = split_box(available_cpus())
    workers = "off" if split is None else f"cores: workers {format_cpus(split[0])};"
    assert result["machine"]["placement"].startswith(workers), result["machine"]["placement"]
    # one client on a placed box: the embedding worker takes the idle cores too (its quiet team)
    assert (result["embedding_quiet_batches"] > 0) == (split is not None), result["embedding_quiet_batches"]
    assert "raw on the worker's" in stdout
    assert "generation tok/s at saturation" in stdout
    assert "embeddings/s" in stdout
    # one client's embedding time, stage by stage, from the terminal events read back off the results topic
    where = result["embedding_one_client_ms"]
    assert where["requests"] == 30, where  # every request of the quick phase found its terminal event
    stages = [where[s] for s in ("edge in", "to the worker", "model", "back")]
    assert all(ms > 0 for ms in stages), where
    assert where["total"] >= where["model"] > 0, where
    # the way back split by the answers' Server-Timing: the terminal event's way to the edge, and the rest
    assert 0 < where["back: return"] < where["back"], where
    assert where["back: respond"] > 0, where
    assert where["raw batch 1"] > 0, where
    assert where["raw batch 1 after idle"] > 0, where
    assert where["raw batch 1 after idle, worker's threads"] > 0, where
    assert where["raw batch 1, eager"] > 0, "the engine is traced on a CPU: the eager forward beside it"
    # the raw forward sampled alone between the blocks of one client's requests
    assert where["raw batch 1 beside"] > 0, where
    assert where["raw batch 1 beside, worker's threads"] > 0, where
    assert "beside the blocks: raw batch 1" in stdout
    assert where["raw idle ms"] == 5, where
    assert "where the time goes" in stdout
    # and one client's time to first token, stage by stage, the same way (the model: prefill to first token)
    first = result["ttft_one_client_ms"]
    assert first["requests"] == 30, first  # every TTFT request of the quick phase found its terminal event
    assert all(first[s] > 0 for s in ("edge in", "to the worker", "model", "back")), first
    assert first["total"] == pytest.approx(result["ttft_ms"]["platform_p50"], rel=0.5), first
    assert first["raw"] == result["ttft_ms"]["raw_p50"]
    assert first["raw after idle"] == result["ttft_ms"]["floor_model_after_idle_ms"] > 0
    # the floor under the added TTFT, measured in the same run: the forward after idle, the two hops alone
    ttft = result["ttft_ms"]
    assert ttft["floor_two_hops_after_idle_ms"] > 0
    assert ttft["floor_idle_ms"] == 5
    assert ttft["floor_added_p50"] >= ttft["floor_two_hops_after_idle_ms"]
    ttft_floor_ms = ttft["floor_added_p50"]
    assert ttft["target_added_p50"] == pytest.approx(5.0 if ttft_floor_ms <= 5 else 1.2 * ttft_floor_ms)
    assert "floor: raw after 5 ms idle" in stdout
    assert "time to first token at low load, where the time goes" in stdout
    profiles = result["peers"]["profiles"]
    assert profiles["ray"] == "not installed"
    for peer in ("raw", "naive", "platform"):
        assert profiles[peer]["embeddings"]["64"]["per_s"] > 0, (peer, profiles[peer])
        assert profiles[peer]["generation"]["1"]["per_s"] > 0, (peer, profiles[peer])
    assert result["peers"]["ratios"]["generation"]["64"]["naive_per_s"] > 0
    assert "platform/naive" in stdout
    # two bare Kafka hops around MiniLM's forward, and with the naive peer the floor under what one client's
    # embedding can add (no Ray here: nothing to judge it against)
    assert 0 < where["bare hop_in"] < where["bare round_trip"], where
    assert 0 < where["bare hop_back"] < where["bare round_trip"], where
    assert 0 < where["bare forward"] < where["bare round_trip"], where
    assert where["bare hops"] > 0, where
    one = result["peers"]["ratios"]["embeddings"]["1"]
    assert one["floor_added_ms"] > 0, one
    assert one["added_ms_apart"] >= 0, "the platform's added latency is taken beside the raw forward"
    # the naive server's part of that floor from its requests sampled beside the platform's blocks too
    assert where["naive beside"] > 0, where
    assert one["naive_added_ms_beside"] == pytest.approx(
        where["naive beside"] - where["raw batch 1 beside, worker's threads"]
    )
    assert "the naive server beside them" in stdout
    assert "ray_floor" not in one, one
    # one client's completions in blocks, beside the raw generate sampled between them
    completions = result["generation_one_client_ms"]
    assert (completions["requests"], completions["samples"]) == (6, 4), completions
    assert completions["platform"] > 0, completions
    assert completions["raw beside"] > 0, completions
    gen_one = result["peers"]["ratios"]["generation"]["1"]
    assert gen_one["added_ms"] == pytest.approx(max(0.0, completions["platform"] - completions["raw beside"]))
    assert gen_one["added_ms_apart"] >= 0, gen_one
    assert "generation at 1 client beside the raw model" in stdout
    assert "the two hops around that forward" in stdout
