"""``sluice up``'s start-up waits (for its workers' ``/readyz`` before it says "up", and never past a Ctrl-C),
and what its fleet tells the operator."""

from __future__ import annotations

import asyncio
import io
from datetime import datetime, timedelta

import pytest
from aiohttp import web
from rich.console import Console

from infra.errors import InfraError
from infra.kafka.broker import free_port
from schemas.events import DeploymentChanged, RolloutGates
from schemas.settings import PlatformSettings
from sluice import up
from sluice.autoscale import FleetSettings
from sluice.up import Fleet, _unless_stopped, _wait_workers
from streams.rollout import advance, roll_back, start_rollout


async def test_a_ctrl_c_ends_a_start_up_wait_at_once_and_cancels_it() -> None:
    stop = asyncio.Event()
    cancelled = asyncio.Event()

    async def loading() -> None:
        try:
            await asyncio.sleep(300)  # a model that takes minutes to load
        except asyncio.CancelledError:
            cancelled.set()
            raise

    asyncio.get_running_loop().call_later(0.05, stop.set)
    async with asyncio.timeout(5):
        assert await _unless_stopped(stop, loading()) is False
    assert cancelled.is_set()


async def test_a_start_up_wait_that_ends_first_goes_on_and_its_error_is_raised() -> None:
    stop = asyncio.Event()

    async def ready() -> None:
        await asyncio.sleep(0)

    assert await _unless_stopped(stop, ready()) is True

    async def broken() -> None:
        raise InfraError("the streams worker was not ready")

    with pytest.raises(InfraError, match="not ready"):
        await _unless_stopped(stop, broken())


async def _worker(
    ready_after: int, first_answer_s: float = 0.0, host: str = "127.0.0.1"
) -> tuple[web.AppRunner, int, list[int]]:
    """An ops server on ``host`` whose /readyz answers 503 ``ready_after`` times, then 200 (its first answer
    after ``first_answer_s``), and whose /healthz answers 200; the statuses /readyz gave."""
    given: list[int] = []

    async def readyz(_: web.Request) -> web.Response:
        if not given:
            await asyncio.sleep(first_answer_s)
        status = 200 if len(given) >= ready_after else 503
        given.append(status)
        return web.Response(status=status)

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, host, 0).start()
    return runner, int(runner.addresses[0][1]), given


@pytest.mark.parametrize(("bind", "asked"), [("::1", "::1"), ("::", "::1"), ("0.0.0.0", "127.0.0.1")])
async def test_workers_are_polled_on_their_ops_host_an_ipv6_one_in_brackets(bind: str, asked: str) -> None:
    """A review found ``http://::1:PORT/readyz`` polled (no client reaches it), and the workers always
    polled at 127.0.0.1: with ``SLUICE_WORKER_OPS_HOST=::1`` none was ever seen ready. A wildcard bind is
    polled at the loopback address of its family."""
    assert up.reachable(bind) == asked
    worker, port, given = await _worker(ready_after=1, host=asked)
    try:
        out = io.StringIO()
        await _wait_workers([("demo-gpt@v1", port)], 5, Console(file=out, width=200), bind)
        assert await up._answers(port, bind)  # a warm standby asked whether it runs
        await up._wait_ready(bind, port, 5)  # the streams worker and the edges: the same poll
    finally:
        await worker.cleanup()
    assert given[-1] == 200
    assert out.getvalue() == ""


async def test_a_poll_that_fails_names_the_url_it_polled_in_brackets() -> None:
    with pytest.raises(InfraError) as raised:
        await up._wait_ready("::1", free_port(), 0.3, what="the streams worker")
    assert "at http://[::1]:" in str(raised.value)


async def test_up_waits_for_each_workers_readyz_and_names_one_that_is_not_ready() -> None:
    loading, loading_port, loading_given = await _worker(ready_after=3)
    try:
        out = io.StringIO()
        silent = free_port()  # a worker that never answers
        await _wait_workers(
            [("demo-gpt@v1", loading_port), ("all-minilm-l6-v2@v1", silent), ("free@v1", 0)],
            # the loading worker is ready at its fourth poll, ~0.75 s in (a poll every 0.25 s): with 1.5 s
            # for both, a stall of the loaded box (CI) past the margin named it not ready too
            4.0,
            Console(file=out, width=200),
        )
    finally:
        await loading.cleanup()
    assert loading_given == [503, 503, 503, 200]  # polled until ready, then left alone
    printed = out.getvalue()
    assert "the worker for all-minilm-l6-v2@v1 was not ready" in printed
    assert f"127.0.0.1:{silent}/readyz" in printed
    assert "its requests wait for it" in printed
    assert "demo-gpt" not in printed  # it came up
    assert "free@v1" not in printed  # on a port of its own choosing: nothing to poll


async def test_a_worker_too_busy_to_answer_one_poll_in_time_is_polled_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A worker loading its model on a busy box may not answer a poll within its timeout; that poll's
    # TimeoutError once escaped the wait and took `sluice up` down.
    monkeypatch.setattr(up, "READY_POLL_S", 0.2)
    busy, busy_port, busy_given = await _worker(ready_after=0, first_answer_s=0.5)
    try:
        out = io.StringIO()
        await _wait_workers([("demo-gpt@v1", busy_port)], 5, Console(file=out, width=200))
    finally:
        await busy.cleanup()
    assert busy_given[-1] == 200
    assert len(busy_given) >= 2  # the slow first answer was given up on, and a later poll found it ready
    assert out.getvalue() == ""


def test_the_fleet_prints_each_rollout_change_once_and_nothing_from_before_it_started() -> None:
    """`sluice up` shows the operator a rollout warming up, stepping, promoting or rolling back."""
    screen = io.StringIO()
    fleet = Fleet(PlatformSettings(), FleetSettings(), Console(file=screen, width=300), base_port=0)
    started = fleet._started_at

    def rollout(model: str, at: datetime) -> DeploymentChanged:
        return start_rollout(
            model, stable="v1", candidate="v2", steps=[0.1, 1.0], shadow=0.0, gates=RolloutGates(),
            now=at, source="sluice/cli",
        )  # fmt: skip

    old = rollout("old-model", started - timedelta(minutes=5))
    warming = rollout("demo-gpt", started + timedelta(seconds=1))
    fleet.changes = [old, warming]  # the control topic as one look read it
    fleet.tell_rollouts()
    fleet.tell_rollouts()  # nothing new
    ready = advance(warming, warming.time, "v2 is ready (worker w-1)", [], "controller")
    back = roll_back(ready, ready.time, "aborted by the operator: x", [], "operator")
    fleet.changes = [old, warming, ready, back]  # two decisions between two looks: both are told
    fleet.tell_rollouts()
    assert screen.getvalue().splitlines() == [
        "rollout demo-gpt: warming by the operator: rollout started: 10% of traffic once a worker of v2 is ready",
        "rollout demo-gpt: canary by the controller: step 1/2, 10% of traffic: v2 is ready (worker w-1)",
        "rollout demo-gpt: rolled_back by the operator: aborted by the operator: x",
    ]
