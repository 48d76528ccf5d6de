"""Files expire as OpenAI's do: 30 days after creation unless an upload asks otherwise (1 hour to 30 days);
an expired file is gone for every read at once, and a sweep removes its bytes."""

from __future__ import annotations

import io
import threading
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from ingest.auth import DEMO_KEY
from ingest.errors import InvalidRequest, NotFound
from ingest.files import DAY_S, FILE_MIN_CHARGE, FileStore, FileWriter, expires_after, tenant_folder
from tests.ingest.conftest import AUTH, OTHER_AUTH, MakeClient


def _store(tmp_path: Path, ttl_s: int = 30 * DAY_S) -> FileStore:
    return FileStore(tmp_path, max_bytes=1 << 20, ttl_s=ttl_s)


def _write(store: FileStore, tenant: str = "acme", purpose: str = "batch") -> str:
    with store.writer(tenant, "a.jsonl", purpose) as out:  # type: ignore[arg-type]
        out.write(b'{"a": 1}\n')
    return out.stored.id


def test_a_new_file_expires_after_the_ttl_and_zero_keeps_it(tmp_path: Path) -> None:
    store = _store(tmp_path)
    stored = store.get("acme", _write(store))
    assert stored.expires_at == stored.created_at + 30 * DAY_S
    assert stored.openai()["expires_at"] == stored.expires_at
    forever = _store(tmp_path / "forever", ttl_s=0)
    assert forever.get("acme", _write(forever)).expires_at is None


def test_an_expired_file_is_gone_for_every_read_and_the_sweep_removes_its_bytes(tmp_path: Path) -> None:
    store = _store(tmp_path)
    gone, kept, other = _write(store), _write(store), _write(store, tenant="zen")
    store.expire_after("acme", gone, 0)  # created_at + 0: expired now
    with pytest.raises(NotFound):
        store.get("acme", gone)
    assert [f.id for f in store.list("acme")] == [kept]
    store.expire_after("acme", kept, 3600)
    assert store.sweep() == 0  # the read already removed the expired one; nothing else is due
    assert store.sweep(now=store.get("acme", kept).created_at + 3600) == 1
    assert [f.id for f in store.list("acme")] == []
    assert not list((tmp_path).glob(f"*/{kept}.*"))
    assert store.get("zen", other).id == other  # another tenant's file is untouched


@pytest.mark.parametrize(
    ("anchor", "seconds", "expected"),
    [(None, None, None), ("created_at", "3600", 3600), ("created_at", str(30 * DAY_S), 30 * DAY_S)],
)
def test_expires_after_fields(anchor: str | None, seconds: str | None, expected: int | None) -> None:
    assert expires_after(anchor, seconds) == expected


@pytest.mark.parametrize(
    ("anchor", "seconds"),
    [("created_at", "3599"), ("created_at", str(30 * DAY_S + 1)), ("created_at", "soon"), ("last_used", "3600"),
     (None, "3600"), ("created_at", None)],
)  # fmt: skip
def test_bad_expires_after_fields_are_refused(anchor: str | None, seconds: str | None) -> None:
    with pytest.raises(InvalidRequest) as refused:
        expires_after(anchor, seconds)
    assert refused.value.code == "invalid_expires_after"


async def test_an_upload_through_the_sdk_sets_its_expiry_and_a_bad_one_keeps_nothing(
    make_client: MakeClient,
) -> None:
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        default = await sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert default.expires_at == default.created_at + 30 * DAY_S
        hour = await sdk.files.create(
            file=("b.jsonl", io.BytesIO(b"{}\n")),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        assert hour.expires_at == hour.created_at + 3600
        assert (await sdk.files.retrieve(hour.id)).expires_at == hour.expires_at
        with pytest.raises(openai.BadRequestError) as refused:
            await sdk.files.create(
                file=("c.jsonl", io.BytesIO(b"{}\n")),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": 60},
            )
        assert refused.value.code == "invalid_expires_after"
        assert sorted(f.id for f in (await sdk.files.list()).data) == sorted([default.id, hour.id])


async def test_the_file_list_pages_as_openais_does(make_client: MakeClient) -> None:
    """Found by an audit: ``files.list(limit=1)`` returned every file with ``has_more: false``; ``limit``,
    ``after`` and ``order`` were ignored."""
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        made = [
            (await sdk.files.create(file=(f"{i}.jsonl", io.BytesIO(b"{}\n")), purpose="batch")).id
            for i in range(5)
        ]
        newest_first = sorted(made, reverse=True)
        first = await sdk.files.list(limit=2)
        assert ([f.id for f in first.data], first.has_more) == (newest_first[:2], True)
        rest = await sdk.files.list(limit=2, after=newest_first[1])
        assert [f.id for f in rest.data] == newest_first[2:4]
        oldest = await sdk.files.list(limit=10, order="asc")
        assert ([f.id for f in oldest.data], oldest.has_more) == (sorted(made), False)
        assert [f.id async for f in sdk.files.list(limit=2)] == newest_first  # the SDK's paging walks it all
        with pytest.raises(openai.BadRequestError):
            await sdk.files.list(order="sideways")  # type: ignore[arg-type]
        for limit in (0, -5, 1_000_000):  # a review: taken as 1 and the most, where the error says 1 to N
            with pytest.raises(openai.BadRequestError, match="limit must be a whole number from 1 to"):
                await sdk.files.list(limit=limit)


def _form(parts: list[tuple[bytes, bytes]], boundary: bytes = b"XyZ") -> bytes:
    out = b"".join(b"--" + boundary + b"\r\n" + head + b"\r\n" + body + b"\r\n" for head, body in parts)
    return out + b"--" + boundary + b"--\r\n"


_PURPOSE = b'Content-Disposition: form-data; name="purpose"\r\n'
_FILE = b'Content-Disposition: form-data; name="file"; filename="a.jsonl"\r\n'


@pytest.mark.parametrize(
    "field_headers",
    [b"Content-Type: text/plain; charset=bogus\r\n", b"Content-Transfer-Encoding: bogus\r\n"],
    ids=["unknown charset", "unknown transfer encoding"],
)
async def test_a_form_field_aiohttp_cannot_decode_is_a_400_and_keeps_nothing(
    make_client: MakeClient, field_headers: bytes
) -> None:
    """Found by a fuzz audit: aiohttp raises ``LookupError`` and ``RuntimeError`` for these (500s)."""
    client, _ = await make_client()
    body = _form([(_PURPOSE + field_headers, b"batch"), (_FILE, b'{"a": 1}\n')])
    response = await client.post(
        "/v1/files",
        data=body,
        headers={"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "multipart/form-data; boundary=XyZ"},
    )
    assert response.status == 400, await response.text()
    error = (await response.json())["error"]
    assert error["code"] == "invalid_form"
    assert "'purpose'" in error["message"]
    listed = await client.get("/v1/files", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    assert (await listed.json())["data"] == []


async def test_a_filename_that_is_not_utf8_is_stored_and_no_bytes_outlive_a_refused_upload(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Found by a review: a Latin-1 filename reached the store as lone surrogates; the data was moved into
    place, then its metadata could not be encoded: a 400, and the bytes stayed on disk with no metadata,
    never listed, counted against the tenant's quota, swept nor deleted (three of them passed a 100 KB
    quota). The name is stored with U+FFFD for what is not UTF-8."""
    client, _ = await make_client(edge_files_max_bytes_per_tenant=100_000)
    latin1 = b'Content-Disposition: form-data; name="file"; filename="r\xe9sum\xe9.jsonl"\r\n'
    auth = {"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "multipart/form-data; boundary=XyZ"}
    statuses = []
    for _ in range(3):  # 3 x 60 KB against a 100 KB quota
        response = await client.post(
            "/v1/files", data=_form([(_PURPOSE, b"batch"), (latin1, b"{}\n" * 20_000)]), headers=auth
        )
        statuses.append(response.status)
        if response.status == 200:
            assert (await response.json())["filename"] == "r\ufffdsum\ufffd.jsonl"
    assert statuses[0] == 200
    assert statuses[1:] == [413, 413]  # counted against the quota
    listed = await client.get("/v1/files", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    kept = {f["id"] for f in (await listed.json())["data"]}
    on_disk = {p.name.removesuffix(".data") for p in (tmp_path / "files").glob("*/file-*.data")}
    assert on_disk == kept


def test_a_file_whose_metadata_cannot_be_written_leaves_no_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ingest.files

    def full(path: Path, data: bytes) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ingest.files, "write_atomic", full)
    store = _store(tmp_path)
    with pytest.raises(OSError, match="No space"):
        _write(store)
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == []


async def test_an_upload_and_a_listing_read_the_tenants_files_off_the_event_loop(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: an upload (the tenant's usage, for its quota) and a listing read every metadata
    file of the tenant on the event loop's thread: with 3,000 files, each stalled every request of the edge
    0.2 s. Both read them on a thread."""
    client, _ = await make_client(edge_files_max_bytes_per_tenant=1 << 30)
    loop_thread = threading.get_ident()
    read_on: dict[str, list[bool]] = {"usage": [], "list": [], "sync": []}
    for name, calls in read_on.items():
        owner: Any = FileWriter if name == "sync" else FileStore
        plain = getattr(owner, name)

        def recorded(self: Any, *args: Any, _plain: Any = plain, _calls: list[bool] = calls) -> Any:
            _calls.append(threading.get_ident() == loop_thread)
            return _plain(self, *args)

        monkeypatch.setattr(owner, name, recorded)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        uploaded = await sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
        assert [f.id for f in (await sdk.files.list()).data] == [uploaded.id]
    assert read_on["usage"] == [False], "the upload's usage was read on the event loop"
    # the data's fsync too (a 200 MB upload's held the loop as long as the disk took): the close's
    # own, after it, has nothing left to write
    assert read_on["sync"][:1] == [False], "the upload was made durable on the event loop"
    # the usage's own read, and the listing's
    assert read_on["list"] == [False, False], "a listing was read on the event loop"


def test_the_sweep_removes_what_a_killed_writer_left_once_untouched_for_an_hour(tmp_path: Path) -> None:
    """Found by a review: an edge killed while it wrote an upload or a batch's output left the bytes so far
    (``.file-<id>.<pid>.part``), never listed, counted, swept nor deleted; a restart wrote the file again
    under its own pid."""
    import os

    from ingest.files import LEFTOVER_S

    store = _store(tmp_path)
    kept = store.get("acme", _write(store))
    folder = next(tmp_path.glob("*/file-*.json")).parent
    now = 1_000_000_000.0
    old_part, old_tmp = folder / ".file-old.4458.part", folder / ".file-old.json.4458.1.tmp"
    writing = folder / ".file-new.4459.part"  # a writer at it now
    for path in (old_part, old_tmp, writing):
        path.write_bytes(b"x" * 1024)
    for path in (old_part, old_tmp):
        os.utime(path, (now - LEFTOVER_S - 1, now - LEFTOVER_S - 1))
    os.utime(writing, (now - 60, now - 60))
    assert store.sweep(now) == 2
    assert not old_part.exists()
    assert not old_tmp.exists()
    assert writing.exists()
    assert store.get("acme", kept.id) == kept  # a file not expired stays


async def _upload(client: Any, content: bytes, auth: dict[str, str]) -> tuple[int, dict[str, Any]]:
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", content, filename="tiny.jsonl")
    response = await client.post("/v1/files", data=form, headers=auth)
    return response.status, await response.json()


async def test_empty_files_count_a_block_each_against_the_tenants_quota(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Found by a review: the quota counted content bytes only, so empty files were free: a tenant with a
    4 KiB quota kept 300 of them, 1.2 MB on disk (each file's metadata takes a 4 KiB block). Each file now
    counts at least FILE_MIN_CHARGE."""
    client, _ = await make_client(
        edge_files_max_bytes_per_tenant=3 * FILE_MIN_CHARGE, edge_files_max_per_tenant=0
    )
    statuses = [(await _upload(client, b"", AUTH))[0] for _ in range(3)]
    assert statuses == [200, 200, 200]
    status, body = await _upload(client, b"", AUTH)
    assert status == 413
    assert (body["error"]["type"], body["error"]["code"]) == (
        "invalid_request_error",
        "storage_quota_exceeded",
    )
    assert f"{3 * FILE_MIN_CHARGE:,} bytes" in body["error"]["message"]
    assert len(list((tmp_path / "files" / tenant_folder("demo")).glob("file-*.json"))) == 3
    assert (await _upload(client, b"", OTHER_AUTH))[0] == 200  # another tenant's quota is its own


async def test_a_tenant_keeps_no_more_files_than_its_limit(make_client: MakeClient) -> None:
    """Found by a review: nothing bounded how many files a tenant kept (each two inodes and a metadata
    block, and each upload reads every metadata file of the tenant). An upload while the tenant keeps
    SLUICE_EDGE_FILES_MAX_PER_TENANT files is refused as the storage quota is, until it deletes one."""
    client, _ = await make_client(edge_files_max_per_tenant=3, edge_files_max_bytes_per_tenant=0)
    ids = []
    for _ in range(3):
        status, body = await _upload(client, b"{}\n", AUTH)
        assert status == 200
        ids.append(body["id"])
    status, body = await _upload(client, b"{}\n", AUTH)
    assert status == 413
    assert (body["error"]["type"], body["error"]["code"]) == (
        "invalid_request_error",
        "storage_quota_exceeded",
    )
    assert "3 files" in body["error"]["message"]
    listed = await (await client.get("/v1/files", headers=AUTH)).json()
    assert sorted(f["id"] for f in listed["data"]) == sorted(ids)  # nothing kept of the refused one
    assert (await _upload(client, b"{}\n", OTHER_AUTH))[0] == 200  # another tenant's count is its own
    assert (await client.delete(f"/v1/files/{ids[0]}", headers=AUTH)).status == 200
    assert (await _upload(client, b"{}\n", AUTH))[0] == 200
