"""Opening the warehouse, and running one read-only query on it.

Everything goes through ``clickhouse-connect``: an embedded chDB engine under ``<data_dir>/warehouse`` when
``warehouse_url`` is unset, else a ClickHouse server over HTTP(S). Datetimes come back timezone-aware.

chDB allows one process per data directory and one engine (directory) per process; a second process gets
:class:`WarehouseLockedError`, which names the owner. Reads from other processes go through the owner's
query server (see :mod:`infra.warehouse.server`).
"""

from __future__ import annotations

import datetime as dt
import decimal
import fcntl
import ipaddress
import math
import os
import re
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import unquote, urlsplit

import clickhouse_connect
import msgspec
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from infra.warehouse.errors import WarehouseError, WarehouseLockedError, WarehouseQueryError
from infra.warehouse.owner import read_owner, warehouse_dir
from schemas.settings import PlatformSettings

__all__ = [
    "DEFAULT_MAX_ROWS",
    "DEFAULT_QUERY_TIMEOUT_S",
    "Client",
    "JsonValue",
    "QueryResult",
    "ServerAddress",
    "open_warehouse",
    "parse_warehouse_url",
    "read_query",
    "to_json_value",
]

DEFAULT_MAX_ROWS = 10_000
DEFAULT_QUERY_TIMEOUT_S = 60.0

JsonValue: TypeAlias = bool | int | float | str | list["JsonValue"] | dict[str, "JsonValue"] | None


class ServerAddress(msgspec.Struct, frozen=True, kw_only=True):
    """A ClickHouse server, parsed from ``http(s)://[user[:password]@]host[:port][/database]``."""

    host: str
    port: int
    username: str | None = None
    password: str = ""
    database: str | None = None
    secure: bool = False

    def redacted(self) -> str:
        scheme = "https" if self.secure else "http"
        user = f"{self.username}@" if self.username else ""
        return f"{scheme}://{user}{self.host}:{self.port}/{self.database or ''}"


class QueryResult(msgspec.Struct, frozen=True, kw_only=True):
    """A query's answer with JSON-safe values; the same whether it came from the owner or a direct open."""

    columns: list[str]
    types: list[str]
    rows: list[list[Any]]
    """Each value is a :data:`JsonValue` (msgspec cannot decode into the recursive alias itself)."""
    truncated: bool = False
    """More rows existed than the row limit; ``rows`` holds the first ones."""


def parse_warehouse_url(url: str) -> ServerAddress:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise WarehouseError(f"warehouse url {url!r}: expected http://host:8123 or https://host:8443")
    try:
        port = parts.port
    except ValueError:
        raise WarehouseError(f"warehouse url {url!r}: the port is not a number") from None
    if not parts.hostname:
        raise WarehouseError(f"warehouse url {url!r}: no host")
    secure = parts.scheme == "https"
    database = unquote(parts.path.strip("/")) or None
    if database is not None and "/" in database:
        raise WarehouseError(f"warehouse url {url!r}: the path must be a single database name")
    return ServerAddress(
        host=parts.hostname,
        port=port or (8443 if secure else 8123),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else "",
        database=database,
        secure=secure,
    )


def open_warehouse(settings: PlatformSettings) -> Client:
    """A clickhouse-connect client on the configured warehouse; the caller closes it.

    Embedded mode creates ``<data_dir>/warehouse`` if needed and takes chDB's lock on it for this process.
    """
    if settings.warehouse_url is not None:
        return _open_server(parse_warehouse_url(settings.warehouse_url))
    return _open_embedded(settings)


def _open_server(address: ServerAddress) -> Client:
    try:
        return clickhouse_connect.get_client(
            host=address.host,
            port=address.port,
            username=address.username,
            password=address.password,
            database=address.database,
            secure=address.secure,
            tz_mode="aware",
        )
    except ClickHouseError as exc:
        raise WarehouseError(f"cannot open the ClickHouse server at {address.redacted()}: {exc}") from exc


_STATUS_PID = re.compile(r"^PID:\s*(\d+)", re.MULTILINE)


def _open_embedded(settings: PlatformSettings) -> Client:
    path = warehouse_dir(settings)
    path.mkdir(parents=True, exist_ok=True)
    try:
        # path= rather than dsn="chdb://..." so that a directory name with '?', '#' or '%' survives.
        return clickhouse_connect.get_client(interface="chdb", path=str(path), tz_mode="aware")
    except ClickHouseError as exc:
        message = str(exc)
        # chDB prints "Cannot lock file .../status" to stderr but raises only "Error initializing
        # EmbeddedServer", so ask the lock itself.
        if "Cannot lock file" in message or _locked_elsewhere(path / "status"):
            owner = read_owner(settings)
            pid = owner.pid if owner is not None else _status_pid(path)
            raise WarehouseLockedError(str(path), pid, owner.url if owner else None) from exc
        if "already initialized with path" in message:
            raise WarehouseError(
                f"this process already runs a chDB engine on another directory, so it cannot open {path} "
                f"(chDB hosts one engine per process; close every client on the other one first): {message}"
            ) from exc
        raise WarehouseError(f"cannot open the embedded warehouse at {path}: {message}") from exc


def _locked_elsewhere(status_file: Path) -> bool:
    """Whether a chDB engine (in any process) holds the flock on its ``status`` file."""
    try:
        fd = os.open(status_file, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _status_pid(path: Path) -> int | None:
    """The pid chDB wrote into its ``status`` lock file, if it can be read."""
    try:
        match = _STATUS_PID.search((path / "status").read_text())
    except OSError:
        return None
    return int(match.group(1)) if match else None


def read_query(
    client: Client,
    sql: str,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
) -> QueryResult:
    """Run ``sql`` with ClickHouse's ``readonly=1`` (no writes, no DDL, no setting changes).

    At most ``max_rows`` rows come back (``truncated`` says whether there were more); the server stops
    the query after ``timeout_s``. A refusal raises :class:`WarehouseQueryError` with ClickHouse's message.
    """
    if max_rows < 1:
        raise ValueError("max_rows must be at least 1")
    settings: dict[str, Any] = {
        "max_result_rows": max_rows,
        "result_overflow_mode": "break",
        "max_execution_time": max(1, math.ceil(timeout_s)),
        "readonly": 1,  # last: once read-only, no later setting may change
    }
    try:
        result = client.query(sql, settings=settings)
    except ClickHouseError as exc:
        raise WarehouseQueryError(str(exc)) from exc
    rows = result.result_rows
    return QueryResult(
        columns=list(result.column_names),
        types=[column_type.name for column_type in result.column_types],
        rows=[[to_json_value(value) for value in row] for row in rows[:max_rows]],
        truncated=len(rows) > max_rows,
    )


def to_json_value(value: object) -> JsonValue:
    """A value decoded by clickhouse-connect, as JSON can carry it.

    Datetimes and dates become ISO 8601 strings; Decimal, UUID and IP addresses strings (exact); NaN and
    infinities null (as ClickHouse's own JSON formats write them); bytes that are not UTF-8 are escaped.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, uuid.UUID, ipaddress.IPv4Address, ipaddress.IPv6Address)):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", errors="backslashreplace")
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json_value(item) for item in value]
    if isinstance(value, Mapping):
        return {str(key): to_json_value(item) for key, item in value.items()}
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)
