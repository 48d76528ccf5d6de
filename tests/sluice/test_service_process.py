"""``sluice up``'s supervisor of child processes: restarts with back-off, and stops without waiting it out."""

from __future__ import annotations

import asyncio

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
