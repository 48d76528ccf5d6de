"""A confluent-kafka consumer polled in its own thread (:class:`ConsumerThread`), and the platform's consumer
settings. Dead-lettering is :mod:`bus.dead_letter`; reading the log by position, :mod:`bus.positions`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, Protocol

import msgspec
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from bus.errors import BusError
from bus.placement import native_threads
from bus.wakeup import QueueWakeup, queue_wakeup
from monitoring.metrics import CONSUMER_LAG, CONSUMER_REPLACED
from schemas.codec import HeaderValue
from schemas.lifecycle import Component, Watcher
from schemas.settings import KafkaConnection

log = logging.getLogger(__name__)

TP = tuple[str, int]
CommitFailed = Callable[[dict[tuple[str, int], int]], None]
"""Told which offsets a commit did not store, so their owner can commit them again."""
Handler = Callable[[list[Message]], None]
Revoked = Callable[[list[TP], bool], dict[TP, int] | None]
"""Told the partitions leaving and whether they were lost; may return final offsets to commit (not lost)."""


UNSETTLED_LIMIT_S = 60.0
"""How long a group member may stay out of a settled membership (librdkafka's statistics: group state
``up``, join state ``steady``) before :class:`ConsumerThread` replaces its consumer. A rebalance settles in
seconds; after a broker stalled past the session (its controller's events took 20-30 s on a box whose
cores were all taken) a client was seen to keep one request in its coordinator connection's queue for
good, out of the group, while a new client joined at once."""


UNREADABLE = frozenset(
    {
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.GROUP_AUTHORIZATION_FAILED,
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._UNKNOWN_PARTITION,
    }
)
"""Consumer errors that say a topic or the group cannot be read (an ACL refused or removed, a topic that is
not there): librdkafka reports them, fetch after fetch, as errors it goes on from. The component must say it
is not ready while they go on (:meth:`ConsumerThread.unreadable_for`), not only log them."""

LOG_EVERY_S = 10.0
"""The least time between two warnings of one kind an error on every fetch or commit would repeat."""

UNREADABLE_QUIET_S = 15.0
"""How long after the last such error the consumer counts as readable again (at once: a record of the
topic that error named)."""

FETCH_WAIT_MAX_MS = 500
"""Kafka's default. The longest an empty fetch waits on the broker; a record ends the wait at once."""


BACKGROUND = {"fetch.min.bytes": 64 * 1024, "fetch.wait.max.ms": 100}
"""Overrides for a consumer no request waits on (the workers' results tail and cancels, control, quota):
the broker answers its fetch when 64 KiB are there or after 100 ms, so a burst of records costs one fetch
instead of one each. At low load every record used to wake every such consumer: ~1.5 ms of broker CPU
per fetch on this box, several per request (benchmarks/kafka_floor.py, docs/perf/)."""


def consumer_config(
    kafka: KafkaConnection, group_id: str | None, client_id: str, **overrides: Any
) -> dict[str, Any]:
    """Manual commits (offsets are committed only after the effect is durable), read-committed isolation."""
    config: dict[str, Any] = {
        **kafka.client_config(),
        "client.id": client_id,
        "group.id": group_id or f"{client_id}-assigned",
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "session.timeout.ms": 10_000,
        "heartbeat.interval.ms": 1_000,
        # A fetch returns as soon as one record arrives (fetch.min.bytes=1), so the wait only bounds how
        # often an idle consumer asks again: at 5 ms the ~12 idle consumers of one edge and two workers
        # kept the broker at 0.27 cores doing nothing, and the round trip was no faster (docs/perf/).
        "fetch.wait.max.ms": FETCH_WAIT_MAX_MS,
        "socket.nagle.disable": True,
        "partition.assignment.strategy": "cooperative-sticky",
    }
    config.update(overrides)
    return config


class ConsumerThread(Component):
    """Poll one consumer on a dedicated thread and pass each non-empty batch to ``handler`` there.

    Either ``subscribe`` to topics as a member of the consumer group in the config, or ``assign`` fixed
    partitions (with explicit start offsets, e.g. OFFSET_END). ``commit`` may be called from any thread:
    commits are queued and sent by the polling thread between batches, asynchronously (their outcome
    comes back through a later poll), and synchronously only where the partitions are about to change
    hands (a revocation, the stop). The handler must be quick (hand work to a queue); an exception in it
    stops the thread and is re-raised by ``stop``.

    Why not synchronously between batches: a commit that waits blocks the poll loop, and a group whose
    session expired meanwhile (a broker stalled past ``session.timeout.ms``) waits for that loop to serve
    its rebalance before it rejoins, so neither ever moved again: seen on a worker, which served nothing
    until restarted (``tests/bus/test_broker_stall.py``).

    Lag: every ``stats_interval_ms`` (0: never) librdkafka's statistics give, per owned partition, the
    records between the end of the partition (its last stable offset under read-committed) and the
    group's committed offset: what this consumer has not yet finished durably, handed-out records waiting
    for their commit included. Before anything is committed on a partition (a consumer that never commits,
    like a reply listener) the lag counts from the position handed to ``handler`` instead. A partition
    that never held a record lags 0 (the streams worker's drift watermark waits for every partition whose
    lag is not 0); others with neither are not reported. The value goes to ``sluice_consumer_lag`` and to ``lag()``; a
    partition's series is removed when it is revoked or the consumer stops.

    Membership (``subscribe`` only, from the same statistics): a member that was in its group and has not
    settled back for ``unsettled_limit_s`` is replaced, its partitions treated as lost
    (:data:`UNSETTLED_LIMIT_S`).
    """

    def __init__(
        self,
        config: dict[str, Any],
        handler: Handler,
        *,
        subscribe: Sequence[str] = (),
        assign: Sequence[TopicPartition] = (),
        on_revoke: Revoked | None = None,
        name: str = "kafka-consumer",
        batch_size: int = 500,
        linger_s: float = 0.0,
        stats_interval_ms: int = 5_000,
        unsettled_limit_s: float = UNSETTLED_LIMIT_S,
        on_failure: Watcher | None = None,
        serve_on: asyncio.AbstractEventLoop | None = None,
        wake_loop: bool = True,
        ends: Mapping[TP, int] | None = None,
        on_ends: Callable[[list[TP]], None] | None = None,
    ) -> None:
        """``on_failure(exc)`` is watched (:meth:`watch`): told on the polling thread when the thread dies of
        an error (the handler raised, or the client hit a fatal error), so owners fail what waits on it.

        A batch is what has arrived when the first record comes, up to ``batch_size``; with ``linger_s``
        the thread waits up to that long after the first record for the batch to fill (fewer, larger
        batches: what a warehouse writer wants).

        ``serve_on`` (``assign`` only, no ``linger_s``): the handler runs on that event loop, woken by
        librdkafka itself (:mod:`bus.wakeup`), with no polling thread: one wake-up a batch instead of
        three, for a consumer a client waits on (an edge's replies). Where that cannot be set up (or with
        ``wake_loop=False``), the thread polls and hands each batch to the loop. Commits then go out at the
        next batch or the stop.

        ``ends`` (a polling thread's): ``on_ends(partitions)`` is told on the polling thread, after the
        handler has had every record before it, when the position reaches a partition's end there, whether
        or not a record sits at ``end - 1``: a transaction's marker there is never handed over, and a
        reader waiting for a record at ``end - 1`` to know it had caught up waited for the next record (an
        edge stayed unready behind a control or idempotency topic a transactional tool wrote, a review)."""
        super().__init__()
        if bool(subscribe) == bool(assign):
            raise ValueError("give exactly one of subscribe= or assign=")
        if serve_on is not None and (subscribe or linger_s):
            raise ValueError("serve_on= reads assigned partitions without lingering")
        self._loop = serve_on
        self._wake_loop = wake_loop
        self._on_loop: Handler | None = None
        """``serve_on`` without a wake-up: the handler, which the polling thread's batches reach on the loop."""
        self._wakeup: QueueWakeup | None = None
        self._attached = False
        """Whether the loop watches the wake-up pipe (loop thread)."""
        self._detached = threading.Event()
        self._config = config
        self._handler = handler
        self._subscribe = list(subscribe)
        self._assign = list(assign)
        self._on_revoke = on_revoke
        if on_failure is not None:
            self.watch(on_failure)
        self.name = name
        self._batch_size = batch_size
        self._linger_s = linger_s
        self._commits: queue.SimpleQueue[tuple[dict[TP, int], CommitFailed | None]] = queue.SimpleQueue()
        self._sent: deque[tuple[dict[TP, int], list[tuple[dict[TP, int], CommitFailed | None]]]] = deque()
        """Asynchronous commits sent and not yet answered, oldest first, with who asked (polling thread)."""
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._pause = threading.Event()
        self._paused = threading.Event()
        self._thread: threading.Thread | None = None
        self._consumer: Consumer | None = None
        self._stats_interval_ms = stats_interval_ms
        self._group = str(config.get("group.id", ""))
        self._read_committed = config.get("isolation.level", "read_committed") == "read_committed"
        self._lag_lock = threading.Lock()  # the polling thread writes, readiness checks read
        self._owned: set[TP] = set()
        self._revoking: set[TP] = set()
        """Partitions being handed over: their owner's commits still go out, in the revoke's flush."""
        self._revocations = 0
        """How many revokes this thread has served (polling thread): one served while a batch was being
        taken may have taken records away from it."""
        self._lags: dict[TP, int] = {}
        self._unsettled_limit_s = unsettled_limit_s
        self._unsettled_since: float | None = None
        """Since when the statistics have said the group is not settled, once it had been (polling thread):
        a member that never joined (its topics not created yet, say) is left to keep trying."""
        self._unsettled_seen: float | None = None
        """When the statistics last said so: a replacement needs the group seen unsettled for the whole
        limit, not only the time since (a handler that blocked through a rebalance polled no news)."""
        self._settled_once = False
        self._group_state = ""
        self._brokers_down_since: float | None = None
        """Since when the statistics have said no broker is connected (polling thread)."""
        self._unreadable: tuple[float, float, str, str | None] | None = None
        """(first, last, what, topic) of the errors in :data:`UNREADABLE` going on now (polling thread)."""
        self._unreadable_logged = 0.0
        self._commit_failure_logged = 0.0
        self._commit_failures_unlogged = 0
        self._live = _Live()
        """The current client's: its callbacks reach this thread's state only while it is current."""
        self._ends = {tp: end for tp, end in (ends or {}).items() if end > 0}
        """Ends not yet reached, told to ``on_ends`` once they are (polling thread)."""
        self._on_ends = on_ends

    def _start(self) -> None:
        if self._thread is not None or self._wakeup is not None:
            return
        self._consumer = self._new_consumer()
        if not self._subscribe:
            with self._lag_lock:
                self._owned.update((tp.topic, tp.partition) for tp in self._assign)
            self._consumer.assign(self._assign)
            self._ready.set()
        if self._loop is not None:
            if self._wake_loop:
                self._wakeup = queue_wakeup(self._consumer, str(self._config.get("client.id", "")))
            if self._wakeup is not None:
                self._loop.call_soon_threadsafe(self._attach)
                return
            self._on_loop, self._handler = self._handler, self._hand_to_loop
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()

    # -------------------------------------------------------- served on an event loop (``serve_on``)

    def _attach(self) -> None:
        """Loop thread: watch the wake-up pipe, and read what arrived before it was watched."""
        if self._wakeup is None or self._loop is None or self._stop.is_set():
            self._detached.set()
            return
        self._attached = True
        self._loop.add_reader(self._wakeup.fd, self._on_wakeup)
        self._on_wakeup()

    def _on_wakeup(self) -> None:
        """Loop thread: librdkafka's queue got work. Everything queued is read (the pipe is written to again
        only once the queue has been empty), records handed over a batch at a time."""
        wakeup, consumer = self._wakeup, self._consumer
        if wakeup is None or consumer is None or self._stop.is_set():
            return
        wakeup.drain()
        try:
            self._flush_commits()
            while True:
                messages = consumer.consume(self._batch_size, 0)
                batch = [m for m in messages if not self._skipped(m)]
                if batch:
                    self._handler(batch)
                if len(messages) < self._batch_size:
                    return
        except BaseException as exc:
            log.exception("%s stopped on an error", self.name)
            self._detach()
            self.fail(exc)

    def _detach(self) -> None:
        """Loop thread: stop watching the pipe."""
        if self._attached and self._wakeup is not None and self._loop is not None:
            self._loop.remove_reader(self._wakeup.fd)
            self._attached = False
        self._detached.set()

    def _hand_to_loop(self, batch: list[Message]) -> None:
        """Polling thread, where no wake-up could be set up: the batch goes to the loop."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed: nobody is left to hand it to
                self._loop.call_soon_threadsafe(self._handle_on_loop, batch)

    def _handle_on_loop(self, batch: list[Message]) -> None:
        """Loop thread: a batch the polling thread handed over."""
        if self.failure is not None or self._on_loop is None:
            return
        try:
            self._on_loop(batch)
        except BaseException as exc:
            log.exception("%s stopped on an error", self.name)
            self._stop.set()
            self.fail(exc)

    def _stop_on_loop(self) -> None:
        """The stop of a consumer served on the loop (any thread): the loop lets go of the pipe first, then
        the queue's reference goes and the client closes (its last commits sent)."""
        wakeup, loop = self._wakeup, self._loop
        if wakeup is None or loop is None:
            return
        if _running(loop):  # on the loop's own thread: nothing to wait for
            self._detach()
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop watches nothing any more
                loop.call_soon_threadsafe(self._detach)
                if not self._detached.wait(5.0):
                    log.warning("%s: its event loop did not let go of the consumer within 5 s", self.name)
        self._wakeup = None
        wakeup.close()
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            try:
                self._flush_commits(wait=True)
            finally:
                consumer.close()
                self._disown()

    def _new_consumer(self) -> Consumer:
        """A client for this thread, subscribed when it is a group member (``assign``: by the caller).
        Its callbacks act only while it is this thread's client (:class:`_Live`)."""
        live = self._live = _Live()
        config = dict(self._config)
        if self._stats_interval_ms > 0:
            config["statistics.interval.ms"] = self._stats_interval_ms
            config["stats_cb"] = live.only(self._on_stats)
        config["on_commit"] = live.only(self._committed)
        with native_threads():  # librdkafka's threads: off a worker's model cores (bus.placement)
            consumer = Consumer(config)
        if self._subscribe:
            consumer.subscribe(
                self._subscribe,
                on_assign=live.only(self._assigned),
                on_revoke=live.only(self._revoked),
                on_lost=live.only(self._lost),
            )
        return consumer

    def _replace_if_unsettled(self, consumer: Consumer) -> Consumer:
        """``consumer``, or a new one in its place when its group has been seen unsettled for too long:
        what it owned is lost (not committed), what it had sent is failed, and it is closed on a thread of
        its own (closing a wedged client can wait on the very request that is stuck), retired first:
        ``close()`` serves the client's late callbacks (a revoke of what it owned, commit answers,
        statistics) on the thread that calls it, and those must not reach the new client's state. The new
        client has the same limit to settle, or is replaced in turn."""
        since, seen = self._unsettled_since, self._unsettled_seen
        if since is None or seen is None or seen - since < self._unsettled_limit_s:
            return consumer
        log.warning(
            "%s: group %s not settled for %.0f s (%s): a new consumer takes over",
            self.name,
            self._group,
            time.monotonic() - since,
            self._group_state,
        )
        CONSUMER_REPLACED.labels(self._group).inc()
        owned = self.assignment()
        if owned:
            self._revoked(consumer, [TopicPartition(t, p) for t, p in owned], lost=True)
        while self._sent:
            merged, callers = self._sent.popleft()
            self._commit_failed(merged, callers, set(merged), "its consumer was replaced")
        self._live.retire()
        fresh = self._consumer = self._new_consumer()
        self._unsettled_since, self._unsettled_seen = time.monotonic(), None  # a member: it must settle
        threading.Thread(
            target=_close_quietly, args=(consumer, self.name), name=f"{self.name}-close", daemon=True
        ).start()
        return fresh

    def wait_assigned(self, timeout: float) -> bool:
        """True once the group gave this consumer its partitions (immediately for ``assign``)."""
        return self._ready.wait(timeout)

    def unsettled_for(self) -> float:
        """Seconds since this member's group, settled before, last said it is not (0 while settled; any
        thread): a rebalance takes a few, a member that fell out of its group more (:data:`UNSETTLED_LIMIT_S`
        replaces it)."""
        since = self._unsettled_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def assignment(self) -> set[TP]:
        """The partitions this consumer owns now."""
        with self._lag_lock:
            return set(self._owned)

    def lag(self) -> dict[TP, int]:
        """The latest lag of each owned partition that has one (see the class docstring)."""
        with self._lag_lock:
            return dict(self._lags)

    def max_lag(self) -> int | None:
        """The largest partition lag, or None before any was reported."""
        with self._lag_lock:
            return max(self._lags.values(), default=None)

    def _assigned(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._unsettled_since = self._unsettled_seen = None  # the group is moving
        with self._lag_lock:  # cooperative rebalancing: partitions are added to what is owned
            self._owned.update((tp.topic, tp.partition) for tp in partitions)
        self._ready.set()

    def _revoked(self, consumer: Consumer, partitions: list[TopicPartition], *, lost: bool = False) -> None:
        """Partitions leave this consumer. Revoked (not lost): their owner may finish their work first,
        committing as it goes, and return the offsets to commit; all of it is committed here, in one
        synchronous commit, before the group hands them on. Lost: what is queued goes out without waiting
        (the group refuses it; its owners are told)."""
        self._unsettled_since = self._unsettled_seen = None  # the group is moving (this may take a while)
        self._revocations += 1
        tps = [(tp.topic, tp.partition) for tp in partitions]
        with self._lag_lock:
            self._revoking = set(tps)  # its owner may still commit them, until the flush below
        self._disown(tps)
        try:
            final = self._on_revoke(tps, lost) if self._on_revoke is not None else None
            if final and not lost:
                self._commits.put((final, None))  # after what the owner queued: its offsets win
            self._flush_commits(wait=not lost)
        finally:
            with self._lag_lock:
                self._revoking = set()

    def _lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """Partitions taken without a revoke (this member missed its session): nothing may be committed."""
        self._revoked(consumer, partitions, lost=True)

    def _disown(self, tps: Sequence[TP] | None = None) -> None:
        """Forget the lag of ``tps`` (all when None) and drop their series from the scrape."""
        with self._lag_lock:
            gone = set(self._owned) if tps is None else set(tps)
            self._owned -= gone
            for topic, partition in gone:
                self._lags.pop((topic, partition), None)
                CONSUMER_LAG.remove(self._group, topic, str(partition))

    def _on_stats(self, stats_json: str) -> None:
        # Called inside poll(): an exception here would stop the consumer, so none escapes.
        try:
            stats = _STATS.decode(stats_json)
            self._record_lag(stats)
            self._watch_group(stats.cgrp)
            self._watch_brokers(stats.brokers)
        except Exception:
            log.exception("%s: cannot read lag from librdkafka statistics", self.name)

    def _watch_brokers(self, brokers: Mapping[str, _BrokerStats]) -> None:
        if not brokers:
            return
        if any(broker.state == "UP" for broker in brokers.values()):
            self._brokers_down_since = None
        elif self._brokers_down_since is None:
            self._brokers_down_since = time.monotonic()

    def _skipped(self, message: Message) -> bool:
        """:func:`_benign_error`, noting the errors that say a topic or the group cannot be read."""
        err = message.error()
        if err is None:
            going = self._unreadable
            if going is not None and going[3] == message.topic():
                self._unreadable = None  # a record of it: it can be read again
            return False
        if err.code() not in UNREADABLE:
            return _benign_error(message)
        self._note_unreadable(message.topic(), err.str())
        return True

    def _note_unreadable(self, topic: str | None, what: str) -> None:
        """An error saying ``topic`` (None: the group) cannot be read, from a fetch or a commit."""
        now = time.monotonic()
        going = self._unreadable
        first = going[0] if going is not None and now - going[1] < UNREADABLE_QUIET_S else now
        self._unreadable = (first, now, what, topic)
        if now - self._unreadable_logged >= LOG_EVERY_S:  # every fetch brings one: hundreds a minute
            self._unreadable_logged = now
            log.warning("%s cannot read %s: %s", self.name, topic or "its group", what)

    def unreadable_for(self) -> tuple[float, str]:
        """How long (seconds) errors saying a topic or the group cannot be read (authorization refused, a
        topic unknown) have kept coming, and the last one's text; (0, "") once none came for
        :data:`UNREADABLE_QUIET_S` (any thread). One such error alone (a topic being created) counts 0. A
        review: with its ACL on the replies topic removed, an edge logged every refused fetch and went on
        answering ``/readyz`` 200, admitting requests no reply could reach."""
        going = self._unreadable
        if going is None or time.monotonic() - going[1] >= UNREADABLE_QUIET_S:
            return 0.0, ""
        return going[1] - going[0], going[2]

    def brokers_down_for(self) -> float:
        """Seconds this consumer's statistics have said no broker is connected (0 while one is, or before
        any statistics; any thread): a readiness check's view of the cluster, which an error on every
        connection attempt alone says only in the log. An audit: the broker killed under ``sluice up``, the
        edge and the workers kept answering ``/readyz`` 200 with ``kafka: true``."""
        since = self._brokers_down_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _watch_group(self, group: _GroupStats | None) -> None:
        if group is None or not self._subscribe:
            return
        self._group_state = f"state {group.state}, join state {group.join_state}"
        if group.state == "up" and group.join_state == "steady":
            self._unsettled_since = self._unsettled_seen = None
            self._settled_once = True
        elif self._settled_once:
            self._unsettled_seen = time.monotonic()
            if self._unsettled_since is None:
                self._unsettled_since = self._unsettled_seen

    def _record_lag(self, stats: _Stats) -> None:
        with self._lag_lock:
            for topic, topic_stats in stats.topics.items():
                for part in topic_stats.partitions.values():
                    tp = (topic, part.partition)
                    if tp not in self._owned:  # also skips partition -1 (librdkafka's unassigned bucket)
                        continue
                    lag = part.lag(read_committed=self._read_committed)
                    if lag is None:
                        continue
                    self._lags[tp] = lag
                    CONSUMER_LAG.labels(self._group, topic, str(part.partition)).set(lag)

    def _serve(self) -> None:
        consumer = self._consumer
        if consumer is None:
            return
        try:
            while not self._stop.is_set():
                consumer = self._replace_if_unsettled(consumer)
                self._flush_commits()
                if self._pause.is_set():
                    self._hold(consumer)
                    continue
                revocations = self._revocations
                messages = take_batch(consumer, self._batch_size, self._linger_s)
                batch = [m for m in messages if not self._skipped(m)]
                if batch and self._revocations != revocations:
                    batch = self._still_owned(batch)
                if batch:
                    self._handler(batch)
                if self._ends:
                    self._reach_ends(consumer)
            self._flush_commits(wait=True)
        except BaseException as exc:  # surfaced by stop(); logging here too so it is never silent
            log.exception("%s stopped on an error", self.name)
            self.fail(exc)
        finally:
            consumer.close()
            self._disown()

    def _reach_ends(self, consumer: Consumer) -> None:
        """Polling thread, after a round: tell ``on_ends`` of the ends the position has reached."""
        reached = past_ends(consumer, self._ends)
        for tp in reached:
            del self._ends[tp]
        if reached and self._on_ends is not None:
            self._on_ends(reached)

    def _still_owned(self, batch: list[Message]) -> list[Message]:
        """The records of ``batch`` whose partitions this member still owns. A batch is taken over several
        polls, and a revoke served by a later one does not take back what an earlier one returned: handed
        on, those records would be worked on here after their partition had changed hands, while its next
        owner reads them too (their commit is left out, :meth:`commit`). An audit: a streams worker
        published audit entries for such records after its revoke, racing the next owner's read of the
        chain heads, and the chain forked."""
        with self._lag_lock:
            owned = set(self._owned)
        kept = [m for m in batch if (m.topic(), m.partition()) in owned]
        if len(kept) < len(batch):
            log.info(
                "%s: %d records of revoked partitions left for their next owner",
                self.name,
                len(batch) - len(kept),
            )
        return kept

    def pause(self, timeout: float = 10.0) -> bool:
        """Stop handing records to the handler, staying in the group (commits still go out) until
        :meth:`stop`. Returns once the polling thread has paused: no handler call starts after that.
        Records fetched but not handled are not committed, so the partitions' next owner reads them.
        (A group member's: not for a consumer served on an event loop.)"""
        if self._loop is not None:
            raise RuntimeError(f"{self.name} is served on an event loop: it has no polling thread to pause")
        self._pause.set()
        if self._thread is None or not self._thread.is_alive():
            return True
        return self._paused.wait(timeout)

    def _hold(self, consumer: Consumer) -> None:
        """One round while paused: every owned partition paused (also one a rebalance just added), the
        group kept by polling; a record that still arrives is dropped, never handled, so never committed."""
        assignment = consumer.assignment()
        if assignment:
            consumer.pause(assignment)
        self._paused.set()
        dropped = consumer.consume(self._batch_size, 0.1)
        if any(not self._skipped(m) for m in dropped):
            log.debug("%s: paused; %d records left for the partitions' next owner", self.name, len(dropped))

    def commit(self, offsets: dict[TP, int], on_failure: CommitFailed | None = None) -> None:
        """Commit ``{(topic, partition): next offset to read}`` (thread-safe, asynchronous to the caller).
        ``on_failure(offsets)`` is called (on the polling thread) if the broker refuses it. A group
        member's offsets of partitions it no longer owns (nor is handing over) are left out: their revoke
        committed what they reached, and sent later they would land after the hand-over, over what the
        partition's next owner committed."""
        if self._subscribe:
            with self._lag_lock:
                offsets = {tp: o for tp, o in offsets.items() if tp in self._owned or tp in self._revoking}
        if offsets:
            self._commits.put((dict(offsets), on_failure))

    def _flush_commits(self, *, wait: bool = False) -> None:
        """Send what :meth:`commit` queued, as one commit: asynchronously (:meth:`_committed` hears the
        outcome), or with ``wait`` synchronously, where the partitions are about to change hands."""
        merged: dict[TP, int] = {}
        callers: list[tuple[dict[TP, int], CommitFailed | None]] = []
        while True:
            try:
                offsets, on_failure = self._commits.get_nowait()
            except queue.Empty:
                break
            merged.update(offsets)
            callers.append((offsets, on_failure))
        if self._subscribe and merged:
            # Owned when queued is not enough: a commit queued while a revoke's own synchronous commit was
            # on its way went out after it, after the hand-over, over the next owner's (a review). What
            # this member no longer owns nor is handing over is not sent; its revoke committed it.
            with self._lag_lock:
                merged = {tp: o for tp, o in merged.items() if tp in self._owned or tp in self._revoking}
        if not merged or self._consumer is None:
            return
        tps = [TopicPartition(topic, part, off) for (topic, part), off in merged.items()]
        if not wait:
            self._sent.append((merged, callers))
            try:
                self._consumer.commit(offsets=tps, asynchronous=True)
            except KafkaException as exc:  # refused before it was sent
                self._sent.pop()
                self._commit_failed(merged, callers, set(merged), exc)
            return
        try:
            self._consumer.commit(offsets=tps, asynchronous=False)
        except Exception as exc:  # a revoked partition cannot be committed: its next owner redoes the work
            self._commit_failed(merged, callers, set(merged), exc)

    def _committed(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """librdkafka's answer to an asynchronous commit (inside a poll, on the polling thread)."""
        answered = {(tp.topic, tp.partition): tp.offset for tp in partitions}
        ours = (
            i
            for i, (sent, _) in enumerate(self._sent)
            if sent == answered or (err is not None and not partitions)
        )
        index = next(ours, None)
        if index is None:
            return  # not one of ours (a synchronous commit's echo)
        merged, callers = self._sent[index]
        del self._sent[index]
        failed = (
            set(merged) if err is not None else {(tp.topic, tp.partition) for tp in partitions if tp.error}
        )
        if failed:
            why = err if err is not None else next(tp.error for tp in partitions if tp.error)
            self._commit_failed(merged, callers, failed, why)

    def _commit_failed(
        self,
        merged: dict[TP, int],
        callers: list[tuple[dict[TP, int], CommitFailed | None]],
        failed: set[TP],
        why: object,
    ) -> None:
        """Tell each caller of a commit which of its offsets were not stored, so it can offer them again.

        A commit refused because its topic is gone or may not be read counts as that topic being
        unreadable (:meth:`unreadable_for`), and the warning is logged at most every :data:`LOG_EVERY_S`.
        A review: with a worker's requests topic deleted, its consumer got no error at all (librdkafka says
        nothing to an assigned member), the worker stayed ready, and the commit offered again every ~0.4 s
        logged 76 warnings in 30 s; the refused commits are the one sign, so the worker is now not ready."""
        code = _error_code(why)
        if code in UNREADABLE:
            for topic in sorted({topic for topic, _ in failed}):
                self._note_unreadable(topic, f"a commit was refused: {why}")
        now = time.monotonic()
        if now - self._commit_failure_logged >= LOG_EVERY_S:
            suppressed, self._commit_failures_unlogged = self._commit_failures_unlogged, 0
            self._commit_failure_logged = now
            more = f" ({suppressed} more since the last such warning)" if suppressed else ""
            log.warning("commit of %s failed: %s%s", merged, why, more)
        else:
            self._commit_failures_unlogged += 1
        for offsets, on_failure in callers:
            refused = {tp: off for tp, off in offsets.items() if tp in failed}
            if on_failure is not None and refused:
                on_failure(refused)

    def stop(self) -> None:
        self._stop.set()
        self._stop_on_loop()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.failure is not None:
            raise BusError(f"{self.name} failed: {self.failure}") from self.failure


_P = ParamSpec("_P")


class _Live:
    """Whether one client is still its thread's: a replaced client is closed on another thread, where
    librdkafka serves its late callbacks, and they then do nothing."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current = True

    def retire(self) -> None:
        self.current = False

    def only(self, callback: Callable[_P, None]) -> Callable[_P, None]:
        """``callback``, called only while the client is current."""

        def call(*args: _P.args, **kwargs: _P.kwargs) -> None:
            if self.current:
                callback(*args, **kwargs)

        return call


def _running(loop: asyncio.AbstractEventLoop) -> bool:
    """Whether ``loop`` runs on this thread (a stop there cannot wait for it)."""
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _close_quietly(consumer: Consumer, name: str) -> None:
    try:
        consumer.close()
    except Exception:
        log.warning("%s: closing a replaced consumer failed", name, exc_info=True)


def _error_code(why: object) -> int | None:
    """The Kafka error code of a commit's failure (a ``KafkaError``, or a ``KafkaException`` of one)."""
    if isinstance(why, KafkaException) and why.args and isinstance(why.args[0], KafkaError):
        why = why.args[0]
    return why.code() if isinstance(why, KafkaError) else None


class _Source(Protocol):
    def poll(self, timeout: float) -> Message | None: ...
    def consume(self, num_messages: int, timeout: float) -> list[Message]: ...


def past_ends(consumer: Consumer, ends: Mapping[tuple[str, int], int]) -> list[tuple[str, int]]:
    """The partitions of ``ends`` (topic, partition -> an end offset) the consumer's position has reached
    the end of. A transaction's commit or abort marker (or an aborted record) at a partition's end is never
    handed over, but the position moves past it: a reader waiting for a record at ``end - 1`` waited for
    good on a topic a transactional tool wrote (MirrorMaker 2, Kafka Connect exactly-once), and no worker,
    CLI or streams worker could start, nor a replay end (reviews)."""
    if not ends:
        return []
    return [
        (tp.topic, tp.partition)
        for tp in consumer.position([TopicPartition(topic, part) for topic, part in ends])
        if tp.offset >= 0 and tp.offset >= ends[(tp.topic, tp.partition)]
    ]


def take_batch(consumer: _Source, size: int, linger_s: float, wait_s: float = 0.05) -> list[Message]:
    """Up to ``size`` records: none when nothing comes within ``wait_s``; else the first record and what
    follows it within ``linger_s`` (0: only what is already fetched). librdkafka fills the list in C."""
    first = consumer.poll(wait_s)  # returns at the first record; consume() with a timeout would wait
    if first is None:
        return []
    messages = [first]
    deadline = time.monotonic() + linger_s
    while len(messages) < size:
        left = max(0.0, deadline - time.monotonic())
        messages += consumer.consume(num_messages=size - len(messages), timeout=left)
        if left == 0.0:
            break
    return messages


def _benign_error(message: Message) -> bool:
    """Whether a polled message is an error to skip (True) or a record (False). A fatal error (the client
    can no longer work, e.g. fenced or misconfigured) raises: the consumer thread stops and says why."""
    err = message.error()
    if err is None:
        return False
    if err.fatal():
        raise KafkaException(err)
    if err.code() == KafkaError._PARTITION_EOF:
        return True
    log.warning("consumer error: %s", err)
    return True


class UnreadableHeaders(ValueError):
    """A record's headers confluent-kafka cannot read: a key that is not UTF-8 (only Java clients always
    write UTF-8 keys; librdkafka's C API, Go and aiokafka write any bytes)."""


def record_headers(message: Message) -> list[tuple[str, HeaderValue]]:
    """A record's headers as ``(key, value)`` pairs (confluent-kafka may give a list or a dict).

    Raises :class:`UnreadableHeaders` for a key that is not UTF-8 (confluent-kafka raises ``SystemError``
    over a ``UnicodeDecodeError``: it escaped the handlers and stopped the consumer, on every restart, a
    review). Do not read that record's headers again: confluent-kafka then hands back a NULL key, which
    crashed the process."""
    try:
        raw = message.headers() or []
    except (SystemError, UnicodeDecodeError) as exc:
        cause = exc.__cause__ or exc.__context__ or exc
        raise UnreadableHeaders(f"a header key is not UTF-8 ({cause})") from None
    return list(raw.items()) if isinstance(raw, dict) else list(raw)


class _PartitionStats(msgspec.Struct):
    """The fields of librdkafka's per-partition statistics used here (offsets are -1001 when unknown)."""

    partition: int
    app_offset: int = -1001
    hi_offset: int = -1001
    ls_offset: int = -1001
    consumer_lag: int = -1

    def lag(self, *, read_committed: bool) -> int | None:
        if self.consumer_lag >= 0:  # end - committed offset, computed by librdkafka
            return self.consumer_lag
        end = self.ls_offset if read_committed else self.hi_offset
        if end == 0:
            return 0  # a partition that never held a record: nothing to read, whoever reads it
        if end < 0 or self.app_offset < 0:
            return None
        return max(0, end - self.app_offset)


class _TopicStats(msgspec.Struct):
    partitions: dict[str, _PartitionStats] = msgspec.field(default_factory=dict)


class _GroupStats(msgspec.Struct):
    """librdkafka's consumer group statistics: ``state`` (``up`` once it has a coordinator) and
    ``join_state`` (``steady`` once a rebalance is done)."""

    state: str = ""
    join_state: str = ""


class _BrokerStats(msgspec.Struct):
    """librdkafka's statistics of one broker connection: ``state`` is ``UP`` while it is connected."""

    state: str = ""


class _Stats(msgspec.Struct):
    topics: dict[str, _TopicStats] = msgspec.field(default_factory=dict)
    cgrp: _GroupStats | None = None
    brokers: dict[str, _BrokerStats] = msgspec.field(default_factory=dict)


_STATS = msgspec.json.Decoder(_Stats)
