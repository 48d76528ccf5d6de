"""Where one client's requests spend their time in ``online.py``: the timings their terminal events carry,
read back off the results topic, beside the client's own clock."""

from __future__ import annotations

import statistics
import time
from typing import Literal

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from bus.consumer import consumer_config
from schemas.codec import decode
from schemas.events import RequestFinished
from schemas.settings import KafkaConnection

STAGES = ("edge in", "to the worker", "model", "back", "total")
BACK_SPLIT = ("back: return", "back: respond")
"""``back`` in two where the answers carried ``Server-Timing``: the terminal event's way to the edge's handler
(the worker's publish, the Kafka hop, the edge's listener thread to its event loop) and the rest (the edge's
JSON and write, the client's read)."""


def server_timing(header: str) -> dict[str, float]:
    """A ``Server-Timing`` header's durations (ms) by name; entries without one are left out."""
    out: dict[str, float] = {}
    for entry in header.split(","):
        name, _, params = entry.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur" and name:
                out[name] = float(value)
    return out


RAW_IDLE_WORKER = "raw batch 1 after idle, worker's threads"
"""The same forward alone after idle on the threads a worker gets (the floor run), as the model stage runs it."""


def where_time_goes(
    conn: KafkaConnection,
    topic: str,
    stamps: list[tuple[str, float, float]],
    model_until: Literal["finished", "first_token"],
    returns: dict[str, float] | None = None,
) -> dict[str, float]:
    """Where one client's requests spend their time, p50 of each stage in ms, from the timings their
    terminal events carry (read back from the results topic) and the client's own clock (one machine, one
    clock; ``stamps``: request id, sent, answer read): ``edge in`` (sent to the request event built at the
    edge: HTTP, auth, tokenising), ``to the worker`` (to the model starting on it: the produce, the first
    Kafka hop, the hand-off to the model thread), ``model`` (to ``model_until``: an embedding batch's
    forward to ``finished``, a completion's prefill to its ``first_token``), ``back`` (to the answer read:
    the event out of the worker, the second hop, the edge's response). ``returns``: request id -> the
    ``return`` stage of its answer's ``Server-Timing`` (ms): ``back`` is then also given in two
    (:data:`BACK_SPLIT`)."""
    wanted = {request_id: (sent, done) for request_id, sent, done in stamps if request_id}
    consumer = Consumer(consumer_config(conn, None, f"bench-where-time-goes-{model_until}"))
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in partitions])
        stages: dict[str, list[float]] = {stage: [] for stage in (*STAGES, *BACK_SPLIT)}
        found: set[str] = set()
        deadline = time.monotonic() + 30
        while len(found) < len(wanted) and time.monotonic() < deadline:
            for message in consumer.consume(1000, 0.5):
                if message.error() is not None:
                    continue
                event = decode(message.value() or b"")
                if not isinstance(event, RequestFinished) or event.request_id not in wanted:
                    continue
                timing, (sent, done) = event.timings, wanted[event.request_id]
                ended = getattr(timing, model_until)
                if timing.accepted is None or timing.started is None or ended is None:
                    continue
                found.add(event.request_id)
                accepted, started, ended_at = (
                    t.timestamp() for t in (timing.accepted, timing.started, ended)
                )
                for stage, ms in zip(
                    STAGES,
                    (accepted - sent, started - accepted, ended_at - started, done - ended_at, done - sent),
                    strict=True,
                ):
                    stages[stage].append(ms * 1000)
                if returns and event.request_id in returns:
                    back = (done - ended_at) * 1000
                    stages[BACK_SPLIT[0]].append(returns[event.request_id])
                    stages[BACK_SPLIT[1]].append(back - returns[event.request_id])
    finally:
        consumer.close()
    out = {stage: statistics.median(values) for stage, values in stages.items() if values}
    out["requests"] = float(len(found))
    return out
