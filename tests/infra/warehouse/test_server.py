"""The owner serves reads: other processes query an embedded warehouse through the process that holds it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from infra.warehouse import (
    WarehouseError,
    WarehouseLockedError,
    WarehouseQueryError,
    WarehouseQueryServer,
    migrate,
    open_warehouse,
    query_warehouse,
    warehouse_dir,
)
from infra.warehouse.client import Client
from infra.warehouse.owner import OwnerRecord, read_owner, write_owner
from schemas.settings import PlatformSettings
from tests.infra.warehouse import procs

pytestmark = pytest.mark.integration


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid is free
    return child.pid


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def test_another_process_queries_through_the_owner(
    settings: PlatformSettings, warehouse: Client
) -> None:
    migrate(warehouse)
    procs.insert_events(warehouse, 2)
    async with WarehouseQueryServer(warehouse, settings) as server:
        owner_file = warehouse_dir(settings) / ".owner.json"
        assert stat.S_IMODE(owner_file.stat().st_mode) == 0o600
        record = read_owner(settings)
        assert record is not None
        assert (record.pid, record.url) == (os.getpid(), server.url)
        assert server.url.startswith("http://127.0.0.1:")

        # The other process cannot open the directory (this one holds it), so every answer came from here.
        answers = await asyncio.to_thread(
            procs.run_sql,
            Path(settings.data_dir),
            "SELECT count() AS n, min(time) AS first FROM events_raw",
            "INSERT INTO events_raw (event_id) VALUES ('intruder')",
            "SELEC 1",
            "SELECT * FROM no_such_table",
        )
    assert not owner_file.exists()
    count, insert, bad, missing = answers
    assert count["ok"]["columns"] == ["n", "first"]
    assert count["ok"]["types"] == ["UInt64", "DateTime64(3, 'UTC')"]
    assert count["ok"]["rows"][0][0] == 2
    assert count["ok"]["rows"][0][1].endswith("+00:00")
    assert insert == {"error": "WarehouseQueryError", "message": insert["message"]}
    assert "INSERT statements are refused" in insert["message"]
    assert bad["error"] == "WarehouseQueryError"
    assert "Syntax error" in bad["message"]
    assert missing["error"] == "WarehouseQueryError"
    assert "UNKNOWN_TABLE" in missing["message"]
    assert warehouse.query("SELECT count() FROM events_raw").result_rows == [(2,)]


async def test_the_owner_checks_the_token_and_bounds_rows(
    settings: PlatformSettings, warehouse: Client
) -> None:
    async with (
        WarehouseQueryServer(warehouse, settings, max_rows=3) as server,
        aiohttp.ClientSession() as http,
    ):
        body = msgspec.json.encode({"sql": "SELECT 1"})
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            async with http.post(f"{server.url}/query", data=body, headers=headers) as response:
                assert response.status == 401
        record = read_owner(settings)
        assert record is not None
        auth = {"Authorization": f"Bearer {record.token}"}
        async with http.post(f"{server.url}/query", data=b"{not json", headers=auth) as response:
            assert response.status == 400
            assert "bad request body" in (await response.json())["error"]

        # More than the server's limit is asked for; the server's limit wins, and says it cut.
        result = await asyncio.to_thread(
            query_warehouse, settings, "SELECT number FROM numbers(1000)", max_rows=100
        )
        assert result.rows == [[0], [1], [2]]
        assert result.truncated
        assert result.row_limit == 3  # the limit it applied, not the 100 asked for


async def test_the_owner_refuses_into_outfile_and_several_statements(
    settings: PlatformSettings, warehouse: Client, tmp_path: Path
) -> None:
    victim = tmp_path / "victim.sql"
    victim.write_text("precious")
    fresh = tmp_path / "fresh.bin"
    async with WarehouseQueryServer(warehouse, settings):
        # Another process asks, so the answer can only come from this owner.
        outfile, trunc, several = await asyncio.to_thread(
            procs.run_sql,
            Path(settings.data_dir),
            f"SELECT 42 INTO OUTFILE '{fresh}'",
            f"SELECT 1 INTO OUTFILE '{victim}' TRUNCATE",
            "SELECT 1 AS a; SELECT 'x' AS b",
        )
    for answer in (outfile, trunc):
        assert answer["error"] == "WarehouseQueryError"
        assert "INTO OUTFILE is refused" in answer["message"]
    assert several["error"] == "WarehouseQueryError"
    assert "one statement at a time" in several["message"]
    assert not fresh.exists()
    assert victim.read_text() == "precious"


async def test_a_full_owner_answers_busy(settings: PlatformSettings, warehouse: Client) -> None:
    async with WarehouseQueryServer(warehouse, settings, max_pending=0):
        with pytest.raises(WarehouseError, match="answered 503"):
            await asyncio.to_thread(query_warehouse, settings, "SELECT 1")


async def test_stop_is_idempotent_and_keeps_a_successors_owner_file(
    settings: PlatformSettings, warehouse: Client
) -> None:
    server = WarehouseQueryServer(warehouse, settings)
    await server.start()
    successor = OwnerRecord(pid=os.getpid(), url="http://127.0.0.1:1", token="t")
    write_owner(settings, successor)
    await server.stop()
    await server.stop()
    assert read_owner(settings) == successor
    with pytest.raises(RuntimeError, match="not started"):
        _ = server.url


@pytest.mark.parametrize("live", [False, True], ids=["dead-pid", "live-pid-nothing-listening"])
def test_a_stale_owner_file_falls_back_to_opening_directly(settings: PlatformSettings, live: bool) -> None:
    with contextlib.closing(open_warehouse(settings)) as client:
        migrate(client)
        procs.insert_events(client, 1)
    pid = os.getpid() if live else dead_pid()
    write_owner(settings, OwnerRecord(pid=pid, url=f"http://127.0.0.1:{closed_port()}", token="t"))
    result = query_warehouse(settings, "SELECT count() FROM events_raw")
    assert result.rows == [[1]]
    with pytest.raises(WarehouseQueryError, match="INSERT statements are refused"):
        query_warehouse(settings, "INSERT INTO events_raw (event_id) VALUES ('x')")
    with pytest.raises(WarehouseQueryError, match="readonly"):
        query_warehouse(settings, "SELECT 1 SETTINGS readonly = 0")


def test_sql_follows_a_live_owner_and_outlives_a_killed_one(settings: PlatformSettings) -> None:
    owner = procs.spawn("owner", settings.data_dir)
    try:
        procs.read_line(owner)
        result = query_warehouse(settings, "SELECT count() FROM events_raw")
        assert result.rows == [[procs.OWNER_EVENTS]]
    finally:
        owner.kill()  # no clean-up: the owner file stays behind, chDB's lock goes with the process
        owner.communicate(timeout=30)
    record = read_owner(settings)
    assert record is not None
    assert record.pid == owner.pid

    result = query_warehouse(settings, "SELECT count() FROM events_raw")
    assert result.rows == [[procs.OWNER_EVENTS]]


def test_a_live_owner_that_does_not_serve_is_reported_as_the_lock_holder(settings: PlatformSettings) -> None:
    owner = procs.spawn("owner", settings.data_dir)
    try:
        ready = procs.read_line(owner)
        record = read_owner(settings)
        assert record is not None
        # Same pid and url, wrong token: as if the file were someone else's; nothing to fall back to.
        write_owner(settings, OwnerRecord(pid=record.pid, url=ready["url"], token="forged"))
        with pytest.raises(WarehouseLockedError) as caught:
            query_warehouse(settings, "SELECT 1")
        assert caught.value.owner_pid == owner.pid
    finally:
        procs.stop(owner)
