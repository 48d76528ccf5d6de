"""``sluice drift rebaseline``: which version it moves, what it refuses, and the event it publishes (on a
real broker, read back from the control topic as the streams worker reads it)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec
import pytest
from typer.testing import CliRunner

import infra.warehouse
import sluice.cli as sluice_cli
import sluice.rollout
from bus.control import read_control
from infra.warehouse import QueryResult
from schemas.codec import kafka_key
from schemas.events import DeploymentChanged, DriftRebaselined, Event
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from sluice.drift_commands import DriftError, rebaseline_version

MODEL = "demo-gpt"


def deployed(stable: str, traffic: dict[str, float]) -> DeploymentChanged:
    return DeploymentChanged(
        tenant="", model=MODEL, source="test", version=stable, action="deploy", traffic=traffic, reason="",
        stable=stable,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("requested", "known", "deployment", "chosen"),
    [
        (None, ["v1"], None, "v1"),  # the only version with reports
        (None, ["v1", "v2"], deployed("v2", {"v2": 1.0}), "v2"),  # the stable one
        ("v1", ["v1", "v2"], deployed("v2", {"v2": 1.0}), "v1"),  # asked for, and has reports
        ("v3", [], deployed("v2", {"v2": 0.9, "v3": 0.1}), "v3"),  # serves, no report yet
        (None, [], deployed("v2", {"v2": 1.0}), "v2"),
    ],
)
def test_the_version_rebaselined(
    requested: str | None, known: list[str], deployment: DeploymentChanged | None, chosen: str
) -> None:
    assert rebaseline_version(MODEL, requested, known, deployment) == chosen


@pytest.mark.parametrize(
    ("requested", "known", "deployment", "message"),
    [
        (None, [], None, "no drift reports and no deployment"),
        ("v9", ["v1", "v2"], None, "no version 'v9'"),
        ("v3", ["v1"], deployed("v1", {"v1": 1.0, "v3": 0.0}), "no version 'v3'"),  # deployed, no traffic
        (None, ["v1", "v2"], None, "several versions (v1, v2): pass --version"),
    ],
)
def test_a_version_that_cannot_be_meant_is_refused(
    requested: str | None, known: list[str], deployment: DeploymentChanged | None, message: str
) -> None:
    with pytest.raises(DriftError, match=message.replace("(", r"\(").replace(")", r"\)")):
        rebaseline_version(MODEL, requested, known, deployment)


class Stand:
    """The warehouse's report versions and the control topic's deployment, stood in for; what is published
    is kept."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, versions: list[str], platform: PlatformSettings
    ) -> None:
        self.published: list[Event] = []
        self.queries: list[str] = []

        def query(settings: PlatformSettings, sql: str, **kwargs: Any) -> QueryResult:
            self.queries.append(sql)
            return QueryResult(columns=["model_version"], types=["String"], rows=[[v] for v in versions])

        monkeypatch.setattr(infra.warehouse, "query_warehouse", query)
        monkeypatch.setattr(sluice.rollout, "deployment_of", lambda settings, model: None)
        monkeypatch.setattr(sluice.rollout, "publish", lambda settings, event: self.published.append(event))
        monkeypatch.setattr(sluice_cli, "_settings", platform)


def invoke(*args: str) -> Any:
    return CliRunner().invoke(sluice_cli.app, ["drift", "rebaseline", *args], env={"COLUMNS": "200"})


def test_the_command_publishes_the_operators_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    stand = Stand(monkeypatch, ["v1"], PlatformSettings())
    before = datetime.now(UTC)
    result = invoke(MODEL, "--reason", "  French prompts are expected now ")
    assert result.exit_code == 0, result.output
    (event,) = stand.published
    assert isinstance(event, DriftRebaselined)
    assert (event.model, event.version, event.reason, event.actor) == (
        MODEL, "v1", "French prompts are expected now", "operator",
    )  # fmt: skip
    assert event.time >= before
    assert "demo-gpt v1: rebaselined at" in result.output
    assert "'demo-gpt'" in stand.queries[0], "the versions are those of this model's reports"


@pytest.mark.parametrize(
    ("args", "versions", "message"),
    [
        (["--reason", "   "], ["v1"], "--reason must say why"),
        (["--reason", "x", "--version", "v7"], ["v1"], "has no version 'v7'"),
        (["--reason", "x"], [], "no drift reports and no deployment"),
    ],
)
def test_what_cannot_be_rebaselined_is_a_usage_error_and_publishes_nothing(
    monkeypatch: pytest.MonkeyPatch, args: list[str], versions: list[str], message: str
) -> None:
    stand = Stand(monkeypatch, versions, PlatformSettings())
    result = invoke(MODEL, *args)
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split())
    assert stand.published == []


def test_a_reason_is_required() -> None:
    result = invoke(MODEL)
    assert result.exit_code == 2
    assert "--reason" in result.output


@pytest.mark.integration
def test_the_rebaseline_is_on_the_control_topic_under_its_versions_key(
    monkeypatch: pytest.MonkeyPatch, kafka: KafkaConnection, topic_prefix: str
) -> None:
    from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics

    names = TopicNames(topic_prefix)
    apply_topics(
        make_admin(kafka), platform_topics(names, [MODEL], TopicSizing(requests=1, replies=1, events=1))
    )
    platform = msgspec.structs.replace(
        PlatformSettings(), kafka_bootstrap=kafka.bootstrap, topic_prefix=topic_prefix
    )
    monkeypatch.setattr(
        infra.warehouse,
        "query_warehouse",
        lambda settings, sql, **kwargs: QueryResult(
            columns=["model_version"], types=["String"], rows=[["v1"]]
        ),
    )
    monkeypatch.setattr(sluice_cli, "_settings", platform)
    result = invoke(MODEL, "--reason", "a new tenant")
    assert result.exit_code == 0, result.output
    (event,) = [e for e in read_control(kafka, names.control, "test") if isinstance(e, DriftRebaselined)]
    assert (event.model, event.version, event.reason) == (MODEL, "v1", "a new tenant")
    assert kafka_key(event) == b"rebaseline:demo-gpt:v1"


@pytest.mark.parametrize("where", ["missing-dir", "a-directory"])
def test_an_html_path_that_cannot_be_written_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, where: str
) -> None:
    """An audit: `drift report --html` into a directory that does not exist failed only after the
    warehouse was sampled and evidently had run (a minute), with a traceback."""
    stand = Stand(monkeypatch, ["v1"], PlatformSettings())
    target = tmp_path / "nowhere" / "report.html" if where == "missing-dir" else tmp_path
    result = CliRunner().invoke(
        sluice_cli.app, ["drift", "report", MODEL, "--html", str(target)], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 2, result.output
    assert ("does not exist" if where == "missing-dir" else "is a directory") in " ".join(
        result.output.split()
    )
    assert stand.queries == [], "the warehouse was asked before the path was checked"
