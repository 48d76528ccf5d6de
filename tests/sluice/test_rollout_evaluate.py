"""``sluice rollout evaluate`` on the real broker: logged requests through the stable version and a
candidate, judged by the rollout gates, before any live traffic."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path

import msgspec
import pytest
from typer.testing import CliRunner

import sluice.evaluate as evaluate_module
from bus.producer import EventProducer
from gpu_workers.models import build_demo_gpt
from gpu_workers.settings import WorkerSettings
from schemas.codec import decode
from schemas.events import (
    BatchItemRequested,
    BatchRef,
    Event,
    GenerationRequested,
    ReplyTo,
    RolloutGates,
    SamplingParams,
    utc_now,
)
from schemas.ids import uuid7
from schemas.manifest import models_root
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from sluice.evaluate import evaluate, logged_requests, parse_duration
from sluice.rollout import RolloutError
from tests.conftest import versioned_platform

pytestmark = pytest.mark.integration
GPT = "demo-gpt"
CANDIDATE = "cand00000042"


@pytest.fixture
def platform(
    platform_settings: PlatformSettings, kafka: KafkaConnection, topic_prefix: str, tmp_path: Path
) -> PlatformSettings:
    """demo-gpt's stable version plus a candidate copy in a cache of the test's own; its topics."""
    stable_dir = build_demo_gpt(models_root(platform_settings.cache_dir))
    return versioned_platform(
        platform_settings, kafka, topic_prefix, tmp_path / "cache", GPT, stable_dir, CANDIDATE
    )


async def _log_requests(platform: PlatformSettings, n: int) -> list[GenerationRequested]:
    names = TopicNames(platform.topic_prefix)
    requests = [
        GenerationRequested(
            tenant=f"tenant-{i % 3}",
            model=GPT,
            request_id=uuid7(),
            source="test",
            model_version="whatever-was-live",
            input_ids=[5 + i % 7, 6, 7, 8, 9],
            sampling=SamplingParams(max_tokens=5, temperature=0.0),
            reply=ReplyTo(topic=names.replies, partition=0, edge_id="e"),
        )
        for i in range(n)
    ]
    shadow = msgspec.structs.replace(
        requests[0], request_id=uuid7(), reply=None, shadow_of=requests[0].request_id
    )
    with EventProducer(platform.kafka, "test-edge") as producer:
        for request in [*requests, shadow]:
            await producer.publish(names.requests(GPT), request)
    return requests


async def test_an_identical_candidate_passes_and_a_failing_one_does_not(platform: PlatformSettings) -> None:
    logged = await _log_requests(platform, 24)
    found = logged_requests(platform, GPT, logged[0].time, limit=100)
    assert [r.request_id for r in found] == [r.request_id for r in logged]  # the shadow copy is skipped
    assert len(logged_requests(platform, GPT, logged[0].time, limit=5)) == 5

    gates = RolloutGates(
        min_requests=20, drift=False, burn=False, max_ttft_p99_ratio=10, max_itl_p99_ratio=10
    )
    same = evaluate(
        platform, GPT, CANDIDATE, window=parse_duration("1h"), limit=100, gates=gates,
        worker=WorkerSettings(drift_sample=0),
    )  # fmt: skip
    assert same.requests == 24
    assert same.same_output == 1.0  # same weights, same seeds: the same answers
    assert {g.gate: g.state for g in same.gates} == {
        "error_ratio": "pass",
        "ttft_p99_ms": "pass",
        "itl_p99_ms": "pass",
        "cost_per_1k_tokens": "pass",
    }
    assert same.passed

    faulty = WorkerSettings(drift_sample=0, fault_fail_ratio=0.5, fault_versions=(CANDIDATE,))
    bad = evaluate(
        platform, GPT, CANDIDATE, window=parse_duration("1h"), limit=100, gates=gates, worker=faulty
    )
    error_ratio = {g.gate: g for g in bad.gates}["error_ratio"]
    assert error_ratio.state == "fail"
    assert error_ratio.baseline == 0.0  # the fault is scoped to the candidate's version
    assert not bad.passed
    assert bad.same_output < 1.0

    few = evaluate(
        platform, GPT, CANDIDATE, window=parse_duration("1h"), limit=10, gates=gates,
        worker=WorkerSettings(drift_sample=0),
    )  # fmt: skip
    assert {g.state for g in few.gates} == {"insufficient_data"}  # never a pass on 10 requests
    assert not few.passed


async def test_the_command_exits_1_on_a_failing_gate_and_2_on_a_bad_request(
    platform: PlatformSettings, cli_env: dict[str, str], tmp_path: Path
) -> None:
    await _log_requests(platform, 20)
    env = {
        **cli_env,
        "SLUICE_CACHE_DIR": platform.cache_dir,
        "SLUICE_MODELS": GPT,
        "SLUICE_FAULT_FAIL_RATIO": "0.5",
        "SLUICE_FAULT_VERSIONS": CANDIDATE,
        "SLUICE_DRIFT_SAMPLE": "0",
    }

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sluice", "rollout", "evaluate", GPT, *args],
            env=env, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip

    report = tmp_path / "evaluation.json"
    failing = run("--version", CANDIDATE, "--from-log", "1h", "--json", str(report))
    assert failing.returncode == 1, failing.stdout + failing.stderr
    assert "error_ratio" in failing.stdout
    assert "fail" in failing.stdout
    saved = msgspec.json.decode(report.read_bytes())
    assert saved["requests"] == 20
    assert {g["gate"]: g["state"] for g in saved["gates"]}["error_ratio"] == "fail"

    unknown = run("--version", "nosuchversion")
    assert unknown.returncode == 2
    assert "no version nosuchversion" in unknown.stderr
    bad_window = run("--version", CANDIDATE, "--from-log", "an hour")
    assert bad_window.returncode == 2
    assert "expected a duration" in bad_window.stderr


def spread(names: TopicNames, start: datetime, count: int, *, tenants: int) -> list[GenerationRequested]:
    """``count`` requests a millisecond apart from ``start``, their tenants taken in turn."""
    return [
        GenerationRequested(
            time=start + timedelta(milliseconds=i),
            tenant=f"tenant-{i % tenants}",
            model=GPT,
            request_id=uuid7(),
            source="test",
            model_version="v",
            input_ids=[5, 6, 7],
            sampling=SamplingParams(max_tokens=2, temperature=0.0),
            reply=ReplyTo(topic=names.replies, partition=0, edge_id="e"),
        )
        for i in range(count)
    ]


async def test_the_limit_takes_the_oldest_logged_requests_over_all_partitions(
    kafka: KafkaConnection, platform_settings: PlatformSettings, topic_prefix: str
) -> None:
    """A review: ``--limit 60`` stopped at the first 60 records the consumer handed back, partition after
    partition, so with requests keyed by tenant the sample was the 2 tenants of 12 on the partitions read
    first. It is the 60 oldest over all partitions; batch lines are skipped and not counted."""
    from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics

    names = TopicNames(topic_prefix)
    apply_topics(
        make_admin(kafka), platform_topics(names, [GPT], TopicSizing(requests=6, replies=2, events=2))
    )
    platform = msgspec.structs.replace(
        platform_settings, kafka_bootstrap=kafka.bootstrap, topic_prefix=topic_prefix, models=(GPT,)
    )
    start = utc_now()
    requests = spread(names, start, 600, tenants=12)  # interleaved in time, so over several partitions
    batch_line = BatchItemRequested.of(
        requests[0], BatchRef(batch_id="batch_1", custom_id="c", index=0), total=1, endpoint="/v1/completions"
    )
    with EventProducer(platform.kafka, "test-edge") as producer:
        await producer.publish(names.requests(GPT), batch_line)
        for request in requests:
            await producer.publish(names.requests(GPT), request)
    oldest = sorted(requests, key=lambda r: r.time)[:60]
    found = logged_requests(platform, GPT, oldest[0].time, limit=60)
    tenants = sorted({r.tenant for r in found})
    assert [r.request_id for r in found] == [r.request_id for r in oldest], f"tenants {tenants} of 12"
    assert all(isinstance(r, GenerationRequested) for r in found)


async def test_the_limit_reads_each_partition_only_until_it_has_given_that_many(
    kafka: KafkaConnection,
    platform_settings: PlatformSettings,
    topic_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A review: the read of the whole ``--from-log`` window ran into its 60 s timeout on a busy topic. The
    ``limit`` oldest overall are among each partition's first ``limit`` (records come in the order they
    were accepted), so a partition is read no further."""
    from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics

    names = TopicNames(topic_prefix)
    apply_topics(
        make_admin(kafka), platform_topics(names, [GPT], TopicSizing(requests=2, replies=2, events=2))
    )
    platform = msgspec.structs.replace(
        platform_settings, kafka_bootstrap=kafka.bootstrap, topic_prefix=topic_prefix, models=(GPT,)
    )
    start = utc_now()
    requests = spread(names, start, 400, tenants=6)
    with EventProducer(platform.kafka, "test-edge") as producer:
        for request in requests:
            await producer.publish(names.requests(GPT), request)
    decoded: list[bytes] = []

    def counted(value: bytes) -> Event:
        decoded.append(value)
        return decode(value)

    monkeypatch.setattr(evaluate_module, "decode", counted)
    found = logged_requests(platform, GPT, start, limit=5)
    assert [r.request_id for r in found] == [r.request_id for r in requests[:5]]
    assert len(decoded) <= 2 * 5, f"{len(decoded)} of 400 records decoded for the 5 oldest"


@pytest.mark.parametrize("logged", [6, 30])
def test_the_command_says_when_too_few_requests_were_logged(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, logged: int
) -> None:
    """A review: with 6 logged requests every gate read insufficient_data with an empty detail, and the
    summary said only "not every gate passed", not that 6 is below --min-requests 20."""
    import sluice.evaluate
    from schemas.events import GateResult
    from sluice.cli import app
    from sluice.evaluate import Evaluation

    def fake(*args: object, **kwargs: object) -> Evaluation:
        gates = [GateResult(gate=g, state="insufficient_data") for g in ("error_ratio", "ttft_p99_ms")]
        return Evaluation(
            model=GPT, stable="v1", candidate=CANDIDATE, requests=logged, gates=gates, same_output=1.0,
            seconds={"stable": 0.1, "candidate": 0.1},
        )  # fmt: skip

    monkeypatch.setattr(sluice.evaluate, "evaluate", fake)
    env = {"COLUMNS": "250", "SLUICE_CACHE_DIR": str(tmp_path)}
    args = ["rollout", "evaluate", GPT, "--version", CANDIDATE, "--min-requests", "20"]
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == 1, result.output
    says = f"{logged} logged requests < --min-requests 20"
    assert (says in result.stdout) == (logged < 20), result.stdout
    if logged < 20:
        assert (
            "not every gate passed: 6 logged requests < --min-requests 20 (widen --from-log" in result.stdout
        )


def test_durations() -> None:
    assert parse_duration("90s").total_seconds() == 90
    assert parse_duration("1.5h").total_seconds() == 5400
    with pytest.raises(RolloutError, match="expected a duration"):
        parse_duration("1 hour")
    for huge in ("1000000000d", "800000d", "1e400s"):  # an audit: an OverflowError's traceback, exit 1
        with pytest.raises(RolloutError, match=r"at most 3650 days|expected a duration"):
            parse_duration(huge)
    assert parse_duration("3650d").days == 3650
