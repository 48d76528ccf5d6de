"""Boundaries of gpu_workers/offsets.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from gpu_workers.offsets import OffsetTracker

A = ("t", 0)


def test_heap_rebuild_keeps_the_lowest_undone_offset_first_with_real_kafka_offsets() -> None:
    """Kafka offsets are large: the rebuilt heap must be sorted, not a set's iteration order (offsets.py:63).
    One slow record at the front, hundreds finishing behind it: the commit must stay on the slow one."""
    for base in range(10**9, 10**9 + 2048, 61):  # several placements relative to the set's hash table
        t = OffsetTracker()
        for offset in range(base, base + 300):
            t.started(A, offset)
        for offset in range(base + 1, base + 300):  # all but the first, which is slow
            t.done(A, offset)
            assert t.committable() == {A: base}, f"committed past the undone offset {base}"
        t.done(A, base)
        assert t.committable() == {A: base + 300}


def test_a_commit_never_stops_short_of_the_highest_started_offset() -> None:
    """started() out of order (offsets.py:54, ``highest = max(...)``): all done, the commit is one past the
    highest started offset, not one past the last one started."""
    t = OffsetTracker()
    t.started(A, 10)
    t.started(A, 5)
    t.done(A, 5)
    t.done(A, 10)
    assert t.committable() == {A: 11}
