"""The worker's I/O shell: Kafka in, one model thread, Kafka out, offsets committed after durability.

Threads: a consumer thread (the model's consumer group), a cancel listener (every partition of the cancel
topic, no group: every worker hears every cancel), the producer's delivery thread, and exactly ONE model
thread that owns the runner (scheduler + engine) and all bookkeeping. Everything reaches the model thread
through one bounded inbox, so the runner is a plain synchronous object (see :mod:`gpu_workers.runtime`; the terminal events'
helpers are :mod:`gpu_workers.terminal`).

Invariants kept here, for every runner:
- each accepted request ends in exactly one terminal event (``RequestFinished``), published to the
  request's reply partition and to the results topic;
- a request's offset is committed only once that terminal event is durable (both topics);
- a redelivered request whose terminal event exists is not run again (the results topic is read at start);
- a record that does not decode goes to the dead-letter topic and the worker keeps going.
"""

from __future__ import annotations

import heapq
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import msgspec
from confluent_kafka import Consumer, KafkaException, Message, TopicPartition
from opentelemetry.trace import Status, StatusCode

from bus.consumer import BACKGROUND, TP, ConsumerThread, consumer_config
from bus.control import control_start, latest_deployments
from bus.dead_letter import Junk, Letter, Why, decode_or_junk, junk_of
from bus.errors import BusError
from bus.positions import offset_at, read_to_end, start_at_peers, uncommitted_since, watermarks
from bus.producer import EventProducer, Position
from gpu_workers import GpuWorkerError, StartCancelled
from gpu_workers.features import FeatureProbe, Vector
from gpu_workers.ledger import RecordLedger
from gpu_workers.observe import WorkerObserver, open_trace
from gpu_workers.runtime import Arrival, Emitter, Origin, Request, Runner
from gpu_workers.terminal import finished_by, too_large, with_features, with_request
from monitoring import tracing
from monitoring.ops import Readiness
from schemas.codec import DecodeError, Event, decode, encode, fits_record, headers, kafka_key, record_size
from schemas.deployments import Deployment
from schemas.events import (
    BatchItemRequested,
    BatchRef,
    CancelRequested,
    DeploymentChanged,
    EmbeddingRequested,
    ErrorInfo,
    GenerationRequested,
    RequestFinished,
    Timings,
    TokenChunk,
    Usage,
    WorkerReady,
    utc_now,
)
from schemas.lifecycle import Component
from schemas.manifest import ManifestError
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames, worker_group

log = logging.getLogger(__name__)

VERSION_RETIRED_CODE = "version_retired"
"""A streamed request cut part-way when its version stopped serving (retriable)."""


@dataclass(frozen=True)
class _Durable:
    """A request's terminal event is durable (or it ended on another worker): its record, and every
    duplicate record of it that waited for it (``_followers``), may be committed."""

    request_id: str
    tp: TP
    offset: int
    generation: int


@dataclass(frozen=True)
class _Undelivered:
    """A terminal event whose results copy Kafka did not take: never committed; the worker fails, and its
    next start runs the request again unless the copy was written after all."""

    request_id: str
    tp: TP
    generation: int


@dataclass(frozen=True)
class _Uncommitted:
    """A commit the broker refused: offered again by the next ``_commit``."""

    offsets: dict[TP, int]


@dataclass(frozen=True)
class _Skip:
    """A record with nothing to run. ``junk``: it does not decode, and is dead-lettered when the model thread
    takes it, if its partition is still this worker's (a letter sent on the way in, for a record whose
    partition then went, was sent again by the next owner); ``letter``: that letter, and the record is
    done once it is durable (``_Lettered``), not before: a crash in between would lose it from the dead
    letters."""

    tp: TP
    offset: int
    generation: int = 0
    junk: Junk | None = None
    letter: Letter | None = None


@dataclass(frozen=True)
class _Lettered:
    """A dead-lettered record's letter landed (``error`` None) or did not (sent again, the record held)."""

    skip: _Skip
    error: BusError | None


@dataclass(frozen=True)
class _Cancel:
    request_id: str


@dataclass(frozen=True)
class _Deploy:
    deployment: Deployment
    event_id: str


_Inbox = Arrival | _Skip | _Cancel | _Deploy
Placement = Literal["run", "hold", "adopt", "drop"]


class WorkerService(Component):
    """Serve one model from its request topic. ``start()``/``stop()`` or ``with``.

    The worker fails (:attr:`failure`, told to :meth:`watch`-ers) when its model thread or any of its
    Kafka threads (requests, cancels, the results tail, control) dies: it cannot keep its invariants
    without each of them, so its supervisor stops it and starts it again."""

    def __init__(
        self,
        *,
        model_id: str,
        worker_id: str,
        kafka: KafkaConnection,
        names: TopicNames,
        runner_factory: Callable[[], Runner],
        inbox_size: int = 1024,
        remember_finished: int = 100_000,
        consumer_overrides: dict[str, object] | None = None,
        probe_factory: Callable[[], FeatureProbe] | None = None,
        version: str = "",
        adopt_grace_s: float = 10.0,
        start_timeout_s: float = 120.0,
        standby: bool = False,
        ready_max_lag: int = 10_000,
    ) -> None:
        """With ``standby``, ``start`` loads the model and follows results, cancels and deployments but
        joins no group: a warm worker that :meth:`join` puts to work at once."""
        super().__init__()
        self.model_id = model_id
        self.standby = standby
        self._start_timeout_s = start_timeout_s
        self._ready_max_lag = ready_max_lag
        """The request lag under which this worker says it is ready (``/readyz``, ``WorkerReady``)."""
        self.version = version
        """The model version this worker runs ("" : any, and no deployment is followed)."""
        self._adopt_grace_s = adopt_grace_s
        self._letters_again: list[tuple[float, _Skip]] = []
        """Dead-lettered records whose letter Kafka did not take, and when to send it again (model thread)."""
        self._deployment: Deployment | None = None
        """The model's latest deployment (model thread); None before any rollout: run every record."""
        self._deployment_id = ""
        """The id of the ``DeploymentChanged`` behind ``_deployment`` (model thread)."""
        self._announce = bool(version)
        """Say ``WorkerReady`` once this worker owns request partitions: at its start, and again for every
        rollout that starts warming its version (model thread)."""
        self._held: dict[str, Arrival] = {}
        """Records routed to another version still serving: not run here, their offsets kept open until
        the results tail shows them finished, or their version stops serving (model thread)."""
        self._left_serving: dict[str, float] = {}
        """Version -> when this worker learned it no longer serves (its records are adopted after the grace;
        this worker's own: what still runs here is cut at half of it)."""
        self._next_sweep = 0.0
        self._skipped: Counter[str] = Counter()
        """Records not run since the last summary, by why (model thread; :meth:`_say_skipped`)."""
        self._skipped_since = 0.0
        self.worker_id = worker_id
        self.source = f"gpu_workers/{worker_id}"
        self._names = names
        self._kafka = kafka
        self._runner_factory = runner_factory
        self._probe_factory = probe_factory
        self._probe: FeatureProbe | None = None
        self._inbox: queue.Queue[_Inbox] = queue.Queue(maxsize=inbox_size)
        # Unbounded but holds at most one entry per request in flight; filled by the producer's thread.
        self._durable: queue.SimpleQueue[_Durable | _Undelivered | _Uncommitted | _Lettered] = (
            queue.SimpleQueue()
        )
        self._finished: OrderedDict[str, None] = OrderedDict()
        self._live: dict[str, Arrival] = {}
        """Requests handed to the runner and not yet ended (model thread only)."""
        self._early_cancels: OrderedDict[str, float] = OrderedDict()
        """Cancels that arrived before their request (another consumer thread): id -> when, bounded."""
        self._remember = remember_finished
        self._ledger = RecordLedger()
        """Which records are stale, running or done, and so what may be committed (every thread)."""
        self._releases: queue.SimpleQueue[tuple[frozenset[TP], int]] = queue.SimpleQueue()
        """Partitions being revoked and the generation of that revoke, for the model thread to give back
        their requests (consumed before it) not yet started."""
        self._followers: dict[str, list[Arrival]] = {}
        """Request id -> the same record of a request consumed again while it ran here or its terminal
        event was on its way (a lost partition given back to this worker redelivers what still runs):
        committed once that terminal event is durable, never before (model thread). Another record of the
        same request (a re-published line, maybe on another partition) is released at once: its request's
        own record holds that record's partition back, and following it would tie two partitions' revokes
        together (a review: a duplicate on another partition ended twice or stalled a revoke)."""
        self._publishing: dict[str, tuple[TP, int]] = {}
        """Requests whose terminal event is produced and not yet durable -> their record (model thread)."""
        self._again: list[_Inbox] = []
        """Records to take again (followers of a request given back): before the inbox (model thread)."""
        self._pending_writes: dict[str, int] = {}
        self._producer = EventProducer(kafka, self.source)
        self._observer = WorkerObserver(model_id, worker_id)
        self._chunks_lost, self._chunks_lost_told = 0, -self.CHUNK_WARNING_EVERY_S
        # One consumer group per version: each reads the whole topic and runs what is routed to it.
        self.group = worker_group(model_id, version)
        overrides = dict(consumer_overrides or {})
        self._requests = ConsumerThread(
            consumer_config(kafka, self.group, self.source, **overrides),
            self._on_requests,
            subscribe=[names.requests(model_id)],
            on_revoke=self._on_revoke,
            name=f"requests-{model_id}",
            on_failure=self.fail,
        )
        self._cancels: ConsumerThread | None = None
        self._control: ConsumerThread | None = None
        self._results_tail: ConsumerThread | None = None
        self._finished_elsewhere: queue.SimpleQueue[str] = queue.SimpleQueue()
        """Request ids whose terminal event the results tail saw (filled by its thread)."""
        self._stop = threading.Event()
        self._draining = threading.Event()
        """Set by :meth:`drain`: records not yet started are left for the partitions' next owner."""
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_cancelled = threading.Event()
        """Set (a stop signal) to give up a :meth:`start` still waiting for the model to load."""

    # ---------------------------------------------------------------- lifecycle

    def _start(self) -> None:
        """Load the model, learn which requests already finished, then start consuming."""
        timeout = self._start_timeout_s
        self._producer.start()
        if self.version:
            self._follow_deployments()
            self._start_at_peers()  # first here: where it starts bounds the results it learns from
        ends = self._learn_finished()
        # Then keep learning: another worker may finish a request whose record this one is handed after a
        # rebalance (its offset was not committed yet); without the tail it would run a second time.
        self._results_tail = ConsumerThread(
            consumer_config(self._kafka, None, f"{self.source}-results", **BACKGROUND),
            self._on_results,
            assign=[TopicPartition(self._names.results, p, end) for p, end in ends.items()],
            name=f"results-{self.model_id}",
            on_failure=self.fail,
        )
        self._results_tail.start()
        self._cancels = ConsumerThread(
            consumer_config(self._kafka, None, f"{self.source}-cancels", **BACKGROUND),
            self._on_cancels,
            assign=_all_partitions_at_end(self._kafka, self._names.cancels),
            name=f"cancels-{self.model_id}",
            on_failure=self.fail,
        )
        self._cancels.start()
        self._thread = threading.Thread(target=self._serve, name=f"model-{self.model_id}", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._ready.wait(self.START_POLL_S):
            if self.start_cancelled.is_set():
                raise StartCancelled(f"worker for {self.model_id} stopped while loading its model")
            if time.monotonic() >= deadline:
                raise BusError(f"worker for {self.model_id} did not load within {timeout:.0f}s")
        if isinstance(self.failure, GpuWorkerError | ManifestError):
            self._say_unloadable(self.failure)
            raise self.failure  # the model cannot load: the caller says how to fix it, not a traceback
        if self.failure is not None:
            raise BusError(f"worker for {self.model_id} failed to start: {self.failure}") from self.failure
        if not self.standby:
            self._subscribe()

    def join(self) -> None:
        """A standby worker joins its group and takes requests (nothing to load: it is warm)."""
        if self.standby:
            self.standby = False
            self._subscribe()

    def _subscribe(self) -> None:
        if self.version:  # again: the serving versions went on while the model loaded (or it stood by)
            self._start_at_peers()
        self._requests.start()

    def wait_assigned(self, timeout: float) -> bool:
        return self._requests.wait_assigned(timeout)

    def assignment(self) -> set[TP]:
        """The request partitions this worker owns now."""
        return self._requests.assignment()

    START_POLL_S = 0.1
    """How often a start waiting for the model looks at :attr:`start_cancelled`."""

    BROKERS_DOWN_S = 10.0
    """How long the request consumer may see no broker before ``/readyz`` says ``kafka: false``."""
    GROUP_GRACE_S = 15.0
    """How long the request consumer's group may stay unsettled before ``/readyz`` says so: a rebalance
    settles within a few seconds, a member that fell out of its group does not (its consumer is replaced
    after ``bus.consumer.UNSETTLED_LIMIT_S``; until then this worker takes no requests)."""

    def readiness(self, max_lag: int | None = None) -> Readiness:
        """Model loaded and serving, consuming its request topic as a settled member of its group, lag under
        ``max_lag`` (``/readyz``; by default the worker's ``ready_max_lag``)."""
        max_lag = self._ready_max_lag if max_lag is None else max_lag
        lag = self._requests.max_lag() or 0
        return Readiness.of(
            model_loaded=self._ready.is_set() and self.failure is None,
            kafka=self.failure is None
            and self._requests.wait_assigned(0)
            and self._requests.brokers_down_for() < self.BROKERS_DOWN_S
            and all(
                reader.unreadable_for()[0] < self.BROKERS_DOWN_S
                for reader in (self._requests, self._results_tail, self._cancels, self._control)
                if reader is not None
            ),
            group=self._requests.unsettled_for() < self.GROUP_GRACE_S,
            lag_ok=lag <= max_lag,
            lag=lag,
        )

    def drain(self, within_s: float) -> bool:
        """Take no more requests and finish those already running, for up to ``within_s``; True when
        nothing is left running (a scale-in or a rolling restart then re-runs nothing). Records fetched but
        not started (the inbox) are dropped uncommitted: the partitions' next owner reads them after
        :meth:`stop`. Nothing later in their partitions is started, so no commit can pass them."""
        deadline = time.monotonic() + within_s
        if self._thread is None or self.failure is not None:
            return False
        self._draining.set()
        if not self._requests.pause(within_s):
            return False
        idle = 0  # two looks in a row: the model thread may hold an item between the inbox and _live
        while time.monotonic() < deadline and self.failure is None:
            idle = idle + 1 if self._inbox.empty() and not self._live else 0
            if idle >= 2:
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        """Stop working and leave the group. Terminal events already produced are flushed and their
        offsets committed; requests without one are redelivered to the group's other members (or to
        this worker's next start)."""
        self._stop.set()
        if self._thread is not None and self._ready.is_set():
            self._thread.join()
            self._thread = None
            self._say_skipped(now=True)
        # else the model thread is still loading (a start given up): it serves nothing, sees the stop once
        # loaded and returns; a daemon, it does not hold the process either
        if self._probe is not None:
            self._probe.close()  # the results copies still waiting for a prompt's embedding go out
        for listener in (self._cancels, self._results_tail, self._control):
            if listener is not None:
                try:
                    listener.stop()
                except BusError:  # already the worker's failure: the rest must still stop
                    log.warning("stopping %s: it had failed", listener.name, exc_info=True)
        self._cancels = self._results_tail = self._control = None
        self._producer.stop()  # the last delivery reports land in self._durable
        self._last_commit()
        self._requests.stop()  # performs the queued commit, then leaves the group

    def _last_commit(self) -> None:
        """What is durable now is committed, however soon after the previous commit (at the interval a
        stop would leave up to ``COMMIT_INTERVAL_S`` of finished requests for the next owner to skip)."""
        self._ledger.commit_now()
        self._commit()

    # ---------------------------------------------------------------- consumer threads

    def _on_requests(self, batch: list[Message]) -> None:
        for message in batch:
            tp = (message.topic() or "", message.partition() or 0)
            offset = message.offset() or 0
            event = decode_or_junk(message)
            if isinstance(event, Junk):
                self._put(_Skip(tp, offset, self._ledger.generation, junk=event))
                continue
            line: BatchRef | None = None
            if isinstance(event, BatchItemRequested):  # a batch line runs as the request it carries
                line, event = event.ref, event.as_request()
            request = self._runnable(event)
            if isinstance(request, Why):  # a producer's mistake, or worse: lettered, not run
                self._put(_Skip(tp, offset, self._ledger.generation, junk=junk_of(message, request)))
                continue
            trace = open_trace(request, *tp, offset, self.group)
            self._put(
                Arrival(request, tp, offset, trace=trace, generation=self._ledger.generation, batch=line)
            )

    def _runnable(self, event: Event) -> Request | Why:
        """A valid event on this model's request topic as the request to run here, or why it is not one."""
        if not isinstance(event, GenerationRequested | EmbeddingRequested):
            # nothing to run (an audit: a valid event of another kind was committed silently)
            return Why(f"a {type(event).__name__} on the request topic of {self.model_id!r}", "misplaced")
        if event.model != self.model_id:
            # run here, its terminal event would name the other model, whose results no tail of this model
            # reads: a redelivery ran it a second time (a fuzz audit)
            why = f"a request for model {event.model!r} on the request topic of {self.model_id!r}"
            return Why(why, "misplaced")
        if event.reply is not None and event.reply.topic != self._names.replies:
            # written where a request said, a chunk and a second terminal event landed on the results topic,
            # or on the compacted control topic under a tenant's key (a review)
            why = f"replies asked on {event.reply.topic!r}, not the replies topic {self._names.replies!r}"
            return Why(why, "misplaced")
        return event

    def _put(self, item: _Inbox) -> None:
        """Blocks while the inbox is full (backpressure: the consumer stops fetching), until stopped."""
        while not self._stop.is_set():
            try:
                self._inbox.put(item, timeout=0.1)
            except queue.Full:
                continue
            return

    def _on_cancels(self, batch: list[Message]) -> None:
        for message in batch:
            try:
                event = decode(message.value() or b"")
            except DecodeError:
                continue  # the edge only writes valid cancels; junk here has no request to stop
            if isinstance(event, CancelRequested) and event.model == self.model_id:
                self._put(_Cancel(event.request_id))

    def _follow_deployments(self) -> None:
        """The deployment now (read to the control topic's end before serving), then every change."""
        control = self._names.control
        # One snapshot of the ends: read to them, then follow from them. Ends taken twice would miss a
        # deployment published in between (a rollout started as this worker starts: it would never learn
        # that its version is warming up, nor say it is ready for it).
        tps, ends = control_start(self._kafka, control, f"{self.source}-control")
        latest = latest_deployments(self._kafka, control, f"{self.source}-control", start=(tps, ends))
        if self.model_id in latest:
            self._deployment = Deployment.of(latest[self.model_id])
            self._deployment_id = latest[self.model_id].id
        if not tps:
            return
        self._control = ConsumerThread(
            consumer_config(self._kafka, None, f"{self.source}-control", **BACKGROUND),
            self._on_control,
            assign=[TopicPartition(control, tp.partition, ends[tp.partition]) for tp in tps],
            name=f"control-{self.model_id}",
            on_failure=self.fail,
        )
        self._control.start()

    def _start_at_peers(self) -> None:
        """A version's group that never read its request topic (a candidate's first worker), or stopped
        reading it long ago (a version rolled out again), starts where the other serving versions' groups
        have all committed. Their commits pass a record only once it has ended, whoever ended it (a record
        routed to another version is held until its terminal event is seen), or while another record of
        its request stays open in that group (so positions are taken whole, theirs or its own:
        :func:`bus.positions.behind_peers`); nothing behind them is this version's to run or hold. Before, a
        candidate's new group started at the topic's first retained record and read the whole history
        before the requests routed to it (a rollout's first ones waited 330 ms behind 15 s of traffic under
        `sluice up`; behind days of retention, for good). Best effort: where the cluster cannot say, the
        group starts from its own positions, as before (a warm standby joining during a broker's outage
        would otherwise fail)."""
        deployment = self._deployment
        if deployment is None:
            return  # no rollout yet: every record is this group's to run, from the first one
        peers = [worker_group(self.model_id, v) for v in sorted(deployment.serving) if v != self.version]
        topic = self._names.requests(self.model_id)
        try:
            moved = start_at_peers(self._kafka, self.group, topic, peers, self.source)
        except (KafkaException, BusError) as exc:
            log.warning(
                "worker %s (%s): %s starts from its own positions (where %s stand cannot be read: %s)",
                self.worker_id,
                self.version,
                self.group,
                ", ".join(peers),
                exc,
            )
            return
        if moved:
            log.info(
                "worker %s (%s): %s starts where %s have committed on %d partitions of %s",
                self.worker_id,
                self.version,
                self.group,
                ", ".join(peers),
                len(moved),
                topic,
            )

    def _on_control(self, batch: list[Message]) -> None:
        for message in batch:
            try:
                event = decode(message.value() or b"")
            except DecodeError:
                continue
            if isinstance(event, DeploymentChanged) and event.model == self.model_id:
                self._put(_Deploy(Deployment.of(event), event.id))

    REVOKE_DRAIN_S = 30.0
    CLOCK_SKEW_S = 600.0
    """How far the clocks of the edges (which time request records) and the workers (results) may differ:
    a worker learns finished requests from this long before the oldest request it could be handed."""

    def _on_revoke(self, tps: list[TP], lost: bool) -> dict[TP, int] | None:
        """Partitions taken away in a rebalance (consumer thread). Every record of theirs still in the inbox
        is stale at once (their next owner runs them). The requests of theirs already running here are
        finished first (up to ``REVOKE_DRAIN_S``) and the offsets they reach are returned, to be committed
        before the partitions move: otherwise the next owner, reading from the last commit, would run them
        a second time. Lost partitions (already someone else's) are dropped without waiting."""
        revoked = self._ledger.revoke(tps)
        self._releases.put((frozenset(tps), revoked))  # the model thread gives back what has not started
        busy, final = self._ledger.hand_over(
            tps,
            revoked,
            give_up=lambda: lost or self._stop.is_set() or self.failure is not None,
            within_s=self.REVOKE_DRAIN_S,
        )
        if busy:
            log.warning("%d requests of revoked partitions %s still running: they may run twice", busy, tps)
        return None if lost else final

    def _on_results(self, batch: list[Message]) -> None:
        for message in batch:
            request_id = finished_by(message, self.model_id, skip_source=self.source)
            if request_id is not None:
                self._finished_elsewhere.put(request_id)

    def knows_finished(self, request_id: str) -> bool:
        """Whether this worker would skip a redelivery of ``request_id`` (for tests and debugging)."""
        return request_id in self._finished

    def _learn_finished(self) -> dict[int, int]:
        """Read the results topic up to now, from the time of the oldest request record this worker's group
        could still be handed (:func:`uncommitted_since`, less :attr:`CLOCK_SKEW_S`): those requests must
        not run again if redelivered, and no older result can be one of theirs. Keeps the newest
        ``remember_finished`` of them by record time, whichever partition holds them. Returns where each
        partition ended, for the tail that keeps learning from there.

        An audit: it read the whole topic (7 days of every model's results) from offset 0 and kept the
        last 100,000 ids in the order it read them, so a hot tenant's partition, read last, pushed out a
        quiet partition's recent results and a redelivered finished request ran again; and the whole read
        had to fit in 120 s (about 1-8 requests/s over a week)."""
        since = uncommitted_since(self._kafka, self.group, self._names.requests(self.model_id), self.source)
        topic = self._names.results
        consumer = Consumer(consumer_config(self._kafka, None, f"{self.source}-results"))
        try:
            starts, ends = [], {}
            for p in _partitions(consumer, topic):
                low, ends[p] = watermarks(consumer, topic, p)
                first = (
                    low
                    if since is None
                    else offset_at(consumer, topic, p, since - int(1000 * self.CLOCK_SKEW_S))
                )
                starts.append(TopicPartition(topic, p, max(low, first)))
            newest: list[tuple[int, int, str]] = []  # a heap of (record time, order, id): the newest kept
            for order, message in enumerate(read_to_end(consumer, starts, ends)):
                request_id = finished_by(message, self.model_id)
                if request_id is not None:
                    item = (message.timestamp()[1], order, request_id)
                    if len(newest) < self._remember:
                        heapq.heappush(newest, item)
                    else:
                        heapq.heappushpop(newest, item)
        finally:
            consumer.close()
        for _, _, request_id in sorted(newest):
            self._remember_finished(request_id)
        return ends

    def _remember_finished(self, request_id: str) -> None:
        self._finished[request_id] = None
        self._finished.move_to_end(request_id)
        while len(self._finished) > self._remember:
            self._finished.popitem(last=False)

    # ---------------------------------------------------------------- the model thread

    def _serves(self) -> bool:
        """Ready as ``/readyz`` says, and owning request partitions (``/readyz`` also passes a worker the
        group gave none): what it is routed from now on runs at once, not behind a backlog."""
        return bool(self._requests.assignment()) and self.readiness().ready

    def _say_ready(self) -> None:
        """``WorkerReady`` for the latest deployment this worker read, on the control topic. An
        announcement Kafka did not take is made again."""
        self._announce = False
        event = self._announcement()

        def delivered(err: BusError | None, _where: Position | None) -> None:
            if err is not None:
                log.warning("worker %s: saying it is ready failed (%s); trying again", self.worker_id, err)
                self._announce = True

        self._producer.produce(self._names.control, event, on_delivery=delivered)
        after = f" (deployment {event.deployment})" if event.deployment else " (no deployment yet)"
        log.info("worker %s (%s): ready%s", self.worker_id, self.version, after)

    def _announcement(self, error: str = "") -> WorkerReady:
        """This worker's readiness announcement for the latest deployment it read (``error``: it cannot
        load its version)."""
        return WorkerReady(
            tenant="",
            model=self.model_id,
            source=self.source,
            version=self.version,
            worker=self.worker_id,
            deployment=self._deployment_id,
            error=error,
        )

    SAY_UNLOADABLE_S = 5.0

    def _say_unloadable(self, failure: BaseException) -> None:
        """A version's worker that cannot load its model says why on the control topic before it fails
        (``WorkerReady.error``): a rollout warming the version is rolled back with that reason at once."""
        if not self.version:
            return
        event = self._announcement(error=str(failure)[:2000] or type(failure).__name__)
        said = threading.Event()
        self._producer.produce(self._names.control, event, on_delivery=lambda err, _where: said.set())
        if not said.wait(self.SAY_UNLOADABLE_S):
            log.warning("worker %s: could not say on the control topic that it cannot load", self.worker_id)

    def _serve(self) -> None:
        try:
            runner = self._runner_factory()
            self._probe = self._probe_factory() if self._probe_factory is not None else None
            if self._probe is not None and self._probe.embedder is not None:
                self._probe.embedder.watch(self.fail)  # a results copy it could not publish
                self._probe.embedder.start()
        except BaseException as exc:
            self.fail(exc)
            self._ready.set()
            return
        self._ready.set()
        emit = _KafkaEmitter(self)
        try:
            while not self._stop.is_set():
                hint = runner.wait_hint()
                if self._probe is not None:  # idle or not: when the drift embedder's thread may embed
                    self._probe.help(idle=hint is None)
                self._drain(runner, emit, block=None if hint is None else hint)
                began = time.perf_counter()
                runner.tick(emit)
                self._observer.tick(runner.load(), time.perf_counter() - began)
                self._commit()
                if self._announce and not self._draining.is_set() and self._serves():
                    self._say_ready()
        except BaseException as exc:
            log.exception("model thread for %s failed", self.model_id)
            self.fail(exc)

    def _drain(self, runner: Runner, emit: Emitter, block: float | None) -> None:
        self._learn_from_tail(runner)
        self._release_revoked(runner)
        again, self._again = self._again, []
        for item in again:
            self._take(runner, emit, item)
        timeout = 0.1 if block is None else block
        first = True
        while True:
            try:
                item = self._inbox.get(timeout=timeout) if first and timeout > 0 else self._inbox.get_nowait()
            except queue.Empty:
                break
            first = False
            self._take(runner, emit, item)
            if not self._releases.empty():  # a revoke waits for it (``_on_revoke``)
                self._release_revoked(runner)
        self._cut_retired(runner)
        self._sweep(runner, emit)
        self._send_letters_again()
        self._say_skipped()

    LETTER_RETRY_S = 2.0
    """How long a dead letter Kafka did not take waits before it is sent again."""

    def _await_letter(self, skip: _Skip) -> None:
        """Its letter's outcome comes back as a ``_Lettered`` (from the producer's thread, or at once)."""
        if skip.letter is not None:
            skip.letter.delivery.then(lambda error: self._durable.put(_Lettered(skip, error)))

    def _send_letters_again(self) -> None:
        """Dead letters Kafka did not take, sent again once due, while their partition is still this
        worker's: a dead-letter topic missing or refusing holds those partitions' commits back (their lag
        shows it), rather than failing the worker on every start (before, a lost letter was dropped)."""
        if not self._letters_again:
            return
        now = time.monotonic()
        due = [skip for when, skip in self._letters_again if when <= now]
        if not due:
            return
        self._letters_again = [(when, skip) for when, skip in self._letters_again if when > now]
        for skip in due:
            stale = self._ledger.settle_if_stale(skip.tp, skip.generation)  # if so, the next owner letters it
            if not stale and skip.letter is not None:
                self._await_letter(replace(skip, letter=skip.letter.again()))

    def _take(self, runner: Runner, emit: Emitter, item: _Inbox) -> None:
        match item:
            case Arrival() if self._draining.is_set():
                if item.trace is not None:  # left for the partition's next owner, never started
                    item.trace.span.set_attribute(tracing.STATUS, "drained")
                    item.trace.span.end()
            case _Skip() if self._draining.is_set():
                pass  # not marked done: an earlier record of its partition may have been dropped
            case Arrival():
                self._learn_from_tail(runner)  # it may have seen this very request finish elsewhere
                with self._ledger.taking(item.tp, item.generation, item.offset) as stale:
                    self._take_arrival(runner, emit, item, stale)
            case _Cancel():
                if item.request_id in self._live:
                    runner.cancel(item.request_id, emit)
                elif item.request_id not in self._finished:
                    self._remember_early_cancel(item.request_id)
            case _Skip():
                junk = item.junk
                taken = self._ledger.take_skip(item.tp, item.generation, item.offset, letter=junk is not None)
                if taken and junk is not None:
                    letter = junk.letter(self._producer, self._names.deadletter, self.source)
                    self._await_letter(replace(item, letter=letter))
            case _Deploy():
                self._deploy(runner, item.deployment, item.event_id)

    def _take_arrival(self, runner: Runner, emit: Emitter, item: Arrival, stale: bool) -> None:
        """A request's record, its stale check done (and its offset started if not stale)."""
        if stale:
            self._skip("revoked", item.event.request_id)
            if item.trace is not None:
                item.trace.span.set_attribute(tracing.STATUS, "revoked")
                item.trace.span.end()
            return
        request_id = item.event.request_id
        ran = self._live.get(request_id)
        where = (ran.tp, ran.offset) if ran is not None else self._publishing.get(request_id)
        if where is not None and where != (item.tp, item.offset):
            # Another record of a request that runs here (a re-published batch line): that
            # request's own record keeps its partition's commit back until it ends.
            self._skip("already running here", request_id)
            self._release(item, "skipped_duplicate")
        elif where is not None:
            # The same request runs here, or its terminal event is on its way (a lost partition
            # handed back to this worker redelivers it; a batch line re-published): this record
            # is committed once that event is durable, not before, and never runs twice.
            self._skip("redelivered while running here (ends with it)", request_id)
            self._ledger.run(item.tp, item.generation)
            self._followers.setdefault(request_id, []).append(item)
            _end_trace(item, "skipped_duplicate")
        elif request_id in self._finished:
            self._skip("already finished", request_id)
            self._release(item, "skipped_finished")
        elif request_id in self._held:
            held = self._held[request_id]
            # the held record's partition moved and came back: hold this one
            if self._ledger.stale(held.tp, held.generation):
                _end_trace(held, "revoked")
                self._held[request_id] = item
            else:
                self._skip("already held here", request_id)
                self._release(item, "skipped_duplicate")
        elif self._placement(item.event) == "run":
            self._run(runner, item, emit)
        else:
            self._held[request_id] = item
            self._next_sweep = 0.0  # an adoptable or droppable record goes at once

    SKIPPED_EVERY_S = 10.0
    """How often the records not run are summed up in the log (each is a debug line): a redelivery after a
    rebalance or a restart skips a record per request already finished, a line each at info before."""

    def _skip(self, why: str, request_id: str) -> None:
        log.debug("skipping %s: %s", request_id, why)
        if not self._skipped:
            self._skipped_since = time.monotonic()
        self._skipped[why] += 1

    def _say_skipped(self, *, now: bool = False) -> None:
        if not self._skipped or (not now and time.monotonic() - self._skipped_since < self.SKIPPED_EVERY_S):
            return
        log.info(
            "worker %s (%s): %d records skipped in %.0f s: %s",
            self.worker_id,
            self.version,
            sum(self._skipped.values()),
            time.monotonic() - self._skipped_since,
            ", ".join(f"{n} {why}" for why, n in sorted(self._skipped.items())),
        )
        self._skipped.clear()

    def _live_here(self, item: Arrival) -> None:
        """``item``'s request now ends here: live, and counted running until its terminal event settles."""
        self._live[item.event.request_id] = item
        self._ledger.run(item.tp, item.generation)

    def _run(self, runner: Runner, item: Arrival, emit: Emitter) -> None:
        request_id = item.event.request_id
        self._live_here(item)
        runner.accept(item, emit)
        if self._early_cancels.pop(request_id, None) is not None:
            runner.cancel(request_id, emit)  # cancelled before it arrived: never runs

    def _release(self, item: Arrival, status: str) -> None:
        """Done with a record this worker does not run: its offset may be committed."""
        _end_trace(item, status)
        self._ledger.release(item.tp, item.generation, item.offset)

    # ---------------------------------------------------------------- versions (model thread)

    def _placement(self, event: Request) -> Placement:
        """What this worker does with a record routed to ``event.model_version``: run it (its own
        version, or any before the first deployment), hold it (another serving version runs it), adopt it
        after a grace period (its version stopped serving and this is the stable version), or drop it after
        the same grace (a shadow copy whose candidate stopped serving: nobody waits for it, it ends
        ``cancelled``)."""
        deployment, version = self._deployment, event.model_version
        if deployment is None or not self.version:
            return "run"
        if self.version not in deployment.serving:
            return "hold"  # this worker is being retired: the stable version takes over what is left
        if deployment.runs(self.version, version):
            if version == self.version:
                return "run"
            return "drop" if event.shadow_of else "adopt"
        return "hold"

    def _deploy(self, runner: Runner, deployment: Deployment, event_id: str) -> None:
        old = self._deployment.serving if self._deployment is not None else frozenset()
        self._deployment_id = event_id
        if deployment.warming and deployment.candidate == self.version:
            self._announce = True  # the rollout waits for a ready worker of this version
        now = time.monotonic()
        for version in old - deployment.serving:
            self._left_serving.setdefault(version, now)
        for version in deployment.serving:
            self._left_serving.pop(version, None)  # serving again (a rollout started anew)
        if deployment != self._deployment:
            log.info("worker %s (%s): deployment %s", self.worker_id, self.version, deployment)
        self._deployment = deployment
        self._next_sweep = 0.0
        if self.version and self.version in old and self.version not in deployment.serving:
            self._retire(runner)

    def _retire(self, runner: Runner) -> None:
        """This version stopped serving: what it has not started goes back to being held, for the stable
        version to adopt (or drop) after the grace. Only what already runs here may finish here, and only
        within half the grace (``_cut_retired``), so no request this worker could still end is adopted:
        one left queued behind a backlog, or a generation longer than the grace, would otherwise end here
        and on the stable version both."""
        self._give_back(runner, running=False)
        if self._held:
            log.info(
                "worker %s (%s): no longer serving; %d requests held",
                self.worker_id,
                self.version,
                len(self._held),
            )

    def _cut_retired(self, runner: Runner) -> None:
        """Half the adopt grace after this version stopped serving, what still runs here is cut: held too
        (no terminal event: the stable version runs it again from the start once the grace is over), or,
        where part of its answer was already streamed, ended here ``failed`` with ``version_retired``
        (retriable), since the stable version's run would go on from another model's text. The other half
        of the grace is the margin for the two workers seeing the deployment change at different times;
        with a drain (a retiring worker is stopped) longer than the grace, a long generation used to end
        on both versions."""
        retired = self._left_serving.get(self.version)  # when this worker saw its version stop serving
        if retired is None or not self._live or time.monotonic() - retired < self._adopt_grace_s / 2:
            return
        held, ended = self._give_back(runner, running=True)
        if held or ended:
            log.warning(
                "worker %s (%s): %d requests still running %.1f s after the version stopped serving were "
                "cut: %d held for the stable version to run again, %d ended %s (part of their answer "
                "was streamed)",
                self.worker_id,
                self.version,
                held + ended,
                self._adopt_grace_s / 2,
                held,
                ended,
                VERSION_RETIRED_CODE,
            )

    def _give_back(self, runner: Runner, *, running: bool) -> tuple[int, int]:
        """What the runner gives back of this worker's live requests (``running``: those started too) is
        held, as another version's records are, but for what it streamed part of, which ends here
        (``_cut_retired``); returns how many were held and how many ended."""
        released = runner.release(list(self._live), running=running)
        ended = 0
        for request_id in released:
            arrival = self._live[request_id]
            streamed = self._observer.streamed(request_id)
            if streamed is not None:
                self._end_retired(arrival, streamed)
                ended += 1
                continue
            del self._live[request_id]
            self._observer.forget(request_id)
            self._ledger.settle(arrival.tp, arrival.generation)
            self._held[request_id] = arrival
            self._take_followers_again(request_id)
        return len(released) - ended, ended

    def _end_retired(self, arrival: Arrival, tokens: int) -> None:
        """End a request cut part-way through its streamed answer (``tokens`` of it: a failure, billed
        nothing): retriable, so the client asks again and gets one version's answer whole. Its timings
        carry the first token the client had (an audit found its row without one)."""
        origin = Origin(self.source, self.worker_id)
        event = arrival.event
        prompt = len(event.input_ids) if isinstance(event, GenerationRequested) else 0
        error = ErrorInfo(
            code=VERSION_RETIRED_CODE,
            message=f"model version {self.version} stopped serving while this answer streamed; retry the "
            "request",
            retriable=True,
        )
        usage = Usage(prompt_tokens=prompt, completion_tokens=tokens, total_tokens=prompt + tokens)
        timings = Timings(
            accepted=event.time,
            started=self._observer.joined_at(event.request_id),
            first_token=self._observer.first_token_at(event.request_id),
            finished=utc_now(),
        )
        self._publish_finish(
            arrival, origin.finished(arrival, "failed", "error", usage, error=error, timings=timings)
        )

    SWEEP_EVERY_S = 0.5

    def _sweep(self, runner: Runner, emit: Emitter) -> None:
        """Run, adopt or drop held records whose placement changed (at most every ``SWEEP_EVERY_S``)."""
        now = time.monotonic()
        if not self._held or now < self._next_sweep:
            return
        self._next_sweep = now + self.SWEEP_EVERY_S
        for request_id, item in list(self._held.items()):
            with self._ledger.taking(item.tp, item.generation, None) as stale:  # started when it was held
                self._sweep_one(runner, emit, request_id, item, stale, now)

    def _sweep_one(
        self, runner: Runner, emit: Emitter, request_id: str, item: Arrival, stale: bool, now: float
    ) -> None:
        """Run, adopt, drop or keep one held record (its stale check done)."""
        placement = self._placement(item.event)
        if stale:
            del self._held[request_id]
            self._release(item, "revoked")
        elif placement == "run":
            del self._held[request_id]
            self._run(runner, item, emit)
        elif placement in ("adopt", "drop"):
            left = self._left_serving.setdefault(item.event.model_version, now)
            if now - left < self._adopt_grace_s:
                return  # the retiring version may still finish it
            del self._held[request_id]
            if placement == "adopt":
                log.info("adopting %s: version %s no longer serves", request_id, item.event.model_version)
                self._run(runner, item, emit)
            else:
                self._drop_shadow(item)

    def _drop_shadow(self, item: Arrival) -> None:
        """End a shadow copy whose candidate stopped serving without running it: nobody waits for its answer,
        but every request on the log ends once, so it gets its ``cancelled`` terminal event (named after this
        version, the one that ended it), built here, not by the runner (whose queues it must not take a
        place in), and its offset is committed once that is durable."""
        event = item.event
        log.info(
            "dropping shadow copy %s: version %s no longer serves", event.request_id, event.model_version
        )
        if item.trace is not None:
            item.trace.span.set_attribute(tracing.STATUS, "shadow_dropped")
        self._live_here(item)
        origin = Origin(self.source, self.worker_id)
        self._publish_finish(
            item, origin.finished(item, "cancelled", "cancelled", timings=Timings(finished=utc_now()))
        )

    @property
    def held(self) -> int:
        """Records held for another version (for tests and debugging)."""
        return len(self._held)

    def _release_revoked(self, runner: Runner) -> None:
        """Give back the not yet started requests of partitions being revoked (``_on_revoke`` waits),
        consumed before that revoke (a partition handed back since is another assignment's)."""
        while True:
            try:
                tps, revoked = self._releases.get_nowait()
            except queue.Empty:
                return
            mine = [
                request_id
                for request_id, arrival in self._live.items()
                if arrival.tp in tps and arrival.generation < revoked
            ]
            for request_id in runner.release(mine):
                arrival = self._live.pop(request_id)
                # an embedding's batch may have taken it already: what was observed of it here goes too (it
                # stayed, and a request handed back later started from the old join; a review)
                self._observer.forget(request_id)
                if arrival.trace is not None:
                    arrival.trace.span.set_attribute(tracing.STATUS, "released")
                    arrival.trace.span.end()
                self._ledger.settle(arrival.tp, arrival.generation)
                self._take_followers_again(request_id)
            self._ledger.released(revoked)

    def _take_followers_again(self, request_id: str) -> None:
        """A request given back unrun: the records that waited for it are taken again (the first of them
        still assigned runs it)."""
        followers = self._followers.pop(request_id, [])
        for follower in followers:
            self._ledger.settle(follower.tp, follower.generation)
        self._again.extend(followers)

    def _ended(self, request_id: str) -> None:
        """The request's terminal event is durable: the records that waited for it are done."""
        self._publishing.pop(request_id, None)
        for follower in self._followers.pop(request_id, []):
            self._ledger.done(follower.tp, follower.generation, follower.offset)

    def _learn_from_tail(self, runner: Runner) -> None:
        while True:
            try:
                request_id = self._finished_elsewhere.get_nowait()
            except queue.Empty:
                return
            if request_id in self._live:
                # Running here too (adopted from a retiring version that finished it after all, or
                # handed over by a rebalance while its old owner still ran it): its terminal event is on
                # the log, so this run ends without one.
                self._end_quietly(runner, request_id)
                continue
            self._remember_finished(request_id)
            held = self._held.pop(request_id, None)
            if held is not None:  # its own version's worker finished it
                self._release(held, "finished_elsewhere")

    def _end_quietly(self, runner: Runner, request_id: str) -> None:
        log.info("%s finished on another worker: ending it here without a terminal event", request_id)
        runner.cancel(request_id, _QuietEmitter(self))

    def _ended_elsewhere(self, arrival: Arrival) -> None:
        """The runner ended a request another worker finished: nothing is published, its offset may be
        committed (the request ended on the log), and it is never run here again."""
        request_id = arrival.event.request_id
        self._live.pop(request_id, None)
        self._remember_finished(request_id)
        self._observer.forget(request_id)
        _end_trace(arrival, "finished_elsewhere")
        self._durable.put(_Durable(request_id, arrival.tp, arrival.offset, arrival.generation))

    EARLY_CANCEL_TTL_S = 120.0
    EARLY_CANCELS = 10_000

    def _remember_early_cancel(self, request_id: str) -> None:
        now = time.monotonic()
        self._early_cancels[request_id] = now
        while self._early_cancels and (
            len(self._early_cancels) > self.EARLY_CANCELS
            or next(iter(self._early_cancels.values())) < now - self.EARLY_CANCEL_TTL_S
        ):
            self._early_cancels.popitem(last=False)

    @property
    def early_cancels(self) -> int:
        """Cancels held for requests not seen yet (for tests and debugging)."""
        return len(self._early_cancels)

    COMMIT_INTERVAL_S = 0.1
    """Offsets go to the broker at most this often: at one client every request used to commit on its own
    (an append to ``__consumer_offsets``, ~1.5 ms of broker CPU here). A crash in the interval redelivers
    requests whose terminal events are durable; the results tail (or the start-up read) skips them."""

    def _commit(self) -> None:
        unlettered: list[_Lettered] = []
        while True:
            try:
                durable = self._durable.get_nowait()
            except queue.Empty:
                break
            if isinstance(durable, _Undelivered):
                # Whether the log has it is unknown, and the worker has failed: it stays finished and
                # publishing here, so no record of it runs again or is committed before the next start
                # reads the results topic (which runs it again only if it is not there).
                self._ledger.settle(durable.tp, durable.generation)
            elif isinstance(durable, _Uncommitted):
                self._ledger.uncommit(durable.offsets)
            elif isinstance(durable, _Lettered):
                skip = durable.skip
                if durable.error is None:
                    self._ledger.done(skip.tp, skip.generation, skip.offset)
                else:  # held (its partition's commit point with it) and sent again, the worker serving on
                    unlettered.append(durable)
                    self._letters_again.append((time.monotonic() + self.LETTER_RETRY_S, skip))
            else:
                self._ledger.done(durable.tp, durable.generation, durable.offset)
                self._ended(durable.request_id)
        offsets = self._ledger.due(time.monotonic(), self.COMMIT_INTERVAL_S)
        if unlettered:  # one line a round, however much junk waits
            first = unlettered[0]
            log.error(
                "%d dead letters not written (the first, of %s[%s]@%s: %s); sent again in %.0f s, their "
                "partitions' commits held",
                len(unlettered),
                *first.skip.tp,
                first.skip.offset,
                first.error,
                self.LETTER_RETRY_S,
            )
        if offsets:
            self._requests.commit(
                offsets, on_failure=lambda refused: self._durable.put(_Uncommitted(refused))
            )

    # ---------------------------------------------------------------- output (model thread)

    def _publish_chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        reply = arrival.event.reply
        if reply is not None:
            self._observer.chunk(arrival.event.request_id, len(chunk.token_ids))
            try:
                self._producer.produce(
                    reply.topic, chunk, partition=reply.partition, on_delivery=self._chunk_delivered
                )
            except BusError:  # a reply partition that does not exist: nobody can be waiting there
                if chunk.seq == 0:
                    log.exception("the replies of %s cannot be produced", arrival.event.request_id)

    CHUNK_WARNING_EVERY_S = 10.0

    def _chunk_delivered(self, err: BusError | None, _where: Position | None) -> None:
        """Producer thread: a chunk that did not reach the log is told, at most once per
        :attr:`CHUNK_WARNING_EVERY_S` with how many: its edge holds what follows it and fills its text in
        from the terminal event (``ingest.reply_stream``), so its client's stream stalls until the end."""
        if err is None:
            return
        self._chunks_lost += 1
        now = time.monotonic()
        if now - self._chunks_lost_told >= self.CHUNK_WARNING_EVERY_S:
            log.warning(
                "%d token chunk(s) not delivered (last: %s); their streams' text comes with the terminal event",
                self._chunks_lost,
                err,
            )
            self._chunks_lost, self._chunks_lost_told = 0, now

    def _publish_finish(self, arrival: Arrival, result: RequestFinished) -> None:
        """Publish a request's terminal event: first the copy its edge waits for on the reply topic, then
        what the client need not wait for (the worker's metrics, the drift features: right after a forward
        pass every cold line of that code costs tens of microseconds, and a sampled generation prompt's
        embedding a whole MiniLM call), then the copy downstream systems read on the results topic, which
        carries the features too. Both copies are one event (same id, status, output and timings); the
        request's offset is committed once both are durable."""
        request_id = arrival.event.request_id
        if request_id in self._finished:
            return  # exactly one terminal event per request
        self._remember_finished(request_id)
        self._publishing[request_id] = (arrival.tp, arrival.offset)
        self._live.pop(request_id, None)
        event, reply = arrival.event, arrival.event.reply
        span, context = self._observer.finishing(
            event,
            arrival.trace,
            result,
            reply.topic if reply is not None else self._names.results,
            reply.partition if reply is not None else None,
        )
        result = with_request(result, event, context, self.version)
        if arrival.batch is not None:
            result = msgspec.structs.replace(result, batch=arrival.batch)
        remaining = [2 if reply is not None else 1]
        lock = threading.Lock()
        where = (request_id, arrival.tp, arrival.offset, arrival.generation)

        def settle_one() -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    self._durable.put(_Durable(*where))
                    if span is not None:
                        span.end()

        def reply_delivered(err: BusError | None, _where: Position | None) -> None:
            if err is not None:  # the edge waits no more; the results copy carries the outcome
                log.warning(
                    "the reply copy of %s was not delivered (%s); its results copy decides", request_id, err
                )
            settle_one()

        def results_delivered(err: BusError | None, _where: Position | None) -> None:
            if err is None:
                settle_one()
                return
            # Whether the log has it is unknown (a timed-out produce may be written after all): not
            # committed, and the worker fails, so that its next start reads the results topic to its end
            # and runs the request again only if it is not there (a retry here could end it twice).
            log.error("terminal event of %s not durable: %s", request_id, err)
            self._durable.put(_Undelivered(request_id, arrival.tp, arrival.generation))
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, str(err)))
                span.end()
            self.fail(BusError(f"the terminal event of {request_id} could not be written: {err}"))

        value, key, head = encode(result), kafka_key(result), headers(result)
        if not fits_record(value, key, head):
            # Too large for one record: end the request failed, not the model thread (which the produce
            # error used to kill, and again after every redelivery).
            log.error(
                "terminal event of %s is %d bytes, over the record limit; it ends failed",
                request_id,
                len(value),
            )
            if span is not None:
                span.set_status(Status(StatusCode.ERROR, "result_too_large"))
            result = too_large(result, len(value))
            value = encode(result)
        if reply is not None:
            try:
                self._producer.produce_raw(
                    reply.topic,
                    value,
                    key=key,
                    headers=head,
                    partition=reply.partition,
                    on_delivery=reply_delivered,
                )
            except BusError:
                # Refused at once (a request naming a reply partition that does not exist, from a producer
                # other than an edge): no edge waits there. The results copy alone carries the outcome and
                # commits the request, which must not take the model thread down (and again at every
                # redelivery).
                log.exception(
                    "the reply of %s cannot be produced; its result goes to results only", request_id
                )
                settle_one()
        self._observer.measure(event, arrival.trace, result)
        probe = self._probe

        def publish_results(vector: Vector | None) -> None:
            out = value if probe is None else with_features(probe, event, result, value, key, head, vector)
            try:
                self._producer.produce_raw(
                    self._names.results, out, key=key, headers=head, on_delivery=results_delivered
                )
            except BusError as exc:
                # Refused at once although it was sized to fit (librdkafka's own framing or limits): the
                # request ends failed rather than the model thread, which a redelivery would end again.
                log.exception("the results copy of %s was refused; it ends failed", request_id)
                failed = encode(too_large(result, record_size(out, key, head)))
                try:
                    self._producer.produce_raw(
                        self._names.results, failed, key=key, headers=head, on_delivery=results_delivered
                    )
                except BusError:
                    results_delivered(BusError(f"the results copy was refused: {exc}"), None)

        if probe is None:
            publish_results(None)
        else:  # a sampled prompt's embedding: the results copy follows from the embedder's thread
            probe.embed_then(event, publish_results)


def _end_trace(arrival: Arrival, status: str) -> None:
    """End the span of a record that ends here without a terminal event of this worker's, with why."""
    if arrival.trace is not None:
        arrival.trace.span.set_attribute(tracing.STATUS, status)
        arrival.trace.span.end()


class _KafkaEmitter:
    def __init__(self, service: WorkerService) -> None:
        self._service = service

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        self._service._publish_chunk(arrival, chunk)

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        self._service._publish_finish(arrival, result)

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        self._service._observer.joined(arrival.event.request_id, batch, budget_ratio)


class _QuietEmitter:
    """What a runner emits for a request another worker already finished: nothing reaches the log."""

    def __init__(self, service: WorkerService) -> None:
        self._service = service

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        pass

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        self._service._ended_elsewhere(arrival)

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


def _partitions(consumer: Consumer, topic: str) -> list[int]:
    """The topic's partitions; :class:`BusError` saying what to run where it has none (a worker started
    before the topics were applied failed with "give exactly one of subscribe= or assign=", a review)."""
    meta = consumer.list_topics(topic, timeout=10).topics[topic]
    if meta.error is not None or not meta.partitions:
        raise BusError(f"topic {topic} is missing: run `sluice topics apply`")
    return list(meta.partitions)


def _all_partitions_at_end(kafka: KafkaConnection, topic: str) -> list[TopicPartition]:
    consumer = Consumer(consumer_config(kafka, None, "sluice-probe"))
    try:
        # Explicit offsets, not OFFSET_END: a lazily resolved "end" could land after a cancel sent in the
        # meantime (a new partition's leader takes a moment), and that cancel would be missed.
        return [
            TopicPartition(topic, p, watermarks(consumer, topic, p)[1]) for p in _partitions(consumer, topic)
        ]
    finally:
        consumer.close()
