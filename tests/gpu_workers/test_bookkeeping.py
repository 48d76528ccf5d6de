"""The worker's exactly-once bookkeeping under random interleavings, against a reference model.

The real ``WorkerService`` model-thread code runs here (inbox, offsets, generations, delivery reports,
commits, revocations with their drain), with Kafka replaced at its edges: records are put into the inbox as
the consumer thread would, terminal events go to a fake producer whose deliveries the test acknowledges or
fails when it likes, commits go to a fake that the broker may refuse, and a partition that is revoked and
assigned again is redelivered from its last committed offset, as Kafka does. A revocation runs
``_on_revoke`` on its own thread, as the consumer's callback does, while the test plays the model thread.

After every step: no committed offset passes a record whose request has not ended durably, no request
ends durably twice, no record consumed before its partition's revocation is run after it. At the end, with
everything delivered, every record ever consumed has ended exactly once and every partition is committed
to its end.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Message

from bus.errors import BusError
from gpu_workers.observe import RunnerLoad
from gpu_workers.runtime import Arrival, Emitter
from gpu_workers.service import WorkerService, _Cancel
from schemas.codec import decode, encode
from schemas.events import DeadLetter, GenerationRequested, ReplyTo, RequestFinished, TokenChunk, Usage
from schemas.ids import uuid7
from schemas.settings import KafkaConnection
from schemas.topics import TopicNames

TOPIC = "p.requests.m"
PARTITIONS = (0, 1, 2)


class FakeRunner:
    """Requests wait until the test starts them, run until it finishes them."""

    def __init__(self) -> None:
        self.waiting: dict[str, Arrival] = {}
        self.running: dict[str, Arrival] = {}
        self.accepted: list[Arrival] = []

    def accept(self, arrival: Arrival, emit: Emitter) -> None:
        self.accepted.append(arrival)
        self.waiting[arrival.event.request_id] = arrival

    def start(self, request_id: str) -> None:
        self.running[request_id] = self.waiting.pop(request_id)

    def finish(self, request_id: str, emit: Emitter, status: str = "completed") -> None:
        arrival = self.running.pop(request_id, None) or self.waiting.pop(request_id)
        emit.finish(
            arrival,
            RequestFinished(
                tenant=arrival.event.tenant,
                model=arrival.event.model,
                request_id=request_id,
                source="fake",
                status=status,  # type: ignore[arg-type]
                finish_reason="stop" if status == "completed" else "cancelled",
                usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
            ),
        )

    def cancel(self, request_id: str, emit: Emitter) -> None:
        if request_id in self.running or request_id in self.waiting:
            self.finish(request_id, emit, "cancelled")

    def release(self, request_ids: Collection[str], *, running: bool = False) -> set[str]:
        released = {r for r in request_ids if r in self.waiting or (running and r in self.running)}
        for request_id in released:
            self.waiting.pop(request_id, None)
            self.running.pop(request_id, None)
        return released

    def tick(self, emit: Emitter) -> None:
        pass

    def wait_hint(self) -> float | None:
        return 0.0

    def load(self) -> RunnerLoad:
        return RunnerLoad(running=len(self.running), waiting=len(self.waiting), budget_ratio=0.0, batch=0)


@dataclass
class FakeProducer:
    """Holds every produce until the test delivers (or fails) it."""

    pending: list[tuple[str, bytes, Callable[..., None] | None]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    refused: set[str] = field(default_factory=set)
    """Topics whose records are refused at once (librdkafka knows them missing)."""

    def produce_raw(self, topic: str, value: bytes, *, on_delivery: Any = None, **_: Any) -> None:
        if topic in self.refused:
            unknown = KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC))  # as librdkafka refuses it
            raise BusError(f"cannot produce to {topic}: unknown topic") from unknown
        with self.lock:
            self.pending.append((topic, value, on_delivery))

    def produce(self, topic: str, event: Any, *, on_delivery: Any = None, **_: Any) -> None:
        # a dead letter: token chunks (told of a delivery only to warn) are not part of the bookkeeping
        if on_delivery is not None and not isinstance(event, TokenChunk):
            self.produce_raw(topic, encode(event), on_delivery=on_delivery)

    def settle(self, index: int, ok: bool) -> tuple[str, bytes, bool]:
        with self.lock:
            topic, value, callback = self.pending.pop(index)
        if callback is not None:
            callback(None if ok else BusError("broker down"), (0, 0) if ok else None)
        return topic, value, ok


@dataclass
class Model:
    """What Kafka and the clients would see."""

    next_offset: dict[int, int] = field(default_factory=lambda: dict.fromkeys(PARTITIONS, 0))
    committed: dict[int, int] = field(default_factory=lambda: dict.fromkeys(PARTITIONS, 0))
    records: dict[tuple[int, int], str] = field(default_factory=dict)
    """(partition, offset) -> request id: the log."""
    junk: set[tuple[int, int]] = field(default_factory=set)
    """(partition, offset) of the log's records that do not decode."""
    lettered: Counter[tuple[int, int]] = field(default_factory=Counter)
    """(partition, offset) -> its dead letters durable."""
    assigned: set[int] = field(default_factory=lambda: set(PARTITIONS))
    durable: Counter[str] = field(default_factory=Counter)
    """Request id -> terminal events durable on the results topic."""
    revoked_at: dict[int, int] = field(default_factory=dict)
    """Partition -> how many arrivals the runner had accepted when it was last revoked."""


class Harness:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.producer = FakeProducer()
        self.commits: list[dict[tuple[str, int], int]] = []
        self.model = Model()
        self.refuse_commits = False
        self._start_worker()

    def _start_worker(self) -> None:
        self.runner = FakeRunner()
        runner = self.runner
        self.service = WorkerService(
            model_id="m",
            worker_id="w",
            kafka=KafkaConnection("127.0.0.1:9"),
            names=TopicNames("p"),
            runner_factory=lambda: runner,
        )
        self.service._producer = self.producer  # type: ignore[assignment]
        self.service.LETTER_RETRY_S = 0.0  # a letter Kafka did not take goes again at the next model step
        self.service._requests.commit = self._commit  # type: ignore[method-assign]
        self.emit = _Emit(self.service)

    def restart(self) -> None:
        """The worker failed (a results copy Kafka did not take): it stops, its producer flushing what it
        holds and its last commit going out, and its supervisor starts a fresh one, which learns every
        request ended on the results topic; the group redelivers every partition from its last commit."""
        assert self.service.failure is not None
        while self.producer.pending:
            self.deliver(0, ok=True)
        self.service._last_commit()
        self._start_worker()
        for request_id, n in self.model.durable.items():
            if n:
                self.service._remember_finished(request_id)
        self.model.revoked_at = {}
        for part in PARTITIONS:
            self.model.assigned.add(part)
            self.assign(part)

    # --- Kafka's side --------------------------------------------------------------------------------

    def _commit(self, offsets: dict[tuple[str, int], int], on_failure: Any = None) -> None:
        if self.refuse_commits and on_failure is not None:
            on_failure(offsets)
            return
        self.commits.append(offsets)
        for (_, part), offset in offsets.items():
            self.check_commit(part, offset)
            self.model.committed[part] = max(self.model.committed[part], offset)

    def consume(self, part: int, fresh: bool) -> None:
        offset = self.model.next_offset[part]
        if (part, offset) in self.model.junk:
            self.consume_junk(part)
            return
        if (part, offset) not in self.model.records:
            if not fresh:
                return
            self.model.records[(part, offset)] = uuid7()
        request_id = self.model.records[(part, offset)]
        event = GenerationRequested(
            tenant="t", model="m", request_id=request_id, source="edge", model_version="v", input_ids=[1]
        )
        self.service._inbox.put_nowait(
            Arrival(event, (TOPIC, part), offset, generation=self.service._ledger.generation)
        )
        self.model.next_offset[part] = offset + 1

    def consume_junk(self, part: int) -> None:
        """A record that does not decode (fresh, or the log's again), through the consumer thread's code."""
        offset = self.model.next_offset[part]
        self.model.junk.add((part, offset))
        self.service._on_requests([Message(topic=TOPIC, partition=part, offset=offset, value=b"{junk")])
        self.model.next_offset[part] = offset + 1

    def revoke(self, part: int) -> None:
        """The consumer thread's revoke callback, with this thread playing the model thread meanwhile."""
        result: dict[str, Any] = {}
        thread = threading.Thread(
            target=lambda: result.update(final=self.service._on_revoke([(TOPIC, part)], False))
        )
        self.model.assigned.discard(part)
        self.model.revoked_at[part] = len(self.runner.accepted)
        thread.start()
        while thread.is_alive():
            self.model_thread_step()
            for request_id in [r for r, a in self.runner.running.items() if a.tp == (TOPIC, part)]:
                self.runner.finish(request_id, self.emit)
            while self.producer.pending:
                self.deliver(0, ok=True)
            self.service._commit()
            thread.join(0.01)
        final = result["final"] or {}
        for (_, p), offset in final.items():
            self.check_commit(p, offset)
            self.model.committed[p] = max(self.model.committed[p], offset)

    def lose(self, part: int) -> None:
        """The partition is lost (a missed session, a replaced consumer): no wait, nothing committed; the
        requests of it running here run on."""
        self.model.assigned.discard(part)
        self.model.revoked_at[part] = len(self.runner.accepted)
        assert self.service._on_revoke([(TOPIC, part)], True) is None

    def assign(self, part: int) -> None:
        self.model.assigned.add(part)
        self.model.next_offset[part] = self.model.committed[part]  # redelivered from the last commit

    def deliver(self, index: int, ok: bool) -> None:
        topic, value, delivered = self.producer.settle(index, ok)
        if delivered and topic == self.service._names.results:
            event = decode(value)
            assert isinstance(event, RequestFinished)
            self.model.durable[event.request_id] += 1
            assert self.model.durable[event.request_id] == 1, f"{event.request_id} ended twice"
        if delivered and topic == self.service._names.deadletter:
            letter = decode(value)
            assert isinstance(letter, DeadLetter)
            self.model.lettered[(letter.partition, letter.offset)] += 1

    # --- the model thread ----------------------------------------------------------------------------

    def model_thread_step(self) -> None:
        self.service._drain(self.runner, self.emit, block=0)
        self.check_no_stale_run()

    # --- invariants ----------------------------------------------------------------------------------

    def check_commit(self, part: int, offset: int) -> None:
        """Never past a record whose request has not ended durably, unless another record of that request
        is still uncommitted (a crash redelivers that one: the request is not lost), nor past one that does
        not decode before its dead letter is durable."""
        for o in range(offset):
            if (part, o) in self.model.junk:
                assert self.model.lettered[(part, o)], f"committed {part}@{offset} past {o}, never lettered"
            request_id = self.model.records.get((part, o))
            if request_id is not None and self.model.durable[request_id] == 0:
                elsewhere = [
                    (p, q)
                    for (p, q), r in self.model.records.items()
                    if r == request_id and (p, q) != (part, o)
                ]
                kept = any(q >= self.model.committed[p] for p, q in elsewhere)
                assert kept, f"committed {part}@{offset} past unfinished {o}"

    def check_no_stale_run(self) -> None:
        """A record consumed before its partition was revoked is never handed to the runner after."""
        for part, accepted_before in self.model.revoked_at.items():
            for arrival in self.runner.accepted[accepted_before:]:
                if arrival.tp == (TOPIC, part):
                    stale = self.service._ledger.stale((TOPIC, part), arrival.generation)
                    assert not stale, f"a revoked record of {part} ran"


class _Emit:
    def __init__(self, service: WorkerService) -> None:
        self._service = service

    def chunk(self, arrival: Arrival, chunk: TokenChunk) -> None:
        pass

    def finish(self, arrival: Arrival, result: RequestFinished) -> None:
        self._service._publish_finish(arrival, result)

    def joined(self, arrival: Arrival, batch: int, budget_ratio: float) -> None:
        pass


def step(h: Harness, action: str) -> bool:
    """One random action of the harness's own (False: ``action`` is not one of them)."""
    rng = h.rng
    if action == "consume":
        if h.model.assigned:
            h.consume(rng.choice(sorted(h.model.assigned)), fresh=True)
    elif action == "drain":
        h.model_thread_step()
    elif action == "start":
        if h.runner.waiting:
            h.runner.start(rng.choice(sorted(h.runner.waiting)))
    elif action == "finish":
        if h.runner.running:
            h.runner.finish(rng.choice(sorted(h.runner.running)), h.emit)
    elif action in ("deliver", "fail"):
        if h.producer.pending:
            h.deliver(rng.randrange(len(h.producer.pending)), ok=action == "deliver")
            if h.service.failure is not None:
                h.restart()
    elif action == "commit":
        h.service._commit()
    elif action == "revoke":
        if h.model.assigned:
            h.revoke(rng.choice(sorted(h.model.assigned)))
    elif action == "lose":
        if h.model.assigned:
            h.lose(rng.choice(sorted(h.model.assigned)))
    elif action == "assign":
        for part in sorted(set(PARTITIONS) - h.model.assigned):
            h.assign(part)
    elif action == "cancel":
        if h.model.records:
            h.service._inbox.put_nowait(_Cancel(rng.choice(sorted(h.model.records.values()))))
    elif action == "junk":  # at the log's end (else what is there is redelivered)
        if h.model.assigned:
            part = rng.choice(sorted(h.model.assigned))
            if (part, h.model.next_offset[part]) in h.model.records:
                h.consume(part, fresh=False)
            else:
                h.consume_junk(part)
    elif action == "refuse":
        h.refuse_commits = not h.refuse_commits
    else:
        return False
    return True


def quiesce(h: Harness, rounds: int = 50, each: Callable[[], None] | None = None) -> None:
    """Every partition back, every record consumed, everything run, delivered and committed (``each``:
    what else happens every round, before this worker runs what it has)."""
    h.refuse_commits = False
    for part in sorted(set(PARTITIONS) - h.model.assigned):
        h.assign(part)
    for round_ in range(rounds):
        if round_ % 10 == 9:  # what waits for a redelivery
            for part in PARTITIONS:
                h.revoke(part)
                h.assign(part)
        for part in PARTITIONS:
            redeliver(h, part)
        if each is not None:
            each()
        h.model_thread_step()
        for request_id in sorted(h.runner.waiting):
            h.runner.start(request_id)
        for request_id in sorted(h.runner.running):
            h.runner.finish(request_id, h.emit)
        while h.producer.pending:
            h.deliver(0, ok=True)
        h.service._commit()


def assert_quiet(h: Harness) -> None:
    """Every record ever consumed ended exactly once, every partition is committed to its end, and the
    worker holds nothing for any of them."""
    never = set(h.model.records.values()) - {request_id for request_id, n in h.model.durable.items() if n}
    assert not never, f"{len(never)} requests never ended"
    assert all(n == 1 for n in h.model.durable.values())
    assert all(h.model.lettered[where] for where in h.model.junk), "a record that does not decode unlettered"
    logged = set(h.model.records) | h.model.junk
    ends = {part: max((o for p, o in logged if p == part), default=-1) + 1 for part in PARTITIONS}
    assert h.model.committed == ends
    assert not h.service._followers
    assert not h.service._publishing
    assert sum(h.service._ledger.running().values()) == 0, h.service._ledger.running()


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_end_every_request_exactly_once(seed: int) -> None:
    h = Harness(seed)
    for _ in range(400):
        action = h.rng.choices(
            ["consume", "drain", "start", "finish", "deliver", "fail", "commit", "revoke", "assign", "cancel",
             "refuse", "lose", "junk"],
            weights=[20, 15, 10, 10, 15, 2, 8, 2, 3, 2, 1, 1, 2],
        )[0]  # fmt: skip
        step(h, action)
    quiesce(h)
    assert_quiet(h)


def request_on(h: Harness, part: int, *, reply: bool = False) -> str:
    """A fresh record on ``part`` (with a reply partition: two copies of its terminal event)."""
    offset = h.model.next_offset[part]
    request_id = h.model.records.setdefault((part, offset), uuid7())
    event = GenerationRequested(
        tenant="t", model="m", request_id=request_id, source="edge", model_version="v", input_ids=[1],
        reply=ReplyTo(topic="p.replies", partition=0, edge_id="e") if reply else None,
    )  # fmt: skip
    h.service._inbox.put_nowait(
        Arrival(event, (TOPIC, part), offset, generation=h.service._ledger.generation)
    )
    h.model.next_offset[part] = offset + 1
    return request_id


def redeliver(h: Harness, part: int) -> None:
    while (part, h.model.next_offset[part]) in h.model.records.keys() | h.model.junk:
        h.consume(part, fresh=False)


@pytest.mark.parametrize("produced", [False, True])
def test_a_lost_partition_handed_back_never_commits_past_its_running_request(produced: bool) -> None:
    """The group loses the partition while a request of it runs here, then hands it back to this worker,
    which is given the same record again: it waits for the running request (or its terminal event on its
    way) and is committed with it, never before (a review saw the group's offset pass a running request,
    which a crash then lost)."""
    h = Harness(0)
    h.service.COMMIT_INTERVAL_S = 0.0
    request_id = request_on(h, 0)
    h.model_thread_step()
    h.runner.start(request_id)
    if produced:
        h.runner.finish(request_id, h.emit)  # its terminal event is on its way
    h.lose(0)
    h.assign(0)
    redeliver(h, 0)
    h.model_thread_step()
    h.service._commit()  # checks: nothing committed past a request not ended durably
    assert h.model.committed[0] == 0
    assert len(h.runner.accepted) == 1, "the redelivered record ran a second time"
    if not produced:
        h.runner.finish(request_id, h.emit)
    while h.producer.pending:
        h.deliver(0, ok=True)
    h.service._commit()
    assert h.model.committed[0] == 1
    assert h.service._ledger.running() == Counter()


def test_a_revoke_waits_for_a_record_the_model_thread_is_taking() -> None:
    """A revoke landing after the model thread took a record but before it counted it running used to
    see nothing busy and hand the partition over at once, and the record then ran here too: the revoke
    now waits until the model thread has seen it (and given the record back, unstarted)."""
    h = Harness(1)
    real = h.service._placement
    finals: list[dict[tuple[str, int], int] | None] = []
    revoker: list[threading.Thread] = []

    def placement(event: Any) -> Any:  # on the model thread, after the record was taken, before it runs
        if not revoker:
            h.model.assigned.discard(0)
            thread = threading.Thread(target=lambda: finals.append(h.service._on_revoke([(TOPIC, 0)], False)))
            revoker.append(thread)
            thread.start()
            deadline = time.monotonic() + 10
            while h.service._ledger.generation == 0:  # the revoke is under way, waiting
                assert time.monotonic() < deadline, "the revoke never started"
        return real(event)

    h.service._placement = placement  # type: ignore[method-assign]
    request_id = request_on(h, 0)
    h.model_thread_step()
    revoker[0].join(5)
    assert not revoker[0].is_alive(), "the revoke never returned"
    assert finals == [{}] or finals == [None] or (finals[0] or {}).get((TOPIC, 0), 0) == 0, finals
    assert request_id not in h.runner.waiting
    assert request_id not in h.runner.running


def test_a_reply_copy_lost_with_the_results_copy_durable_ends_the_request() -> None:
    """The edge's copy of the terminal event was not delivered but the results copy was: the request
    ended on the log. It used to be un-finished, and run (and ended) again when redelivered here."""
    h = Harness(2)
    h.service.COMMIT_INTERVAL_S = 0.0
    request_id = request_on(h, 0, reply=True)
    h.model_thread_step()
    h.runner.start(request_id)
    h.runner.finish(request_id, h.emit)
    topics = [topic for topic, _, _ in h.producer.pending]
    h.deliver(topics.index("p.replies"), ok=False)
    h.deliver(0, ok=True)
    h.service._commit()
    assert h.model.committed[0] == 1
    h.revoke(0)
    h.assign(0)
    redeliver(h, 0)
    h.model_thread_step()
    assert len(h.runner.accepted) == 1
    assert h.service.failure is None


class SlowTick(FakeRunner):
    """Its first step lasts until released (a CPU embedding batch, a first graph capture)."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()
        self.let_go = threading.Event()

    def tick(self, emit: Emitter) -> None:
        self.entered.set()
        self.let_go.wait(10)


def test_a_revoke_of_an_idle_partition_does_not_wait_for_a_model_step() -> None:
    """The revoke waits for the model thread only while it is between taking a record and counting it
    (a review: waiting for its next step held every rebalance for up to a whole batch)."""
    h = Harness(0)
    runner = SlowTick()
    h.service._runner_factory = lambda: runner
    thread = threading.Thread(target=h.service._serve, daemon=True)
    thread.start()
    assert runner.entered.wait(10), "the model thread never stepped"
    began = time.monotonic()
    h.service._on_revoke([(TOPIC, 2)], False)  # nothing of partition 2 was ever consumed
    took = time.monotonic() - began
    runner.let_go.set()
    h.service._stop.set()
    thread.join(5)
    # the step lasts 10 s unless released after the revoke: a revoke waiting for it takes that long
    assert took < 5, f"a revoke of a partition with nothing running waited {took:.2f}s for a model step"


def test_another_record_of_a_running_request_is_released_at_once() -> None:
    """A re-published record of a request running here, on another partition: its request's own record
    holds its partition back, so this one is committed at once; following it tied the two partitions'
    revokes together (a review: a revoke waited for a request queued elsewhere, and a duplicate taken
    again ended its request twice)."""
    h = Harness(4)
    h.service.COMMIT_INTERVAL_S = 0.0
    request_id = request_on(h, 0)
    h.model_thread_step()
    h.model.records[(1, 0)] = request_id
    redeliver(h, 1)
    h.model_thread_step()
    assert request_id not in h.service._followers
    h.service.REVOKE_DRAIN_S = 10.0  # the request never ends: a revoke waiting for it takes this long
    began = time.monotonic()
    h.revoke(1)
    assert time.monotonic() - began < 5, "the revoke of the duplicate's partition waited for its request"
    assert [a.tp for a in h.runner.accepted] == [(TOPIC, 0)]
    assert h.model.committed[0] == 0


def test_a_failed_worker_does_not_run_again_a_request_whose_results_copy_may_be_written() -> None:
    """Whether the log has a results copy that timed out is unknown: the worker fails (its next start reads
    the results topic and runs the request again only if it is not there). Until its supervisor stops it,
    it may still take records: one of that request must not run (the copy may be on the log after all),
    and nothing of it is committed."""
    h = Harness(5)
    h.service.COMMIT_INTERVAL_S = 0.0
    request_id = request_on(h, 0)
    h.model_thread_step()
    h.runner.start(request_id)
    h.runner.finish(request_id, h.emit)
    h.deliver(0, ok=False)
    h.service._commit()
    assert h.service.failure is not None
    h.model.records[(0, 1)] = request_id  # the same request again (a re-published line)
    redeliver(h, 0)
    h.model_thread_step()
    h.service._commit()
    assert len(h.runner.accepted) == 1
    assert h.model.committed[0] == 0


@pytest.mark.parametrize("delivered", [True, False])
def test_a_record_that_does_not_decode_is_committed_only_once_its_dead_letter_is_durable(
    delivered: bool,
) -> None:
    """The junk's offset, and the requests after it, wait for its dead letter: committed once it lands. A
    letter Kafka does not take is sent again (the worker serving on, the partition's commit held) until
    one lands (a review found the offset marked done at once: a crash in between lost the record from the
    dead letters)."""
    h = Harness(3)
    h.service.COMMIT_INTERVAL_S = 0.0
    h.consume_junk(0)
    after = request_on(h, 0)
    h.model_thread_step()
    h.runner.start(after)
    h.runner.finish(after, h.emit)
    (letter,) = [
        i for i, (topic, _, _) in enumerate(h.producer.pending) if topic == h.service._names.deadletter
    ]
    h.deliver(1 - letter, ok=True)  # the request's terminal event first
    h.service._commit()
    assert h.model.committed[0] == 0, "committed past a dead letter not yet durable"
    h.deliver(0, ok=delivered)
    h.service._commit()
    assert h.service.failure is None
    if not delivered:
        assert h.model.committed[0] == 0
        assert not h.producer.pending
        h.model_thread_step()  # sent again
        ((topic, _, _),) = h.producer.pending
        assert topic == h.service._names.deadletter
        h.deliver(0, ok=True)
        h.service._commit()
    assert h.model.committed[0] == 2
    assert h.model.lettered[(0, 0)] == 1
    quiesce(h)
    assert_quiet(h)


def test_a_revoke_waits_for_a_dead_letter_on_its_way() -> None:
    """A revoke commits a partition only up to a junk record whose letter is not durable yet, and waits
    for it (as for a terminal event): the next owner would letter it again otherwise."""
    h = Harness(4)
    h.service.COMMIT_INTERVAL_S = 0.0
    h.consume_junk(0)
    h.model_thread_step()
    assert h.service._ledger.running()[((TOPIC, 0), h.service._ledger.generation)] == 1
    h.revoke(0)  # plays the model thread and delivers what is pending while the revoke waits
    assert h.model.committed[0] == 1
    assert h.model.lettered[(0, 0)] == 1


@pytest.mark.parametrize("lost", [False, True])
def test_junk_whose_partition_goes_while_it_waits_in_the_inbox_is_lettered_by_the_next_owner_only(
    lost: bool,
) -> None:
    """A record that does not decode is lettered when the model thread takes it, not on its way into the
    inbox: one whose partition was revoked (or lost) while it waited there is stale, and its next owner
    letters it. It used to be lettered on the way in too: two letters of one record."""
    h = Harness(8)
    h.service.COMMIT_INTERVAL_S = 0.0
    h.consume_junk(0)  # in the inbox, not taken yet
    if lost:
        h.lose(0)
    else:  # nothing of the partition runs here: the revoke does not wait for the model thread
        h.model.assigned.discard(0)
        h.model.revoked_at[0] = len(h.runner.accepted)
        for (_, part), offset in (h.service._on_revoke([(TOPIC, 0)], False) or {}).items():
            h.check_commit(part, offset)
            h.model.committed[part] = max(h.model.committed[part], offset)
    h.model_thread_step()  # finds it stale
    while h.producer.pending:
        h.deliver(0, ok=True)
    assert h.model.lettered[(0, 0)] == 0, "lettered by the worker whose partition it no longer was"
    assert h.model.committed[0] == 0
    h.assign(0)  # handed back: read again from the last commit, as a next owner reads it
    quiesce(h)
    assert_quiet(h)
    assert h.model.lettered[(0, 0)] == 1


def test_a_draining_worker_letters_no_junk_it_leaves_to_the_next_owner() -> None:
    """A worker draining (stopping, its partitions about to move) takes nothing new from its inbox: a record
    that does not decode waiting there is neither lettered nor committed; the partition's next owner letters
    it (it was lettered on the way in, then again by that owner)."""
    h = Harness(9)
    h.service.COMMIT_INTERVAL_S = 0.0
    h.consume_junk(0)
    h.service._draining.set()
    h.model_thread_step()
    assert not h.producer.pending, "lettered by a worker that left the record to the next owner"
    h.service._commit()
    assert h.model.committed[0] == 0


def test_a_producer_gone_as_junk_is_lettered_fails_the_worker_and_its_successor_letters_it_once() -> None:
    """The model thread letters a record that does not decode when it takes it: a producer that is gone by
    then (closed, or a fatal error) raises there, and the worker fails. Nothing of the partition is committed
    past the record, and the worker that takes over letters it once and runs the request after it."""
    h = Harness(10)
    h.service.COMMIT_INTERVAL_S = 0.0
    h.consume_junk(0)
    after = request_on(h, 0)

    def gone(topic: str, value: bytes, **_: Any) -> None:
        raise BusError(f"cannot produce to {topic}: the producer is closed")  # no Kafka error: not a refusal

    h.producer.produce_raw = gone  # type: ignore[method-assign]
    with pytest.raises(BusError, match="closed"):
        h.model_thread_step()
    h.service.fail(BusError("the producer is closed"))  # what the model thread's loop does with it
    h.service._commit()
    assert h.model.committed[0] == 0
    del h.producer.produce_raw  # the fake's own method again, for the worker that takes over
    h.restart()
    quiesce(h)
    assert_quiet(h)
    assert h.model.lettered[(0, 0)] == 1
    assert h.model.durable[after] == 1


def test_a_dead_letter_refused_at_once_is_sent_again_and_the_worker_serves_on() -> None:
    """Once librdkafka knows the dead-letter topic missing, ``produce`` raises instead of reporting a failed
    delivery: the worker's consumer and model threads used to die of it (found by review). Now the letter
    counts as not delivered and is sent again until the topic is back; the requests around it run."""
    h = Harness(6)
    h.service.COMMIT_INTERVAL_S = 0.0
    deadletter = h.service._names.deadletter
    h.producer.refused.add(deadletter)
    h.consume_junk(0)
    after = request_on(h, 0)
    for _ in range(3):
        h.model_thread_step()
    assert h.service.failure is None
    h.runner.start(after)
    h.runner.finish(after, h.emit)
    while h.producer.pending:
        h.deliver(0, ok=True)
    h.service._commit()
    assert h.model.durable[after] == 1
    assert h.model.committed[0] == 0, "committed past a record never lettered"
    h.producer.refused.clear()  # the topic is back
    h.model_thread_step()
    ((topic, _, _),) = h.producer.pending
    assert topic == deadletter
    h.deliver(0, ok=True)
    h.service._commit()
    assert h.model.committed[0] == 2
    assert h.model.lettered[(0, 0)] == 1


def test_a_stopping_worker_commits_what_is_durable_however_soon_after_the_last_commit() -> None:
    """Commits go out at most once an interval; the stop's last one does not wait for it (before, a stop
    within the interval left the requests finished since for the next owner to read and skip)."""
    h = Harness(5)
    h.service.COMMIT_INTERVAL_S = 60.0

    def run_to_durable() -> None:
        request_id = request_on(h, 0)
        h.model_thread_step()
        h.runner.finish(request_id, h.emit)
        while h.producer.pending:
            h.deliver(0, ok=True)
        h.service._commit()

    run_to_durable()
    assert h.model.committed[0] == 1  # the first commit goes at once
    run_to_durable()
    assert h.model.committed[0] == 1, "within the interval"
    h.service._last_commit()
    assert h.model.committed[0] == 2


def test_a_results_copy_refused_at_once_ends_its_request_failed_and_the_worker_serves_on() -> None:
    """librdkafka refuses a record at ``produce`` when it is over its size limit with its key and headers.
    A terminal event sized to fit by its value alone, whose tenant and trace context took ~10 KB of headers
    beside it, was refused there: the model thread died of it, and every worker after it at the record's
    redelivery (an audit). Now the request ends ``failed`` with ``result_too_large`` on the results topic,
    once, and is committed."""
    h = Harness(7)
    h.service.COMMIT_INTERVAL_S = 0.0
    results = h.service._names.results
    refusals = [0]
    take = h.producer.produce_raw

    def refuse_first(topic: str, value: bytes, **kw: Any) -> None:
        if topic == results and not refusals[0]:
            refusals[0] += 1
            too_large = KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE))
            raise BusError(f"cannot produce to {topic}: too large") from too_large
        take(topic, value, **kw)

    h.producer.produce_raw = refuse_first  # type: ignore[method-assign]
    request = request_on(h, 0, reply=True)
    after = request_on(h, 0)
    h.model_thread_step()
    for request_id in (request, after):
        h.runner.start(request_id)
        h.runner.finish(request_id, h.emit)
    assert h.service.failure is None
    assert refusals[0] == 1
    ended: dict[str, RequestFinished] = {}
    for topic, value, _ in list(h.producer.pending):
        event = decode(value)
        if topic == results and isinstance(event, RequestFinished):
            ended[event.request_id] = event
    assert ended[request].status == "failed"
    error = ended[request].error
    assert error is not None
    assert error.code == "result_too_large"
    assert ended[after].status == "completed"
    while h.producer.pending:
        h.deliver(0, ok=True)
    h.model_thread_step()
    h.service._commit()
    assert h.model.durable[request] == h.model.durable[after] == 1
    assert h.model.committed[0] == 2


def test_a_request_released_at_a_revoke_leaves_nothing_observed_behind() -> None:
    """Found by review: a request given back at a revoke (an embedding's batch may have taken it already)
    kept what the worker had observed of it, its join time among it: held for good, and the start of a
    request handed back to this worker later."""
    h = Harness(8)
    request = request_on(h, 1)
    h.model_thread_step()
    h.service._observer.joined(request, batch=4, budget_ratio=0.5)  # a batch took it
    assert h.service._observer.joined_at(request) is not None
    h.revoke(1)
    assert request not in h.runner.waiting
    assert h.service._observer.joined_at(request) is None


def test_a_token_chunk_that_is_not_delivered_is_told_with_a_count_not_once_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A chunk that does not reach the log leaves its stream's text short until the terminal event fills it
    in at the edge (``ingest.reply_stream``): it was not told at all; in an outage, one line per chunk would
    flood the log."""
    h = Harness(9)
    lost = BusError("delivery to p.replies failed: Local: Message timed out")
    with caplog.at_level("WARNING", logger="gpu_workers.service"):
        for _ in range(3):
            h.service._chunk_delivered(lost, None)
        h.service._chunk_delivered(None, (0, 7))
    told = [r.getMessage() for r in caplog.records if "token chunk" in r.getMessage()]
    assert told == [
        "1 token chunk(s) not delivered (last: delivery to p.replies failed: Local: Message timed out); "
        "their streams' text comes with the terminal event"
    ]
    h.service._chunks_lost_told -= h.service.CHUNK_WARNING_EVERY_S  # the interval has passed
    caplog.clear()
    with caplog.at_level("WARNING", logger="gpu_workers.service"):
        h.service._chunk_delivered(lost, None)
    assert [r.getMessage()[:2] for r in caplog.records if "token chunk" in r.getMessage()] == ["3 "]
