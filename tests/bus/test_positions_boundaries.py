"""Boundaries of bus/positions.py its other tests let pass: found by mutation testing, each test here fails
with a one-line change to it that the module's other tests did not notice."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import TopicPartition

import bus.positions as positions
from bus.positions import offset_at, read_to_end
from tests.bus.test_read_to_end import _Record


class _Log:
    """A fake consumer: per partition (low, high watermark, records held = offsets low..last)."""

    def __init__(
        self, parts: dict[int, tuple[int, int, int]], committed: dict[int, int] | None = None
    ) -> None:
        self.parts = (
            parts  # partition -> (low, high, last record offset + 1): high > that: a marker at the end
        )
        self.committed_offsets = committed or {}
        self.consumed = 0
        self.found = -1
        """The offset ``offsets_for_times`` answers (-1: nothing at or after the time)."""
        self.assigned: list[TopicPartition] = []
        self._pos: dict[int, int] = {}

    # --- consumer API
    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        low, high, _ = self.parts[tp.partition]
        return low, high

    def offsets_for_times(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self.found) for tp in tps]

    def assign(self, tps: list[TopicPartition]) -> None:
        self.assigned = list(tps)
        self._pos = {tp.partition: tp.offset for tp in tps}

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self._pos[tp.partition]) for tp in tps]

    def consume(self, num_messages: int = 1, timeout: float = 0.0) -> list[_Record]:
        self.consumed += 1
        out: list[_Record] = []
        for part, at in list(self._pos.items()):
            low, high, last = self.parts[part]
            at = max(at, low)
            while at < last and len(out) < num_messages:
                out.append(_Record(part, at, ts=1_000 + at))
                at += 1
            if at >= last:
                at = high  # past a transaction marker at the end
            self._pos[part] = at
        if not out:
            time.sleep(min(timeout, 0.01))
        return out

    def list_topics(self, topic: str, timeout: float) -> Any:
        meta = SimpleNamespace(error=None, partitions={p: None for p in self.parts})
        return SimpleNamespace(topics={topic: meta})

    def committed(self, tps: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [
            TopicPartition(tp.topic, tp.partition, self.committed_offsets.get(tp.partition, -1001))
            for tp in tps
        ]

    def close(self) -> None:
        pass


def test_offset_at_a_partitions_first_record_is_that_record() -> None:
    """positions.py:68 (``found.offset < 0``): the first record at/after a time can be offset 0."""
    log = _Log({0: (0, 5, 5)})
    log.found = 0
    assert offset_at(log, "t", 0, 1_000) == 0  # type: ignore[arg-type]
    log.found = -1  # nothing at or after that time: the end
    assert offset_at(log, "t", 0, 1_000) == 5  # type: ignore[arg-type]


def test_topic_extent_of_an_existing_topic(monkeypatch: pytest.MonkeyPatch) -> None:
    """positions.py:114 (``meta.error is not None``): a healthy topic has an extent, not None."""
    log = _Log({0: (2, 7, 7), 1: (0, 3, 3)})
    monkeypatch.setattr(positions, "Consumer", lambda config: log)
    monkeypatch.setattr(positions, "probe_config", lambda *a, **k: {})
    extent = positions.topic_extent(SimpleNamespace(), "t", "c")  # type: ignore[arg-type]
    assert extent is not None
    starts, ends = extent
    assert [(tp.partition, tp.offset) for tp in starts] == [(0, 2), (1, 0)]
    assert ends == {0: 7, 1: 3}


def test_a_partition_already_at_its_end_is_not_read() -> None:
    """positions.py:147 (``tp.offset < ends``): nothing to read, no consume (each one waits up to 0.5 s)."""
    log = _Log({0: (0, 3, 3)})
    assert list(read_to_end(log, [TopicPartition("t", 0, 3)], {0: 3})) == []  # type: ignore[arg-type]
    assert log.consumed == 0
    assert log.assigned == []


def test_a_partition_retention_emptied_is_not_read() -> None:
    """positions.py:153 (``firsts[part] < ends[part]``): low watermark at the end: nothing to wait for."""
    log = _Log({0: (3, 3, 3)})
    assert list(read_to_end(log, [TopicPartition("t", 0, 0)], {0: 3})) == []  # type: ignore[arg-type]
    assert log.consumed == 0
    assert log.assigned == []


def test_a_partition_ending_in_a_transaction_marker_ends_the_read() -> None:
    """positions.py:185 (``todo -= past_ends``): records 0..2, a commit marker at 3, end 4: read 3 and stop,
    not wait until the timeout for a record at offset 3 that never comes."""
    log = _Log({0: (0, 4, 3)})
    got = list(read_to_end(log, [TopicPartition("t", 0, 0)], {0: 4}, timeout_s=2))  # type: ignore[arg-type]
    assert [m.offset() for m in got] == [0, 1, 2]


def test_a_group_committed_to_its_end_holds_nothing_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """positions.py:222 (``start >= high``): every partition committed to its end: the time of now, not
    None (``cannot say``), after a 10 s wait per partition for a record that is not there."""
    log = _Log({0: (0, 5, 5)}, committed={0: 5})
    monkeypatch.setattr(positions, "Consumer", lambda config: log)
    monkeypatch.setattr(positions, "consumer_config", lambda *a, **k: {})
    before = int(time.time() * 1000)
    t0 = time.monotonic()
    at = positions.uncommitted_since(SimpleNamespace(), "g", "t", "c", timeout_s=2)  # type: ignore[arg-type]
    assert at is not None
    assert at >= before
    assert time.monotonic() - t0 < 2


def test_the_oldest_uncommitted_record_is_the_oldest_across_partitions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """positions.py:227 (``min(oldest, at)``): the oldest record the group could be handed, not the newest."""
    log = _Log({0: (0, 5, 5), 1: (0, 50, 50)}, committed={0: 2, 1: 40})
    monkeypatch.setattr(positions, "Consumer", lambda config: log)
    monkeypatch.setattr(positions, "consumer_config", lambda *a, **k: {})
    assert positions.uncommitted_since(SimpleNamespace(), "g", "t", "c") == 1_002  # type: ignore[arg-type]


# Needs no broker: it lived among the integration tests and never ran without one (mutation testing).
@pytest.mark.parametrize(
    ("own", "peers", "moved"),
    [
        ({}, [], {}),  # no peers: the group starts at the topic's first record, as a new group does
        ({}, [{0: 5, 1: 2}], {0: 5, 1: 2}),
        ({0: 5, 1: 1}, [{0: 5, 1: 2}], {1: 2}),  # level stays; behind moves up
        ({0: 7, 1: 1}, [{0: 5, 1: 2}], {}),  # ahead anywhere: its own positions, never a mix of the two
        ({0: 0, 1: 1}, [{0: 1, 1: 0}], {}),  # (each keeps a request's record open on another partition)
        ({0: 3}, [{0: 5, 1: 2}], {0: 5, 1: 2}),
        ({0: 3, 1: 1}, [{0: 5}], {}),  # a partition it committed and the peers did not: ahead of them
        ({}, [{0: 5, 1: 2}, {0: 3, 1: -1001}], {0: 3}),  # the lowest of them; a peer without one: none
        ({}, [{0: 5}, {1: 4}], {}),
    ],
)
def test_where_a_group_moves_up_to_behind_its_peers(
    own: dict[int, int], peers: list[dict[int, int]], moved: dict[int, int]
) -> None:
    from bus.positions import behind_peers

    assert behind_peers(own, peers) == moved
