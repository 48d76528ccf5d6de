"""The owner serves reads: one process holds the embedded warehouse, every other one queries through it.

chDB lets one process open a data directory. The platform process (``sluice up``) owns it and runs a
:class:`WarehouseQueryServer`: a loopback HTTP endpoint that runs read-only queries on the owner's client in
one dedicated thread, and advertises itself in ``<data_dir>/warehouse/.owner.json`` (pid, url, token; mode
0600, so only this user can read the token). :func:`query_warehouse` — what ``sluice sql`` and dashboards
call — asks the owner when one is running, and otherwise opens the warehouse itself.

Wire format (msgspec JSON): ``POST /query`` with ``Authorization: Bearer <token>`` and ``{"sql", "max_rows"}``
answers 200 with a :class:`QueryResult`, 400 ``{"error"}`` when ClickHouse refuses the query, 401 on a wrong
token, 503 when too many queries are already waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import secrets
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from infra.warehouse.client import (
    DEFAULT_MAX_ROWS,
    DEFAULT_QUERY_TIMEOUT_S,
    Client,
    QueryResult,
    check_query_text,
    open_warehouse,
    read_query,
)
from infra.warehouse.errors import WarehouseError, WarehouseQueryError
from infra.warehouse.owner import OwnerRecord, pid_alive, read_owner, remove_owner, warehouse_dir, write_owner
from schemas.codec import UNREADABLE_JSON
from schemas.lifecycle import AsyncComponent
from schemas.settings import PlatformSettings

__all__ = ["QueryRequest", "WarehouseQueryServer", "query_warehouse"]

log = logging.getLogger(__name__)

_LOOPBACK = "127.0.0.1"


class QueryRequest(msgspec.Struct, frozen=True, kw_only=True):
    sql: str
    max_rows: int | None = None


class _ErrorBody(msgspec.Struct, frozen=True):
    error: str


class WarehouseQueryServer(AsyncComponent):
    """Serve read-only queries on ``client`` (the owner's) to other local processes.

    Queries run one at a time on a single worker thread (chDB is not to be driven from many threads); at
    most ``max_pending`` wait, and more are answered 503 rather than queued without bound. ``client`` may be
    the one the owner writes with (clickhouse-connect serialises calls on a chDB client); a second
    :func:`~infra.warehouse.client.open_warehouse` in the owning process — chDB allows many clients on the
    directory a process holds — keeps long reads from delaying the writer.
    """

    def __init__(
        self,
        client: Client,
        settings: PlatformSettings,
        *,
        max_rows: int = DEFAULT_MAX_ROWS,
        timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
        max_pending: int = 16,
    ) -> None:
        super().__init__()
        self._client = client
        self._settings = settings
        self._max_rows = max_rows
        self._timeout_s = timeout_s
        self._max_pending = max_pending
        self._pending = 0
        self._runner: web.AppRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._record: OwnerRecord | None = None

    @property
    def url(self) -> str:
        if self._record is None:
            raise RuntimeError("the warehouse query server is not started")
        return self._record.url

    async def _start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("the warehouse query server is already started")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="warehouse-query")
        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/query", self._handle_query)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=self._timeout_s + 5)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, _LOOPBACK, 0)
        await site.start()
        port = runner.addresses[0][1]
        record = OwnerRecord(
            pid=os.getpid(), url=f"http://{_LOOPBACK}:{port}", token=secrets.token_urlsafe(32)
        )
        self._record = record
        write_owner(self._settings, record)
        log.info("warehouse query server at %s", record.url)

    async def stop(self) -> None:
        """Withdraw the owner file, finish in-flight queries, stop the worker thread. Idempotent."""
        if self._record is not None:
            remove_owner(self._settings, self._record)
            self._record = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._executor is not None:
            executor, self._executor = self._executor, None
            await asyncio.to_thread(functools.partial(executor.shutdown, wait=True, cancel_futures=True))

    async def _handle_query(self, request: web.Request) -> web.Response:
        record, executor = self._record, self._executor
        if record is None or executor is None:
            return _error(503, "the warehouse query server is stopping")
        presented = request.headers.get("Authorization", "")
        presented_bytes = presented.encode("utf-8", "surrogateescape")  # a non-UTF-8 byte: refused, not a 500
        if not secrets.compare_digest(presented_bytes, f"Bearer {record.token}".encode()):
            return _error(401, "missing or wrong token (see the owner file)")
        try:
            body = msgspec.json.decode(await request.read(), type=QueryRequest)
        except UNREADABLE_JSON as exc:
            return _error(400, f"bad request body: {exc}")
        if self._pending >= self._max_pending:
            return _error(503, f"{self._pending} queries are already waiting; try again")
        max_rows = min(body.max_rows or self._max_rows, self._max_rows)
        query = functools.partial(
            read_query, self._client, body.sql, max_rows=max(1, max_rows), timeout_s=self._timeout_s
        )
        self._pending += 1
        try:
            result = await asyncio.get_running_loop().run_in_executor(executor, query)
        except WarehouseQueryError as exc:
            return _error(400, str(exc))
        except Exception as exc:
            log.exception("warehouse query failed")
            return _error(500, f"{type(exc).__name__}: {exc}")
        finally:
            self._pending -= 1
        return web.Response(body=msgspec.json.encode(result), content_type="application/json")


def _error(status: int, message: str) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(_ErrorBody(message)), content_type="application/json"
    )


def query_warehouse(
    settings: PlatformSettings,
    sql: str,
    *,
    max_rows: int = DEFAULT_MAX_ROWS,
    timeout_s: float = DEFAULT_QUERY_TIMEOUT_S,
) -> QueryResult:
    """Run one read-only query wherever the warehouse is reachable from this process (blocking).

    A ClickHouse server (``warehouse_url``) is queried directly. In embedded mode a live owner answers it
    over loopback; with no owner, or a stale owner file, the directory is opened here for the one query.
    Raises :class:`WarehouseQueryError` when ClickHouse refuses the query, :class:`WarehouseLockedError`
    when another process holds the directory without serving it. Call it from a thread, never from the
    owner's event loop (which has to answer it).
    """
    check_query_text(sql)
    if settings.warehouse_url is None:
        owner = read_owner(settings)
        if owner is not None and pid_alive(owner.pid):
            result = _ask_owner(owner, sql, max_rows=max_rows, timeout_s=timeout_s)
            if result is not None:
                return result
        path = warehouse_dir(settings)
        if not path.is_dir():
            raise WarehouseError(
                f"there is no embedded warehouse at {path} yet: start the platform (`sluice up`) "
                "or run `sluice warehouse migrate`"
            )
    client = open_warehouse(settings)
    try:
        return read_query(client, sql, max_rows=max_rows, timeout_s=timeout_s)
    finally:
        client.close()


def _ask_owner(owner: OwnerRecord, sql: str, *, max_rows: int, timeout_s: float) -> QueryResult | None:
    """The owner's answer, or None when nothing (or something else) listens at its url: a stale file."""
    if not owner.url.startswith(f"http://{_LOOPBACK}:"):
        return None  # never send the token anywhere but loopback
    request = urllib.request.Request(  # noqa: S310 (scheme and host checked above)
        f"{owner.url}/query",
        data=msgspec.json.encode(QueryRequest(sql=sql, max_rows=max_rows)),
        headers={"Authorization": f"Bearer {owner.token}", "Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(request, timeout=timeout_s + 10) as response:
            return msgspec.json.decode(response.read(), type=QueryResult)
    except urllib.error.HTTPError as exc:
        with exc:
            message = _error_message(exc.read())
        if exc.code == 400:
            raise WarehouseQueryError(message) from None
        if exc.code in (401, 404, 405):
            return None  # not our owner: the pid was reused and another service has the port
        raise WarehouseError(
            f"the warehouse owner (pid {owner.pid}) answered {exc.code}: {message}"
        ) from None
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            raise WarehouseError(f"the warehouse owner (pid {owner.pid}) did not answer in time") from exc
        return None  # connection refused: the owner is gone
    except TimeoutError as exc:
        raise WarehouseError(f"the warehouse owner (pid {owner.pid}) did not answer in time") from exc
    except msgspec.DecodeError as exc:
        raise WarehouseError(f"the warehouse owner (pid {owner.pid}) sent a malformed answer: {exc}") from exc


def _error_message(body: bytes) -> str:
    with contextlib.suppress(msgspec.DecodeError):
        return msgspec.json.decode(body, type=_ErrorBody).error
    return body.decode("utf-8", errors="replace")
