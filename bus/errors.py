"""The one exception root of ``bus``."""

from __future__ import annotations

from confluent_kafka import KafkaError, KafkaException


class BusError(RuntimeError):
    """Talking to Kafka failed. ``retriable`` says whether the same call may succeed later."""

    def __init__(self, message: str, *, retriable: bool = False) -> None:
        super().__init__(message)
        self.retriable = retriable


def kafka_reason(exc: KafkaException) -> str:
    """librdkafka's own words for ``exc`` (``Failed to get metadata: ...``), not ``KafkaError{code=...}``."""
    err = exc.args[0] if exc.args else None
    return err.str() if isinstance(err, KafkaError) else str(exc)
