"""Opening the warehouse: server URLs (pure), embedded chDB persistence and its one-process lock."""

from __future__ import annotations

import datetime as dt
import decimal
import ipaddress
import os
import re
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
from infra.warehouse.client import Client, check_query_text, to_json_value
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


@pytest.mark.parametrize(
    ("url", "problem", "shown"),
    [
        ("http://default:hunter2secret@ch:abc", "port", "'http://default:[REDACTED]@ch:abc'"),
        ("clickhouse://u:hunter2secret@ch:8123", "expected http", "'clickhouse://u:[REDACTED]@ch:8123'"),
        ("//u:hunter2secret@ch:8123", "expected http", "'//u:[REDACTED]@ch:8123'"),
        ("http://u:hunter2secret@:8123", "no host", "'http://u:[REDACTED]@:8123'"),
        ("http://u:hunter2secret@ch/a/b", "single", "'http://u:[REDACTED]@ch/a/b'"),
        ("http://u:pw@hunter2secret@ch:x", "port", "'http://u:[REDACTED]@ch:x'"),  # '@' in the password
        ("http://u:hunter2secret@[ch:8123", "not a valid URL", "warehouse url:"),  # urlsplit refuses it
        # unencoded '#', '/', '?' in the password cut the parser's host part short: it printed the rest
        ("http://u:hunter#2secret@ch:8123/db", "port", "'http://u:[REDACTED]@ch:8123/db'"),
        ("http://u:hunter/2secret@ch:8123", "port", "'http://u:[REDACTED]@ch:8123'"),
        ("http://u:hun?ter2secret@ch:8123", "port", "'http://u:[REDACTED]@ch:8123'"),
    ],
)
def test_a_bad_server_url_is_quoted_without_its_password(url: str, problem: str, shown: str) -> None:
    """Found by a review: every one of these errors quoted the whole ``SLUICE_WAREHOUSE_URL``, password
    and all, and ``sluice streams`` / ``sluice sql`` print them."""
    with pytest.raises(WarehouseError, match=re.escape(problem)) as caught:
        parse_warehouse_url(url)
    assert "hunter2secret" not in str(caught.value)
    assert shown in str(caught.value)


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
def test_read_query_shows_a_string_that_is_not_utf8_escaped_not_as_hex(warehouse: Client) -> None:
    """Found by a review: clickhouse-connect gave a String that is not UTF-8 as its hex digits, which read
    the same as text: ``unhex('41ff')`` and ``'41ff'`` printed alike."""
    result = read_query(
        warehouse,
        "SELECT unhex('41ff') AS binary, '41ff' AS text, 'héllo' AS u, map('k', unhex('ff')) AS m, "
        "[unhex('ff'), 'ok'] AS a, toFixedString('ab', 2) AS f",
    )
    assert result.rows == [["A\\xff", "41ff", "héllo", {"k": "\\xff"}, ["\\xff", "ok"], "ab"]]


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
    # an error quotes the query, without the limits this module appended to it
    with pytest.raises(WarehouseQueryError) as unknown:
        read_query(warehouse, "SELECT * FROM nosuch")
    assert "nosuch" in str(unknown.value)
    assert "SETTINGS" not in str(unknown.value)
    assert "readonly" not in str(unknown.value)
    # one query's memory is bounded (embedded, it lives in the streams worker): an audit's groupArray of
    # 150 M numbers grew that process by 4.3 GB
    assert read_query(warehouse, "SELECT getSetting('max_memory_usage') AS m").rows == [[2 << 30]]
    with pytest.raises(WarehouseQueryError, match=r"MEMORY_LIMIT_EXCEEDED|memory limit"):
        read_query(
            warehouse, "SELECT length(groupArray(number)) FROM numbers(10000000)", max_memory_bytes=32 << 20
        )

    writes = [
        "INSERT INTO events_raw (event_id) VALUES ('x')",
        "DROP TABLE events_raw",
        "SET readonly = 0",
        "SELECT 1 SETTINGS readonly = 0",
    ]
    for write in writes:
        with pytest.raises(WarehouseQueryError, match=r"readonly|statements are refused"):
            read_query(warehouse, write)
    with pytest.raises(WarehouseQueryError, match="Syntax error"):
        read_query(warehouse, "SELEC 1")
    assert warehouse.query("SELECT count() FROM events_raw").result_rows == [(2,)]


@pytest.mark.parametrize("sql", ["", "  \n\t", "SELECT '\udcff'"], ids=["empty", "blank", "not-utf8"])
def test_an_empty_or_undecodable_query_is_refused_before_any_engine(
    settings: PlatformSettings, sql: str
) -> None:
    with pytest.raises(WarehouseQueryError, match=r"empty|UTF-8"):
        check_query_text(sql)
    with pytest.raises(WarehouseQueryError, match=r"empty|UTF-8"):
        query_warehouse(settings, sql)  # not "there is no embedded warehouse": the engine is never asked
    assert not warehouse_dir(settings).exists()


@pytest.mark.parametrize("kind", ["file", "under-a-file"])
def test_a_data_dir_that_cannot_hold_the_warehouse_is_a_warehouse_error(tmp_path: Path, kind: str) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    data_dir = blocker if kind == "file" else blocker / "deeper"
    with pytest.raises(WarehouseError, match="cannot create the embedded warehouse directory"):
        open_warehouse(PlatformSettings(data_dir=str(data_dir)))


@pytest.mark.integration
def test_into_outfile_is_refused_and_writes_nothing(warehouse: Client, tmp_path: Path) -> None:
    victim = tmp_path / "victim.sql"
    victim.write_text("precious")
    fresh = tmp_path / "fresh.bin"
    attempts = [
        f"SELECT 1 INTO OUTFILE '{victim}' TRUNCATE",
        f"select 1 into   outfile '{victim}' truncate",
        f"SELECT 1 INTO /* hidden */ OUTFILE '{victim}' TRUNCATE",
        f"SELECT 1 INTO -- hidden\n OUTFILE '{fresh}'",
        f"WITH 2 AS x SELECT x INTO OUTFILE '{fresh}' AND STDOUT FORMAT CSV",
        f"SELECT 'a\\' INTO OUTFILE' AS s INTO OUTFILE '{fresh}'",
        f"SELECT 1; SELECT 2 INTO OUTFILE '{fresh}'",
    ]
    for sql in attempts:
        with pytest.raises(WarehouseQueryError, match=r"INTO OUTFILE is refused|one statement at a time"):
            read_query(warehouse, sql)
    assert victim.read_text() == "precious"
    assert not fresh.exists()
    # The words inside a string, or an alias named outfile, are no file.
    quoted = read_query(warehouse, "SELECT 'x INTO OUTFILE y' AS outfile")
    assert (quoted.columns, quoted.rows) == (["outfile"], [["x INTO OUTFILE y"]])


@pytest.mark.integration
def test_functions_that_reach_past_the_warehouse_are_refused_and_touch_nothing(
    warehouse: Client, tmp_path: Path
) -> None:
    """Found by an audit: ``readonly=1`` refuses these in a SELECT, but a DESCRIBE opened what they named
    (a local file's first line came back in the error; a URL was fetched) and sqlite() created its file
    before the refusal."""
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:precious\n")
    created = tmp_path / "created.db"
    attempts = [
        f"DESCRIBE file('{secret}', 'Values')",
        f"DESCRIBE TABLE file('{secret}', 'CSVWithNames')",
        f"SELECT * FROM sqlite('{created}', 't')",
        "DESCRIBE url('http://127.0.0.1:9/data.csv', 'CSVWithNames')",
        "SELECT * FROM s3 ('http://127.0.0.1:9/bucket/x.csv', 'CSV')",
        f"SELECT file('{secret}')",
        f"WITH x AS (SELECT * FROM FILE('{secret}', 'LineAsString')) SELECT * FROM x",
        "SELECT * FROM executable('cat /etc/passwd', 'TSV', 'line String')",
        "SELECT * FROM remote('127.0.0.1:9', system.one)",
        "DESCRIBE oss('http://127.0.0.1:9/bucket/x.csv', 'CSV')",  # another name of s3() in this build
        f"SELECT * FROM filesystem('{tmp_path}')",
    ]
    for sql in attempts:
        with pytest.raises(WarehouseQueryError, match=r"\(\) is refused") as refused:
            read_query(warehouse, sql)
        assert "precious" not in str(refused.value)
    assert not created.exists()
    # the names as words, in strings, or as columns are no call
    fine = read_query(warehouse, "SELECT 'file(x)' AS url, 1 AS file")
    assert (fine.columns, fine.rows) == (["url", "file"], [["file(x)", 1]])
    made_up = read_query(warehouse, "SELECT sum(number) AS n FROM numbers(4)")  # rows made up: fine
    assert made_up.rows == [[6]]


@pytest.mark.integration
def test_read_query_runs_exactly_one_read_statement(warehouse: Client) -> None:
    for sql in ("SELECT 1 AS a; SELECT 'x' AS b", "SELECT 1;;SELECT 2", "SHOW TABLES; SELECT 1"):
        with pytest.raises(WarehouseQueryError, match="one statement at a time"):
            read_query(warehouse, sql)
    # readonly=1 lets these through; USE would re-point the owner's shared client for every later reader.
    for sql, word in (
        ("USE system", "USE"),
        ("KILL QUERY WHERE 1", "KILL"),
        ("SYSTEM STOP MERGES", "SYSTEM"),
    ):
        with pytest.raises(WarehouseQueryError, match=f"{word} statements are refused"):
            read_query(warehouse, sql)
    assert warehouse.query("SELECT currentDatabase()").result_rows == [("default",)]
    for sql in ("SELECT 1 AS a;", "-- a comment\nSELECT 1 AS a -- another", "(SELECT 1 AS a)"):
        assert read_query(warehouse, sql).rows == [[1]]
    assert read_query(warehouse, "EXPLAIN SELECT 1").rows
    with pytest.raises(WarehouseQueryError, match="Syntax error") as caught:
        read_query(warehouse, "SELEC 1")
    assert "formatQuerySingleLine" not in str(caught.value)


@pytest.mark.integration
def test_an_empty_result_keeps_its_columns(warehouse: Client) -> None:
    empty = read_query(warehouse, "SELECT 1 AS a, 'x' AS b WHERE 0")
    assert (empty.columns, empty.types, empty.rows, empty.truncated) == (
        ["a", "b"],
        ["UInt8", "String"],
        [],
        False,
    )


@pytest.mark.integration
def test_the_row_and_size_limits_bound_what_the_engine_sends(warehouse: Client) -> None:
    # ClickHouse stops at the block that crosses the row limit; blocks of 65,536 wide rows cost gigabytes.
    small = read_query(warehouse, "SELECT blockSize() AS rows_in_block FROM numbers(1000000)", max_rows=5)
    assert (len(small.rows), small.truncated, small.row_limit) == (5, True, 5)
    assert small.rows[0][0] <= 1024
    # And at about max_result_bytes whatever the row limit, saying it may have cut.
    wide = read_query(
        warehouse,
        "SELECT repeat(toString(number % 10), 10) FROM numbers(400000)",
        max_rows=1_000_000,
        max_result_bytes=1 << 16,
    )
    assert len(wide.rows) < 400_000
    assert (wide.size_limited, wide.truncated) == (True, True)
    whole = read_query(warehouse, "SELECT number FROM numbers(10)", max_result_bytes=1 << 16)
    assert (len(whole.rows), whole.size_limited, whole.truncated) == (10, False, False)


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
