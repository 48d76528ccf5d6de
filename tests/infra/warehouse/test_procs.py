"""The helpers that drive the warehouse tests' other processes."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.infra.warehouse.procs import read_line, stop

FD_SETSIZE = 1024  # what select.select() accepts


@pytest.fixture
def descriptors_used_up_to_fd_setsize() -> Iterator[None]:
    """Hold descriptors open until the next one is above FD_SETSIZE, as embedded ClickHouse's per-thread
    /proc files do in a worker that has opened many warehouses (CI hit it at ~1030)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FD_SETSIZE + 64:
        pytest.skip(f"the descriptor limit ({soft}) is too low to reach FD_SETSIZE")
    held: list[int] = []
    try:
        while (fd := os.open(os.devnull, os.O_RDONLY)) <= FD_SETSIZE:
            held.append(fd)
        held.append(fd)
        yield
    finally:
        for fd in held:
            os.close(fd)


def _printer(*lines: str) -> subprocess.Popen[str]:
    """A process that prints ``lines`` in one write, then waits for its stdin to close."""
    text = "".join(f"{line}\n" for line in lines)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import sys; sys.stdout.write({text!r}); sys.stdout.flush(); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.usefixtures("descriptors_used_up_to_fd_setsize")
def test_read_line_works_on_a_pipe_above_fd_setsize() -> None:
    proc = _printer('{"ready": 1}')
    try:
        assert proc.stdout is not None
        assert proc.stdout.fileno() > FD_SETSIZE
        assert read_line(proc, timeout_s=30) == {"ready": 1}
    finally:
        stop(proc)


def test_lines_that_arrive_together_are_each_read_in_turn() -> None:
    proc = _printer("starting", '{"n": 1}', "noise", '{"n": 2}')
    try:
        assert read_line(proc, timeout_s=30) == {"n": 1}
        assert read_line(proc, timeout_s=5) == {"n": 2}
    finally:
        stop(proc)
