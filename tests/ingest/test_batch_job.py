"""A batch's bookkeeping as a plain object: memory bounded by the line count (100k lines), the journal
replayed after a crash (a torn last write included), retries scheduled with backoff."""

from __future__ import annotations

import json
import time
import tracemalloc
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgspec
import pytest

from ingest.auth import TenantDirectory
from ingest.batch_job import DONE, FAILED, PENDING, RETRY, Job, JournalEntry
from ingest.batch_lines import parse_line
from ingest.batches import BatchRunner
from ingest.files import FileStore
from ingest.models import ModelCatalogue
from ingest.prepare import Preparer
from schemas.events import BatchStateChanged, ReplyTo
from tests.ingest.conftest import EMB, settings
from tests.ingest.fake_batch_log import FakeBatchLog

T0 = datetime(2026, 11, 25, 12, 0, tzinfo=UTC)


def state(total: int = 0) -> BatchStateChanged:
    return BatchStateChanged(
        tenant="demo",
        model=EMB,
        source="test",
        batch_id="batch_" + "0" * 32,
        status="in_progress",
        endpoint="/v1/embeddings",
        completion_window="24h",
        input_file_id="file-" + "1" * 32,
        edge_id="edge-test",
        created_at=T0,
        expires_at=T0 + timedelta(hours=24),
    )


def write_input(path: Path, lines: int) -> None:
    with path.open("w") as out:
        for i in range(lines):
            body = {"model": EMB, "input": "hello world the fox"}
            out.write(
                json.dumps(
                    {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings", "body": body}
                )
            )
            out.write("\n")


def job_of(tmp_path: Path, lines: int) -> Job:
    (tmp_path / "job").mkdir()
    write_input(tmp_path / "in.jsonl", lines)
    job = Job(tmp_path / "job", state(), tmp_path / "in.jsonl")
    job.index_input()
    return job


def result(index: int, attempt: int = 0, *, ok: bool = True, final: bool = True) -> JournalEntry:
    line = msgspec.json.encode({"custom_id": f"line-{index}", "attempt": attempt}) if final else b"null"
    return JournalEntry(index, attempt, ok, final, msgspec.Raw(line))


@pytest.mark.timeout(300)
def test_100k_lines_are_validated_run_and_written_in_bounded_memory(
    tmp_path: Path, catalogue: ModelCatalogue
) -> None:
    lines = 100_000
    write_input(tmp_path / "in.jsonl", lines)
    tenants = TenantDirectory.demo()
    tenant = tenants.named("demo")
    assert tenant is not None
    edge = settings(edge_batch_max_lines=lines)
    runner = BatchRunner(
        log=FakeBatchLog(),
        settings=edge,
        store=FileStore(tmp_path / "files", max_bytes=1 << 30),
        preparer=Preparer(catalogue, edge, ReplyTo(topic="r", partition=0, edge_id="e")),
        tenants=tenants,
    )
    (tmp_path / "job").mkdir()
    job = Job(tmp_path / "job", msgspec.structs.replace(state(), model=""), tmp_path / "in.jsonl")

    tracemalloc.start()
    errors, total, model = runner._check_file(job, tenant)  # every line parsed and tokenised
    validated = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    assert job.total == lines  # the same pass indexed the lines
    for i in range(lines):
        job.record(result(i), backoff=0.0, now=0.0)
    written = sum(1 for _ in job.lines(ok=True))
    ran = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    job.close()

    assert (errors, total, model, written) == ([], lines, EMB, lines)
    # a 16-byte digest per custom_id while validating; a few bytes per line after (no line is kept)
    assert validated < 24 * 2**20, validated
    assert ran < 8 * 2**20, ran
    assert job.counts().completed == lines


def test_the_journal_replays_into_the_same_states_and_a_torn_write_is_dropped(tmp_path: Path) -> None:
    job = job_of(tmp_path, 6)
    job.record(result(0), backoff=0.0, now=0.0)
    job.record(result(1, ok=False), backoff=0.0, now=0.0)
    job.record(result(2, ok=False, final=False), backoff=0.0, now=0.0)  # retriable: attempt 1 next
    assert not job.record(result(0, attempt=1), backoff=0.0, now=0.0)  # a line settles once
    job.close()
    with job.journal_path.open("ab") as journal:
        journal.write(b"[3,0,true,tr")  # the edge died mid-write

    again = Job(job.folder, job.state, job.input_path)
    again.index_input()
    again.restore()
    assert list(again.status) == [DONE, FAILED, RETRY, PENDING, PENDING, PENDING]
    assert again.attempts[2] == 1
    assert again.result_line(0) == msgspec.json.encode({"custom_id": "line-0", "attempt": 0})
    assert list(again.lines(ok=True)) == [again.result_line(0)]
    assert again.next_to_publish(time.monotonic()) == (2, 1)  # the retry is due at once after a restart
    assert again.next_to_publish(time.monotonic()) == (3, 0)
    again.record(result(3), backoff=0.0, now=0.0)  # the torn bytes are gone: the journal goes on cleanly
    again.close()
    third = Job(job.folder, job.state, job.input_path)
    third.index_input()
    third.restore()
    assert list(third.status)[:4] == [DONE, FAILED, RETRY, DONE]


def test_retries_wait_their_backoff_and_lines_go_out_in_input_order(tmp_path: Path) -> None:
    job = job_of(tmp_path, 3)
    now = 1000.0
    assert [job.next_to_publish(now) for _ in range(3)] == [(0, 0), (1, 0), (2, 0)]
    assert job.next_to_publish(now) is None
    job.record(result(1, ok=False, final=False), backoff=2.0, now=now)
    due = job.next_retry_due()
    assert due is not None
    assert now + 1.0 <= due <= now + 3.0  # 2 s x 0.5-1.5 jitter
    assert job.next_to_publish(due - 0.01) is None
    assert job.next_to_publish(due) == (1, 1)
    job.record(result(1, attempt=1, ok=False, final=False), backoff=2.0, now=now)
    second = job.next_retry_due()
    assert second is not None
    assert now + 2.0 <= second <= now + 6.0  # doubled
    job.close()


def test_an_unrun_line_names_its_custom_id_in_the_error_file(tmp_path: Path) -> None:
    job = job_of(tmp_path, 2)
    job.record(result(0), backoff=0.0, now=0.0)
    (error,) = [json.loads(line) for line in job.lines(ok=False, ending="cancelled")]
    assert error["custom_id"] == "line-1"
    assert error["error"]["code"] == "batch_cancelled"
    assert parse_line(job.raw_line(1), "/v1/embeddings").custom_id == "line-1"
    job.close()


def test_a_restarted_edge_reads_the_first_line_of_a_file_that_begins_with_a_bom(tmp_path: Path) -> None:
    """Found by a review: a UTF-8 byte-order mark begins no line. The restarted edge's index (offsets in the
    file, which it seeks to) finds the first line after it, whole."""
    job = job_of(tmp_path, 3)
    plain = list(job.offsets)
    job.close()
    data = (tmp_path / "in.jsonl").read_bytes()
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + data)
    again = Job(tmp_path / "job", state(), tmp_path / "in.jsonl")
    again.index_input()
    assert list(again.offsets) == [offset + 3 for offset in plain]
    assert [again.custom_id(i) for i in range(3)] == ["line-0", "line-1", "line-2"]
    assert again.raw_line(0) == data.splitlines()[0]
    again.close()
