"""Events into warehouse rows: the one place that decides what the warehouse holds.

The live streams worker and ``sluice replay`` both hand batches of consumed records to :class:`Rows` and
insert what it returns with :func:`insert`, so a replay of the log builds the same tables. Every table
is idempotent under redelivery: ``events_raw`` collapses on the event id, ``request_facts`` and
``drift_features`` on the request (latest terminal event wins), ``audit_log`` on (tenant, seq),
``drift_reports`` on (model, version, scope, window), ``batches`` on (tenant, batch id) (the highest
``seq`` wins). Prompts, completions, embeddings and token ids are removed before an event is stored
unless ``streams_store_content`` is set.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec
from clickhouse_connect.driver.client import Client

from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    AuditEntry,
    BatchItemRequested,
    BatchStateChanged,
    DeploymentChanged,
    DriftReport,
    EmbeddingRequested,
    Event,
    GenerationRequested,
    PricesChanged,
    RequestFinished,
    TokenChunk,
)
from schemas.topics import TopicNames
from streams.audit import AUDIT_COLUMNS, audit_row
from streams.drift import FEATURE_COLUMNS, REPORT_COLUMNS, feature_row, report_row
from streams.facts import FACT_COLUMNS, fact_row
from streams.pricing import PriceHistory, Prices

log = logging.getLogger(__name__)

RAW_COLUMNS = (
    "event_id", "type", "time", "tenant", "model", "request_id", "source", "payload", "topic", "partition",
    "offset",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Consumed:
    """A consumed record, from the sink's consumer or from replay's reader."""

    topic: str
    partition: int
    offset: int
    value: bytes


@dataclass
class Batch:
    """Rows for each table, plus the decoded events (for metrics and spans) and what failed to decode."""

    raw: list[list[Any]] = field(default_factory=list)
    facts: list[list[Any]] = field(default_factory=list)
    audit: list[list[Any]] = field(default_factory=list)
    drift: list[list[Any]] = field(default_factory=list)
    reports: list[list[Any]] = field(default_factory=list)
    deployments: list[list[Any]] = field(default_factory=list)
    batches: list[list[Any]] = field(default_factory=list)
    events: list[tuple[Consumed, Event]] = field(default_factory=list)
    undecodable: list[tuple[Consumed, DecodeError]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.events) + len(self.undecodable)


def redact(event: Event) -> Event:
    """The event without prompt/completion text, token ids or vectors (what ``events_raw`` keeps)."""
    match event:
        case GenerationRequested():
            return msgspec.structs.replace(event, prompt=None, input_ids=[])
        case EmbeddingRequested():
            return msgspec.structs.replace(event, texts=None, inputs=[])
        case BatchItemRequested():
            return msgspec.structs.replace(event, prompt=None, input_ids=[], texts=None, inputs=None)
        case RequestFinished():
            features = event.features
            if features is not None and features.embedding is not None:
                features = msgspec.structs.replace(features, embedding=None)  # kept in drift_features
            return msgspec.structs.replace(
                event, text=None, embeddings=None, embeddings_f32=None, features=features
            )
        case TokenChunk():
            return msgspec.structs.replace(event, text="", token_ids=[])
    return event


class Rows:
    """``decisions_from_topic``: turn ``AuditEntry`` and ``DriftReport`` events into ``audit_log`` and
    ``drift_reports`` rows (replay). The live worker makes those decisions itself and adds their rows."""

    def __init__(
        self,
        prices: Prices,
        *,
        store_content: bool = False,
        decisions_from_topic: bool = False,
        topics: TopicNames | None = None,
    ) -> None:
        """``topics``: the platform's topics; an event makes its table's row only when read from the topic
        that carries it (terminal events from ``results``, billed and audited; audit entries from
        ``audit``, drift reports from ``drift``, deployments from ``control``, batch states from
        ``batches``); one read from another is set aside to be dead-lettered. Audits: a ``RequestFinished``
        produced by mistake to ``usage``, ``cancels`` or a request topic was billed, and in no audit chain;
        a replay wrote an audit entry found on ``usage`` into ``audit_log``, where the live worker never
        does. None: from any (a test's). ``prices``: a :class:`PriceHistory` follows the tables published on
        ``control``, each taken before the batch it arrives in is priced."""
        self._prices = prices
        self._history = prices if isinstance(prices, PriceHistory) else None
        self._store_content = store_content
        self._decisions_from_topic = decisions_from_topic
        self._carriers: dict[type[Event], str] = (
            {}
            if topics is None
            else {
                RequestFinished: topics.results,
                AuditEntry: topics.audit,
                DriftReport: topics.drift,
                DeploymentChanged: topics.control,
                BatchStateChanged: topics.batches,
                PricesChanged: topics.control,
            }
        )

    def raw_row(
        self, event: Event, topic: str, partition: int, offset: int, *, encoded: bytes | None = None
    ) -> list[Any]:
        """The ``events_raw`` row of an event stored at (topic, partition, offset); ``encoded``, the
        event's record value when the caller has it, is reused where nothing is redacted from it."""
        stored = event if self._store_content else redact(event)
        payload = encoded if encoded is not None and stored is event else encode(stored)
        return [
            event.id,
            type(event).__struct_config__.tag,
            event.time,
            event.tenant,
            event.model,
            event.request_id,
            event.source,
            payload.decode(),
            topic,
            partition,
            offset,
        ]

    def batch(self, records: Iterable[Consumed]) -> Batch:
        """Each record's rows; a record that does not decode, or decodes into an event no row can hold (a
        terminal event without a tenant: no audit chain is its), is set aside to be dead-lettered, never
        left to stop the batch (and the sink at that offset on every restart)."""
        out = Batch()
        decoded: list[tuple[Consumed, Event]] = []
        history, carrier = self._history, self._carriers.get(PricesChanged)
        for record in records:
            try:
                event = decode(record.value)
            except DecodeError as exc:
                out.undecodable.append((record, exc))
                continue
            decoded.append((record, event))
            # a table published in this batch prices what it accepted since: taken before any is priced
            if history is not None and type(event) is PricesChanged and carrier in (None, record.topic):
                history.add(event)
        for record, event in decoded:
            try:
                rows = self._rows_of(event, record.topic, record.offset)
            except DecodeError as exc:
                out.undecodable.append((record, exc))
                continue
            except (ValueError, TypeError, OverflowError) as exc:
                out.undecodable.append((record, DecodeError(f"decodes but cannot be stored: {exc}")))
                continue
            out.events.append((record, event))
            out.raw.append(self.raw_row(event, record.topic, record.partition, record.offset))
            for table, row in rows:
                getattr(out, table).append(row)
        return out

    def _rows_of(self, event: Event, topic: str, offset: int) -> list[tuple[str, list[Any]]]:
        """(the :class:`Batch` field, its row) for each table row ``event`` (read from ``topic``) makes,
        besides ``events_raw``."""
        carrier = self._carriers.get(type(event))
        if carrier is not None and topic != carrier:
            kind = "a terminal event" if isinstance(event, RequestFinished) else f"a {type(event).__name__}"
            raise DecodeError(f"{kind} on {topic}: only {carrier} carries them")
        if isinstance(event, RequestFinished):
            if not event.tenant:
                raise ValueError("a terminal event needs a tenant")
            rows = [("facts", fact_row(event, self._prices))]
            # An offline job's inputs say nothing of the live traffic's drift, nor does a shadow copy
            # ended unrun (its candidate stopped serving: cancelled, named after the stable version).
            if event.batch is None and not (event.shadow_of is not None and event.status == "cancelled"):
                rows.append(("drift", feature_row(event)))
            return rows
        if isinstance(event, AuditEntry) and self._decisions_from_topic:
            return [("audit", audit_row(event))]
        if isinstance(event, DriftReport) and self._decisions_from_topic:
            return [("reports", report_row(event))]
        if isinstance(event, DeploymentChanged):
            return [("deployments", deployment_row(event, offset))]
        if isinstance(event, BatchStateChanged):
            return [("batches", batch_row(event))]
        return []


DEPLOYMENT_COLUMNS = (
    "event_id", "time", "model", "version", "action", "phase", "stable", "candidate", "traffic", "steps",
    "step", "step_started", "shadow", "reason", "evidence", "actor", "rollout_id", "source", "log_offset",
)  # fmt: skip


def deployment_row(event: DeploymentChanged, offset: int = -1) -> list[Any]:
    """The ``deployments`` row of a deployment change: traffic, steps and the gate evidence as JSON, and
    its ``offset`` on the control topic (-1: not known), which orders a model's decisions."""
    return [
        event.id,
        event.time,
        event.model,
        event.version,
        event.action,
        event.phase,
        event.stable,
        event.candidate or "",
        msgspec.json.encode(event.traffic, order="sorted").decode(),
        msgspec.json.encode(event.steps).decode(),
        event.step,
        event.step_started,
        event.shadow,
        event.reason,
        msgspec.json.encode(event.evidence).decode(),
        event.actor,
        event.rollout_id,
        event.source,
        offset,
    ]


BATCH_COLUMNS = (
    "tenant", "batch_id", "seq", "event_id", "time", "model", "status", "endpoint", "completion_window",
    "edge_id", "input_file_id", "output_file_id", "error_file_id", "total", "completed", "failed",
    "created_at", "expires_at", "in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at",
    "cancelling_at", "cancelled_at", "error_count", "errors", "metadata", "source",
)  # fmt: skip


def batch_row(event: BatchStateChanged) -> list[Any]:
    """The ``batches`` row of a batch's state: counts, file ids ('' for none), times, the input file's
    errors and the client's metadata as JSON."""
    return [
        event.tenant,
        event.batch_id,
        event.seq,
        event.id,
        event.time,
        event.model,
        event.status,
        event.endpoint,
        event.completion_window,
        event.edge_id,
        event.input_file_id,
        event.output_file_id or "",
        event.error_file_id or "",
        event.counts.total,
        event.counts.completed,
        event.counts.failed,
        event.created_at,
        event.expires_at,
        event.in_progress_at,
        event.finalizing_at,
        event.completed_at,
        event.failed_at,
        event.expired_at,
        event.cancelling_at,
        event.cancelled_at,
        len(event.errors),
        msgspec.json.encode(event.errors).decode(),
        msgspec.json.encode(event.metadata, order="sorted").decode(),
        event.source,
    ]


class Inserter(Protocol):
    def raw_insert(
        self,
        table: str,
        column_names: Sequence[str] | None = None,
        insert_block: bytes | None = None,
        settings: dict[str, Any] | None = None,
        fmt: str | None = None,
    ) -> object: ...


def query_rows(client: Client, sql: str) -> list[dict[str, Any]]:
    """A query's rows as dicts with native values (blocking: call it from a thread on an event loop)."""
    result = client.query(sql)
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]


ROW_FORMAT = "JSONCompactEachRow"
"""How the sink hands rows to ClickHouse: one JSON array per row, encoded by msgspec in C and parsed by
the engine. clickhouse-connect's own ``insert`` builds the Native format column by column in Python,
~60 us of GIL per terminal event that the sink's event loop needed (``docs/streams.md``, Benchmark)."""
ROW_SETTINGS = {"date_time_input_format": "best_effort", "max_partitions_per_insert_block": 0}
"""msgspec writes datetimes as RFC 3339 (``2026-11-29T12:28:07.591234Z``); the engine truncates them to
the column's precision, as clickhouse-connect's Native encoding does. Every value in a row comes from an
event decoded from JSON, so no float is NaN or infinite (which JSON cannot carry). The tables are
partitioned by month, and one insert spanning more than 100 of them (ClickHouse's default limit; a replay
of years, or events dated anywhere) failed the whole batch, again at every redelivery: no limit."""
_ROWS = msgspec.json.Encoder()


def table_rows(batch: Batch) -> list[tuple[str, list[list[Any]], Sequence[str]]]:
    """The batch's rows per table, with the table's columns, in the order they are inserted."""
    return [
        ("events_raw", batch.raw, RAW_COLUMNS),
        ("request_facts", batch.facts, FACT_COLUMNS),
        ("audit_log", batch.audit, AUDIT_COLUMNS),
        ("drift_features", batch.drift, FEATURE_COLUMNS),
        ("drift_reports", batch.reports, REPORT_COLUMNS),
        ("deployments", batch.deployments, DEPLOYMENT_COLUMNS),
        ("batches", batch.batches, BATCH_COLUMNS),
    ]


def insert_rows(client: Inserter, table: str, rows: Sequence[Sequence[Any]], columns: Sequence[str]) -> None:
    """Insert ``rows`` (values in ``columns`` order) into ``table`` as :data:`ROW_FORMAT` (blocking)."""
    client.raw_insert(table, columns, _ROWS.encode_lines(rows), settings=ROW_SETTINGS, fmt=ROW_FORMAT)


def insert(client: Inserter, batch: Batch) -> None:
    """Write a batch's rows (blocking: call it from a thread when on an event loop)."""
    for table, rows, columns in table_rows(batch):
        if rows:
            insert_rows(client, table, rows, columns)
