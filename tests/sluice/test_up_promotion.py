"""A promotion under autoscaling keeps the workers the model was scaled to: the count carries over to the
new stable version, and a ``WorkersScaled`` for it says so. A review found the model dropped to
``--workers-per-model`` at once (the latest decision named the old version), with nothing published: the
traffic 3 workers served landed on 1, which scaled out again only after its queue grew, on cold loads."""

from __future__ import annotations

import asyncio
import types

import pytest
from rich.console import Console

import sluice.up as up
from schemas.events import Event, WorkersScaled
from schemas.settings import PlatformSettings
from sluice.autoscale import FleetSettings


class _Lag:
    def __init__(self) -> None:
        self.lagging: dict[str, int] = {}

    def __call__(self, topic: str, model: str, version: str | None) -> int:
        self.lagging[topic] = 1
        return 10  # the candidate's group kept up with its share: little queued at the promotion

    def keep(self, groups: set[str]) -> None:
        pass

    def close(self) -> None:
        pass


async def test_a_promotion_under_load_keeps_the_workers_the_model_was_scaled_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = up.Fleet(
        PlatformSettings(),
        FleetSettings(fleet_autoscale=True, fleet_max_workers=4, fleet_scale_interval_s=0.1),
        Console(quiet=True),
        0,
        asyncio.Event(),
    )
    fleet._lag = _Lag()  # type: ignore[assignment]
    serial = iter(range(1, 100))

    async def spawn(key: tuple[str, str], *, standby: bool) -> object:
        return types.SimpleNamespace(port=0, model=key[0], version=key[1], serial=next(serial))

    retired: list[tuple[tuple[str, str], str]] = []
    monkeypatch.setattr(fleet, "_spawn", spawn)
    v1_retired = asyncio.Event()

    def retire(key: tuple[str, str], worker: object, why: str) -> None:
        retired.append((key, why))
        if [why for _, why in retired].count("the version no longer serves") == 3:
            v1_retired.set()

    monkeypatch.setattr(fleet, "_retire", retire)
    m = "demo-gpt"
    # Under load: the autoscaler took v1 (stable) to 3 workers; v2 is the canary with its one worker.
    fleet._scaled[m] = WorkersScaled(
        tenant="", source="sluice/autoscaler", model=m, version="v1", replicas=3, previous=1,
        reason="lag 140 over 1 x 50", actor="autoscaler",
    )  # fmt: skip
    await fleet.reconcile({(m, "v1"): 3, (m, "v2"): 1}, {m: "v1"})
    assert len(fleet.workers[(m, "v1")]) == 3

    # The controller promotes v2: the deployment now serves v2 alone.
    monkeypatch.setattr(fleet, "desired", lambda: ({(m, "v2"): fleet.replicas(m, "v2")}, {m: "v2"}))
    published: list[Event] = []

    async def publish(topic: str, event: Event) -> None:
        published.append(event)

    following = asyncio.create_task(fleet.follow(publish))
    async with asyncio.timeout(10):  # one round: its reconcile starts v2's workers, then retires v1's
        await v1_retired.wait()
    following.cancel()
    serving = len(fleet.workers[(m, "v2")])
    assert serving == 3, f"the promotion left {serving} worker(s) for the traffic 3 served a moment before"
    # the log says what runs: one decision, for v2, carried over from v1
    assert [(e.version, e.previous, e.replicas) for e in published if isinstance(e, WorkersScaled)] == [
        ("v2", 1, 3)
    ]
    assert "carried over" in fleet.decisions[-1].reason
    assert fleet.replicas(m, "v2") == 3
