"""Async batches (the OpenAI Batch API) on the edge that accepted them: validate the input file, publish each
line as a :class:`BatchItemRequested` at batch priority, collect the lines' results from the results
topic, retry what failed for a retriable reason, and write the output and error files in input order.

Everything a batch is lives on the log and on disk, never only in this process:
- its lines are request events on ``requests.<model>`` (each line's attempt has a request id derived from
  batch, line and attempt, so publishing it again runs it once);
- their results are the workers' terminal events on ``results``; this runner reads them in its own group
  (``sluice-batches.<edge id>``) and commits their offsets only after its journal is synced;
- its state is a :class:`BatchStateChanged` on the compacted ``batches`` topic after every change (what
  the warehouse, the dashboard and ``sluice batch status`` read) and in ``state.json``.

A restarted edge reloads the batches it ran (``state.json``, the journal), publishes again every line that
has no result (duplicates of lines still queued are skipped by the workers), and goes on. At most
``SLUICE_EDGE_BATCH_MAX_IN_FLIGHT`` lines per model are published and unfinished at once, so a batch never
fills the workers' queues: interactive requests overtake it there (they are a higher class).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import shutil
import time
from array import array
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar, get_args

import msgspec

from bus.errors import BusError
from ingest.auth import Tenant, TenantDirectory
from ingest.batch_job import (
    IN_FLIGHT,
    NO_LINE,
    PENDING,
    RETRY,
    Ending,
    Job,
    JournalEntry,
    at_time,
    load_state,
)
from ingest.batch_lines import LineError, echo, item_request_id, line_request, output_line, parse_line
from ingest.batch_log import BatchLog
from ingest.errors import IngestError, InvalidRequest, NotFound
from ingest.files import (
    SWEEP_S,
    FileStore,
    StoredFile,
    expires_after,
    new_file_id,
    read_lines,
    tenant_folder,
    write_atomic,
)
from ingest.prepare import Preparer
from ingest.settings import EdgeSettings
from monitoring import metrics
from schemas.codec import encode
from schemas.events import (
    BatchCounts,
    BatchLineError,
    BatchStateChanged,
    BatchStatus,
    CancelRequested,
    Endpoint,
    RequestFinished,
    utc_now,
)
from schemas.ids import uuid7
from schemas.lifecycle import AsyncComponent

log = logging.getLogger(__name__)
T = TypeVar("T")

ENDPOINTS: tuple[Endpoint, ...] = get_args(Endpoint)
RETRIABLE_CODES = frozenset({"queue_full", "worker_oom", "worker_error", "unavailable", "fault_injected"})
MAX_REPORTED_ERRORS = 100
VALIDATIONS = 2
"""Batches validated at once, one per tenant at most."""
ENDING_GRACE_S = 30.0
"""After a cancel or the expiry, how long lines already running may take to end before the batch is
finalised without them."""
CATCH_UP_LIMIT_S = 300.0
"""How long an ending batch waits for a restarted edge to read the results written while it was down
(``BatchLog.caught_up``) before it ends without them: a log that cannot be read must not hold it for good."""
FOLLOW_IDLE_S = 60.0
"""With no batch unfinished for this long, the edge stops reading the results topic (``BatchLog.unfollow``)."""
PROGRESS_EVERY_S = 1.0
MAX_POSTPONE_S = 60.0
"""The longest a line waits to be prepared again after a retriable refusal (its model being redeployed)."""


class FileInUse(IngestError):
    """A file that an unfinished batch still reads cannot be deleted."""

    status = 409
    error_type = "invalid_request_error"
    default_code = "file_in_use"


def batch_id_ok(batch_id: str) -> bool:
    return batch_id.startswith("batch_") and len(batch_id) == 38 and batch_id[6:].isalnum()


_UNCHECKABLE = LineError("invalid_request", "This line could not be read as a request.")
"""A line that raised what no check expected (the edge's own error, logged): it fails alone."""


def parse_window(value: str) -> timedelta:
    """``24h`` (OpenAI's only value), or any ``<n>h`` / ``<n>m`` / ``<n>s`` from 1 s to 7 days."""
    units = {"h": 3600, "m": 60, "s": 1}
    number, unit = value[:-1], value[-1:]
    # str.isdigit alone takes '²', which int() refuses; and int() refuses over 4,300 digits (7 days is 6)
    digits = number.isascii() and number.isdigit() and len(number) <= 7
    if unit not in units or not digits or not 1 <= int(number) * units[unit] <= 7 * 86400:
        raise InvalidRequest(
            "completion_window must be '24h' (or '<n>h', '<n>m', '<n>s' up to 7 days).",
            param="completion_window",
            code="invalid_completion_window",  # it was null, unlike every other 400 (a review)
        )
    return timedelta(seconds=int(number) * units[unit])


def retriable(finished: RequestFinished) -> bool:
    """A failure that another attempt may not have: the worker was overloaded, died or shut down."""
    if finished.status == "cancelled":
        return True  # not by the batch (that is checked first): a worker shutting down
    if finished.status != "failed" or finished.error is None:
        return False
    return finished.error.retriable or finished.error.code in RETRIABLE_CODES


def _first_time(seen: set[bytes], custom_id: str) -> None:
    digest = hashlib.blake2b(custom_id.encode(), digest_size=16).digest()  # 16 bytes a line, not the id
    if digest in seen:
        raise LineError("duplicate_custom_id", f"custom_id {custom_id!r} appears twice.", "custom_id")
    seen.add(digest)


class ExpiresAfter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    anchor: str
    seconds: int


class CreateBatch(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: ExpiresAfter | None = None
    """When the output and error files expire (OpenAI's; an audit found the SDK's parameter refused)."""


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
"""OpenAI's limits on a batch's ``metadata``. Unbounded, 16 values of 63 KB made every state of the batch
larger than a record may be (an audit)."""


def check_metadata(metadata: dict[str, str]) -> None:
    if len(metadata) > METADATA_PAIRS:
        raise InvalidRequest(f"metadata holds at most {METADATA_PAIRS} pairs.", param="metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"metadata keys are at most {METADATA_KEY_CHARS} characters and values at most "
                f"{METADATA_VALUE_CHARS} (key {echo(key)} has a {len(key)}-character key and a "
                f"{len(value)}-character value).",
                param="metadata",
                code="invalid_metadata",
            )


class BatchRunner(AsyncComponent):
    def __init__(
        self,
        *,
        log: BatchLog,
        settings: EdgeSettings,
        store: FileStore,
        preparer: Preparer,
        tenants: TenantDirectory,
        exhausted: Callable[[str], bool] = lambda tenant: False,
    ) -> None:
        """``exhausted``: whether a tenant's spending budget is used up (its lines wait until it is not)."""
        super().__init__()
        self._exhausted = exhausted
        self._log, self._settings = log, settings
        self.store, self._preparer, self._tenants = store, preparer, tenants
        self._edge_id = settings.edge_id
        self._source = f"ingest/{settings.edge_id}"
        self._root = store.root / "batches"
        self._jobs: dict[str, Job] = {}
        self._in_flight: dict[str, int] = {}
        self._wake = asyncio.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._checks: ThreadPoolExecutor | None = None
        """Validation's own threads: on the file threads, 8 big batches of one tenant held every other
        tenant's batches (and cancels, state writes, journal syncs) behind them for 20 s (an audit)."""
        self._checking: dict[str, asyncio.Semaphore] = {}
        """tenant -> one validation at a time: a tenant's batches take turns, others' go beside them."""
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self._last_progress: dict[str, float] = {}
        self._saving: dict[str, asyncio.Lock] = {}  # a batch's states are written and published in order
        self._idle_since: float | None = None  # no batch unfinished since (monotonic)
        self._resumed = False  # batches ran when this edge started: the first follow reads what they left
        self.follow_idle_s = FOLLOW_IDLE_S

    # ------------------------------------------------------------------ lifecycle

    async def _start(self) -> None:
        await self._log.start()
        self._log.watch(self.fail)
        self._started = True
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="batch-files")
        self._checks = ThreadPoolExecutor(max_workers=VALIDATIONS, thread_name_prefix="batch-validate")
        jobs, ended = await self._blocking(self._reload)
        for state in ended:
            await self._publish_state(state)
        for job in jobs:
            self._jobs[job.state.batch_id] = job
            self._resumed = True
            if job.ending == "cancelled" and job.state.in_progress_at is not None:
                self._cancel_unsettled(job)
            tenant = self._tenants.named(job.state.tenant)
            if job.state.status == "validating" and tenant is not None:
                self._spawn(self._validate(job, tenant), f"batch-validate-{job.state.batch_id}")
            elif job.state.status == "validating":
                # nobody may run its lines now: it stayed validating for good, past its window, and held
                # the edge reading results (a review)
                gone = BatchLineError(
                    code="tenant_unknown",
                    message=f"The batch failed: its tenant {job.state.tenant!r} is no longer configured.",
                )
                await self._fail(job, gone)
        self._spawn(self._pump(), "batch-pump")
        self._spawn(self._collect(), "batch-results")
        self._spawn(self._sweep(), "file-sweep")
        self._wake.set()  # resumed batches go on at once

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this runner's file threads, which :meth:`stop` waits for."""
        if self._pool is None:
            raise RuntimeError("the batch runner is not started")
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("batch task %s failed", task.get_name(), exc_info=task.exception())
            self.fail(task.exception() or RuntimeError(task.get_name()))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        # A cancelled task's file work runs on in its thread: wait for it, so that nothing this runner
        # started writes a batch's state after it stopped (a successor may be reading them by then).
        for pool in (self._pool, self._checks):
            if pool is not None:
                await asyncio.to_thread(pool.shutdown, True, cancel_futures=True)
        self._pool = self._checks = None
        for job in self._jobs.values():
            _close(job)
        if self._started:
            self._started = False
            await self._log.stop()

    async def _sweep(self) -> None:
        """Remove expired files (reads already treat them as gone) and the folders of batches that ended
        longer ago than files live, every ``SWEEP_S``."""
        while True:
            try:
                removed = await self._blocking(self.store.sweep)
                batches = await self._blocking(self.sweep_batches)
            except OSError:
                log.warning("sweeping expired files failed; next try in %.0fs", SWEEP_S, exc_info=True)
            else:
                if removed or batches:
                    log.info("removed %d expired files and %d ended batches", removed, batches)
            await asyncio.sleep(SWEEP_S)

    def sweep_batches(self, now: datetime | None = None) -> int:
        """Remove the folders (state, journal) of batches that ended more than ``ttl_s`` of the file store
        ago, when their output and error files have expired too (0: kept); returns how many. An audit
        found every batch's folder kept for good, its journal holding every output line."""
        ttl = self.store.ttl_s
        if not ttl:
            return 0
        now = now or utc_now()
        cutoff = now - timedelta(seconds=ttl)
        removed = 0
        for path in self._root.glob("*/batch_*/state.json"):
            state = load_state(path)
            if state is None or not state.terminal or state.batch_id in self._jobs or state.time >= cutoff:
                continue
            files = (state.output_file_id, state.error_file_id)
            if any(f and self.store.kept(state.tenant, f, now.timestamp()) for f in files):
                # its files live longer than the store's TTL (``output_expires_after``): the batch stays
                # readable while they are served (a review: GET /v1/batches/{id} was a 404 meanwhile)
                continue
            shutil.rmtree(path.parent, ignore_errors=True)
            removed += 1
        return removed

    def _reload(self) -> tuple[list[Job], list[BatchStateChanged]]:
        """The unfinished batches this edge ran before it stopped, and those that end here (saved, to be
        published): cancelled before they were validated, or failed because their input file is gone."""
        jobs: list[Job] = []
        ended: list[BatchStateChanged] = []
        for path in self._root.glob("*/batch_*/state.json"):
            state = load_state(path)
            if state is None or state.terminal or state.edge_id != self._edge_id:
                continue
            try:
                self._reload_one(path, state, jobs, ended)
            except Exception as exc:  # one batch this cannot resume fails; the edge starts (an audit: a bad
                # journal entry stopped every start of the edge)
                log.exception("batch %s cannot resume; it fails", state.batch_id)
                error = BatchLineError(code="batch_unreadable", message=f"The batch could not resume: {exc}")
                with contextlib.suppress(OSError):
                    ended.append(self._ended_at_reload(path, state, **_failure(state.counts, error)))
        return jobs, ended

    def _reload_one(
        self, path: Path, state: BatchStateChanged, jobs: list[Job], ended: list[BatchStateChanged]
    ) -> None:
        """Resume one unfinished batch of this edge into ``jobs``, or end it into ``ended``."""
        if state.cancelling_at is not None and state.in_progress_at is None:  # no line ever ran
            ended.append(self._ended_at_reload(path, state, status="cancelled", cancelled_at=utc_now()))
            return
        try:
            input_path = self.store.data_path(state.tenant, state.input_file_id)
            job = Job(path.parent, state, input_path)
            job.index_input()
        except (NotFound, OSError):
            log.warning("batch %s: its input file is gone; it cannot resume and fails", state.batch_id)
            error = _input_gone(state.input_file_id)
            counts = _journal_counts(path.parent, state)
            ended.append(self._ended_at_reload(path, state, **_failure(counts, error)))
            return
        if state.status != "validating":
            job.restore()
            job.next_index = 0  # every line without a result is published again
        if state.cancelling_at is not None:
            job.end_as("cancelled", time.monotonic())  # its cancels went out before the stop: it only ends
        elif state.status == "finalizing" and (state.expired_at is not None or not job.settled()):
            # it was ending expired (or lines never ran): every line settled during the expiry's grace
            # made it end ``completed`` at the restart (a review)
            job.end_as("expired", time.monotonic())
        jobs.append(job)
        log.info("batch %s resumes (%s, %d lines)", state.batch_id, state.status, job.total)

    @staticmethod
    def _ended_at_reload(path: Path, state: BatchStateChanged, **changes: Any) -> BatchStateChanged:
        ended = at_time(state, utc_now(), **changes)
        write_atomic(path, encode(ended))
        log.info("batch %s %s at the restart", state.batch_id, ended.status)
        return ended

    # ------------------------------------------------------------------ API

    def _folder(self, tenant: str, batch_id: str) -> Path:
        return self._root / tenant_folder(tenant) / batch_id

    async def create(self, tenant: Tenant, body: CreateBatch) -> BatchStateChanged:
        endpoint = next((e for e in ENDPOINTS if e == body.endpoint), None)
        if endpoint is None:
            raise InvalidRequest(
                f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint", code="invalid_endpoint"
            )
        window = parse_window(body.completion_window)
        stored = self.store.get(tenant.name, body.input_file_id)
        if stored.purpose != "batch":
            raise InvalidRequest(
                "input_file_id must name a file uploaded with purpose 'batch'.", param="input_file_id"
            )
        check_metadata(body.metadata or {})
        expiry = body.output_expires_after
        output_expires_after_s = (
            expires_after(expiry.anchor, str(expiry.seconds), "output_expires_after") if expiry else None
        )
        now = utc_now()
        batch_id = "batch_" + uuid7().replace("-", "")
        state = BatchStateChanged(
            tenant=tenant.name,
            model="",
            source=self._source,
            batch_id=batch_id,
            status="validating",
            endpoint=endpoint,
            completion_window=body.completion_window,
            input_file_id=body.input_file_id,
            edge_id=self._edge_id,
            created_at=now,
            expires_at=now + window,
            metadata=dict(body.metadata or {}),
            output_expires_after_s=output_expires_after_s,
        )
        folder = self._folder(tenant.name, batch_id)
        folder.mkdir(parents=True, exist_ok=True)
        job = Job(folder, state, self.store.data_path(tenant.name, body.input_file_id))
        job.save_state(state)
        self._jobs[batch_id] = job
        await self._publish_state(state)
        self._spawn(self._validate(job, tenant), f"batch-validate-{batch_id}")
        return state

    def get(self, tenant: str, batch_id: str) -> BatchStateChanged:
        job = self._jobs.get(batch_id)
        if job is not None and job.state.tenant == tenant:
            return job.state
        state = load_state(self._folder(tenant, batch_id) / "state.json") if batch_id_ok(batch_id) else None
        if state is None or state.tenant != tenant:
            raise NotFound(f"No such Batch object: {batch_id}", param="batch_id")
        return state

    async def listing(self, tenant: str) -> list[BatchStateChanged]:
        """The tenant's batches, newest first (from every edge sharing the files dir). Their states are
        read on a thread: 3,000 of them stalled the event loop 0.2 s a listing (an audit)."""
        running = {j.state.batch_id: j.state for j in list(self._jobs.values()) if j.state.tenant == tenant}
        folder = self._root / tenant_folder(tenant)
        states = await asyncio.to_thread(
            lambda: [load_state(path) for path in folder.glob("batch_*/state.json")]
        )
        out = {s.batch_id: s for s in states if s is not None and s.tenant == tenant}
        out.update(running)
        return sorted(out.values(), key=lambda s: s.batch_id, reverse=True)

    async def cancel(self, tenant: str, batch_id: str) -> BatchStateChanged:
        """Cancel a batch that is validating or in progress (one that is finalizing has run every line: it
        ends as it is)."""
        state = self.get(tenant, batch_id)
        job = self._jobs.get(batch_id)
        if state.terminal or state.status in ("cancelling", "finalizing"):
            if state.status in ("cancelled", "cancelling"):
                return state
            raise InvalidRequest(
                f"Cannot cancel a batch that is {state.status}.",
                code="batch_not_cancellable",
                param="batch_id",
            )
        if job is None:
            raise InvalidRequest(
                f"Batch {batch_id} runs on edge {state.edge_id}, which is not running; cancel it there.",
                code="batch_not_here",
            )
        if job.ending == "expired":  # its window has passed: it ends expired (a 200 said nothing of it)
            raise InvalidRequest(
                f"Cannot cancel batch {batch_id}: its completion window has passed, and it is ending as "
                "expired.",
                code="batch_not_cancellable",
                param="batch_id",
            )
        cancelling = await self._end(job, "cancelled")
        # The state this cancel made, unless the batch ended meanwhile: while ``cancelling`` was written and
        # published, the pump could finalise the batch (its last running lines ended), and the 200 said
        # ``finalizing``, as if the cancel had come too late (a review).
        return job.state if job.state.terminal else cancelling

    async def delete_file(self, tenant: str, file_id: str) -> None:
        """Delete the tenant's file, unless a batch that has not ended reads it (:class:`FileInUse`): on any
        edge sharing the files dir."""
        self.store.get(tenant, file_id)  # 404 first: another tenant's file is not "in use"
        states = await self.listing(tenant)
        # and, with no await until the file is gone, a batch this edge accepted while they were read (a
        # create registers its job before its first await): it was answered 200 and then failed
        # ``input_file_missing`` (a review). Another edge's create in that window still can.
        states += [job.state for job in list(self._jobs.values()) if job.state.tenant == tenant]
        for state in states:
            if state.input_file_id == file_id and not state.terminal:
                raise FileInUse(
                    f"File {file_id} is the input file of batch {state.batch_id}, which is {state.status}; "
                    "delete it once the batch has ended (a cancel ends it sooner).",
                    param="file_id",
                )
        self.store.delete(tenant, file_id)

    def _running_file(self, tenant: str, file_id: str) -> tuple[Job, bool] | None:
        """The batch of this edge that has not ended whose output (True) or error file is ``file_id``."""
        for job in list(self._jobs.values()):  # read from a thread too (downloads): a copy
            state = job.state
            if (
                state.tenant == tenant
                and not state.terminal
                and file_id in (state.output_file_id, state.error_file_id)
            ):
                return job, file_id == state.output_file_id
        return None

    def partial_output(self, tenant: str, file_id: str) -> Iterator[bytes] | None:
        """The lines so far of a running batch's output or error file ``file_id`` (None: no such), in input
        order."""
        running = self._running_file(tenant, file_id)
        return None if running is None else running[0].lines(ok=running[1])

    def partial_file(self, tenant: str, file_id: str) -> dict[str, Any] | None:
        """OpenAI's file object of a running batch's output or error file, as written so far (None: no
        such; blocking: it reads the lines settled so far)."""
        running = self._running_file(tenant, file_id)
        if running is None:
            return None
        job, ok = running
        state, size, lines = job.state, 0, 0
        for line in job.lines(ok=ok):
            size, lines = size + len(line) + 1, lines + 1
        began = state.in_progress_at or state.created_at
        partial = StoredFile(
            id=file_id,
            tenant=tenant,
            bytes=size,
            created_at=int(began.timestamp()),
            filename=file_name(state.batch_id, ok=ok),
            purpose="batch_output",
            lines=lines,
        )
        why = f"batch {state.batch_id} is {state.status}: {lines} lines so far; the content so far is served"
        return {**partial.openai(), "status": "uploaded", "status_details": why}

    # ------------------------------------------------------------------ validating

    async def _validate(self, job: Job, tenant: Tenant) -> None:
        try:
            async with self._checking.setdefault(tenant.name, asyncio.Semaphore(1)):
                if self._checks is None:
                    raise RuntimeError("the batch runner is not started")
                if job.ending is not None:  # cancelled while it waited its turn
                    return
                check = functools.partial(self._check_file, job, tenant)
                errors, total, model = await asyncio.get_running_loop().run_in_executor(self._checks, check)
        except OSError as exc:  # the input file cannot be read: this batch fails, not the edge
            log.exception("batch %s: validation failed", job.state.batch_id)
            errors, total, model = [BatchLineError(code="unreadable_file", message=str(exc))], 0, ""
        if job.ending is not None:  # cancelled meanwhile: the pump ended it (_step), nothing runs
            return
        now = utc_now()
        if errors:
            await self._change(job, status="failed", failed_at=now, errors=errors)
            self._drop(job)
            return
        await self._change(
            job,
            status="in_progress",
            model=model,
            in_progress_at=now,
            counts=job.counts(),
            output_file_id=new_file_id(),
            error_file_id=new_file_id(),
        )
        log.info("batch %s: %d lines of %s in progress", job.state.batch_id, total, model)
        self._wake.set()

    def _check_file(self, job: Job, tenant: Tenant) -> tuple[list[BatchLineError], int, str]:
        """Every line checked as its request would be (tokenised too), streaming; the first errors. The
        job's line index (offsets, flags) is built in the same pass."""
        errors: list[BatchLineError] = []
        seen: set[bytes] = set()
        offsets, flags = array("Q"), bytearray()
        limit = self._settings.edge_batch_max_lines
        checked = job.state
        for number, (offset, raw) in enumerate(read_lines(job.input_path), start=1):
            if job.ending is not None:  # cancelled: _validate leaves it (a cancel answered in 15 s, and
                break  # the rest of the file was checked for nothing)
            if not raw.strip():
                continue
            if len(offsets) == limit:
                message = f"A batch holds at most {limit:,} lines."
                errors.append(BatchLineError(code="too_many_lines", message=message, line=number))
                break
            offsets.append(offset)
            flags.append(0)
            try:
                parsed = parse_line(raw, checked.endpoint)
                flags[-1] = parsed.flags
                _first_time(seen, parsed.custom_id)
                # The first line naming a model that serves this endpoint names the batch's model: a first
                # line with a typo in it fails as itself, not every later line as naming another model.
                named = checked if checked.model else msgspec.structs.replace(checked, model=parsed.model)
                try:
                    line_request(self._preparer, tenant, named, parsed, len(offsets) - 1, 0, self._source)
                except LineError as exc:
                    if exc.param != "model":
                        checked = named
                    raise
                except IngestError:
                    checked = named
                    raise
                checked = named
            except LineError as exc:
                if len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(exc.at(number))
            except IngestError:  # retriable (its model is being redeployed): checked when it is published
                pass
            # a line nothing above expected fails as a line, not the edge (and every restart)
            except Exception:
                log.exception("batch %s: line %d could not be checked", job.state.batch_id, number)
                if len(errors) < MAX_REPORTED_ERRORS:
                    errors.append(_UNCHECKABLE.at(number))
        if not offsets:
            errors.append(BatchLineError(code="empty_file", message="The input file has no lines."))
        job.set_index(offsets, flags)
        return errors, len(offsets), checked.model

    # ------------------------------------------------------------------ publishing

    async def _pump(self) -> None:
        """Publish what the in-flight windows allow, end batches, report progress; wake on every change."""
        while True:
            timeout = self._next_wake()
            with contextlib.suppress(TimeoutError):
                # not asyncio.wait_for: on 3.11 it swallows a cancel that comes as the wake is set, and
                # stop() then waits for this loop forever (CPython gh-86296, fixed in 3.12)
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            now = time.monotonic()
            await self._follow(now)
            for job in list(self._jobs.values()):
                await self._step(job, now)
            await self._publish(now)
            self._observe()

    async def _follow(self, now: float) -> None:
        """Read the results topic while a batch is unfinished (before any of its lines is published), and
        stop ``follow_idle_s`` after the last one ended: every request's terminal event passes there."""
        if self._unfinished():
            self._idle_since = None
            if not self._log.following:
                await self._log.follow(from_end=not self._resumed)
                self._resumed = False  # from here on, nothing is in flight while it does not follow
            return
        self._resumed = False  # whatever the restart brought back has ended
        if self._idle_since is None:
            self._idle_since = now
        elif now - self._idle_since >= self.follow_idle_s and self._log.following:
            await self._log.unfollow()
            if self._unfinished():  # a batch came in while it stopped: none of its lines is out yet
                self._idle_since = None
                await self._log.follow(from_end=True)

    def _unfinished(self) -> bool:
        return any(not job.state.terminal for job in self._jobs.values())

    def _observe(self) -> None:
        by_status = Counter(job.state.status for job in self._jobs.values())
        for status in ("validating", "in_progress", "cancelling", "finalizing"):
            metrics.BATCHES.labels(status).set(by_status.get(status, 0))
        for model, lines in self._in_flight.items():
            metrics.BATCH_LINES_IN_FLIGHT.labels(model).set(lines)

    def _next_wake(self) -> float:
        """Seconds to the next round: the first retry due of a batch that could publish it then, at most
        :data:`PROGRESS_EVERY_S`. A retry that waits for room in its model's window (woken by a result), for
        its tenant's budget or for nothing (its batch ended) does not count: an audit found the pump going
        round 80-90 times a second for as long as one of those lasted."""
        due = [
            d
            for job in self._jobs.values()
            if (d := job.next_retry_due()) is not None and self._may_publish(job)
        ]
        soonest = min(due, default=time.monotonic() + PROGRESS_EVERY_S)
        return max(0.01, min(PROGRESS_EVERY_S, soonest - time.monotonic()))

    def _may_publish(self, job: Job) -> bool:
        """Whether ``job`` could publish a line now: running, room in its model's window, its tenant not out
        of budget."""
        room = self._settings.edge_batch_max_in_flight - self._in_flight.get(job.state.model, 0)
        return (
            job.state.status == "in_progress"
            and job.ending is None
            and room > 0
            and not self._exhausted(job.state.tenant)
        )

    async def _step(self, job: Job, now: float) -> None:
        state = job.state
        if job.ending is not None and state.in_progress_at is None:  # cancelled while it was validating
            await self._change(job, status="cancelled", cancelled_at=utc_now())  # no line ran: no files
            self._drop(job)  # its validation, still running maybe, sees the cancel and leaves it (_validate)
            log.info("batch %s cancelled before it ran", state.batch_id)
            return
        if state.status == "finalizing":  # the edge stopped while it wrote the files: write them again
            await self._finish(job, job.ending)
            return
        if state.status == "in_progress" and job.ending is None and utc_now() >= state.expires_at:
            await self._end(job, "expired")
        if state.status == "in_progress" and job.ending is None:
            if job.settled():
                await self._finish(job, None)
                return
        elif job.ending is not None and (
            (self._log.caught_up and (job.in_flight == 0 or now - job.ending_since > ENDING_GRACE_S))
            or now - job.ending_since > CATCH_UP_LIMIT_S
        ):
            # caught up: an edge restarted with the batch running first reads the results written while it
            # was down (an audit: a batch whose window passed meanwhile ended at once, its lines that had
            # completed, and were billed, reported batch_expired); a log it cannot read holds it only so long
            await self._finish(job, job.ending)
            return
        if (
            state.status in ("in_progress", "cancelling")
            and now - self._last_progress.get(state.batch_id, 0) >= PROGRESS_EVERY_S
        ):
            counts = job.counts()
            if counts != state.counts:
                await self._change(job, counts=counts)
            self._last_progress[state.batch_id] = now

    async def _publish(self, now: float) -> None:
        """Fill each model's in-flight window, fairly between batches: each running batch first up to its
        share (the window over the batches of that model), then what the others leave to whoever has more
        (work-conserving). A tenant's big batch never holds another's small one back."""
        if not self._log.following:
            return  # a line's result must never land before the results topic is read (_follow)
        window = self._settings.edge_batch_max_in_flight
        running: dict[str, list[Job]] = {}
        for job in self._jobs.values():
            if job.state.status == "in_progress" and job.ending is None:
                running.setdefault(job.state.model, []).append(job)
        for model, jobs in running.items():
            share = max(1, window // len(jobs))
            for job in jobs:
                await self._publish_lines(job, now, share - job.in_flight)
            for job in jobs:
                await self._publish_lines(job, now, window - self._in_flight.get(model, 0))

    async def _publish_lines(self, job: Job, now: float, limit: int) -> None:
        tenant = self._tenants.named(job.state.tenant)
        model = job.state.model
        room = min(limit, self._settings.edge_batch_max_in_flight - self._in_flight.get(model, 0), 64)
        if tenant is None or room <= 0 or not _running(job):
            return  # (or it ended in this round: its input file is gone)
        if self._exhausted(tenant.name):
            # its budget is used up: its lines wait (the pump looks again every second), as its interactive
            # requests get 402; a running batch went on spending (an audit)
            return
        picked: list[tuple[int, int]] = []
        while len(picked) < room and (nxt := job.next_to_publish(now)) is not None:
            picked.append(nxt)
        if not picked:
            return
        try:
            events = await self._blocking(self._line_events, job, tenant, picked)
        except OSError as exc:  # its input file is gone (expired, or deleted from another edge)
            log.warning("batch %s: its input file cannot be read", job.state.batch_id, exc_info=True)
            await self._fail(job, _input_gone(job.state.input_file_id, exc))
            return
        if not _running(job):  # cancelled while they were prepared: they stay pending, never run
            return
        # a line refused for a retriable reason (its model is being redeployed) waits and is prepared again,
        # later the more rounds in a row found nothing to publish
        delay = min(MAX_POSTPONE_S, self._settings.edge_batch_retry_backoff_s * 2**job.unready_rounds)
        published = waited = False
        for (index, attempt), event in zip(picked, events, strict=True):
            if job.status[index] not in (PENDING, RETRY) or job.attempts[index] != attempt:
                # its result was read while it was prepared (a restarted edge reads the results written
                # since its last commit): done, or retried as a later attempt. Marked in flight over done
                # and published again, it waited for a result no worker sends twice (an audit)
                continue
            if isinstance(event, LineError):  # the model or the tenant changed since validation
                self._refuse(job, index, attempt, event)
                continue
            if isinstance(event, IngestError):
                job.postpone(index, delay, now)
                waited = True
                continue
            job.status[index] = IN_FLIGHT
            job.in_flight += 1
            self._in_flight[model] = self._in_flight.get(model, 0) + 1
            self._log.publish_line(event, functools.partial(self._undelivered, job, index))
            published = True
        if published or not waited:
            job.unready_rounds = 0
            self._wake.set()  # more may fit: go round again
        else:  # nothing could be published: the next round when the first postponed line is due
            job.unready_rounds = min(job.unready_rounds + 1, 16)

    def _line_events(self, job: Job, tenant: Tenant, picked: list[tuple[int, int]]) -> list[Any]:
        """Each picked line's event, or the :class:`LineError` that fails it, or the retriable
        :class:`IngestError` it must wait out; :class:`OSError` when the input file cannot be read."""
        out: list[Any] = []
        for index, attempt in picked:
            try:
                parsed = parse_line(job.raw_line(index), job.state.endpoint)
                out.append(
                    line_request(self._preparer, tenant, job.state, parsed, index, attempt, self._source)
                )
            except (LineError, IngestError) as exc:
                out.append(exc)
            except OSError:  # the input file: the caller fails the batch
                raise
            except Exception:  # as in _check_file: the line fails, not the edge
                log.exception("batch %s: line %d could not be prepared", job.state.batch_id, index + 1)
                out.append(_UNCHECKABLE)
        return out

    def _undelivered(self, job: Job, index: int, err: BusError) -> None:
        if self._jobs.get(job.state.batch_id) is not job:  # it ended meanwhile: its lines were counted out
            return  # (an audit: counted out twice, the model's window went negative and over-admitted)
        log.warning("batch %s line %d not published (%s); publishing again", job.state.batch_id, index, err)
        if job.status[index] == IN_FLIGHT:
            job.status[index] = PENDING
            job.in_flight -= 1
            self._in_flight[job.state.model] -= 1
            job.next_index = min(job.next_index, index)
            self._wake.set()

    def _refuse(self, job: Job, index: int, attempt: int, error: LineError) -> None:
        """A line that validated but cannot be published now (its model or tenant changed): it fails."""
        line = msgspec.json.encode(
            {
                "id": None,
                "custom_id": job.custom_id(index),
                "response": None,
                "error": {"code": error.code, "message": error.message},
            }
        )
        job.record(
            JournalEntry(index, attempt, False, True, msgspec.Raw(line)), backoff=0.0, now=time.monotonic()
        )
        metrics.BATCH_LINES.labels(job.state.model, "failed").inc()

    # ------------------------------------------------------------------ results

    async def _collect(self) -> None:
        """Apply the lines' results; commit their offsets once the journals holding them are synced. A
        journal that cannot be written (a full disk) fails its batch, not the edge: an audit found the
        edge failed, and again at every restart while the disk stayed full."""
        while True:
            found = await self._log.results(0.5)
            # The jobs themselves, not their ids: while one journal syncs, the pump can finish another
            # batch of this poll and drop it from ``_jobs`` (a review: a KeyError stopped the edge).
            touched: dict[str, Job] = {}
            broken: dict[str, tuple[Job, OSError]] = {}
            now = time.monotonic()
            for finished in found:
                job = self._jobs.get(finished.batch.batch_id) if finished.batch is not None else None
                if job is None or job.state.status not in ("in_progress", "cancelling"):
                    continue
                batch_id = job.state.batch_id
                if batch_id in broken:
                    continue
                try:
                    self._apply_result(job, finished, now)
                except OSError as exc:
                    broken[batch_id] = (job, exc)
                    continue
                touched[batch_id] = job
            for batch_id, job in touched.items():
                if batch_id in broken:
                    continue
                try:
                    await self._blocking(job.sync)
                except OSError as exc:
                    broken[batch_id] = (job, exc)
            for batch_id, (job, error) in broken.items():
                log.error("batch %s: its journal cannot be written (%s); it fails", batch_id, error)
                await self._fail(job, _write_failed("its results could not be kept", error))
            self._log.handled()
            if touched:
                self._wake.set()

    def _apply_result(self, job: Job, finished: RequestFinished, now: float) -> None:
        ref = finished.batch
        if ref is None or not 0 <= ref.index < job.total:
            return
        was = job.status[ref.index]
        ok, line = output_line(finished, ref, job.state.endpoint, job.base64(ref.index))
        if not ok and ref.attempt < job.attempts[ref.index]:
            # An older attempt's failure, already retried (read again after a restart, or delivered
            # twice): before, its "last attempt?" test read the line's current attempt and failed the line
            # for good, the retry's outcome thrown away (a review).
            return
        final = ok or job.ending is not None or not retriable(finished)
        final = final or ref.attempt + 1 >= self._settings.edge_batch_max_attempts
        entry = JournalEntry(ref.index, ref.attempt, ok, final, msgspec.Raw(line) if final else NO_LINE)
        if job.record(entry, backoff=self._settings.edge_batch_retry_backoff_s, now=now):
            outcome = "completed" if ok else "failed" if final else "retried"
            metrics.BATCH_LINES.labels(job.state.model, outcome).inc()
            if was == IN_FLIGHT:
                self._in_flight[job.state.model] -= 1

    # ------------------------------------------------------------------ ending

    async def _end(self, job: Job, ending: Ending) -> BatchStateChanged:
        """Stop publishing; a cancel also cancels the lines running now (an expiry lets their deadline).
        Returns the state this made (``cancelling``), or the job's as it was (an expiry changes none)."""
        if job.ending is not None:
            return job.state
        job.end_as(ending, time.monotonic())
        made = job.state
        if ending == "cancelled":
            ran = job.state.in_progress_at is not None  # else it is validating: no line was published
            made = await self._change(job, status="cancelling", cancelling_at=utc_now())
            if ran:
                self._cancel_running(job)
                for index in range(job.total):
                    if job.status[index] in (PENDING, RETRY):
                        job.status[index] = PENDING  # never runs now
                job.retries.clear()
        self._wake.set()
        return made

    def _cancel_running(self, job: Job) -> None:
        for index in range(job.total):
            if job.status[index] == IN_FLIGHT:
                self._cancel_line(job, index, job.attempts[index])

    def _cancel_unsettled(self, job: Job) -> None:
        """Cancel again, at a restart, every line of a batch found ``cancelling`` that may have been running
        when the edge stopped. ``cancelling`` is written before its cancels go out, so an edge killed
        between the two left them unsent and those lines ran to their end (a review); a cancel of a
        request that is not running is dropped by the workers."""
        for index, attempt in job.maybe_running(self._settings.edge_batch_max_in_flight):
            self._cancel_line(job, index, attempt)

    def _cancel_line(self, job: Job, index: int, attempt: int) -> None:
        cancel = CancelRequested(
            tenant=job.state.tenant,
            model=job.state.model,
            request_id=item_request_id(job.state, index, attempt),
            source=self._source,
            reason="client_cancel",
        )
        self._log.cancel(cancel)

    async def _fail(self, job: Job, error: BatchLineError) -> None:
        """End a batch that cannot go on as ``failed`` with ``error`` (OpenAI's ``errors``), and no files:
        its lines still running are cancelled. Only this batch ends, never the edge."""
        if job.state.terminal:
            return
        self._cancel_running(job)
        counts = job.counts()
        metrics.BATCH_LINES.labels(job.state.model, "failed").inc(
            counts.total - counts.completed - counts.failed
        )
        await self._change(job, **_failure(counts, error))
        self._drop(job)
        log.warning("batch %s failed: %s", job.state.batch_id, error.message)

    async def _finish(self, job: Job, ending: Ending | None) -> None:
        """Write the output and error files (input order) and the final state."""
        try:  # the results it ends with durable before "finalizing" is: a review found "finalizing" on
            # disk with the last result still in the journal's buffer, which a restart took for a line
            # never run (and ended the batch expired, hours early)
            await self._blocking(job.sync)
        except OSError as exc:
            await self._fail(job, _write_failed("its results could not be kept", exc))
            return
        now = utc_now()
        expired = {"expired_at": job.state.expired_at or now} if ending == "expired" else {}
        # an expiry is kept with the state (``expired_at``): a restart while finalizing ends it so
        await self._change(job, status="finalizing", finalizing_at=now, counts=job.counts(), **expired)
        state = job.state
        out_id, err_id = state.output_file_id or new_file_id(), state.error_file_id or new_file_id()
        try:
            errors = await self._blocking(self._write_files, job, ending, out_id, err_id)
        except Exception as exc:  # a full disk, say: this batch fails (for good: a restart would not help)
            log.exception("batch %s: its output and error files cannot be written", state.batch_id)
            await self._blocking(self._remove_files, state.tenant, out_id, err_id)
            message = f"The batch's output and error files could not be written: {exc}"
            await self._fail(job, BatchLineError(code="output_write_failed", message=message))
            return
        now = utc_now()
        final: BatchStatus = ending or "completed"
        times = {"expired": {"expired_at": state.expired_at or now}, "cancelled": {"cancelled_at": now}}.get(
            final, {"completed_at": now}
        )
        counts = job.counts()
        if ending is not None:  # lines that never ran count as failed
            unrun = counts.total - counts.completed - counts.failed
            metrics.BATCH_LINES.labels(state.model, "failed").inc(unrun)
            counts = msgspec.structs.replace(counts, failed=counts.total - counts.completed)
        await self._change(
            job,
            status=final,
            counts=counts,
            output_file_id=out_id,
            error_file_id=err_id if errors else None,
            **times,
        )
        self._drop(job)
        log.info(
            "batch %s %s: %d completed, %d failed", state.batch_id, final, counts.completed, counts.failed
        )

    def _write_files(self, job: Job, ending: Ending | None, out_id: str, err_id: str) -> int:
        """The output and error files (not bounded by the upload limit); how many error lines."""
        state = job.state
        out_name, err_name = file_name(state.batch_id, ok=True), file_name(state.batch_id, ok=False)
        ttl = state.output_expires_after_s
        with self.store.writer(
            state.tenant, out_name, "batch_output", out_id, bounded=False, ttl_s=ttl
        ) as out:
            for line in job.lines(ok=True):
                out.write(line + b"\n")
        errors = 0
        with self.store.writer(
            state.tenant, err_name, "batch_output", err_id, bounded=False, ttl_s=ttl
        ) as err:
            for line in job.lines(ok=False, ending=ending):
                err.write(line + b"\n")
                errors += 1
        if not errors:
            self.store.delete(state.tenant, err_id)
        return errors

    def _remove_files(self, tenant: str, *file_ids: str) -> None:
        """Remove what a failed write left (a file it finished), best effort."""
        for file_id in file_ids:
            with contextlib.suppress(NotFound, OSError):
                self.store.delete(tenant, file_id)

    def _drop(self, job: Job) -> None:
        _close(job)
        if job.state.terminal and job.saved_seq == job.state.seq:
            # its results are in its files now (or it failed): an audit found every ended batch's journal
            # kept for good, output lines and all, after its files were deleted or expired. Kept while the
            # final state is not on disk: a restart reading the state before it resumes from the journal.
            with contextlib.suppress(OSError):
                job.journal_path.unlink(missing_ok=True)
        self._jobs.pop(job.state.batch_id, None)
        self._last_progress.pop(job.state.batch_id, None)
        self._saving.pop(job.state.batch_id, None)
        for index in range(job.total):
            if job.status[index] == IN_FLIGHT:
                self._in_flight[job.state.model] -= 1

    # ------------------------------------------------------------------ state

    async def _change(self, job: Job, **changes: Any) -> BatchStateChanged:
        """The batch's next state: what every reader of the job sees at once (a cancel coming meanwhile
        sees it ``finalizing``, say), then written and published, in order. Returns it (the job's may be a
        later one by then)."""
        state = at_time(job.state, utc_now(), **changes)
        job.state = state
        async with self._saving.setdefault(state.batch_id, asyncio.Lock()):
            try:
                await self._blocking(job.write_state, state)
            except OSError as exc:  # a full disk: the state still goes on the log, and the next one is
                # written whole (an audit: this failed the edge, and a cancel answered 500)
                log.warning("batch %s: its %s state was not written (%s)", state.batch_id, state.status, exc)
            await self._publish_state(state)
        return state

    async def _publish_state(self, state: BatchStateChanged) -> None:
        try:
            await self._log.publish_state(state)
        except BusError:  # state.json holds it; the next change publishes the whole state again
            log.warning("batch %s: state not published", state.batch_id, exc_info=True)


def _close(job: Job) -> None:
    """Close a job's files; one that cannot be synced (a full disk) is logged, not raised: whatever closes
    it (its end, the runner's stop) must go on."""
    try:
        job.close()
    except OSError as exc:
        log.warning("batch %s: its journal could not be synced at close (%s)", job.state.batch_id, exc)


def _write_failed(what: str, exc: OSError) -> BatchLineError:
    return BatchLineError(
        code="output_write_failed", message=f"The batch failed: {what} ({exc.strerror or exc})."
    )


def _running(job: Job) -> bool:
    """Its lines may be published: in progress, not ending."""
    return job.state.status == "in_progress" and job.ending is None


def _journal_counts(folder: Path, state: BatchStateChanged) -> BatchCounts:
    """A batch's counts as its journal has them, without its input file: ``state.counts`` is only as new as
    the last state written, and lines may have settled since (the journal is synced before their offsets
    are committed, so it is the truth)."""
    total = state.counts.total
    job = Job(folder, state, folder / "input-gone")
    job.set_index(array("q", [0]) * total, bytearray(total))
    job.restore()
    job.close()
    return job.counts()


def _input_gone(file_id: str, exc: OSError | None = None) -> BatchLineError:
    why = f" ({exc.strerror or exc})" if exc is not None else ""
    return BatchLineError(
        code="input_file_missing",
        message=f"The input file {file_id} is gone (deleted or expired) before the batch ended{why}.",
        param="input_file_id",
    )


def _failure(counts: BatchCounts, error: BatchLineError) -> dict[str, Any]:
    """The changes that end a batch ``failed`` after it started: ``error``, no files, the lines that did not
    complete counted failed."""
    return {
        "status": "failed",
        "failed_at": utc_now(),
        "errors": [error],
        "output_file_id": None,
        "error_file_id": None,
        "counts": msgspec.structs.replace(counts, failed=counts.total - counts.completed),
    }


def file_name(batch_id: str, *, ok: bool) -> str:
    """The name of a batch's output (``ok``) or error file."""
    return f"{batch_id}_{'output' if ok else 'error'}.jsonl"


def batch_object(state: BatchStateChanged) -> dict[str, Any]:
    """OpenAI's batch object."""

    def ts(value: datetime | None) -> int | None:
        return int(value.timestamp()) if value is not None else None

    errors = (
        {"object": "list", "data": [msgspec.to_builtins(e) for e in state.errors]} if state.errors else None
    )
    return {
        "id": state.batch_id,
        "object": "batch",
        "endpoint": state.endpoint,
        "model": state.model or None,
        "errors": errors,
        "input_file_id": state.input_file_id,
        "completion_window": state.completion_window,
        "status": state.status,
        "output_file_id": state.output_file_id,
        # a running batch names its error file once a line failed: one that ends without errors has none
        "error_file_id": state.error_file_id if state.terminal or state.counts.failed else None,
        "created_at": ts(state.created_at),
        "in_progress_at": ts(state.in_progress_at),
        "expires_at": ts(state.expires_at),
        "finalizing_at": ts(state.finalizing_at),
        "completed_at": ts(state.completed_at),
        "failed_at": ts(state.failed_at),
        "expired_at": ts(state.expired_at),
        "cancelling_at": ts(state.cancelling_at),
        "cancelled_at": ts(state.cancelled_at),
        "request_counts": msgspec.to_builtins(state.counts),
        "metadata": state.metadata or None,
    }
