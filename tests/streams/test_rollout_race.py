"""An operator's decision and the controller's, both derived from one deployment, on the real broker: the
streams service (in this process, on its own embedded warehouse) keeps the operator's as the log's last
word even when the controller's lands after it."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import msgspec
import pytest

from bus.control import read_control
from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from schemas.events import DeploymentChanged, RolloutGates, WorkerReady, utc_now
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from streams.rollout import roll_back, start_rollout
from streams.service import StreamsService
from streams.settings import StreamsSettings

pytestmark = pytest.mark.integration
MODEL = "demo-gpt"


@pytest.mark.timeout(180)
async def test_an_abort_that_lands_just_before_the_controllers_step_is_the_last_word(
    kafka: KafkaConnection, platform_settings: PlatformSettings, tmp_path: Path
) -> None:
    names = TopicNames(f"race-{uuid.uuid4().hex[:8]}")
    apply_topics(
        make_admin(kafka), platform_topics(names, [MODEL], TopicSizing(requests=1, replies=1, events=1))
    )
    platform = msgspec.structs.replace(
        platform_settings,
        kafka_bootstrap=kafka.bootstrap,
        topic_prefix=names.prefix,
        data_dir=str(tmp_path),
        models=(MODEL,),
    )
    operator = EventProducer(kafka, "operator")
    operator.start()
    begun = start_rollout(
        MODEL,
        stable="v1",
        candidate="v2",
        steps=[0.1, 0.5],
        shadow=0.0,
        gates=RolloutGates(),
        now=utc_now(),
        source="sluice/cli",
    )
    await operator.publish(names.control, begun)
    aborted = roll_back(begun, utc_now(), "aborted by the operator: race", [], "operator")
    settings = StreamsSettings(streams_port=0, streams_batch_ms=50, rollout_eval_interval_s=0.2)
    try:
        async with StreamsService(platform, settings) as service:
            assert service.streams is not None
            rollout = service.streams.rollout
            publish = rollout._publish

            async def the_abort_lands_first(decision: DeploymentChanged) -> tuple[int, int]:
                rollout._publish = publish
                await operator.publish(names.control, aborted)  # the sink has not brought it here yet
                return await publish(decision)

            rollout._publish = the_abort_lands_first
            ready = WorkerReady(
                tenant="",
                model=MODEL,
                source="gpu_workers/w-1",
                version="v2",
                worker="w-1",
                deployment=begun.id,
            )
            await operator.publish(names.control, ready)
            deadline = time.monotonic() + 60
            while True:
                log = [e for e in await asyncio.to_thread(read_control, kafka, names.control, "race")]
                deployments = [e for e in log if isinstance(e, DeploymentChanged)]
                if len(deployments) >= 4 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # nothing more follows
            deployments = [
                e
                for e in await asyncio.to_thread(read_control, kafka, names.control, "race")
                if isinstance(e, DeploymentChanged)
            ]
            assert service.failure is None
    finally:
        operator.stop()
    assert [(d.phase, d.actor) for d in deployments] == [
        ("warming", "operator"),
        ("rolled_back", "operator"),  # the abort, placed before the step
        ("canary", "controller"),  # the step, derived from the warming deployment before the abort
        ("rolled_back", "controller"),  # the abort again: the log's last word
    ]
    last = deployments[-1]
    assert last.traffic == aborted.traffic
    assert "the operator's rollback again" in last.reason
    assert rollout.deployments[MODEL].id == last.id
