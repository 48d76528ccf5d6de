"""A partition's lag as read from librdkafka's statistics, without a broker."""

from __future__ import annotations

from bus.consumer import _PartitionStats


def test_a_partition_that_never_held_a_record_lags_0_not_unknown() -> None:
    """Nothing committed and nothing handed over: the lag was unknown for good on an empty partition, and
    the streams worker's drift watermark waits for every ``results`` partition whose lag is not 0."""
    assert _PartitionStats(partition=0, ls_offset=0, hi_offset=0).lag(read_committed=True) == 0
    assert _PartitionStats(partition=0, ls_offset=5, hi_offset=5).lag(read_committed=True) is None
    assert _PartitionStats(partition=0, ls_offset=5, app_offset=2).lag(read_committed=True) == 3
    assert _PartitionStats(partition=0, ls_offset=5, consumer_lag=1).lag(read_committed=True) == 1
