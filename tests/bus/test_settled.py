"""``settled`` waits out a cluster that is still settling (a new partition's leader, a group's coordinator
on a broker that just started) and fails at once on anything else."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from confluent_kafka import KafkaError, KafkaException

from bus.errors import BusError
from bus.positions import settled


def flaky(code: int, failures: int) -> tuple[list[int], Callable[[], str]]:
    calls: list[int] = []

    def call() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise KafkaException(KafkaError(code))
        return "done"

    return calls, call


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.NOT_COORDINATOR,
        KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError._DESTROY_BROKER,  # the broker died under the request (seen: a worker starting as one did)
    ],
)
def test_a_settling_cluster_is_waited_for(code: int) -> None:
    calls, call = flaky(code, 2)
    assert settled(call, "offsets", timeout=5) == "done"
    assert len(calls) == 3


def test_any_other_error_fails_at_once() -> None:
    calls, call = flaky(KafkaError.TOPIC_AUTHORIZATION_FAILED, 5)
    with pytest.raises(BusError, match="cannot read offsets"):
        settled(call, "offsets", timeout=5)
    assert len(calls) == 1


def test_a_cluster_that_never_settles_fails_after_the_timeout() -> None:
    _, call = flaky(KafkaError.NOT_COORDINATOR, 10_000)
    with pytest.raises(BusError):
        settled(call, "offsets", timeout=0.3)
