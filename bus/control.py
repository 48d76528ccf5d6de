"""The compacted ``control`` topic read to its end: the latest deployment of every model.

``DeploymentChanged`` (key ``deployment:<model>``) is the only truth of what serves. Long-running
services follow the topic with a :class:`ConsumerThread` from :func:`control_start`; one-shot readers (the
CLI, ``sluice up`` at start, the rollout controller at start) call :func:`latest_deployments`.
"""

from __future__ import annotations

from collections.abc import Iterable

from confluent_kafka import Consumer, KafkaException, TopicPartition

from bus.consumer import consumer_config
from bus.errors import BusError, kafka_reason
from bus.positions import probe_config, read_to_end, watermarks
from bus.producer import Position
from schemas.codec import DecodeError, decode
from schemas.events import DeploymentChanged, Event
from schemas.settings import KafkaConnection


def control_start(
    kafka: KafkaConnection, topic: str, client_id: str
) -> tuple[list[TopicPartition], dict[int, int]]:
    """Every partition of the control topic from offset 0, and where each ends now (what a reader must
    have seen before it knows the current state). No topic: nothing to read."""
    consumer = Consumer(probe_config(kafka, client_id))
    try:
        meta = consumer.list_topics(topic, timeout=10).topics.get(topic)
        if meta is None or meta.error is not None:
            return [], {}
        ends = {p: watermarks(consumer, topic, p)[1] for p in meta.partitions}
        return [TopicPartition(topic, p, 0) for p in meta.partitions], ends
    except KafkaException as exc:  # no broker within the timeout: the platform's own error, as elsewhere
        reason = kafka_reason(exc)
        raise BusError(
            f"cannot read {topic} from Kafka at {kafka.bootstrap}: {reason} (is it running?)"
        ) from exc
    finally:
        consumer.close()


def read_control(
    kafka: KafkaConnection,
    topic: str,
    client_id: str,
    timeout: float = 30.0,
    *,
    start: tuple[list[TopicPartition], dict[int, int]] | None = None,
) -> list[Event]:
    """Every decodable event on the control topic up to its current end (or to the ends of ``start``, a
    :func:`control_start` taken before: a reader that follows on from those same ends misses nothing), in
    offset order per partition."""
    return [event for event, _ in read_placed(kafka, topic, client_id, timeout, start=start)]


def read_placed(
    kafka: KafkaConnection,
    topic: str,
    client_id: str,
    timeout: float = 30.0,
    *,
    start: tuple[list[TopicPartition], dict[int, int]] | None = None,
) -> list[tuple[Event, Position]]:
    """:func:`read_control`, each event with its (partition, offset): its place in the log."""
    tps, ends = start if start is not None else control_start(kafka, topic, client_id)
    events: list[tuple[Event, Position]] = []
    consumer = Consumer(consumer_config(kafka, None, client_id))
    try:
        for message in read_to_end(consumer, tps, ends, timeout):
            try:
                events.append(
                    (decode(message.value() or b""), (message.partition() or 0, message.offset() or 0))
                )
            except DecodeError:
                continue  # a tombstone or junk: not state
    finally:
        consumer.close()
    return events


def latest_deployments(
    kafka: KafkaConnection,
    topic: str,
    client_id: str,
    *,
    start: tuple[list[TopicPartition], dict[int, int]] | None = None,
) -> dict[str, DeploymentChanged]:
    """model -> its latest ``DeploymentChanged`` (models never deployed through a rollout are absent), up
    to the ends of ``start`` when given (see :func:`read_control`)."""
    return deployments_in(read_control(kafka, topic, client_id, start=start))


def deployments_in(events: Iterable[Event]) -> dict[str, DeploymentChanged]:
    """model -> its latest ``DeploymentChanged`` among ``events`` (in log order)."""
    return {event.model: event for event in events if isinstance(event, DeploymentChanged)}
