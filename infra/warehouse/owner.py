"""The owner file: how the process that holds the embedded warehouse tells others where to send reads.

``<data_dir>/warehouse/.owner.json`` holds ``{pid, url, token}``; it is written (mode 0600, atomically) by
:class:`~infra.warehouse.server.WarehouseQueryServer` when it starts and removed when it stops. A file left
behind by a process that died is *stale*: its pid is gone (or belongs to someone else and nothing answers at
the url), and readers fall back to opening the warehouse themselves.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import msgspec

from schemas.settings import PlatformSettings

OWNER_FILE = ".owner.json"


class OwnerRecord(msgspec.Struct, frozen=True):
    pid: int
    url: str
    token: str


def warehouse_dir(settings: PlatformSettings) -> Path:
    """Where the embedded (chDB) warehouse keeps its data: ``<data_dir>/warehouse``, absolute."""
    return Path(settings.data_dir).expanduser().resolve() / "warehouse"


def owner_path(settings: PlatformSettings) -> Path:
    return warehouse_dir(settings) / OWNER_FILE


def read_owner(settings: PlatformSettings) -> OwnerRecord | None:
    """The owner record, or None when there is none or it cannot be read (a torn or foreign file)."""
    try:
        return msgspec.json.decode(owner_path(settings).read_bytes(), type=OwnerRecord)
    except (OSError, msgspec.DecodeError):
        return None


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, but another user's
        return True
    return True


def write_owner(settings: PlatformSettings, record: OwnerRecord) -> None:
    """Publish ``record`` atomically, readable by this user only (it carries the query token)."""
    path = owner_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{OWNER_FILE}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(msgspec.json.encode(record))
    os.replace(tmp, path)


def remove_owner(settings: PlatformSettings, record: OwnerRecord) -> None:
    """Remove the owner file if it is still ``record`` (never a successor's)."""
    if read_owner(settings) == record:
        with contextlib.suppress(FileNotFoundError):
            owner_path(settings).unlink()
