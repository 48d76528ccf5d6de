"""What ``sluice up`` refuses before it starts anything (Kafka, the streams worker, the workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import infra.warehouse.client as client_module
import sluice.up as up
from infra.warehouse.errors import WarehouseLockedError
from schemas.settings import PlatformSettings
from tests.sluice.test_up_checks import _run, started  # noqa: F401  (a fixture)


@pytest.mark.parametrize("content", [None, "[tenants.acme\n", '[tenants.acme]\nkey_sha256 = "not a list"\n'])
def test_a_tenants_file_that_does_not_load_is_refused_before_anything_starts(
    started: list[str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    content: str | None,
) -> None:
    """A review: Kafka, the streams worker, ``models prepare`` and the workers all started, then the edge
    ended it with a 40-line traceback on a missing file."""
    tenants = tmp_path / "tenants.toml"
    if content is not None:
        tenants.write_text(content)
    monkeypatch.setenv("SLUICE_EDGE_TENANTS_FILE", str(tenants))
    code, lines = _run(PlatformSettings(data_dir=str(tmp_path / "data")))
    assert code == 2
    assert len(lines) == 1
    assert lines[0].startswith(f"settings error: SLUICE_EDGE_TENANTS_FILE: tenants file {tenants}: ")
    assert started == []


_HOLD = """
import fcntl, os, sys, time
path = sys.argv[1]
os.makedirs(os.path.dirname(path), exist_ok=True)
handle = open(path, "a+")
fcntl.flock(handle, fcntl.LOCK_EX)
handle.truncate(0)
handle.write(sys.argv[2].format(pid=os.getpid()))
handle.flush()
print("held", flush=True)
time.sleep(60)
"""


@contextmanager
def held_by_another_process(path: Path, content: str) -> Iterator[int]:
    """``path`` flocked by another process, which wrote ``content`` (``{pid}``: its pid) into it."""
    with subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(path), content], stdout=subprocess.PIPE, text=True
    ) as holder:
        try:
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "held"
            yield holder.pid
        finally:
            holder.kill()


def test_a_second_up_on_a_data_dir_in_use_is_refused_at_once_naming_the_first(
    started: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    """A review: the second one applied topics on the first one's Kafka, then crash-looped its streams
    worker on the warehouse's lock for 120 s."""
    data = tmp_path / "data"
    with held_by_another_process(data / "up.lock", "{pid}\n") as pid:
        code, lines = _run(PlatformSettings(data_dir=str(data)))
    assert code == 2
    assert lines == [
        f"error: the data dir {data} is in use by another `sluice up` (process {pid}); stop it, or give this "
        "one a data dir of its own (SLUICE_DATA_DIR)"
    ]
    assert started == []
    # the lock goes with its holder, and each run lets go of it when it ends
    assert _run(PlatformSettings(data_dir=str(data)))[0] == 0
    assert _run(PlatformSettings(data_dir=str(data)))[0] == 0
    assert started == ["the platform", "the platform"]


def test_a_data_dir_whose_warehouse_another_process_holds_is_refused_naming_it(
    started: list[str],  # noqa: F811
    tmp_path: Path,
) -> None:
    data = tmp_path / "data"
    # chDB holds a flock on its status file and writes its pid there
    with held_by_another_process(data / "warehouse" / "status", "PID: {pid}\n") as pid:
        code, lines = _run(PlatformSettings(data_dir=str(data)))
    assert code == 2
    said = " ".join(lines)  # one message, wrapped
    assert said.startswith(f"error: the embedded warehouse at {data / 'warehouse'} is held by process {pid}")
    assert started == []


# The warehouse held by an orphan. Found by a review: after a `kill -9` (or an OOM kill) of `sluice up`, its
# streams worker still holds the warehouse while it drains after its parent-death signal, and an immediate
# restart (a supervisor's) was refused, which under fast-restart limits can leave the unit failed for good.


def locked_until(calls: list[int], free_after: int, pid: int) -> Callable[[PlatformSettings], None]:
    def check(settings: PlatformSettings) -> None:
        calls.append(1)
        if len(calls) <= free_after:
            raise WarehouseLockedError(str(settings.data_dir), pid, None)

    return check


def test_a_warehouse_an_orphan_holds_is_waited_for(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(client_module, "check_warehouse_free", locked_until(calls, 3, 4242))
    monkeypatch.setattr(up, "_orphaned", lambda pid: pid == 4242)
    with up.claim_data_dir(PlatformSettings(data_dir=str(tmp_path))):
        assert len(calls) == 4  # refused three times while it drained, then free


def test_a_warehouse_a_live_owner_holds_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(client_module, "check_warehouse_free", locked_until(calls, 3, 4242))
    monkeypatch.setattr(up, "_orphaned", lambda pid: False)
    with pytest.raises(WarehouseLockedError):
        up.claim_data_dir(PlatformSettings(data_dir=str(tmp_path)))
    assert len(calls) == 1


def test_an_orphan_that_keeps_the_warehouse_is_refused_after_the_wait(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(client_module, "check_warehouse_free", locked_until(calls, 10**6, 4242))
    monkeypatch.setattr(up, "_orphaned", lambda pid: True)
    monkeypatch.setattr(up, "ORPHAN_RELEASE_S", 0.6)
    with pytest.raises(WarehouseLockedError):
        up.claim_data_dir(PlatformSettings(data_dir=str(tmp_path)))
    assert 2 <= len(calls) <= 5


def test_orphaned_reads_the_parent_from_proc() -> None:
    assert up._orphaned(None) is False
    assert up._orphaned(os.getpid()) is (os.getppid() == 1)
    assert up._orphaned(2**22 + 12345) is False  # no such process
