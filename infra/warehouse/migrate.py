"""Versioned DDL migrations for the warehouse.

A migration is a file ``NNNN_name.sql`` in :data:`MIGRATIONS_DIR`: ClickHouse statements, each ending with a
``;`` at the end of a line (so one statement may span many lines; ``--`` comments are fine). Migrations are
applied in version order and recorded in ``schema_migrations`` (version, name, sha256 checksum, applied_at),
so running :func:`migrate` again applies nothing. An applied migration is immutable: editing its file raises
:class:`MigrationChecksumError`; put the change in a new migration.

ClickHouse DDL is not transactional. A migration that fails half-way is not recorded and is re-run from its
first statement next time, so write every statement to be repeatable (``CREATE TABLE IF NOT EXISTS``,
``ALTER TABLE ... ADD COLUMN IF NOT EXISTS``).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import msgspec
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import ClickHouseError

from infra.warehouse.errors import MigrationChecksumError, MigrationError

__all__ = [
    "MIGRATIONS_DIR",
    "MIGRATIONS_TABLE",
    "AppliedMigration",
    "Migration",
    "MigrationStatus",
    "load_migrations",
    "migrate",
    "split_statements",
    "status",
]

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
MIGRATIONS_TABLE = "schema_migrations"

_FILE_NAME = re.compile(r"^(\d{4})_([a-z0-9][a-z0-9_]*)\.sql$")

_CREATE_TABLE = f"""
CREATE TABLE IF NOT EXISTS {MIGRATIONS_TABLE}
(
    version    UInt32,
    name       String,
    checksum   String,
    applied_at DateTime64(3, 'UTC')
)
ENGINE = ReplacingMergeTree
ORDER BY version
"""

# Server-side parameters: the same on chDB and a server, and (unlike chDB's first file-based insert) fast.
_RECORD = (
    f"INSERT INTO {MIGRATIONS_TABLE} (version, name, checksum, applied_at) "  # noqa: S608
    "VALUES ({version:UInt32}, {name:String}, {checksum:String}, {applied_at:DateTime64(3, 'UTC')})"
)


class Migration(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    name: str
    checksum: str
    """sha256 of the file's bytes, hex."""
    statements: tuple[str, ...]


class AppliedMigration(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    name: str
    checksum: str
    applied_at: dt.datetime


class MigrationStatus(msgspec.Struct, frozen=True, kw_only=True):
    version: int
    name: str
    state: Literal["applied", "pending", "changed", "unknown"]
    """``changed``: applied, but the file differs since; ``unknown``: applied, but no such file here (the
    warehouse was migrated by newer code)."""
    checksum: str
    applied_at: dt.datetime | None = None


def split_statements(sql: str) -> list[str]:
    """Statements of a migration file: each ends with ``;`` at the end of a (non-comment) line."""
    statements: list[str] = []
    current: list[str] = []
    for line in sql.splitlines():
        current.append(line)
        stripped = line.strip()
        if stripped.endswith(";") and not stripped.startswith("--"):
            statements.append("\n".join(current).rstrip().removesuffix(";"))
            current = []
    statements.append("\n".join(current))
    return [statement.strip() for statement in statements if _has_code(statement)]


def _has_code(statement: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in statement.splitlines())


def load_migrations(directory: Path = MIGRATIONS_DIR) -> list[Migration]:
    """The migrations in ``directory``, by version; a stray ``.sql`` name or a duplicate version raises."""
    migrations: dict[int, Migration] = {}
    for path in sorted(directory.glob("*.sql")):
        match = _FILE_NAME.match(path.name)
        if match is None:
            raise MigrationError(f"{path}: migration files are named NNNN_name.sql (lower case, digits, _)")
        version = int(match.group(1))
        if version in migrations:
            raise MigrationError(f"{path}: version {version:04d} is used by {migrations[version].name} too")
        raw = path.read_bytes()
        statements = tuple(split_statements(raw.decode("utf-8")))
        if not statements:
            raise MigrationError(f"{path}: no statements")
        migrations[version] = Migration(
            version=version,
            name=match.group(2),
            checksum=hashlib.sha256(raw).hexdigest(),
            statements=statements,
        )
    return [migrations[version] for version in sorted(migrations)]


def migrate(
    client: Client,
    progress: Callable[[str], None] | None = None,
    *,
    directory: Path = MIGRATIONS_DIR,
) -> list[AppliedMigration]:
    """Apply the pending migrations in order; return those applied by this call (empty when up to date).

    ``progress`` is called with ``NNNN_name`` before each migration is applied.

    Every applied migration's checksum is verified first, so nothing runs on a warehouse whose history
    disagrees with the files.
    """
    migrations = load_migrations(directory)
    _run(client, _CREATE_TABLE, f"creating {MIGRATIONS_TABLE}")
    applied = _applied(client)
    known = {migration.version for migration in migrations}
    unknown = sorted(set(applied) - known)
    if unknown:
        raise MigrationError(
            f"the warehouse has migrations {', '.join(f'{v:04d}' for v in unknown)} applied that are not "
            f"in {directory}: it was migrated by newer code"
        )
    for migration in migrations:
        record = applied.get(migration.version)
        if record is not None and record.checksum != migration.checksum:
            raise MigrationChecksumError(migration.version, record.name, record.checksum, migration.checksum)

    done: list[AppliedMigration] = []
    for migration in migrations:
        if migration.version in applied:
            continue
        label = f"{migration.version:04d}_{migration.name}"
        if progress is not None:
            progress(label)
        for index, statement in enumerate(migration.statements, start=1):
            _run(client, statement, f"migration {label}, statement {index}")
        record = AppliedMigration(
            version=migration.version,
            name=migration.name,
            checksum=migration.checksum,
            applied_at=_now_ms(),
        )
        try:
            client.command(_RECORD, parameters=msgspec.structs.asdict(record))
        except ClickHouseError as exc:
            raise MigrationError(f"migration {label} ran but could not be recorded: {exc}") from exc
        done.append(record)
    return done


def status(client: Client, *, directory: Path = MIGRATIONS_DIR) -> list[MigrationStatus]:
    """Every migration, applied or pending, by version; reads only (creates no table)."""
    migrations = load_migrations(directory)
    exists = client.query(f"EXISTS TABLE {MIGRATIONS_TABLE}").result_rows[0][0]
    applied = _applied(client) if exists else {}
    rows: list[MigrationStatus] = []
    for migration in migrations:
        record = applied.pop(migration.version, None)
        if record is None:
            rows.append(
                MigrationStatus(
                    version=migration.version,
                    name=migration.name,
                    state="pending",
                    checksum=migration.checksum,
                )
            )
        else:
            rows.append(
                MigrationStatus(
                    version=record.version,
                    name=record.name,
                    state="applied" if record.checksum == migration.checksum else "changed",
                    checksum=record.checksum,
                    applied_at=record.applied_at,
                )
            )
    rows.extend(
        MigrationStatus(
            version=record.version,
            name=record.name,
            state="unknown",
            checksum=record.checksum,
            applied_at=record.applied_at,
        )
        for record in applied.values()
    )
    return sorted(rows, key=lambda row: row.version)


def _applied(client: Client) -> dict[int, AppliedMigration]:
    result = client.query(
        f"SELECT version, name, checksum, applied_at FROM {MIGRATIONS_TABLE} FINAL ORDER BY version"  # noqa: S608
    )
    return {
        int(version): AppliedMigration(
            version=int(version), name=name, checksum=checksum, applied_at=applied_at
        )
        for version, name, checksum, applied_at in result.result_rows
    }


def _now_ms() -> dt.datetime:
    """Now, at the millisecond precision ``applied_at`` is stored with."""
    now = dt.datetime.now(dt.UTC)
    return now.replace(microsecond=now.microsecond // 1000 * 1000)


def _run(client: Client, statement: str, what: str) -> None:
    try:
        client.command(statement)
    except ClickHouseError as exc:
        raise MigrationError(f"{what} failed: {exc}") from exc
