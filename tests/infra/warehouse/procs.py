"""Other processes for the warehouse tests: chDB allows one process per data directory, so "another
process" has to be a real one.

``python -m tests.infra.warehouse.procs owner DATA_DIR`` opens and migrates the warehouse, inserts
:data:`OWNER_EVENTS` events, serves reads, prints one ``ready`` JSON line and runs until its stdin closes.
``python -m tests.infra.warehouse.procs sql DATA_DIR SQL...`` runs each query with ``query_warehouse`` and
prints one JSON line per query: ``{"ok": QueryResult}`` or ``{"error": type, "message": ...}``.
"""

from __future__ import annotations

import asyncio
import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from infra.warehouse import WarehouseError, WarehouseQueryServer, migrate, open_warehouse, query_warehouse
from infra.warehouse.client import Client
from schemas.settings import PlatformSettings

REPO_ROOT = Path(__file__).resolve().parents[3]
OWNER_EVENTS = 3


def insert_events(client: Client, count: int, *, tenant: str = "acme") -> None:
    for index in range(count):
        client.command(
            "INSERT INTO events_raw (event_id, type, time, tenant, model, request_id, source, payload, "
            "topic, `partition`, `offset`) VALUES ({event_id:String}, 'request.accepted', now64(3), "
            "{tenant:String}, 'demo-gpt', {event_id:String}, 'test', '{}', 'sluice.requests.demo-gpt', 0, "
            "{offset:UInt64})",
            parameters={"event_id": f"e{index}", "tenant": tenant, "offset": index},
        )


# ------------------------------------------------------------------ run from the tests


def spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.infra.warehouse.procs", *args],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_line(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> dict[str, Any]:
    """The next JSON line the process prints, within ``timeout_s``; its stderr if it dies instead.

    It reads the pipe's descriptor itself, keeping what follows the line for the next call: a buffered
    ``readline`` would pull two lines in at once and leave the second where no poll can see it. It polls
    with a selector (epoll), not ``select.select``, which refuses a descriptor above FD_SETSIZE (1024), as
    a long test session's can be (embedded ClickHouse keeps three /proc files per thread it starts).
    """
    assert proc.stdout is not None
    pending = _pending.setdefault(proc.pid, bytearray())
    deadline = time.monotonic() + timeout_s
    while True:
        end = pending.find(b"\n")
        if end >= 0:
            line = pending[: end + 1].decode()
            del pending[: end + 1]
            if line.startswith("{"):
                result: dict[str, Any] = json.loads(line)
                return result
            continue
        with selectors.DefaultSelector() as selector:
            selector.register(proc.stdout.fileno(), selectors.EVENT_READ)
            ready = selector.select(max(0.0, deadline - time.monotonic()))
        if not ready:
            proc.kill()
            raise TimeoutError(f"no line from {proc.args!r} in {timeout_s} s")
        chunk = os.read(proc.stdout.fileno(), 65536)
        if not chunk:
            _, err = proc.communicate(timeout=10)
            raise RuntimeError(f"{proc.args!r} exited {proc.returncode}:\n{err}")
        pending += chunk


_pending: dict[int, bytearray] = {}  # what read_line has read past its last line, by pid


def stop(proc: subprocess.Popen[str], timeout_s: float = 30.0) -> None:
    """Ask the process to finish (close its stdin) and wait; kill it if it does not."""
    _pending.pop(proc.pid, None)
    try:
        proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def run_sql(data_dir: Path, *queries: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.infra.warehouse.procs", "sql", str(data_dir), *queries],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


# ------------------------------------------------------------------ in the other process


async def _owner(settings: PlatformSettings) -> None:
    client = open_warehouse(settings)
    try:
        migrate(client)
        insert_events(client, OWNER_EVENTS)
        async with WarehouseQueryServer(client, settings) as server:
            print(json.dumps({"ready": True, "url": server.url}), flush=True)
            await asyncio.to_thread(sys.stdin.read)
    finally:
        client.close()


def _sql(settings: PlatformSettings, queries: list[str]) -> None:
    for query in queries:
        try:
            result = query_warehouse(settings, query)
        except WarehouseError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), flush=True)
        else:
            print(msgspec.json.encode({"ok": result}).decode(), flush=True)


def main(argv: list[str]) -> None:
    command, data_dir, *rest = argv
    settings = PlatformSettings(data_dir=data_dir)
    if command == "owner":
        asyncio.run(_owner(settings))
    elif command == "sql":
        _sql(settings, rest)
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
