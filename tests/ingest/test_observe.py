"""What the edge says about one request's time: the ``Server-Timing`` header of a non-streamed answer."""

from __future__ import annotations

from datetime import UTC, datetime

from ingest.observe import RequestWatch
from schemas.events import EmbeddingRequested, RequestFinished, Timings, Usage

WALL = 1_800_000_000.0
"""The wall clock at monotonic 0."""


class Clocks:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return WALL + self.now


def at(monotonic: float, skew_ms: float = 0.0) -> datetime:
    """The UTC time of ``monotonic`` on a host whose clock is ``skew_ms`` ahead of the edge's."""
    return datetime.fromtimestamp(WALL + monotonic + skew_ms / 1000, UTC)


def request() -> EmbeddingRequested:
    return EmbeddingRequested(
        tenant="acme",
        model="all-minilm-l6-v2",
        request_id="r1",
        source="test",
        model_version="v1",
        inputs=[[101, 102]],
    )


def finished(accepted: datetime | None, started: datetime, done: datetime) -> RequestFinished:
    return RequestFinished(
        tenant="acme",
        model="all-minilm-l6-v2",
        request_id="r1",
        source="test",
        status="completed",
        finish_reason="stop",
        usage=Usage(prompt_tokens=2, completion_tokens=0, total_tokens=2),
        timings=Timings(accepted=accepted, started=started, finished=done),
    )


def served(event: EmbeddingRequested | None, result: RequestFinished, clocks: Clocks) -> str | None:
    """The header of ``result`` arriving at 100.012 and answered at 100.013 (the request came in at 100.0)."""
    with RequestWatch(event, stream=False, t0=100.0, clock=clocks.monotonic, wall=clocks.wall) as watch:
        clocks.now = 100.012
        watch.delivered(result)
        clocks.now = 100.013
        return watch.server_timing(result)


def test_each_stage_is_the_time_between_two_hand_offs() -> None:
    result = finished(at(100.001), at(100.004), at(100.010))
    assert served(request(), result, Clocks()) == (
        "edge;dur=1.00, queue;dur=3.00, model;dur=6.00, return;dur=2.00, total;dur=13.00"
    )


def test_a_worker_clock_behind_moves_time_between_the_stages_that_cross_hosts() -> None:
    # the worker's clock 2.5 ms behind the edge's: the queue looks 2.5 ms shorter and the way back 2.5 ms
    # longer; their sum, the edge's stage, the model's and the total stay
    result = finished(at(100.001), at(100.004, -2.5), at(100.010, -2.5))
    assert served(request(), result, Clocks()) == (
        "edge;dur=1.00, queue;dur=0.50, model;dur=6.00, return;dur=4.50, total;dur=13.00"
    )
    # 5 ms behind would make the queue negative: it reads 0
    result = finished(at(100.001), at(100.004, -5), at(100.010, -5))
    assert served(request(), result, Clocks()) == (
        "edge;dur=1.00, queue;dur=0.00, model;dur=6.00, return;dur=7.00, total;dur=13.00"
    )


def test_no_header_for_a_request_this_edge_did_not_submit_or_before_its_end() -> None:
    result = finished(at(100.001), at(100.004), at(100.010))
    assert served(None, result, Clocks()) is None  # a resume or a replay: an earlier run's timings
    clocks = Clocks()
    with RequestWatch(request(), stream=False, t0=100.0, clock=clocks.monotonic, wall=clocks.wall) as watch:
        assert watch.server_timing(result) is None


def test_a_stage_whose_timings_are_missing_is_left_out() -> None:
    result = finished(None, at(100.004), at(100.010))
    assert served(request(), result, Clocks()) == "model;dur=6.00, return;dur=2.00, total;dur=13.00"
