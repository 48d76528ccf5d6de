from __future__ import annotations

import random

import pytest

from gpu_workers.offsets import OffsetTracker, TopicPartition

A: TopicPartition = ("sluice.requests.demo", 0)
B: TopicPartition = ("sluice.requests.demo", 1)


@pytest.mark.parametrize(
    ("started", "done", "expected"),
    [
        ([], [], None),
        ([5], [], 5),  # nothing durable yet: commit (or keep) the first offset not done
        ([5], [5], 6),
        ([5, 6, 7], [7, 6], 5),  # out of order: never past the unfinished 5
        ([5, 6, 7], [7, 5], 6),
        ([5, 6, 7], [5, 6, 7], 8),
        ([3, 9, 12], [3, 9], 12),  # gaps (compaction, transaction markers) do not hold the commit back
        ([3, 9, 12], [3, 9, 12], 13),
    ],
)
def test_commit_point(started: list[int], done: list[int], expected: int | None) -> None:
    t = OffsetTracker()
    for offset in started:
        t.started(A, offset)
    for offset in done:
        assert t.done(A, offset)
    assert t.committable().get(A) == expected


def test_reports_a_partition_only_when_it_advanced_past_the_last_commit() -> None:
    t = OffsetTracker()
    t.started(A, 0)
    t.started(B, 10)
    assert t.committable() == {A: 0, B: 10}
    t.mark_committed({A: 0, B: 10})
    assert t.committable() == {}
    t.done(A, 0)
    assert t.committable() == {A: 1}
    assert t.committable() == {A: 1}  # still owed until marked: a failed commit is retried
    t.mark_committed({A: 1})
    assert t.committable() == {}


def test_mark_committed_never_goes_back_and_ignores_unknown_partitions() -> None:
    t = OffsetTracker()
    t.started(A, 0)
    t.done(A, 0)
    t.mark_committed({A: 1, B: 7})
    t.mark_committed({A: 0})
    assert t.committable() == {}
    assert t.partitions == [A]


def test_done_is_false_for_what_is_not_in_flight() -> None:
    t = OffsetTracker()
    t.started(A, 4)
    assert not t.done(A, 3)
    assert not t.done(B, 4)
    assert t.done(A, 4)
    assert not t.done(A, 4)


def test_started_twice_counts_once() -> None:
    t = OffsetTracker()
    t.started(A, 4)
    t.started(A, 4)
    assert t.in_flight(A) == 1
    t.done(A, 4)
    assert t.committable() == {A: 5}


def test_revoke_forgets_partitions_and_late_done_calls() -> None:
    t = OffsetTracker()
    t.started(A, 1)
    t.started(B, 2)
    t.revoke([A])
    assert not t.done(A, 1)
    assert t.committable() == {B: 2}
    assert (t.in_flight(), t.in_flight(A), t.in_flight(B)) == (1, 0, 1)
    t.started(A, 50)  # assigned again: starts fresh from where the group resumes
    assert t.committable() == {A: 50, B: 2}


def test_negative_offsets_are_refused() -> None:
    with pytest.raises(ValueError, match="offset"):
        OffsetTracker().started(A, -1)


@pytest.mark.parametrize("seed", range(40))
def test_random_completion_order_never_commits_past_an_undone_offset(seed: int) -> None:
    rng = random.Random(seed)
    t = OffsetTracker()
    tps = [("t", p) for p in range(3)]
    next_offset = dict.fromkeys(tps, 0)
    started: dict[TopicPartition, set[int]] = {tp: set() for tp in tps}
    finished: dict[TopicPartition, set[int]] = {tp: set() for tp in tps}
    committed: dict[TopicPartition, int] = {}
    for _ in range(1500):
        op = rng.random()
        tp = rng.choice(tps)
        if op < 0.45:
            next_offset[tp] += rng.choice((1, 1, 1, 2, 5))  # gaps happen
            t.started(tp, next_offset[tp])
            started[tp].add(next_offset[tp])
        elif op < 0.85:
            undone = sorted(started[tp] - finished[tp])
            if undone:
                offset = rng.choice(undone)
                assert t.done(tp, offset)
                finished[tp].add(offset)
        elif op < 0.98:
            offsets = t.committable()
            for p, offset in offsets.items():
                assert offset > committed.get(p, -1), "reported without advancing"
                assert all(o in finished[p] for o in started[p] if o < offset), "commit past an undone offset"
                open_offsets = started[p] - finished[p]
                # and as far as allowed: the first undone offset, or one past everything started
                assert offset == (min(open_offsets) if open_offsets else max(started[p]) + 1)
            if rng.random() < 0.8:  # sometimes the commit fails and is owed again
                t.mark_committed(offsets)
                committed.update(offsets)
        else:
            t.revoke([tp])
            started[tp].clear()
            finished[tp].clear()
            committed.pop(tp, None)
        for p in tps:
            assert t.in_flight(p) == len(started[p] - finished[p])


def test_many_out_of_order_completions_behind_one_slow_offset() -> None:
    t = OffsetTracker()
    for offset in range(200):
        t.started(A, offset)
    for offset in reversed(range(1, 200)):
        t.done(A, offset)
    assert t.committable() == {A: 0}
    assert t.in_flight(A) == 1
    t.done(A, 0)
    assert t.committable() == {A: 200}


def test_a_refused_commit_is_offered_again() -> None:
    t = OffsetTracker()
    t.started(A, 4)
    t.done(A, 4)
    assert t.committable() == {A: 5}
    t.mark_committed({A: 5})
    assert t.committable() == {}
    t.uncommit({A: 5})  # the broker refused it
    assert t.committable() == {A: 5}


def test_uncommit_leaves_a_later_commit_alone() -> None:
    t = OffsetTracker()
    for offset in (4, 5):
        t.started(A, offset)
        t.done(A, offset)
    t.mark_committed({A: 5})
    t.mark_committed({A: 6})
    t.uncommit({A: 5})  # an older commit's failure report arrives after a newer one was marked
    assert t.committable() == {}
    t.uncommit({B: 3})  # a partition not tracked: nothing to do
