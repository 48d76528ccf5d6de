"""The streams worker: a Faust app that turns the event log into warehouse tables and the audit chain.

Two agents:

- ``sink`` reads the request topics, ``results``, ``audit``, ``cancels``, ``control`` and ``usage`` in
  batches (``SLUICE_STREAMS_BATCH_SIZE`` events or ``SLUICE_STREAMS_BATCH_MS``, whichever comes first) and
  writes them through :mod:`streams.sink`: ``events_raw``, ``request_facts`` and ``audit_log``. The rows are
  idempotent (see the sink), so a redelivered batch after a crash does not double count; offsets are
  committed by Faust only after the agent has processed (and so written) the batch.
- ``audit`` reads ``results`` and extends each tenant's hash chain (``streams.audit``), keeping the chain
  heads in a Faust table (changelog-backed, so a restarted worker continues the chain) and publishing each
  entry to the ``audit`` topic. With ``exactly_once`` (the default) the head update, the entry and the
  input offset commit in one Kafka transaction: a crash never forks or repeats the chain.

Undecodable records go to the dead-letter topic with the reason; both agents keep going.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import faust
from opentelemetry.trace import Span, SpanKind

from bus.consumer import dead_letter
from bus.producer import EventProducer
from monitoring import metrics, tracing
from schemas.codec import DecodeError, decode, encode, headers
from schemas.events import RequestFinished
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams.audit import AuditHead, request_entry
from streams.control import SPEND_TODAY, WINDOWS, Controller, WindowCounts, burn_sql
from streams.pricing import PriceTable
from streams.settings import StreamsSettings
from streams.sink import Batch, Consumed, Inserter, Rows, insert

log = logging.getLogger(__name__)

SOURCE = "streams/worker"


def sink_topics(names: TopicNames, request_topics: Sequence[str]) -> list[str]:
    """Every topic whose events the warehouse keeps (token chunks on ``replies`` are delivery only)."""
    return [*request_topics, names.results, names.audit, names.cancels, names.control, names.usage]


class StreamsApp:
    """The Faust app and its agents. ``await start()`` / ``await stop()`` on the running loop."""

    def __init__(
        self,
        platform: PlatformSettings,
        settings: StreamsSettings,
        writer: Inserter,
        prices: PriceTable,
        producer: EventProducer,
        *,
        controller: Controller | None = None,
        request_topics: Sequence[str],
        results_partitions: int,
        app_id: str | None = None,
        on_batch: Callable[[Batch], None] | None = None,
    ) -> None:
        names = TopicNames(platform.topic_prefix)
        self.names = names
        self._writer = writer
        self._rows = Rows(prices, store_content=settings.streams_store_content)
        self._producer = producer
        self._on_batch = on_batch
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warehouse-writer")
        self.app = faust.App(
            app_id or f"{platform.topic_prefix}-streams",
            broker=f"kafka://{platform.bootstrap}",
            store="memory://",
            processing_guarantee=settings.streams_guarantee,
            web_enabled=False,
            topic_replication_factor=1,
            topic_partitions=results_partitions,
            consumer_auto_offset_reset="earliest",
            broker_session_timeout=10.0,
            broker_heartbeat_interval=1.0,
            broker_rebalance_timeout=10.0,
            broker_commit_interval=1.0,
            stream_wait_empty=False,
            table_standby_replicas=0,
        )
        raw: dict[str, Any] = {"key_type": bytes, "value_type": bytes, "value_serializer": "raw"}
        self._sink_channel = self.app.topic(*sink_topics(names, request_topics), **raw)
        self._results = self.app.topic(names.results, **raw)
        self._audit_out = self.app.topic(names.audit, **raw)
        self._heads = self.app.Table("audit-heads", default=None, partitions=results_partitions)
        self.app.agent(self._sink_channel, name="sink")(self._guard(self._sink))
        self.app.agent(self._results, name="audit")(self._guard(self._audit))
        self._controller = controller
        if controller is not None:
            self.app.timer(settings.streams_control_interval_s, name="control")(self._control)
        self.failure: BaseException | None = None
        """Set when an agent crashed: the process must exit (and be restarted), not limp on."""
        self._batch_size = settings.streams_batch_size
        self._within = settings.streams_batch_ms / 1000

    async def start(self) -> None:
        await self.app.start()

    async def stop(self) -> None:
        await self.app.stop()
        self._executor.shutdown(wait=True)

    @property
    def assigned(self) -> bool:
        consumer = self.app.consumer
        return bool(consumer.assignment()) if consumer is not None else False

    # ---------------------------------------------------------------- agents

    def _guard(
        self, agent: Callable[[faust.StreamT[bytes]], Awaitable[None]]
    ) -> Callable[[faust.StreamT[bytes]], Awaitable[None]]:
        """Faust logs an agent's crash and carries on without it; record it instead, so the process
        stops and its supervisor restarts it from the committed offsets."""

        async def guarded(stream: faust.StreamT[bytes]) -> None:
            try:
                await agent(stream)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("streams agent %s crashed", agent.__name__)
                self.failure = exc
                raise

        guarded.__name__ = agent.__name__
        return guarded

    async def _sink(self, stream: faust.StreamT[bytes]) -> None:
        batches = stream.take_events(self._batch_size, within=self._within)  # type: ignore[attr-defined]
        async for events in batches:
            records = [
                Consumed(e.message.topic, e.message.partition, e.message.offset, e.message.value or b"")
                for e in events
            ]
            await self.write(records)

    async def write(self, records: Sequence[Consumed]) -> Batch:
        """Rows for ``records``, written before returning (so their offsets may then be committed)."""
        batch = self._rows.batch(records)
        spans = self._spans(batch)
        began = time.perf_counter()
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, insert, self._writer, batch)
        written = time.time()
        metrics.STREAMS_INSERT_SECONDS.observe(time.perf_counter() - began)
        metrics.STREAMS_BATCH_SIZE.observe(len(batch))
        for span in spans:
            span.end()
        for record, event in batch.events:
            metrics.STREAMS_EVENTS.labels(record.topic, type(event).__struct_config__.tag).inc()
            metrics.STREAMS_FRESHNESS.observe(max(0.0, written - event.time.timestamp()))
        for record, exc in batch.undecodable:
            dead_letter(
                self._producer,
                self.names.deadletter,
                SOURCE,
                (record.topic, record.partition, record.offset),
                record.value,
                exc,
            )
        if self._on_batch is not None:
            self._on_batch(batch)
        return batch

    def _spans(self, batch: Batch) -> list[Span]:
        """One ``process`` span per terminal event, a child of the worker's publish span."""
        spans = []
        for record, event in batch.events:
            if isinstance(event, RequestFinished) and event.traceparent:
                spans.append(
                    tracing.tracer().start_span(
                        f"process {record.topic}",
                        context=tracing.context_of(event.traceparent, event.tracestate),
                        kind=SpanKind.CONSUMER,
                        attributes={
                            **tracing.messaging("process", record.topic, record.partition, record.offset),
                            tracing.REQUEST_ID: event.request_id,
                            tracing.TENANT: event.tenant,
                            "sluice.streams.tables": "events_raw,request_facts",
                        },
                    )
                )
        return spans

    async def _control(self) -> None:
        """Evaluate budgets and burn rates on the warehouse; publish what changed on ``control``."""
        controller = self._controller
        if controller is None:
            return
        loop = asyncio.get_running_loop()
        try:
            spend = await loop.run_in_executor(self._executor, _rows, self._writer, SPEND_TODAY)
            burns: list[dict[str, Any]] = []
            for minutes in WINDOWS:
                burns += await loop.run_in_executor(self._executor, _rows, self._writer, burn_sql(minutes))
        except Exception:
            log.exception("control: reading the warehouse failed; trying again next interval")
            return
        events = controller.budgets({r["tenant"]: int(r["spent"]) for r in spend})
        events += controller.burn(
            {(r["model"], int(r["minutes"])): WindowCounts(int(r["bad"]), int(r["total"])) for r in burns}
        )
        for event in events:
            await self._producer.publish(self.names.control, event)
            log.info("control: %s", event)

    async def _audit(self, stream: faust.StreamT[bytes]) -> None:
        async for event in stream.events():
            try:
                finished = decode(event.message.value or b"")
            except DecodeError:
                continue  # the sink dead-letters it
            if isinstance(finished, RequestFinished):
                await self._chain(finished, event.message.partition, event.message.offset)

    async def _chain(self, finished: RequestFinished, partition: int, offset: int) -> None:
        """Append the request's entry to its tenant's chain, once.

        The head remembers where (results partition, offset) the tenant's last entry came from. The
        head's changelog and the entry commit in the same transaction, but this topic's offsets commit
        only once the sink has also written the event, so after a crash an event can come back whose
        entry is already committed: the head says so, and it is skipped."""
        stored = self._heads.get(finished.tenant)
        if stored and stored.get("partition") == partition and offset <= stored.get("offset", -1):
            return
        head = AuditHead(seq=stored["seq"], entry_hash=stored["entry_hash"]) if stored else None
        entry = request_entry(head, finished, source=SOURCE)
        await self._audit_out.send(key=finished.tenant.encode(), value=encode(entry), headers=headers(entry))
        self._heads[finished.tenant] = {
            "seq": entry.seq,
            "entry_hash": entry.entry_hash,
            "partition": partition,
            "offset": offset,
        }
        metrics.STREAMS_AUDIT_ENTRIES.inc()


def _rows(client: Inserter, sql: str) -> list[dict[str, Any]]:
    result = client.query(sql)  # type: ignore[attr-defined]
    return [dict(zip(result.column_names, row, strict=True)) for row in result.result_rows]
