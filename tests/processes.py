"""Checks on processes that tests start."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its new parent to reap it counts as dead)."""
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def dies_with_killed_parent(script: str, *args: str, within_s: float = 10.0) -> bool:
    """Run ``script`` (Python; it starts a child and prints the child's pid) as a parent process, kill the
    parent with SIGKILL, and say whether the child is gone within ``within_s``."""
    with subprocess.Popen([sys.executable, "-c", script, *args], stdout=subprocess.PIPE, text=True) as parent:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child), "the child did not start"
        parent.kill()
    deadline = time.monotonic() + within_s
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(child)
