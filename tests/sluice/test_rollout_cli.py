"""``sluice rollout``'s planning: steps, and the checks before start / promote / abort (Kafka faked out)."""

from __future__ import annotations

import os
import re
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

import bus.positions
import infra.warehouse
import sluice.rollout
from infra.warehouse import QueryResult
from schemas.events import DeploymentChanged, Event, GateResult, RolloutGates, WorkerReady
from schemas.manifest import ModelManifest, current_model_dir, models_root, write_manifest
from schemas.settings import PlatformSettings, load_settings
from schemas.topics import worker_group
from sluice.rollout import (
    RolloutError,
    current_version,
    live_gates,
    parse_steps,
    plan_abort,
    plan_promote,
    plan_start,
)
from streams.rollout import VersionStats, advance, judge, reapply, roll_back, start_rollout

MODEL = "demo-gpt"
T0 = datetime(2025, 3, 1, 12, tzinfo=UTC)
STEPS = [0.05, 0.25, 0.5, 1.0]
GATES = RolloutGates(min_requests=20, step_min_s=30)

# --- parse_steps ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("canary", "steps", "shares"),
    [
        (10, "5,25,50,100", [0.1, 0.25, 0.5, 1.0]),  # a step below the canary is dropped
        (5, "25,50,100", [0.05, 0.25, 0.5, 1.0]),
        (5, "25,50", [0.05, 0.25, 0.5, 1.0]),  # 100 appended
        (5, "50, 25 ,,", [0.05, 0.25, 0.5, 1.0]),  # sorted, blanks ignored
        (10, "10,50,50", [0.1, 0.5, 1.0]),  # no repeats
        (5, "", [0.05, 1.0]),
        (0, "5,25,50,100", [0.0, 0.05, 0.25, 0.5, 1.0]),  # shadow only first
        (0, "", [0.0, 1.0]),
        (12.5, "33.3", [0.125, 0.333, 1.0]),
        (99.99, "100", [0.9999, 1.0]),
    ],
)
def test_parse_steps(canary: float, steps: str, shares: list[float]) -> None:
    assert parse_steps(canary, steps) == shares


@pytest.mark.parametrize(
    ("canary", "steps", "message"),
    [
        (5, "5,abc", "--steps '5,abc': expected comma-separated percentages, e.g. 5,25,50,100"),
        (5, "25;50", "expected comma-separated percentages"),
        (100, "", "--canary 100: expected a percentage from 0 (shadow only) to below 100"),
        (-1, "25", "--canary -1: expected a percentage"),
        (float("nan"), "25", "--canary nan"),
        (5, "0,50", "--steps '0,50': every step must be at least 0.01"),
        (
            5,
            "50,150",
            "every step must be at least 0.01 and at most 100 (short of 100, at most 99.99: traffic is split in "
            "10,000 buckets)",
        ),
        (5, "-5", "every step must be at least 0.01"),
        (5, "nan", "every step must be at least 0.01"),
        (5, "inf", "every step must be at least 0.01"),
        (0, "0.001,50", "every step must be at least 0.01"),  # an audit: a step that routes nothing
        (0.001, "50", "--canary 0.001: routes nothing (traffic is split in 10,000 buckets)"),
        # found by review: a step short of 100 that rounds to every bucket left the stable version no
        # request to compare with, and the rollout waited at that step for good
        (5, "50,99.996", "--steps '50,99.996': every step must be at least 0.01 and at most 100"),
        (99.996, "", "--canary 99.996: routes every request"),
    ],
)
def test_parse_steps_rejects(canary: float, steps: str, message: str) -> None:
    with pytest.raises(RolloutError, match=message.replace("(", r"\(").replace(")", r"\)")) as caught:
        parse_steps(canary, steps)
    assert isinstance(caught.value, ValueError)  # the CLI's usage-error root


# --- plan_start / plan_promote / plan_abort ---------------------------------------------------------------


@pytest.fixture
def platform(tmp_path: Path) -> PlatformSettings:
    """A cache dir holding demo-gpt v1 (current, with a manifest), v2 and v3."""
    settings = load_settings(
        PlatformSettings, {"SLUICE_CACHE_DIR": str(tmp_path), "SLUICE_MODEL_PATHS": "extra-model=/nowhere"}
    )
    root = models_root(settings.cache_dir) / MODEL
    for model, version in ((MODEL, "v1"), (MODEL, "v2"), (MODEL, "v3"), ("extra-model", "e2")):
        directory = models_root(settings.cache_dir) / model / version
        directory.mkdir(parents=True)
        write_manifest(
            directory, ModelManifest(model_id=model, task="generation", version=version, max_context=128)
        )
    os.symlink(root / "v1", current_model_dir(settings.cache_dir, MODEL))
    return settings


class Log:
    """Stands in for the compacted control topic: the latest deployment per model."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.latest: dict[str, DeploymentChanged] = {}
        self.asked: list[str] = []
        self.ready: list[WorkerReady] = []
        """The workers' readiness announcements on the topic, in log order."""
        monkeypatch.setattr(sluice.rollout, "deployment_of", self.deployment_of)
        monkeypatch.setattr(sluice.rollout, "read_control", self.read_control)

    def read_control(self, kafka: object, topic: str, client_id: str) -> list[Event]:
        return [*self.latest.values(), *self.ready]

    def deployment_of(self, platform: PlatformSettings, model: str) -> DeploymentChanged | None:
        self.asked.append(model)
        return self.latest.get(model)


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> Log:
    return Log(monkeypatch)


def warming(stable: str = "v1", candidate: str = "v2", *, now: datetime = T0) -> DeploymentChanged:
    """A rollout just started (its candidate's workers loading)."""
    return start_rollout(
        MODEL,
        stable=stable,
        candidate=candidate,
        steps=STEPS,
        shadow=0.1,
        gates=GATES,
        now=now,
        source="sluice/cli",
    )


def rollout(stable: str = "v1", candidate: str = "v2", *, now: datetime = T0) -> DeploymentChanged:
    """A rollout at its first step (a worker of the candidate said it is ready)."""
    return advance(warming(stable, candidate, now=now), now, "ready", [], "controller")


def start(platform: PlatformSettings, version: str, model: str = MODEL) -> DeploymentChanged:
    return plan_start(platform, model, version, steps=STEPS, shadow=0.1, gates=GATES, now=T0)


def test_the_fixture_reads_the_cache_dir_from_the_environment(
    platform: PlatformSettings, tmp_path: Path
) -> None:
    assert platform.cache_dir == str(tmp_path)
    assert current_version(platform, MODEL) == "v1"


def test_current_version_without_a_prepared_model(tmp_path: Path) -> None:
    settings = msgspec.structs.replace(PlatformSettings(), cache_dir=str(tmp_path))
    with pytest.raises(RolloutError, match=r"demo-gpt: .*run `sluice models prepare`"):
        current_version(settings, MODEL)


def test_start_a_first_rollout_from_the_prepared_version(platform: PlatformSettings, log: Log) -> None:
    event = start(platform, "v2")
    assert log.asked == [MODEL]
    assert (event.model, event.version, event.stable, event.candidate) == (MODEL, "v2", "v1", "v2")
    assert (event.action, event.phase, event.actor, event.source) == (
        "deploy",
        "warming",
        "operator",
        "sluice/cli",
    )
    assert event.traffic == {"v1": 1.0, "v2": 0.0}  # until a worker of v2 is ready
    assert (event.steps, event.step, event.step_started, event.time) == (STEPS, 0, T0, T0)
    assert (event.shadow, event.gates) == (0.1, GATES)


def test_start_uses_the_logged_stable_version(
    platform: PlatformSettings, log: Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_manifest(platform: PlatformSettings, model: str) -> str:
        raise AssertionError("the log's stable version wins over the prepared directory")

    monkeypatch.setattr(sluice.rollout, "current_version", no_manifest)
    promoted = msgspec.structs.replace(
        rollout(), phase="promoted", stable="v2", traffic={"v2": 1.0}, action="promote"
    )
    log.latest[MODEL] = promoted
    event = start(platform, "v3")
    assert (event.stable, event.candidate) == ("v2", "v3")
    assert event.traffic == {"v2": 1.0, "v3": 0.0}


def test_start_again_after_a_rollback(platform: PlatformSettings, log: Log) -> None:
    log.latest[MODEL] = roll_back(rollout(), T0, "aborted by the operator: x", [], "operator")
    event = start(platform, "v2")
    assert (event.stable, event.candidate, event.phase) == ("v1", "v2", "warming")
    assert event.rollout_id != log.latest[MODEL].rollout_id


def test_start_defaults_to_now(platform: PlatformSettings, log: Log) -> None:
    before = datetime.now(UTC)
    event = plan_start(platform, MODEL, "v2", steps=STEPS, shadow=0.0, gates=GATES)
    assert before <= event.time <= datetime.now(UTC) + timedelta(seconds=1)
    assert event.step_started == event.time


def test_start_refuses_a_second_rollout(platform: PlatformSettings, log: Log) -> None:
    log.latest[MODEL] = rollout()
    with pytest.raises(RolloutError) as caught:
        start(platform, "v3")
    message = str(caught.value)
    assert "a rollout of demo-gpt v2 is in progress (step 1/4)" in message
    assert "`sluice rollout promote`" in message
    assert "`sluice rollout abort`" in message


def test_start_refuses_a_second_rollout_while_the_first_warms_up(
    platform: PlatformSettings, log: Log
) -> None:
    log.latest[MODEL] = warming()
    with pytest.raises(RolloutError, match=r"a rollout of demo-gpt v2 is in progress \(warming up\)"):
        start(platform, "v3")


def test_promote_gives_a_warming_rollout_its_first_step(platform: PlatformSettings, log: Log) -> None:
    log.latest[MODEL] = warming()
    event = plan_promote(platform, MODEL, to_end=False)
    assert (event.phase, event.step, event.action, event.actor) == ("canary", 0, "deploy", "operator")
    assert event.traffic == {"v1": 0.95, "v2": 0.05}
    log.ready.append(ready(log.latest[MODEL]))
    assert plan_promote(platform, MODEL, to_end=True).phase == "promoted"


def ready(current: DeploymentChanged, version: str = "v2", error: str = "") -> WorkerReady:
    """A worker of ``version`` says it is ready for ``current`` (or, with ``error``, that it cannot load)."""
    return WorkerReady(
        tenant="admin", model=MODEL, source="worker", version=version, worker="w1", deployment=current.id,
        error=error,
    )  # fmt: skip


def test_promote_all_while_warming_waits_for_a_ready_worker_of_the_candidate(
    platform: PlatformSettings, log: Log
) -> None:
    """A review: ``promote --all`` at once after ``start`` made the candidate stable, ``sluice up`` stopped
    the old stable version's worker, and demo-gpt had no worker for 9.5 s until the candidate's loaded (for
    good, had it been unable to). It is refused until a worker of the candidate is ready, or --force."""
    current = warming()
    log.latest[MODEL] = current
    refused = r"demo-gpt is warming up and no worker of v2 has said it is ready yet; .*--force"
    with pytest.raises(RolloutError, match=refused):
        plan_promote(platform, MODEL, to_end=True)
    # another version's, or one naming an earlier deployment (a worker that may be gone), is not enough
    log.ready += [ready(current, version="v3"), msgspec.structs.replace(ready(current), deployment="old")]
    with pytest.raises(RolloutError, match=refused):
        plan_promote(platform, MODEL, to_end=True)
    log.ready.append(ready(current, error="no config.json"))
    with pytest.raises(RolloutError, match=r"a worker of v2 cannot load it: no config\.json"):
        plan_promote(platform, MODEL, to_end=True)
    assert plan_promote(platform, MODEL, to_end=True, force=True).phase == "promoted"
    assert plan_promote(platform, MODEL, to_end=False).phase == "canary"  # the stable version still serves
    log.ready.append(ready(current))
    assert plan_promote(platform, MODEL, to_end=True).phase == "promoted"


def test_abort_a_warming_rollout(platform: PlatformSettings, log: Log) -> None:
    log.latest[MODEL] = warming()
    event = plan_abort(platform, MODEL, "wrong version")
    assert (event.phase, event.traffic) == ("rolled_back", {"v1": 1.0, "v2": 0.0})


def test_start_refuses_the_prepared_stable_version(platform: PlatformSettings, log: Log) -> None:
    with pytest.raises(RolloutError, match="v1 is already the stable version of demo-gpt"):
        start(platform, "v1")


def test_start_refuses_the_logged_stable_version(platform: PlatformSettings, log: Log) -> None:
    log.latest[MODEL] = msgspec.structs.replace(rollout(), phase="promoted", stable="v2", traffic={"v2": 1.0})
    with pytest.raises(RolloutError, match="v2 is already the stable version of demo-gpt"):
        start(platform, "v2")


def test_start_refuses_an_unknown_version(platform: PlatformSettings, log: Log) -> None:
    with pytest.raises(
        RolloutError, match=r"demo-gpt has no version v9: register it with `sluice models add`"
    ):
        start(platform, "v9")


def test_start_refuses_a_version_file_that_is_no_directory(platform: PlatformSettings, log: Log) -> None:
    (models_root(platform.cache_dir) / MODEL / "v4").write_text("not a model")
    with pytest.raises(RolloutError, match="has no version v4"):
        start(platform, "v4")


@pytest.mark.parametrize(
    ("version", "message"),
    [
        ("", "'' is not a version name"),
        ("current", "'current' is not a version name"),
        (".", "'.' is not a version name"),
        ("v2/", "'v2/' is not a version name"),
        ("../demo-gpt/v2", "is not a version name"),
        ("v5", "holds version v2, not v5"),
    ],
)
def test_start_refuses_a_path_that_is_not_a_registered_version(
    platform: PlatformSettings, log: Log, version: str, message: str
) -> None:
    """Found by an audit: any path that existed was taken (the model folder itself, the ``current`` link,
    ``v2/``), and a rollout published whose candidate no worker could ever announce."""
    shutil.copytree(
        models_root(platform.cache_dir) / MODEL / "v2", models_root(platform.cache_dir) / MODEL / "v5"
    )
    with pytest.raises(RolloutError, match=re.escape(message)):
        start(platform, version)


@pytest.mark.parametrize("shadow", [0.00001, 0.00004])
def test_start_refuses_a_shadow_share_that_mirrors_nothing(
    platform: PlatformSettings, log: Log, shadow: float
) -> None:
    with pytest.raises(RolloutError, match="mirrors nothing"):
        plan_start(platform, MODEL, "v2", steps=STEPS, shadow=shadow, gates=GATES, now=T0)


def test_start_refuses_a_step_deadline_shorter_than_a_step(platform: PlatformSettings, log: Log) -> None:
    short = RolloutGates(min_requests=100, step_min_s=60, step_max_s=30)
    with pytest.raises(RolloutError, match=r"--step-max-s 30 is shorter than --step-min-s 60"):
        plan_start(platform, MODEL, "v2", steps=STEPS, shadow=0.1, gates=short, now=T0)
    for step_max_s in (0.0, 60.0):  # none, or as long as the shortest step
        gates = RolloutGates(min_requests=100, step_min_s=60, step_max_s=step_max_s)
        started = plan_start(platform, MODEL, "v2", steps=STEPS, shadow=0.1, gates=gates, now=T0)
        assert started.gates == gates


def test_start_refuses_an_unserved_model(platform: PlatformSettings, log: Log) -> None:
    with pytest.raises(
        RolloutError, match=r"gone-model is not served \(SLUICE_MODELS / SLUICE_MODEL_PATHS\)"
    ):
        start(platform, "v2", model="gone-model")
    assert log.asked == []


def test_start_a_model_served_from_model_paths(
    platform: PlatformSettings, log: Log, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sluice.rollout, "current_version", lambda platform, model: "e1")
    event = start(platform, "e2", model="extra-model")
    assert (event.model, event.stable, event.candidate) == ("extra-model", "e1", "e2")


def test_start_refuses_a_rollout_that_can_never_see_a_request(platform: PlatformSettings, log: Log) -> None:
    with pytest.raises(RolloutError):
        plan_start(platform, MODEL, "v2", steps=parse_steps(0, "25,100"), shadow=0.0, gates=GATES, now=T0)


def test_promote_moves_one_step(platform: PlatformSettings, log: Log) -> None:
    current = rollout()
    log.latest[MODEL] = current
    event = plan_promote(platform, MODEL, to_end=False)
    assert (event.phase, event.step, event.action) == ("canary", 1, "promote")
    assert event.traffic == {"v1": 0.75, "v2": 0.25}
    assert (event.actor, event.source, event.rollout_id) == ("operator", "sluice/cli", current.rollout_id)
    assert event.time > current.time
    assert "promoted by the operator" in event.reason


@pytest.mark.parametrize("step", [0, 1, 2])
def test_promote_all_reaches_promoted(platform: PlatformSettings, log: Log, step: int) -> None:
    current = rollout()
    for _ in range(step):
        current = advance(current, T0, "test", [], "operator")
    log.latest[MODEL] = current
    event = plan_promote(platform, MODEL, to_end=True)
    assert event.phase == "promoted"
    assert (event.stable, event.version, event.traffic) == ("v2", "v2", {"v2": 1.0})
    assert event.shadow == 0.0
    assert event.step == len(STEPS) - 1
    assert event.actor == "operator"
    # an audit: from step 1 it said "after step 2", a step that never ran
    assert event.reason == f"promoted to 100% after step {step + 1}: promoted by the operator"


def test_promote_all_while_warming_says_so(platform: PlatformSettings, log: Log) -> None:
    log.latest[MODEL] = warming("v1", "v2", now=T0)
    log.ready.append(ready(log.latest[MODEL]))
    assert plan_promote(platform, MODEL, to_end=True).reason == (
        "promoted to 100% while warming up: promoted by the operator"
    )


def test_abort_rolls_back_with_the_reason(platform: PlatformSettings, log: Log) -> None:
    current = rollout()
    log.latest[MODEL] = advance(current, T0, "test", [], "operator")
    event = plan_abort(platform, MODEL, "p99 looks off")
    assert (event.action, event.phase) == ("rollback", "rolled_back")
    assert event.traffic == {"v1": 1.0, "v2": 0.0}
    assert event.shadow == 0.0
    assert event.reason == "aborted by the operator: p99 looks off"
    assert (event.actor, event.source, event.stable, event.version) == ("operator", "sluice/cli", "v1", "v2")


@pytest.mark.parametrize("phase", [None, "promoted", "rolled_back", "stable"])
def test_promote_and_abort_need_a_rollout_in_progress(
    platform: PlatformSettings, log: Log, phase: str | None
) -> None:
    if phase is not None:
        log.latest[MODEL] = msgspec.structs.replace(rollout(), phase=phase)
    expected = r"no rollout of demo-gpt is in progress \(see `sluice rollout status`\)"
    with pytest.raises(RolloutError, match=expected):
        plan_promote(platform, MODEL, to_end=True)
    with pytest.raises(RolloutError, match=expected):
        plan_abort(platform, MODEL, "why")


# --- live_gates -------------------------------------------------------------------------------------------


def test_live_gates_compute_what_the_controller_computes(
    platform: PlatformSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    current = rollout(now=T0)
    queries: list[str] = []
    stat_columns = [
        "model_version",
        "n",
        "errors",
        "ttft_p99",
        "ttft_n",
        "itl_p99",
        "itl_n",
        "tokens",
        "cost_nanos",
    ]

    def query(settings: PlatformSettings, sql: str) -> QueryResult:
        queries.append(sql)
        if "FROM request_facts" in sql:
            return QueryResult(
                columns=stat_columns,
                types=["String"] * len(stat_columns),
                rows=[
                    ["v1", 100, 1, 100.0, 100, 20.0, 100, 1000, 1_000_000_000],
                    ["v2", 100, 2, 300.0, 100, None, 0, 1000, 1_000_000_000],
                ],
            )
        raise AssertionError(f"unexpected query: {sql}")

    monkeypatch.setattr(infra.warehouse, "query_warehouse", query)
    groups: list[str] = []

    def members(admin: object, group: str) -> int:
        groups.append(group)
        return 2

    monkeypatch.setattr(bus.positions, "group_members", members)
    results = live_gates(platform, current)
    assert len(queries) == 1  # the TTFT gate fails: the drift gate is not tested (it would not decide)
    assert "burn" not in {r.gate for r in results}
    expected = judge(
        msgspec.structs.replace(GATES, burn=False),  # the burn gate is the controller's alone
        VersionStats(
            n=100, errors=2, ttft_p99_ms=300.0, itl_p99_ms=None, tokens=1000, cost_nanos=10**9, ttft_n=100
        ),
        VersionStats(
            n=100,
            errors=1,
            ttft_p99_ms=100.0,
            itl_p99_ms=20.0,
            tokens=1000,
            cost_nanos=10**9,
            ttft_n=100,
            itl_n=100,
        ),
    )
    serving = GateResult(gate="serving", state="pass", candidate=2.0, detail="2 worker(s)")
    assert results == [*expected, serving]
    assert [r.state for r in results] == [
        "pass",
        "fail",
        "insufficient_data",
        "pass",
        "insufficient_data",
        "pass",
    ]
    assert groups == [worker_group(MODEL, "v2")]
    # the burn gate as the controller's last decision judged it (an audit: it was never shown)
    burn = GateResult(
        gate="burn", state="pass", candidate=15.2, limit=14.4, detail="availability 1h/5m burn 15.2"
    )
    judged = msgspec.structs.replace(current, evidence=[burn])
    assert live_gates(platform, judged)[-2:] == [burn, serving]


def test_live_gates_of_a_step_dated_ahead_read_from_now(
    platform: PlatformSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit: a step whose decider's clock was an hour ahead showed 0/0 samples for an hour
    (its window began in the future) while the controller judged the step's real requests."""
    ahead = rollout(now=datetime.now(UTC) + timedelta(hours=1))
    queries: list[str] = []

    def query(settings: PlatformSettings, sql: str) -> QueryResult:
        queries.append(sql)
        return QueryResult(columns=["model_version"], types=["String"], rows=[])

    monkeypatch.setattr(infra.warehouse, "query_warehouse", query)
    monkeypatch.setattr(bus.positions, "group_members", lambda admin, group: 1)
    before = int(datetime.now(UTC).timestamp() * 1000)
    live_gates(platform, ahead)
    (since,) = (int(m) for m in re.findall(r"accepted >= fromUnixTimestamp64Milli\((\d+)\)", queries[0]))
    assert before <= since <= int(datetime.now(UTC).timestamp() * 1000)


# --- sluice rollout status --------------------------------------------------------------------------------


def test_status_of_a_warming_rollout_says_what_it_waits_for(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import bus.control
    from sluice.cli import app

    begun = warming(now=datetime.now(UTC) - timedelta(seconds=42))
    monkeypatch.setattr(bus.control, "latest_deployments", lambda kafka, topic, client_id: {MODEL: begun})
    monkeypatch.setattr(
        infra.warehouse, "query_warehouse", lambda settings, sql: pytest.fail("no gates while warming")
    )
    result = CliRunner().invoke(
        app, ["rollout", "status", MODEL], env={"COLUMNS": "200", "SLUICE_CACHE_DIR": str(tmp_path)}
    )
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if "warming" in line)
    assert "1/" not in row  # no step has begun
    waiting = next(line for line in result.output.splitlines() if line.startswith(f"{MODEL}: waiting"))
    assert waiting.startswith(f"{MODEL}: waiting for a worker of v2 to be ready (4")  # 42 s, give or take
    assert "s of 600s; no traffic until then, rolled back after)" in waiting


def test_status_of_an_embeddings_canary_shows_the_gates_that_do_not_apply(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An embeddings model has no first token and no inter-token gap: `status` shows its TTFT gate judged
    on the end-to-end latency and its ITL gate as not applicable (not insufficient_data for ever)."""
    import bus.control
    from sluice.cli import app

    current = rollout(now=datetime.now(UTC) - timedelta(minutes=5))
    monkeypatch.setattr(bus.control, "latest_deployments", lambda kafka, topic, client_id: {MODEL: current})
    columns = ["model_version", "n", "errors", "ttft_p99", "ttft_n", "itl_p99", "itl_n", "tokens"]
    columns += ["cost_nanos", "embed_p99", "embed_n"]

    def query(settings: PlatformSettings, sql: str) -> QueryResult:
        if "AS embedding" in sql:  # the drift gate's shadow pairs: 100, alike
            pairs = [[f"r{i}", v, [1.0, float(i)]] for i in range(100) for v in ("v1", "v2")]
            return QueryResult(columns=["original", "model_version", "embedding"], types=[], rows=pairs)
        if "FROM request_facts" not in sql:
            return QueryResult(columns=["verdict", "windows", "features"], types=[], rows=[])
        rows = [
            [v, 100, 0, None, 0, None, 0, 1200, 24_000, e2e, 100] for v, e2e in (("v1", 40.0), ("v2", 45.0))
        ]
        return QueryResult(columns=columns, types=["String"] * len(columns), rows=rows)

    monkeypatch.setattr(infra.warehouse, "query_warehouse", query)
    result = CliRunner().invoke(
        app, ["rollout", "status", MODEL], env={"COLUMNS": "250", "SLUICE_CACHE_DIR": str(tmp_path)}
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    itl = next(line for line in lines if "itl_p99_ms" in line)
    assert "not_applicable" in itl
    assert "no request of either version has an inter-token gap" in itl
    assert "None" not in itl, "a value a gate does not have is '-' (an audit read None)"
    ttft = next(line for line in lines if "ttft_p99_ms" in line)
    assert "pass" in ttft
    assert "embeddings: end-to-end p99" in ttft
    drift = next(line for line in lines if line.lstrip("│ ").startswith("drift"))
    assert "pass" in drift
    assert "vectors alike (cosine median 1.0000" in drift


def test_status_of_a_canary_with_a_deadline_says_how_long_its_step_has_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import bus.control
    from infra.warehouse import WarehouseError
    from sluice.cli import app

    current = rollout(now=datetime.now(UTC) - timedelta(seconds=120))
    current = msgspec.structs.replace(current, gates=msgspec.structs.replace(GATES, step_max_s=900))
    monkeypatch.setattr(bus.control, "latest_deployments", lambda kafka, topic, client_id: {MODEL: current})

    def down(settings: PlatformSettings, sql: str) -> QueryResult:
        raise WarehouseError("the warehouse is down")

    monkeypatch.setattr(infra.warehouse, "query_warehouse", down)
    result = CliRunner().invoke(
        app, ["rollout", "status", MODEL], env={"COLUMNS": "200", "SLUICE_CACHE_DIR": str(tmp_path)}
    )
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "deadline" in line)
    assert line.startswith(f"{MODEL}: step 1 has run 12")  # 120 s, give or take
    assert line.endswith("s of its 900s deadline (still inconclusive then: rolled back)")


def test_an_evaluation_passes_with_gates_that_do_not_apply() -> None:
    from schemas.events import GateResult
    from sluice.evaluate import Evaluation

    def evaluation(*states: str) -> Evaluation:
        gates = [GateResult(gate=f"g{i}", state=state) for i, state in enumerate(states)]  # type: ignore[arg-type]
        return Evaluation("m", "v1", "v2", 100, gates, 1.0, {})

    assert evaluation("pass", "not_applicable", "pass").passed
    assert not evaluation("pass", "not_applicable", "insufficient_data").passed
    assert not evaluation("fail", "not_applicable").passed


def test_rollout_status_without_a_broker_is_one_line(tmp_path: Path) -> None:
    """Found by an audit: reading the control topic with no broker raised confluent_kafka's own
    KafkaException, which the command (catching the platform's BusError) let out as a traceback."""
    from tests.sluice.test_cli import sluice

    env = {**os.environ, "SLUICE_KAFKA_BOOTSTRAP": "127.0.0.1:1", "SLUICE_DATA_DIR": str(tmp_path)}
    result = sluice("rollout", "status", env=env)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "error: cannot read the control topic" in result.stderr


@pytest.mark.parametrize(
    "option", ["--step-min-s", "--ready-timeout-s", "--max-ttft-ratio", "--max-itl-ratio", "--max-cost-ratio"]
)
def test_a_gate_no_consumer_could_read_is_a_usage_error(option: str, tmp_path: Path) -> None:
    """Found by an audit: ``inf`` for these passed, the decision was written with ``null`` in its place,
    the CLI said "rollout started", and every consumer skipped the record it could not decode."""
    from sluice.cli import app

    result = CliRunner().invoke(
        app,
        ["rollout", "start", MODEL, "--version", "v2", option, "inf"],
        env={"COLUMNS": "200", "SLUICE_CACHE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 2, result.output
    assert "rollout started" not in result.output


def test_a_decision_that_would_not_read_back_is_not_published(
    platform: PlatformSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a check upstream lets through, ``publish`` reads the decision back first."""
    monkeypatch.setattr(sluice.rollout, "EventProducer", lambda *a, **k: pytest.fail("published"))
    unreadable = msgspec.structs.replace(
        warming(), gates=msgspec.structs.replace(GATES, step_min_s=float("inf"))
    )
    with pytest.raises(RolloutError, match="could not be read back"):
        sluice.rollout.publish(platform, unreadable)


def test_status_of_a_model_neither_served_nor_deployed_is_an_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """An audit: ``rollout status nosuch`` said "no rollouts yet" and exited 0. A review: a model the CLI's
    own SLUICE_MODELS does not list but the cluster deploys (its control topic says) is shown, not refused."""
    import bus.control
    from sluice.cli import app

    deployed = msgspec.structs.replace(warming(now=datetime.now(UTC)), model="their-model")
    monkeypatch.setattr(
        bus.control, "latest_deployments", lambda kafka, topic, client_id: {"their-model": deployed}
    )
    env = {"COLUMNS": "200", "SLUICE_CACHE_DIR": str(tmp_path), "SLUICE_MODELS": "demo-gpt"}
    unknown = CliRunner().invoke(app, ["rollout", "status", "nosuch"], env=env)
    assert unknown.exit_code == 2, unknown.output
    assert "nosuch is not served" in unknown.output
    theirs = CliRunner().invoke(app, ["rollout", "status", "their-model"], env=env)
    assert theirs.exit_code == 0, theirs.output
    assert "their-model" in theirs.output
    served = CliRunner().invoke(app, ["rollout", "status", "demo-gpt"], env=env)
    assert (served.exit_code, "no rollouts yet for demo-gpt" in served.output) == (0, True)


def test_a_decision_a_later_one_overtook_on_the_log_says_so_and_fails(
    monkeypatch: pytest.MonkeyPatch, log: Log, tmp_path: Path
) -> None:
    """An audit: ``rollout abort`` and ``rollout promote --all`` run together both said done; the promote
    was written first, the abort after it, and the abort is what served. The one overtaken now says so."""
    from sluice.cli import app

    published: list[DeploymentChanged] = []
    abort = roll_back(rollout(), T0, "aborted by the operator: race", [], "operator")

    def publish(platform: PlatformSettings, event: DeploymentChanged) -> None:
        published.append(event)
        log.latest[MODEL] = abort  # another operator's abort lands after this one

    monkeypatch.setattr(sluice.rollout, "publish", publish)
    log.latest[MODEL] = rollout()
    env = {"COLUMNS": "250", "SLUICE_CACHE_DIR": str(tmp_path)}
    result = CliRunner().invoke(app, ["rollout", "promote", MODEL, "--all"], env=env)
    assert result.exit_code == 1, result.output
    assert "superseded" in result.output
    assert "rollback -> rolled_back by operator (aborted by the operator: race)" in " ".join(
        result.output.split()
    )
    assert published[0].phase == "promoted"

    def publish_alone(platform: PlatformSettings, event: DeploymentChanged) -> None:
        log.latest[MODEL] = event

    monkeypatch.setattr(sluice.rollout, "publish", publish_alone)
    log.latest[MODEL] = rollout()
    alone = CliRunner().invoke(app, ["rollout", "promote", MODEL], env=env)
    assert alone.exit_code == 0, alone.output
    assert "superseded" not in alone.output


def test_the_command_refuses_promote_all_while_warming_unless_forced(
    monkeypatch: pytest.MonkeyPatch, log: Log, tmp_path: Path
) -> None:
    from sluice.cli import app

    def publish(platform: PlatformSettings, event: DeploymentChanged) -> None:
        log.latest[MODEL] = event

    monkeypatch.setattr(sluice.rollout, "publish", publish)
    log.latest[MODEL] = warming()
    env = {"COLUMNS": "250", "SLUICE_CACHE_DIR": str(tmp_path)}
    refused = CliRunner().invoke(app, ["rollout", "promote", MODEL, "--all"], env=env)
    assert refused.exit_code == 2, refused.output
    assert "no worker of v2 has said it is ready yet" in " ".join(refused.output.split())
    assert log.latest[MODEL].phase == "warming"
    forced = CliRunner().invoke(app, ["rollout", "promote", MODEL, "--all", "--force"], env=env)
    assert forced.exit_code == 0, forced.output
    assert log.latest[MODEL].phase == "promoted"


def test_a_start_the_controller_took_on_at_once_is_not_superseded(
    monkeypatch: pytest.MonkeyPatch, log: Log, platform: PlatformSettings
) -> None:
    """Found by review: with a worker of the candidate already running, the controller's first step
    follows the start within a second; read back after it, the start said "superseded" and exited 1,
    though the rollout had started and was going on. A later decision of another rollout, or an
    operator's, still is what it says."""
    import sluice.cli
    from sluice.cli import app

    monkeypatch.setattr(sluice.cli, "_settings", platform)  # read once per process: this test's

    def publish(platform: PlatformSettings, event: DeploymentChanged) -> None:
        log.latest[event.model] = advance(event, event.time, "v2 is ready (worker w-1)", [], "controller")

    monkeypatch.setattr(sluice.rollout, "publish", publish)
    env = {"COLUMNS": "250", "SLUICE_CACHE_DIR": platform.cache_dir}
    argv = ["rollout", "start", MODEL, "--version", "v2", "--canary", "5"]
    result = CliRunner().invoke(app, argv, env=env)
    assert result.exit_code == 0, result.output
    assert "superseded" not in result.output
    assert "since then, by the controller: deploy -> canary" in " ".join(result.output.split())

    def overtaken(platform: PlatformSettings, event: DeploymentChanged) -> None:
        log.latest[event.model] = roll_back(rollout(), T0, "aborted by the operator: race", [], "operator")

    monkeypatch.setattr(sluice.rollout, "publish", overtaken)
    log.latest.pop(MODEL)
    other = CliRunner().invoke(app, argv, env=env)
    assert other.exit_code == 1, other.output
    assert "superseded" in other.output


def test_an_abort_the_controller_published_again_is_not_superseded(
    monkeypatch: pytest.MonkeyPatch, log: Log, platform: PlatformSettings
) -> None:
    """Found by a review: the controller's step derived from the deployment before an abort landed after
    it, and the controller published the abort again (its actor, a new id); read back, the abort said
    "superseded" and exited 1, though it is what serves. A step that does overtake it still says so."""
    import sluice.cli
    from sluice.cli import app

    monkeypatch.setattr(sluice.cli, "_settings", platform)
    current = rollout()
    step = advance(current, T0 + timedelta(seconds=2), "gates passed", [], "controller")

    def publish(platform: PlatformSettings, event: DeploymentChanged) -> None:
        log.latest[MODEL] = reapply(event, step, T0 + timedelta(seconds=3))

    monkeypatch.setattr(sluice.rollout, "publish", publish)
    env = {"COLUMNS": "250", "SLUICE_CACHE_DIR": platform.cache_dir}
    log.latest[MODEL] = current
    result = CliRunner().invoke(app, ["rollout", "abort", MODEL, "--reason", "bad"], env=env)
    assert log.latest[MODEL].phase == "rolled_back"
    assert result.exit_code == 0, result.output
    assert "since then, by the controller: rollback -> rolled_back" in " ".join(result.output.split())

    def overtaken(platform: PlatformSettings, event: DeploymentChanged) -> None:
        log.latest[MODEL] = step  # the step landed after the abort, not yet published again

    monkeypatch.setattr(sluice.rollout, "publish", overtaken)
    log.latest[MODEL] = current
    raced = CliRunner().invoke(app, ["rollout", "abort", MODEL, "--reason", "bad"], env=env)
    assert raced.exit_code == 1, raced.output
    assert "superseded" in raced.output


def test_a_passing_evaluation_says_what_it_could_not_judge(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by a review: a candidate whose answers matched the stable version's on 1.4% of the logged
    requests passed `rollout evaluate` ("every gate passed", exit 0), and the drift gate rolled it back
    live. The summary says the drift and burn-rate gates judge live traffic, how often the answers
    differed, and the shadow-only start that lets them judge before any client sees the candidate."""
    import sluice.evaluate
    from sluice.cli import app
    from sluice.evaluate import Evaluation

    passed = Evaluation(
        model=MODEL,
        stable="v1",
        candidate="v2",
        requests=500,
        gates=[GateResult(gate="error_ratio", state="pass", candidate=0.0, baseline=0.0, limit=0.01)],
        same_output=0.014,
        seconds={"stable": 1.0, "candidate": 1.0},
    )
    monkeypatch.setattr(sluice.evaluate, "evaluate", lambda *args, **kwargs: passed)
    result = CliRunner().invoke(
        app,
        ["rollout", "evaluate", MODEL, "--version", "v2"],
        env={"COLUMNS": "300", "SLUICE_CACHE_DIR": str(tmp_path)},
    )
    assert result.exit_code == 0, result.output
    said = " ".join(result.output.split())
    assert "every gate passed" in said
    assert "the drift and burn-rate gates judge live traffic" in said
    assert "differed from the stable version's on 98.6% of these requests" in said
    assert f"sluice rollout start {MODEL} --version v2 --shadow 100 --canary 0" in said
