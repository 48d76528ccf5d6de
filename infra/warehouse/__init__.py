"""The warehouse: ClickHouse through clickhouse-connect (embedded chDB by default), its migrations, and the
owner's read server that lets other processes query an embedded warehouse."""

from infra.warehouse.client import QueryResult, ServerAddress, open_warehouse, parse_warehouse_url, read_query
from infra.warehouse.errors import (
    MigrationChecksumError,
    MigrationError,
    WarehouseError,
    WarehouseLockedError,
    WarehouseQueryError,
)
from infra.warehouse.migrate import AppliedMigration, MigrationStatus, migrate, status
from infra.warehouse.owner import warehouse_dir
from infra.warehouse.server import WarehouseQueryServer, query_warehouse

__all__ = [
    "AppliedMigration",
    "MigrationChecksumError",
    "MigrationError",
    "MigrationStatus",
    "QueryResult",
    "ServerAddress",
    "WarehouseError",
    "WarehouseLockedError",
    "WarehouseQueryError",
    "WarehouseQueryServer",
    "migrate",
    "open_warehouse",
    "parse_warehouse_url",
    "query_warehouse",
    "read_query",
    "status",
    "warehouse_dir",
]
