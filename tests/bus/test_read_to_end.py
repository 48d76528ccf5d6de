"""Reading the log to its end against a consumer standing in for the broker (the real one: test_positions)."""

from __future__ import annotations

from confluent_kafka import TIMESTAMP_CREATE_TIME, TopicPartition

from bus.positions import read_to_end


class _Record:
    def __init__(self, partition: int, offset: int, ts: int = 0) -> None:
        self._at = (partition, offset)
        self._ts = ts

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._at[0]

    def offset(self) -> int:
        return self._at[1]

    def timestamp(self) -> tuple[int, int]:
        return TIMESTAMP_CREATE_TIME, self._ts


class _Log:
    """A consumer over two partitions of 3 and 700 records that counts what each ``consume`` asked for."""

    def __init__(self) -> None:
        self.sizes = {0: 3, 1: 700}
        self.asked: list[int] = []
        self._next: dict[int, int] = {}

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        return 0, self.sizes[tp.partition]

    def assign(self, tps: list[TopicPartition]) -> None:
        self._next = {tp.partition: tp.offset for tp in tps}

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, self._next[tp.partition]) for tp in tps]

    def consume(self, num_messages: int, timeout: float) -> list[_Record]:
        self.asked.append(num_messages)
        out: list[_Record] = []
        for part, at in self._next.items():
            while at < self.sizes[part] and len(out) < num_messages:
                out.append(_Record(part, at))
                at += 1
            self._next[part] = at
        return out


def test_a_read_to_the_end_never_asks_for_more_records_than_are_left() -> None:
    """``consume`` waits its whole timeout for a count it cannot fill: asking for 500 when 3 were left
    added 0.5 s to every short read of the log (each CLI look at the control topic, each re-anchor)."""
    log = _Log()
    read = list(read_to_end(log, [TopicPartition("t", 0, 1), TopicPartition("t", 1, 0)], {0: 3, 1: 700}))  # type: ignore[arg-type]
    assert len(read) == 2 + 700
    assert log.asked == [500, 202]
