"""Topic names, and nothing else: partitions, retention and compaction belong to ``infra/``."""

from __future__ import annotations

import re

import msgspec

_NAME = re.compile(r"^[a-zA-Z0-9._-]+$")
_MAX_TOPIC_LENGTH = 249  # Kafka's limit


def _check(kind: str, value: str) -> str:
    if not _NAME.fullmatch(value):
        raise ValueError(f"{kind} {value!r} may contain only letters, digits, '.', '_' and '-'")
    return value


class TopicNames(msgspec.Struct, frozen=True):
    """The platform's topics under one prefix (``PlatformSettings.topic_prefix``)."""

    prefix: str

    def __post_init__(self) -> None:
        _check("topic prefix", self.prefix)

    def _name(self, suffix: str) -> str:
        name = f"{self.prefix}.{suffix}"
        if len(name) > _MAX_TOPIC_LENGTH:
            raise ValueError(f"topic name longer than {_MAX_TOPIC_LENGTH} characters: {name!r}")
        return name

    def requests(self, model: str) -> str:
        """Requests for one model; its workers form one consumer group on it."""
        return self._name(f"requests.{_check('model id', model)}")

    @property
    def requests_prefix(self) -> str:
        """What every request topic's name starts with (to find the topics of all models ever served)."""
        return self._name("requests.")

    @property
    def replies(self) -> str:
        """Token chunks and terminal events, routed to the edge partition that holds the client."""
        return self._name("replies")

    @property
    def results(self) -> str:
        """Terminal events, for downstream systems."""
        return self._name("results")

    @property
    def cancels(self) -> str:
        return self._name("cancels")

    @property
    def control(self) -> str:
        """Latest state per key: deployments, budget states, burn-rate alerts."""
        return self._name("control")

    @property
    def usage(self) -> str:
        return self._name("usage")

    @property
    def audit(self) -> str:
        return self._name("audit")

    @property
    def drift(self) -> str:
        return self._name("drift")

    @property
    def deadletter(self) -> str:
        return self._name("deadletter")

    @property
    def quota(self) -> str:
        """What each edge admitted per tenant and model lately: limits hold across edges."""
        return self._name("quota")

    @property
    def idempotency(self) -> str:
        """Idempotency keys claimed by any edge (the first claim of a key wins)."""
        return self._name("idempotency")

    @property
    def batches(self) -> str:
        """The latest state of every async batch (compacted; key ``batch:<id>``)."""
        return self._name("batches")

    def shared(self) -> tuple[str, ...]:
        """Every topic that is not per model."""
        return (
            self.replies,
            self.results,
            self.cancels,
            self.control,
            self.usage,
            self.audit,
            self.drift,
            self.deadletter,
            self.quota,
            self.idempotency,
            self.batches,
        )


def worker_group(model_id: str, version: str | None) -> str:
    """The consumer group of a model version's workers (what a lag-based autoscaler watches)."""
    return f"sluice-workers.{model_id}" + (f".{version}" if version else "")
