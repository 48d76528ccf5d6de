"""The record ledger alone, as a plain object: what may be committed across takes, effects and revokes."""

from __future__ import annotations

import threading
import time

from gpu_workers.ledger import RecordLedger

A = ("requests.m", 0)
B = ("requests.m", 1)


class Waiting:
    """A revoke's ``give_up``: never, and it tells when the revoke has looked and kept waiting (it is asked
    only then), so a test need not guess how long a thread takes to get there."""

    def __init__(self) -> None:
        self.looked = threading.Event()

    def __call__(self) -> bool:
        self.looked.set()
        return False

    def wait(self) -> None:
        assert self.looked.wait(10), "the revoke never looked"
        self.looked.clear()


def _take(ledger: RecordLedger, tp: tuple[str, int], offset: int) -> None:
    """The model thread takes a record of the current generation and runs it."""
    generation = ledger.generation
    with ledger.taking(tp, generation, offset) as stale:
        assert not stale
        ledger.run(tp, generation)


def test_a_record_holds_its_partition_back_until_its_effect_is_durable() -> None:
    ledger = RecordLedger()
    _take(ledger, A, 0)
    _take(ledger, A, 1)
    ledger.done(A, 0, 1)  # the later one ends first
    assert ledger.due(0.0, 0.0) == {A: 0}
    ledger.done(A, 0, 0)
    assert ledger.due(1.0, 0.0) == {A: 2}
    assert ledger.running() == {}


def test_commits_go_out_at_most_once_an_interval_and_a_refused_one_is_offered_again() -> None:
    ledger = RecordLedger()
    _take(ledger, A, 0)
    ledger.done(A, 0, 0)
    assert ledger.due(10.0, 1.0) == {A: 1}
    _take(ledger, A, 1)
    ledger.done(A, 0, 1)
    assert ledger.due(10.5, 1.0) == {}, "inside the interval"
    assert ledger.due(11.0, 1.0) == {A: 2}
    ledger.uncommit({A: 2})
    ledger.commit_now()
    assert ledger.due(11.1, 1.0) == {A: 2}, "the refused commit again"
    assert ledger.due(20.0, 1.0) == {}, "nothing new"


def test_a_record_consumed_before_its_partition_was_revoked_is_stale_and_records_nothing() -> None:
    ledger = RecordLedger()
    consumed = ledger.generation
    revoked = ledger.revoke([A])
    assert revoked == consumed + 1 == ledger.generation
    with ledger.taking(A, consumed, 5) as stale:
        assert stale
    assert not ledger.take_skip(A, consumed, 6, letter=False)
    ledger.release(A, consumed, 5)
    assert ledger.due(0.0, 0.0) == {}
    assert ledger.partitions == []
    assert not ledger.stale(B, consumed), "other partitions are untouched"
    with ledger.taking(A, ledger.generation, 7) as stale:  # handed back: a new assignment's records
        assert not stale


def test_a_skipped_record_is_done_at_once_a_dead_lettered_one_when_its_letter_lands() -> None:
    ledger = RecordLedger()
    assert ledger.take_skip(A, 0, 0, letter=False)
    assert ledger.take_skip(A, 0, 1, letter=True)
    assert ledger.due(0.0, 0.0) == {A: 1}, "held at the letter"
    assert ledger.running() == {(A, 0): 1}
    ledger.done(A, 0, 1)
    assert ledger.due(1.0, 0.0) == {A: 2}
    assert ledger.running() == {}


def test_settling_an_old_generation_never_settles_a_later_assignment() -> None:
    ledger = RecordLedger()
    _take(ledger, A, 0)  # generation 0: outlives its partition's loss
    ledger.hand_over([A], ledger.revoke([A]), give_up=lambda: True, within_s=0)
    _take(ledger, A, 0)  # handed back and redelivered: generation 1
    ledger.settle(A, 0)
    ledger.settle(A, 0)
    assert ledger.running() == {(A, 1): 1}
    assert ledger.settle_if_stale(A, 0)
    assert not ledger.settle_if_stale(A, 1)
    assert ledger.running() == {(A, 1): 1}


def test_a_revoke_hands_over_once_what_runs_there_settles_and_commits_every_point() -> None:
    ledger = RecordLedger()
    _take(ledger, A, 0)
    _take(ledger, A, 1)
    _take(ledger, B, 0)
    ledger.done(A, 0, 0)
    assert ledger.due(0.0, 0.0) == {A: 1, B: 0}  # marked committed: a revoke still returns its point
    handed: list[tuple[int, dict[tuple[str, int], int]]] = []
    revoked = ledger.revoke([A])
    ledger.released(revoked)
    waiting = Waiting()
    waiter = threading.Thread(
        target=lambda: handed.append(ledger.hand_over([A], revoked, give_up=waiting, within_s=30))
    )
    waiter.start()
    waiting.wait()
    assert handed == [], "A@1 still runs: the revoke waits for it"
    ledger.done(A, 0, 1)
    waiter.join(10)
    assert handed == [(0, {A: 2})]
    assert A not in ledger.partitions
    assert B in ledger.partitions
    ledger.done(A, 0, 1)  # a late effect of a partition gone changes nothing
    assert ledger.running() == {(B, 0): 1}


def test_a_revoke_waits_for_a_record_between_its_stale_check_and_being_counted() -> None:
    ledger = RecordLedger()
    handed: list[tuple[int, dict[tuple[str, int], int]]] = []
    generation = ledger.generation
    waiting = Waiting()
    with ledger.taking(A, generation, 0) as stale:
        assert not stale
        revoked = ledger.revoke([A])
        waiter = threading.Thread(
            target=lambda: handed.append(ledger.hand_over([A], revoked, give_up=waiting, within_s=30))
        )
        waiter.start()
        waiting.wait()
        assert handed == [], "the record is not counted yet: the revoke must not take the point"
        ledger.run(A, generation)
    waiting.looked.clear()
    waiting.wait()  # it looked again after the block
    assert handed == [], "counted running now"
    ledger.done(A, generation, 0)
    waiter.join(10)
    assert handed == [(0, {A: 1})]


def test_a_revoke_whose_release_is_done_does_not_wait_for_a_later_take() -> None:
    ledger = RecordLedger()
    revoked = ledger.revoke([A])
    ledger.released(revoked)
    waiting = Waiting()
    with ledger.taking(B, ledger.generation, 0):  # the model thread takes another partition's record
        assert ledger.hand_over([A], revoked, give_up=waiting, within_s=30) == (0, {})
    assert not waiting.looked.is_set(), "the revoke waited for the take"


def test_a_revoke_gives_up_when_told_and_says_how_many_still_ran() -> None:
    ledger = RecordLedger()
    _take(ledger, A, 0)
    _take(ledger, A, 1)
    revoked = ledger.revoke([A])
    ledger.released(revoked)
    assert ledger.hand_over([A], revoked, give_up=lambda: True, within_s=30) == (2, {A: 0})
    assert ledger.running() == {}, "the partition's records are no longer waited for"
    started = time.monotonic()
    _take(ledger, B, 0)
    revoked = ledger.revoke([B])
    ledger.released(revoked)
    assert ledger.hand_over([B], revoked, give_up=lambda: False, within_s=0.05) == (1, {B: 0})
    assert time.monotonic() - started < 30
