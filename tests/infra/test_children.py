"""A child started with ``die_with(parent)`` does not outlive its parent, even when the parent dies between
the fork and the child's ``prctl(PR_SET_PDEATHSIG)`` (``sluice up`` killed while it restarts a
crash-looping worker). A review found such a child orphaned for good, holding its ports and partitions."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.processes import alive

_PARENT = """
import os, subprocess, sys, time
from infra.children import die_with

started = die_with(os.getpid())

def slow_then_die_with_parent():
    with open(sys.argv[1], "w") as out:
        out.write(str(os.getpid()))
    time.sleep(1.0)  # a slow fork under load: the parent is killed meanwhile
    started()

subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], preexec_fn=slow_then_die_with_parent)
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_parent_died_before_its_prctl_does_not_outlive_it(tmp_path: Path) -> None:
    said = tmp_path / "child.pid"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    with subprocess.Popen([sys.executable, "-c", _PARENT, str(said)], env=env) as parent:
        deadline = time.monotonic() + 10
        while not said.exists() or not said.read_text():
            assert time.monotonic() < deadline, "the child never reached its preexec_fn"
            time.sleep(0.02)
        child = int(said.read_text())
        parent.kill()  # before the child's prctl
    deadline = time.monotonic() + 5
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert not alive(child), f"child {child} outlived its killed parent: an orphan"
    finally:
        if alive(child):
            os.kill(child, 9)
