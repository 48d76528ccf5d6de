"""Files of the OpenAI Files API (``purpose="batch"`` inputs, and the output and error files batches write),
kept on disk under ``SLUICE_EDGE_FILES_DIR`` (default ``<data dir>/files``), one folder per tenant.

A tenant's folder is named by a hash of its name, and every lookup goes through it: a file id of another
tenant is simply not there, so it reads as 404, like an id that never existed. File ids are checked
against their pattern before any path is built from them. Uploads stream to a temporary file (bounded by
``SLUICE_EDGE_FILE_MAX_BYTES``; the files batches write are not: their size follows from an input that
passed that limit) that is renamed into place once complete and synced, so a reader never sees half a
file. Several edges on one machine (or on a shared file system) share the store.

Files expire as OpenAI's do: ``SLUICE_EDGE_FILE_TTL_S`` after creation (30 days; 0 never), or what an
upload asks with ``expires_after[anchor]=created_at`` and ``expires_after[seconds]`` (1 hour to 30 days).
An expired file is gone for every read at once; :meth:`FileStore.sweep` (the batch runner, every
``SWEEP_S``) removes its bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, BinaryIO, Literal, NamedTuple

import msgspec

from ingest.errors import InvalidRequest, NotFound, PayloadTooLarge, StorageQuotaExceeded
from schemas.codec import UNREADABLE_JSON
from schemas.ids import uuid7

_MISSING_OR_UNREADABLE: tuple[type[Exception], ...] = (FileNotFoundError, *UNREADABLE_JSON)
_GONE_OR_UNREADABLE: tuple[type[Exception], ...] = (OSError, *UNREADABLE_JSON)
"""A metadata file that is gone, or that is not JSON msgspec can read (an edited or torn file)."""

Purpose = Literal["batch", "batch_output"]
FILE_ID = re.compile(r"^file-[0-9a-f]{32}$")
_CHUNK = 1 << 16
DAY_S = 86_400
EXPIRES_AFTER_S = (3_600, 30 * DAY_S)
"""What ``expires_after[seconds]`` may ask for (OpenAI's bounds)."""
SWEEP_S = 600.0
FILE_MIN_CHARGE = 4096
"""What each stored file counts at least against its tenant's quota, in bytes. A file is its bytes and a
metadata JSON (two inodes), and the JSON alone takes a 4 KiB block on the usual file systems (ext4's and
XFS's default block): counted by its content only, an empty file cost nothing, and a tenant with a 4 KiB
quota kept 300 of them, 1.2 MB on disk (a review). A file past 4 KiB counts its content, as before."""
UTF8_BOM = b"\xef\xbb\xbf"


class StoredFile(msgspec.Struct, frozen=True, kw_only=True):
    """A file's metadata (``<id>.json`` beside its bytes ``<id>.data``)."""

    id: str
    tenant: str
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    lines: int = 0
    expires_at: int | None = None
    """Unix seconds after which the file is gone (None: kept until deleted)."""

    def expired(self, now: float | None = None) -> bool:
        return self.expires_at is not None and (time.time() if now is None else now) >= self.expires_at

    def openai(self) -> dict[str, Any]:
        """OpenAI's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
            "expires_at": self.expires_at,
        }


_META = msgspec.json.Decoder(StoredFile)


class Usage(NamedTuple):
    """What a tenant's files hold, as its quotas count them."""

    bytes: int
    """Their content, each file counted at least :data:`FILE_MIN_CHARGE`."""
    files: int


def charge(size: int) -> int:
    """What a file of ``size`` content bytes counts against its tenant's quota."""
    return max(size, FILE_MIN_CHARGE)


def tenant_folder(tenant: str) -> str:
    """A tenant's folder name under a store's root (files) or its ``batches/`` (batches): a hash, so no
    tenant name ever becomes a path, and every lookup is confined to the caller's folder."""
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


def new_file_id() -> str:
    return "file-" + uuid7().replace("-", "")


def not_found(file_id: str) -> NotFound:
    return NotFound(f"No such File object: {file_id}", param="file_id")


class FileStore:
    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        ttl_s: int = 30 * DAY_S,
        max_tenant_bytes: int = 0,
        max_tenant_files: int = 0,
    ) -> None:
        """``ttl_s``: how long a new file lives unless its upload says otherwise (0: until deleted);
        ``max_tenant_bytes``: what one tenant's files may hold together, uploads and the files its batches
        wrote, each counted at least :data:`FILE_MIN_CHARGE` (0: no limit); ``max_tenant_files``: how many
        files one tenant may keep, those its batches wrote included; an upload past it is refused (0: no
        limit)."""
        self.root = root
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.max_tenant_bytes = max_tenant_bytes
        self.max_tenant_files = max_tenant_files

    def usage(self, tenant: str) -> Usage:
        """What the tenant's files hold (blocking: it reads their metadata)."""
        files = self.list(tenant)
        return Usage(bytes=sum(charge(stored.bytes) for stored in files), files=len(files))

    def _dir(self, tenant: str) -> Path:
        return self.root / tenant_folder(tenant)

    def _paths(self, tenant: str, file_id: str) -> tuple[Path, Path]:
        if not FILE_ID.fullmatch(file_id):
            raise not_found(file_id)
        folder = self._dir(tenant)
        return folder / f"{file_id}.json", folder / f"{file_id}.data"

    def _read(self, tenant: str, file_id: str) -> StoredFile | None:
        """The metadata of the tenant's file ``file_id``, expired or not; None for another tenant's (a hash
        collision of two tenants' names, however unlikely) or an unknown id."""
        meta, _ = self._paths(tenant, file_id)
        try:
            stored = _META.decode(meta.read_bytes())
        except _MISSING_OR_UNREADABLE:
            return None
        return stored if stored.tenant == tenant else None

    def get(self, tenant: str, file_id: str) -> StoredFile:
        """The tenant's file ``file_id``; :class:`NotFound` for another tenant's or an unknown id."""
        stored = self._read(tenant, file_id)
        if stored is None:
            raise not_found(file_id)
        if stored.expired():
            self._remove(tenant, file_id)
            raise not_found(file_id)
        return stored

    def data_path(self, tenant: str, file_id: str) -> Path:
        self.get(tenant, file_id)
        return self._paths(tenant, file_id)[1]

    def list(self, tenant: str, purpose: str | None = None) -> list[StoredFile]:
        """The tenant's files, newest first."""
        out = []
        for meta in self._dir(tenant).glob("file-*.json"):
            try:
                stored = _META.decode(meta.read_bytes())
            except _GONE_OR_UNREADABLE:
                continue
            if stored.tenant == tenant and not stored.expired() and purpose in (None, stored.purpose):
                out.append(stored)
        return sorted(out, key=lambda f: f.id, reverse=True)

    def delete(self, tenant: str, file_id: str) -> None:
        self.get(tenant, file_id)
        self._remove(tenant, file_id)

    def _remove(self, tenant: str, file_id: str) -> None:
        meta, data = self._paths(tenant, file_id)
        meta.unlink(missing_ok=True)  # metadata first: from here on no reader finds the file
        data.unlink(missing_ok=True)

    def kept(self, tenant: str, file_id: str, now: float) -> bool:
        """Whether the tenant's file ``file_id`` is there and not expired at ``now`` (nothing removed)."""
        stored = self._read(tenant, file_id)
        return stored is not None and not stored.expired(now)

    def expire_after(self, tenant: str, file_id: str, seconds: int) -> StoredFile:
        """Make the tenant's file expire ``seconds`` after it was created (an upload's ``expires_after``)."""
        stored = self.get(tenant, file_id)
        stored = msgspec.structs.replace(stored, expires_at=stored.created_at + seconds)
        write_atomic(self._paths(tenant, file_id)[0], msgspec.json.encode(stored))
        return stored

    def sweep(self, now: float | None = None) -> int:
        """Remove every expired file of every tenant; returns how many (blocking: run it on a thread)."""
        now = time.time() if now is None else now
        removed = 0
        for meta in self.root.glob("*/file-*.json"):
            try:
                stored = _META.decode(meta.read_bytes())
            except _GONE_OR_UNREADABLE:
                continue
            if stored.expired(now) and meta.parent.name == tenant_folder(stored.tenant):
                self._remove(stored.tenant, stored.id)
                removed += 1
        # What a writer killed mid-file left (an upload, a batch's output: the bytes so far), never listed
        # nor counted: untouched for an hour, no writer is at it any more (a review found them kept for good)
        for pattern in (".file-*.part", ".file-*.tmp"):
            for left in self.root.glob(f"*/{pattern}"):
                with contextlib.suppress(OSError):
                    if now - left.stat().st_mtime > LEFTOVER_S:
                        left.unlink()
                        removed += 1
        return removed

    async def upload(
        self, tenant: str, filename: str, purpose: Purpose, chunks: AsyncIterator[bytes]
    ) -> StoredFile:
        """Stream ``chunks`` into a new file; :class:`PayloadTooLarge` past the size limit, and
        :class:`StorageQuotaExceeded` past what the tenant may store, or when it keeps as many files as it
        may (nothing kept). Uploads of one tenant running at once may together pass its quotas by what they
        carry: each sees what was stored before it began. (An audit: any tenant could fill the edge's disk,
        200 MB a file, kept 30 days, and a full disk failed every batch. A review: or with any number of
        empty files, which counted nothing.) The usage is read on a thread: it reads every metadata file of
        the tenant, and 3,000 of them stalled the event loop 0.2 s an upload (a review). It is read again
        for each upload rather than kept in memory, since every edge sharing the files dir adds and deletes
        files; the file count bounds what one read costs."""
        room = None
        if self.max_tenant_bytes or self.max_tenant_files:
            used = await asyncio.to_thread(self.usage, tenant)
            if self.max_tenant_files and used.files >= self.max_tenant_files:
                raise self._too_many_files(used.files)
            if self.max_tenant_bytes:
                room = self.max_tenant_bytes - used.bytes
                if room < FILE_MIN_CHARGE:  # even an empty file would take it past the quota
                    raise self._over_quota(used.bytes + FILE_MIN_CHARGE)
        # From here room >= FILE_MIN_CHARGE, so a file's charge passes it exactly when its content does.
        with self.writer(tenant, filename, purpose) as out:
            async for chunk in chunks:
                if room is not None and out.size + len(chunk) > room:
                    raise self._over_quota(self.max_tenant_bytes - room + out.size + len(chunk))
                out.write(chunk)
            # Made durable on a thread: the fsync of a 200 MB upload held the event loop, every request
            # of the edge, for as long as the disk took (a review). What is left at the block's end (the
            # rename, the metadata) is small.
            await asyncio.to_thread(out.sync)
        return out.stored

    def _over_quota(self, used: int) -> StorageQuotaExceeded:
        return StorageQuotaExceeded(
            f"This upload would take the files you store past {self.max_tenant_bytes:,} bytes ({used:,} with "
            f"it; each file counts at least {FILE_MIN_CHARGE:,}): delete files you no longer need "
            "(DELETE /v1/files/{file_id}), or wait for them to expire.",
            param="file",
        )

    def _too_many_files(self, files: int) -> StorageQuotaExceeded:
        return StorageQuotaExceeded(
            f"You store {files:,} files, the most this server keeps for one tenant ({self.max_tenant_files:,}): "
            "delete files you no longer need (DELETE /v1/files/{file_id}), or wait for them to expire.",
            param="file",
        )

    @contextlib.contextmanager
    def writer(
        self,
        tenant: str,
        filename: str,
        purpose: Purpose,
        file_id: str | None = None,
        *,
        bounded: bool = True,
        ttl_s: int | None = None,
    ) -> Iterator[FileWriter]:
        """Write a new file; it appears (metadata last) only if the block ends without an error. ``bounded``:
        :class:`PayloadTooLarge` past ``max_bytes`` (an upload); a file the platform writes (a batch's
        output) is not. ``ttl_s``: its lifetime, if not the store's."""
        file_id = file_id or new_file_id()
        meta, data = self._paths(tenant, file_id)
        data.parent.mkdir(parents=True, exist_ok=True)
        tmp = data.with_name(f".{file_id}.{os.getpid()}.part")
        out = FileWriter(tmp, self.max_bytes if bounded else None)
        try:
            yield out
            out.close()
            created = int(time.time())
            ttl = self.ttl_s if ttl_s is None else ttl_s
            out.stored = StoredFile(
                id=file_id,
                tenant=tenant,
                bytes=out.size,
                created_at=created,
                filename=filename,
                purpose=purpose,
                lines=out.lines,
                expires_at=created + ttl if ttl else None,
            )
            encoded = msgspec.json.encode(out.stored)  # before the data is in place: it can fail (a review)
            os.replace(tmp, data)
            try:
                write_atomic(meta, encoded)
            except BaseException:  # bytes without metadata are never listed, counted, swept nor deleted
                data.unlink(missing_ok=True)
                raise
        finally:
            out.close()
            tmp.unlink(missing_ok=True)


LEFTOVER_S = 3600.0
"""How long a file being written may go untouched before the sweep takes it for one a killed writer left."""


class FileWriter:
    """Bytes into a file being made, counted against the limit (None: no limit), lines counted."""

    def __init__(self, path: Path, max_bytes: int | None) -> None:
        self._file: BinaryIO | None = path.open("wb")
        self._max = max_bytes
        self.size = 0
        self.lines = 0
        self._last = b"\n"
        self.stored: StoredFile

    def write(self, chunk: bytes) -> None:
        if self._file is None:
            raise ValueError("write to a closed file")
        self.size += len(chunk)
        if self._max is not None and self.size > self._max:
            raise PayloadTooLarge(f"The file is larger than the limit of {self._max:,} bytes.", param="file")
        if chunk:
            self.lines += chunk.count(b"\n")
            self._last = chunk[-1:]
        self._file.write(chunk)

    def sync(self) -> None:
        """What was written, made durable (any thread, while nothing else writes): :meth:`close` then
        has nothing left to wait for."""
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is None:
            return
        if self._last != b"\n" and self.size:
            self.lines += 1  # a last line without its newline
        self.sync()
        self._file.close()
        self._file = None


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` so that a reader sees the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # one per writer
    with tmp.open("wb") as out:
        out.write(data)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(byte offset, line without its newline) of every line of a file, streaming. A UTF-8 byte-order mark
    that begins the file (Windows editors write one) is not part of its first line, which begins after it:
    read as the line's, it failed the line, "not valid JSON" (a review). The offset is the line's own, as
    a reader seeking to it (a restarted edge) reads the line."""
    offset = 0
    with path.open("rb") as source:
        for line in source:
            start = len(UTF8_BOM) if offset == 0 and line.startswith(UTF8_BOM) else 0
            yield offset + start, line[start:].rstrip(b"\r\n")
            offset += len(line)


def check_purpose(value: str) -> Purpose:
    if value != "batch":
        raise InvalidRequest(
            f"Unsupported purpose {value!r}: this server stores files for the Batch API only ('batch').",
            param="purpose",
            code="invalid_purpose",
        )
    return "batch"


async def chunks_of(read: Any) -> AsyncIterator[bytes]:
    """An aiohttp body part (``read_chunk``) as chunks."""
    while chunk := await read(_CHUNK):
        yield chunk


def expires_after(anchor: str | None, seconds: str | None, field: str = "expires_after") -> int | None:
    """An upload's ``expires_after[anchor]`` and ``expires_after[seconds]`` form fields (or a batch's
    ``output_expires_after``, ``field``), checked: the seconds, or None when neither was given."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest(
            f"{field}[anchor] must be 'created_at'.", param=f"{field}.anchor", code="invalid_expires_after"
        )
    low, high = EXPIRES_AFTER_S
    try:
        value = int(seconds or "")
    except ValueError:
        value = -1
    if not low <= value <= high:
        raise InvalidRequest(
            f"{field}[seconds] must be a whole number from {low} (1 hour) to {high} (30 days).",
            param=f"{field}.seconds",
            code="invalid_expires_after",
        )
    return value
