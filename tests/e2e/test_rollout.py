"""Issue 10 done-when on the real platform: the edge (in-process), a worker per version (stable, a bad
candidate that fails requests by fault injection, a good candidate), a real ``sluice streams`` process
running the rollout controller, and the ``sluice rollout`` CLI.

- A bad candidate is rolled back by the controller on its own, within the documented bound once its gate
  has enough samples; every accepted request ends exactly once; stable clients never see an error; the
  decision and its evidence are in the audit chain and the warehouse.
- A good candidate is promoted step by step to 100 %, with sticky routing and shadow traffic that never
  reaches a client and is never billed; the controller is killed mid-rollout and resumes from the log.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest

from gpu_workers.models import build_demo_gpt
from gpu_workers.service import WorkerService
from gpu_workers.settings import WorkerSettings
from ingest.auth import DEMO_KEY
from schemas.events import DeploymentChanged, GenerationRequested, RequestFinished, TokenChunk, WorkerReady
from schemas.manifest import models_root, read_manifest
from schemas.settings import KafkaConnection, PlatformSettings
from tests.conftest import versioned_platform
from tests.e2e.conftest import GPT, Platform, TopicLog, started_workers
from tests.e2e.test_streams import Streams, _sluice, running_streams

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
BAD = "bad000000001"
GOOD = "good00000001"
TERSE = "terse0000001"
"""A candidate that answers every request with 2 tokens (fault injection): no error, only other answers."""
LATENCY_SLACK = ("--max-ttft-ratio", "50", "--max-itl-ratio", "50")
"""The three versions' workers share this process and 2 cores, and the candidate also runs the shadow
copies: its latencies say how the CPU was shared, not how the model is (with 4x, one stall of the box in a
step's window, a JVM starting beside this test in CI, took a candidate's ITL p99 to 834 ms against stable's
28 and rolled the good candidate back). These tests are about the
controller's decisions on errors and promotion; the latency gates' limits are tested on their own in
``tests/streams/test_rollout.py``."""
ROLLBACK_BOUND_S = 60.0
"""docs/rollout.md: a failing candidate is rolled back within this long after its gate has the samples."""


@pytest.fixture(scope="module")
def e2e_settings(
    platform_settings: PlatformSettings, kafka: KafkaConnection, tmp_path_factory: pytest.TempPathFactory
) -> PlatformSettings:
    """demo-gpt only, in a cache of its own: the stable version (linked from the shared build) plus two
    candidate copies whose manifests name other versions."""
    stable_dir = build_demo_gpt(models_root(platform_settings.cache_dir))
    cache = tmp_path_factory.mktemp("rollout-cache")
    prefix = f"e2e-rollout-{int(time.time())}"
    return versioned_platform(platform_settings, kafka, prefix, cache, GPT, stable_dir, BAD, GOOD, TERSE)


@pytest.fixture(scope="module")
def prepared_models() -> None:
    """Built by ``e2e_settings`` into the module's own cache."""


@pytest.fixture(scope="module")
def stable(e2e_settings: PlatformSettings) -> str:
    return read_manifest(models_root(e2e_settings.cache_dir) / GPT / "current").version


@pytest.fixture(scope="module")
def workers(e2e_settings: PlatformSettings, stable: str) -> Iterator[list[WorkerService]]:
    """A worker per version; the bad candidate's fails 60 % of its requests, the terse one's answers stop
    after 2 tokens (fault injection)."""
    specs = []
    for version in (stable, BAD, GOOD, TERSE):
        terse = version == TERSE
        settings = WorkerSettings(
            worker_id=f"rollout-{version}",
            worker_version=version,
            worker_flush_tokens=4,
            # Longer than any request here, even on a loaded CI box: a retiring version's request still
            # running after the grace would end twice (the residual risk in docs/rollout.md, hit once in
            # CI with 2 s). The default is 10 s.
            worker_adopt_grace_s=6.0,
            drift_sample=0,
            fault_fail_ratio=0.0 if terse else 0.6,
            fault_max_tokens=2 if terse else 0,
            fault_versions=(TERSE,) if terse else (BAD,),
        )
        specs.append((GPT, settings))
    with started_workers(e2e_settings, specs) as started:
        yield started


@pytest.fixture(scope="module")
def streams(e2e_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Streams]:
    with running_streams(
        e2e_settings,
        tmp_path_factory.mktemp("rollout") / "data",
        SLUICE_ROLLOUT_EVAL_INTERVAL_S="0.5",
        SLUICE_DRIFT_ALPHA="0.001",  # the good candidate's drift gate tests twice: a false alarm <= 0.2 %
        SLUICE_CACHE_DIR=e2e_settings.cache_dir,
        SLUICE_MODELS=GPT,
    ) as running:
        yield running


@pytest.fixture(scope="module")
async def control(e2e_settings: PlatformSettings, platform: Platform) -> AsyncIterator[TopicLog]:
    log = TopicLog(e2e_settings.kafka, platform.names.control)
    log._thread.start()
    yield log
    log._thread.stop()


@dataclass(frozen=True)
class Outcome:
    user: str
    status: int
    version: str | None
    """The response's ``system_fingerprint`` (the model version that served it); None on an error."""
    request_id: str | None


async def _ask(session: aiohttp.ClientSession, url: str, user: str) -> Outcome:
    body = {
        "model": GPT,
        "messages": [{"role": "user", "content": f"Say something about rivers, {user}."}],
        "max_tokens": 6,
    }
    async with session.post(
        f"{url}/chat/completions", json=body, headers={**AUTH, "X-Session-Id": user}
    ) as response:
        payload = await response.json()
        if response.status != 200:
            return Outcome(user, response.status, None, None)
        return Outcome(user, 200, payload["system_fingerprint"], payload["id"])


async def _load(
    session: aiohttp.ClientSession, url: str, users: list[str], *, repeat: int = 1, concurrency: int = 4
) -> list[Outcome]:
    """Each user asks ``repeat`` times in a row (a conversation); ``concurrency`` users at once."""
    gate = asyncio.Semaphore(concurrency)

    async def conversation(user: str) -> list[Outcome]:
        async with gate:
            return [await _ask(session, url, user) for _ in range(repeat)]

    return [o for outcomes in await asyncio.gather(*(conversation(u) for u in users)) for o in outcomes]


def _deployments(control: TopicLog, model: str = GPT) -> list[DeploymentChanged]:
    return [e for e in control.all() if isinstance(e, DeploymentChanged) and e.model == model]


async def _wait_edge(platform: Platform, phase: str, candidate: str | None, model: str = GPT) -> None:
    gateway = platform.edge.ctx.gateway
    for _ in range(300):
        deployment = gateway.deployment(model)
        # A rolled-back deployment still names its candidate, with no traffic: the canary one, which also
        # names it, must not pass for it (the load after a rollback was sent on the canary split once).
        if (
            deployment is not None
            and deployment.candidate == candidate
            and (deployment.share > 0 if phase == "canary" else deployment.share == 0)
        ):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the edge did not follow the deployment to {phase} {candidate}")


async def _all_ended_once(platform: Platform, within: float = 60) -> list[RequestFinished]:
    """Every request on the log has exactly one terminal event on ``results``, shadow copies included: a
    shadow copy still queued when its candidate was rolled back ends ``cancelled`` by the stable version
    after the adopt grace (docs/rollout.md)."""
    requests = [e for e in platform.requests.all() if isinstance(e, GenerationRequested)]
    ids = {r.request_id for r in requests}

    def ended() -> bool:
        done = {e.request_id for e in platform.results.all() if isinstance(e, RequestFinished)}
        return ids <= done

    await platform.results.wait(ended, within)
    every = {r.request_id for r in requests}
    finals = [e for e in platform.results.all() if isinstance(e, RequestFinished) and e.request_id in every]
    counts: dict[str, int] = {}
    for final in finals:
        counts[final.request_id] = counts.get(final.request_id, 0) + 1
    assert {rid: n for rid, n in counts.items() if n != 1} == {}, "a request ended more than once"
    return finals


async def _rows_caught_up(streams: Streams, n: int, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rows = await streams.sql("SELECT count() AS n FROM request_facts FINAL")
        if rows[0]["n"] >= n:
            return
        await asyncio.sleep(0.3)
    raise AssertionError(f"request_facts did not reach {n} rows")


@pytest.mark.timeout(300)  # its own loop allows 120 s for the rollback, and the checks follow
async def test_a_bad_candidate_is_rolled_back_by_the_controller_and_nothing_is_lost(
    platform: Platform,
    workers: list[WorkerService],
    streams: Streams,
    control: TopicLog,
    stable: str,
) -> None:
    await streams.ready()
    env = {**streams.env}
    started = _sluice(
        env, "rollout", "start", GPT, "--version", BAD, "--canary", "30", "--steps", "60",
        "--min-requests", "20", "--step-min-s", "0", "--no-drift-gate", *LATENCY_SLACK,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    await _wait_edge(platform, "canary", BAD)

    outcomes: list[Outcome] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        began = time.monotonic()
        rollback: DeploymentChanged | None = None
        while rollback is None and time.monotonic() - began < 120:
            users = [f"user-{random.randrange(10**9)}" for _ in range(24)]
            outcomes += await _load(session, platform.base_url, users)
            rollback = next((d for d in _deployments(control) if d.action == "rollback"), None)
            if rollback is None:
                await asyncio.sleep(0.5)
        assert rollback is not None, "the bad candidate was not rolled back"
        await _wait_edge(platform, "rolled_back", BAD)
        after = await _load(session, platform.base_url, [f"after-{i}" for i in range(20)])

    # the decision: automatic, with the failing gate's numbers (the error-ratio gate, or the fast burn,
    # which may act first: it needs no min_requests)
    assert rollback.actor == "controller"
    assert rollback.phase == "rolled_back"
    assert rollback.traffic == {stable: 1.0, BAD: 0.0}
    failing = {g.gate: g for g in rollback.evidence if g.state == "fail"}
    assert failing
    assert set(failing) <= {"error_ratio", "burn"}, rollback.reason
    finals = await _all_ended_once(platform)
    if "error_ratio" in failing:
        gate = failing["error_ratio"]
        assert gate.candidate_n >= 20
        assert gate.baseline_n >= 20
        assert gate.candidate is not None
        assert gate.limit is not None
        assert gate.candidate > gate.limit
        assert "error_ratio" in rollback.reason
        # within the bound once the gate had its samples (both versions at min_requests terminal events)
        by_version: dict[str, list[RequestFinished]] = {}
        for final in sorted(finals, key=lambda f: f.time):
            by_version.setdefault(final.model_version, []).append(final)
        enough_at = max(by_version[BAD][19].time, by_version[stable][19].time)
        assert (rollback.time - enough_at).total_seconds() <= ROLLBACK_BOUND_S
    else:
        assert failing["burn"].detail
        assert "burn" in rollback.reason

    # clients: errors only from the candidate; after the rollback everything is served by the stable version
    errors = [o for o in outcomes if o.status != 200]
    assert errors, "the fault injection did not fail anything: the test proves nothing"
    assert all(o.status == 200 and o.version == stable for o in after)
    failed = [f for f in finals if f.status != "completed"]
    assert {f.model_version for f in failed} == {BAD}
    assert len(errors) == len(failed)

    # the warehouse and the audit chain have the decision and its evidence
    await _rows_caught_up(streams, len(finals))
    rows = await streams.sql(
        f"SELECT count() AS n FROM request_facts FINAL WHERE model_version = '{stable}' AND status != 'completed'"
    )
    assert rows[0]["n"] == 0
    for _ in range(100):
        audit = await streams.sql(
            "SELECT action, decision, details FROM audit_log FINAL WHERE action = 'model.rollback'"
        )
        if audit:
            break
        await asyncio.sleep(0.3)
    assert len(audit) == 1
    assert audit[0]["decision"] == BAD
    stored = await streams.sql(
        f"SELECT action, phase, actor, evidence FROM deployments FINAL WHERE model = '{GPT}' ORDER BY time"
    )
    assert [(r["action"], r["phase"], r["actor"]) for r in stored] == [
        ("deploy", "warming", "operator"),
        ("deploy", "canary", "controller"),  # once the candidate's worker said it was ready
        ("rollback", "rolled_back", "controller"),
    ]
    assert json.loads(stored[-1]["evidence"]) == json.loads(msgspec.json.encode(rollback.evidence))
    evidence = json.loads(json.loads(audit[0]["details"])["evidence"])
    assert {(g["gate"], g["state"]) for g in evidence} >= {(gate, "fail") for gate in failing}
    verify = _sluice(env, "audit", "verify")
    assert verify.returncode == 0, verify.stdout + verify.stderr
    shown = _sluice(env, "rollout", "status", GPT)
    assert shown.returncode == 0, shown.stderr
    assert "rolled_back" in shown.stdout


@pytest.mark.timeout(300)  # its own loop allows 120 s for the rollback, and the checks follow
async def test_a_candidate_that_answers_differently_is_rolled_back_by_the_drift_gate(
    platform: Platform,
    workers: list[WorkerService],
    streams: Streams,
    control: TopicLog,
    stable: str,
) -> None:
    """No error, no slower: only its answers differ (2 tokens where the stable version gives 6). Every
    other gate passes; the drift gate compares its answers to shadow copies with the originals' and rolls
    it back, naming the features."""
    await streams.ready()
    env = {**streams.env}
    before = len(_deployments(control))
    started = _sluice(
        env, "rollout", "start", GPT, "--version", TERSE, "--canary", "10", "--steps", "50", "--shadow", "100",
        "--min-requests", "15", "--step-min-s", "0", "--max-cost-ratio", "50", *LATENCY_SLACK,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    assert "drift gate: at each step" in started.stdout
    await _wait_edge(platform, "canary", TERSE)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        began = time.monotonic()
        ended: DeploymentChanged | None = None
        while ended is None and time.monotonic() - began < 120:
            outcomes = await _load(
                session, platform.base_url, [f"t-{random.randrange(10**9)}" for _ in range(16)]
            )
            assert all(o.status == 200 for o in outcomes)
            decided = [d for d in _deployments(control)[before:] if d.actor == "controller"]
            ended = next((d for d in decided if d.phase in ("rolled_back", "promoted") or d.step > 0), None)
            if ended is None:
                await asyncio.sleep(0.3)
        assert ended is not None, "the terse candidate was neither rolled back nor promoted"
        await _wait_edge(platform, "rolled_back", TERSE)
    assert (ended.action, ended.phase, ended.actor) == ("rollback", "rolled_back", "controller"), ended.reason
    gates = {g.gate: g for g in ended.evidence}
    assert {g for g, r in gates.items() if r.state == "fail"} == {"drift"}, ended.reason
    assert {r.state for g, r in gates.items() if g not in ("drift", "itl_p99_ms")} == {"pass"}
    drift = gates["drift"]
    assert "completion_tokens" in drift.detail
    assert drift.candidate_n == drift.baseline_n >= 15
    assert "drift fail (answers to the same requests differ in" in ended.reason
    finals = await _all_ended_once(platform)  # clients' requests, its live ones included, ended once each
    # its shadow copies ended too: answered by the candidate, or (queued at the rollback) dropped unrun by
    # the stable version
    copies = {
        r.request_id for r in platform.requests.all()
        if isinstance(r, GenerationRequested) and r.shadow_of is not None and r.model_version == TERSE
    }  # fmt: skip
    ends = {(f.model_version, f.status) for f in finals if f.request_id in copies}
    assert copies
    assert ends <= {(TERSE, "completed"), (stable, "cancelled")}, ends


@pytest.mark.timeout(300)  # its own loop allows 180 s for the steps; the default 120 s would cut it first
async def test_a_good_candidate_is_promoted_step_by_step_across_a_controller_restart(
    platform: Platform,
    workers: list[WorkerService],
    streams: Streams,
    control: TopicLog,
    stable: str,
) -> None:
    await streams.ready()
    env = {**streams.env}
    before = len(_deployments(control))
    started = _sluice(
        env, "rollout", "start", GPT, "--version", GOOD, "--canary", "20", "--steps", "50",
        "--shadow", "50", "--min-requests", "15", "--step-min-s", "0", *LATENCY_SLACK,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    await _wait_edge(platform, "canary", GOOD)

    outcomes: list[Outcome] = []
    killed = False
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        began = time.monotonic()
        while time.monotonic() - began < 180:
            decisions = _deployments(control)[before:]
            if decisions[-1].phase == "promoted":
                break
            if not killed and decisions[-1].step == 1:
                streams.kill()  # mid-rollout: the restarted controller must resume at step 2, from the log
                streams.start()
                await streams.ready()
                killed = True
            users = [f"conv-{random.randrange(10**9)}" for _ in range(12)]
            outcomes += await _load(session, platform.base_url, users, repeat=2)
        assert killed, "the rollout never reached its second step"
        promoted = _deployments(control)[before:]
        assert promoted[-1].phase == "promoted", [d.reason for d in promoted]
        await _wait_edge(platform, "promoted", None)
        after = await _load(session, platform.base_url, [f"later-{i}" for i in range(10)])

    # warming 0 % -> 20 % once ready -> step 50 % -> promoted 100 %, once each: the restart repeated nothing
    assert [(d.action, d.phase, d.step, d.traffic.get(GOOD)) for d in promoted] == [
        ("deploy", "warming", 0, 0.0),
        ("deploy", "canary", 0, 0.2),
        ("promote", "canary", 1, 0.5),
        ("promote", "promoted", 2, 1.0),
    ]
    assert [d.actor for d in promoted] == ["operator", "controller", "controller", "controller"]
    # the drift gate compared its outputs with the stable version's (matched by tenant) at each step
    drift = [next(g for g in d.evidence if g.gate == "drift") for d in promoted[2:]]
    assert [g.state for g in drift] == ["pass", "pass"], [g.detail for g in drift]
    assert all(g.candidate_n >= 15 and g.candidate_n == g.baseline_n for g in drift)
    ready = [e for e in control.all() if isinstance(e, WorkerReady) and e.deployment == promoted[0].id]
    assert [(e.version, e.worker) for e in ready] == [(GOOD, f"rollout-{GOOD}")]
    assert promoted[1].reason.endswith(f"{GOOD} is ready (worker rollout-{GOOD})")
    assert ready[0].time <= promoted[1].time
    # nothing was routed to the candidate before its first step was on the log
    early = [
        r for r in platform.requests.all()
        if isinstance(r, GenerationRequested) and r.model_version == GOOD and r.time < promoted[1].time
    ]  # fmt: skip
    assert early == []
    assert promoted[-1].stable == GOOD
    assert all(o.status == 200 and o.version == GOOD for o in after)
    assert all(o.status == 200 for o in outcomes)

    # sticky: a conversation never moves from the candidate back to the stable version
    by_user: dict[str, list[str | None]] = {}
    for outcome in outcomes:
        by_user.setdefault(outcome.user, []).append(outcome.version)
    pairs = [v for v in by_user.values() if len(v) == 2]
    assert not [v for v in pairs if v == [GOOD, stable]]
    assert [v for v in pairs if v == [GOOD, GOOD]]
    assert [v for v in pairs if v == [stable, stable]]

    # shadow copies ran on the candidate, never reached a client, and were not billed
    finals = await _all_ended_once(platform)
    shadows = [
        r for r in platform.requests.all()
        if isinstance(r, GenerationRequested) and r.shadow_of is not None and r.time >= promoted[0].time
    ]  # fmt: skip
    assert shadows
    assert all(r.reply is None and r.model_version == GOOD for r in shadows)
    shadow_ids = {r.request_id for r in shadows}
    assert not [e for e in platform.replies.all() if e.request_id in shadow_ids]
    assert not [e for e in platform.replies.all() if isinstance(e, TokenChunk) and e.request_id in shadow_ids]
    assert {f.model_version for f in finals if f.request_id in shadow_ids} == {GOOD}
    await _rows_caught_up(streams, len(finals))
    billed = await streams.sql("SELECT sum(cost_nanos) AS spent FROM spend_day")
    charged = await streams.sql("SELECT sum(cost_nanos) AS c FROM request_facts FINAL WHERE shadow_of = ''")
    in_shadow = await streams.sql(
        f"SELECT count() AS n, sum(cost_nanos) AS c FROM request_facts FINAL WHERE shadow_of != '' AND model_version = '{GOOD}'"
    )
    assert in_shadow[0]["n"] == len(shadow_ids)
    assert in_shadow[0]["c"] > 0  # recorded for the cost gate ...
    assert billed[0]["spent"] == charged[0]["c"]  # ... and never billed
