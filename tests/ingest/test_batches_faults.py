"""The Batch and Files APIs under faults and hostile input an audit found (2026-11-30): a full disk, state
that grows with what a tenant sends, one tenant's validations holding the others', files kept for good, a
damaged journal, races between a reader of a running batch's files and its results."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest
from openai import AsyncOpenAI
from openai.types import Batch

from bus.errors import BusError
from ingest.app import Edge
from ingest.auth import DEMO_KEY, TenantDirectory
from ingest.batch_job import Job
from ingest.batches import BatchRunner
from ingest.files import FileStore, FileWriter
from schemas.events import BatchItemRequested, BatchLineError, BatchStateChanged, RequestFinished
from tests.ingest.conftest import AUTH, OTHER_KEY, Client, MakeClient
from tests.ingest.fake_batch_log import FakeBatchLog, complete, failing
from tests.ingest.fake_gateway import FakeGateway
from tests.ingest.test_batch_job import job_of, result
from tests.ingest.test_batches import CHAT, _eventually, chat_line, jsonl, run, until


def _no_space(*_args: Any, **_kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


def _sdk(client: Client, key: str = DEMO_KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


@dataclass
class Held:
    """A batch whose published lines the workers hold (answer them with ``batch_log.answer``)."""

    client: Client
    edge: Edge
    sdk: AsyncOpenAI
    batch: Batch
    lines: list[BatchItemRequested]

    @property
    def runner(self) -> BatchRunner:
        assert self.edge.batches is not None
        return self.edge.batches


@contextlib.asynccontextmanager
async def held_batch(
    make_client: MakeClient,
    batch_log: FakeBatchLog,
    lines: int,
    *,
    published: int | None = None,
    **settings: Any,
) -> AsyncIterator[Held]:
    """An edge running a batch of ``lines`` chat lines, once ``published`` of them (all) are out and held."""
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: held.append(event)
    client, edge = await make_client(**settings)
    async with _sdk(client) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(lines)])
        await _eventually(lambda: len(held) == (lines if published is None else published))
        yield Held(client, edge, sdk, created, held)


# --- a full disk ---------------------------------------------------------------------------------------------


async def test_a_journal_that_cannot_be_synced_fails_its_batch_not_the_edge(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Results came back after the disk filled up: the journal's sync raised ENOSPC out of the results loop,
    which failed the edge (interactive traffic included), and again at every restart while the disk stayed
    full; stopping that edge raised too."""
    async with held_batch(make_client, batch_log, 3) as held:
        monkeypatch.setattr(Job, "sync", _no_space)
        monkeypatch.setattr(Job, "write_state", _no_space)
        for event in held.lines:
            batch_log.answer(complete(event))
        await _eventually(lambda: batch_log.states[-1].status == "failed")
        failed = batch_log.states[-1]
        assert failed.batch_id == held.batch.id
        assert [e.code for e in failed.errors] == ["output_write_failed"]
        assert "No space left on device" in failed.errors[0].message
        assert held.edge.failure is None
        response = await held.client.get("/healthz")
        assert response.status == 200
        monkeypatch.undo()
        batch_log.respond = complete
        other = await until(held.sdk, (await run(held.sdk, [chat_line(0)])).id, "completed")  # it goes on
        assert other.request_counts is not None
        assert other.request_counts.completed == 1
    await held.edge.stop()  # closing a job whose journal cannot be synced does not stop the stop


async def test_a_cancel_with_the_disk_full_is_answered(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with held_batch(make_client, batch_log, 3) as held:
        monkeypatch.setattr(Job, "write_state", _no_space)
        cancelling = await held.sdk.batches.cancel(held.batch.id)
        assert cancelling.status == "cancelling"
        assert held.edge.failure is None


async def test_an_upload_on_a_full_disk_is_a_507_in_openai_shape(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(FileWriter, "write", _no_space)
    response = await client.post(
        "/v1/files", data={"purpose": "batch", "file": io.BytesIO(b"{}\n")}, headers=AUTH
    )
    assert response.status == 507
    error = (await response.json())["error"]
    assert (error["code"], error["type"]) == ("storage_full", "server_error")
    assert response.headers["x-should-retry"] == "true"


async def test_a_tenant_stores_no_more_than_its_quota(make_client: MakeClient, tmp_path: Path) -> None:
    """Any tenant could fill the disk: 200 MB a file, no limit on files, kept 30 days."""
    client, edge = await make_client(edge_files_max_bytes_per_tenant=10_000)
    assert edge.ctx is not None
    async with _sdk(client) as sdk, _sdk(client, OTHER_KEY) as other:
        first = await sdk.files.create(file=("a.jsonl", io.BytesIO(b"x" * 6000 + b"\n")), purpose="batch")
        response = await client.post(
            "/v1/files", data={"purpose": "batch", "file": io.BytesIO(b"y" * 5000 + b"\n")}, headers=AUTH
        )
        assert response.status == 413
        error = (await response.json())["error"]
        assert error["code"] == "storage_quota_exceeded"
        assert "10,000 bytes" in error["message"]
        assert [f.id for f in (await sdk.files.list()).data] == [first.id]  # nothing half-kept
        await other.files.create(
            file=("b.jsonl", io.BytesIO(b"z" * 6000 + b"\n")), purpose="batch"
        )  # its own
        await sdk.files.delete(first.id)
        await sdk.files.create(file=("c.jsonl", io.BytesIO(b"y" * 5000 + b"\n")), purpose="batch")


# --- what a tenant's input makes the batch's state hold ------------------------------------------------------


async def test_an_echoed_value_is_cut_and_the_state_stays_small(
    client: Client, batch_log: FakeBatchLog
) -> None:
    """100 lines whose url was 100 KB each made a failed batch's state 10 MB: over a record's limit, so it was
    never published, and the batch read ``validating`` everywhere but this edge."""
    lines = [{**chat_line(i), "url": "/v1/" + "x" * 100_000} for i in range(100)]
    async with _sdk(client) as sdk:
        failed = await until(sdk, (await run(sdk, lines)).id, "failed")
    assert failed.errors is not None
    assert failed.errors.data is not None
    message = failed.errors.data[0].message or ""
    assert len(message) < 300
    assert "(100,004 characters)" in message
    assert len(msgspec.json.encode(batch_log.states[-1])) < 100_000


@pytest.mark.parametrize("metadata", [{"k" * 65: "v"}, {"key": "v" * 513}, {f"k{i}": "v" for i in range(17)}])
async def test_metadata_past_openais_limits_is_a_400(client: Client, metadata: dict[str, str]) -> None:
    async with _sdk(client) as sdk:
        uploaded = await sdk.files.create(
            file=("in.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch"
        )
    response = await client.post(
        "/v1/batches",
        json={"input_file_id": uploaded.id, "endpoint": CHAT, "metadata": metadata},
        headers=AUTH,
    )
    assert response.status == 400
    assert (await response.json())["error"]["param"] == "metadata"


# --- one tenant's validations and the others' ----------------------------------------------------------------


async def test_one_tenants_validations_do_not_hold_anothers(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 big batches of one tenant held another tenant's 1-line batch 22 s, and a cancel 15 s: validation
    shared the runner's file threads with state writes and journal syncs, with no limit per tenant."""
    release = threading.Event()
    checking: list[str] = []
    check = BatchRunner._check_file

    def slow(self: BatchRunner, job: Job, tenant: Any) -> Any:
        checking.append(tenant.name)
        if tenant.name == "demo":
            release.wait(10)
        return check(self, job, tenant)

    monkeypatch.setattr(BatchRunner, "_check_file", slow)
    client, _ = await make_client()
    try:
        async with _sdk(client) as sdk, _sdk(client, OTHER_KEY) as other:
            big = [await run(sdk, [chat_line(i) for i in range(3)]) for _ in range(4)]
            await _eventually(lambda: checking.count("demo") == 1)  # one of its validations at a time
            small = await run(other, [chat_line(0)])
            done = await until(other, small.id, "completed", within_s=5)
            assert done.status == "completed"
            assert checking.count("demo") == 1
            cancelled = await sdk.batches.cancel(big[-1].id)  # waiting its turn: answered at once
            assert cancelled.status in ("cancelling", "cancelled")
    finally:
        release.set()


# --- files kept for good ---------------------------------------------------------------------------------------


async def test_an_ended_batch_keeps_no_journal_and_its_folder_goes_after_the_file_ttl(
    make_client: MakeClient, tmp_path: Path
) -> None:
    client, edge = await make_client()
    async with _sdk(client) as sdk:
        done = await until(sdk, (await run(sdk, [chat_line(i) for i in range(3)])).id, "completed")
    runner = edge.batches
    assert runner is not None
    (folder,) = [p.parent for p in (tmp_path / "files" / "batches").glob("*/batch_*/state.json")]
    assert folder.name == done.id
    # its output lines are in its output file (removed once its final state is on disk, a moment after the
    # API shows it: the state changes first)
    await _eventually(lambda: not (folder / "journal.jsonl").exists())
    assert runner.sweep_batches() == 0
    assert runner.sweep_batches(now=done_at(done) + timedelta(days=29)) == 0
    assert runner.sweep_batches(now=done_at(done) + timedelta(days=31)) == 1
    assert not folder.exists()


async def test_an_ended_batch_stays_while_its_output_file_outlives_the_file_ttl(
    make_client: MakeClient, tmp_path: Path
) -> None:
    """Found by a review: the folder went once the store's TTL passed, while the batch's own
    ``output_expires_after`` kept its output file served: ``GET /v1/batches/{id}`` was a 404 meanwhile."""
    client, edge = await make_client(edge_file_ttl_s=3600)
    async with _sdk(client) as sdk:
        created = await run(sdk, [chat_line(0)], output_expires_s=7 * 86_400)
        done = await until(sdk, created.id, "completed")
    runner = edge.batches
    assert runner is not None
    (folder,) = [p.parent for p in (tmp_path / "files" / "batches").glob("*/batch_*/state.json")]
    # the runner lets go of the batch just after its final state is served (CI once swept in between: a
    # batch still held is never swept)
    await _eventually(lambda: created.id not in runner._jobs)
    assert runner.sweep_batches(now=done_at(done) + timedelta(days=2)) == 0  # its output still served
    assert folder.exists()
    assert runner.sweep_batches(now=done_at(done) + timedelta(days=8)) == 1
    assert not folder.exists()


def done_at(batch: Any) -> datetime:
    return datetime.fromtimestamp(batch.completed_at, UTC)


# --- a damaged journal -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry", [[99, 0, True, True, None], [-1, 0, True, True, None], [1, 4096, False, False, None]]
)
def test_a_journal_entry_no_edge_writes_is_read_as_torn(tmp_path: Path, entry: list[Any]) -> None:
    """An entry that is JSON but not one this edge writes (an index past the end, a negative one, an attempt
    past a byte) stopped every start of the edge (IndexError, OverflowError), or was applied to the last line."""
    job = job_of(tmp_path, 3)
    good = msgspec.json.encode(result(0))
    job.journal_path.write_bytes(
        good + b"\n" + json.dumps(entry).encode() + b"\n" + msgspec.json.encode(result(2)) + b"\n"
    )
    job.restore()
    job.close()
    assert job.counts().completed == 1
    assert job.journal_path.read_bytes() == good + b"\n"  # cut where it stops being readable


async def test_a_batch_that_cannot_resume_fails_and_the_edge_starts(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with held_batch(make_client, batch_log, 3) as held:
        created = held.batch
    await held.client.close()
    monkeypatch.setattr(Job, "restore", lambda self: (_ for _ in ()).throw(ValueError("what no edge wrote")))
    second, edge = await make_client()
    async with _sdk(second) as sdk:
        failed = await until(sdk, created.id, "failed")
    assert failed.errors is not None
    assert failed.errors.data is not None
    assert failed.errors.data[0].code == "batch_unreadable"
    assert edge.failure is None


# --- a reader of a running batch's files -------------------------------------------------------------------


def test_a_result_recorded_while_a_reader_syncs_is_synced_before_its_offsets_commit(tmp_path: Path) -> None:
    """A result recorded while a reader of the running batch's files synced the journal had its flag
    cleared by that reader after the fsync: the runner's own sync skipped it, and its offset was committed
    with the entry not on disk."""
    job = job_of(tmp_path, 2)
    job.record(result(0), backoff=0.0, now=0.0)
    in_fsync, go_on = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        in_fsync.set()
        go_on.wait(5)
        real_fsync(fd)

    reader = threading.Thread(target=job.sync)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", slow_fsync)
        reader.start()
        assert in_fsync.wait(5)
        job.record(result(1), backoff=0.0, now=0.0)
        go_on.set()
        reader.join(5)
        assert not reader.is_alive(), "the reader's sync never returned"
    synced: list[int] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", lambda fd: synced.append(fd))
        job.sync()  # the runner's, before it commits the second result's offset
    job.close()
    assert synced, "the second result was taken as synced"


# --- cancels and windows ---------------------------------------------------------------------------------------


async def test_a_cancel_of_a_batch_ending_expired_says_so(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    async with held_batch(make_client, batch_log, 2) as held:
        # its window passed: it waits for its lines
        held.runner._jobs[held.batch.id].end_as("expired", time.monotonic())
        response = await held.client.post(f"/v1/batches/{held.batch.id}/cancel", headers=AUTH)
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "batch_not_cancellable"


async def test_a_cancel_racing_its_batchs_last_results_answers_cancelling(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: while the ``cancelling`` state was published (acks=all on Kafka: a round trip),
    the lines still running ended and the pump finalised the batch; the cancel's 200 read the job's state
    after that, ``finalizing``, as if the cancel had been refused. It answers the state it made."""
    publishing, release = asyncio.Event(), asyncio.Event()
    plain = batch_log.publish_state

    async def held_cancelling(state: BatchStateChanged) -> None:
        if state.status == "cancelling":
            publishing.set()
            await release.wait()  # the broker's round trip
        await plain(state)

    monkeypatch.setattr(batch_log, "publish_state", held_cancelling)
    async with held_batch(make_client, batch_log, 4) as held:
        cancel = asyncio.create_task(held.sdk.batches.cancel(held.batch.id))
        await asyncio.wait_for(publishing.wait(), 5)
        for event in held.lines:  # the running lines end while the cancel is on its way
            batch_log.answer(complete(event))
        job = held.runner._jobs[held.batch.id]
        await _eventually(lambda: job.state.status == "finalizing")
        release.set()
        assert (await cancel).status == "cancelling"
        done = await until(held.sdk, held.batch.id, "cancelled", "completed")
    assert done.status == "cancelled"
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)


async def test_a_delivery_failure_after_its_batch_ended_is_not_counted_out_twice(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    async with held_batch(make_client, batch_log, 4) as held:
        runner = held.runner
        job = runner._jobs[held.batch.id]
        await runner._fail(job, BatchLineError(code="output_write_failed", message="the disk"))
        model = job.state.model
        assert runner._in_flight[model] == 0
        runner._undelivered(job, 0, BusError("late"))
        assert runner._in_flight[model] == 0


def test_a_tenants_usage_counts_its_files_only(tmp_path: Path) -> None:
    store = FileStore(tmp_path, max_bytes=1 << 20)
    assert store.usage("demo") == (0, 0)
    with store.writer("demo", "a", "batch") as out:
        out.write(b"x" * 5000)
    with store.writer("other", "b", "batch") as out:
        out.write(b"y" * 6000)
    assert (store.usage("demo"), store.usage("other")) == ((5000, 1), (6000, 1))


async def test_a_running_batch_waits_while_its_tenants_budget_is_used_up(
    make_client: MakeClient, batch_log: FakeBatchLog, gateway: FakeGateway
) -> None:
    """Found by an audit: once the tenant's budget was exhausted its interactive requests got 402, but its
    running batch published every line left and completed. Its lines now wait, and go on when the budget
    allows again."""
    async with held_batch(make_client, batch_log, 6, published=2, edge_batch_max_in_flight=2) as held:
        gateway.exhausted.add("demo")
        for event in held.lines:
            batch_log.answer(complete(event))
        await asyncio.sleep(1.5)  # the pump looks again every second
        assert len(batch_log.lines) == 2
        assert (await held.sdk.batches.retrieve(held.batch.id)).status == "in_progress"
        gateway.exhausted.discard("demo")
        batch_log.respond = complete
        done = await until(held.sdk, held.batch.id, "completed")
        assert done.request_counts is not None
        assert done.request_counts.completed == 6


async def test_a_retried_lines_failure_read_again_does_not_end_it(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """Found by review: an older attempt's retriable failure read a second time (results are read at least
    once: an edge restart reads again what it had not committed) was taken as the line's last attempt's,
    the line failed for good and its next attempt's success thrown away."""

    def respond(event: BatchItemRequested) -> RequestFinished | None:
        if event.attempt == 1:
            again = failing("queue_full")(event)
            assert again is not None
            batch_log.answer(again)  # delivered twice
            return again
        return failing("queue_full")(event) if event.attempt == 0 else complete(event)

    batch_log.respond = respond
    client, _ = await make_client(edge_batch_retry_backoff_s=0.01, edge_batch_max_attempts=3)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, (await run(sdk, [chat_line(0)])).id, "completed")
    assert sorted(e.attempt for e in batch_log.lines) == [0, 1, 2]
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (1, 0)


async def test_a_validating_batch_whose_tenant_is_gone_at_a_restart_fails(
    make_client: MakeClient,
    batch_log: FakeBatchLog,
    tenants: TenantDirectory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found by review: reloaded by a restarted edge after its tenant left the tenants file, a batch still
    validating was never validated nor expired (only a running batch expires), and kept the edge reading
    results for good."""
    release = threading.Event()
    check = BatchRunner._check_file

    def held(self: BatchRunner, job: Job, tenant: Any) -> Any:
        release.wait(10)
        return check(self, job, tenant)

    monkeypatch.setattr(BatchRunner, "_check_file", held)
    one, _ = await make_client()
    async with AsyncOpenAI(base_url=str(one.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(0)], window="1s")
    asyncio.get_running_loop().call_later(0.3, release.set)
    await one.close()  # stopped while validating
    monkeypatch.setattr(BatchRunner, "_check_file", check)
    monkeypatch.delitem(tenants._by_name, "demo")  # gone from the tenants file meanwhile
    await make_client()
    (last,) = [s for s in batch_log.states if s.batch_id == created.id][-1:]
    assert last.status == "failed"
    assert [e.code for e in last.errors] == ["tenant_unknown"]


async def test_two_batches_settling_in_one_results_poll_do_not_kill_the_edge(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: after a results poll the runner synced each touched batch's journal and looked
    each up again by id; while one synced, the pump finished the other (its lines settled) and dropped it:
    a KeyError stopped the runner, and with it the edge."""
    held: list[BatchItemRequested] = []
    batch_log.respond = held.append
    client, edge = await make_client()
    runner = edge.batches
    assert runner is not None
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        a = await run(sdk, [chat_line(0)])
        b = await run(sdk, [chat_line(0)])
        await _eventually(lambda: len(held) == 2)

        # The first journal sync of the results loop takes a while (a slow disk, a loaded box): long
        # enough for the pump's next round (at most 1 s away) to finish the other, settled, batch.
        original = Job.sync
        first = threading.Event()

        def slow_sync(self: Job) -> None:
            if not first.is_set() and threading.current_thread().name.startswith("batch-files"):
                first.set()
                others = {a.id, b.id} - {self.state.batch_id}
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline and others & set(runner._jobs):
                    time.sleep(0.01)
            original(self)

        monkeypatch.setattr(Job, "sync", slow_sync)
        for event in held:  # both lines' results come back in one poll
            batch_log.answer(complete(event))
        for batch in (a, b):
            done = await until(sdk, batch.id, "completed", "failed")
            assert done.status == "completed"
        await asyncio.sleep(0.3)
    assert runner.failure is None, f"the batch runner died: {runner.failure!r}"
    assert edge.failure is None, f"the edge failed: {edge.failure!r}"


async def test_the_finalizing_state_is_never_on_disk_before_the_results_that_settled_it(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: with the results loop's journal sync slow (a slow disk, busy file threads), the
    pump wrote ``finalizing`` while the journal still held the results that settled the batch; an edge
    killed then resumed it with a line unsettled, took it for never run, and ended the batch expired."""
    original_sync, original_write = Job.sync, Job.write_state
    first = threading.Event()
    unsynced_at_finalizing: list[bool] = []

    def slow_sync(self: Job) -> None:
        if self._dirty_journal and not first.is_set():  # the results loop's sync of the last results
            first.set()
            time.sleep(1.5)  # the pump's next round (at most 1 s away) comes first
        original_sync(self)

    def write_state(self: Job, state: Any) -> None:
        if state.status == "finalizing":
            unsynced_at_finalizing.append(self._dirty_journal)
        original_write(self, state)

    monkeypatch.setattr(Job, "sync", slow_sync)
    monkeypatch.setattr(Job, "write_state", write_state)
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(3)])
        await until(sdk, created.id, "completed")
    assert unsynced_at_finalizing == [False], "finalizing was made durable before the results that settled it"
