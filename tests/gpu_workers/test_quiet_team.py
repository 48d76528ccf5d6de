"""The quiet team: an embedding worker's small batches with nothing behind them run on a wider torch team
whose extra threads live on the cores the worker does not own; everything else on the worker's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bus.placement import place_native_threads
from gpu_workers.batching import BatcherConfig
from gpu_workers.embedding import EmbeddingEngine
from gpu_workers.embedding_runner import EmbeddingRunner
from gpu_workers.main import quiet_threads
from gpu_workers.models import (
    QUIET_SPIN_COUNT,
    QUIET_THREAD_NAME,
    LoadedModel,
    QuietTeam,
    configure_openmp,
)
from gpu_workers.runtime import Arrival
from gpu_workers.settings import WorkerSettings
from tests.gpu_workers.test_runners import Collected, embedding

ROOT = Path(__file__).resolve().parents[2]


class Threads:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, threads: int) -> None:
        self.calls.append(threads)


def test_the_team_goes_wide_after_a_streak_of_quiet_batches_and_narrow_at_the_first_busy_one() -> None:
    threads = Threads()
    team = QuietTeam(1, 2, max_batch=4, set_threads=threads)
    gap = QuietTeam.QUIET_IDLE_S
    streak = [team.size_for(1, waiting=0, idle_s=gap) for _ in range(QuietTeam.QUIET_STREAK + 1)]
    assert streak == [1] * (QuietTeam.QUIET_STREAK - 1) + [2, 2], "quiet for a while first"
    assert team.size_for(4, waiting=0, idle_s=1.0) == 2
    busy = [
        (5, 0, 1.0),  # more than max_batch items
        (1, 3, 1.0),  # work queued behind the batch
        (1, 0, gap / 2),  # a request arrived as the last one finished
    ]
    for batch, waiting, idle in busy:
        for _ in range(QuietTeam.QUIET_STREAK - 1):
            assert team.size_for(1, waiting=0, idle_s=1.0) == 2
        assert team.size_for(batch, waiting=waiting, idle_s=idle) == 1, (batch, waiting, idle)
        again = [team.size_for(1, waiting=0, idle_s=1.0) for _ in range(QuietTeam.QUIET_STREAK)]
        assert again == [1] * (QuietTeam.QUIET_STREAK - 1) + [2], "a new streak first"
    assert threads.calls == [2, 1, 2, 1, 2, 1, 2], "torch is told only when the size changes"
    assert team.wide_batches == 3 + 3 * QuietTeam.QUIET_STREAK


def test_a_quiet_team_is_wider_than_the_workers_own() -> None:
    for narrow, wide in ((2, 2), (2, 1), (0, 2)):
        with pytest.raises(ValueError, match="wider"):
            QuietTeam(narrow, wide, max_batch=4)


def test_start_warms_up_wide_and_comes_back_narrow() -> None:
    threads = Threads()
    seen: list[list[int]] = []
    team = QuietTeam(1, 3, max_batch=4, set_threads=threads)
    team.start(lambda: seen.append(list(threads.calls)))
    assert seen == [[3]], "the warm-up ran on the wide team"
    assert threads.calls == [3, 1]
    assert team.size_for(8, waiting=0, idle_s=1.0) == 1
    assert threads.calls == [3, 1], "already narrow"


def test_the_runner_tells_the_team_its_batch_what_waits_and_how_long_the_model_idled(
    minilm: LoadedModel,
) -> None:
    class Recorded(QuietTeam):
        def __init__(self) -> None:
            super().__init__(1, 2, max_batch=2, set_threads=lambda _: None)
            self.asked: list[tuple[int, int, float]] = []

        def size_for(self, batch: int, waiting: int, idle_s: float) -> int:
            self.asked.append((batch, waiting, round(idle_s, 3)))
            return super().size_for(batch, waiting, idle_s)

    now = [100.0]
    runner = EmbeddingRunner(
        EmbeddingEngine(minilm.model),
        minilm.manifest,
        source="test",
        worker_id="w",
        batching=BatcherConfig(max_batch_size=2, max_wait_s=0.0, max_batch_tokens=4096),
        team=(team := Recorded()),
        clock=lambda: now[0],
        overlap=False,  # a quiet team is a CPU worker's; on a GPU each batch would finish a tick later
    )
    out = Collected()

    def arrive(offset: int) -> str:
        request = embedding(inputs=[[101, 2088 + offset, 102]])
        runner.accept(Arrival(request, ("requests", 0), offset), out)
        return request.request_id

    for offset in range(QuietTeam.QUIET_STREAK):
        now[0] += 0.005
        lone = arrive(100 + offset)
        runner.tick(out)  # one client: a lone request 5 ms after the last one ended
        assert lone in out.finished
    now[0] += 0.001
    for offset in range(1, 4):
        arrive(offset)
    runner.tick(out)  # two of three, 1 ms after: busier
    runner.tick(out)  # the third, at once
    streak = [(1, 0, 0.005)] * QuietTeam.QUIET_STREAK
    assert team.asked == [*streak, (2, 1, 0.001), (1, 0, 0.0)]
    assert team.wide_batches == 1, "the last of the streak"
    assert runner.load().quiet_batches == 1
    assert len(out.finished) == QuietTeam.QUIET_STREAK + 3


@pytest.fixture
def no_openmp_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No OpenMP variables and torch not loaded, restored afterwards (whatever configure_openmp sets)."""
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.setenv(name, "")  # recorded, so the test's own writes are undone too
        monkeypatch.delenv(name)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    return monkeypatch


def test_configure_openmp_spins_briefly_for_a_quiet_team(no_openmp_env: pytest.MonkeyPatch) -> None:
    configure_openmp("passive", QUIET_SPIN_COUNT)
    assert os.environ["GOMP_SPINCOUNT"] == str(QUIET_SPIN_COUNT)
    assert "OMP_WAIT_POLICY" not in os.environ, "a passive team is slower than one thread"
    del os.environ["GOMP_SPINCOUNT"]
    configure_openmp("active", QUIET_SPIN_COUNT)
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert "GOMP_SPINCOUNT" not in os.environ


def test_an_explicit_spin_count_wins(no_openmp_env: pytest.MonkeyPatch) -> None:
    no_openmp_env.setenv("GOMP_SPINCOUNT", "5")
    configure_openmp("passive", QUIET_SPIN_COUNT)
    assert os.environ["GOMP_SPINCOUNT"] == "5"
    assert "OMP_WAIT_POLICY" not in os.environ


@pytest.fixture
def unplaced() -> Iterator[None]:
    yield
    place_native_threads(None)


def test_quiet_threads_default_to_every_core_of_a_placed_embedding_worker(unplaced: None) -> None:
    worker = WorkerSettings()
    assert quiet_threads(worker, "embedding") == 0, "not placed: off"
    own = os.sched_getaffinity(0)
    place_native_threads({max(own) + 1, max(own) + 2})
    assert quiet_threads(worker, "embedding") == len(own) + 2
    assert quiet_threads(worker, "generation") == 0, "demo-gpt is faster on one thread"
    assert quiet_threads(WorkerSettings(worker_quiet_threads=3), "embedding") == 3
    assert quiet_threads(WorkerSettings(worker_quiet_threads=3), "generation") == 0


def test_worker_settings_read_the_quiet_team_from_the_environment() -> None:
    from schemas.settings import load_settings

    worker = load_settings(
        WorkerSettings, {"SLUICE_WORKER_QUIET_THREADS": "2", "SLUICE_WORKER_QUIET_BATCH": "8"}
    )
    assert (worker.worker_quiet_threads, worker.worker_quiet_batch) == (2, 8)


# A fresh process: OpenMP counts its cores once, when torch loads, which this test process did long ago.
_PROBE = textwrap.dedent(
    """
    import json, os, sys, threading
    from gpu_workers.models import QuietTeam, load_torch

    own, spare = {int(sys.argv[1])}, {int(sys.argv[2])}
    widen = sys.argv[3] == "widen"
    os.sched_setaffinity(0, own)  # the worker's process on its own core, as place_worker leaves it
    out = {}

    def model_thread():
        load_torch(spare if widen else ())
        import torch
        out["openmp_threads"] = torch.get_num_threads()  # OpenMP's default: the cores it saw at load
        out["after_load"] = sorted(os.sched_getaffinity(0))
        torch.set_num_threads(1)
        before = set(os.listdir("/proc/self/task"))
        team = QuietTeam(1, 2, max_batch=4, helper_cores=spare)
        x = torch.ones(1 << 20)
        team.start(lambda: (x + x).sum())
        out["after_start"] = sorted(os.sched_getaffinity(0))
        out["torch_threads"] = torch.get_num_threads()
        new = set(os.listdir("/proc/self/task")) - before
        out["helpers"] = sorted(sorted(os.sched_getaffinity(int(t))) for t in new)
        out["names"] = sorted(
            open(f"/proc/self/task/{t}/comm").read().strip()
            for t in new
            if os.sched_getaffinity(int(t)) == spare
        )
        out["others"] = sorted(
            sorted(os.sched_getaffinity(int(t))) for t in set(os.listdir("/proc/self/task")) - new
        )

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    print(json.dumps(out))
    """
)


def _probe(own: int, spare: int, mode: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(own), str(spare), mode],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two cores to split (and Linux affinity)",
)
def test_torch_loaded_with_the_spare_cores_sees_them_and_the_team_lives_there() -> None:
    spare, own = sorted(os.sched_getaffinity(0))[:2]
    narrow = _probe(own, spare, "plain")
    assert narrow["openmp_threads"] == 1, "loaded on one core, OpenMP counts one"
    wide = _probe(own, spare, "widen")
    assert wide["openmp_threads"] == 2, "loaded with the spare core too, OpenMP counts both"
    assert wide["after_load"] == [own], "the loading thread is back on its own core"
    assert wide["after_start"] == [own]
    assert wide["torch_threads"] == 1, "narrow again after the warm-up"
    assert [spare] in wide["helpers"], "the team's extra thread lives on the spare core"
    assert wide["names"], wide
    assert set(wide["names"]) == {QUIET_THREAD_NAME}, "named, for top -H"
    assert wide["others"] == [[own]] * len(wide["others"]), "nothing else moved"


def test_a_worker_builds_its_embedding_runner_with_the_team_it_is_given(minilm: LoadedModel) -> None:
    from gpu_workers.main import runner_factory
    from gpu_workers.models import configure_torch_threads

    narrow = configure_torch_threads()
    # a quiet team is a CPU worker's (a GPU's batches do not run on torch's CPU threads): the worker is
    # placed on the CPU, also where the test session's models load on a GPU
    worker = WorkerSettings(worker_device="cpu", worker_quiet_threads=narrow + 1, worker_quiet_batch=2)
    runner = runner_factory(minilm.path, worker, "test", "w")()
    try:
        assert isinstance(runner, EmbeddingRunner)
        assert runner.team is not None
        assert (runner.team.narrow, runner.team.wide, runner.team.max_batch) == (narrow, narrow + 1, 2)
        off = runner_factory(
            minilm.path, WorkerSettings(worker_device="cpu", worker_quiet_threads=narrow), "test", "w"
        )()
        assert isinstance(off, EmbeddingRunner)
        assert off.team is None, "no wider than the worker's own: off"
    finally:
        configure_torch_threads(narrow)
