"""Every topic the platform uses, as code, and an idempotent ``apply`` that makes a cluster match it."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec
from confluent_kafka import KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)

from infra.errors import InfraError
from schemas.topics import TopicNames

DAY_MS = 24 * 60 * 60 * 1000


class TopicSpec(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    partitions: int
    config: dict[str, str]
    purpose: str


class TopicChange(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    action: Literal["created", "partitions increased", "config changed", "unchanged"]
    detail: str = ""


class TopicSpecError(InfraError):
    """The cluster differs from the spec in a way ``apply`` cannot fix."""


class TopicSizing(msgspec.Struct, frozen=True, kw_only=True):
    """Partition counts. Requests: one per worker a model may scale to. Replies: one per edge instance."""

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
    ]
    return specs


def apply_topics(admin: AdminClient, specs: Iterable[TopicSpec], timeout: float = 30.0) -> list[TopicChange]:
    """Create missing topics, grow partitions and set configs; report what happened to each topic.

    Raises TopicSpecError (before changing anything) when a topic has more partitions than its spec asks:
    Kafka cannot shrink a topic.
    """
    specs = list(specs)
    existing = admin.list_topics(timeout=timeout).topics
    for spec in specs:
        if spec.name in existing and len(existing[spec.name].partitions) > spec.partitions:
            raise TopicSpecError(
                f"topic {spec.name} has {len(existing[spec.name].partitions)} partitions but the spec asks "
                f"for {spec.partitions}; Kafka cannot remove partitions. Raise the spec to at least "
                f"{len(existing[spec.name].partitions)}, or delete and recreate the topic."
            )
    changes: list[TopicChange] = []
    missing = [s for s in specs if s.name not in existing]
    if missing:
        futures = admin.create_topics(
            [
                NewTopic(s.name, num_partitions=s.partitions, replication_factor=1, config=s.config)
                for s in missing
            ],
            operation_timeout=timeout,
        )
        for spec in missing:
            _result(futures[spec.name], f"creating {spec.name}")
            changes.append(
                TopicChange(name=spec.name, action="created", detail=f"{spec.partitions} partitions")
            )
    present = [s for s in specs if s.name in existing]
    drifted = _config_drift(admin, present, timeout)
    for spec in present:
        have = len(existing[spec.name].partitions)
        detail: list[str] = []
        if have < spec.partitions:
            fut = admin.create_partitions([NewPartitions(spec.name, spec.partitions)])[spec.name]
            _result(fut, f"growing {spec.name}")
            detail.append(f"partitions {have} -> {spec.partitions}")
        if drifted.get(spec.name):
            resource = ConfigResource(
                ConfigResource.Type.TOPIC,
                spec.name,
                incremental_configs=[
                    ConfigEntry(k, spec.config[k], incremental_operation=AlterConfigOpType.SET)
                    for k in sorted(drifted[spec.name])
                ],
            )
            _result(admin.incremental_alter_configs([resource])[resource], f"configuring {spec.name}")
            detail += [f"{k}: {v} -> {spec.config[k]}" for k, v in sorted(drifted[spec.name].items())]
        if not detail:
            changes.append(TopicChange(name=spec.name, action="unchanged"))
        elif have < spec.partitions:
            changes.append(
                TopicChange(name=spec.name, action="partitions increased", detail="; ".join(detail))
            )
        else:
            changes.append(TopicChange(name=spec.name, action="config changed", detail="; ".join(detail)))
    order = {s.name: i for i, s in enumerate(specs)}
    return sorted(changes, key=lambda c: order[c.name])


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
    """(name, partitions) of the cluster's topics under ``prefix``."""
    topics = admin.list_topics(timeout=timeout).topics
    return sorted(
        (name, len(meta.partitions)) for name, meta in topics.items() if name.startswith(prefix + ".")
    )


def make_admin(bootstrap: str) -> AdminClient:
    return AdminClient({"bootstrap.servers": bootstrap})
