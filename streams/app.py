"""The streams worker: turns the event log into warehouse tables and the audit chain.

The sink reads the request topics, ``results``, ``cancels``, ``control``, ``usage`` and ``batches`` with a
librdkafka consumer on its own thread, in batches (``SLUICE_STREAMS_BATCH_SIZE`` events, or what arrived
within ``SLUICE_STREAMS_BATCH_MS`` of a batch's first event). For each batch it

1. builds the rows (:mod:`streams.sink`): ``events_raw``, ``request_facts``, ``drift_features`` and
   ``batches`` (each async batch's latest state);
2. extends each tenant's audit hash chain with the batch's terminal events (:mod:`streams.audit`),
   publishes the new entries on the ``audit`` topic and waits until they are durable;
3. inserts the rows and the entries, and only then commits the batch's offsets.

Every table is idempotent under redelivery, so a crash anywhere re-does at most one batch and double
counts nothing. The chain heads are anchored on the ``audit`` topic (:mod:`streams.anchor`): at start
the worker reads the topic to its end and goes on from each chain's last entry there, re-inserting into
``audit_log`` what the warehouse lacks (a crash between publishing and inserting, or a cut tail) and
withholding the rows of a chain the warehouse disagrees with. Each entry records the results offset it
came from, so an event delivered again after its entry was published is skipped. When a rebalance gives
the worker a ``results`` or ``control`` partition (two workers share the group in a rolling update), it
first reads what was appended to the topic since its last read: the other worker extended those chains.

Why not Faust tables and ``exactly_once``: we built the chain that way first. On Kafka 4.3.1 with
faust-streaming 0.15.3, after a ``kill -9`` the restarted worker repeated entries (offsets of a topic two
agents read commit later than the transaction) and, in other runs, left a partition unprocessed. The
design above needs neither.

Why not a Faust agent (what the sink was until issue 12): Faust and aiokafka deliver events one at a
time through Python, ~90 us of CPU per event with large buffers, where librdkafka's ``consume`` fills a
batch in C for ~4 us per event (``docs/streams.md``, Benchmark). The timers (control, drift, rollout) are
plain asyncio tasks.

Undecodable records go to the dead-letter topic with the reason; the sink keeps going.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple, ParamSpec

import msgspec
from clickhouse_connect.driver.client import Client
from confluent_kafka import Message
from confluent_kafka.admin import AdminClient
from opentelemetry.trace import Span, SpanKind

from bus.consumer import TP, ConsumerThread, consumer_config
from bus.control import read_placed
from bus.dead_letter import dead_letter_event
from bus.errors import BusError
from bus.positions import group_members
from bus.producer import EventProducer, Position
from infra.topics import make_admin
from monitoring import metrics, tracing
from schemas.codec import decode, encode, fits_record, headers, kafka_key
from schemas.events import (
    AuditEntry,
    BudgetStateChanged,
    BurnRateCrossed,
    DeploymentChanged,
    DriftRebaselined,
    DriftReport,
    Event,
    PricesChanged,
    RequestFinished,
    UsageRecorded,
    WorkersScaled,
    utc_now,
)
from schemas.lifecycle import AsyncComponent
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames, worker_group
from streams.anchor import (
    AUDIT_HEADS,
    ORIGIN,
    Anchored,
    AnchorError,
    Placed,
    TopicChain,
    advance,
    anchor_chains,
    audit_extent,
    audit_records,
    read_chains,
    resumed,
)
from streams.audit import AuditHead, admin_entry, audit_row, request_entry
from streams.control import SPEND_TODAY, Controller, WindowCounts, burn_sql
from streams.drift import Baseline, DriftMonitor, report_row
from streams.facts import usage_record
from streams.pricing import PriceHistory, PriceTable, PricingError
from streams.rollout import FAST_WINDOWS, RolloutController
from streams.settings import StreamsSettings
from streams.sink import Batch, Consumed, Rows, insert, query_rows

log = logging.getLogger(__name__)

SOURCE = "streams/worker"

REVOKE_WAIT_S = 30.0
REREAD_RETRY_S = (0.25, 2.0)
"""The first and the longest wait between tries of a read of the control or audit topic that the sink's
batch needs (:meth:`StreamsApp._until_read`): doubling, so a broker back in a few seconds is seen within
that, and a stop waits at most the longest."""
"""How long a revoke waits for the insert in flight, so the batch's offsets go out with it."""

LATEST_ACCEPTED = "SELECT max(toUnixTimestamp64Milli(accepted)) AS accepted_ms FROM request_facts"
"""When the latest request the warehouse holds a fact of was accepted (unix ms; 0 when it holds none)."""

CLOCK_ALLOWANCE = timedelta(minutes=10)
"""How far past this host's clock a new price table may come into force before its start warns."""


def sink_topics(names: TopicNames, request_topics: Sequence[str], *, decisions: bool = True) -> list[str]:
    """Every topic whose events the warehouse keeps (token chunks on ``replies`` are delivery only; the
    usage records on ``usage`` are the ledger's entries this worker derives from ``results``, whose
    ``request_facts`` rows hold the same numbers). The live worker writes the audit entries and drift
    reports it publishes itself (``decisions=False``); a replay reads them from their topics."""
    topics = [*request_topics, names.results, names.cancels, names.control, names.batches]
    return [*topics, names.audit, names.drift] if decisions else topics


def requests_pattern(names: TopicNames) -> str:
    """A subscription to every request topic, those made later too (librdkafka's ``^`` regex form; a new
    topic is picked up at the next metadata refresh, :data:`SINK_METADATA_REFRESH_MS`)."""
    return "^" + re.escape(names.requests_prefix) + ".+"


SINK_METADATA_REFRESH_MS = 30_000
"""How often the sink asks for the cluster's topics, so a request topic made while it runs is read within
this (librdkafka's default, 5 minutes)."""


P = ParamSpec("P")


def guarded(
    fail: Callable[[BaseException], object], work: Callable[P, Awaitable[None]]
) -> Callable[P, Awaitable[None]]:
    """``work`` (a timer) with whatever escapes it told to ``fail`` and raised again."""

    @functools.wraps(work)
    async def guard(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            await work(*args, **kwargs)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("streams: %s crashed", getattr(work, "__name__", work))
            fail(exc)
            raise

    return guard


async def every(interval_s: float, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` every ``interval_s`` seconds (the first time after one interval) until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        await work()


class Prepared(NamedTuple):
    """A batch ready to insert: its rows (audit entries durable on the topic), spans, entries made."""

    batch: Batch
    spans: list[Span]
    entries: int


def consumed(messages: Sequence[Message]) -> tuple[list[Consumed], dict[tuple[str, int], int]]:
    """The batch's records, and the offsets to commit once they are written: per partition, the one after
    its last record."""
    records: list[Consumed] = []
    ends: dict[tuple[str, int], int] = {}
    for message in messages:
        topic, partition, offset = message.topic() or "", message.partition() or 0, message.offset() or 0
        records.append(Consumed(topic, partition, offset, message.value() or b""))
        ends[(topic, partition)] = offset + 1
    return records, ends


class StreamsApp(AsyncComponent):
    """The sink's consumer thread and the timers. ``await start()`` / ``await stop()`` on the running loop.

    The sink reads with librdkafka (:class:`bus.consumer.ConsumerThread`, a member of the consumer group
    ``<prefix>-streams``): the polling thread takes a batch, hands it to :meth:`write` on the event loop,
    waits until it is written and only then commits its offsets. Every timer is guarded, as is the
    consumer: what escapes one is the app's failure (:meth:`fail`), so the process stops and its supervisor
    restarts it from the committed offsets instead of limping on without its sink or its controller.
    """

    def __init__(
        self,
        platform: PlatformSettings,
        settings: StreamsSettings,
        writer: Client,
        prices: PriceTable,
        producer: EventProducer,
        *,
        controller: Controller | None = None,
        request_topics: Sequence[str],
        app_id: str | None = None,
        on_batch: Callable[[Batch], None] | None = None,
    ) -> None:
        super().__init__()
        names = TopicNames(platform.topic_prefix)
        self.names = names
        self._writer = writer
        self._file_prices = prices
        self._prices_from = (
            f"SLUICE_STREAMS_PRICES_FILE={settings.streams_prices_file}"
            if settings.streams_prices_file
            else "the built-in demo prices (SLUICE_STREAMS_PRICES_FILE unset)"
        )
        """Where the file's table came from, for the messages that refuse it."""
        self.prices = PriceHistory(prices)
        """The price tables on the log (the file's is published at start when the log lacks its version)."""
        self._rows = Rows(self.prices, store_content=settings.streams_store_content, topics=names)
        self._producer = producer
        self._on_batch = on_batch
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warehouse-writer")
        self.group = app_id or f"{platform.topic_prefix}-streams"
        """The sink's consumer group (the Faust app of earlier versions committed under the same id)."""
        self.topics = sink_topics(names, [requests_pattern(names)], decisions=False)
        """What the sink subscribes to: every request topic by a pattern, not the ones there at start
        (``request_topics`` is what a replay reads). A review: a model added while the worker ran (its
        topic made by ``sluice topics apply``) never reached ``events_raw`` until a restart, for good past
        the topic's retention, and a replay of the same log had it."""
        self._sink: ConsumerThread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timers: list[asyncio.Task[None]] = []
        self._storing: asyncio.Task[Batch] | None = None
        """The insert of the batch before the one being prepared."""
        self._heads: dict[str, AuditHead] | None = None
        self._offsets: dict[str, dict[int, int]] = {}
        """Per chain, per source partition: the offset its last audit entry from there came from."""
        self._audit_read: dict[int, int] = {}
        """Per partition of the audit topic, the end up to which ``_heads`` and ``_offsets`` were read from it
        (entries this worker published since are in them too)."""
        self._anchored: set[TP] = set()
        """The ``results`` and ``control`` partitions whose chains' heads were read after this worker was last
        given them (polling thread): another worker may have extended those chains while it owned them."""
        self._control_losses = 0
        """How many times the sink has let go of the control partition (revoked or lost; polling thread)."""
        self._control_read: int | None = None
        """``_control_losses`` when the control topic was last read again while this worker held its
        partition (:meth:`reseed`): equal to it, that read came after the partition was last gained."""
        self._judging = False
        """Whether this worker's drift timer last ran as the judge (it exports the drift gauges)."""
        self._reseeding = asyncio.Lock()
        """One read of the control topic at a time (a timer and the sink may both find it due)."""
        self.audit_conflicts: dict[str, str] = {}
        """Chains whose warehouse rows disagree with the audit topic (why): their rows are withheld."""
        self._anchor_timeout_s = settings.streams_audit_anchor_timeout_s
        self._controller = controller
        self._last_batch_at: float | None = None
        self._last_batch_full = False
        self._stored_until: dict[TP, int] = {}
        """Per partition read: the latest ``finished`` time of a terminal event the sink has written from it
        (ms). Per partition, not over all of them: after a restart with a backlog, one tenant's ``results``
        partition is read up to now while another's is still an hour behind, and the latest finish over all
        of them let windows be judged without the late partition's rows (a review)."""
        self._rebaselined: dict[tuple[str, str], DriftRebaselined] = {}
        """The latest operator's rebaseline of each (model, version), from the control topic."""
        self._promoted: dict[tuple[str, str], datetime] = {}
        """When a rollout last promoted each (model, version) to all of its traffic, from the control topic:
        the version's baseline while it is the stable one, through the next rollout too."""
        self.drift = DriftMonitor(
            settings,
            self._read,
            self._publish_report,
            self.stored_until,
            self._baseline,
            may_judge=self._owns_control,
        )
        self.rollout = RolloutController(
            self._read,
            self._publish_deployment,
            interval_s=settings.rollout_eval_interval_s,
            drift_alpha=settings.drift_alpha,
            drift_null_tolerance=settings.drift_null_tolerance,
            fast_windows=controller.fast_windows if controller is not None else FAST_WINDOWS,
            members=self._members,
            may_decide=self._owns_control,
        )
        # Evaluations are due after sink batches; the rollout timer only runs one a batch left waiting.
        self._every: list[tuple[float, Callable[[], Awaitable[None]]]] = [
            (settings.drift_interval_s, self._drift),
            (settings.rollout_eval_interval_s, self._rollout),
        ]
        if controller is not None:
            self._every.append((settings.streams_control_interval_s, self._control))
        self._kafka = platform.kafka
        self._admin: AdminClient | None = None
        self._batch_size = settings.streams_batch_size
        self._within = settings.streams_batch_ms / 1000

    async def _start(self) -> None:
        await self.anchor()
        placed = await asyncio.to_thread(read_placed, self._kafka, self.names.control, f"{SOURCE}-start")
        control = [event for event, _ in placed]
        places = {event.id: at for event, at in placed}
        self.rollout.seed(control, places)  # resume where the log says
        self._observe_rebaselines(control)
        await self._follow_prices(control)
        self._seed_control(control)
        await self.drift.prepare()
        self._loop = asyncio.get_running_loop()
        for interval, work in self._every:
            task = asyncio.create_task(every(interval, guarded(self.fail, work)), name=work.__name__)
            self._timers.append(task)
        self._sink = ConsumerThread(
            consumer_config(
                self._kafka,
                self.group,
                f"{self.group}-sink",
                **{"topic.metadata.refresh.interval.ms": SINK_METADATA_REFRESH_MS},
            ),
            self._consume,
            subscribe=self.topics,
            name="streams-sink",
            batch_size=self._batch_size,
            linger_s=self._within,
            on_revoke=self._revoked,
            on_failure=self.fail,
        )
        await asyncio.to_thread(self._sink.start)

    async def _follow_prices(self, control: Iterable[Event]) -> None:
        """The price history from the control topic as read at start; the file's table published on it
        unless the log holds its version (:meth:`_publish_prices`)."""
        self.prices.observe(control)
        await self._publish_prices()

    async def _publish_prices(self) -> None:
        """Put the price file's table on the log, in force from now (or just after the latest table there,
        or the latest request already priced, whichever is later), unless the log holds its version: a published version never changes (a file that changed its
        prices but not its version is refused, or a rebuild could not tell which prices a row was priced
        by). Only a worker that runs alone
        publishes one: another streams worker would price by its old history until its sink read the new
        table, and the rows it wrote meanwhile would differ from a rebuild's (a review)."""
        table, now, latest = self._file_prices, utc_now(), self.prices.latest()
        published = self.prices.published(table.version)
        if published is not None and published != table:
            raise PricingError(
                f"price table {table.version!r} of {self._prices_from} is on the log with other prices: a "
                "published table never changes; give the new prices a new version (the file's `version`)"
            )
        if published is not None and latest is not None:
            if (current := latest[1]).version != table.version:
                # publishing it again would compact away when it was first in force
                raise PricingError(
                    f"price table {table.version!r} of {self._prices_from} was replaced by "
                    f"{current.version!r}: to price by it again, publish its prices under a new version (the "
                    "file's `version`)"
                )
            return
        others = await self._group_members(self.group)
        if others:  # None: the cluster cannot say; publishing will tell
            raise PricingError(
                f"price table {table.version!r} of {self._prices_from} is new, and a new table is published only by a streams "
                f"worker that runs alone: group {self.group} has {others} member(s) now. Stop the other "
                "streams worker first (one killed without a clean stop leaves the group within its session "
                "timeout, ~45s: `sluice up` starts this one again meanwhile)"
            )
        # after every table on the log, whatever this host's clock says: a table dated before the one in
        # force would be sorted behind it and never priced by (a review)
        effective = now if latest is None else max(now, latest[0] + timedelta(milliseconds=1))
        # and after every request already priced: a request is priced by when the edge accepted it (its
        # id's time, the edge's clock), so with an edge clock ahead of this host's, one the previous worker
        # priced by the old table would have been dated after the new one's start, and a replay (which knows
        # both tables) priced it by the new one (a review). Every fact a worker committed is in the
        # warehouse (it inserts before it commits), and this worker runs alone; one left uncommitted is
        # priced again by this worker, under the new history, as a replay prices it.
        priced = await self._latest_accepted()
        if priced is not None and priced >= effective:
            effective = priced + timedelta(milliseconds=1)
            if effective > now + CLOCK_ALLOWANCE:
                log.warning(
                    "prices: %s comes into force only at %s, after the latest request already priced (its "
                    "id dated %s by its edge); this host's clock says %s: an edge's clock is ahead",
                    table.version,
                    effective,
                    priced,
                    now,
                )
        event = PricesChanged(
            tenant="", model="", source=SOURCE, time=now, prices=table, effective=effective, actor="streams"
        )
        await self._producer.publish(self.names.control, event)
        self.prices.add(event)
        log.info("prices: %s published on %s, in force from %s", table.version, self.names.control, effective)

    async def _latest_accepted(self) -> datetime | None:
        """When the latest request the warehouse holds a fact of was accepted (None: it holds none)."""
        rows = await self._read(LATEST_ACCEPTED)
        millis = int(rows[0]["accepted_ms"]) if rows and rows[0]["accepted_ms"] is not None else 0
        return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=millis) if millis > 0 else None

    async def stop(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            try:  # on a thread: the sink may be waiting for a write on this loop
                await asyncio.to_thread(sink.stop)
            except BusError:
                log.warning("streams: the sink had failed", exc_info=True)  # already told (fail)
        storing, self._storing = self._storing, None
        if storing is not None:  # an insert the sink's last revoke did not wait for: left uncommitted
            await asyncio.gather(storing, return_exceptions=True)
        timers, self._timers = self._timers, []
        for task in timers:
            task.cancel()
        await asyncio.gather(*timers, return_exceptions=True)
        self._executor.shutdown(wait=True)

    @property
    def assigned(self) -> bool:
        return self._sink is not None and bool(self._sink.assignment())

    def _baseline(self, model: str, version: str) -> Baseline | None:
        """Since when ``version``'s drift references must date: its promotion to all of ``model``'s
        traffic (if a rollout promoted it and it still serves it), or an operator's rebaseline, the later."""
        deployment = self.rollout.deployments.get(model)
        since = None
        if deployment is not None and deployment.stable == version:
            # while the next rollout runs (or after it rolled back) the promotion still holds: its
            # references taken during its own canary (a share of the tenants) were kept for good, and every
            # window of the whole traffic was judged against them (a review)
            since = (
                deployment.step_started or deployment.time
                if deployment.phase == "promoted"
                else self._promoted.get((model, version))
            )
        promoted = Baseline.promoted(version, since) if since is not None else None
        rebaselined = self._rebaselined.get((model, version))
        return Baseline.latest(promoted, Baseline.rebaselined(rebaselined) if rebaselined else None)

    def _observe_rebaselines(self, events: Iterable[Event]) -> None:
        """Follow ``DriftRebaselined`` and promotions on the control topic (the log's order: the latest of
        a key holds)."""
        for event in events:
            if isinstance(event, DriftRebaselined):
                self._rebaselined[(event.model, event.version)] = event
            elif isinstance(event, DeploymentChanged) and event.phase == "promoted":
                self._promoted[(event.model, event.stable)] = event.step_started or event.time

    def _holds_control(self) -> bool:
        """Whether this streams worker's sink reads the control topic (one partition) now."""
        sink = self._sink
        return sink is not None and any(topic == self.names.control for topic, _ in sink.assignment())

    def _owns_control(self) -> bool:
        """Whether this worker holds the control partition and has read the control topic again since it
        was given it (:meth:`take_control`): only that one decides rollouts, judges drift and announces
        budgets. An audit: a second streams worker (two replicas in an overlap, two processes) decided too,
        double-published steps, and undid an operator's abort it never read. A review: the new owner
        decided from what it read at its own start until a record reached its sink (the only reader
        again then), so it announced a crossing its previous owner had announced, and never let in a
        tenant that owner had refused under a lower limit."""
        return self._holds_control() and self._control_read == self._control_losses

    async def take_control(self) -> bool:
        """:meth:`_owns_control`, reading the control topic again first when this worker holds its partition
        but has not read it since it was given it (:meth:`reseed`; a failed read raises). Every decision
        the partition's owner alone makes awaits this: the sink's timers fire whether records arrive or
        not, and on a quiet platform (a refused tenant sends nothing) none might come for good."""
        if self._holds_control() and self._control_read != self._control_losses:
            async with self._reseeding:
                if self._holds_control() and self._control_read != self._control_losses:
                    await self.reseed()
        return self._owns_control()

    async def _members(self, model: str, version: str) -> int | None:
        return await self._group_members(worker_group(model, version))

    async def _group_members(self, group: str) -> int | None:
        """How many members consumer group ``group`` has now (None: the cluster cannot say)."""
        if self._admin is None:
            self._admin = make_admin(self._kafka)
        return await asyncio.to_thread(group_members, self._admin, group)

    # ---------------------------------------------------------------- the sink

    def _consume(self, messages: list[Message]) -> None:
        """On the polling thread: hand a batch to the loop (:meth:`_pipelined`) and wait until it is
        prepared; its offsets are committed once it is written."""
        loop, sink = self._loop, self._sink
        if loop is not None and sink is None:
            return  # stopping: left uncommitted, for the next owner (it raised, and logged a traceback)
        if loop is None or sink is None:
            raise RuntimeError("the sink consumes before the app started")
        records, offsets = consumed(messages)
        gained = self._gained(sink.assignment())
        stored = functools.partial(sink.commit, offsets)  # by the polling thread before its next batch
        control = any(topic == self.names.control for topic, _ in gained)
        pipelined = self._pipelined(records, stored, reanchor=bool(gained), reseed=control)
        asyncio.run_coroutine_threadsafe(pipelined, loop).result()
        self._anchored |= gained

    def _gained(self, owned: set[TP]) -> set[TP]:
        """The ``results`` and ``control`` partitions among ``owned`` whose chains' heads have not been read
        since this worker was given them (polling thread)."""
        fed = (self.names.results, self.names.control)
        return {tp for tp in owned if tp[0] in fed} - self._anchored

    def _revoked(self, partitions: list[TP], lost: bool) -> None:
        """On the polling thread, before the group hands ``partitions`` on (or, ``lost``, after it did).

        Their chains' heads are read again if they come back (another worker may extend the chains
        meanwhile). Every batch handed to the loop has its audit entries durable on the topic already
        (:meth:`_consume` waits for that, and records fetched before the revoke are not handed over:
        :class:`~bus.consumer.ConsumerThread`), so nothing of these partitions is published after this
        returns; the next owner reads the topic after it. What waits is the last batch's insert: waited
        for here (up to :data:`REVOKE_WAIT_S`), so its offsets are committed with the revoke and the next
        owner starts after it. Past that, or when lost, they are left uncommitted: the next owner reads
        the batch again, and skips the events whose entries it finds on the topic.

        Losing the control partition ends this worker's reading of the control topic as its owner: given
        it again, it reads the topic again before it decides (:meth:`take_control`)."""
        self._anchored.difference_update(partitions)
        if any(topic == self.names.control for topic, _ in partitions):
            self._control_losses += 1
            self._let_go_of_judging()
        loop = self._loop
        if lost or loop is None or not loop.is_running():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._inserted(), loop).result(timeout=REVOKE_WAIT_S)
        except TimeoutError:
            log.warning(
                "streams: the last batch was not written within %.0f s of the revoke of %s; "
                "its offsets are left for the partitions' next owner",
                REVOKE_WAIT_S,
                sorted(partitions),
            )
        except RuntimeError:
            log.debug("streams: the event loop closed during a revoke", exc_info=True)

    async def _inserted(self) -> None:
        """Once the insert in flight (if any) has ended; its commit is queued by then (a failed one failed
        the app)."""
        storing = self._storing
        if storing is not None:
            await asyncio.wait([storing])

    async def _pipelined(
        self,
        records: Sequence[Consumed],
        on_stored: Callable[[], object],
        *,
        reanchor: bool = False,
        reseed: bool = False,
    ) -> None:
        """Prepare ``records`` (rows, audit entries durable on the topic) while the previous batch is
        still being inserted, wait for that insert, then start this batch's; ``on_stored`` runs once
        it is written. One insert at a time, in order, so offsets are committed in order, each after
        its batch's rows. A failed insert fails the app (nothing after it is committed). With
        ``reanchor``, the chain heads are read again first (:meth:`reanchor`); with ``reseed``, the
        control topic's state too, unless a timer already did since the partition was gained
        (:meth:`take_control`)."""
        if reseed:
            await self._until_read("reading the control topic again", self.take_control)
        if reanchor:
            await self._until_read("reading the audit chains' heads again", self.reanchor)
        prepared = await self._prepare(records)
        previous = self._storing
        if previous is not None:
            await previous  # raises what failed it
        task = asyncio.create_task(self._store(prepared))
        task.add_done_callback(functools.partial(self._stored, on_stored))
        self._storing = task

    async def _until_read(self, what: str, read: Callable[[], Awaitable[object]]) -> None:
        """``read`` (a read of the control or the audit topic a batch must follow), tried again while
        the cluster cannot answer it. A review: a broker gone for a moment as the sink took its first batch
        after a rebalance (as any outage longer than the session hands its partitions back) raised out of
        the batch, and the streams worker died: usage and audit stopped until a restart, and a restart
        failed while the broker was away. The batch cannot go on without the read (prices and deployments
        another owner followed; chain heads it extended), so it waits, its offsets uncommitted; a stop
        ends the wait."""
        wait, longest = REREAD_RETRY_S
        while True:
            try:
                await read()
                return
            except BusError as exc:
                if self._sink is None:
                    raise  # stopping: the batch is left uncommitted, for the next owner
                log.warning("streams: %s failed (%s); trying again in %.2f s", what, exc, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, longest)

    def _stored(self, on_stored: Callable[[], object], task: asyncio.Task[Batch]) -> None:
        if task.cancelled():
            return
        failed = task.exception()
        if failed is not None:
            log.error("streams: writing a batch failed", exc_info=failed)
            self.fail(failed)
            return
        on_stored()

    async def write(self, records: Sequence[Consumed]) -> Batch:
        """Rows and audit entries for ``records``, durable before returning (so their offsets may then
        be committed)."""
        return await self._store(await self._prepare(records))

    async def _prepare(self, records: Sequence[Consumed]) -> Prepared:
        """The rows of ``records`` and their audit entries, published and durable on the audit topic."""
        batch = self._rows.batch(records)
        self._last_batch_at = time.monotonic()
        self._last_batch_full = len(records) >= self._batch_size
        spans = self._spans(batch)
        entries = await self._chain(batch)
        withheld = self.audit_conflicts
        batch.audit += [audit_row(entry) for entry, _, _ in entries if entry.tenant not in withheld]
        raw_row, audit = self._rows.raw_row, self.names.audit
        batch.raw += [raw_row(entry, audit, *where, encoded=value) for entry, value, where in entries]
        return Prepared(batch, spans, len(entries))

    async def _store(self, prepared: Prepared) -> Batch:
        """Insert a prepared batch, then count it, dead-letter what could not be decoded and let the
        rollout controller see its outcomes."""
        batch, spans, entries = prepared
        began = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(self._executor, insert, self._writer, batch)
        written = time.time()
        metrics.STREAMS_INSERT_SECONDS.observe(time.perf_counter() - began)
        metrics.STREAMS_BATCH_SIZE.observe(len(batch))
        metrics.STREAMS_AUDIT_ENTRIES.inc(entries)
        if entries:
            metrics.STREAMS_EVENTS.labels(self.names.audit, "audit_entry").inc(entries)
        for span in spans:
            span.end()
        kinds: Counter[tuple[str, str | int | None]] = Counter()
        freshness = metrics.STREAMS_FRESHNESS.observe
        marks = self._stored_until
        now_ms = int(written * 1000)  # a finish dated later (a wrong clock, or hostile) counts as now:
        for record, event in batch.events:  # it pinned the drift watermark at its date
            if isinstance(event, RequestFinished):
                finished_ms = min(int((event.timings.finished or event.time).timestamp() * 1000), now_ms)
                where = (record.topic, record.partition)
                marks[where] = max(marks.get(where, 0), finished_ms)
            kinds[(record.topic, type(event).__struct_config__.tag)] += 1
            freshness(max(0.0, written - event.time.timestamp()))
        for (topic, kind), count in kinds.items():
            metrics.STREAMS_EVENTS.labels(topic, kind).inc(count)
        # durable before the batch's offsets are committed (a crash in between would lose them)
        await asyncio.gather(
            *(
                self._producer.publish(
                    self.names.deadletter,
                    dead_letter_event(
                        SOURCE, (record.topic, record.partition, record.offset), record.value, exc
                    ),
                )
                for record, exc in batch.undecodable
            )
        )
        if self._on_batch is not None:
            self._on_batch(batch)
        places = {
            e.id: (r.partition, r.offset)
            for r, e in batch.events
            if isinstance(e, DeploymentChanged) and r.topic == self.names.control
        }
        self.rollout.observe((event for _, event in batch.events), places)
        self._observe_rebaselines(e for r, e in batch.events if r.topic == self.names.control)
        await self._rollout()
        return batch

    def _spans(self, batch: Batch) -> list[Span]:
        """One ``process`` span per terminal event, a child of the worker's publish span."""
        spans: list[Span] = []
        if not tracing.recording():
            return spans  # tracing is off: skip building attributes for no-op spans
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
        """Evaluate budgets and burn rates on the warehouse; publish what changed on ``control``. Only the
        worker whose sink reads the control topic announces (as only it decides rollouts): two workers in
        an overlap each announced a crossing (two audit entries), and a retiring replica's word, under the
        budgets file it was started with, stayed last on the log (a review: a raised limit undone). A worker
        just given the partition reads the control topic first (:meth:`take_control`): the budget and burn
        states its previous owner announced are compared, not those this worker read at its start."""
        controller = self._controller
        if controller is None or not await self._taken("control"):
            return
        try:
            spend = await self._read(SPEND_TODAY)
            burns: list[dict[str, Any]] = []
            for minutes in controller.windows:
                burns += await self._read(burn_sql(minutes))
        except Exception:
            log.exception("control: reading the warehouse failed; trying again next interval")
            return
        events = controller.budgets({r["tenant"]: int(r["spent"]) for r in spend})
        events += controller.burn(
            {(r["model"], int(r["minutes"])): WindowCounts(int(r["bad"]), int(r["total"])) for r in burns}
        )
        for event in events:
            try:
                await self._producer.publish(self.names.control, event)
            except BusError:
                log.exception("control: publishing %s failed; announcing it again next interval", event)
                controller.unannounced(event)
                continue
            log.info("control: %s", event)

    SINK_IDLE_S = 5.0

    def stored_until(self) -> int | None:
        """The drift monitor's watermark: None when the sink has caught up with the log (its last batch
        was not full, or nothing came for a while although it holds its partitions, or every ``results``
        partition it holds is read to its end); otherwise the earliest, over the ``results`` partitions
        still behind, of the latest finish time written from each, so windows wait for the rows of the
        slowest partition. A partition is behind while its consumer lag is not 0 (or not known yet:
        librdkafka's statistics come every few seconds); one with nothing written yet holds every window."""
        idle = self._last_batch_at is None or time.monotonic() - self._last_batch_at > self.SINK_IDLE_S
        if (idle and self.assigned) or (not idle and not self._last_batch_full):
            return None
        sink = self._sink
        if sink is None:  # not started (tests): every partition written from counts as behind
            behind = set(self._stored_until)
        else:
            lags = sink.lag()
            results = self.names.results
            behind = {tp for tp in sink.assignment() if tp[0] == results and lags.get(tp) != 0}
        if not behind:
            return None
        return min(self._stored_until.get(tp, 0) for tp in behind)

    async def _read(self, sql: str) -> list[dict[str, Any]]:
        """A query on the writer's thread (the warehouse client is used from one thread at a time)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, query_rows, self._writer, sql)

    async def _publish_report(self, report: DriftReport) -> None:
        """Durable on the drift topic first, then its ``drift_reports`` and ``events_raw`` rows."""
        where = await self._producer.publish(self.names.drift, report)
        stored = decode(encode(report))  # the rows a replay builds from the topic, by construction
        if not isinstance(stored, DriftReport):
            raise TypeError(f"a drift report decoded as {type(stored).__name__}")
        batch = Batch(
            reports=[report_row(stored)], raw=[self._rows.raw_row(stored, self.names.drift, *where)]
        )
        await asyncio.get_running_loop().run_in_executor(self._executor, insert, self._writer, batch)
        metrics.STREAMS_EVENTS.labels(self.names.drift, "drift_report").inc()

    async def _publish_deployment(self, event: DeploymentChanged) -> Position:
        """A rollout decision, durable on the control topic (the sink then stores and chains it); where."""
        return await self._producer.publish(self.names.control, event)

    async def _taken(self, timer: str) -> bool:
        """:meth:`take_control` for a timer: a failed read of the control topic is logged, and the timer
        skips this round (it is tried again at the next)."""
        try:
            return await self.take_control()
        except Exception:
            log.exception("%s: reading the control topic again failed; trying again next interval", timer)
            return False

    async def _rollout(self) -> None:
        """Run the rollout decisions that are due; only the control partition's owner decides
        (``may_decide``), once it has read the control topic since it was given it."""
        if not await self._taken("rollout"):
            return
        try:
            await self.rollout.run_due()
        except Exception:
            log.exception("rollout: publishing a decision failed; trying again")

    async def _drift(self) -> None:
        """Evaluate the drift windows that closed; a failure is logged and retried next interval. Only the
        worker whose sink reads the control topic judges (as only it decides rollouts): it follows the
        promotions and rebaselines a verdict depends on, and two workers' reports of one window share an
        id, so a second judge with older state made one of two verdicts win at random (a review)."""
        if not await self._taken("drift"):
            if self._judging:  # also here: a verdict recorded just as the partition was revoked
                self._judging = False
                self._let_go_of_judging()
            return
        self._judging = True
        try:
            await self.drift.run_once()
        except Exception:
            log.exception("drift: evaluating windows failed; trying again next interval")

    @staticmethod
    def _let_go_of_judging() -> None:
        """What this worker exports as the judge of drift and rollout gates goes: the new owner exports its
        own. The alerts take the ``max`` over workers, so a drift verdict of 1 kept by a worker that no
        longer judges fired for as long as it lived (a review); the gate states are the dashboards'."""
        metrics.forget_drift()
        metrics.ROLLOUT_GATE_STATE.clear()

    async def _chain(self, batch: Batch) -> list[tuple[AuditEntry, bytes, Position]]:
        """The batch's new audit entries, in order, published and durable on the audit topic, each with
        its record value and the (partition, offset) it was stored at; before them, each new result's usage
        record (the cost ledger's entry) on the usage topic."""
        todo = [(record, event) for record, event in batch.events if self._audited(record, event)]
        if not todo:
            return []
        if self._heads is None:
            await self.anchor()
        heads = self._heads
        if heads is None:
            raise RuntimeError("the audit chains were anchored, yet have no heads")
        entries: list[AuditEntry] = []
        usage: list[UsageRecorded] = []
        for record, event in todo:
            chain = chain_of(event)
            reached = self._offsets.setdefault(chain, {})
            if record.offset <= reached.get(record.partition, -1):
                continue  # delivered again after its entry was stored
            origin = {ORIGIN: f"{record.partition}:{record.offset}"}
            entry = (
                request_entry(heads.get(chain), event, source=SOURCE, extra=origin)
                if isinstance(event, RequestFinished)
                else admin_action(heads.get(chain), chain, event, origin)
            )
            heads[chain] = AuditHead(seq=entry.seq, entry_hash=entry.entry_hash)
            reached[record.partition] = record.offset
            entries.append(entry)
            if isinstance(event, RequestFinished):
                bill = usage_record(event, self.prices, source=SOURCE)
                if bill is not None:
                    usage.append(bill)
        # The ledger's entries first: a result is read again until its audit entry is durable, so one whose
        # usage record went out and whose entry did not is billed again, under the same id (never lost).
        await self._producer.publish_many(
            self.names.usage, [(encode(bill), kafka_key(bill), headers(bill)) for bill in usage]
        )
        values = [encode(entry) for entry in entries]
        return list(zip(entries, values, await self._publish(entries, values), strict=True))

    async def anchor(self) -> Anchored:
        """Load every chain's head from the audit topic and heal ``audit_log`` where it is behind
        (:func:`streams.anchor.anchor_chains`); on the writer's thread. Called at start."""
        loop = asyncio.get_running_loop()
        anchored, self._audit_read = await loop.run_in_executor(self._executor, self._anchor)
        self._heads = dict(anchored.heads)
        self._offsets = {chain: dict(reached) for chain, reached in anchored.offsets.items()}
        self.audit_conflicts = dict(anchored.conflicts)
        metrics.STREAMS_AUDIT_CONFLICTS.set(len(anchored.conflicts))
        for chain, (first, last) in anchored.healed.items():
            metrics.STREAMS_AUDIT_HEALED.inc(last - first + 1)
            log.warning(
                "audit: chain %r: the warehouse was behind the audit topic; seq %d..%d re-inserted from it",
                chain,
                first,
                last,
            )
        for problem in anchored.topic_problems:
            log.error("audit: chain %r: seq %d: %s", problem.tenant, problem.seq, problem.reason)
        for chain, reason in anchored.conflicts.items():
            log.error(
                "audit: chain %r disagrees with the audit topic: %s. Its entries go on from the topic's "
                "head, their audit_log rows are withheld until resolved (docs/streams.md, Audit log)",
                chain,
                reason,
            )
        log.info(
            "audit: %d chains anchored on %s (%d entries read)",
            len(anchored.heads),
            self.names.audit,
            anchored.entries,
        )
        return anchored

    def _anchor(self) -> tuple[Anchored, dict[int, int]]:
        """The chains anchored, and the end of the audit topic they were read to."""
        rows = query_rows(self._writer, AUDIT_HEADS)
        try:
            extent = audit_extent(self._kafka, self.names.audit, f"{SOURCE}-anchor")
        except AnchorError:
            log.warning("audit: no %s topic: the chains go on from the warehouse's heads", self.names.audit)
            return anchor_chains(rows, lambda: (), self._heal), {}

        def records() -> Iterator[Placed]:
            return audit_records(self._kafka, extent, f"{SOURCE}-anchor", timeout_s=self._anchor_timeout_s)

        return anchor_chains(rows, records, self._heal), dict(extent[1])

    def _seed_control(self, control: list[Event]) -> None:
        """The budget and burn states last announced, from the log itself: the warehouse may not hold the
        last one yet (a process stopped right after announcing it), and a state the controller does not
        know was announced is never announced back (a raised limit would leave the tenant refused)."""
        if self._controller is not None:
            self._controller.seed(
                {e.tenant: e.exhausted for e in control if isinstance(e, BudgetStateChanged)},
                {(e.model, e.window): e.firing for e in control if isinstance(e, BurnRateCrossed)},
            )

    async def reseed(self) -> None:
        """Read the control topic to its end again and follow what this worker missed: given the control
        partition, it reads on from where its previous owner committed, and what that one read since this
        worker started (a deployment, an operator's drift rebaseline) was never this worker's (a review:
        the rebaseline was lost in a rolling update). Positions make it idempotent (the rollout controller
        keeps the later of two places; a rebaseline's key keeps the latest). Begun while this worker holds
        the control partition, it makes the worker its owner (:meth:`_owns_control`), unless the partition
        was let go of meanwhile."""
        losses = self._control_losses  # before the partition is looked at: a loss after it counts
        held = self._holds_control()
        placed = await asyncio.to_thread(read_placed, self._kafka, self.names.control, f"{SOURCE}-reseed")
        control = [event for event, _ in placed]
        self.rollout.seed(control, {event.id: at for event, at in placed})
        self._observe_rebaselines(control)
        self.prices.observe(control)
        self._seed_control(control)  # announced by the previous owner since: compared with the log's word
        if held:
            # Another worker may have judged drift windows since this one last did: the monitor loads
            # what was reported from the warehouse again, rather than judge them again (a review).
            self.drift.forget()
            self._control_read = losses

    async def reanchor(self) -> None:
        """Bring every chain's head up to the audit topic's end now, before records of partitions this
        worker was just given are chained: while another worker owned them it extended their chains, and
        going on from heads read earlier forked them (an audit: two streams workers in one group, as in a
        rolling update). Reads only what was appended since the last read (:func:`~streams.anchor.resumed`);
        it runs after the assignment, so after the previous owner's revoke, whose entries are durable by
        then (:meth:`_revoked`). The warehouse is not compared again: the previous owner inserts its
        entries, and the next start heals what a crash left out (``anchor``)."""
        if self._heads is None:
            await self.anchor()
            return
        began = time.perf_counter()
        chains, read, ends = await asyncio.to_thread(self._catch_up, dict(self._audit_read))
        moved = sum(1 for name, chain in chains.items() if chain.head != self._heads.get(name))
        advance(self._heads, self._offsets, chains)
        self._audit_read = ends
        for chain in chains.values():
            if chain.problem is not None:
                log.error("audit: chain %r: seq %d: %s", chain.chain, chain.problem.seq, chain.problem.reason)
        log.info(
            "audit: heads read again on %s for partitions gained: %d entries appended since, %d chains moved "
            "on (%.0f ms)",
            self.names.audit,
            read,
            moved,
            (time.perf_counter() - began) * 1000,
        )

    def _catch_up(self, read: dict[int, int]) -> tuple[dict[str, TopicChain], int, dict[int, int]]:
        """The chains as the audit topic's entries past ``read`` (per partition) leave them, how many entries
        that was, and the topic's end now."""
        try:
            extent = audit_extent(self._kafka, self.names.audit, f"{SOURCE}-anchor")
        except AnchorError:
            return {}, 0, read
        since = resumed(extent, read)
        records = audit_records(self._kafka, since, f"{SOURCE}-anchor", timeout_s=self._anchor_timeout_s)
        chains, count = read_chains(records)
        return chains, count, dict(extent[1])

    def _heal(self, placed: Sequence[Placed]) -> None:
        """Insert entries read from the audit topic: their ``audit_log`` and ``events_raw`` rows."""
        batch = Batch(
            audit=[audit_row(entry) for entry, _, _ in placed],
            raw=[self._rows.raw_row(entry, self.names.audit, p, o) for entry, p, o in placed],
        )
        insert(self._writer, batch)

    async def _publish(self, entries: Sequence[AuditEntry], values: Sequence[bytes]) -> list[Position]:
        """Produce every entry (``values``: their encoded form), then wait once for all of them to be
        durable (one wake-up per batch)."""
        records = [
            (value, kafka_key(entry), headers(entry)) for entry, value in zip(entries, values, strict=True)
        ]
        return await self._producer.publish_many(self.names.audit, records)

    def _audited(self, record: Consumed, event: Event) -> bool:
        """Terminal events from ``results`` and administrative state changes from ``control``."""
        if record.topic == self.names.results:
            return isinstance(event, RequestFinished)
        return record.topic == self.names.control and isinstance(
            event, BudgetStateChanged | DeploymentChanged | WorkersScaled | DriftRebaselined | PricesChanged
        )


def chain_of(event: Event) -> str:
    """Whose chain an entry extends: the tenant's for its requests; ``admin:<control key>`` for an
    administrative change (one partition feeds each chain, so its order is the log's)."""
    if isinstance(event, RequestFinished):
        return event.tenant
    return f"admin:{kafka_key(event).decode()}"


def admin_action(head: AuditHead | None, chain: str, event: Event, origin: dict[str, str]) -> AuditEntry:
    """The entry for a budget decision, a deployment change or a scaling decision on the control topic."""
    if isinstance(event, BudgetStateChanged):
        action, resource = "budget.enforce", f"tenant:{event.tenant}"
        decision = "exhausted" if event.exhausted else "within_budget"
        details = {"limit_micros": str(event.limit_micros), "spent_micros": str(event.spent_micros)}
    elif isinstance(event, DeploymentChanged):
        action, resource, decision = f"model.{event.action}", f"model:{event.model}", event.version
        details = {
            "reason": event.reason,
            "traffic": json.dumps(event.traffic, sort_keys=True),
            "phase": event.phase,
            "stable": event.stable,
            "actor": event.actor,
            "evidence": msgspec.json.encode(event.evidence).decode(),
        }
    elif isinstance(event, WorkersScaled):
        action, resource, decision = "workers.scale", f"model:{event.model}", str(event.replicas)
        details = {
            "reason": event.reason,
            "version": event.version,
            "previous": str(event.previous),
            "lag": str(event.lag),
            "target_lag": str(event.target_lag),
            "bounds": f"{event.bounds[0]}..{event.bounds[1]}",
            "actor": event.actor,
        }
    elif isinstance(event, DriftRebaselined):
        action, resource, decision = "drift.rebaseline", f"model:{event.model}", event.version
        details = {"reason": event.reason, "actor": event.actor}
    elif isinstance(event, PricesChanged):
        action, resource, decision = "prices.publish", f"prices:{event.prices.version}", event.prices.version
        details = {
            "effective": event.effective.isoformat(),
            "prices": msgspec.json.encode(event.prices, order="sorted").decode(),
            "actor": event.actor,
        }
    else:
        raise TypeError(f"{type(event).__name__} is not an administrative change")

    def entry(details: dict[str, str]) -> AuditEntry:
        return admin_entry(
            head,
            tenant=chain,
            actor=event.source,
            action=action,
            resource=resource,
            decision=decision,
            details=details,
            source=SOURCE,
            model=event.model,
            time=event.time,
            entry_id=event.id,
        )

    details |= origin
    made = entry(details)
    if fits_record(encode(made)):
        return made
    # An entry escapes what it quotes again (a JSON detail in JSON): a change that fit one record could
    # make an entry that does not, which the audit topic refused, again at every redelivery.
    return entry({key: _cut(value) for key, value in details.items()})


DETAIL_CHARS = 4096
"""What an audit entry keeps of one detail when the whole entry would not fit a record."""


def _cut(value: str) -> str:
    if len(value) <= DETAIL_CHARS:
        return value
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{value[:DETAIL_CHARS]}... (cut to {DETAIL_CHARS} of {len(value)} characters; sha256 {digest})"
