"""Opening the warehouse: server URLs (pure), embedded chDB persistence and its one-process lock."""

from __future__ import annotations

import datetime as dt
import decimal
import ipaddress
import os
import stat
import uuid
from pathlib import Path
from typing import Any

import clickhouse_connect
import pytest

from infra.errors import InfraError
from infra.warehouse import (
    ServerAddress,
    WarehouseError,
    WarehouseLockedError,
    WarehouseQueryError,
    migrate,
    open_warehouse,
    parse_warehouse_url,
    query_warehouse,
    read_query,
    warehouse_dir,
)
from infra.warehouse.client import Client, to_json_value
from schemas.settings import PlatformSettings
from tests.infra.warehouse import procs


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://localhost:8123", ServerAddress(host="localhost", port=8123)),
        ("http://ch", ServerAddress(host="ch", port=8123)),
        ("https://ch.example", ServerAddress(host="ch.example", port=8443, secure=True)),
        (
            "https://an%40alyst:p%3Ass@ch.example:9443/sluice/",
            ServerAddress(
                host="ch.example",
                port=9443,
                username="an@alyst",
                password="p:ss",
                database="sluice",
                secure=True,
            ),
        ),
    ],
)
def test_server_urls_parse(url: str, expected: ServerAddress) -> None:
    assert parse_warehouse_url(url) == expected


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("clickhouse://h:9000", "expected http"),
        ("http://:8123", "no host"),
        ("http://h:x", "port"),
        ("http://h/a/b", "single"),
    ],
)
def test_bad_server_urls_are_refused(url: str, problem: str) -> None:
    with pytest.raises(WarehouseError, match=problem):
        parse_warehouse_url(url)


def test_a_server_url_opens_a_clickhouse_connect_client(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []

    sentinel = object()

    def fake_get_client(**kwargs: Any) -> object:
        calls.append(kwargs)
        return sentinel

    monkeypatch.setattr(clickhouse_connect, "get_client", fake_get_client)
    assert open_warehouse(PlatformSettings(warehouse_url="https://bob:s3cret@ch:8443/db")) is sentinel
    assert calls == [
        {
            "host": "ch",
            "port": 8443,
            "username": "bob",
            "password": "s3cret",
            "database": "db",
            "secure": True,
            "tz_mode": "aware",
        }
    ]


def test_an_unreachable_server_is_a_warehouse_error_without_the_password() -> None:
    with pytest.raises(WarehouseError, match="cannot open the ClickHouse server") as caught:
        open_warehouse(PlatformSettings(warehouse_url="http://bob:s3cret@127.0.0.1:1/"))
    assert "s3cret" not in str(caught.value)
    assert isinstance(caught.value, InfraError)


def test_query_values_become_json_safe() -> None:
    when = dt.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=dt.UTC)
    values = [
        None, True, 2**64 - 1, 1.5, float("nan"), float("inf"), "s", when, dt.date(2026, 1, 2),
        decimal.Decimal("1.50"), uuid.UUID(int=1), ipaddress.IPv4Address("10.0.0.1"), b"ok", b"\xff",
        (1, "a"), {1: [when]}, dt.timedelta(seconds=90),
    ]  # fmt: skip
    assert [to_json_value(v) for v in values] == [
        None, True, 2**64 - 1, 1.5, None, None, "s", "2026-01-02T03:04:05.678000+00:00", "2026-01-02",
        "1.50", "00000000-0000-0000-0000-000000000001", "10.0.0.1", "ok", "\\xff",
        [1, "a"], {"1": ["2026-01-02T03:04:05.678000+00:00"]}, 90.0,
    ]  # fmt: skip


def test_sql_before_any_warehouse_exists_says_so(settings: PlatformSettings) -> None:
    with pytest.raises(WarehouseError, match="no embedded warehouse"):
        query_warehouse(settings, "SELECT 1")
    assert not warehouse_dir(settings).exists()


@pytest.mark.integration
def test_read_query_is_read_only_bounded_and_aware(warehouse: Client) -> None:
    migrate(warehouse)
    procs.insert_events(warehouse, 2)
    result = read_query(warehouse, "SELECT event_id, time, `offset` FROM events_raw ORDER BY `offset`")
    assert result.columns == ["event_id", "time", "offset"]
    assert result.types == ["String", "DateTime64(3, 'UTC')", "UInt64"]
    assert [row[0] for row in result.rows] == ["e0", "e1"]
    assert dt.datetime.fromisoformat(result.rows[0][1]).utcoffset() == dt.timedelta(0)
    assert not result.truncated

    big = read_query(warehouse, "SELECT number FROM system.numbers LIMIT 100000", max_rows=5)
    assert (big.rows, big.truncated) == ([[0], [1], [2], [3], [4]], True)
    exact = read_query(warehouse, "SELECT number FROM numbers(5)", max_rows=5)
    assert (len(exact.rows), exact.truncated) == (5, False)

    writes = ["INSERT INTO events_raw (event_id) VALUES ('x')", "DROP TABLE events_raw", "SET readonly = 0"]
    for write in writes:
        with pytest.raises(WarehouseQueryError, match="readonly"):
            read_query(warehouse, write)
    with pytest.raises(WarehouseQueryError, match="Syntax error"):
        read_query(warehouse, "SELEC 1")
    assert warehouse.query("SELECT count() FROM events_raw").result_rows == [(2,)]


@pytest.mark.integration
def test_data_persists_across_close_reopen_and_processes(settings: PlatformSettings) -> None:
    client = open_warehouse(settings)
    try:
        migrate(client)
        procs.insert_events(client, 2)
    finally:
        client.close()

    client = open_warehouse(settings)
    try:
        assert client.query("SELECT count() FROM events_raw").result_rows == [(2,)]
        assert migrate(client) == []
    finally:
        client.close()

    # No owner is running, so the other process opens the directory itself.
    (answer,) = procs.run_sql(Path(settings.data_dir), "SELECT count() AS n, any(tenant) FROM events_raw")
    assert answer["ok"]["rows"] == [[2, "acme"]]


@pytest.mark.integration
def test_a_second_process_gets_a_lock_error_naming_the_owner(settings: PlatformSettings) -> None:
    owner = procs.spawn("owner", settings.data_dir)
    try:
        ready = procs.read_line(owner)
        with pytest.raises(WarehouseLockedError) as caught:
            open_warehouse(settings)
        error = caught.value
        assert (error.owner_pid, error.owner_url) == (owner.pid, ready["url"])
        assert error.path == str(warehouse_dir(settings))
        assert f"held by process {owner.pid}" in str(error)
        assert "`sluice sql`" in str(error)
        owner_file = warehouse_dir(settings) / ".owner.json"
        assert stat.S_IMODE(owner_file.stat().st_mode) == 0o600
    finally:
        procs.stop(owner)
    assert owner.returncode == 0
    assert not owner_file.exists()


@pytest.mark.integration
def test_the_lock_error_falls_back_to_chdbs_status_file_for_the_pid(settings: PlatformSettings) -> None:
    owner = procs.spawn("owner", settings.data_dir)
    try:
        procs.read_line(owner)
        os.unlink(warehouse_dir(settings) / ".owner.json")  # an owner that serves no reads
        with pytest.raises(WarehouseLockedError, match=rf"held by process {owner.pid}\. chDB") as caught:
            query_warehouse(settings, "SELECT 1")
        assert caught.value.owner_url is None
    finally:
        procs.stop(owner)
