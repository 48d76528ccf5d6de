"""Shared fixtures: one real Kafka broker per test session (unless SLUICE_KAFKA_BOOTSTRAP names one)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from infra.kafka.broker import LocalKafka, free_port
from schemas.manifest import read_manifest, write_manifest
from schemas.settings import KafkaConnection, PlatformSettings, load_settings

SLOWEST_FIRST = (
    "tests/benchmarks/test_online_benchmark.py",
    "tests/e2e/test_scale_out.py",
    "tests/e2e/test_batches.py",
    "tests/e2e/test_streams.py",
    "tests/e2e/test_drift.py",
    "tests/sluice/test_up.py",
    "tests/infra/test_cluster.py",
    "tests/e2e/test_rollout.py",
    "tests/streams/test_audit_anchor.py",
    "tests/ingest/test_batch_job.py",
    "tests/benchmarks/test_batch_benchmark.py",
    "tests/benchmarks/test_drift_benchmark.py",
    "tests/benchmarks/test_streams_benchmark.py",
    "tests/gpu_workers/test_service.py",
)
"""The files that take longest (``--durations`` of a CI run), started first: ``scripts/test`` runs the
files on two pytest workers (``-n 2 --dist loadfile``), and a long file picked up last would leave one
worker idle while the other finishes it. Any order is correct; this one only ends sooner."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    root = Path(__file__).resolve().parent.parent

    def where(item: pytest.Item) -> int:
        return rank.get(item.path.relative_to(root).as_posix(), len(rank))

    items.sort(key=where)  # stable: the rest keep their order


@pytest.fixture(scope="session")
def platform_settings() -> PlatformSettings:
    return load_settings(PlatformSettings)


@pytest.fixture(scope="session")
def kafka(
    platform_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KafkaConnection]:
    """A broker for the whole session: an external one if configured (with its security settings), else
    our own on free ports."""
    if not platform_settings.local_kafka:
        yield platform_settings.kafka
        return
    broker = own_broker(platform_settings, tmp_path_factory.mktemp("kafka"))
    broker.start()
    try:
        yield broker.connection
    finally:
        broker.stop()


def own_broker(platform_settings: PlatformSettings, data_dir: Path) -> LocalKafka:
    """A local broker of a test's own on free ports (not started), for tests that stop or stall it; skips
    the test where ``SLUICE_KAFKA_BOOTSTRAP`` names an external cluster.

    Its JVM dies with the thread that starts it (start it from one that lives as long as the test: the
    main thread, or the event loop's executor): a pytest or xdist worker killed by a CI timeout or a
    cancelled job runs no fixture teardown, and its JVM, in a session of its own, outlived it (a review)."""
    if not platform_settings.local_kafka:
        pytest.skip("SLUICE_KAFKA_BOOTSTRAP points at an external cluster: no local broker of the test's own")
    broker = LocalKafka(
        data_dir=data_dir,
        cache_dir=platform_settings.cache_dir,
        version=platform_settings.kafka_version,
        port=free_port(),
        controller_port=free_port(),
    )
    broker.die_with_parent = True
    return broker


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka: KafkaConnection) -> str:
    """The session broker's ``host:port`` (for ``SLUICE_KAFKA_BOOTSTRAP`` in a child's environment)."""
    return kafka.bootstrap


@pytest.fixture
def topic_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix unique to the test, so tests on the shared broker never see each other's topics."""
    name = "".join(ch if ch.isalnum() else "-" for ch in request.node.name)[:40].strip("-")
    return f"t{os.getpid()}-{name}"


@pytest.fixture
def cli_env(kafka_bootstrap: str, tmp_path: Path, topic_prefix: str) -> dict[str, str]:
    """Environment for running the real ``sluice`` CLI against the session broker."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k.startswith("SLUICE_KAFKA_")
    }
    env.update(
        SLUICE_KAFKA_BOOTSTRAP=kafka_bootstrap,
        SLUICE_TOPIC_PREFIX=topic_prefix,
        SLUICE_DATA_DIR=str(tmp_path / "data"),
    )
    cache = os.environ.get("SLUICE_CACHE_DIR")
    if cache:
        env["SLUICE_CACHE_DIR"] = cache
    return env


def versioned_cache(cache: Path, model: str, stable_dir: Path, *candidates: str) -> str:
    """A model cache under ``cache`` holding ``model``'s stable version (a link to the prepared
    ``stable_dir``, also ``current``) and one copy per candidate version whose manifest names it (same
    weights, another version id). Returns the stable version."""
    from schemas.manifest import models_root

    root = models_root(cache) / model
    root.mkdir(parents=True)
    version = read_manifest(stable_dir).version
    (root / version).symlink_to(stable_dir)
    (root / "current").symlink_to(version)
    for candidate in candidates:
        add_candidate(root, stable_dir, candidate)
    return version


def versioned_platform(
    settings: PlatformSettings, kafka: KafkaConnection, prefix: str, cache: Path, model: str, stable_dir: Path,
    *candidates: str,
) -> PlatformSettings:  # fmt: skip
    """``settings`` serving ``model`` alone from a :func:`versioned_cache` under ``cache`` (its stable version
    and ``candidates``), on Kafka topics of ``prefix`` (created here)."""
    from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
    from schemas.topics import TopicNames

    versioned_cache(cache, model, stable_dir, *candidates)
    apply_topics(
        make_admin(kafka),
        platform_topics(TopicNames(prefix), [model], TopicSizing(requests=2, replies=2, events=2)),
    )
    return msgspec.structs.replace(
        settings, kafka_bootstrap=kafka.bootstrap, topic_prefix=prefix, cache_dir=str(cache), models=(model,)
    )


def add_candidate(model_root: Path, stable_dir: Path, version: str) -> str:
    """A copy of ``stable_dir`` in ``model_root`` as ``version`` (kept when it is there already); returns
    the stable version."""
    manifest = read_manifest(stable_dir)
    if not (model_root / version).exists():
        shutil.copytree(stable_dir, model_root / version)
        write_manifest(model_root / version, msgspec.structs.replace(manifest, version=version))
    return manifest.version
