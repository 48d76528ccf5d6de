"""How the consumer thread commits, against a fake librdkafka consumer whose synchronous commit never
returns (what a group whose session expired does while it waits for the poll loop to serve its
rebalance): the loop must keep polling, and each commit's outcome must reach whoever asked for it."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from confluent_kafka import KafkaError, Message, TopicPartition

import bus.consumer
from bus.consumer import ConsumerThread


class Record:
    def __init__(self, offset: int) -> None:
        self._offset = offset

    def error(self) -> None:
        return None

    def offset(self) -> int:
        return self._offset


@dataclass
class Answered:
    """A partition in librdkafka's answer to a commit (its ``TopicPartition.error`` cannot be set here)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None


class StuckGroupConsumer:
    """Serves ``records`` one per poll; a synchronous commit blocks until released, an asynchronous one
    is answered by the next poll (refused when ``refuse`` names its partition)."""

    made: list[StuckGroupConsumer] = []

    def __init__(self, config: dict[str, Any]) -> None:
        self.on_commit = config.get("on_commit", lambda err, partitions: None)
        self.records: queue.SimpleQueue[Record] = queue.SimpleQueue()
        self.answers: list[tuple[KafkaError | None, list[Answered]]] = []
        self.release = threading.Event()
        self.sync_commits = 0
        self.refuse: set[tuple[str, int]] = set()
        StuckGroupConsumer.made.append(self)

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def poll(self, timeout: float) -> Message | None:
        while self.answers:
            self.on_commit(*self.answers.pop(0))
        try:
            return self.records.get(timeout=timeout)  # type: ignore[return-value]
        except queue.Empty:
            return None

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return []

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        if not asynchronous:
            self.sync_commits += 1
            self.release.wait()
            return
        refused = KafkaError(KafkaError.ILLEGAL_GENERATION)
        answered = [
            Answered(
                tp.topic,
                tp.partition,
                tp.offset,
                refused if (tp.topic, tp.partition) in self.refuse else None,
            )
            for tp in offsets
        ]
        self.answers.append((None, answered))

    def close(self) -> None:
        self.release.set()


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> type[StuckGroupConsumer]:
    StuckGroupConsumer.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", StuckGroupConsumer)
    return StuckGroupConsumer


def test_a_commit_never_holds_up_the_poll_loop(fake: type[StuckGroupConsumer]) -> None:
    handled: queue.SimpleQueue[int] = queue.SimpleQueue()

    def handle(batch: list[Message]) -> None:
        for message in batch:
            offset = message.offset() or 0
            handled.put(offset)
            thread.commit({("t", 0): offset + 1})

    thread = ConsumerThread({}, handle, assign=[TopicPartition("t", 0, 0)], stats_interval_ms=0)
    with thread:
        (consumer,) = fake.made
        for offset in range(5):
            consumer.records.put(Record(offset))
        # each commit goes out between batches: a synchronous one would block here for good
        assert [handled.get(timeout=5) for _ in range(5)] == list(range(5))
        assert consumer.sync_commits == 0


def test_a_refused_asynchronous_commit_reaches_its_callers_with_their_own_offsets(
    fake: type[StuckGroupConsumer],
) -> None:
    refused: queue.SimpleQueue[dict[tuple[str, int], int]] = queue.SimpleQueue()
    thread = ConsumerThread({}, lambda batch: None, assign=[TopicPartition("t", 0, 0)], stats_interval_ms=0)
    with thread:
        (consumer,) = fake.made
        consumer.refuse = {("t", 1)}
        thread.commit({("t", 0): 4, ("t", 1): 7}, on_failure=refused.put)
        assert refused.get(timeout=5) == {("t", 1): 7}  # the partition stored is not offered again
        thread.commit({("t", 0): 9}, on_failure=refused.put)
        consumer.records.put(Record(0))  # a poll later: the answer to the second commit has come
        with pytest.raises(queue.Empty):
            refused.get(timeout=0.5)
        consumer.release.set()  # the stop's final commit may wait: the partitions change hands


class WedgedMember(StuckGroupConsumer):
    """A group member: the first one made settles once, then never again (its statistics say so every
    poll); the next one is assigned partition 0 of ``t`` and settles."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.stats = config["stats_cb"]
        self.settled = len(WedgedMember.made) > 1
        self.closed = threading.Event()
        self.callbacks: dict[str, Any] = {}
        self.polls = 0

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def poll(self, timeout: float) -> Message | None:
        join = "steady" if self.settled or self.polls == 0 else "wait-join"
        self.polls += 1
        self.stats(f'{{"cgrp": {{"state": "up", "join_state": "{join}"}}}}')
        if self.settled and not self.callbacks.pop("assigned", None):
            self.callbacks["on_assign"](self, [TopicPartition("t", 0)])
            self.callbacks["assigned"] = True
        return super().poll(min(timeout, 0.01))

    def close(self) -> None:
        self.closed.set()


def test_a_member_whose_group_never_settles_is_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    WedgedMember.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", WedgedMember)
    handled: queue.SimpleQueue[int] = queue.SimpleQueue()

    def handle(batch: list[Message]) -> None:
        for message in batch:
            handled.put(message.offset() or 0)

    thread = ConsumerThread({"group.id": "g"}, handle, subscribe=["t"], unsettled_limit_s=0.2)
    with thread:
        assert thread.wait_assigned(5)  # only the second consumer is ever assigned anything
        wedged, fresh = WedgedMember.made
        assert isinstance(wedged, WedgedMember)
        assert wedged.closed.wait(5)
        fresh.records.put(Record(3))
        assert handled.get(timeout=5) == 3
        time.sleep(0.5)  # a settled member stays
        assert len(WedgedMember.made) == 2


class NeverJoined(WedgedMember):
    """A member that never settles, not even once (its topics do not exist yet, say)."""

    def poll(self, timeout: float) -> Message | None:
        self.stats('{"cgrp": {"state": "up", "join_state": "init"}}')
        return StuckGroupConsumer.poll(self, min(timeout, 0.01))


def test_a_member_that_never_joined_is_left_to_keep_trying(monkeypatch: pytest.MonkeyPatch) -> None:
    NeverJoined.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", NeverJoined)
    with ConsumerThread({"group.id": "g"}, lambda batch: None, subscribe=["t"], unsettled_limit_s=0.1):
        time.sleep(0.6)
        assert len(NeverJoined.made) == 1


def test_how_long_a_member_has_been_out_of_its_group_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """``unsettled_for`` (a worker's readiness reads it): 0 while settled, growing once the member falls
    out of a group it was in."""
    WedgedMember.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", WedgedMember)
    with ConsumerThread(
        {"group.id": "g"}, lambda batch: None, subscribe=["t"], unsettled_limit_s=60
    ) as thread:
        deadline = time.monotonic() + 10  # settled at the first poll, out of the group from the second
        while (first := thread.unsettled_for()) == 0:  # (0.3 s of sleep was not two polls on a stalled box)
            assert time.monotonic() < deadline, "never told it was out of its group"
            time.sleep(0.01)
        time.sleep(0.2)
        assert 0 < first < thread.unsettled_for() < 60
        assert len(WedgedMember.made) == 1  # not replaced before its limit


class LateCallbacks(StuckGroupConsumer):
    """Every member is assigned partition 0 of ``t`` at its first poll. The first then falls out of its
    group; closed, it serves its late callbacks, as librdkafka does on the thread that closes it: the
    revoke of what it owned, and statistics saying it is still out of the group."""

    go = threading.Event()

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.stats = config["stats_cb"]
        self.first = len(LateCallbacks.made) == 1
        self.callbacks: dict[str, Any] = {}
        self.polls = 0
        self.closed = threading.Event()

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def poll(self, timeout: float) -> Message | None:
        join = "wait-join" if self.first and self.polls else "steady"
        self.stats(f'{{"cgrp": {{"state": "up", "join_state": "{join}"}}}}')
        if self.polls == 0:
            self.callbacks["on_assign"](self, [TopicPartition("t", 0)])
        self.polls += 1
        return super().poll(min(timeout, 0.01))

    def close(self) -> None:
        if self.first:
            assert LateCallbacks.go.wait(5)
            self.callbacks["on_revoke"](self, [TopicPartition("t", 0)])
            self.stats('{"cgrp": {"state": "up", "join_state": "wait-join"}}')
        self.closed.set()


def test_a_replaced_clients_late_callbacks_do_not_reach_its_successor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    LateCallbacks.made.clear()
    LateCallbacks.go.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", LateCallbacks)
    revoked: list[tuple[list[tuple[str, int]], bool]] = []

    def on_revoke(tps: list[tuple[str, int]], lost: bool) -> dict[tuple[str, int], int]:
        revoked.append((tps, lost))
        return {}

    with ConsumerThread(
        {"group.id": "g"}, lambda batch: None, subscribe=["t"], on_revoke=on_revoke, unsettled_limit_s=0.2
    ) as thread:
        deadline = time.monotonic() + 5
        while len(LateCallbacks.made) < 2 or getattr(LateCallbacks.made[1], "polls", 0) < 2:
            assert time.monotonic() < deadline, "the member that fell out was not replaced"
            time.sleep(0.01)
        wedged = LateCallbacks.made[0]
        assert isinstance(wedged, LateCallbacks)
        assert revoked == [([("t", 0)], True)]  # lost at the replacement: nothing committed
        LateCallbacks.go.set()  # now the old client's close serves its revoke and statistics
        assert wedged.closed.wait(5)
        time.sleep(0.1)
        assert revoked == [([("t", 0)], True)]  # not revoked again, from the closing thread
        assert thread.assignment() == {("t", 0)}  # the successor still owns it
        assert thread.unsettled_for() == 0.0  # and the old client's statistics are not its own
        assert len(LateCallbacks.made) == 2


class NeverSettlesAgain(WedgedMember):
    """The first member settles once and falls out; none made after it ever settles."""

    def poll(self, timeout: float) -> Message | None:
        join = "steady" if self is WedgedMember.made[0] and self.polls == 0 else "wait-join"
        self.polls += 1
        self.stats(f'{{"cgrp": {{"state": "up", "join_state": "{join}"}}}}')
        return StuckGroupConsumer.poll(self, min(timeout, 0.01))


def test_a_successor_that_never_settles_is_replaced_in_turn_and_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replacement is a member that must settle: one that does not is no better than the client it
    replaced, and its readiness must not read green meanwhile."""
    WedgedMember.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", NeverSettlesAgain)
    with ConsumerThread(
        {"group.id": "g"}, lambda batch: None, subscribe=["t"], unsettled_limit_s=0.2
    ) as thread:
        deadline = time.monotonic() + 5
        while len(WedgedMember.made) < 3:
            assert time.monotonic() < deadline, f"replaced {len(WedgedMember.made) - 1} times, not twice"
            time.sleep(0.01)
        assert thread.unsettled_for() > 0


class Revoking(StuckGroupConsumer):
    """Assigned partition 0 of ``t`` at the first poll, revoked at the second (a rebalance); records every
    commit it is asked for."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.release.set()
        self.callbacks: dict[str, Any] = {}
        self.polls = 0
        self.commits: list[tuple[list[tuple[str, int, int]], bool]] = []

    def subscribe(self, topics: list[str], **callbacks: Any) -> None:
        self.callbacks = callbacks

    def poll(self, timeout: float) -> Message | None:
        self.polls += 1
        if self.polls == 1:
            self.callbacks["on_assign"](self, [TopicPartition("t", 0)])
        elif self.polls == 2:
            self.callbacks["on_revoke"](self, [TopicPartition("t", 0)])
        return super().poll(min(timeout, 0.01))

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits.append(([(tp.topic, tp.partition, tp.offset) for tp in offsets], asynchronous))
        super().commit(offsets, asynchronous)


def first_commit() -> Revoking:
    """The one :class:`Revoking` client made, once it has been asked for a commit."""
    (consumer,) = Revoking.made
    assert isinstance(consumer, Revoking)
    deadline = time.monotonic() + 5
    while not consumer.commits:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return consumer


def test_what_an_owner_commits_while_it_finishes_a_revoked_partition_goes_out_before_the_hand_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker drains a revoked partition's requests in its revoke callback and commits their offsets as
    they finish: those must be stored before the partition changes hands, or its next owner runs them
    again."""
    Revoking.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", Revoking)
    done = threading.Event()

    def on_revoke(tps: list[tuple[str, int]], lost: bool) -> dict[tuple[str, int], int]:
        thread.commit({("t", 0): 5})  # the drain finished up to offset 4
        done.set()
        return {}

    thread = ConsumerThread({"group.id": "g"}, lambda batch: None, subscribe=["t"], on_revoke=on_revoke)
    with thread:
        assert done.wait(5)
        consumer = first_commit()
        assert consumer.commits[0] == ([("t", 0, 5)], False)  # synchronously, inside the revoke


def test_a_commit_of_a_partition_already_handed_over_is_left_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker marks offsets committed, then queues them: a revoke in between commits every point
    itself, and the queued commit, sent after the hand-over, would land over the next owner's."""
    Revoking.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", Revoking)
    revoked = threading.Event()

    def on_revoke(tps: list[tuple[str, int]], lost: bool) -> dict[tuple[str, int], int]:
        revoked.set()
        return {("t", 0): 3}

    thread = ConsumerThread({"group.id": "g"}, lambda batch: None, subscribe=["t"], on_revoke=on_revoke)
    with thread:
        assert revoked.wait(5)
        consumer = first_commit()
        thread.commit({("t", 0): 2, ("u", 1): 9})  # late: "t" 0 is someone else's now, "u" 1 never ours
        time.sleep(0.2)
        assert consumer.commits == [([("t", 0, 3)], False)]


class CommitsDuringTheHandOver(Revoking):
    """While the revoke's synchronous commit waits on the broker, the owner's model thread commits an
    offset it computed before the revoke (the GIL is free then, and the partition is still being handed
    over)."""

    late: ConsumerThread | None = None

    def commit(self, offsets: list[TopicPartition], asynchronous: bool) -> None:
        super().commit(offsets, asynchronous)
        if not asynchronous and self.late is not None:
            late = threading.Thread(target=self.late.commit, args=({("t", 0): 2},))
            late.start()
            late.join()


def test_a_commit_queued_while_the_hand_over_commits_is_not_sent_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: a commit queued while the revoke's own synchronous commit was on its way passed the
    ownership check (the partition was still being handed over), stayed queued, and went out at the next
    poll, after the hand-over, below the offset the revoke had committed: over the next owner's."""
    CommitsDuringTheHandOver.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", CommitsDuringTheHandOver)
    revoked = threading.Event()

    def on_revoke(tps: list[tuple[str, int]], lost: bool) -> dict[tuple[str, int], int]:
        revoked.set()
        return {("t", 0): 3}

    thread = ConsumerThread({"group.id": "g"}, lambda batch: None, subscribe=["t"], on_revoke=on_revoke)
    CommitsDuringTheHandOver.late = thread
    try:
        with thread:
            assert revoked.wait(5)
            consumer = first_commit()
            time.sleep(0.2)  # the poll loop's later rounds
            assert consumer.commits == [([("t", 0, 3)], False)]
    finally:
        CommitsDuringTheHandOver.late = None


class RebalancesOnce(WedgedMember):
    """Settled at the first poll; the second says a rebalance is under way and brings a record; settled
    again from the third."""

    def poll(self, timeout: float) -> Message | None:
        self.polls += 1
        join = "wait-join" if self.polls == 2 else "steady"
        self.stats(f'{{"cgrp": {{"state": "up", "join_state": "{join}"}}}}')
        if self.polls == 2:
            self.records.put(Record(7))
        return StuckGroupConsumer.poll(self, min(timeout, 0.01))


def test_a_handler_that_blocks_through_a_rebalance_does_not_get_its_member_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The group was seen unsettled once, then the handler held the thread past the limit (a worker's full
    inbox): no statistics came meanwhile, so nothing says the group is still unsettled."""
    WedgedMember.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", RebalancesOnce)
    handled = threading.Event()

    def handle(batch: list[Message]) -> None:
        time.sleep(0.4)
        handled.set()

    with ConsumerThread({"group.id": "g"}, handle, subscribe=["t"], unsettled_limit_s=0.2):
        assert handled.wait(5)
        time.sleep(0.3)
        assert len(WedgedMember.made) == 1


class Placed(Record):
    def __init__(self, topic: str, partition: int, offset: int) -> None:
        super().__init__(offset)
        self._where = (topic, partition)

    def topic(self) -> str:
        return self._where[0]

    def partition(self) -> int:
        return self._where[1]


class RevokedMidTake(Revoking):
    """Assigns ``t`` 0 and 1 at the first poll, which returns a record of ``t`` 0; the ``consume`` that
    follows in the same batch serves the revoke of ``t`` 0 (a rebalance) and returns a record of ``t`` 1."""

    revoked = False

    def poll(self, timeout: float) -> Message | None:
        self.polls += 1
        if self.polls == 1:
            self.callbacks["on_assign"](self, [TopicPartition("t", 0), TopicPartition("t", 1)])
            return Placed("t", 0, 4)  # type: ignore[return-value]
        time.sleep(min(timeout, 0.01))
        return None

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        if self.polls > 1 or self.revoked:
            return []
        self.revoked = True
        self.callbacks["on_revoke"](self, [TopicPartition("t", 0)])
        return [Placed("t", 1, 9)]  # type: ignore[list-item]


def test_a_record_taken_before_a_revoke_in_the_same_batch_is_left_for_the_next_owner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka cannot take back what an earlier poll of the batch returned: handed on, a record of the
    revoked partition was worked on here while its next owner read it too."""
    Revoking.made.clear()
    monkeypatch.setattr(bus.consumer, "Consumer", RevokedMidTake)
    handled: queue.SimpleQueue[list[tuple[str, int, int]]] = queue.SimpleQueue()

    def handle(batch: list[Message]) -> None:
        handled.put([(m.topic() or "", m.partition() or 0, m.offset() or 0) for m in batch])

    with ConsumerThread({"group.id": "g"}, handle, subscribe=["t"], linger_s=0.05, stats_interval_ms=0):
        assert handled.get(timeout=5) == [("t", 1, 9)]
