"""The Files and Batches routes of the OpenAI API (``/v1/files``, ``/v1/batches``).

Every lookup is by the caller's tenant: another tenant's file or batch is a 404, exactly like an id that
never existed. The batch runner does the work (:mod:`ingest.batches`); an edge built without one (tests of
the online path) answers 503 here.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from ingest.auth import Tenant
from ingest.batches import BatchRunner, CreateBatch, batch_object
from ingest.context import EdgeContext
from ingest.errors import InvalidRequest, Unavailable
from ingest.files import StoredFile, check_purpose, chunks_of, expires_after
from ingest.http import json_response
from ingest.openai import decode_body

_STREAM_LINES = 512

T = TypeVar("T")


def _page(
    request: web.Request, items: Sequence[T], key: Callable[[T], str], *, default: int, most: int
) -> dict[str, Any]:
    """One page of ``items`` as OpenAI lists them (``limit``, ``after`` an id, ``order`` by id, newest first
    by default): ``data`` (the items), ``first_id``, ``last_id`` and ``has_more``."""
    try:
        limit = int(request.query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= most:  # as it says (0, -5 and 10**6 were taken as 1 and the most: a review)
        raise InvalidRequest(f"limit must be a whole number from 1 to {most}.", param="limit")
    order = request.query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be 'asc' or 'desc'.", param="order")
    ordered = sorted(items, key=key, reverse=order == "desc")
    after = request.query.get("after")
    if after:
        ordered = [i for i in ordered if (key(i) < after if order == "desc" else key(i) > after)]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": key(page[0]) if page else None,
        "last_id": key(page[-1]) if page else None,
        "has_more": len(ordered) > limit,
    }


_DOWNLOAD = {
    "Content-Type": "application/octet-stream",
    "Content-Disposition": "attachment",
    "X-Content-Type-Options": "nosniff",
}
"""A file's content is data to save, never a page a browser renders (its bytes are the client's)."""


def _checked_form(stored: StoredFile | None, purpose: str | None) -> StoredFile:
    if stored is None:
        raise InvalidRequest("The form has no 'file' part.", param="file")
    check_purpose(purpose or "")
    return stored


class BatchRoutes:
    def __init__(self, ctx: EdgeContext, runner: BatchRunner | None) -> None:
        self.ctx = ctx
        self.runner = runner

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/v1/files", self.upload)
        app.router.add_get("/v1/files", self.files)
        app.router.add_get("/v1/files/{file_id}", self.file)
        app.router.add_delete("/v1/files/{file_id}", self.delete_file)
        app.router.add_get("/v1/files/{file_id}/content", self.content)
        app.router.add_post("/v1/batches", self.create)
        app.router.add_get("/v1/batches", self.batches)
        app.router.add_get("/v1/batches/{batch_id}", self.batch)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel)

    def _caller(self, request: web.Request) -> tuple[Tenant, BatchRunner]:
        tenant = self.ctx.tenants.authenticate(request.headers.get("Authorization"))
        if self.runner is None:
            raise Unavailable("This edge does not run batches.", code="batches_unavailable")
        return tenant, self.runner

    # ------------------------------------------------------------------ files

    async def upload(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        if not request.content_type.startswith("multipart/"):
            raise InvalidRequest("Upload a file as multipart/form-data with 'file' and 'purpose'.")
        purpose: str | None = None
        stored: StoredFile | None = None
        expiry: dict[str, str] = {}
        try:
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader):
                    continue
                if part.name == "purpose":
                    purpose = (await _field(part))[:64]
                elif part.name in ("expires_after[anchor]", "expires_after[seconds]"):
                    expiry[part.name] = (await _field(part))[:32]
                elif part.name == "file" and stored is None:
                    filename = _printable_name(part.filename or "upload.jsonl")[:255]
                    stored = await runner.store.upload(
                        tenant.name, filename, "batch", chunks_of(part.read_chunk)
                    )
            uploaded = _checked_form(stored, purpose)
            seconds = expires_after(expiry.get("expires_after[anchor]"), expiry.get("expires_after[seconds]"))
            if seconds is not None:
                uploaded = runner.store.expire_after(tenant.name, uploaded.id, seconds)
        except (HttpProcessingError, ValueError, UnicodeDecodeError) as exc:
            if stored is not None:
                runner.store.delete(tenant.name, stored.id)
            raise InvalidRequest(
                f"The multipart form could not be read: {exc}", code="invalid_form"
            ) from None
        except BaseException:
            if stored is not None:
                runner.store.delete(tenant.name, stored.id)
            raise
        return json_response(uploaded.openai())

    async def files(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        # on a thread: it reads every metadata file of the tenant (3,000 stalled the event loop 0.2 s: a review)
        listed = await asyncio.to_thread(runner.store.list, tenant.name, request.query.get("purpose"))
        page = _page(request, listed, lambda f: f.id, default=10_000, most=10_000)  # OpenAI's bounds
        return json_response({**page, "data": [f.openai() for f in page["data"]]})

    async def file(self, request: web.Request) -> web.Response:
        """A file's metadata; a running batch's output or error file's as written so far."""
        tenant, runner = self._caller(request)
        file_id = request.match_info["file_id"]
        partial = await asyncio.to_thread(runner.partial_file, tenant.name, file_id)
        return json_response(partial or runner.store.get(tenant.name, file_id).openai())

    async def delete_file(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        file_id = request.match_info["file_id"]
        await runner.delete_file(tenant.name, file_id)  # 409 file_in_use while a batch reads it
        return json_response({"id": file_id, "object": "file", "deleted": True})

    async def content(self, request: web.Request) -> web.StreamResponse:
        """The file's bytes; for a running batch's output or error file, the lines settled so far, in input
        order."""
        tenant, runner = self._caller(request)
        file_id = request.match_info["file_id"]
        # on a thread: it syncs the batch's journal and opens it (the lines are then read from what is open)
        partial = await asyncio.to_thread(runner.partial_output, tenant.name, file_id)
        if partial is None:
            path = runner.store.data_path(tenant.name, file_id)
            return web.FileResponse(path, headers=_DOWNLOAD)
        response = web.StreamResponse(headers=_DOWNLOAD)
        await response.prepare(request)
        while lines := await asyncio.to_thread(lambda: list(itertools.islice(partial, _STREAM_LINES))):
            await response.write(b"".join(line + b"\n" for line in lines))
        await response.write_eof()
        return response

    # ------------------------------------------------------------------ batches

    async def create(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        self.ctx.admission.check_budget(tenant, self.ctx.gateway.budget_exhausted(tenant.name))
        body = decode_body(await request.read(), CreateBatch)
        state = await runner.create(tenant, body)
        return json_response(batch_object(state))

    async def batches(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        states = await runner.listing(tenant.name)
        page = _page(request, states, lambda s: s.batch_id, default=20, most=100)  # OpenAI's bounds
        return json_response({**page, "data": [batch_object(s) for s in page["data"]]})

    async def batch(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        return json_response(batch_object(runner.get(tenant.name, request.match_info["batch_id"])))

    async def cancel(self, request: web.Request) -> web.Response:
        tenant, runner = self._caller(request)
        state = await runner.cancel(tenant.name, request.match_info["batch_id"])
        return json_response(batch_object(state))


async def _field(part: BodyPartReader) -> str:
    """A form field's text; one in a charset or a transfer encoding aiohttp does not know is the client's
    error (aiohttp raises ``LookupError`` for the one and ``RuntimeError`` for the other)."""
    try:
        return await part.text()
    except (LookupError, RuntimeError) as exc:
        raise InvalidRequest(
            f"The form field {part.name!r} could not be read: {exc}", code="invalid_form"
        ) from None


def _printable_name(name: str) -> str:
    """``name`` with what is not UTF-8 (aiohttp hands a filename's Latin-1 bytes over as lone surrogates)
    as U+FFFD: stored as sent, near enough, not refused (a review found it kept the bytes of an upload it
    then refused as a 400)."""
    return "".join("\ufffd" if "\ud800" <= c <= "\udfff" else c for c in name)
