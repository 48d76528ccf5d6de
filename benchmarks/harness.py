"""What the benchmark scripts share: a percentile and a broker for one run (run them as
``python benchmarks/<name>.py``: this directory is then on the import path)."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

from infra.kafka.broker import LocalKafka, free_port
from schemas.settings import KafkaConnection, PlatformSettings


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


@contextmanager
def kafka(settings: PlatformSettings) -> Iterator[KafkaConnection]:
    """The configured cluster, or a local broker on free ports in a temporary directory."""
    if not settings.local_kafka:
        yield settings.kafka
        return
    with tempfile.TemporaryDirectory(prefix="sluice-bench-") as tmp:
        broker = LocalKafka(
            tmp, settings.cache_dir, settings.kafka_version, port=free_port(), controller_port=free_port()
        )
        with broker:
            yield broker.connection
