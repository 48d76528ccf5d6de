"""``sluice up``'s supervisor of child processes: restarts with back-off, and stops without waiting it out."""

from __future__ import annotations

import asyncio
import io
import signal
import sys
import threading
import types
from pathlib import Path

import pytest
from confluent_kafka import KafkaError, KafkaException
from rich.console import Console

import sluice.up as up
from schemas.settings import PlatformSettings
from schemas.topics import worker_group
from sluice.autoscale import FleetSettings
from sluice.services import set_on_signals
from sluice.up import ServiceProcess
from tests.processes import dies_with_killed_parent


async def test_stop_during_a_restart_back_off_returns_at_once() -> None:
    """Before, a stop waited out the back-off (up to 30 s) before ``sluice up`` could exit."""
    child = ServiceProcess(
        "quick", ["settings"], Console(quiet=True), {}, backoff_s=30.0
    )  # `sluice settings` exits at once: the supervisor restarts it after 30 s
    await child.start()
    for _ in range(600):
        if child.exits:
            break
        await asyncio.sleep(0.05)
    assert child.exits == 1, "the child exited and the supervisor is in its back-off"
    await asyncio.wait_for(child.stop(), timeout=5)
    assert child.exits == 1


async def test_a_child_that_exits_once_the_platform_halts_is_not_restarted() -> None:
    """A Ctrl-C reaches every process of the group: children exit on their own while ``sluice up`` starts
    stopping. Before, the supervisor restarted them (a streams worker restarted mid-shutdown failed)."""
    halt = asyncio.Event()
    child = ServiceProcess("quick", ["settings"], Console(quiet=True), {}, backoff_s=0.2, halt=halt)
    halt.set()
    await child.start()
    await asyncio.wait_for(child._task, timeout=60)  # type: ignore[arg-type]  # the supervisor ends by itself
    assert child.exits == 0
    again = ServiceProcess(
        "quick", ["settings"], Console(quiet=True), {}, backoff_s=2.0, halt=asyncio.Event()
    )
    await again.start()
    for _ in range(600):  # no halt: it restarts
        if again.exits >= 1:
            break
        await asyncio.sleep(0.05)
    assert again.exits >= 1
    await again.stop()


def test_a_child_dies_with_sluice_up_even_after_a_kill_9() -> None:
    """Before, ``sluice up`` killed by a signal it cannot handle left its workers and streams process
    running (holding ports, the warehouse lock and partitions); a test's timeout left four of them."""
    script = (
        "import os, subprocess, sys, time\n"
        "from infra.children import die_with\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], preexec_fn=die_with(os.getpid()))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    assert dies_with_killed_parent(script), "the child outlived its killed parent"


def test_a_second_signal_inside_the_handler_does_not_hang_the_worker() -> None:
    """A worker's SIGTERM handler set an Event; a second signal (a Ctrl-C to the group, then the
    supervisor's SIGTERM) landing while the first handler held the Event's lock made the handler wait for
    itself: the worker hung for ever, outliving ``sluice up``. Here the second signal lands exactly there."""
    stop = threading.Event()
    previous = signal.getsignal(signal.SIGUSR2)
    set_on_signals(stop, signal.SIGUSR2)
    handler = signal.getsignal(signal.SIGUSR2)
    assert callable(handler)
    notify_all = stop._cond.notify_all  # type: ignore[attr-defined]

    def notify_with_a_second_signal() -> None:
        handler(signal.SIGUSR2, None)  # the nested signal, while set() holds the lock
        notify_all()

    stop._cond.notify_all = notify_with_a_second_signal  # type: ignore[attr-defined]
    try:
        first = threading.Thread(target=handler, args=(signal.SIGUSR2, None), daemon=True)
        first.start()
        first.join(timeout=5)
        assert not first.is_alive(), "the handler waits for itself"
        assert stop.is_set()
    finally:
        signal.signal(signal.SIGUSR2, previous)


_STANDBY_CHILD = r"""
import os, signal, sys, time
log = open(sys.argv[1], "a")
log.write(f"start standby={os.environ.get('SLUICE_WORKER_STANDBY')}\n"); log.flush()
joined = []
signal.signal(signal.SIGUSR1, lambda *_: joined.append(1))
deadline = time.time() + 20
while time.time() < deadline and not joined:
    time.sleep(0.05)
sys.exit(1)  # joined, then crashed
"""


async def test_a_warm_standby_that_joined_restarts_as_a_serving_worker(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Before, the restarted process was a standby again (SLUICE_WORKER_STANDBY stayed in its
    environment), waiting for a SIGUSR1 that never came while the fleet counted it as serving."""
    log = tmp_path / "starts.txt"
    log.write_text("")
    spawn = asyncio.create_subprocess_exec

    async def child(*_args: object, env: dict[str, str] | None = None, **kw: object) -> object:
        return await spawn(sys.executable, "-c", _STANDBY_CHILD, str(log), env=env)

    asked: list[str] = []

    async def answers(port: int, host: str) -> bool:
        asked.append(host)
        return True

    monkeypatch.setattr(asyncio, "create_subprocess_exec", child)
    monkeypatch.setattr(up, "_answers", answers)
    fleet = up.Fleet(
        PlatformSettings(), FleetSettings(fleet_autoscale=True, fleet_warm_workers=1), Console(quiet=True), 0,
        asyncio.Event(), ops_host="::1",
    )  # fmt: skip
    key = ("demo-gpt", "v1")
    fleet.standby[key] = [await fleet._spawn(key, standby=True)]
    for _ in range(200):
        if "start" in log.read_text():
            break
        await asyncio.sleep(0.05)
    worker = await fleet._add(key)  # a scale-out: the standby joins
    fleet.workers[key] = [worker]
    for _ in range(200):
        if log.read_text().count("start") >= 2:
            break
        await asyncio.sleep(0.05)
    await worker.process.stop()
    assert log.read_text().splitlines()[:2] == ["start standby=true", "start standby=None"]
    assert asked == ["::1"]  # on its SLUICE_WORKER_OPS_HOST, not 127.0.0.1 (a review)


_EXITS_AFTER = r"""
import pathlib, sys, time
runs = pathlib.Path(sys.argv[1])
n = len(runs.read_text().splitlines()) if runs.exists() else 0
with runs.open("a") as f:
    f.write("run\n")
time.sleep(0.6 if n == 2 else 0.0)  # the third run is a healthy one, then it crashes too
sys.exit(1)
"""


async def test_a_child_that_ran_healthily_restarts_after_the_first_back_off_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Found by an audit: the back-off only grew, so a worker that crashed twice at start waited up to 30 s
    to come back from a crash days later."""
    runs = tmp_path / "runs.txt"
    spawn = asyncio.create_subprocess_exec

    async def child(*_args: object, env: dict[str, str] | None = None, **kw: object) -> object:
        return await spawn(sys.executable, "-c", _EXITS_AFTER, str(runs), env=env)

    monkeypatch.setattr(asyncio, "create_subprocess_exec", child)
    supervised = ServiceProcess("flaky", [], Console(quiet=True), {}, backoff_s=0.05, healthy_s=0.5)
    await supervised.start()
    for _ in range(400):
        if supervised.exits >= 4:
            break
        await asyncio.sleep(0.05)
    await supervised.stop()
    assert supervised.backoffs[:4] == [0.05, 0.1, 0.05, 0.1]  # reset after the healthy third run


async def test_no_warm_standby_is_kept_past_the_most_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by an audit: at --max-workers a new standby was started anyway; it could never join, and held
    a model's memory (and the worker core while it loaded) for nothing."""
    fleet = up.Fleet(
        PlatformSettings(),
        FleetSettings(fleet_autoscale=True, fleet_max_workers=2, fleet_warm_workers=1),
        Console(quiet=True),
        0,
        asyncio.Event(),
    )
    started: list[bool] = []
    retired: list[str] = []

    async def spawn(key: tuple[str, str], *, standby: bool) -> object:
        started.append(standby)
        return types.SimpleNamespace(port=0, model=key[0], version=key[1], serial=len(started))

    async def never_answers(port: int, host: str) -> bool:
        return False

    monkeypatch.setattr(fleet, "_spawn", spawn)
    monkeypatch.setattr(fleet, "_retire", lambda key, worker, why: retired.append(why))
    monkeypatch.setattr(up, "_answers", never_answers)
    key, stable = ("demo-gpt", "v1"), {"demo-gpt": "v1"}
    await fleet.reconcile({key: 1}, stable)
    assert (len(fleet.workers[key]), len(fleet.standby[key])) == (1, 1)  # room for one more: one warm
    await fleet.reconcile({key: 2}, stable)
    assert (len(fleet.workers[key]), len(fleet.standby[key])) == (2, 0)
    assert retired == ["a standby past --max-workers"]
    await fleet.reconcile({key: 1}, stable)  # scaled in: room again, a standby again
    assert len(fleet.standby[key]) == 1


async def test_a_stop_while_its_child_is_being_spawned_ends_that_child(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review: a stop that came while the supervisor awaited the spawn (a worker crashed and was
    being restarted when a scale-in retired it) signalled the dead child, or none, and waited for good
    while the new one served on, counted nowhere."""
    spawning, spawned = asyncio.Event(), asyncio.Event()
    real = asyncio.create_subprocess_exec

    async def slow_exec(*args: object, **kwargs: object) -> asyncio.subprocess.Process:
        spawning.set()
        await spawned.wait()  # the stop comes now
        return await real("sleep", "300", **kwargs)  # type: ignore[arg-type]  # runs until signalled

    monkeypatch.setattr(asyncio, "create_subprocess_exec", slow_exec)
    child = ServiceProcess("worker #1", ["worker"], Console(quiet=True), {}, stop_grace_s=5.0)
    await child.start()
    await spawning.wait()
    stopping = asyncio.create_task(child.stop())
    await asyncio.sleep(0.05)
    spawned.set()
    await asyncio.wait_for(stopping, timeout=10)
    assert child._proc is not None
    assert child._proc.returncode == -signal.SIGTERM


async def test_a_worker_is_given_its_drain_before_it_is_killed() -> None:
    """Found by a review: ``sluice up`` killed a stopping worker after a fixed 30 s, so one given a longer
    ``SLUICE_WORKER_DRAIN_S`` lost its flush and its commits at every scale-in."""
    assert up.STOP_GRACE_S == 30.0
    fleet = up.Fleet(PlatformSettings(), FleetSettings(), Console(quiet=True), 0, worker_drain_s=60.0)
    assert fleet._stop_grace_s == 75.0
    assert up.Fleet(PlatformSettings(), FleetSettings(), Console(quiet=True), 0)._stop_grace_s == 30.0
    child = ServiceProcess("stubborn", ["worker"], Console(quiet=True), {}, stop_grace_s=0.5)
    child._proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)",
    )
    await asyncio.sleep(0.5)  # its handler is set
    await asyncio.wait_for(child.stop(), timeout=10)  # killed after its grace, not 30 s
    assert child._proc.returncode == -signal.SIGKILL


async def test_a_port_is_not_given_again_while_a_retiring_worker_still_holds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review: a retiring worker left the fleet's list at once but held its ops port while it
    drained; after a promotion the new version's next worker was given the model's fixed port, and
    crash-looped until the old one left."""
    draining = asyncio.Event()

    class Draining:
        def __init__(self, name: str, args: list[str], console: Console, env: dict[str, str], **_: object):
            self.name, self.env = name, env

        async def start(self) -> None:
            pass

        async def stop(self) -> None:
            await draining.wait()

    monkeypatch.setattr(up, "ServiceProcess", Draining)
    fleet = up.Fleet(PlatformSettings(), FleetSettings(), Console(quiet=True), 9400, asyncio.Event())
    old = await fleet._spawn(("demo-gpt", "v1"), standby=False)
    assert old.port == 9400
    fleet._retire(("demo-gpt", "v1"), old, "promoted")
    new = await fleet._spawn(("demo-gpt", "v2"), standby=False)
    assert new.port == 0  # picks a free one
    draining.set()
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the retirement's task ends: the port is free again
    assert (await fleet._spawn(("demo-gpt", "v2"), standby=False)).port == 9400


class _Lag:
    """GroupLag's part the fleet uses: one model's lag read fails, and the groups kept."""

    def __init__(self) -> None:
        self.lagging: dict[str, int] = {}
        self.kept: list[set[str]] = []

    def __call__(self, topic: str, model: str, version: str | None) -> int:
        if model == "a":
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "committed offsets timed out"))
        self.lagging[topic] = 1
        return 500

    def keep(self, groups: set[str]) -> None:
        self.kept.append(groups)


async def test_one_models_lag_read_failing_leaves_the_others_autoscaled() -> None:
    """Found by a review: one model's lag read raising ended the whole round (its caller catches it), so
    no model was scaled, nor any deployment reconciled, while that read kept failing. And the fleet kept a
    lag client for every version ever stable; now only the stable ones'."""
    screen = io.StringIO()
    fleet = up.Fleet(
        PlatformSettings(),
        FleetSettings(fleet_autoscale=True, fleet_max_workers=3),
        Console(file=screen, width=300),
        0,
        asyncio.Event(),
    )
    fleet._lag = _Lag()  # type: ignore[assignment]
    published: list[object] = []

    async def publish(topic: str, event: object) -> None:
        published.append(event)

    await fleet.autoscale({"a": "v1", "b": "v2"}, publish)
    assert [(e.model, e.replicas) for e in published] == [("b", 1)]  # type: ignore[attr-defined]
    assert "no lag for a@v1 this round" in screen.getvalue()
    assert fleet._lag.kept == [{worker_group("a", "v1"), worker_group("b", "v2")}]  # type: ignore[attr-defined]


async def test_a_child_whose_start_is_refused_is_started_again_after_the_back_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by a review: a fork refused once (EAGAIN at a pids limit, ENOMEM, EMFILE) ended the supervisor:
    the child was never started again (the fleet still counted it) and the stop re-raised the error."""
    import errno

    real = asyncio.create_subprocess_exec
    calls: list[int] = []

    async def flaky(*args: object, **kwargs: object) -> asyncio.subprocess.Process:
        calls.append(1)
        if len(calls) == 1:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
        return await real(sys.executable, "-c", "import time; time.sleep(30)", **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(asyncio, "create_subprocess_exec", flaky)
    said = io.StringIO()
    child = ServiceProcess("worker #1", ["worker"], Console(file=said), {}, backoff_s=0.05, stop_grace_s=2)
    await child.start()
    for _ in range(100):
        if len(calls) >= 2:
            break
        await asyncio.sleep(0.05)
    await asyncio.wait_for(child.stop(), 10)  # raised the EAGAIN before
    assert len(calls) == 2
    assert child.exits == 1
    assert "worker #1 could not start (Resource temporarily unavailable); restarting in 0s" in said.getvalue()


def test_an_edge_child_is_given_its_shutdown_grace_before_it_is_killed() -> None:
    """Found by a review: edges 2..N were killed 30 s after SIGTERM whatever SLUICE_EDGE_SHUTDOWN_GRACE_S said;
    edge 1, in process, honoured it."""
    import msgspec

    from ingest.settings import EdgeSettings
    from schemas.settings import load_settings

    edge = load_settings(EdgeSettings, {})
    assert up.edge_stop_grace_s(msgspec.structs.replace(edge, edge_shutdown_grace_s=60.0)) > 61.0
    assert up.edge_stop_grace_s(msgspec.structs.replace(edge, edge_shutdown_grace_s=1.0)) == up.STOP_GRACE_S
