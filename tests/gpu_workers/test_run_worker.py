"""``run_worker``, the loop of ``sluice worker``, around a stand-in service (no model, no Kafka)."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

import gpu_workers.main as worker_main
from gpu_workers.settings import WorkerSettings
from monitoring.ops import Readiness
from schemas.settings import PlatformSettings


class _Service:
    """What ``run_worker`` asks of a ``WorkerService``."""

    def __init__(self, standby: bool) -> None:
        self.worker_id = "w-test"
        self.standby = standby
        self.failure: BaseException | None = None
        self.start_cancelled: threading.Event | None = None
        self.calls: list[str] = []

    def readiness(self) -> Readiness:
        return Readiness.of(loaded=True)

    def watch(self, _: Any) -> None:
        pass

    def start(self) -> None:
        self.calls.append("start")

    def join(self) -> None:
        self.standby = False
        self.calls.append("join")

    def drain(self, within_s: float) -> bool:
        self.calls.append("drain")
        return True

    def stop(self) -> None:
        self.calls.append("stop")


@pytest.mark.parametrize("joins", [False, True])
def test_a_warm_standby_stopped_before_it_joins_never_says_it_serves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, joins: bool
) -> None:
    """Found by an audit: a warm standby stopped with Ctrl-C before it was ever asked to join logged
    "serving demo-gpt" on its way out."""
    service = _Service(standby=True)
    monkeypatch.setattr(worker_main, "make_worker", lambda *args: service)
    monkeypatch.setattr(worker_main, "tune_gc", lambda: None)
    stop, join = threading.Event(), threading.Event()
    (join if joins else stop).set()
    if joins:  # it joins, serves, then is stopped
        threading.Timer(0.3, stop.set).start()
    with caplog.at_level(logging.INFO, logger="gpu_workers.main"):
        worker_main.run_worker(PlatformSettings(), WorkerSettings(worker_ops_port=0), "demo-gpt", stop, join)
    said = [record.getMessage() for record in caplog.records]
    assert any("warm for demo-gpt" in line for line in said)
    assert any("serving demo-gpt" in line for line in said) is joins, said
    assert service.calls == (["start", "join", "drain", "stop"] if joins else ["start", "drain", "stop"])
