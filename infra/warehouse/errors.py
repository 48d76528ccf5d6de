"""The warehouse package's exceptions: one root, each subclass says what the caller can do about it."""

from __future__ import annotations

from infra.errors import InfraError


class WarehouseError(InfraError):
    """Root of everything :mod:`infra.warehouse` raises (itself an :class:`~infra.errors.InfraError`)."""


class WarehouseLockedError(WarehouseError):
    """The embedded warehouse directory is held by another process (chDB allows one per directory)."""

    def __init__(self, path: str, owner_pid: int | None, owner_url: str | None) -> None:
        self.path = path
        self.owner_pid = owner_pid
        self.owner_url = owner_url
        who = f"process {owner_pid}" if owner_pid is not None else "another process"
        served = f"; it serves read-only queries at {owner_url}" if owner_url else ""
        super().__init__(
            f"the embedded warehouse at {path} is held by {who}{served}. chDB allows one process per "
            "data directory: `sluice sql` and dashboards query through the owner (the running platform, "
            "`sluice up`); stop the owner to open the directory directly, or point SLUICE_WAREHOUSE_URL at "
            "a ClickHouse server"
        )


class WarehouseQueryError(WarehouseError):
    """ClickHouse refused a query (bad SQL, a write in read-only mode, an unknown table ...)."""


class MigrationError(WarehouseError):
    """A migration file is malformed, or applying one failed."""


class MigrationChecksumError(MigrationError):
    """A migration that is already applied has been edited since."""

    def __init__(self, version: int, name: str, recorded: str, current: str) -> None:
        self.version = version
        self.name = name
        self.recorded = recorded
        self.current = current
        super().__init__(
            f"migration {version:04d}_{name} was applied with checksum {recorded[:12]}… but the file now "
            f"has {current[:12]}…; applied migrations are immutable: restore the file and put the change in "
            "a new migration"
        )
