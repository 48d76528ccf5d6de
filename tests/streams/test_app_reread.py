"""The reads of the control and audit topics a sink's batch needs, after a rebalance gave it partitions,
are tried again while the broker cannot answer them.

Found by a review on a real broker: a broker stopped one second after a request's terminal event reached a
freshly started sink (its first batch; it had just been given ``control``), and ``sluice streams`` exited 1
with ``cannot read the offsets of full.control[0]: ... Unknown partition``. The same read from a timer is
logged and tried again at the next interval; from the sink it raised out of the batch and killed the
consumer thread, so every usage record and audit entry waited for a restart, which failed again at start
while the broker was away. Any outage longer than the group session hands the sink's partitions back as
the broker returns, so the read meets the broker just as it comes back."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

import streams.app
from bus.consumer import ConsumerThread
from bus.errors import BusError
from streams.app import StreamsApp
from tests.streams.test_app import Producer, Sink, make_app

BLIP = BusError(
    "cannot read the offsets of p.control[0]: KafkaError{code=_UNKNOWN_PARTITION,val=-190,"
    'str="Failed to get watermark offsets: Local: Unknown partition"}'
)


def sink_of(app: StreamsApp) -> Sink:
    sink = Sink()
    app._sink = cast(ConsumerThread, sink)
    sink.owned = {("p.control", 0), ("p.results", 0)}
    return sink


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams.app, "REREAD_RETRY_S", (0.01, 0.02))


async def test_a_failed_control_read_in_the_sink_is_tried_again_not_the_workers_death(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[str] = []

    def read_placed(*args: object) -> list[object]:
        reads.append("control")
        if len(reads) <= 2:
            raise BLIP
        return []  # the topic as it is: nothing this worker missed

    monkeypatch.setattr(streams.app, "read_placed", read_placed)
    app = make_app(tmp_path, producer=Producer())
    sink_of(app)
    stored: list[bool] = []
    await app._pipelined([], lambda: stored.append(True), reseed=True)
    await app._inserted()
    assert len(reads) == 3  # two failures, then the read that let the batch go on
    assert stored == [True]
    assert app._owns_control()


async def test_a_failed_read_of_the_audit_heads_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = make_app(tmp_path, producer=Producer())
    sink_of(app)
    tries: list[int] = []

    async def reanchor() -> None:
        tries.append(1)
        if len(tries) <= 2:
            raise BLIP

    monkeypatch.setattr(app, "reanchor", reanchor)
    stored: list[bool] = []
    await app._pipelined([], lambda: stored.append(True), reanchor=True)
    await app._inserted()
    assert (len(tries), stored) == (3, [True])


async def test_a_stop_ends_the_wait_for_a_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    app = make_app(tmp_path, producer=Producer())
    sink_of(app)

    def read_placed(*args: object) -> list[object]:
        app._sink = None  # the app stops while the broker is still away
        raise BLIP

    monkeypatch.setattr(streams.app, "read_placed", read_placed)
    with pytest.raises(BusError):
        await app._pipelined([], lambda: None, reseed=True)
