"""How many workers each model runs under ``sluice up``: fixed, or scaled on the queue in Kafka.

The loop is the platform's own: observe → decide → act, with the decision on the log.

- **Observe**: a model's lag is what waits for its worker group on its request topic, end offset minus
  committed offset summed over partitions. Workers commit a request's offset only once it has finished, so
  lag counts requests queued and running: the same signal KEDA's ``ScaledObject`` scales on in
  ``infra/k8s`` (``lagThreshold`` = ``SLUICE_FLEET_TARGET_LAG``).
- **Decide** (:class:`ScalePolicy`, pure): ``ceil(lag / target_lag)`` workers within ``[min, max]``. Out at
  once and straight to that count; in one worker at a time, only after the lag has called for fewer for
  ``scale_in_after_s`` (each step waits again), so a burst's gaps never flap the fleet.
- **Act**: the decision is a ``WorkersScaled`` on the compacted control topic (key ``scale:<model>``, in the
  audit chain ``admin:scale:<model>``); the fleet reads the latest one and starts workers (a warm standby
  first: its model is loaded, it joins the group at once) or stops them (a stopping worker drains: it
  takes nothing new and finishes what runs, ``SLUICE_WORKER_DRAIN_S``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from confluent_kafka import Consumer, TopicPartition

from bus.consumer import consumer_config
from bus.placement import parse_cpus
from bus.positions import watermarks
from schemas.settings import KafkaConnection, load_settings, register
from schemas.topics import worker_group

Count = Annotated[int, msgspec.Meta(ge=1, le=64)]


@register
class FleetSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How many edges and workers ``sluice up`` runs (``SLUICE_FLEET_*``), and how workers scale."""

    fleet_edges: Count = 1
    """Edges: the first in the ``sluice up`` process on ``SLUICE_EDGE_PORT``, the others ``sluice edge``
    children on the next ports, each with its own id and replies partition."""
    fleet_workers_per_model: Count = 1
    """Workers per model (of its stable version); with autoscaling, the fewest it scales in to."""
    fleet_autoscale: bool = False
    """Scale each model's workers on its queue in Kafka between ``workers_per_model`` and ``max_workers``."""
    fleet_max_workers: Count = 4
    """The most workers per model autoscaling starts."""
    fleet_target_lag: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 50
    """Requests waiting or running that one worker is sized for (KEDA's ``lagThreshold`` in infra/k8s)."""
    fleet_scale_in_after_s: Annotated[float, msgspec.Meta(ge=0.0)] = 60.0
    """How long the queue must call for fewer workers before one stops (and again before the next)."""
    fleet_scale_interval_s: Annotated[float, msgspec.Meta(ge=0.1, le=60.0)] = 2.0
    """How often the lag is read and the fleet reconciled."""
    fleet_warm_workers: Annotated[int, msgspec.Meta(ge=0, le=8)] = 0
    """Standby workers per autoscaled model: model loaded, not in the group, joined at once on a scale-out
    (then replaced). Each costs a worker's memory; 0: a scale-out waits for a model to load."""

    fleet_worker_cpus: str = "auto"
    """Cores for the workers (``taskset -c`` syntax), the rest of the box going to the ``sluice up`` process
    (the edge) and what it starts (Kafka, the streams worker); ``auto``: the upper half of the cores it may
    use (nothing pinned on one core), ``off``: nothing pinned. A model thread sharing its core with the
    edge and Kafka waits on the run queue 10-20 % of the time (bus/placement.py, docs/perf).
    ``SLUICE_WORKER_CPUS``, when set, names the workers' cores instead."""

    def __post_init__(self) -> None:
        if self.fleet_worker_cpus not in ("auto", "off"):
            parse_cpus(self.fleet_worker_cpus)
        if not self.fleet_autoscale and self.fleet_warm_workers:
            # an audit: accepted and silently unused (a standby joins only on a scale-out)
            raise ValueError(
                f"SLUICE_FLEET_WARM_WORKERS ({self.fleet_warm_workers}) needs SLUICE_FLEET_AUTOSCALE "
                "(--autoscale): a standby joins only when autoscaling adds a worker"
            )
        if self.fleet_autoscale and self.fleet_max_workers < self.fleet_workers_per_model:
            raise ValueError(
                f"SLUICE_FLEET_MAX_WORKERS ({self.fleet_max_workers}) is below SLUICE_FLEET_WORKERS_PER_MODEL "
                f"({self.fleet_workers_per_model}), the fewest workers autoscaling keeps"
            )


def fleet_of(flags: Mapping[str, object], env: Mapping[str, str] | None = None) -> FleetSettings:
    """``sluice up``'s fleet: its flags (``fleet_*`` fields) over ``SLUICE_FLEET_*``, checked once, together.
    Checked before the flags were merged, the environment alone was judged: ``SLUICE_FLEET_WARM_WORKERS=2``
    with ``--autoscale`` was refused (a review)."""
    merged = {**(os.environ if env is None else env)}
    merged.update({f"SLUICE_{name.upper()}": str(value).lower() for name, value in flags.items()})
    return load_settings(FleetSettings, merged)


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    previous: int
    reason: str


@dataclass(slots=True)
class ScalePolicy:
    """The decision for one model, from its lag and the workers it has (pure: ``now`` is given)."""

    min_workers: int
    max_workers: int
    target_lag: int
    scale_in_after_s: float
    _below_since: dict[str, float] = field(default_factory=dict)

    def wanted(self, lag: int, partitions: int | None = None) -> int:
        """Workers for ``lag``, within the bounds and, past ``min_workers``, no more than ``partitions``, the
        topic's partitions that hold the lag: a worker past them gets no queued request, and holds its model
        in memory doing nothing (audits: a lag of 2,000 started 12 workers on 6 partitions; one tenant's lag,
        all on one partition since requests are keyed by tenant, started a second worker that only took
        that partition over). KEDA's ``limitToPartitionsWithLag``."""
        ceiling = self.max_workers if partitions is None else min(self.max_workers, partitions)
        return min(max(ceiling, self.min_workers), max(self.min_workers, math.ceil(lag / self.target_lag)))

    def decide(
        self, model: str, current: int, lag: int, now: float, partitions: int | None = None
    ) -> Decision | None:
        """The new worker count when it changes now, else None (``partitions``: the request topic's that
        hold the lag)."""
        wanted = self.wanted(lag, partitions)
        if current < self.min_workers or current > self.max_workers:  # bounds changed since the last run
            self._below_since.pop(model, None)
            bounded = min(self.max_workers, max(self.min_workers, current))
            return Decision(bounded, current, f"bounds are {self.min_workers}..{self.max_workers}")
        if wanted > current:
            self._below_since.pop(model, None)
            return Decision(wanted, current, f"lag {lag} over {current} x {self.target_lag}")
        if wanted == current:
            self._below_since.pop(model, None)
            return None
        since = self._below_since.setdefault(model, now)
        if now - since < self.scale_in_after_s:
            return None
        self._below_since[model] = now  # the next step down waits a whole period again
        return Decision(
            current - 1,
            current,
            f"lag {lag} has needed {wanted} for {self.scale_in_after_s:.0f}s",
        )


class GroupLag:
    """Lag of worker groups on their request topics, read every interval through one long-lived client
    per group (it never joins the group: it only reads the group's committed offsets)."""

    def __init__(self, kafka: KafkaConnection) -> None:
        self._kafka = kafka
        self._consumers: dict[str, Consumer] = {}
        self.lagging: dict[str, int] = {}
        """topic -> its partitions that had lag, as of the last read of its lag."""

    def __call__(self, topic: str, model: str, version: str | None) -> int:
        """Records of ``topic`` not yet committed by the worker group of ``model``'s ``version``: queued and
        running requests (a partition the group never committed counts from its first record)."""
        group = worker_group(model, version)
        consumer = self._consumers.get(group)
        if consumer is None:
            consumer = Consumer(consumer_config(self._kafka, group, "sluice-autoscaler"))
            self._consumers[group] = consumer
        meta = consumer.list_topics(topic, timeout=10).topics[topic]
        tps = [TopicPartition(topic, p) for p in meta.partitions]
        committed = {tp.partition: tp.offset for tp in consumer.committed(tps, timeout=10)}
        lags = []
        for partition in meta.partitions:
            low, high = watermarks(consumer, topic, partition)
            at = committed.get(partition, -1)
            # a committed offset retention has passed counts from the first record left (a review: the
            # records aged out counted as lag, scaling a quiet model out)
            lags.append(max(0, high - max(at, low)))
        self.lagging[topic] = sum(1 for lag in lags if lag > 0)
        return sum(lags)

    def keep(self, groups: set[str]) -> None:
        """Close the clients of groups not in ``groups`` (a version no longer stable): one client was kept
        per version ever stable, for as long as the fleet ran (a review)."""
        for group in [group for group in self._consumers if group not in groups]:
            self._consumers.pop(group).close()

    def close(self) -> None:
        for consumer in self._consumers.values():
            consumer.close()
        self._consumers.clear()
