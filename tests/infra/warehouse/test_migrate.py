"""Migrations: file parsing (pure), and applying them to a real embedded warehouse (integration)."""

from __future__ import annotations

from pathlib import Path

import pytest

from infra.warehouse import MigrationChecksumError, MigrationError, migrate, status
from infra.warehouse.client import Client
from infra.warehouse.migrate import MIGRATIONS_DIR, load_migrations, split_statements

CREATE_A = "CREATE TABLE IF NOT EXISTS a (x UInt8) ENGINE = MergeTree ORDER BY x"


def write(directory: Path, name: str, sql: str) -> Path:
    path = directory / name
    path.write_text(sql)
    return path


def test_statements_end_with_a_semicolon_at_the_end_of_a_line() -> None:
    sql = """-- a comment; with a semicolon
CREATE TABLE a
(
    x UInt8 DEFAULT ';'
) ENGINE = Memory;

-- only a comment;
CREATE TABLE b (x UInt8) ENGINE = Memory;
SELECT 1"""
    assert split_statements(sql) == [
        "-- a comment; with a semicolon\nCREATE TABLE a\n(\n    x UInt8 DEFAULT ';'\n) ENGINE = Memory",
        "-- only a comment;\nCREATE TABLE b (x UInt8) ENGINE = Memory",
        "SELECT 1",
    ]
    assert split_statements("-- nothing here;\n\n") == []


def test_shipped_migrations_load_in_order() -> None:
    migrations = load_migrations()
    assert [m.version for m in migrations] == sorted({m.version for m in migrations})
    assert (migrations[0].version, migrations[0].name) == (1, "events_raw")
    assert all(len(m.checksum) == 64 for m in migrations)
    assert MIGRATIONS_DIR.is_dir()


@pytest.mark.parametrize("name", ["1_short.sql", "0001-dash.sql", "0001_Upper.sql", "notes.sql"])
def test_a_misnamed_migration_is_refused(tmp_path: Path, name: str) -> None:
    write(tmp_path, name, "SELECT 1;")
    with pytest.raises(MigrationError, match=r"NNNN_name\.sql"):
        load_migrations(tmp_path)


def test_duplicate_versions_and_empty_files_are_refused(tmp_path: Path) -> None:
    write(tmp_path, "0001_a.sql", "SELECT 1;")
    write(tmp_path, "0001_b.sql", "SELECT 1;")
    with pytest.raises(MigrationError, match="version 0001"):
        load_migrations(tmp_path)
    (tmp_path / "0001_b.sql").unlink()
    write(tmp_path, "0002_empty.sql", "-- nothing yet\n")
    with pytest.raises(MigrationError, match="no statements"):
        load_migrations(tmp_path)


@pytest.mark.integration
def test_shipped_migrations_create_events_raw(warehouse: Client) -> None:
    progress: list[str] = []
    applied = migrate(warehouse, progress.append)
    assert [m.version for m in applied] == [m.version for m in load_migrations()]
    assert progress[0] == "0001_events_raw"
    columns = {row[0]: row[1] for row in warehouse.query("DESCRIBE TABLE events_raw").result_rows}
    assert columns["time"] == "DateTime64(3, 'UTC')"
    assert columns["type"] == "LowCardinality(String)"
    assert (columns["partition"], columns["offset"]) == ("UInt32", "UInt64")
    engine, sorting_key, partition_key = warehouse.query(
        "SELECT engine, sorting_key, partition_key FROM system.tables "
        "WHERE database = currentDatabase() AND name = 'events_raw'"
    ).result_rows[0]
    assert engine == "ReplacingMergeTree"
    assert sorting_key == "tenant, type, time, event_id"
    assert partition_key == "toYYYYMM(time)"

    assert migrate(warehouse) == []  # idempotent
    assert [s.state for s in status(warehouse)] == ["applied"] * len(applied)


@pytest.mark.integration
def test_migrations_apply_in_order_once_and_are_immutable(warehouse: Client, tmp_path: Path) -> None:
    migrations = tmp_path / "migrations"
    migrations.mkdir()
    write(migrations, "0002_b.sql", "ALTER TABLE a ADD COLUMN IF NOT EXISTS y String;\n")
    first = write(migrations, "0001_a.sql", f"{CREATE_A};\n")
    assert [s.state for s in status(warehouse, directory=migrations)] == ["pending", "pending"]

    applied = migrate(warehouse, directory=migrations)
    assert [(m.version, m.name) for m in applied] == [(1, "a"), (2, "b")]
    assert applied[0].applied_at.tzinfo is not None
    recorded = warehouse.query("SELECT version, name, checksum FROM schema_migrations ORDER BY version")
    assert recorded.result_rows == [(m.version, m.name, m.checksum) for m in applied]

    assert migrate(warehouse, directory=migrations) == []
    write(migrations, "0003_c.sql", "CREATE TABLE IF NOT EXISTS c (x UInt8) ENGINE = MergeTree ORDER BY x;\n")
    assert [m.version for m in migrate(warehouse, directory=migrations)] == [3]
    assert warehouse.query("SELECT count() FROM schema_migrations").result_rows == [(3,)]
    rows = status(warehouse, directory=migrations)
    assert [(s.version, s.state) for s in rows] == [(1, "applied"), (2, "applied"), (3, "applied")]
    assert rows[0].applied_at == applied[0].applied_at

    first.write_text(first.read_text() + "-- edited\n")
    with pytest.raises(MigrationChecksumError, match="0001_a was applied with checksum") as caught:
        migrate(warehouse, directory=migrations)
    assert caught.value.version == 1
    assert status(warehouse, directory=migrations)[0].state == "changed"

    (migrations / "0003_c.sql").unlink()
    first.write_text(first.read_text().replace("-- edited\n", ""))
    with pytest.raises(MigrationError, match="0003 applied that are not"):
        migrate(warehouse, directory=migrations)
    assert [s.state for s in status(warehouse, directory=migrations)] == ["applied", "applied", "unknown"]


@pytest.mark.integration
def test_a_failed_migration_is_not_recorded_and_names_its_statement(
    warehouse: Client, tmp_path: Path
) -> None:
    write(tmp_path, "0001_ok.sql", f"{CREATE_A};\n")
    write(
        tmp_path, "0002_bad.sql", "CREATE TABLE IF NOT EXISTS b (x UInt8) ENGINE = Memory;\nCREATE TABL x;\n"
    )
    with pytest.raises(MigrationError, match=r"0002_bad, statement 2 failed: .*Syntax error"):
        migrate(warehouse, directory=tmp_path)
    assert [s.state for s in status(warehouse, directory=tmp_path)] == ["applied", "pending"]
    write(tmp_path, "0002_bad.sql", "CREATE TABLE IF NOT EXISTS b (x UInt8) ENGINE = Memory;\n")
    assert [m.version for m in migrate(warehouse, directory=tmp_path)] == [2]
