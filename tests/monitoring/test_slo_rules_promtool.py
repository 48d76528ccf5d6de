"""The generated rules, run by Prometheus' own rule engine (``promtool test rules``) on synthetic series.

Each test writes the rules and a promtool test file into ``tmp_path``: series that should page do, those
that should not don't. Series have one sample a minute, as a 1m scrape would give. Most tests strip the
annotations (promtool compares them verbatim and they carry ``$value``); one checks them rendered.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from monitoring.slo import (
    ROLLOUT_DECISIONS,
    AlertSettings,
    ConsumerLagAlert,
    LatencyObjective,
    SloConfig,
    Tier,
    render_rules,
    rule_groups,
)

REPO = Path(__file__).resolve().parents[2]
PROMETHEUS_EXAMPLE = REPO / "infra" / "prometheus" / "prometheus.yml"
ALERTMANAGER_EXAMPLE = REPO / "infra" / "prometheus" / "alertmanager.yml"

FAST, SLOW, TICKET_1D, TICKET_3D = (
    "SluiceErrorBudgetBurn1h",
    "SluiceErrorBudgetBurn6h",
    "SluiceErrorBudgetBurn1d",
    "SluiceErrorBudgetBurn3d",
)
LAG, DEAD, OOM = "SluiceConsumerLag", "SluiceDeadLetters", "SluiceWorkerOutOfMemory"
DRIFT, PIPELINE, STALE = "SluiceDriftDetected", "SluiceDriftFeaturePipeline", "SluiceDriftReportsStale"
ROLLBACK = "SluiceRolloutRolledBack"
ALL_ALERTS = (FAST, SLOW, TICKET_1D, TICKET_3D, LAG, DEAD, OOM, DRIFT, PIPELINE, STALE, ROLLBACK)

# interactive (99.5%, TTFT 0.5 s / 95%) is the default tier; batch (99%, TTFT 5 s / 90%) has two models
# (the dot in batch.v3 must be escaped in the rules' regex).
CONFIG = SloConfig(
    tiers=(
        Tier(
            name="interactive",
            availability=0.995,
            ttft=LatencyObjective(threshold_seconds=0.5, target=0.95),
            itl=LatencyObjective(threshold_seconds=0.1, target=0.95),
        ),
        Tier(
            name="batch",
            availability=0.99,
            ttft=LatencyObjective(threshold_seconds=5.0, target=0.9),
            models=("batch-model", "batch.v3"),
        ),
    ),
    default_tier="interactive",
    alerts=AlertSettings(consumer_lag=ConsumerLagAlert(max_records=1000, for_minutes=5)),
)


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(
            f"{name} is not installed: run `source scripts/system-deps.sh` (Debian packages prometheus and "
            "prometheus-alertmanager)"
        )
    return path


def run(*args: str | Path) -> str:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=60, check=False)
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{' '.join(map(str, args))} exited {done.returncode}:\n{output}"
    return output


# ---------------------------------------------------------------- series


def counter(*segments: tuple[int, float]) -> list[float]:
    """A counter sampled each minute from 0: ``(minutes, increase per minute)`` segments."""
    values, value = [0.0], 0.0
    for minutes, per_minute in segments:
        for _ in range(minutes):
            value += per_minute
            values.append(value)
    return values


def gauge(*segments: tuple[int, float]) -> list[float]:
    """A gauge sampled each minute: ``(minutes, value)`` segments."""
    return [value for minutes, value in segments for _ in range(minutes)]


STALE_MARKER = "stale"
"""A staleness marker: what Prometheus writes when a target's scrape fails or a series leaves it."""


def series(name: str, values: Sequence[float | str | None], **labels: str) -> dict[str, str]:
    """A promtool input series; ``None`` is a missing sample (the series does not exist then)."""
    label_text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    text = " ".join("_" if v is None else v if isinstance(v, str) else f"{v:.15g}" for v in values)
    return {"series": f"{name}{{{label_text}}}", "values": text}


def requests(model: str, minutes_ok: int, per_minute: float, *, error_share: float) -> list[dict[str, str]]:
    """Completed and failed request counters of ``model``: ``minutes_ok`` healthy minutes (no errors),
    then steady traffic with ``error_share`` of it failed until ``minutes_ok + 480``."""
    labels = {"tenant": "t1", "model": model, "version": "1"}
    bad = per_minute * error_share
    return [
        series(
            "sluice_requests_total",
            counter((minutes_ok, per_minute), (480, per_minute - bad)),
            outcome="completed",
            **labels,
        ),
        series("sluice_requests_total", counter((minutes_ok, 0), (480, bad)), outcome="failed", **labels),
        # cancelled requests are neither good nor bad: plenty of them must not change anything
        series(
            "sluice_requests_total", counter((minutes_ok + 480, per_minute)), outcome="cancelled", **labels
        ),
    ]


def ttft(model: str, minutes: int, per_minute: float, *, fast_share: float, le: str) -> list[dict[str, str]]:
    """TTFT histogram series of ``model``: ``fast_share`` of observations at or under the bucket ``le``."""
    labels = {"tenant": "t1", "model": model, "version": "1"}
    name = "sluice_time_to_first_token_seconds"
    return [
        series(f"{name}_bucket", counter((minutes, per_minute * fast_share)), le=le, **labels),
        series(f"{name}_bucket", counter((minutes, per_minute)), le="+Inf", **labels),
        series(f"{name}_count", counter((minutes, per_minute)), **labels),
    ]


def serving(model: str, *segments: tuple[int, float], version: str = "1") -> dict[str, str]:
    """Completed requests of a model version (what the drift alerts take for "still serves")."""
    labels = {"tenant": "t1", "model": model, "version": version, "outcome": "completed"}
    return series("sluice_requests_total", counter(*segments), **labels)


def last_report(minutes: int, *, window_s: int = 300, lag_s: int = 40) -> list[float | None]:
    """``sluice_drift_last_report_timestamp_seconds`` each minute while reports arrive: the end of the
    latest window reported, each report published ``lag_s`` after its window closed (none before the
    first)."""
    ends = [(m * 60 - lag_s) // window_s * window_s for m in range(minutes)]
    return [float(end) if end > 0 else None for end in ends]


# ---------------------------------------------------------------- promtool


def alert(name: str, at: str, *expected: dict[str, str]) -> dict[str, Any]:
    return {"eval_time": at, "alertname": name, "exp_alerts": [{"exp_labels": dict(e)} for e in expected]}


def promtool_test(
    tmp_path: Path,
    input_series: list[dict[str, str]],
    alert_tests: list[dict[str, Any]],
    *,
    config: SloConfig = CONFIG,
    expr_tests: Sequence[dict[str, Any]] = (),
    annotations: bool = False,
    drift_window_s: float | None = None,
) -> str:
    """Run ``promtool test rules`` on the rules of ``config`` (annotations stripped unless asked)."""
    doc = rule_groups(config, drift_window_s=drift_window_s)
    if not annotations:
        for group in doc["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    test = {
        "rule_files": ["rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": input_series,
                "alert_rule_test": alert_tests,
                "promql_expr_test": list(expr_tests),
            }
        ],
    }
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    return run(tool("promtool"), "test", "rules", tmp_path / "test.yml")


def no_alerts(*times: str) -> list[dict[str, Any]]:
    return [alert(name, at) for at in times for name in ALL_ALERTS]


# ---------------------------------------------------------------- tests


def test_generated_rules_pass_promtool_check(tmp_path: Path) -> None:
    for name, config in (("defaults", SloConfig()), ("custom", CONFIG)):
        path = tmp_path / f"{name}.yml"
        path.write_text(render_rules(config))
        output = run(tool("promtool"), "check", "rules", path)
        assert "SUCCESS" in output


def test_total_outage_pages_the_fast_burn_within_minutes(tmp_path: Path) -> None:
    # 7 h healthy (so the 6h window is full of good traffic), then every request fails from minute 420.
    page = {"severity": "page", "slo": "availability", "tier": "interactive", "model": "demo-gpt"}
    promtool_test(
        tmp_path,
        requests("demo-gpt", 420, 100, error_share=1.0),
        [
            *no_alerts("419m"),
            # 2 minutes in: the 5m window burns at 80x, but the 1h window only at ~7x; nothing yet
            alert(FAST, "422m"),
            alert(FAST, "428m", page),
            # the 6h/30m pair needs longer (6h burn 10/360 / 0.005 = 5.6 < 6 after 10 minutes) ...
            alert(SLOW, "430m"),
            # ... and fires as the second line of defence soon after
            alert(SLOW, "440m", page),
        ],
    )


def test_healthy_model_has_no_alerts_at_all(tmp_path: Path) -> None:
    # 0.1% errors (burn rate 0.2), 99% of first tokens under 0.5 s (burn 0.2), low lag, no dead letters.
    labels = {"tenant": "t1", "model": "demo-gpt", "version": "1"}
    itl = "sluice_inter_token_latency_seconds"
    inputs = [
        *requests("demo-gpt", 0, 1000, error_share=0.001),
        *ttft("demo-gpt", 480, 100, fast_share=0.99, le="0.5"),
        series(f"{itl}_bucket", counter((480, 990)), le="0.1", **labels),
        series(f"{itl}_count", counter((480, 1000)), **labels),
        series(
            "sluice_consumer_lag",
            gauge((481, 40)),
            group="g",
            topic="sluice.requests.demo-gpt",
            partition="0",
        ),
        series("sluice_dead_letters_total", gauge((481, 0)), topic="sluice.replies", reason="decode"),
        series("sluice_worker_out_of_memory_total", gauge((481, 0)), model="demo-gpt"),
        series("sluice_worker_batch_limit_ratio", gauge((481, 1)), model="demo-gpt"),
    ]
    ratio = "model:sluice_slo_errors:ratio_rate"
    promtool_test(
        tmp_path,
        inputs,
        no_alerts("5m", "30m", "1h", "3h", "7h", "8h"),
        expr_tests=[
            # the recorded ratios are there and right (compared in a range: they are rates of counters)
            {
                "expr": f'count({ratio}1h{{slo="availability",model="demo-gpt"}} > 0.0009 < 0.0011)',
                "eval_time": "2h",
                "exp_samples": [{"labels": "{}", "value": 1}],
            },
            {
                "expr": f'count({ratio}6h{{slo="ttft",tier="interactive"}} > 0.009 < 0.011)',
                "eval_time": "7h",
                "exp_samples": [{"labels": "{}", "value": 1}],
            },
            {
                "expr": f'count({ratio}5m{{slo="itl",tier="interactive"}} > 0.009 < 0.011)',
                "eval_time": "1h",
                "exp_samples": [{"labels": "{}", "value": 1}],
            },
        ],
    )


def test_slow_steady_burn_pages_slow_not_fast_and_tiers_set_the_budget(tmp_path: Path) -> None:
    # 4% errors: 8x the interactive budget (0.5%) but 4x the batch one (1%).
    inputs = [
        *requests("demo-gpt", 0, 1000, error_share=0.04),  # listed nowhere: default tier
        *requests("other-model", 0, 1000, error_share=0.04),  # idem
        *requests("batch-model", 0, 1000, error_share=0.04),  # batch tier
    ]
    slow = [
        {"severity": "page", "slo": "availability", "tier": "interactive", "model": m}
        for m in ("demo-gpt", "other-model")
    ]
    tickets = [
        {"severity": "ticket", "slo": "availability", "tier": tier, "model": m}
        for tier, m in (("interactive", "demo-gpt"), ("interactive", "other-model"), ("batch", "batch-model"))
    ]
    promtool_test(
        tmp_path,
        inputs,
        [
            # 8x is under the fast pair's 14.4x at any time: no fast page, ever
            *(alert(FAST, at) for at in ("10m", "1h", "4h", "7h", "8h")),
            # above the slow pair's 6x: pages for both interactive models, not for batch-model (4x)
            *(alert(SLOW, at, *slow) for at in ("1h", "7h", "8h")),
            # 4x and 8x are both above the 1d/2h ticket's 3x and the 3d/6h ticket's 1x
            alert(TICKET_1D, "7h", *tickets),
            alert(TICKET_3D, "7h", *tickets),
        ],
    )


def test_latency_breach_pages_with_the_tier_threshold(tmp_path: Path) -> None:
    labels = {"tenant": "t1", "model": "demo-gpt", "version": "1"}
    inputs = [
        *requests("demo-gpt", 0, 100, error_share=0.0),
        # 90% of first tokens slower than 0.5 s: burn 0.9 / 0.05 = 18x > 14.4x
        *ttft("demo-gpt", 30, 100, fast_share=0.1, le="0.5"),
        # every first token of batch-model slower than its 5 s (prometheus_client writes le="5.0"):
        # burn 1 / 0.1 = 10x, under the fast pair's 14.4x, which the 90% objective lowers to 9x: both page
        *ttft("batch-model", 30, 10, fast_share=0.0, le="5.0"),
        # the same as Prometheus 3 stores it (le="5"), for the other batch model
        *ttft("batch.v3", 30, 10, fast_share=0.0, le="5"),
        # ITL fine
        series("sluice_inter_token_latency_seconds_bucket", counter((30, 100)), le="0.1", **labels),
        series("sluice_inter_token_latency_seconds_count", counter((30, 100)), **labels),
    ]
    fast = {"severity": "page", "slo": "ttft", "tier": "interactive", "model": "demo-gpt"}
    slow_batch = [
        {"severity": "page", "slo": "ttft", "tier": "batch", "model": m} for m in ("batch-model", "batch.v3")
    ]
    promtool_test(
        tmp_path,
        inputs,
        [
            alert(FAST, "10m", *slow_batch, fast),
            alert(FAST, "25m", *slow_batch, fast),
            alert(SLOW, "25m", *slow_batch, fast),  # 18x is above 6x too
        ],
    )


def ttft_breach(model: str, healthy_minutes: int, breach_minutes: int) -> list[dict[str, str]]:
    """TTFT series of ``model``: ``healthy_minutes`` with every first token within 5 s, then
    ``breach_minutes`` with every one slower (a total breach after a healthy history)."""
    labels = {"tenant": "t1", "model": model, "version": "1"}
    name = "sluice_time_to_first_token_seconds"
    fast = counter((healthy_minutes, 10), (breach_minutes, 0))
    total = counter((healthy_minutes + breach_minutes, 10))
    return [
        series(f"{name}_bucket", fast, le="5.0", **labels),
        series(f"{name}_bucket", total, le="+Inf", **labels),
        series(f"{name}_count", total, **labels),
    ]


def test_a_total_breach_of_a_90_percent_objective_pages_within_the_hour(tmp_path: Path) -> None:
    """Found by review: a 90% objective burns at most 10x, so the fast pair's 14.4x could never fire; after
    a healthy history a total TTFT breach paged through the 6h pair only, about 3.5 hours in. The fast
    pair now alerts above 0.9 / budget (9x) for it: more than 90% of the last hour's first tokens slow."""
    page = {"severity": "page", "slo": "ttft", "tier": "batch", "model": "batch-model"}
    promtool_test(
        tmp_path,
        ttft_breach("batch-model", 420, 180),  # 7 h healthy, then every first token over 5 s
        [
            alert(FAST, "470m"),  # 50 minutes in: 83% of the hour's first tokens slow, under 90%
            alert(FAST, "480m", page),  # 60 minutes in: all of them
            alert(SLOW, "480m"),  # the 6h pair (6x: 60% of six hours) is still far off
            alert(FAST, "599m", page),
        ],
    )


def test_the_default_batch_tier_pages_fast_on_a_total_ttft_breach(tmp_path: Path) -> None:
    """The shipped batch tier's latency objectives are 95% (burn at most 20x, over the fast pair's 14.4x):
    a total breach after a healthy history pages through the 1h pair once 72% of the hour is bad, 43
    minutes in, without any threshold lowered."""
    interactive, batch = SloConfig().tiers
    config = SloConfig(tiers=(interactive, msgspec.structs.replace(batch, models=("batch-model",))))
    assert config.lowered_thresholds() == []
    page = {"severity": "page", "slo": "ttft", "tier": "batch", "model": "batch-model"}
    promtool_test(
        tmp_path,
        ttft_breach("batch-model", 420, 180),
        [alert(FAST, "455m"), alert(FAST, "465m", page), alert(SLOW, "465m")],
        config=config,
    )


def test_no_page_waits_for_more_bad_events_than_there_are(tmp_path: Path) -> None:
    """Whatever the target, every page's threshold is under 1 / budget: an objective whose events all go
    bad fires both page pairs, the fast one included (at 50%, 90%, 93% and 99% targets)."""
    targets = (0.5, 0.9, 0.93, 0.99)
    tiers = tuple(
        Tier(
            name=f"t{i}",
            availability=0.995,
            ttft=LatencyObjective(threshold_seconds=5.0, target=target),
            models=(f"m{i}",),
        )
        for i, target in enumerate(targets)
    )
    config = SloConfig(
        tiers=(Tier(name="other", availability=0.995), *tiers),
        default_tier="other",
        alerts=AlertSettings(tickets=False),  # the pages only: days of series are slow in promtool
    )
    assert {(x.tier, x.alert.alert) for x in config.lowered_thresholds()} == {
        ("t0", FAST),  # 50%: burns at most 2x
        ("t0", SLOW),
        ("t1", FAST),  # 90%: at most 10x
        ("t2", FAST),  # 93%: at most 14.29x, just under 14.4x
    }
    inputs = [s for i in range(len(targets)) for s in ttft_breach(f"m{i}", 0, 370)]
    page = [{"severity": "page", "slo": "ttft", "tier": f"t{i}", "model": f"m{i}"} for i in range(4)]
    promtool_test(tmp_path, inputs, [alert(FAST, "61m", *page), alert(SLOW, "361m", *page)], config=config)


def test_consumer_lag_over_threshold_for_its_duration_fires(tmp_path: Path) -> None:
    def lag(values: list[float], group: str, topic: str, partition: str) -> dict[str, str]:
        return series("sluice_consumer_lag", values, group=group, topic=topic, partition=partition)

    inputs = [
        # g1 is 5000 behind on one partition of the topic (max per group and topic counts)
        lag(gauge((31, 5000)), "g1", "sluice.requests.demo-gpt", "0"),
        lag(gauge((31, 10)), "g1", "sluice.requests.demo-gpt", "1"),
        # g2 stays under the threshold; g3 is over it for only 3 minutes
        lag(gauge((31, 500)), "g2", "sluice.results", "0"),
        lag(gauge((10, 0), (3, 5000), (18, 0)), "g3", "sluice.usage", "0"),
    ]
    fired = {"severity": "page", "group": "g1", "topic": "sluice.requests.demo-gpt"}
    promtool_test(
        tmp_path,
        inputs,
        [
            alert(LAG, "3m"),  # pending: over the threshold for less than 5 minutes
            alert(LAG, "6m", fired),
            alert(LAG, "14m", fired),
            alert(LAG, "30m", fired),
        ],
    )


def test_dead_letters_fire_on_any_increase_and_on_a_new_series(tmp_path: Path) -> None:
    decode = {"topic": "sluice.replies", "reason": "decode"}
    schema = {"topic": "sluice.requests.demo-gpt", "reason": "schema"}
    inputs = [
        # a counter at 0 that goes to 1 at minute 11 and stays there
        series("sluice_dead_letters_total", gauge((11, 0), (50, 1)), **decode),
        # a series that only comes into being at minute 40, at 1 (its first dead letter)
        series("sluice_dead_letters_total", [*[None] * 40, *gauge((21, 1))], **schema),
    ]
    promtool_test(
        tmp_path,
        inputs,
        [
            alert(DEAD, "5m"),
            alert(DEAD, "15m", {"severity": "ticket", **decode}),
            alert(DEAD, "30m"),  # no new dead letter for 10 minutes: resolved
            alert(DEAD, "45m", {"severity": "ticket", **schema}),
            alert(DEAD, "55m"),
        ],
    )


OOM_TOTAL = "sluice_worker_out_of_memory_total"


def test_out_of_memory_fires_per_model_on_any_increase_and_on_a_worker_that_starts_with_one(
    tmp_path: Path,
) -> None:
    inputs = [
        # two workers of one model: one runs out of memory twice at minute 11 (summed by model), the other
        # never does
        series(OOM_TOTAL, gauge((11, 0), (50, 2)), model="all-minilm-l6-v2", instance="w1:9401"),
        series(OOM_TOTAL, gauge((61, 0)), model="all-minilm-l6-v2", instance="w2:9401"),
        # a worker first scraped at minute 40 that already ran out of memory once
        series(OOM_TOTAL, [*[None] * 40, *gauge((21, 1))], model="demo-gpt", instance="w3:9400"),
    ]
    promtool_test(
        tmp_path,
        inputs,
        [
            alert(OOM, "5m"),
            alert(OOM, "15m", {"severity": "ticket", "model": "all-minilm-l6-v2"}),
            alert(OOM, "30m"),  # nothing for 10 minutes: resolved (the batch limit grows back on its own)
            alert(OOM, "45m", {"severity": "ticket", "model": "demo-gpt"}),
            alert(OOM, "55m"),
        ],
    )


def test_annotations_render(tmp_path: Path) -> None:
    # every request fails from the start: the 1h burn rate is exactly 1 / 0.005 = 200
    inputs = [
        *requests("demo-gpt", 0, 100, error_share=1.0),
        series("sluice_consumer_lag", gauge((20, 5000)), group="g1", topic="sluice.results", partition="0"),
    ]
    page = {
        "exp_labels": {"severity": "page", "slo": "availability", "tier": "interactive", "model": "demo-gpt"},
        "exp_annotations": {
            "summary": "demo-gpt: availability error budget burning at 200x over 1h (page above 14.4x)",
            "description": (
                "Objective (interactive tier, 30-day budget): 99.5% of requests complete (not failed, "
                "expired or shed). The burn rate (error ratio / error budget 0.005) is above 14.4 over "
                "both the last 1h and the last 5m: at that rate 2% of the budget goes in 1h."
            ),
        },
    }
    lag = {
        "exp_labels": {"severity": "page", "group": "g1", "topic": "sluice.results"},
        "exp_annotations": {
            "summary": "Consumer group g1 is 5k records behind on sluice.results",
            "description": (
                "The largest partition lag of group g1 on sluice.results has stayed above 1000 records for "
                "5m: its consumers do not keep up, or have stopped. On a request topic, requests wait that "
                "long before a worker sees them."
            ),
        },
    }
    promtool_test(
        tmp_path,
        inputs,
        [
            {"eval_time": "15m", "alertname": FAST, "exp_alerts": [page]},
            {"eval_time": "15m", "alertname": LAG, "exp_alerts": [lag]},
        ],
        annotations=True,
    )


def test_drift_detected_fires_for_a_drifting_version_that_serves(tmp_path: Path) -> None:
    def detected(values: list[float], model: str, version: str = "1") -> dict[str, str]:
        return series("sluice_drift_detected", values, model=model, version=version)

    inputs = [
        # demo-gpt's reports say drift for three windows in a row (minutes 5 to 19), then no_drift again
        detected(gauge((5, 0), (15, 1), (11, 0)), "demo-gpt"),
        # other-model never drifts; blip-model's one false alarm lasts its window (minutes 5 to 9)
        detected(gauge((31, 0)), "other-model"),
        detected(gauge((5, 0), (5, 1), (21, 0)), "blip-model"),
        # demo-gpt's retired version 0 drifted in its last report, and gets no traffic any more
        detected(gauge((31, 1)), "demo-gpt", version="0"),
        serving("demo-gpt", (30, 0), version="0"),
        serving("demo-gpt", (30, 100)),
        serving("other-model", (30, 100)),
        serving("blip-model", (30, 100)),
    ]
    drifted = {"severity": "ticket", "model": "demo-gpt", "version": "1"}
    promtool_test(
        tmp_path,
        inputs,
        [
            *no_alerts("4m"),
            # pending until a minute into the second window that says drift (for: 6m)
            alert(DRIFT, "10m"),
            alert(DRIFT, "11m", drifted),
            alert(DRIFT, "19m", drifted),
            *no_alerts("25m"),  # resolved with the no_drift report
        ],
    )


def test_drift_quality_findings_fire_the_feature_pipeline_alert(tmp_path: Path) -> None:
    def quality(values: list[float], model: str) -> dict[str, str]:
        return series("sluice_drift_quality_issues", values, model=model, version="1")

    inputs = [
        quality(gauge((3, 0), (20, 2)), "demo-gpt"),  # two findings from minute 3 (e.g. no embeddings)
        quality(gauge((23, 0)), "other-model"),
        series("sluice_drift_detected", gauge((23, 0)), model="demo-gpt", version="1"),
        serving("demo-gpt", (22, 100)),
        serving("other-model", (22, 100)),
    ]
    broken = {"severity": "ticket", "model": "demo-gpt", "version": "1"}
    promtool_test(
        tmp_path,
        inputs,
        [
            *no_alerts("2m"),
            alert(PIPELINE, "3m"),
            alert(PIPELINE, "5m", broken),
            alert(PIPELINE, "20m", broken),
            alert(DRIFT, "20m"),  # a broken pipeline is not drift
        ],
    )


def test_drift_reports_that_stop_arriving_fire_while_the_model_serves(tmp_path: Path) -> None:
    def reported(values: Sequence[float | str | None], model: str) -> dict[str, str]:
        return series("sluice_drift_last_report_timestamp_seconds", values, model=model)

    frozen = last_report(21)  # reports until minute 20, the last for the window ending at 900 s
    inputs = [
        # fresh: reports keep arriving every 5 minutes
        reported(last_report(61), "fresh"),
        # stuck: the streams worker runs (the gauge is scraped) but no report comes after minute 20
        reported(frozen + [frozen[-1]] * 40, "stuck"),
        # gone: the streams worker is down from minute 21 (its series goes stale, then is absent)
        reported([*frozen, STALE_MARKER, *[None] * 39], "gone"),
        # idle: reports stop because the model stopped completing requests at minute 10
        reported(frozen + [frozen[-1]] * 40, "idle"),
        serving("fresh", (60, 100)),
        serving("stuck", (60, 100)),
        serving("gone", (60, 100)),
        serving("idle", (10, 100), (50, 0)),
    ]
    stale = [{"severity": "ticket", "model": m} for m in ("gone", "stuck")]
    promtool_test(
        tmp_path,
        inputs,
        [
            *no_alerts("10m", "20m"),
            # 3 windows of 300 s, the lateness and an interval (940 s) after the last window's end (900 s):
            # 1800 s is not past it, 1860 s is
            alert(STALE, "30m"),
            alert(STALE, "31m", *stale),
            alert(STALE, "59m", *stale),
        ],
    )


def test_the_drift_window_sets_the_stale_threshold(tmp_path: Path) -> None:
    # 60 s windows: stale after 180 s (and the 40 s of lateness and interval) without a report
    inputs = [
        series(
            "sluice_drift_last_report_timestamp_seconds",
            [*last_report(11, window_s=60), *[540.0] * 10],
            model="demo-gpt",
        ),
        serving("demo-gpt", (20, 100)),
    ]
    promtool_test(
        tmp_path,
        inputs,
        [
            alert(STALE, "12m"),  # the last window ended at 540 s: 720 s is not past 540 + 220
            alert(STALE, "13m", {"severity": "ticket", "model": "demo-gpt"}),
            alert(DRIFT, "13m"),
        ],
        drift_window_s=60,
    )


def test_a_healthy_drift_monitor_with_short_windows_is_not_stale(tmp_path: Path) -> None:
    """A report is a window, the lateness (30 s) and up to an interval (10 s) old when the next one comes:
    with 10 s windows that is 50 s, past three windows (30 s). A review found the alert firing on a healthy
    monitor when the threshold counted windows only; it is 3 x 10 + 30 + 10 = 70 s."""

    def reported(values: Sequence[float | str | None], model: str) -> dict[str, str]:
        return series("sluice_drift_last_report_timestamp_seconds", values, model=model)

    # each report as late as a healthy monitor makes it: 49 s after its window's end, so 50 s old at worst
    frozen = last_report(
        21, window_s=10, lag_s=49
    )  # the last one, at minute 20, for the window ending 1150 s
    inputs = [
        reported(last_report(31, window_s=10, lag_s=49), "healthy"),
        reported(frozen + [frozen[-1]] * 10, "stuck"),
        serving("healthy", (30, 100)),
        serving("stuck", (30, 100)),
    ]
    promtool_test(
        tmp_path,
        inputs,
        [
            *[alert(STALE, f"{m}m") for m in (5, 10, 15, 20)],
            alert(STALE, "21m", {"severity": "ticket", "model": "stuck"}),  # 110 s since 1150 s: past 70
            alert(STALE, "29m", {"severity": "ticket", "model": "stuck"}),
        ],
        drift_window_s=10,
    )


def test_drift_annotations_render(tmp_path: Path) -> None:
    inputs = [
        series("sluice_drift_detected", gauge((20, 1)), model="demo-gpt", version="1"),
        series("sluice_drift_quality_issues", gauge((20, 2)), model="demo-gpt", version="1"),
        series("sluice_drift_last_report_timestamp_seconds", gauge((20, 0)), model="demo-gpt"),
        serving("demo-gpt", (20, 100)),
    ]
    drifted = {
        "exp_labels": {"severity": "ticket", "model": "demo-gpt", "version": "1"},
        "exp_annotations": {
            "summary": "demo-gpt version 1: its traffic drifted",
            "description": (
                "The latest all-tenant drift report of model demo-gpt version 1 says drift, as did the one "
                "before it: some request features (prompt length, script, language, output, "
                "log-probabilities, embeddings) are distributed differently from its reference window. "
                "`sluice drift status` shows every model's latest verdict; `sluice drift report demo-gpt "
                "--html out.html` shows which features moved and how."
            ),
        },
    }
    broken = {
        "exp_labels": {"severity": "ticket", "model": "demo-gpt", "version": "1"},
        "exp_annotations": {
            "summary": "demo-gpt version 1: 2 drift data-quality finding(s)",
            "description": (
                "The latest all-tenant drift report of model demo-gpt version 1 has data-quality findings: "
                "the feature pipeline broke, not the traffic (features missing or out of range, the "
                "embedding sampler stopped). `sluice drift report demo-gpt --html out.html` lists them; "
                "`sluice drift status` shows every model's latest verdict."
            ),
        },
    }
    stale = {
        "exp_labels": {"severity": "ticket", "model": "demo-gpt"},
        "exp_annotations": {
            "summary": "No drift report for demo-gpt for 16m 0s",
            "description": (
                "The latest drift report of demo-gpt covers a window that ended 16m 0s ago, more than 3 "
                "drift windows of 300 s and the monitor's lateness (30 s) and interval (10 s), while the "
                "model still completes requests: the streams worker's drift monitor is down or stuck (or "
                "cannot read the warehouse). Check the streams worker and its logs; `sluice drift status` "
                "shows each model's last report."
            ),
        },
    }
    promtool_test(
        tmp_path,
        inputs,
        [
            {"eval_time": "16m", "alertname": DRIFT, "exp_alerts": [drifted]},
            {"eval_time": "16m", "alertname": PIPELINE, "exp_alerts": [broken]},
            {"eval_time": "16m", "alertname": STALE, "exp_alerts": [stale]},
        ],
        annotations=True,
    )


def test_an_automatic_rollback_opens_a_ticket_and_an_operator_abort_does_not(tmp_path: Path) -> None:
    def decisions(values: list[float], model: str, actor: str) -> dict[str, str]:
        return series(ROLLOUT_DECISIONS, values, model=model, action="rollback", actor=actor)

    inputs = [
        decisions(counter((10, 0), (1, 1), (59, 0)), "demo-gpt", "controller"),  # one at minute 11
        decisions(counter((10, 0), (1, 1), (59, 0)), "other", "operator"),
    ]
    ticket = {"severity": "ticket", "model": "demo-gpt"}
    promtool_test(
        tmp_path,
        inputs,
        [
            alert(ROLLBACK, "10m"),
            alert(ROLLBACK, "12m", ticket),
            alert(ROLLBACK, "35m", ticket),
            alert(ROLLBACK, "45m"),  # the lookback (30m) has passed
        ],
    )


def test_example_prometheus_config_loads_the_generated_rules(tmp_path: Path) -> None:
    config = tmp_path / "prometheus.yml"
    shutil.copy(PROMETHEUS_EXAMPLE, config)
    # before the rules exist (a glob matching nothing) ...
    run(tool("promtool"), "check", "config", config)
    # ... and with them, generated where the example's rule_files looks
    (tmp_path / "sluice-rules.yml").write_text(render_rules(SloConfig()))
    output = run(tool("promtool"), "check", "config", config)
    assert "sluice-rules.yml" in output
    assert "SUCCESS" in output
    assert "rules found" in output


def test_example_alertmanager_config_is_valid_and_routes_by_severity() -> None:
    amtool = tool("amtool")
    run(amtool, "check-config", ALERTMANAGER_EXAMPLE)

    def receiver(*labels: str) -> str:
        return run(
            amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER_EXAMPLE}", *labels
        ).split()[0]

    assert receiver("severity=page", "slo=availability", "model=demo-gpt") == "pager"
    assert receiver("severity=ticket", "slo=availability", "model=demo-gpt") == "ticket"
    assert receiver("severity=ticket", "alertname=SluiceDeadLetters") == "ticket"
