"""``sluice up``'s supervisor of child processes: restarts with back-off, and stops without waiting it out."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console

from sluice.up import ServiceProcess


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
        "import subprocess, sys, time\n"
        "from sluice.up import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], preexec_fn=die_with_parent)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    with subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _alive(child)
        parent.kill()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its killed parent"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False
