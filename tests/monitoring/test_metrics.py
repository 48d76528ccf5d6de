"""record_drift: one all-tenant drift report into the drift gauges and counter."""

from __future__ import annotations

import uuid
from typing import get_args

import pytest
from prometheus_client import REGISTRY

from monitoring import metrics
from schemas.events import DriftVerdict


def value(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


@pytest.fixture
def model() -> str:
    """A model id no other test records (the metrics are process-wide)."""
    return f"drift-{uuid.uuid4().hex[:8]}"


def verdicts(model: str, version: str) -> dict[str, float | None]:
    return {
        v: value("sluice_drift_verdict", model=model, version=version, verdict=v)
        for v in metrics.DRIFT_VERDICTS
    }


def test_verdicts_are_the_schemas() -> None:
    assert set(metrics.DRIFT_VERDICTS) == set(get_args(DriftVerdict))
    assert len(metrics.DRIFT_VERDICTS) == 5


def test_record_drift_sets_the_gauges_and_counts_the_report(model: str) -> None:
    features = [("prompt_chars", 0.0001, True), ("prompt_language", 0.42, False), ("embedding", 0.31, True)]
    metrics.record_drift(model, "v1", "drift", features, 0, 1_700_000_100.0)

    assert value("sluice_drift_detected", model=model, version="v1") == 1
    assert verdicts(model, "v1") == {
        "reference": 0,
        "no_drift": 0,
        "drift": 1,
        "insufficient_data": 0,
        "data_quality": 0,
    }
    assert value("sluice_drift_quality_issues", model=model, version="v1") == 0
    assert value("sluice_drift_last_report_timestamp_seconds", model=model) == 1_700_000_100.0
    for name, statistic, drifted in features:
        assert value("sluice_drift_feature_statistic", model=model, feature=name) == statistic
        assert value("sluice_drift_feature_drifted", model=model, feature=name) == (1 if drifted else 0)
    assert value("sluice_drift_reports_total", model=model, verdict="drift") == 1
    assert value("sluice_drift_reports_total", model=model, verdict="no_drift") is None


def test_the_next_report_replaces_the_state_and_adds_one_to_its_verdict(model: str) -> None:
    metrics.record_drift(model, "v1", "drift", [("prompt_chars", 0.0001, True)], 0, 1_700_000_100.0)
    metrics.record_drift(model, "v1", "no_drift", [("prompt_chars", 0.3, False)], 0, 1_700_000_400.0)
    metrics.record_drift(model, "v1", "data_quality", [("prompt_chars", 0.5, False)], 2, 1_700_000_700.0)

    assert value("sluice_drift_detected", model=model, version="v1") == 0
    assert [v for v, on in verdicts(model, "v1").items() if on] == ["data_quality"]
    assert sum(v or 0 for v in verdicts(model, "v1").values()) == 1
    assert value("sluice_drift_quality_issues", model=model, version="v1") == 2
    assert value("sluice_drift_last_report_timestamp_seconds", model=model) == 1_700_000_700.0
    assert value("sluice_drift_feature_statistic", model=model, feature="prompt_chars") == 0.5
    assert value("sluice_drift_feature_drifted", model=model, feature="prompt_chars") == 0
    for verdict in ("drift", "no_drift", "data_quality"):
        assert value("sluice_drift_reports_total", model=model, verdict=verdict) == 1


def test_features_the_latest_report_did_not_test_lose_their_series(model: str) -> None:
    metrics.record_drift(model, "v1", "drift", [("refusal", 0.0, True), ("embedding", 0.4, True)], 0, 300.0)
    metrics.record_drift(model, "v1", "insufficient_data", [], 0, 600.0)

    for feature in ("refusal", "embedding"):
        assert value("sluice_drift_feature_statistic", model=model, feature=feature) is None
        assert value("sluice_drift_feature_drifted", model=model, feature=feature) is None
    assert value("sluice_drift_detected", model=model, version="v1") == 0


def test_versions_have_their_own_verdicts(model: str) -> None:
    metrics.record_drift(model, "v1", "drift", [], 0, 300.0)
    metrics.record_drift(model, "v2", "reference", [], 0, 300.0)

    assert value("sluice_drift_detected", model=model, version="v1") == 1
    assert value("sluice_drift_detected", model=model, version="v2") == 0
    assert value("sluice_drift_verdict", model=model, version="v2", verdict="reference") == 1
    assert value("sluice_drift_reports_total", model=model, verdict="drift") == 1
    assert value("sluice_drift_reports_total", model=model, verdict="reference") == 1


def test_an_unknown_verdict_is_an_error_and_records_nothing(model: str) -> None:
    with pytest.raises(ValueError, match="unknown drift verdict 'drifted'"):
        metrics.record_drift(model, "v1", "drifted", [("refusal", 0.0, True)], 0, 300.0)
    assert value("sluice_drift_detected", model=model, version="v1") is None
    assert value("sluice_drift_reports_total", model=model, verdict="drifted") is None
    assert value("sluice_drift_feature_statistic", model=model, feature="refusal") is None


def test_drift_metrics_are_in_the_exposition(model: str) -> None:
    metrics.record_drift(model, "v1", "no_drift", [("output_chars", 0.2, False)], 1, 900.0)
    metrics.DRIFT_EVALUATION_SECONDS.observe(0.3)
    text = metrics.exposition(streams=True).decode()
    assert f'sluice_drift_verdict{{model="{model}",verdict="no_drift",version="v1"}} 1.0' in text
    assert f'sluice_drift_feature_statistic{{feature="output_chars",model="{model}"}} 0.2' in text
    assert 'sluice_drift_evaluation_seconds_bucket{le="0.5"}' in text


def test_another_service_leaves_the_streams_metrics_out() -> None:
    """An audit: every process registers every metric, and the edges and workers exported the streams
    worker's unlabelled ones at 0 (a Grafana line per target, an ``absent()`` that never fires)."""
    metrics.DRIFT_EVALUATION_SECONDS.observe(0.3)
    streams = metrics.exposition(streams=True).decode()
    other = metrics.exposition().decode()
    for name in (
        "sluice_streams_audit_conflicts",
        "sluice_streams_freshness_seconds_count",
        "sluice_drift_evaluation",
    ):
        assert name in streams
        assert name not in other
    assert "sluice_consumer_lag" in other, "what every service records stays"
    assert "sluice_requests_total" in other
    known = {m._name for m in metrics._ALL}
    assert known >= metrics.STREAMS_ONLY
    assert {n for n in known if n.startswith(("sluice_streams_", "sluice_drift_", "sluice_rollout_"))} == (
        metrics.STREAMS_ONLY
    )


def test_children_remember_labelled_series_and_count_into_the_registry(model: str) -> None:
    child = metrics.Children(limit=2)
    first = child(metrics.WORKER_REQUESTS, model, "v1", "completed")
    assert child(metrics.WORKER_REQUESTS, model, "v1", "completed") is first
    assert child(metrics.WORKER_REQUESTS, model, "v1", "failed") is not first
    first.inc(3)
    child(metrics.WORKER_REQUESTS, model, "v2", "completed").inc()  # over the limit: starts over
    child(metrics.WORKER_REQUESTS, model, "v1", "completed").inc()
    labels = {"model": model, "version": "v1", "status": "completed"}
    assert REGISTRY.get_sample_value("sluice_worker_requests_total", labels) == 4
