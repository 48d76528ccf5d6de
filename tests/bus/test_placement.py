"""CPU placement: core lists, the box split, Kafka's native threads off a worker's model cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from bus.placement import (
    PlacementError,
    available_cpus,
    batch_policy,
    format_cpus,
    native_threads,
    parse_cpus,
    place_native_threads,
    split_box,
)
from bus.producer import EventProducer
from gpu_workers.settings import WorkerSettings
from schemas.settings import KafkaConnection, SettingsError
from sluice.autoscale import FleetSettings

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity only")


@pytest.mark.parametrize(
    ("text", "cores"),
    [("1", {1}), ("0-3,6", {0, 1, 2, 3, 6}), (" 2 , 4-5", {2, 4, 5}), ("3,3,2-3", {2, 3})],
)
def test_core_lists_parse_like_taskset_and_format_back(text: str, cores: set[int]) -> None:
    assert parse_cpus(text) == cores
    assert parse_cpus(format_cpus(cores)) == cores


def test_formatting_folds_runs() -> None:
    assert format_cpus({0, 1, 2, 6, 8, 9}) == "0-2,6,8-9"
    assert format_cpus({5}) == "5"


@pytest.mark.parametrize("text", ["x", "3-1", "", ",", "-1", "1-"])
def test_a_bad_core_list_is_a_settings_error_that_says_what_is_wrong(text: str) -> None:
    with pytest.raises(PlacementError, match="core"):
        parse_cpus(text)
    assert issubclass(PlacementError, SettingsError)


def test_settings_refuse_a_bad_core_list_when_read() -> None:
    with pytest.raises(ValueError, match="core list"):
        WorkerSettings(worker_cpus="one")
    with pytest.raises(ValueError, match="core list"):
        FleetSettings(fleet_worker_cpus="half")
    assert FleetSettings(fleet_worker_cpus="off").fleet_worker_cpus == "off"
    assert FleetSettings().fleet_worker_cpus == "auto"


def test_the_box_split_gives_workers_the_upper_half() -> None:
    assert split_box([0]) is None
    assert split_box([]) is None
    f = frozenset
    assert split_box([0, 1]) == (f({1}), f({0}))
    assert split_box([0, 1, 2]) == (f({2}), f({0, 1}))
    assert split_box(range(8)) == (f({4, 5, 6, 7}), f({0, 1, 2, 3}))
    assert split_box([3, 9, 5, 7]) == (f({7, 9}), f({3, 5}))


@pytest.fixture
def native_on_first_core() -> Iterator[frozenset[int]]:
    cores = frozenset({min(available_cpus())})
    place_native_threads(cores)
    try:
        yield cores
    finally:
        place_native_threads(None)


def _tasks() -> dict[int, str]:
    tasks: dict[int, str] = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                tasks[int(task)] = comm.read().strip()
        except OSError:
            continue
    return tasks


@needs_affinity
def test_threads_started_while_building_a_client_get_the_native_cores(
    native_on_first_core: frozenset[int],
) -> None:
    own = os.sched_getaffinity(0)
    seen: list[set[int]] = []
    with native_threads():
        thread = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join()
    assert seen == [native_on_first_core]
    assert os.sched_getaffinity(0) == own, "the building thread goes back to its own cores"


@needs_affinity
def test_a_producers_librdkafka_threads_run_on_the_native_cores(native_on_first_core: frozenset[int]) -> None:
    before = set(_tasks())
    with EventProducer(KafkaConnection("127.0.0.1:1"), "placement-test"):  # no broker needed
        deadline = time.monotonic() + 10
        while True:  # a new thread names itself once it runs
            python = {thread.native_id for thread in threading.enumerate()}
            native = {tid: name for tid, name in _tasks().items() if tid not in before and tid not in python}
            if any(name.startswith("rdk:") for name in native.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        assert any(name.startswith("rdk:") for name in native.values()), native
        for tid in native:
            assert os.sched_getaffinity(tid) == native_on_first_core, native[tid]
            assert os.sched_getscheduler(tid) == os.SCHED_BATCH, native[tid]
    assert os.sched_getscheduler(0) == os.SCHED_OTHER, "the building thread goes back to its own policy"


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")
def test_threads_started_under_the_batch_policy_keep_it_and_the_caller_gets_its_own_back() -> None:
    def policy_of_a_new_thread() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))
        thread.start()
        thread.join()
        return seen[0]

    assert policy_of_a_new_thread() == os.SCHED_OTHER
    with batch_policy():
        assert os.sched_getscheduler(0) == os.SCHED_BATCH
        assert policy_of_a_new_thread() == os.SCHED_BATCH
    assert os.sched_getscheduler(0) == os.SCHED_OTHER
    assert policy_of_a_new_thread() == os.SCHED_OTHER


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="scheduling policies are Linux's")
def test_where_policies_are_refused_clients_are_still_built(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*_: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "sched_setscheduler", refused)
    with native_threads():  # the refusal is not the caller's problem: nothing raises
        assert os.sched_getscheduler(0) == os.SCHED_OTHER
    with pytest.raises(OSError, match="the client's own"), native_threads():
        raise OSError("the client's own")  # an error of the body passes through unchanged


@needs_affinity
def test_without_a_placement_clients_are_built_where_the_caller_runs() -> None:
    place_native_threads(None)
    own = os.sched_getaffinity(0)
    with native_threads():
        assert os.sched_getaffinity(0) == own


PROBE = """
import json, os, sys
from bus.placement import place_box
line, env = place_box(sys.argv[1])
tasks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"line": line, "env": env, "tasks": tasks}))
"""


def _probe(choice: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, choice], capture_output=True, text=True, check=True, timeout=60
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@needs_affinity
def test_placing_the_box_moves_this_process_off_the_workers_cores() -> None:
    available = available_cpus()
    split = split_box(available)
    result = _probe("auto")
    if split is None:  # one core: nothing to split
        assert result["env"] == {}
        return
    workers, rest = split
    assert result["env"] == {"SLUICE_WORKER_CPUS": format_cpus(workers)}
    assert f"workers {format_cpus(workers)}" in str(result["line"])
    tasks = result["tasks"]
    assert isinstance(tasks, dict)
    assert tasks
    assert all(set(cores) == rest for cores in tasks.values()), tasks


@needs_affinity
def test_placement_off_moves_nothing() -> None:
    result = _probe("off")
    assert result == {"line": "", "env": {}, "tasks": result["tasks"]}
    tasks = result["tasks"]
    assert isinstance(tasks, dict)
    assert all(set(cores) == set(available_cpus()) for cores in tasks.values())


def test_cores_this_process_cannot_use_are_refused_with_the_cores_it_has() -> None:
    has = f"this process has {format_cpus(available_cpus())}"
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "4096"], capture_output=True, text=True, check=False, timeout=60
    )
    assert out.returncode != 0
    assert "cannot give the workers cores 4096" in out.stderr
    assert has in out.stderr
    env = {**os.environ, "SLUICE_WORKER_CPUS": "4096"}
    worker = subprocess.run(
        [sys.executable, "-m", "sluice", "worker", "--model", "demo-gpt"],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert worker.returncode == 2, worker.stdout + worker.stderr
    assert "cannot run on cores 4096" in worker.stdout + worker.stderr
    assert has in worker.stdout + worker.stderr
