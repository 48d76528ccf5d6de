"""Every topic the platform uses, as code, and an idempotent ``apply`` that makes a cluster match it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import msgspec
from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)

from infra.errors import InfraError
from schemas.codec import TOPIC_MAX_MESSAGE_BYTES
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames

HOUR_MS = 60 * 60 * 1000
DAY_MS = 24 * HOUR_MS


class TopicSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    partitions: int
    config: dict[str, str]
    purpose: str
    replication: int = 1
    """Replicas of each partition, set when the topic is created (changing it later is a reassignment)."""


class TopicChange(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    action: Literal["created", "partitions increased", "config changed", "unchanged"]
    detail: str = ""


class TopicSpecError(InfraError):
    """The cluster differs from the spec in a way ``apply`` cannot fix."""


class TopicSizing(msgspec.Struct, frozen=True, kw_only=True):
    """Partition counts (requests: one per worker a model may scale to; replies: one per edge instance) and
    the replication factor (``SLUICE_KAFKA_REPLICATION_FACTOR``; with 2 or more, every topic also asks
    ``min.insync.replicas`` = replication - 1, so an ``acks=all`` write survives one broker's loss)."""

    requests: int = 6
    replies: int = 8
    events: int = 6
    replication: int = 1


def platform_topics(
    names: TopicNames, models: Sequence[str], sizing: TopicSizing | None = None
) -> list[TopicSpec]:
    """The full catalogue, in a stable order."""
    size = sizing or TopicSizing()
    delete = {"cleanup.policy": "delete"}

    def retained(days: float) -> dict[str, str]:
        return {**delete, "retention.ms": str(int(days * DAY_MS))}

    specs = [
        TopicSpec(
            name=names.requests(model),
            partitions=size.requests,
            config=retained(7),
            purpose=f"accepted requests for {model}; key = tenant (salted for hot tenants)",
        )
        for model in models
    ]
    specs += [
        TopicSpec(
            name=names.replies,
            partitions=size.replies,
            config=retained(1),
            purpose="token chunks + terminal events; partition = the edge that holds the client",
        ),
        TopicSpec(
            name=names.results,
            partitions=size.events,
            config=retained(7),
            purpose="terminal results for downstream consumers; key = tenant",
        ),
        TopicSpec(
            name=names.cancels,
            partitions=size.events,
            config=retained(1),
            purpose="cancel requests (client disconnect or cancel frame); key = tenant",
        ),
        TopicSpec(
            name=names.control,
            partitions=1,
            config={"cleanup.policy": "compact", "min.compaction.lag.ms": "0", "segment.ms": str(DAY_MS)},
            purpose="latest budget, deployment and burn-rate state; compacted by key",
        ),
        TopicSpec(
            name=names.usage,
            partitions=size.events,
            config=retained(30),
            purpose="usage and cost records; key = tenant",
        ),
        TopicSpec(
            name=names.audit,
            partitions=size.events,
            config=retained(365),
            purpose="append-only audit entries; key = tenant (hash chain per tenant)",
        ),
        TopicSpec(
            name=names.drift, partitions=1, config=retained(30), purpose="drift and data-quality reports"
        ),
        TopicSpec(
            name=names.deadletter,
            partitions=1,
            config=retained(14),
            purpose="events no consumer could decode, with the reason",
        ),
        TopicSpec(
            name=names.quota,
            partitions=1,
            config={**delete, "retention.ms": str(HOUR_MS)},
            purpose="each edge's admitted requests and tokens per tenant and model (shared limits)",
        ),
        TopicSpec(
            name=names.idempotency,
            partitions=size.events,
            config={
                "cleanup.policy": "compact,delete",
                "retention.ms": str(DAY_MS),
                "min.compaction.lag.ms": "0",
            },
            purpose="idempotency keys claimed by edges, 24 h; key = tenant + key hash (first claim wins)",
        ),
        TopicSpec(
            name=names.batches,
            partitions=size.events,
            config={"cleanup.policy": "compact", "min.compaction.lag.ms": "0", "segment.ms": str(DAY_MS)},
            purpose="latest state of every async batch (status, progress, files); key = batch:<id>",
        ),
    ]
    # One record limit on every topic, above the broker's default (1 MB): a terminal event of 2,048 vectors,
    # or a request of that many inputs, is one record (schemas.codec.TOPIC_MAX_MESSAGE_BYTES).
    sized = {"max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES)}
    if size.replication > 1:
        sized["min.insync.replicas"] = str(size.replication - 1)
    return [
        msgspec.structs.replace(spec, replication=size.replication, config={**spec.config, **sized})
        for spec in specs
    ]


def topics_of(settings: PlatformSettings) -> list[TopicSpec]:
    """The catalogue for a platform's settings: its prefix, its models, its replication factor."""
    sizing = TopicSizing(replication=settings.kafka_replication_factor)
    return platform_topics(TopicNames(settings.topic_prefix), settings.served_models(), sizing)


def apply_topics(admin: AdminClient, specs: Iterable[TopicSpec], timeout: float = 30.0) -> list[TopicChange]:
    """Create missing topics, grow partitions and set configs; report what happened to each topic.

    Raises TopicSpecError (before changing anything) when a topic has more partitions than its spec asks:
    Kafka cannot shrink a topic.
    """
    specs = list(specs)
    listed = _listed(admin, timeout)
    counts = {name: len(meta.partitions) for name, meta in listed.items()}
    for spec in specs:
        if counts.get(spec.name, 0) > spec.partitions:
            raise TopicSpecError(
                f"topic {spec.name} has {counts[spec.name]} partitions but the spec asks for "
                f"{spec.partitions}; Kafka cannot remove partitions. Raise the spec to at least "
                f"{counts[spec.name]}, or delete and recreate the topic."
            )
        replicas = _replication(listed.get(spec.name))
        if replicas is not None and replicas < spec.replication:
            # A review: apply set min.insync.replicas for the new factor on topics still at the old one
            # (every acks=all produce refused), and said the cluster matched the spec.
            raise TopicSpecError(
                f"topic {spec.name} has {replicas} replica(s) but the spec asks for {spec.replication} "
                "(SLUICE_KAFKA_REPLICATION_FACTOR); apply does not move partitions between brokers: raise it "
                "with Kafka's partition reassignment (kafka-reassign-partitions.sh), then apply again"
            )
    missing = [s for s in specs if s.name not in counts]
    created = _create(admin, missing, timeout)
    if missing:
        counts = _wait_visible(admin, [s.name for s in missing], timeout)
    changes = {
        name: TopicChange(name=name, action="created", detail=detail) for name, detail in created.items()
    }
    present = [s for s in specs if s.name not in created]
    drifted = _config_drift(admin, present, timeout)
    for spec in present:
        changes[spec.name] = _reconcile(admin, spec, counts[spec.name], drifted.get(spec.name, {}))
    _wait_applied(admin, [s for s in present if changes[s.name].action != "unchanged"], timeout)
    return [changes[s.name] for s in specs]


def _wait_applied(admin: AdminClient, specs: Sequence[TopicSpec], timeout: float) -> None:
    """Wait until each changed topic reads back as its spec: KRaft brokers apply an accepted change
    from the metadata log a moment later, and a describe in between still shows the old value."""
    deadline = time.monotonic() + timeout
    while specs:
        counts = _partition_counts(admin, timeout)
        drifted = _config_drift(admin, specs, timeout)
        specs = [s for s in specs if s.name in drifted or counts.get(s.name, 0) < s.partitions]
        if not specs:
            return
        if time.monotonic() > deadline:
            raise InfraError(f"topics {[s.name for s in specs]} were changed but never read back as changed")
        time.sleep(0.05)


def _create(admin: AdminClient, specs: Sequence[TopicSpec], timeout: float) -> dict[str, str]:
    """Create ``specs``; return name -> detail of those this call created (a concurrent creator may win)."""
    if not specs:
        return {}
    futures = admin.create_topics(
        [
            NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication, config=s.config)
            for s in specs
        ],
        operation_timeout=timeout,
    )
    created = {}
    for spec in specs:
        try:
            futures[spec.name].result()
        except KafkaException as exc:
            code = exc.args[0].code()
            if code == KafkaError.INVALID_REPLICATION_FACTOR:  # the cluster answered: fewer brokers
                raise TopicSpecError(
                    f"creating {spec.name} failed: {exc.args[0].str()}: the cluster has fewer brokers than "
                    f"its {spec.replication} replicas (SLUICE_KAFKA_REPLICATION_FACTOR)"
                ) from exc
            if code != KafkaError.TOPIC_ALREADY_EXISTS:
                raise InfraError(f"creating {spec.name} failed: {exc.args[0]}") from exc
            continue  # the broker's metadata lagged a creation: reconciled as present below
        created[spec.name] = f"{spec.partitions} partitions"
    return created


def _reconcile(admin: AdminClient, spec: TopicSpec, have: int, drift: dict[str, str]) -> TopicChange:
    detail: list[str] = []
    if have < spec.partitions:
        _result(
            admin.create_partitions([NewPartitions(spec.name, spec.partitions)])[spec.name],
            f"growing {spec.name}",
        )
        detail.append(f"partitions {have} -> {spec.partitions}")
    if drift:
        entries = [
            ConfigEntry(key, spec.config[key], incremental_operation=AlterConfigOpType.SET)
            for key in sorted(drift)
        ]
        resource = ConfigResource(ConfigResource.Type.TOPIC, spec.name, incremental_configs=entries)
        _result(admin.incremental_alter_configs([resource])[resource], f"configuring {spec.name}")
        detail += [f"{key}: {old} -> {spec.config[key]}" for key, old in sorted(drift.items())]
    if not detail:
        return TopicChange(name=spec.name, action="unchanged")
    action: Literal["partitions increased", "config changed"] = (
        "partitions increased" if have < spec.partitions else "config changed"
    )
    return TopicChange(name=spec.name, action=action, detail="; ".join(detail))


def _partition_counts(admin: AdminClient, timeout: float, *, led: bool = False) -> dict[str, int]:
    """name -> partitions; with ``led``, only topics whose every partition has a leader (usable now)."""
    return {
        name: len(meta.partitions)
        for name, meta in _listed(admin, timeout).items()
        if not led or all(p.leader >= 0 for p in meta.partitions.values())
    }


def _replication(meta: Any) -> int | None:
    """A listed topic's replication factor (its least replicated partition's), None when not listed."""
    if meta is None or not meta.partitions:
        return None
    return min(len(p.replicas) for p in meta.partitions.values())


def _listed(admin: AdminClient, timeout: float) -> dict[str, Any]:
    """The cluster's topics' metadata (:class:`InfraError` when the cluster does not answer)."""
    try:
        return dict(admin.list_topics(timeout=timeout).topics)
    except KafkaException as exc:
        raise InfraError(f"listing the topics failed: {exc.args[0]}") from exc


def _wait_visible(admin: AdminClient, names: Sequence[str], timeout: float) -> dict[str, int]:
    """Wait until every topic in ``names`` is listed with a leader for each partition; return all counts."""
    deadline = time.monotonic() + timeout
    while True:
        counts = _partition_counts(admin, timeout, led=True)
        if all(name in counts for name in names):
            return counts
        if time.monotonic() > deadline:
            raise InfraError(
                f"topics {sorted(set(names) - set(counts))} were created but never became visible"
            )
        time.sleep(0.05)


def _config_drift(
    admin: AdminClient, specs: Sequence[TopicSpec], timeout: float
) -> dict[str, dict[str, str]]:
    """topic -> {key: current value} for each spec'd key whose value differs."""
    if not specs:
        return {}
    resources = [ConfigResource(ConfigResource.Type.TOPIC, s.name) for s in specs]
    futures = admin.describe_configs(resources, request_timeout=timeout)
    drift: dict[str, dict[str, str]] = {}
    for spec, resource in zip(specs, resources, strict=True):
        current = _result(futures[resource], f"describing {spec.name}")
        wrong = {
            key: (current[key].value or "") if key in current else ""
            for key, want in spec.config.items()
            if key not in current or current[key].value != want
        }
        if wrong:
            drift[spec.name] = wrong
    return drift


def _result(future: object, what: str) -> dict[str, ConfigEntry]:
    try:
        return future.result()  # type: ignore[attr-defined,no-any-return]
    except KafkaException as exc:
        raise InfraError(f"{what} failed: {exc.args[0]}") from exc


def describe_topics(admin: AdminClient, prefix: str, timeout: float = 10.0) -> list[tuple[str, int]]:
    """(name, partitions) of the cluster's topics under ``prefix`` (:class:`InfraError` when the cluster
    does not answer)."""
    topics = _listed(admin, timeout)
    return sorted(
        (name, len(meta.partitions)) for name, meta in topics.items() if name.startswith(prefix + ".")
    )


def under_replicated(
    admin: AdminClient, names: Sequence[str], timeout: float = 10.0
) -> list[tuple[str, int]]:
    """(topic, partition) of each partition of ``names`` whose in-sync replicas are fewer than its
    replicas: after a broker's loss, its partitions until it is back and has caught up. A topic the
    answering broker does not know yet (just created: ``apply_topics`` waits until one broker lists it,
    and the others learn of it a moment later) is asked about again until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        futures = admin.describe_topics(TopicCollection(list(names)), request_timeout=timeout)
        lagging: list[tuple[str, int]] = []
        for name in names:
            try:
                description = futures[name].result()
            except KafkaException as exc:
                if exc.args[0].code() == KafkaError.UNKNOWN_TOPIC_OR_PART and time.monotonic() < deadline:
                    break  # not known yet where it was asked: ask again
                raise InfraError(f"describing {name} failed: {exc.args[0]}") from exc
            lagging += [(name, p.id) for p in description.partitions if len(p.isr) < len(p.replicas)]
        else:
            return sorted(lagging)
        time.sleep(0.1)


def make_admin(kafka: KafkaConnection, **overrides: Any) -> AdminClient:
    """The one way an AdminClient is made: with the connection's security keys."""
    return AdminClient(kafka.client_config(**overrides))


def quiet_admin(kafka: KafkaConnection) -> AdminClient:
    """An admin client for short-lived questions, whose librdkafka log lines stay out of the terminal: a
    Kafka that does not answer is one clear error from the caller, not a connection failure printed every
    50 ms until it gives up."""
    return make_admin(kafka, logger=_QUIET)


_QUIET = logging.getLogger("sluice.librdkafka.quiet")
_QUIET.setLevel(logging.CRITICAL)
_QUIET.propagate = False
