"""``sluice capacity``: workers for a traffic profile from the online benchmark's measured throughput."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluice.capacity import DEFAULT_BENCH, CapacityError, Measured, Profile, load_measured, plan
from sluice.cli import app

GEN = Measured(
    "generation", per_worker=1000.0, single_stream=100.0, alone_p99_ms=20.0, quick=False, source="t"
)
EMB = Measured("embeddings", per_worker=400.0, single_stream=50.0, alone_p99_ms=30.0, quick=False, source="t")


def test_generation_counts_output_and_prompt_tokens_against_one_worker() -> None:
    # 10 rps x (50 out + 100 prompt x 0.5) = 1000 tokens/s: one worker's worth, at 70% busy at most -> 2
    result = plan(GEN, Profile(rps=10, prompt_tokens=100, output_tokens=50, prompt_token_cost=0.5))
    assert result.demand == pytest.approx(1000)
    assert result.load == pytest.approx(1.0)
    assert result.needed == 2
    assert result.workers == 2
    assert result.utilisation == pytest.approx(0.5)
    assert result.request_ms == pytest.approx(20 + 1000 * 50 / 100)
    assert result.slo_met_alone


def test_headroom_and_an_exact_fit() -> None:
    exact = plan(GEN, Profile(rps=7, output_tokens=100, headroom=0.3))  # 0.7 load at a 0.7 ceiling
    assert exact.needed == 1
    assert plan(GEN, Profile(rps=7.1, output_tokens=100, headroom=0.3)).needed == 2
    assert plan(GEN, Profile(rps=10, output_tokens=100, headroom=0.0)).needed == 1
    assert plan(GEN, Profile(rps=0.001, output_tokens=1)).needed == 1  # never zero


@pytest.mark.parametrize(("zones", "workers", "per_zone"), [(1, 4, 4), (2, 8, 4), (3, 6, 2), (4, 8, 2)])
def test_zones_hold_the_load_with_one_lost(zones: int, workers: int, per_zone: int) -> None:
    # load 2.8 at a 0.7 ceiling: 4 workers needed wherever they run
    result = plan(GEN, Profile(rps=28, output_tokens=100, headroom=0.3, zones=zones))
    assert result.needed == 4
    assert (result.workers, result.per_zone) == (workers, per_zone)
    survivors = workers - per_zone if zones > 1 else workers
    assert result.load / survivors <= 0.7 + 1e-9
    assert result.utilisation_zone_lost == pytest.approx(result.load / survivors)


def test_embeddings_count_inputs() -> None:
    result = plan(EMB, Profile(rps=100, inputs_per_request=8, slo_ms=25))
    assert result.demand == 800
    assert result.needed == 3  # 2.0 workers' worth at a 0.7 ceiling
    assert not result.slo_met_alone  # 30 ms alone is over a 25 ms SLO whatever the count


def test_embeddings_judge_the_whole_requests_latency_against_the_slo() -> None:
    """A review found the verdict on one input's p99 whatever --inputs-per-request: 32 inputs expected at
    ~500 ms were "within the 50 ms SLO", exit 0."""
    one = plan(EMB, Profile(rps=10, inputs_per_request=1, slo_ms=50))
    assert one.judged_ms == pytest.approx(30.0)  # one input: its measured p99
    assert one.slo_met_alone
    many = plan(EMB, Profile(rps=10, inputs_per_request=32, slo_ms=50))
    assert many.judged_ms == pytest.approx(30 + 1000 * 31 / 50)  # the other 31 at 50 inputs/s
    assert not many.slo_met_alone
    assert plan(EMB, Profile(rps=10, inputs_per_request=2, slo_ms=50)).slo_met_alone  # 30 + 20 ms


def test_the_embeddings_command_prints_the_figure_it_judged_and_exits_1_when_over(tmp_path: Path) -> None:
    args = ["capacity", "--task", "embeddings", "--bench", str(_bench(tmp_path)), "--slo-ms", "50"]
    over = CliRunner().invoke(app, [*args, "--inputs-per-request", "32"], env={"COLUMNS": "300"})
    assert over.exit_code == 1, over.output
    assert over.output.splitlines()[-1] == (
        "request p99 alone with 32 inputs is expected at 322.0 ms (12.0 ms measured for one, the rest at 100 "
        "inputs/s), over the 50 ms SLO: no number of workers meets it; fewer inputs per request or a faster "
        "worker (device, model) is needed"
    )
    within = CliRunner().invoke(app, [*args, "--inputs-per-request", "2"], env={"COLUMNS": "300"})
    assert within.exit_code == 0, within.output
    assert "with 2 inputs is expected at 22.0 ms" in within.output
    assert "within the 50 ms SLO" in within.output
    as_json = CliRunner().invoke(app, [*args, "--inputs-per-request", "32", "--json"])
    assert as_json.exit_code == 1
    assert json.loads(as_json.output)["plan"]["judged_ms"] == pytest.approx(322.0)


@pytest.mark.parametrize(
    ("profile", "message"),
    [
        (Profile(rps=0, output_tokens=1), "--rps"),
        (Profile(rps=1, output_tokens=1, headroom=1.0), "--headroom"),
        (Profile(rps=1, output_tokens=1, zones=0), "--zones"),
        (Profile(rps=1, output_tokens=0), "--output-tokens"),
        # an audit: these raised OverflowError, or planned against a NaN SLO
        (Profile(rps=1e308, output_tokens=1, prompt_tokens=200), "past any plan"),
        (Profile(rps=1, output_tokens=1, prompt_token_cost=float("inf")), "--prompt-token-cost"),
        (Profile(rps=1, output_tokens=1, slo_ms=float("nan")), "--slo-ms"),
        (Profile(rps=1, output_tokens=1, slo_ms=-5), "--slo-ms"),
    ],
)
def test_bad_profiles_are_clear_errors(profile: Profile, message: str) -> None:
    with pytest.raises(CapacityError, match=message):
        plan(GEN, profile)


def test_the_committed_benchmark_result_is_readable_for_both_tasks() -> None:
    for task in ("generation", "embeddings"):
        measured = load_measured(DEFAULT_BENCH, task)
        assert measured.per_worker > measured.single_stream > 0
        assert measured.alone_p99_ms > 0
        assert not measured.quick


def test_missing_or_foreign_results_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CapacityError, match=r"run `python benchmarks/online\.py`"):
        load_measured(tmp_path / "none.json", "generation")
    (tmp_path / "other.json").write_text('{"machine": {"quick": false}}')
    with pytest.raises(CapacityError, match="is not an online benchmark result"):
        load_measured(tmp_path / "other.json", "generation")


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -1.0])
def test_a_result_with_a_throughput_that_is_no_number_is_a_clear_error(value: float) -> None:
    measured = Measured(
        "generation", per_worker=value, single_stream=100.0, alone_p99_ms=20.0, quick=False, source="t"
    )
    with pytest.raises(CapacityError, match="measured no throughput"):
        plan(measured, Profile(rps=1, output_tokens=1))


def test_a_result_nested_too_deep_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CapacityError, match="is not an online benchmark result"):
        load_measured(tmp_path / "deep.json", "generation")


def test_the_task_is_case_insensitive(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["capacity", "--task", "Embeddings", "--bench", str(_bench(tmp_path))])
    assert result.exit_code == 0, result.output
    assert "capacity for embeddings" in result.output


def _bench(tmp_path: Path, *, quick: bool = False, ttft_p99: float = 10.0) -> Path:
    path = tmp_path / "online.json"
    profile = {"1": {"per_s": 100.0, "p99_ms": 12.0}, "64": {"per_s": 800.0, "p99_ms": 90.0}}
    path.write_text(
        json.dumps(
            {
                "machine": {"quick": quick},
                "generation": {"platform_tokens_per_s": 1000.0},
                "ttft_ms": {"platform_p99": ttft_p99},
                "peers": {"profiles": {"platform": {"generation": profile, "embeddings": profile}}},
            }
        )
    )
    return path


def test_the_command_prints_a_plan_and_json(tmp_path: Path) -> None:
    bench = _bench(tmp_path)
    args = [
        "capacity",
        "--bench",
        str(bench),
        "--rps",
        "14",
        "--output-tokens",
        "100",
        "--prompt-tokens",
        "0",
    ]
    shown = CliRunner().invoke(app, [*args, "--zones", "3"], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    assert "workers to run" in shown.output
    assert "3 (1 in each of 3 zones)" in shown.output  # 1.4 load / 0.7 -> 2 needed, 1 per zone x 3
    assert "within the 500 ms SLO" in shown.output
    as_json = CliRunner().invoke(app, [*args, "--json"])
    assert as_json.exit_code == 0, as_json.output
    result = json.loads(as_json.output)
    assert result["plan"]["needed"] == 2
    assert result["measured"]["per_worker"] == 1000.0


def test_an_slo_no_fleet_meets_exits_1_and_a_quick_result_is_flagged(tmp_path: Path) -> None:
    bench = _bench(tmp_path, quick=True, ttft_p99=40.0)
    result = CliRunner().invoke(
        app, ["capacity", "--bench", str(bench), "--slo-ms", "30"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 1
    assert "no number of workers meets it" in result.output
    assert "is a --quick run" in result.output
    bad = CliRunner().invoke(app, ["capacity", "--bench", str(tmp_path / "x.json")])
    assert bad.exit_code == 2
    assert "no benchmark result" in bad.output
    task = CliRunner().invoke(app, ["capacity", "--task", "vision"])
    assert task.exit_code == 2
