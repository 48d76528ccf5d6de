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
from schemas.settings import PlatformSettings, url_without_password

__all__ = [
    "DEFAULT_MAX_RESULT_BYTES",
    "DEFAULT_MAX_ROWS",
    "DEFAULT_QUERY_TIMEOUT_S",
    "Client",
    "JsonValue",
    "QueryResult",
    "ServerAddress",
    "check_query_text",
    "open_warehouse",
    "parse_warehouse_url",
    "read_query",
    "to_json_value",
]

DEFAULT_MAX_ROWS = 10_000
DEFAULT_QUERY_TIMEOUT_S = 60.0
DEFAULT_MAX_RESULT_BYTES = 64 << 20
"""ClickHouse stops a result at about this size (``max_result_bytes``), whatever the row limit."""
DEFAULT_MAX_QUERY_MEMORY_BYTES = 2 << 30
"""What one read query may hold in memory (``max_memory_usage``; ClickHouse's default is none). Embedded,
the warehouse lives in the streams worker: an audit's ``sluice sql`` grew that process from 0.6 to 4.9 GB
with one ``groupArray``, and a larger one would have had the sink and the controller killed."""

# ClickHouse stops a result at the block that crosses the row limit, and blocks default to 65,536 rows (of
# wide rows: gigabytes, even for one row asked for), so blocks are cut to about the row limit. Not below 1,024 rows: tiny blocks
# make scans crawl (a count() over 50M rows with 2-row blocks ran past a 60 s timeout; 0.4 s with 1,024).
_MIN_BLOCK_ROWS = 1024
_MAX_BLOCK_ROWS = 65_536

_READ_STATEMENTS = frozenset({"SELECT", "WITH", "SHOW", "DESCRIBE", "EXPLAIN", "EXISTS"})
"""What ``read_query`` runs, by the first word of the statement as ClickHouse formats it. ``readonly=1``
alone lets ``USE`` (which would re-point the owner's shared client), ``KILL QUERY``, ``SYSTEM STOP
MERGES`` and ``INTO OUTFILE`` through."""
_INTO_OUTFILE = re.compile(r"\bINTO\s+OUTFILE\b", re.IGNORECASE)
_SETTINGS_ECHO = re.compile(r" SETTINGS (?:\w+ = '[^']*'(?:, )?)+")
"""The limits this module sets, as ClickHouse quotes them back in an error's query: not the caller's."""
_LOCAL_TABLE_FUNCTIONS = frozenset(
    {
        "numbers", "numbers_mt", "zeros", "zeros_mt", "generate_series", "generateSeries", "generateRandom",
        "values", "view", "merge", "null", "loop", "format", "dictionary",
    }
)  # fmt: skip
"""The table functions a read may call: they read the warehouse's own tables or make rows up."""
_OUTSIDE_ALWAYS = frozenset({"file", "url", "s3", "remote", "remoteSecure", "sqlite", "executable", "input"})
"""Refused even where ``system.table_functions`` cannot be read (``file`` is a plain function too)."""
_outside: re.Pattern[str] | None = None


def _outside_pattern(client: Client, settings: dict[str, Any]) -> re.Pattern[str]:
    """A call of any table function but :data:`_LOCAL_TABLE_FUNCTIONS`, from the engine's own list (read
    once a process): files, URLs, object stores, lakes, other databases and servers, programs, and any
    such this build adds. ``readonly=1`` refuses them in a SELECT, but a DESCRIBE still opened what they
    named (an audit: a local file's first line came back in the error, a URL was fetched, one that never
    answered held the query for minutes), and ``sqlite()`` created its file before the refusal. A deny
    list by name missed the build's other names for some (``oss``, ``cosn``, ``paimon``...)."""
    global _outside
    if _outside is not None:
        return _outside
    try:
        listed = client.query("SELECT name FROM system.table_functions", settings=settings).result_rows
    except ClickHouseError:  # refuse the usual ones this time; the engine's list is read again next time
        return _calls_of(_OUTSIDE_ALWAYS)
    _outside = _calls_of({str(row[0]) for row in listed} | _OUTSIDE_ALWAYS)
    return _outside


def _calls_of(names: set[str] | frozenset[str]) -> re.Pattern[str]:
    """A call of any of ``names`` but the local table functions."""
    refused = sorted(names - _LOCAL_TABLE_FUNCTIONS, key=len, reverse=True)
    return re.compile(r"\b(" + "|".join(map(re.escape, refused)) + r")\s*\(", re.IGNORECASE)


_ONE_STATEMENT = (
    "one statement at a time: a read-only query is a single statement (remove the ';' and what follows)"
)

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
    """Rows may be missing at the end: more rows existed than the row limit, or the result reached the size
    limit (``size_limited``); ``rows`` holds the first ones."""
    row_limit: int | None = None
    """The row limit applied, which may be lower than the one asked for (a query server caps it); None
    from an owner that predates this field."""
    size_limited: bool = False
    """The result reached the byte limit (:data:`DEFAULT_MAX_RESULT_BYTES`), so it may have been cut before
    the row limit."""


def parse_warehouse_url(url: str) -> ServerAddress:
    """``url`` (``SLUICE_WAREHOUSE_URL``) as a server address; :class:`WarehouseError` says what is wrong
    with it, quoting it without its password (:func:`~schemas.settings.url_without_password`)."""
    try:
        parts = urlsplit(url)
    except ValueError:  # its message may quote the netloc, password and all
        raise WarehouseError(
            "warehouse url: not a valid URL (expected http://host:8123 or https://host:8443)"
        ) from None
    shown = url_without_password(url)
    if parts.scheme not in ("http", "https"):
        raise WarehouseError(f"warehouse url {shown!r}: expected http://host:8123 or https://host:8443")
    try:
        port = parts.port
    except ValueError:
        raise WarehouseError(f"warehouse url {shown!r}: the port is not a number") from None
    if not parts.hostname:
        raise WarehouseError(f"warehouse url {shown!r}: no host")
    secure = parts.scheme == "https"
    database = unquote(parts.path.strip("/")) or None
    if database is not None and "/" in database:
        raise WarehouseError(f"warehouse url {shown!r}: the path must be a single database name")
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
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file in the way, a missing or read-only parent ...
        raise WarehouseError(
            f"cannot create the embedded warehouse directory {path}: {exc.strerror or exc} "
            f"(SLUICE_DATA_DIR or --data-dir must name a directory this user can write)"
        ) from exc
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


def check_warehouse_free(settings: PlatformSettings) -> None:
    """:class:`WarehouseLockedError` naming the owner when another process holds the embedded warehouse
    (a ClickHouse server, ``SLUICE_WAREHOUSE_URL``, is never held): asked before a start that would open
    it, rather than have its opener fail on chDB's lock and be restarted for minutes (a review)."""
    if settings.warehouse_url is not None:
        return
    path = warehouse_dir(settings)
    if _locked_elsewhere(path / "status"):
        owner = read_owner(settings)
        pid = owner.pid if owner is not None else _status_pid(path)
        raise WarehouseLockedError(str(path), pid, owner.url if owner else None)


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


def check_query_text(sql: str) -> None:
    """Refuse, before any engine sees it, a query that is empty or not UTF-8 text (:class:`WarehouseQueryError`)."""
    try:
        sql.encode("utf-8")
    except UnicodeEncodeError:
        raise WarehouseQueryError("the query is not valid UTF-8 text") from None
    if not sql.strip():
        raise WarehouseQueryError(
            "the query is empty: give one SELECT (or SHOW, DESCRIBE, EXPLAIN) statement"
        )


_STRINGS_AS_BYTES = {"String": "bytes", "FixedString": "bytes"}


def read_query(
    client: Client,
    sql: str,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
    max_result_bytes: int = DEFAULT_MAX_RESULT_BYTES,
    max_memory_bytes: int = DEFAULT_MAX_QUERY_MEMORY_BYTES,
) -> QueryResult:
    """Run one read statement of ``sql`` with ClickHouse's ``readonly=1`` (no writes, no DDL, no setting
    changes).

    ClickHouse's own parser (``formatQuerySingleLine``) first reads ``sql`` as exactly one statement; what
    runs is its formatted text, which must be a SELECT, WITH, SHOW, DESCRIBE, EXPLAIN or EXISTS statement
    without INTO OUTFILE (which writes a file even in read-only mode). Anything else, several statements,
    an empty query, or one ClickHouse refuses raises :class:`WarehouseQueryError`.

    At most ``max_rows`` rows come back (``truncated`` says whether there were more); ClickHouse also stops
    after the block that crosses ``max_result_bytes`` (``size_limited``), and the query after ``timeout_s``
    or once it holds ``max_memory_bytes``.
    """
    if max_rows < 1:
        raise ValueError("max_rows must be at least 1")
    if max_result_bytes < 1:
        raise ValueError("max_result_bytes must be at least 1")
    check_query_text(sql)
    settings: dict[str, Any] = {
        "max_result_rows": max_rows,
        "max_result_bytes": max_result_bytes,
        "result_overflow_mode": "break",
        "max_block_size": min(_MAX_BLOCK_ROWS, max(_MIN_BLOCK_ROWS, max_rows + 1)),
        "max_execution_time": max(1, math.ceil(timeout_s)),
        "max_memory_usage": max_memory_bytes,
        "readonly": 1,  # last: once read-only, no later setting may change
    }
    statement = _read_statement(client, sql, settings)
    try:
        # Strings as bytes: clickhouse-connect turns one that is not UTF-8 into its hex digits, which
        # read the same as text ('41ff'); as bytes it is escaped (a review)
        result = client.query(statement, settings=settings, query_formats=_STRINGS_AS_BYTES)
        rows = result.result_rows  # decoding can fail too (a stream error): inside the try
        columns = list(result.column_names)
        types = [column_type.name for column_type in result.column_types]
    except ClickHouseError as exc:
        raise WarehouseQueryError(_SETTINGS_ECHO.sub("", str(exc))) from exc
    if not columns:  # chDB sends nothing at all for an empty result, not even the header
        columns, types = _describe(client, statement, settings)
    values = [[to_json_value(value) for value in row] for row in rows[:max_rows]]
    more_rows = len(rows) > max_rows
    # ClickHouse keeps the block that crossed the byte limit, so a cut result is at least that big (its JSON
    # is a close enough measure; a result that just reaches it is reported as possibly cut).
    size_limited = not more_rows and bool(values) and len(msgspec.json.encode(values)) >= max_result_bytes
    return QueryResult(
        columns=columns,
        types=types,
        rows=values,
        truncated=more_rows or size_limited,
        row_limit=max_rows,
        size_limited=size_limited,
    )


def _read_statement(client: Client, sql: str, settings: dict[str, Any]) -> str:
    """``sql`` as ClickHouse's parser formats it (one line, no comments), once it is a single read statement.

    The formatted text is what runs, so what is checked here is exactly what executes: nothing can hide
    after a ';', in a comment, or behind the SETTINGS clause the client appends.
    """
    try:
        result = client.query(
            "SELECT formatQuerySingleLine({sql:String})", parameters={"sql": sql}, settings=settings
        )
        statement = str(result.result_rows[0][0])
    except ClickHouseError as exc:
        message = _parser_message(str(exc))
        if "Multi-statements are not allowed" in message:
            raise WarehouseQueryError(_ONE_STATEMENT) from exc
        raise WarehouseQueryError(message) from exc
    bare = _unquoted(statement)
    if bare is None or ";" in bare:  # neither comes out of the formatter; refuse rather than guess
        raise WarehouseQueryError(_ONE_STATEMENT)
    if _INTO_OUTFILE.search(bare):
        raise WarehouseQueryError(
            "INTO OUTFILE is refused: queries here only read (for a file, redirect the output of "
            "`sluice sql --format csv` or `--format json`)"
        )
    if outside := _outside_pattern(client, settings).search(bare):
        raise WarehouseQueryError(
            f"{outside.group(1)}() is refused: queries here read the warehouse's own tables, not files, URLs "
            "or other databases"
        )
    first = _first_word(bare)
    if first not in _READ_STATEMENTS:
        raise WarehouseQueryError(
            f"{first or 'such'} statements are refused: read-only queries are SELECT, WITH, SHOW, DESCRIBE, "
            "EXPLAIN or EXISTS statements"
        )
    return statement


def _unquoted(text: str) -> str | None:
    """``text`` with every quoted part ('string', `identifier`, "identifier") blanked out; None when a
    quote is left open."""
    kept: list[str] = []
    quote: str | None = None
    index = 0
    while index < len(text):
        char = text[index]
        if quote is None:
            if char in "'`\"":
                quote = char
                kept.append(" ")
            else:
                kept.append(char)
        elif char == "\\":
            index += 1  # the escaped character, whatever it is
        elif char == quote:
            if text[index + 1 : index + 2] == quote:
                index += 1  # a doubled quote stands for itself
            else:
                quote = None
                kept.append(" ")
        index += 1
    return None if quote is not None else "".join(kept)


_FIRST_WORD = re.compile(r"[\s(]*([A-Za-z]*)")


def _first_word(bare: str) -> str:
    match = _FIRST_WORD.match(bare)
    return match.group(1).upper() if match else ""


_IN_SCOPE = " In scope SELECT formatQuerySingleLine("
_ERROR_CODE = re.compile(r"(\([A-Z][A-Z0-9_]+\))[^()]*(?:\(version [^)]*\))?[.\s]*$")


def _parser_message(message: str) -> str:
    """ClickHouse's refusal of the format call, without the call itself (it quotes the whole query)."""
    cut = message.find(_IN_SCOPE)
    if cut < 0:
        return message
    code = _ERROR_CODE.search(message[cut:])
    return message[:cut].rstrip(" :.") + (f". {code.group(1)}" if code else "")


def _describe(client: Client, statement: str, settings: dict[str, Any]) -> tuple[list[str], list[str]]:
    """The columns a SELECT would have had, for a result without rows; none for other statements."""
    bare = _unquoted(statement)
    if bare is None or _first_word(bare) not in ("SELECT", "WITH"):
        return [], []
    try:
        described = client.query(f"DESCRIBE TABLE ({statement})", settings=settings).result_rows
    except ClickHouseError:
        return [], []
    return [str(row[0]) for row in described], [str(row[1]) for row in described]


def _text(value: bytes | bytearray) -> str:
    """Bytes as text, what is not UTF-8 escaped."""
    return bytes(value).decode("utf-8", errors="backslashreplace")


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
        return _text(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        return [to_json_value(item) for item in value]
    if isinstance(value, Mapping):
        return {
            _text(key) if isinstance(key, (bytes, bytearray)) else str(key): to_json_value(item)
            for key, item in value.items()
        }
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    return str(value)
