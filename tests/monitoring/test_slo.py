"""SLO configuration: defaults, loading and validation; the structure of the generated rules; the CLI."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from typer.testing import CliRunner

from monitoring.metrics import catalogue
from monitoring.slo import (
    BATCH_LIMIT,
    CONSUMER_LAG,
    DEAD_LETTERS_TOTAL,
    DEFAULT_CONFIG,
    DRIFT_DETECTED,
    DRIFT_LAST_REPORT,
    DRIFT_QUALITY_ISSUES,
    ITL_SECONDS,
    OUT_OF_MEMORY_TOTAL,
    PAGE_ALERTS,
    RECORD_PREFIX,
    REQUESTS_TOTAL,
    ROLLOUT_DECISIONS,
    TICKET_ALERTS,
    TTFT_SECONDS,
    AlertSettings,
    DriftAlert,
    LatencyObjective,
    SloConfig,
    SloConfigError,
    Tier,
    budget_minutes,
    burn_alerts,
    load_slo_config,
    parse_slo_config,
    render_rules,
    rule_groups,
    seconds_duration,
    windows,
)
from sluice.cli import app
from streams.settings import StreamsSettings

DOC = Path(__file__).resolve().parents[2] / "docs" / "slo.md"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "slo.toml"
    path.write_text(text)
    return path


def rules_of(config: SloConfig) -> list[dict[str, Any]]:
    return [rule for group in rule_groups(config)["groups"] for rule in group["rules"]]


def group(config: SloConfig, name: str) -> list[dict[str, Any]]:
    return next(g["rules"] for g in rule_groups(config)["groups"] if g["name"] == name)


# ---------------------------------------------------------------- configuration


def test_defaults() -> None:
    assert load_slo_config(None) is DEFAULT_CONFIG
    assert [t.name for t in DEFAULT_CONFIG.tiers] == ["interactive", "batch"]
    interactive = DEFAULT_CONFIG.tier("interactive")
    assert interactive.availability == 0.995
    assert interactive.ttft == LatencyObjective(threshold_seconds=0.5, target=0.95)
    assert interactive.window_days == 30
    assert DEFAULT_CONFIG.tier_of("demo-gpt") is interactive
    assert DEFAULT_CONFIG.alerts.tickets
    assert budget_minutes(0.995, 30) == pytest.approx(216)  # 3h 36m
    # 95%, not 90%: a 90% objective's burn rate cannot reach the fast page's 14.4x (a review)
    batch = DEFAULT_CONFIG.tier("batch")
    assert (batch.ttft, batch.itl) == (
        LatencyObjective(threshold_seconds=5.0, target=0.95),
        LatencyObjective(threshold_seconds=0.3, target=0.95),
    )
    assert DEFAULT_CONFIG.lowered_thresholds() == []


def test_the_documented_example_loads(tmp_path: Path) -> None:
    match = re.search(r"```toml\n(.*?)```", DOC.read_text(), re.S)
    assert match is not None
    config = load_slo_config(write(tmp_path, match.group(1)))
    assert config.tier_of("demo-gpt").name == "interactive"
    assert config.tier_of("all-minilm-l6-v2").name == "batch"
    assert config.tier_of("unlisted").name == "interactive"
    assert config.tier("batch").itl is None
    assert config.lowered_thresholds() == []  # every documented pair can fire for every objective
    assert config.alerts.consumer_lag.max_records == 1000
    assert config.alerts.burn == PAGE_ALERTS + TICKET_ALERTS
    assert config.alerts.drift == DriftAlert(
        window_s=300, drift_windows=2, stale_after_windows=3, for_minutes=1
    )


def test_keys_left_out_keep_their_defaults(tmp_path: Path) -> None:
    config = load_slo_config(write(tmp_path, "[alerts.consumer_lag]\nmax_records = 5000\n"))
    assert config.tiers == DEFAULT_CONFIG.tiers
    assert config.alerts.consumer_lag.max_records == 5000
    assert config.alerts.consumer_lag.for_minutes == 5
    assert config.alerts.dead_letters == DEFAULT_CONFIG.alerts.dead_letters
    assert config.alerts.drift == DEFAULT_CONFIG.alerts.drift == DriftAlert()


def test_integral_thresholds_may_be_written_as_integers(tmp_path: Path) -> None:
    text = 'default_tier = "slow"\n[[tiers]]\nname = "slow"\navailability = 0.9\nttft = { threshold_seconds = 5, target = 0.5 }\n'
    config = load_slo_config(write(tmp_path, text))
    assert config.tier("slow").ttft == LatencyObjective(threshold_seconds=5.0, target=0.5)


BAD_CONFIGS = [
    ("avilability = 0.9\n", "unknown field `avilability`"),
    ('[[tiers]]\nname = "interactive"\navilability = 0.9\n', "unknown field `avilability` - at `$.tiers[0]`"),
    ("[alerts]\nticket = false\n", "unknown field `ticket` - at `$.alerts`"),
    ('[[tiers]]\nname = "interactive"\navailability = 1.0\n', "< 1.0 - at `$.tiers[0].availability`"),
    ('[[tiers]]\nname = "interactive"\navailability = 0\n', "> 0.0 - at `$.tiers[0].availability`"),
    (
        '[[tiers]]\nname = "interactive"\navailability = 0.9\nttft = { threshold_seconds = 0.5, target = 1.5 }\n',
        "< 1.0 - at `$.tiers[0].ttft.target`",
    ),
    (
        '[[tiers]]\nname = "interactive"\navailability = 0.9\nttft = { threshold_seconds = 0.6, target = 0.9 }\n',
        "ttft threshold_seconds 0.6 is not a bucket boundary of sluice_time_to_first_token_seconds; "
        "allowed: 0.005, 0.01, 0.025",
    ),
    (
        # 0.6 is a boundary of neither histogram; 0.0025 (next case) is one of ITL_BUCKETS only
        '[[tiers]]\nname = "interactive"\navailability = 0.9\nitl = { threshold_seconds = 0.6, target = 0.9 }\n',
        "itl threshold_seconds 0.6 is not a bucket boundary of sluice_inter_token_latency_seconds; "
        "allowed: 0.001, 0.0025",
    ),
    (
        '[[tiers]]\nname = "interactive"\navailability = 0.9\nttft = { threshold_seconds = 0.0025, target = 0.9 }\n',
        "ttft threshold_seconds 0.0025 is not a bucket boundary",
    ),
    ('default_tier = "gold"\n', "default_tier 'gold' is not a tier (tiers: interactive, batch)"),
    ('[[tiers]]\nname = "Gold Tier"\navailability = 0.9\n', "at `$.tiers[0].name`"),
    (
        '[[tiers]]\nname = "interactive"\navailability = 0.9\nwindow_days = 1\n',
        ">= 7 - at `$.tiers[0].window_days`",
    ),
    ("tiers = []\n", "length >= 1 - at `$.tiers`"),
    (
        '[alerts.dead_letters]\nseverity = "sms"\n',
        "Invalid enum value 'sms' - at `$.alerts.dead_letters.severity`",
    ),
    ("default_tier = \n", "not valid TOML"),
    ("[alerts.drift]\nstale_after_windows = 1\n", ">= 2 - at `$.alerts.drift.stale_after_windows`"),
    ("[alerts.drift]\nwindow_s = 0.5\n", ">= 1.0 - at `$.alerts.drift.window_s`"),
    ("[drift]\nwindow_s = 300\n", "unknown field `drift`"),
    ("[alerts]\nburn = []\n", "length >= 1 - at `$.alerts.burn`"),
    (
        '[[alerts.burn]]\nlong_minutes = 60\nshort_minutes = 60\nbudget_share = 0.02\nseverity = "page"\n',
        "burn pair 1h/1h: the short window must be shorter than the long one",
    ),
    (
        '[[alerts.burn]]\nlong_minutes = 60\nshort_minutes = 5\nbudget_share = 2\nseverity = "page"\n',
        "< 1.0 - at `$.alerts.burn[0].budget_share`",
    ),
    (
        '[[alerts.burn]]\nlong_minutes = 60\nshort_minutes = 5\nbudget_share = 0.02\nseverity = "page"\n'
        '[[alerts.burn]]\nlong_minutes = 60\nshort_minutes = 10\nbudget_share = 0.05\nseverity = "ticket"\n',
        "burn pairs share a long window (it names the alert): 1h, 1h",
    ),
]


@pytest.mark.parametrize(("text", "message"), BAD_CONFIGS)
def test_invalid_files_are_errors_that_say_where(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(SloConfigError) as caught:
        load_slo_config(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {
                "default_tier": "a",
                "tiers": [
                    {"name": "a", "availability": 0.9, "models": ["m"]},
                    {"name": "b", "availability": 0.9, "models": ["m"]},
                ],
            },
            "model 'm' is in two tiers: 'a' and 'b'",
        ),
        (
            {
                "default_tier": "a",
                "tiers": [{"name": "a", "availability": 0.9}, {"name": "a", "availability": 0.8}],
            },
            "tier names repeat: a, a",
        ),
        (
            {"default_tier": "a", "tiers": [{"name": "a", "availability": 0.9, "models": ["m", "m"]}]},
            "tier 'a' lists a model twice",
        ),
    ],
)
def test_inconsistent_tiers_are_errors(data: dict[str, Any], message: str) -> None:
    with pytest.raises(SloConfigError, match=re.escape(message)):
        parse_slo_config(data)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SloConfigError, match="cannot read"):
        load_slo_config(tmp_path / "nope.toml")


def test_constructing_in_code_validates_too() -> None:
    with pytest.raises(ValueError, match="not a bucket boundary"):
        Tier(name="x", availability=0.9, ttft=LatencyObjective(threshold_seconds=0.6, target=0.9))


# ---------------------------------------------------------------- rules


def test_rules_read_metrics_that_exist() -> None:
    names = {info.name for info in catalogue()}  # histograms by their base name
    exprs = " ".join(rule["expr"] for rule in rules_of(DEFAULT_CONFIG))
    read = {re.sub(r"_(bucket|count)$", "", m) for m in re.findall(r"(?<![:\w])sluice_\w+", exprs)}
    assert read == {
        REQUESTS_TOTAL,
        TTFT_SECONDS,
        ITL_SECONDS,
        CONSUMER_LAG,
        DEAD_LETTERS_TOTAL,
        OUT_OF_MEMORY_TOTAL,
        DRIFT_DETECTED,
        DRIFT_QUALITY_ISSUES,
        DRIFT_LAST_REPORT,
        ROLLOUT_DECISIONS,
    }
    assert read <= names
    assert BATCH_LIMIT in names  # named in the out-of-memory alert's description


def test_burn_thresholds_are_the_workbooks_for_30_days() -> None:
    assert [round(a.threshold(30), 6) for a in PAGE_ALERTS + TICKET_ALERTS] == [14.4, 6, 3, 1]
    assert [(a.long, a.short) for a in PAGE_ALERTS + TICKET_ALERTS] == [
        ("1h", "5m"),
        ("6h", "30m"),
        ("1d", "2h"),
        ("3d", "6h"),
    ]
    assert round(PAGE_ALERTS[0].threshold(28), 6) == 13.44


def thresholds(rule: dict[str, Any]) -> set[float]:
    return {float(t) for t in re.findall(r"> ([0-9.e+-]+)\n", rule["expr"])}


def test_a_pair_out_of_an_objectives_reach_alerts_below_one_over_its_budget(tmp_path: Path) -> None:
    """Found by review: the burn rate cannot pass 1 / budget (10 for a 90% target), so a pair above it
    (the fast page's 14.4x) was a rule that could never fire, loaded without a word. Such a pair alerts
    above 0.9 / budget for that objective, and the rules file, the alert and ``slo show`` say so."""
    config = load_slo_config(
        write(
            tmp_path,
            'default_tier = "batch"\n[[tiers]]\nname = "batch"\navailability = 0.99\n'
            "ttft = { threshold_seconds = 5.0, target = 0.9 }\nitl = { threshold_seconds = 0.3, target = 0.5 }\n",
        )
    )
    lowered = {(x.slo, x.alert.alert): round(x.threshold, 6) for x in config.lowered_thresholds()}
    assert lowered == {
        ("ttft", "SluiceErrorBudgetBurn1h"): 9,  # 90%: burns at most 10x
        ("itl", "SluiceErrorBudgetBurn1h"): 1.8,  # 50%: at most 2x
        ("itl", "SluiceErrorBudgetBurn6h"): 1.8,
        ("itl", "SluiceErrorBudgetBurn1d"): 1.8,  # 3d's 1x stays
    }
    budgets = {"availability": 0.01, "ttft": 0.1, "itl": 0.5}
    alerts = [r for r in rules_of(config) if r.get("alert", "").startswith("SluiceErrorBudgetBurn")]
    assert len(alerts) == 4 * 3
    for rule in alerts:
        (threshold,) = thresholds(rule)
        budget = budgets[rule["labels"]["slo"]]
        assert threshold * budget <= 0.9 + 1e-9, rule["expr"]  # reachable: at most 90% bad events
        said = (rule["labels"]["slo"], rule["alert"]) in lowered
        assert ("out of reach or nearly" in rule["annotations"]["description"]) is said
    fast_ttft = next(
        r for r in alerts if r["alert"] == "SluiceErrorBudgetBurn1h" and r["labels"]["slo"] == "ttft"
    )
    assert thresholds(fast_ttft) == {9.0}
    assert "page above 9x" in fast_ttft["annotations"]["summary"]
    assert "1.25% of the budget goes in 1h" in fast_ttft["annotations"]["description"]
    header = [line for line in render_rules(config).splitlines() if line.startswith("# Lowered: ")]
    assert len(header) == 4
    assert header[0] == (
        "# Lowered: tier 'batch' ttft (target 90%): SluiceErrorBudgetBurn1h (1h/5m) alerts above 9x, not "
        "14.4x: its burn rate cannot pass 10x, so the pair fires when more than 90% of its events are bad."
    )


def test_default_rules_structure() -> None:
    doc = rule_groups(DEFAULT_CONFIG)
    # batch lists no models: no group for it; interactive (the default) takes every model
    assert [g["name"] for g in doc["groups"]] == [
        "sluice-slo-interactive",
        "sluice-kafka",
        "sluice-workers",
        "sluice-drift",
        "sluice-rollout",
    ]
    rules = group(DEFAULT_CONFIG, "sluice-slo-interactive")
    records = [r for r in rules if "record" in r]
    alerts = [r for r in rules if "alert" in r]
    assert rules == records + alerts  # recordings first: alerts read this evaluation's ratios
    assert {(r["record"], r["labels"]["slo"]) for r in records} == {
        (f"{RECORD_PREFIX}{w}", slo)
        for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
        for slo in ("availability", "ttft", "itl")
    }
    assert all("model=" not in r["expr"] and "model!" not in r["expr"] for r in records)
    assert all("sum by (model)" in r["expr"] for r in records)
    assert len(alerts) == 4 * 3
    for a in alerts:
        assert set(a["labels"]) == {"severity", "slo", "tier"}  # model comes from the expression
        assert set(a["annotations"]) == {"summary", "description"}
        assert "{{ $labels.model }}" in a["annotations"]["summary"]
    fast_availability = next(
        a for a in alerts if a["alert"] == "SluiceErrorBudgetBurn1h" and a["labels"]["slo"] == "availability"
    )
    assert fast_availability["labels"] == {"severity": "page", "slo": "availability", "tier": "interactive"}
    expr = " ".join(fast_availability["expr"].split())
    assert expr == (
        f'( {RECORD_PREFIX}1h{{slo="availability",tier="interactive"}} / 0.005 > 14.4 ) and '
        f'( {RECORD_PREFIX}5m{{slo="availability",tier="interactive"}} / 0.005 > 14.4 )'
    )


def test_availability_counts_cancelled_as_neither_good_nor_bad() -> None:
    expr = group(DEFAULT_CONFIG, "sluice-slo-interactive")[0]["expr"]
    assert 'outcome=~"failed|expired|shed"' in expr
    assert 'outcome=~"completed|failed|expired|shed"' in expr
    assert "cancelled" not in expr


def test_kafka_alerts() -> None:
    lag, dead = group(DEFAULT_CONFIG, "sluice-kafka")
    assert lag["alert"] == "SluiceConsumerLag"
    assert lag["expr"].strip() == "max by (group, topic) (sluice_consumer_lag) > 1000"
    assert lag["for"] == "5m"
    assert lag["labels"] == {"severity": "page"}
    assert dead["alert"] == "SluiceDeadLetters"
    assert "increase(sluice_dead_letters_total[10m])" in dead["expr"]
    assert "offset 10m" in dead["expr"]
    assert dead["labels"] == {"severity": "ticket"}


def test_out_of_memory_alert() -> None:
    (oom,) = group(DEFAULT_CONFIG, "sluice-workers")
    assert oom["alert"] == "SluiceWorkerOutOfMemory"
    assert "sum by (model) (increase(sluice_worker_out_of_memory_total[10m])) > 0" in oom["expr"]
    assert "offset 10m" in oom["expr"]
    assert oom["labels"] == {"severity": "ticket"}
    assert "sluice_worker_batch_limit_ratio" in oom["annotations"]["description"]
    config = parse_slo_config({"alerts": {"out_of_memory": {"window_minutes": 30, "severity": "page"}}})
    (oom,) = group(config, "sluice-workers")
    assert "[30m]" in oom["expr"]
    assert oom["labels"] == {"severity": "page"}


def test_drift_alerts() -> None:
    detected, pipeline, stale = group(DEFAULT_CONFIG, "sluice-drift")
    serving = 'sum by (model, version) (rate(sluice_requests_total{outcome="completed"}[15m])) > 0'
    assert detected["alert"] == "SluiceDriftDetected"
    assert detected["expr"] == (
        f"max by (model, version) (sluice_drift_detected) == 1\nand on (model, version)\n{serving}\n"
    )
    assert pipeline["alert"] == "SluiceDriftFeaturePipeline"
    assert pipeline["expr"] == (
        f"max by (model, version) (sluice_drift_quality_issues) > 0\nand on (model, version)\n{serving}\n"
    )
    assert detected["for"] == "6m"  # a minute into the second window in a row that says drift
    assert pipeline["for"] == "1m"
    assert stale["alert"] == "SluiceDriftReportsStale"
    # three 300 s windows, the 30 s lateness and the 10 s interval (SLUICE_DRIFT_LATENESS_S, _INTERVAL_S)
    assert stale["expr"] == (
        "time() - max by (model) (max_over_time(sluice_drift_last_report_timestamp_seconds[1d])) > 940\n"
        'and on (model)\nsum by (model) (rate(sluice_requests_total{outcome="completed"}[15m])) > 0\n'
    )
    assert "for" not in stale  # the threshold is the wait
    for rule in (detected, pipeline, stale):
        assert rule["labels"] == {"severity": "ticket"}
        assert set(rule["annotations"]) == {"summary", "description"}
        assert "{{ $labels.model }}" in rule["annotations"]["summary"]
    assert "sluice drift report {{ $labels.model }} --html out.html" in detected["annotations"]["description"]
    assert "sluice drift status" in detected["annotations"]["description"]


def test_the_drift_window_comes_from_the_config_or_the_caller(tmp_path: Path) -> None:
    def drift_rules(config: SloConfig, window_s: float | None = None) -> list[dict[str, Any]]:
        doc = rule_groups(config, drift_window_s=window_s)
        return next(g["rules"] for g in doc["groups"] if g["name"] == "sluice-drift")

    def stale(config: SloConfig, window_s: float | None = None) -> str:
        return str(drift_rules(config, window_s)[2]["expr"])

    text = (
        "[alerts.drift]\nwindow_s = 600\ndrift_windows = 3\nstale_after_windows = 4\nfor_minutes = 5\n"
        'severity = "page"\n'
    )
    config = load_slo_config(write(tmp_path, text))
    assert "> 2440\n" in stale(config)
    assert "[40m]" in stale(config)
    rules = drift_rules(config)
    assert {r["labels"]["severity"] for r in rules} == {"page"}
    assert rules[0]["for"] == "21m"  # two windows of drift and a minute into the third
    assert "says drift, as did the 2 before it:" in rules[0]["annotations"]["description"]
    assert rules[1]["for"] == "5m"
    assert drift_rules(DEFAULT_CONFIG, 60)[0]["for"] == "2m"
    once = SloConfig(alerts=AlertSettings(drift=DriftAlert(drift_windows=1)))
    assert drift_rules(once)[0]["for"] == "1m"
    assert "says drift: some" in drift_rules(once)[0]["annotations"]["description"]
    # the caller's window (the streams worker's SLUICE_DRIFT_WINDOW_S) wins over the file's
    assert "> 280\n" in stale(config, 60)
    assert "[5m]" in stale(config, 60)  # the traffic window never goes under 5 minutes
    assert "> 62.5\n" in stale(DEFAULT_CONFIG, 7.5)
    assert render_rules(DEFAULT_CONFIG, drift_window_s=600).count("> 1840\n") == 1
    with pytest.raises(SloConfigError, match=re.escape("drift window 0.5 s: must be at least 1 s")):
        rule_groups(DEFAULT_CONFIG, drift_window_s=0.5)


def test_the_stale_threshold_counts_the_drift_monitors_lateness_and_interval(tmp_path: Path) -> None:
    """A healthy report is up to a window, the lateness and an interval old (the window's end is reported
    ``SLUICE_DRIFT_LATENESS_S`` after it, by a monitor that looks every ``SLUICE_DRIFT_INTERVAL_S``): a
    review found the stale alert firing on a healthy monitor with 10 s windows (3 x 10 s < 10 + 30 + 10)."""

    def stale(config: SloConfig = DEFAULT_CONFIG, **streams: float) -> str:
        doc = rule_groups(config, **streams)
        return str(next(g["rules"] for g in doc["groups"] if g["name"] == "sluice-drift")[2]["expr"])

    # the defaults are the streams worker's
    assert (DriftAlert().lateness_s, DriftAlert().interval_s) == (
        StreamsSettings().drift_lateness_s,
        StreamsSettings().drift_interval_s,
    )
    assert "> 70\n" in stale(drift_window_s=10)
    assert "> 95\n" in stale(drift_window_s=10, drift_lateness_s=60, drift_interval_s=5)
    config = load_slo_config(
        write(tmp_path, "[alerts.drift]\nwindow_s = 60\nlateness_s = 0\ninterval_s = 1\n")
    )
    assert "> 181\n" in stale(config)
    assert "> 280\n" in stale(config, drift_lateness_s=90, drift_interval_s=10)  # the caller's win
    # the traffic window stays the windows' span: a model that stopped serving must not alert
    assert "[5m]" in stale(drift_window_s=10)
    with pytest.raises(SloConfigError, match=re.escape("drift lateness -1 s: must be at least 0 s")):
        rule_groups(DEFAULT_CONFIG, drift_lateness_s=-1)
    with pytest.raises(SloConfigError, match=re.escape("drift interval 0 s: must be more than 0 s")):
        rule_groups(DEFAULT_CONFIG, drift_interval_s=0)


def test_cli_rules_take_the_streams_workers_drift_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """``sluice slo rules`` reads the drift window, lateness and interval the streams worker runs with, each
    when set (else the config's)."""
    monkeypatch.setenv("SLUICE_DRIFT_WINDOW_S", "10")
    result = CliRunner().invoke(app, ["slo", "rules"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == rule_groups(DEFAULT_CONFIG, drift_window_s=10)
    assert "[1d])) > 70\n" in result.stdout
    monkeypatch.setenv("SLUICE_DRIFT_LATENESS_S", "60")
    monkeypatch.setenv("SLUICE_DRIFT_INTERVAL_S", "5")
    result = CliRunner().invoke(app, ["slo", "rules"])
    assert result.exit_code == 0, result.output
    assert "[1d])) > 95\n" in result.stdout
    # and `slo show` says what the rules do (it showed the config's window alone, and windows only)
    result = CliRunner().invoke(app, ["slo", "show"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    (stale,) = [line for line in result.stdout.splitlines() if "SluiceDriftReportsStale" in line]
    assert "10 s drift windows" in stale
    assert "60 s lateness and 5 s interval (95 s)" in stale


def test_seconds_duration() -> None:
    assert [seconds_duration(s) for s in (900, 3600, 90, 7.5, 1800.0)] == [
        "15m",
        "1h",
        "90s",
        "7500ms",
        "30m",
    ]


def test_tiers_select_their_models_and_the_default_takes_the_rest() -> None:
    config = SloConfig(
        tiers=(
            Tier(name="interactive", availability=0.995),
            Tier(name="batch", availability=0.99, models=("emb", "org/model.v1")),
            Tier(name="gold", availability=0.999, models=("vip",)),
        )
    )
    default = group(config, "sluice-slo-interactive")[0]["expr"]
    batch = group(config, "sluice-slo-batch")[0]["expr"]
    gold = group(config, "sluice-slo-gold")[0]["expr"]
    # regex metacharacters escaped for RE2, backslashes doubled for the PromQL string
    assert 'model!~"emb|org/model\\\\.v1|vip"' in default
    assert 'model=~"emb|org/model\\\\.v1"' in batch
    assert 'model="vip"' in gold
    # no latency objectives in these tiers: availability only
    assert {r["labels"]["slo"] for r in group(config, "sluice-slo-gold") if "record" in r} == {"availability"}


def test_a_single_other_model_is_excluded_with_not_equal() -> None:
    config = SloConfig(
        tiers=(DEFAULT_CONFIG.tiers[0], Tier(name="batch", availability=0.99, models=("emb",)))
    )
    assert 'model!="emb"' in group(config, "sluice-slo-interactive")[0]["expr"]


def test_latency_rules_read_the_threshold_bucket() -> None:
    config = SloConfig(
        tiers=(
            Tier(
                name="interactive",
                availability=0.995,
                ttft=LatencyObjective(threshold_seconds=5.0, target=0.9),
                itl=LatencyObjective(threshold_seconds=0.0025, target=0.9),
            ),
        )
    )
    records = [r for r in group(config, "sluice-slo-interactive") if "record" in r]
    ttft = next(r["expr"] for r in records if r["labels"]["slo"] == "ttft")
    itl = next(r["expr"] for r in records if r["labels"]["slo"] == "itl")
    assert 'sluice_time_to_first_token_seconds_bucket{le=~"5|5\\\\.0"}' in ttft  # either exposition
    assert "sluice_time_to_first_token_seconds_count[" in ttft
    assert 'sluice_inter_token_latency_seconds_bucket{le="0.0025"}' in itl


def test_without_tickets_only_the_page_pairs_and_their_windows() -> None:
    config = SloConfig(alerts=AlertSettings(tickets=False))
    assert windows(config) == [5, 30, 60, 360]
    assert {r["alert"] for r in rules_of(config) if "alert" in r} == {
        "SluiceErrorBudgetBurn1h",
        "SluiceErrorBudgetBurn6h",
        "SluiceConsumerLag",
        "SluiceDeadLetters",
        "SluiceWorkerOutOfMemory",
        "SluiceDriftDetected",
        "SluiceDriftFeaturePipeline",
        "SluiceDriftReportsStale",
        "SluiceRolloutRolledBack",
    }


CUSTOM_BURN = """
[[alerts.burn]]
long_minutes = 120
short_minutes = 10
budget_share = 0.05
severity = "page"

[[alerts.burn]]
long_minutes = 2880
short_minutes = 240
budget_share = 0.1
severity = "ticket"
"""


def test_the_burn_pairs_come_from_the_config(tmp_path: Path) -> None:
    config = load_slo_config(write(tmp_path, CUSTOM_BURN))
    assert [(a.alert, a.long, a.short, a.severity) for a in burn_alerts(config)] == [
        ("SluiceErrorBudgetBurn2h", "2h", "10m", "page"),
        ("SluiceErrorBudgetBurn2d", "2d", "4h", "ticket"),
    ]
    assert windows(config) == [10, 120, 240, 2880]
    assert windows(config, "page") == [10, 120]
    rules = group(config, "sluice-slo-interactive")
    assert {r["record"] for r in rules if "record" in r} == {
        f"{RECORD_PREFIX}{w}" for w in ("10m", "2h", "4h", "2d")
    }
    assert {r["alert"] for r in rules if "alert" in r} == {
        "SluiceErrorBudgetBurn2h",
        "SluiceErrorBudgetBurn2d",
    }
    fast = next(
        r
        for r in rules
        if r.get("alert") == "SluiceErrorBudgetBurn2h" and r["labels"]["slo"] == "availability"
    )
    assert " ".join(fast["expr"].split()) == (  # 5% of a 30-day budget in 2h: 0.05 * 30 * 24 / 2 = 18
        f'( {RECORD_PREFIX}2h{{slo="availability",tier="interactive"}} / 0.005 > 18 ) and '
        f'( {RECORD_PREFIX}10m{{slo="availability",tier="interactive"}} / 0.005 > 18 )'
    )
    no_tickets = msgspec.structs.replace(config, alerts=msgspec.structs.replace(config.alerts, tickets=False))
    assert windows(no_tickets) == windows(no_tickets, "page") == [10, 120]


def test_the_default_burn_pairs_are_the_workbooks() -> None:
    assert DEFAULT_CONFIG.alerts.burn == PAGE_ALERTS + TICKET_ALERTS
    assert burn_alerts(DEFAULT_CONFIG, "page") == PAGE_ALERTS
    assert windows(DEFAULT_CONFIG, "page") == [5, 30, 60, 360]


def test_yaml_round_trips_and_keeps_expressions_readable() -> None:
    text = render_rules(DEFAULT_CONFIG, source="slo.toml")
    assert text.startswith("# Generated by `sluice slo rules` from slo.toml")
    assert yaml.safe_load(text) == rule_groups(DEFAULT_CONFIG)
    assert "expr: |\n" in text  # multi-line PromQL as literal blocks


# ---------------------------------------------------------------- CLI


def test_cli_rules_to_stdout_and_file(tmp_path: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["slo", "rules"])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == rule_groups(DEFAULT_CONFIG)

    config = write(tmp_path, "[alerts.consumer_lag]\nmax_records = 42\n")
    out = tmp_path / "rules.yml"
    result = runner.invoke(app, ["slo", "rules", "--config", str(config), "--out", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert f"from {config}" in text
    assert "(sluice_consumer_lag) > 42" in text


def test_cli_without_config_uses_the_streams_workers_slo_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``SLUICE_STREAMS_SLO_FILE`` is what the streams worker computes its burn events against: the rules
    and the table default to it, so the alerts and the events come from one file."""
    config = write(tmp_path, CUSTOM_BURN + "[alerts.consumer_lag]\nmax_records = 42\n")
    monkeypatch.setenv("SLUICE_STREAMS_SLO_FILE", str(config))
    result = CliRunner().invoke(app, ["slo", "rules"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        f"# Generated by `sluice slo rules` from {config} (SLUICE_STREAMS_SLO_FILE)"
    )
    assert yaml.safe_load(result.stdout) == rule_groups(load_slo_config(config))
    assert "SluiceErrorBudgetBurn2h" in result.stdout
    assert "SluiceErrorBudgetBurn1h" not in result.stdout
    result = CliRunner().invoke(app, ["slo", "show"])
    assert result.exit_code == 0, result.output
    assert "SluiceErrorBudgetBurn2h" in result.stdout
    assert "SluiceErrorBudgetBurn1h" not in result.stdout
    assert "SluiceWorkerOutOfMemory" in result.stdout
    # --config still wins over the variable
    result = CliRunner().invoke(app, ["slo", "rules", "--config", str(write(tmp_path, ""))])
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.stdout) == rule_groups(DEFAULT_CONFIG)


def test_cli_invalid_config_exits_2_with_the_reason(tmp_path: Path) -> None:
    config = write(tmp_path, "[alerts]\nticket = false\n")
    for command in ("rules", "show"):
        result = CliRunner().invoke(app, ["slo", command, "--config", str(config)])
        assert result.exit_code == 2
        assert "unknown field `ticket`" in result.output


def test_cli_show_lists_tiers_and_alerts() -> None:
    result = CliRunner().invoke(app, ["slo", "show"])
    assert result.exit_code == 0, result.output
    for text in (
        "interactive",
        "batch",
        "99.5%",
        "95% within 0.5 s",
        "3h 36m",
        "SluiceErrorBudgetBurn1h",
        "14.4",
        "SluiceDriftDetected",
        "SluiceDriftFeaturePipeline",
        "SluiceDriftReportsStale",
    ):
        assert text in result.stdout


def test_cli_show_names_a_lowered_threshold(tmp_path: Path) -> None:
    config = write(tmp_path, 'default_tier = "x"\n[[tiers]]\nname = "x"\navailability = 0.9\n')
    result = CliRunner().invoke(app, ["slo", "show", "--config", str(config)])
    assert result.exit_code == 0, result.output
    assert "lowered: tier 'x' availability (target 90%): SluiceErrorBudgetBurn1h (1h/5m) alerts above 9x" in (
        " ".join(result.stdout.split())
    )
    assert "lowered" not in CliRunner().invoke(app, ["slo", "show"]).stdout


@pytest.mark.parametrize("args", [["slo"], ["slo", "rules"], ["slo", "show"]], ids=" ".join)
def test_cli_help(args: list[str]) -> None:
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


def test_an_integer_threshold_given_in_code_matches_both_le_forms() -> None:
    tier = Tier(name="interactive", availability=0.9, ttft=LatencyObjective(threshold_seconds=5, target=0.9))
    records = group(SloConfig(tiers=(tier,)), "sluice-slo-interactive")
    assert any('le=~"5|5\\\\.0"' in r["expr"] for r in records if "record" in r)
