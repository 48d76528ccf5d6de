"""The edge's Kafka side: publish requests, fan replies in to the streams waiting for them, replay from the log.

Replies come back on ONE partition of the replies topic that belongs to this edge instance (``reply_to``),
read with a plain assignment (no consumer group), starting at the partition's end when the edge starts.
An edge that restarts with the same id gets the same partition; a client that reconnects is served from the
log (``resume``): the request id is a UUIDv7, so its timestamp tells where in the partition to start reading.

Memory is bounded per stream: a reader that falls behind by more than ``stream_buffer`` events is switched
to reading its own tail from the log instead of buffering it (Kafka already holds it).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import msgspec
from confluent_kafka import Consumer, Message, TopicPartition
from opentelemetry.trace import SpanKind

from bus.consumer import BACKGROUND, ConsumerThread, UnreadableHeaders, consumer_config, record_headers
from bus.control import control_start
from bus.errors import BusError
from bus.positions import offset_at, read_to_end, watermarks
from bus.producer import EventProducer
from ingest.errors import GatewayUnavailable
from ingest.gateway import IdempotencyRecord
from ingest.idempotency import ClaimTable
from ingest.quota import WINDOW_S
from ingest.reply_stream import WHOLE, After, Reply, ReplyStream
from monitoring import tracing
from schemas.codec import UNREADABLE_JSON, DecodeError, decode
from schemas.coordination import (
    IdempotencyClaim,
    QuotaSync,
    claim_key,
    decode_claim,
    decode_quota,
    encode_coordination,
    key_digest,
)
from schemas.deployments import Deployment
from schemas.events import (
    BudgetStateChanged,
    CancelRequested,
    DeploymentChanged,
    EmbeddingRequested,
    Event,
    GenerationRequested,
    ReplyTo,
    RequestFinished,
    TokenChunk,
)
from schemas.ids import uuid7_unix_ms
from schemas.lifecycle import AsyncComponent
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames

log = logging.getLogger(__name__)

T = TypeVar("T")

FINISH_LISTEN_S = 180.0
"""How long a :meth:`KafkaGateway.when_finished` listener waits for its request's end: past the quota
window (60 s), settling a reservation changes nothing."""
FINISH_LISTENERS = 100_000
"""The most listeners kept at once (one per request cancelled in the last :data:`FINISH_LISTEN_S`)."""

Detokenize = Callable[[str, list[int]], str]
"""(model, token ids) -> text; used to cut the overlap when a retried request replays tokens."""


class KafkaGateway(AsyncComponent):
    """Implements the edge's Gateway on Kafka. ``start()``/``stop()`` or ``async with``."""

    def __init__(
        self,
        *,
        kafka: KafkaConnection,
        names: TopicNames,
        edge_id: str,
        reply_partition: int,
        salts: Mapping[str, int] | None = None,
        detokenize: Detokenize | None = None,
        stream_buffer: int = 1024,
        idempotency_ttl_s: float = 24 * 3600,
        idempotency_per_tenant: int = 10_000,
        resume_window_s: float = 3600.0,
        resume_index: int = 100_000,
        replies_on_loop: bool = True,
    ) -> None:
        super().__init__()
        self._kafka = kafka
        self._names = names
        self.edge_id = edge_id
        self.reply_to = ReplyTo(topic=names.replies, partition=reply_partition, edge_id=edge_id)
        self._salts = dict(salts or {})
        self._detokenize = detokenize
        self._stream_buffer = stream_buffer
        self._owners: collections.OrderedDict[str, tuple[str, int | None]] = collections.OrderedDict()
        """Request id -> (tenant, offset of its first reply on this edge's partition, when seen): which
        streams may be resumed here, by whom, from where. Filled by submits and the reply listener, and
        at start from the last ``resume_window_s`` of the partition (record headers only)."""
        self._owners_lock = threading.Lock()  # the start's index writes on a thread, then only the event loop
        self._resume_window_s = resume_window_s
        self._resume_index = resume_index
        self._replies_on_loop = replies_on_loop
        self._producer = EventProducer(kafka, f"ingest/{edge_id}")
        self._producer.watch(self.fail)
        self.watch(self._gateway_failed)
        self._streams: dict[str, ReplyStream] = {}
        self._finish_listeners: OrderedDict[str, tuple[float, Callable[[RequestFinished], None]]] = (
            OrderedDict()
        )
        """Request id -> (since, listener) (:meth:`when_finished`), oldest first."""
        self._log_readers: ThreadPoolExecutor | None = None
        """The threads that read the log for resumed and lagging streams (:meth:`read_log`)."""
        self._listener: ConsumerThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._claims = ClaimTable(per_tenant=idempotency_per_tenant, ttl_s=idempotency_ttl_s)
        """Idempotency keys claimed by any edge, from the ``idempotency`` topic (applied on the loop)."""
        self._claims_reader: ConsumerThread | None = None
        self._claims_read: dict[int, int] = {}
        """Per partition of the idempotency topic, the next offset the reader will apply."""
        self._claims_waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._abandoned: list[tuple[int, int, str, str, IdempotencyRecord]] = []
        """(partition, offset, tenant, key, record) of claims published whose read-back was not waited
        out (it timed out, or the client left): once read, each is withdrawn if it won its key."""
        self._withdrawing: set[asyncio.Task[None]] = set()
        self._claims_caught_up = asyncio.Event()
        self._claims_ends: dict[int, int] = {}
        self._control: ConsumerThread | None = None
        self._exhausted: set[str] = set()
        self._deployments: dict[str, Deployment] = {}
        self._control_ends: dict[int, int] = {}
        self._control_seen = threading.Event()
        """Set once the control listener has read to where the topic ended at start: only then do the
        budgets and deployments reflect the log (``ready()``)."""
        self._quota: ConsumerThread | None = None
        self._quota_apply: Callable[[QuotaSync, float], None] | None = None
        self._quota_unheard: dict[str, tuple[QuotaSync, float, float]] = {}
        """Per publishing instance, its latest snapshot read before anyone followed them (:meth:`follow_quota`):
        (snapshot, age when read, ``time.monotonic()`` when read). The read-back of the last window arrives
        while the gateway starts, before the edge follows; it was dropped, so a restarted edge forgot what it
        and its dead peers had admitted in the last minute (a review). Only the latest of each instance is
        kept, as the ledger keeps only that."""
        self._quota_live_from = 0
        """The quota topic's end when this edge started: snapshots from there on are live."""
        self.on_deploy: Callable[[str, Deployment], None] | None = None
        """Told of every deployment before edges route by it (the catalogue preloads its versions)."""

    # ---------------------------------------------------------------- lifecycle

    async def _start(self) -> None:
        """Producer, reply listener, control listener. Any of them dying fails the gateway (:meth:`fail`):
        open streams fail at once, submits are refused, and ``ready()`` turns false, so budgets and
        deployments never go stale silently."""
        self._loop = asyncio.get_running_loop()
        self._log_readers = ThreadPoolExecutor(self.LOG_READERS, thread_name_prefix=f"log-{self.edge_id}")
        self._producer.start()
        start = await asyncio.to_thread(self._partition_end)
        await asyncio.to_thread(self._index_recent, start)
        self._listener = ConsumerThread(
            consumer_config(self._kafka, None, f"ingest-{self.edge_id}-replies"),
            self._on_replies,
            assign=[TopicPartition(self._names.replies, self.reply_to.partition, start)],
            name=f"replies-{self.edge_id}",
            on_failure=self.fail,
            serve_on=self._loop,  # the listener's batches are handled on the loop, woken by librdkafka
            wake_loop=self._replies_on_loop,
        )
        self._listener.start()
        control, self._control_ends = await asyncio.to_thread(
            control_start, self._kafka, self._names.control, f"ingest-{self.edge_id}-control"
        )
        if not control:
            log.warning("no control topic %s: budgets and deployments are not followed", self._names.control)
        if not any(self._control_ends.values()):
            self._control_seen.set()
        if control:
            self._control = ConsumerThread(
                consumer_config(self._kafka, None, f"ingest-{self.edge_id}-control", **BACKGROUND),
                self._on_control,
                assign=control,
                name=f"control-{self.edge_id}",
                on_failure=self.fail,
                ends={(self._names.control, p): end for p, end in self._control_ends.items()},
                on_ends=lambda reached: self._control_reached([part for _, part in reached]),
            )
            self._control.start()
            # Route by the current deployments from the first request: wait until they are read.
            if not await asyncio.to_thread(self._control_seen.wait, self.CONTROL_CATCH_UP_S):
                log.warning("the control topic was not read to its end within %ss", self.CONTROL_CATCH_UP_S)
        quota = await asyncio.to_thread(self._recent_quota)
        if quota is None:
            log.warning("no quota topic %s: tenants' limits are this edge's alone", self._names.quota)
        else:
            self._quota = ConsumerThread(
                consumer_config(self._kafka, None, f"ingest-{self.edge_id}-quota", **BACKGROUND),
                self._on_quota,
                assign=[quota],
                name=f"quota-{self.edge_id}",
                on_failure=self.fail,
            )
            self._quota.start()
        claims, ends = await asyncio.to_thread(
            control_start, self._kafka, self._names.idempotency, f"ingest-{self.edge_id}-claims"
        )
        if not claims:
            log.warning("no idempotency topic %s: Idempotency-Key is refused", self._names.idempotency)
        else:
            self._claims_ends = {p: end for p, end in ends.items() if end > 0}
            if not self._claims_ends:
                self._claims_caught_up.set()
            self._claims_reader = ConsumerThread(
                consumer_config(self._kafka, None, f"ingest-{self.edge_id}-claims"),
                self._on_claims,
                assign=claims,
                name=f"claims-{self.edge_id}",
                on_failure=self.fail,
                ends={(self._names.idempotency, p): end for p, end in self._claims_ends.items()},
                on_ends=self._claims_ends_reached,
            )
            self._claims_reader.start()
            try:  # every key claimed in the last day, by any edge, before the first request
                await asyncio.wait_for(self._claims_caught_up.wait(), self.CONTROL_CATCH_UP_S)
            except TimeoutError:
                log.warning(
                    "the idempotency topic was not read to its end within %ss", self.CONTROL_CATCH_UP_S
                )

    async def stop(self) -> None:
        for name in ("_claims_reader", "_quota", "_control", "_listener"):
            listener: ConsumerThread | None = getattr(self, name)
            setattr(self, name, None)
            if listener is not None:
                try:
                    await asyncio.to_thread(listener.stop)
                except BusError:
                    log.warning("%s had failed", name.strip("_"), exc_info=True)
        await asyncio.to_thread(self._producer.stop)
        readers, self._log_readers = self._log_readers, None
        if readers is not None:  # the streams still reading end at their next poll (GatewayUnavailable)
            await asyncio.to_thread(readers.shutdown)

    LOG_READERS = 32
    """Threads reading the log for resumed and lagging streams, each poll holding one for up to 0.2 s. They
    were the loop's default executor's (``min(32, cpus + 4)`` threads), which also tokenises large bodies
    (``ingest/prepare.py``): 24 live streams and 72 resume readers made a 120 KB prompt's request take
    1.5-2.6 s instead of 0.1-0.2 s (an audit). Past this many, log readers wait for each other alone."""

    def _gateway_failed(self, exc: BaseException) -> None:
        """On the failing thread: replies or control are no longer followed; fail the open streams now
        rather than let each wait for its deadline (their clients get a 503 and may resume elsewhere)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._fail_streams, exc)

    def _fail_streams(self, exc: BaseException) -> None:
        for stream in list(self._streams.values()):
            stream.fail(GatewayUnavailable(f"this edge stopped receiving replies ({exc}); resume the stream"))

    CONTROL_CATCH_UP_S = 30.0

    BROKERS_DOWN_S = 10.0
    """How long the reply listener may see no broker before the edge is not ready (``/readyz``)."""

    def ready(self) -> bool:
        control_ok = self._control is None or self._control_seen.is_set()
        listener = self._listener
        return (
            listener is not None
            and self.failure is None
            and control_ok
            and listener.brokers_down_for() < self.BROKERS_DOWN_S
            and all(
                reader.unreadable_for()[0] < self.BROKERS_DOWN_S
                for reader in (listener, self._control, self._quota, self._claims_reader)
                if reader is not None
            )
        )

    def deployment(self, model: str) -> Deployment | None:
        return self._deployments.get(model)

    def budget_exhausted(self, tenant: str) -> bool:
        return tenant in self._exhausted

    def _control_reached(self, parts: list[int], *, but: str | None = None) -> None:
        """Control listener thread: these partitions are read to where they ended at the start (by a record
        at the end, or by the position past a transaction's marker there); once all are, the edge knows the
        current deployments and budgets. ``but``: a model whose deployment the record being read logs."""
        if self._control_seen.is_set():
            return
        for part in parts:
            self._control_ends[part] = 0
        if not any(self._control_ends.values()):
            self._control_seen.set()
            for model, latest in sorted(self._deployments.items()):  # the history read: its end
                if model != but:
                    log.info("deployment of %s: %s", model, latest)

    def _on_control(self, batch: list[Message]) -> None:
        """Control listener thread: the latest budget state per tenant (a set swap is atomic enough)."""
        for message in batch:
            try:
                event: Event | None = decode(message.value() or b"")
            except DecodeError:
                # still a record read: one the edge cannot decode (a tombstone, a newer event type) ending
                # the topic kept it unready until the next control record (a review, 2026-12-01)
                event = None
            if not self._control_seen.is_set():
                part, offset = message.partition() or 0, message.offset() or 0
                if offset + 1 >= self._control_ends.get(part, 0):
                    self._control_reached(
                        [part], but=event.model if isinstance(event, DeploymentChanged) else None
                    )
            if isinstance(event, DeploymentChanged):
                deployment = Deployment.of(event)
                if self.on_deploy is not None:
                    self.on_deploy(event.model, deployment)
                self._deployments[event.model] = deployment
                if self._control_seen.is_set():  # not each of the history's (a line per rollout ever)
                    log.info("deployment of %s: %s", event.model, deployment)
            elif isinstance(event, BudgetStateChanged):
                if event.exhausted:
                    self._exhausted.add(event.tenant)
                    log.warning("tenant %s is over its budget: refusing its new requests", event.tenant)
                else:
                    self._exhausted.discard(event.tenant)

    def _disown(self, request_id: str) -> None:
        with self._owners_lock:
            self._owners.pop(request_id, None)

    def _own(self, request_id: str, tenant: str, offset: int | None = None) -> bool:
        """Index the request as this edge's (with its first reply's offset once known); True if it was new."""
        with self._owners_lock:
            known = self._owners.get(request_id)
            if known is None:
                self._owners[request_id] = (tenant, offset)
                while len(self._owners) > self._resume_index:
                    self._owners.popitem(last=False)
                return True
            if known[1] is None and offset is not None:
                self._owners[request_id] = (known[0], offset)
            return False

    def owner(self, request_id: str) -> tuple[str, int | None] | None:
        """(tenant, first reply offset) of a request this edge may resume, else None."""
        with self._owners_lock:
            return self._owners.get(request_id)

    def _index_recent(self, end: int) -> None:
        """Index the requests answered on this edge's partition in the last ``resume_window_s``, from the
        records' CloudEvents headers (no body is decoded), so streams survive an edge restart."""
        begin = self._offset_at(int((time.time() - self._resume_window_s) * 1000))
        consumer = Consumer(consumer_config(self._kafka, None, f"ingest-{self.edge_id}-index"))
        tp = TopicPartition(self._names.replies, self.reply_to.partition, begin)
        try:
            for message in read_to_end(consumer, [tp], {tp.partition: end}):
                # A record that is not this platform's (a header key or value not UTF-8) is skipped, not
                # the edge's failure: it failed the start while it was in the window (a review).
                try:
                    head = dict(record_headers(message))
                    subject, tenant = head.get("ce_subject"), head.get("ce_tenant")
                    if isinstance(subject, bytes) and isinstance(tenant, bytes):
                        self._own(subject.decode(), tenant.decode(), message.offset())
                except (UnreadableHeaders, UnicodeDecodeError):
                    continue
        finally:
            consumer.close()

    def _partition_end(self) -> int:
        consumer = Consumer(consumer_config(self._kafka, None, f"ingest-{self.edge_id}-probe"))
        try:
            return watermarks(consumer, self._names.replies, self.reply_to.partition)[1]
        finally:
            consumer.close()

    # ---------------------------------------------------------------- requests

    def partition_key(self, tenant: str, request_id: str) -> bytes:
        """The tenant, salted over ``salts[tenant]`` keys for hot tenants so they can use every worker."""
        salts = self._salts.get(tenant, 1)
        if salts <= 1:
            return tenant.encode()
        salt = int.from_bytes(hashlib.blake2b(request_id.encode(), digest_size=4).digest(), "big") % salts
        return f"{tenant}#{salt}".encode()

    async def submit(self, event: GenerationRequested | EmbeddingRequested) -> ReplyStream:
        """Publish durably, then return the stream its replies will arrive on."""
        if self._listener is None or self.failure is not None:
            raise GatewayUnavailable(
                f"this edge lost its connection to the platform ({self.failure}); retry on another edge"
            )
        stream = ReplyStream(self, event.request_id, event.model, WHOLE, self._stream_buffer)
        new = self._own(event.request_id, event.tenant)
        self._streams[event.request_id] = stream  # registered first: no reply can be missed
        topic = self._names.requests(event.model)
        with tracing.current_span(
            f"publish {topic}", kind=SpanKind.PRODUCER, attributes=tracing.messaging("publish", topic)
        ) as span:
            traceparent, tracestate = tracing.carrier_of(span)
            if traceparent is not None:  # the worker's spans become children of this one
                event = msgspec.structs.replace(event, traceparent=traceparent, tracestate=tracestate)
            try:
                where = await self._producer.publish(
                    topic, event, key=self.partition_key(event.tenant, event.request_id)
                )
            except BusError as exc:  # not durable: nothing to resume, and the caller may retry
                self._streams.pop(event.request_id, None)
                if new:
                    self._disown(event.request_id)
                raise GatewayUnavailable(f"the request could not be published: {exc}") from exc
            except BaseException:  # cancelled while publishing: it may be on the log, resumable
                self._streams.pop(event.request_id, None)
                raise
            if span.is_recording():
                span.set_attributes(tracing.messaging("publish", topic, where[0], where[1]))
        return stream

    async def mirror(self, event: GenerationRequested | EmbeddingRequested) -> None:
        """Publish a shadow copy: nobody listens for its replies (it has no ``reply``)."""
        topic = self._names.requests(event.model)
        try:
            await self._producer.publish(topic, event, key=self.partition_key(event.tenant, event.request_id))
        except BusError as exc:
            raise GatewayUnavailable(f"the shadow copy could not be published: {exc}") from exc

    async def cancel(self, event: CancelRequested) -> None:
        try:
            await self._producer.publish(self._names.cancels, event)
        except BusError as exc:
            raise GatewayUnavailable(f"the cancel could not be sent: {exc}") from exc

    async def resume(self, tenant: str, request_id: str, after: After) -> ReplyStream | None:
        """The request's replies after ``after``, read from the log; None (404) unless the index says
        this edge holds the request for this tenant: an unknown or foreign id costs a lookup, never a
        scan of the log."""
        owner = self.owner(request_id)
        partition = self.reply_to.partition
        if owner is None or owner[0] != tenant:
            claimed = self._claims.by_request(tenant, request_id)
            if claimed is None:
                return None  # never another tenant's stream, nor a made-up one
            # another edge's request, named by an idempotency claim: its replies are on that edge's
            # partition, from a moment before the claim (a bounded read, not a scan for an unknown id)
            owner, partition = (tenant, None), claimed.reply_partition
        start = owner[1]
        if start is None:  # no reply seen yet: from a moment before it was accepted
            start = await self._on_log_reader(self._offset_at, uuid7_unix_ms(request_id) - 5_000, partition)
        return ReplyStream(
            self,
            request_id,
            "",
            after,
            self._stream_buffer,
            tenant=tenant,
            from_log=start,
            partition=partition,
        )

    def forget(self, request_id: str, stream: ReplyStream) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]

    def detokenize(self, model: str, token_ids: list[int]) -> str:
        if self._detokenize is None:
            return ""
        return self._detokenize(model, token_ids)

    # ---------------------------------------------------------------- quota

    async def publish_quota(self, sync: QuotaSync) -> None:
        """Fire and forget: a snapshot that is lost is replaced by the next one."""
        self._producer.produce_raw(self._names.quota, encode_coordination(sync), key=sync.edge.encode())

    def follow_quota(self, apply: Callable[[QuotaSync, float], None]) -> None:
        """Event loop: hand every snapshot to ``apply`` from now on, those read before first (each aged by
        its wait, so a snapshot read back at start is as old as it really is)."""
        unheard, self._quota_unheard = self._quota_unheard, {}
        now = time.monotonic()
        for sync, age, read_at in unheard.values():
            apply(sync, age + max(0.0, now - read_at))
        self._quota_apply = apply

    def _recent_quota(self) -> TopicPartition | None:
        """Where to start reading the quota topic: one window back, so that what other edges (and this
        edge's previous life) admitted lately still counts after a restart."""
        consumer = Consumer(consumer_config(self._kafka, None, f"ingest-{self.edge_id}-quota-seek"))
        try:
            topic = consumer.list_topics(self._names.quota, timeout=10).topics.get(self._names.quota)
            if topic is None or topic.error is not None or not topic.partitions:
                return None
            since = int((time.time() - WINDOW_S) * 1000)
            self._quota_live_from = watermarks(consumer, self._names.quota, 0)[1]
            return TopicPartition(self._names.quota, 0, offset_at(consumer, self._names.quota, 0, since))
        finally:
            consumer.close()

    def _on_quota(self, batch: list[Message]) -> None:
        """Quota listener thread: decode the snapshots and hand them to the loop in one hop per batch."""
        now_ms = time.time() * 1000
        syncs: list[tuple[QuotaSync, float]] = []
        for message in batch:
            try:
                sync = decode_quota(message.value() or b"")
            except UNREADABLE_JSON:
                log.warning("undecodable quota snapshot at offset %s", message.offset())
                continue
            # A snapshot published since this edge started is live: heard now. Its age by the publisher's
            # clock made a peer whose clock is a second behind not live, and one a minute behind not counted
            # at all (an audit). Only the window read back at start is dated by the snapshot's own time.
            live = (message.offset() or 0) >= self._quota_live_from
            syncs.append((sync, 0.0 if live else min(WINDOW_S, max(0.0, (now_ms - sync.time_ms) / 1000))))
        loop = self._loop
        if syncs and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._hear_quota, syncs, time.monotonic())

    def _hear_quota(self, syncs: list[tuple[QuotaSync, float]], read_at: float) -> None:
        """Event loop: apply the snapshots, or keep the latest of each instance until someone follows them
        (decided here, on the loop, so none falls between the check and :meth:`follow_quota`)."""
        apply = self._quota_apply
        if apply is not None:
            for sync, age in syncs:
                apply(sync, age)
            return
        for sync, age in syncs:  # in log order, one partition: a later snapshot of an instance replaces it
            self._quota_unheard[sync.edge] = (sync, age, read_at)

    # ---------------------------------------------------------------- idempotency

    CLAIM_WAIT_S = 10.0

    async def lookup_idempotent(self, tenant: str, key: str) -> IdempotencyRecord | None:
        claim = self._claims.get(tenant, key_digest(key), time.time() * 1000)
        return (
            None
            if claim is None
            else IdempotencyRecord(request_id=claim.request_id, body_hash=claim.body_hash)
        )

    async def remember_idempotent(
        self, tenant: str, key: str, record: IdempotencyRecord
    ) -> IdempotencyRecord:
        """Claim ``key`` on the log and return the record of the claim that won it (in log order, on every
        edge alike): ``record`` itself, or an earlier claim's, whose stream the caller then replays."""
        if self._claims_reader is None:
            raise GatewayUnavailable("idempotency keys are not available on this edge (no idempotency topic)")
        claim = IdempotencyClaim(
            tenant=tenant,
            key_sha256=key_digest(key),
            request_id=record.request_id,
            body_hash=record.body_hash,
            edge=self.edge_id,
            reply_partition=self.reply_to.partition,
            time_ms=int(time.time() * 1000),
        )
        published = asyncio.ensure_future(
            self._producer.publish_raw(
                self._names.idempotency, encode_coordination(claim), key=claim_key(tenant, key)
            )
        )
        try:
            partition, offset = await asyncio.shield(published)
        except asyncio.CancelledError:
            # the client left while the claim was on its way: it lands all the same, and is withdrawn once
            # read if it won (as below), or it would hold the key for a request never published
            published.add_done_callback(lambda done: self._abandon_landed(done, tenant, key, record))
            raise
        except BusError as exc:
            raise GatewayUnavailable(f"cannot record the idempotency key: {exc}") from exc
        try:
            await self._claims_passed(partition, offset)
        except BaseException:
            # The claim is on the log but no request will follow it here (the read-back timed out, or the
            # client left): once read, it is withdrawn if it won. Held, every retry with the key was a 409
            # for the claim's 24 hours, for a request never published (an audit).
            self._abandon(partition, offset, tenant, key, record)
            raise
        won = self._claims.get(tenant, claim.key_sha256, time.time() * 1000)
        if won is None:  # withdrawn meanwhile by its winner's failed publish: ours was after it
            raise GatewayUnavailable("the idempotency key was released by a failed request; retry")
        return IdempotencyRecord(request_id=won.request_id, body_hash=won.body_hash)

    async def forget_idempotent(self, tenant: str, key: str, record: IdempotencyRecord) -> None:
        """Withdraw this edge's winning claim of ``key`` (its request was never published)."""
        held = self._claims.get(tenant, key_digest(key), time.time() * 1000)
        if held is None or held.request_id != record.request_id:
            return
        self._claims.withdraw(tenant, held.key_sha256)
        try:
            await self._producer.publish_raw(self._names.idempotency, None, key=claim_key(tenant, key))
        except BusError:
            log.warning("could not withdraw the idempotency claim of %s", record.request_id, exc_info=True)

    async def _claims_passed(self, partition: int, offset: int) -> None:
        """Wait until the reader has applied the record at ``offset`` (and so every claim before it)."""
        if self._claims_read.get(partition, 0) > offset:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._claims_waiting.append((partition, offset, future))
        try:
            await asyncio.wait_for(future, self.CLAIM_WAIT_S)
        except TimeoutError as exc:
            raise GatewayUnavailable("the idempotency topic is not being read; retry") from exc

    def _on_claims(self, batch: list[Message]) -> None:
        """Claims reader thread: decode, then apply on the loop in one hop per batch."""
        read: list[tuple[int, int, bytes | None, IdempotencyClaim | None]] = []
        for message in batch:
            value, claim = message.value(), None
            if value is not None:
                try:
                    claim = decode_claim(value)
                except UNREADABLE_JSON:
                    log.warning("undecodable idempotency claim at offset %s", message.offset())
            read.append((message.partition() or 0, message.offset() or 0, message.key(), claim))
        loop = self._loop
        if read and loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._apply_claims, read)

    def _apply_claims(self, read: list[tuple[int, int, bytes | None, IdempotencyClaim | None]]) -> None:
        for partition, offset, key, claim in read:
            if claim is not None:
                self._claims.apply(claim)
            elif key is not None:  # a tombstone: the key's winner withdrew it
                tenant, _, digest = key.decode(errors="replace").partition("\x00")
                self._claims.withdraw(tenant, digest)
            self._claims_read[partition] = offset + 1
            if offset + 1 >= self._claims_ends.get(partition, 0):
                self._claims_ends.pop(partition, None)
        self._claims_reached([])
        self._withdraw_abandoned()
        waiting = []
        for partition, offset, future in self._claims_waiting:
            if self._claims_read.get(partition, 0) > offset:
                if not future.done():
                    future.set_result(None)
            elif not future.done():
                waiting.append((partition, offset, future))
        self._claims_waiting = waiting

    def _claims_ends_reached(self, reached: list[tuple[str, int]]) -> None:
        """Claims reader thread: partitions read to their ends, told to the loop after the batches before
        them (which reach it the same way)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._claims_reached, [part for _, part in reached])

    def _claims_reached(self, parts: list[int]) -> None:
        """Event loop: these partitions are read to where they ended at the start (by a record at the end,
        or by the position past a transaction's marker there); once all are, every key claimed before
        this edge started is known."""
        for part in parts:
            self._claims_ends.pop(part, None)
        if not self._claims_ends:
            self._claims_caught_up.set()

    def _abandon_landed(
        self, published: asyncio.Future[tuple[int, int]], tenant: str, key: str, record: IdempotencyRecord
    ) -> None:
        """A claim whose publish outlived its client, abandoned where it landed (if it did)."""
        if not published.cancelled() and published.exception() is None:
            self._abandon(*published.result(), tenant, key, record)

    def _abandon(self, partition: int, offset: int, tenant: str, key: str, record: IdempotencyRecord) -> None:
        """No request follows the claim at ``offset``: withdrawn once read (at once if it was), if it won."""
        self._abandoned.append((partition, offset, tenant, key, record))
        self._withdraw_abandoned()

    def _withdraw_abandoned(self) -> None:
        """Withdraw each abandoned claim the reader has passed (:meth:`forget_idempotent` withdraws only a
        claim that won its key)."""
        left = []
        for partition, offset, tenant, key, record in self._abandoned:
            if self._claims_read.get(partition, 0) > offset:
                task = asyncio.get_running_loop().create_task(self.forget_idempotent(tenant, key, record))
                self._withdrawing.add(task)
                task.add_done_callback(self._withdrawing.discard)
            else:
                left.append((partition, offset, tenant, key, record))
        self._abandoned = left

    # ---------------------------------------------------------------- replies

    def _on_replies(self, batch: list[Message]) -> None:
        """Event loop: decode a batch of this edge's replies and hand each to its stream."""
        decoded: list[tuple[int, Reply]] = []
        for message in batch:
            try:
                event = decode(message.value() or b"")
            except DecodeError:
                log.warning("undecodable reply at offset %s", message.offset())
                continue
            if isinstance(event, TokenChunk | RequestFinished):
                decoded.append((message.offset() or 0, event))
                self._own(event.request_id, event.tenant, message.offset())
        for offset, reply in decoded:
            stream = self._streams.get(reply.request_id)
            if stream is not None:
                stream.push(offset, reply)
            if isinstance(reply, RequestFinished) and self._finish_listeners:
                heard = self._finish_listeners.pop(reply.request_id, None)
                if heard is not None:
                    try:
                        heard[1](reply)
                    except Exception:
                        log.exception("a listener for request %s's end failed", reply.request_id)

    def when_finished(self, request_id: str, listener: Callable[[RequestFinished], None]) -> None:
        """:meth:`ingest.gateway.Gateway.when_finished`: forgotten unheard after :data:`FINISH_LISTEN_S`,
        and at most :data:`FINISH_LISTENERS` at once (the oldest go first)."""
        listeners, now = self._finish_listeners, time.monotonic()
        while listeners and (
            len(listeners) >= FINISH_LISTENERS or next(iter(listeners.values()))[0] < now - FINISH_LISTEN_S
        ):
            listeners.popitem(last=False)
        listeners[request_id] = (now, listener)

    # ---------------------------------------------------------------- the log

    def _offset_at(self, unix_ms: int, partition: int | None = None) -> int:
        partition = self.reply_to.partition if partition is None else partition
        consumer = Consumer(consumer_config(self._kafka, None, f"ingest-{self.edge_id}-seek"))
        try:
            return offset_at(consumer, self._names.replies, partition, unix_ms)
        finally:
            consumer.close()

    async def _on_log_reader(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on one of the log readers' threads (:attr:`LOG_READERS`)."""
        readers = self._log_readers
        if readers is None:
            raise GatewayUnavailable("this edge's gateway is not running; resume the stream elsewhere")
        return await asyncio.get_running_loop().run_in_executor(readers, functools.partial(fn, *args))

    async def read_log(
        self, request_id: str, start: int, partition: int | None = None
    ) -> AsyncIterator[tuple[int, Reply]]:
        """This request's replies from ``start`` on, until its terminal event (waits for live ones), on this
        edge's partition or another's."""
        consumer = Consumer(consumer_config(self._kafka, None, f"ingest-{self.edge_id}-log"))
        partition = self.reply_to.partition if partition is None else partition
        consumer.assign([TopicPartition(self._names.replies, partition, start)])
        try:
            while True:
                messages = await self._on_log_reader(consumer.consume, 500, 0.2)
                for message in messages:
                    if message.error() is not None:
                        continue
                    reply = _reply_of(message, request_id)
                    if reply is not None:
                        yield message.offset() or 0, reply
                        if isinstance(reply, RequestFinished):
                            return
        finally:
            await asyncio.to_thread(consumer.close)


def _reply_of(message: Message, request_id: str) -> Reply | None:
    try:
        event = decode(message.value() or b"")
    except DecodeError:
        return None
    if isinstance(event, TokenChunk | RequestFinished) and event.request_id == request_id:
        return event
    return None
