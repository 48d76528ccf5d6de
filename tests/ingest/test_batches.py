"""The Batch API on the edge, driven by the official ``openai`` SDK over TCP, with an in-memory log behind
(workers answer at once, or fail, or hold lines, as each test says). The same runner on the real broker and
workers: ``tests/e2e/test_batches.py``."""

from __future__ import annotations

import asyncio
import errno
import io
import json
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Final

import openai
import pytest
from openai import AsyncOpenAI
from openai.types import Batch
from prometheus_client import REGISTRY

from ingest.auth import DEMO_KEY, DEMO_TENANT
from ingest.batch_job import Job
from ingest.batch_lines import BATCH_PRIORITY
from ingest.batches import BatchRunner, parse_window
from ingest.errors import InvalidRequest, Unavailable
from ingest.files import FileStore, FileWriter
from ingest.prepare import Preparer
from schemas.events import BatchItemRequested, RequestFinished, Usage
from tests.ingest.conftest import EMB, GEN, OTHER_KEY, Client, MakeClient
from tests.ingest.fake_batch_log import FakeBatchLog, complete, failing, finished

CHAT: Final = "/v1/chat/completions"


def chat_line(i: int, custom_id: str | None = None, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id or f"req-{i}",
        "method": "POST",
        "url": CHAT,
        "body": {"model": GEN, "messages": [{"role": "user", "content": f"tell me a story {i}"}], **body},
    }


def jsonl(lines: list[Any]) -> bytes:
    return b"".join(
        (line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines
    )


@pytest.fixture
async def sdk(client: Client) -> AsyncIterator[AsyncOpenAI]:
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as made:
        yield made


async def run(
    sdk: AsyncOpenAI,
    lines: list[Any],
    endpoint: str = CHAT,
    window: str = "24h",
    output_expires_s: int | None = None,
) -> Batch:
    """A batch of ``lines`` (``output_expires_s``: its output files' ``output_expires_after``)."""
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl(lines))), purpose="batch")
    if output_expires_s is None:
        return await sdk.batches.create(
            input_file_id=uploaded.id,
            endpoint=endpoint,  # type: ignore[arg-type]
            completion_window=window,  # type: ignore[arg-type]
        )
    return await sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window=window,  # type: ignore[arg-type]
        output_expires_after={"anchor": "created_at", "seconds": output_expires_s},
    )


async def until(sdk: AsyncOpenAI, batch_id: str, *statuses: str, within_s: float = 10.0) -> Batch:
    deadline = time.monotonic() + within_s
    while True:
        batch = await sdk.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"batch is {batch.status}, not {statuses}")
        await asyncio.sleep(0.02)


async def lines_of(sdk: AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    content = await sdk.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_chat_batch_completes_with_one_output_line_per_input_in_input_order(
    sdk: AsyncOpenAI, batch_log: FakeBatchLog
) -> None:
    lines = [chat_line(i, custom_id=f"z-{50 - i}") for i in range(50)]  # custom ids sort against the order
    created = await run(sdk, lines)
    assert created.status == "validating"
    done = await until(sdk, created.id, "completed")
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
        50,
        50,
        0,
    )
    assert done.error_file_id is None
    assert done.completed_at is not None
    assert done.model == GEN
    out = await lines_of(sdk, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"z-{50 - i}" for i in range(50)]
    for i, line in enumerate(out):
        body = line["response"]["body"]
        assert line["response"]["status_code"] == 200
        assert line["error"] is None
        assert body["object"] == "chat.completion"
        assert body["choices"][0]["message"]["content"] == f"line {i}"
        assert line["id"].startswith("batch_req_")
    published = batch_log.lines
    assert len(published) == 50
    assert {e.priority for e in published} == {BATCH_PRIORITY}
    assert all(e.reply is None and e.deadline == published[0].deadline for e in published)
    # the edge saves a state (what retrieve reads) before it publishes it: the last one may still be on its way
    await _eventually(lambda: batch_log.states[-1].status == "completed")
    states = [s.status for s in batch_log.states if s.batch_id == created.id]
    assert states[0] == "validating"
    assert states[-2:] == ["finalizing", "completed"]
    assert [s.seq for s in batch_log.states] == sorted(s.seq for s in batch_log.states)


async def test_an_embeddings_batch_keeps_each_lines_encoding(sdk: AsyncOpenAI) -> None:
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMB, "input": ["hello world", "the fox"][: 1 + i % 2]}
            | ({"encoding_format": "base64"} if i == 3 else {}),
        }
        for i in range(6)
    ]
    created = await run(sdk, lines, endpoint="/v1/embeddings")
    done = await until(sdk, created.id, "completed")
    out = await lines_of(sdk, done.output_file_id)
    assert [len(line["response"]["body"]["data"]) for line in out] == [1, 2, 1, 2, 1, 2]
    assert out[0]["response"]["body"]["data"][0]["embedding"][0] == 0.0  # the fake's vector: [index, ...]
    assert out[5]["response"]["body"]["data"][1]["embedding"][:1] == [5.0]
    assert isinstance(out[3]["response"]["body"]["data"][0]["embedding"], str)  # base64


async def test_an_invalid_file_fails_validation_with_every_bad_line_and_nothing_runs(
    sdk: AsyncOpenAI, batch_log: FakeBatchLog
) -> None:
    lines: list[Any] = [
        chat_line(0),
        b"{not json",
        chat_line(2, custom_id="req-0"),  # duplicate
        {**chat_line(3), "url": "/v1/embeddings"},
        {**chat_line(4), "method": "GET"},
        chat_line(5) | {"body": {"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]}},
        chat_line(6) | {"body": {"model": GEN, "messages": []}},
        chat_line(7),
    ]
    created = await run(sdk, lines)
    failed = await until(sdk, created.id, "failed")
    assert failed.errors is not None
    assert failed.errors.data is not None
    found = {(e.line, e.code) for e in failed.errors.data}
    assert {line for line, _ in found} == {2, 3, 4, 5, 6, 7}
    assert (2, "invalid_json_line") in found
    assert (3, "duplicate_custom_id") in found
    assert (4, "mismatched_endpoint") in found
    assert (5, "invalid_method") in found
    assert (6, "model_not_found") in found
    assert batch_log.lines == []  # nothing executed
    assert failed.output_file_id is None
    assert failed.failed_at is not None


async def test_a_first_line_naming_a_wrong_model_fails_alone(sdk: AsyncOpenAI) -> None:
    """Found by a review: the first line named the batch's model whatever it named, so a typo in line 1
    failed every later line as ``mismatched_model``, hiding the one line to fix. The first line naming a
    model that serves the endpoint names it."""
    wrong = [{"role": "user", "content": "x"}]
    lines: list[Any] = [
        chat_line(0) | {"body": {"model": "no-such-model", "messages": wrong}},
        chat_line(1) | {"body": {"model": EMB, "messages": wrong}},  # an embedding model: not this endpoint
        chat_line(2),
        chat_line(3),
    ]
    created = await run(sdk, lines)
    failed = await until(sdk, created.id, "failed")
    assert failed.errors is not None
    assert failed.errors.data is not None
    found = [(e.line, e.code) for e in failed.errors.data]
    assert found == [(1, "model_not_found"), (2, "unsupported_model_task")]


async def test_a_file_that_begins_with_a_utf8_bom_runs_and_a_utf16_one_is_named(sdk: AsyncOpenAI) -> None:
    """Found by a review: a JSONL file saved by a Windows editor begins with a UTF-8 byte-order mark, which
    was read as part of the first line: the batch failed, line 1 "not valid JSON". A UTF-16 file (its lines
    cannot be read either) is said to be one."""
    data = b"\xef\xbb\xbf" + jsonl([chat_line(0), chat_line(1)])
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    created = await sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    done = await until(sdk, created.id, "completed", "failed")
    assert done.status == "completed", done.errors
    out = await lines_of(sdk, done.output_file_id)
    assert [line["custom_id"] for line in out] == ["req-0", "req-1"]

    utf16 = jsonl([chat_line(0)]).decode().encode("utf-16")  # with its byte-order mark, as Windows saves it
    uploaded = await sdk.files.create(file=("in.jsonl", io.BytesIO(utf16)), purpose="batch")
    created = await sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    failed = await until(sdk, created.id, "failed")
    assert failed.errors is not None
    assert failed.errors.data
    first = failed.errors.data[0]
    assert (first.line, first.code) == (1, "invalid_json_line")
    assert "UTF-16" in (first.message or "")
    assert "save it as UTF-8" in (first.message or "")


async def test_lines_msgspec_cannot_read_fail_their_batch_not_the_edge(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """msgspec raises ``UnicodeDecodeError`` and ``RecursionError`` for these, not its ``DecodeError``: each
    used to escape validation, stop the edge, and stop it again at every restart (the batch validates
    again)."""
    client, edge = await make_client()
    not_utf8 = json.dumps(chat_line(1)).encode().replace(b"tell me", b"tell\xff me")
    deep = (
        json.dumps({**chat_line(2), "x": "HERE"}).encode().replace(b'"HERE"', b"[" * 100_000 + b"]" * 100_000)
    )
    bad_id = json.dumps(chat_line(3, custom_id="id-HERE")).encode().replace(b"HERE", b"\xff")
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        failed = await until(sdk, (await run(sdk, [chat_line(0), not_utf8, deep, bad_id])).id, "failed")
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [(e.line, e.code, e.message) for e in failed.errors.data] == [
            (
                2,
                "invalid_json",
                "We could not parse the JSON body of your request: a string in it is not UTF-8",
            ),
            (3, "invalid_json_line", "This line is not valid JSON: it is nested too deeply."),
            (4, "invalid_json_line", "This line is not valid JSON: a string in it is not UTF-8."),
        ]
    assert edge.failure is None
    assert batch_log.lines == []


async def test_a_line_that_breaks_its_check_fails_alone_and_the_edge_keeps_serving(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever a line raises that no check expected (an edge bug) fails that line, logged: it must not
    stop the edge (a restart validates the batch again, and would stop again)."""
    from ingest import batches
    from ingest.batch_lines import parse_line as real

    def parse(raw: bytes, endpoint: Any) -> Any:
        if b"req-1" in raw:
            raise RuntimeError("a bug")
        return real(raw, endpoint)

    monkeypatch.setattr(batches, "parse_line", parse)
    client, edge = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        failed = await until(sdk, (await run(sdk, [chat_line(0), chat_line(1)])).id, "failed")
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [(e.line, e.code) for e in failed.errors.data] == [(2, "invalid_request")]
        done = await until(sdk, (await run(sdk, [chat_line(0)])).id, "completed")
        assert done.request_counts is not None
        assert done.request_counts.completed == 1
    assert edge.failure is None


async def test_a_line_that_breaks_when_it_is_published_fails_alone(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same when a line validated and breaks as it is prepared to run: that line goes to the error
    file, the others run, the edge keeps serving."""
    from ingest import batches
    from ingest.batch_lines import parse_line as real

    seen = [0]

    def parse(raw: bytes, endpoint: Any) -> Any:
        if b"req-1" in raw:
            seen[0] += 1
            if seen[0] > 1:  # validated once, then breaks
                raise RuntimeError("a bug")
        return real(raw, endpoint)

    monkeypatch.setattr(batches, "parse_line", parse)
    client, edge = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, (await run(sdk, [chat_line(i) for i in range(3)])).id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 1)
        errors = await lines_of(sdk, done.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("req-1", "invalid_request")]
    assert edge.failure is None


async def test_limits_on_lines_files_and_fields_are_clear_4xx(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    client, _ = await make_client(edge_batch_max_lines=3, edge_file_max_bytes=4096)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        failed = await until(sdk, (await run(sdk, [chat_line(i) for i in range(5)])).id, "failed")
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [e.code for e in failed.errors.data] == ["too_many_lines"]
        with pytest.raises(openai.APIStatusError) as too_big:
            await sdk.files.create(file=("big.jsonl", io.BytesIO(b"x" * 5000)), purpose="batch")
        assert too_big.value.status_code == 413
        with pytest.raises(openai.BadRequestError) as purpose:
            await sdk.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
        assert purpose.value.code == "invalid_purpose"
        assert (await sdk.files.list()).data == [
            f for f in (await sdk.files.list()).data if f.purpose == "batch"
        ]
        good = await sdk.files.create(file=("a.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
        for endpoint, window in (("/v1/moderations", "24h"), (CHAT, "forever")):
            with pytest.raises(openai.BadRequestError):
                await sdk.batches.create(
                    input_file_id=good.id,
                    endpoint=endpoint,  # type: ignore[arg-type]
                    completion_window=window,  # type: ignore[arg-type]
                )
        with pytest.raises(openai.NotFoundError):
            await sdk.batches.create(input_file_id="file-" + "0" * 32, endpoint=CHAT, completion_window="24h")
    assert batch_log.lines == []
    assert len(await _stored(client)) == 2  # the refused uploads left nothing behind


async def _stored(client: Client) -> list[Any]:
    response = await client.get("/v1/files", headers={"Authorization": f"Bearer {DEMO_KEY}"})
    body = await response.json()
    return list(body["data"])


async def test_another_tenant_can_never_see_or_touch_files_or_batches(
    client: Client, sdk: AsyncOpenAI
) -> None:
    created = await run(sdk, [chat_line(0)])
    done = await until(sdk, created.id, "completed")
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=OTHER_KEY, max_retries=0) as other:
        for call in (
            other.files.retrieve(done.input_file_id),
            other.files.content(done.input_file_id),
            other.files.content(done.output_file_id or ""),
            other.files.delete(done.input_file_id),
            other.batches.retrieve(done.id),
            other.batches.cancel(done.id),
            other.batches.create(input_file_id=done.input_file_id, endpoint=CHAT, completion_window="24h"),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await other.files.list()).data == []
        assert (await other.batches.list()).data == []
    assert (await sdk.files.retrieve(done.input_file_id)).id == done.input_file_id  # still there, untouched
    assert [b.id for b in (await sdk.batches.list()).data] == [done.id]


async def test_retriable_failures_run_again_and_the_rest_go_to_the_error_file(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    def respond(event: BatchItemRequested) -> RequestFinished | None:
        if event.index % 3 == 0 and event.attempt == 0:
            return failing("queue_full")(event)  # retried, then completes
        if event.index == 4:
            return failing("queue_full")(event)  # retried until the attempts are spent
        if event.index == 5:
            return failing("invalid_request")(event)  # not retriable
        return complete(event)

    batch_log.respond = respond
    before = {o: _lines_counted(o) for o in ("completed", "failed", "retried")}
    client, _ = await make_client(edge_batch_retry_backoff_s=0.01, edge_batch_max_attempts=3)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, (await run(sdk, [chat_line(i) for i in range(9)])).id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (7, 2)
        out = await lines_of(sdk, done.output_file_id)
        errors = await lines_of(sdk, done.error_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in (0, 1, 2, 3, 6, 7, 8)]
    assert [(e["custom_id"], e["response"]["body"]["error"]["code"]) for e in errors] == [
        ("req-4", "queue_full"),
        ("req-5", "invalid_request"),
    ]
    attempts = sorted((e.index, e.attempt) for e in batch_log.lines)
    assert [a for i, a in attempts if i == 4] == [0, 1, 2]
    counted = {o: _lines_counted(o) - before[o] for o in before}
    assert counted == {"completed": 7, "failed": 2, "retried": 5}  # 0, 3, 6 once; 4 twice
    assert [a for i, a in attempts if i == 0] == [0, 1]
    assert [a for i, a in attempts if i == 5] == [0]
    ids = {(e.index, e.attempt): e.request_id for e in batch_log.lines}
    assert len(set(ids.values())) == len(ids)  # each attempt its own request


async def test_cancel_stops_what_has_not_run_and_cancels_what_runs(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: held.append(event)
    client, _ = await make_client(edge_batch_max_in_flight=4)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(10)])
        await until(sdk, created.id, "in_progress")
        await _eventually(lambda: len(held) == 4)
        batch_log.answer(complete(held[0]))
        await _eventually(lambda: len(held) == 5)  # a slot freed: one more line went out
        cancelling = await sdk.batches.cancel(created.id)
        assert cancelling.status == "cancelling"
        assert sorted(c.request_id for c in batch_log.cancels) == sorted(e.request_id for e in held[1:])
        for event in held[1:]:
            usage = Usage(prompt_tokens=1, completion_tokens=0, total_tokens=1)
            batch_log.answer(finished(event, "cancelled", usage))
        done = await until(sdk, created.id, "cancelled")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (1, 9)
        assert [line["custom_id"] for line in await lines_of(sdk, done.output_file_id)] == ["req-0"]
        errors = await lines_of(sdk, done.error_file_id)
    assert [e["custom_id"] for e in errors] == [f"req-{i}" for i in range(1, 10)]
    assert {e["error"]["code"] for e in errors if e["response"] is None} == {"batch_cancelled"}
    assert len(batch_log.lines) == 5  # nothing was published after the cancel


async def _expire(batch_log: FakeBatchLog, held: list[BatchItemRequested]) -> None:
    """Past the lines' deadline (the batch's expiry), each held line ends ``expired``, as a worker ends it."""
    deadline = held[0].deadline
    assert deadline is not None
    await asyncio.sleep(max(0.0, deadline.timestamp() - time.time()) + 0.05)
    usage = Usage(prompt_tokens=0, completion_tokens=0, total_tokens=0)
    for event in held:
        batch_log.answer(finished(event, "expired", usage))


async def test_a_batch_expires_at_its_window_with_what_completed(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: complete(event) if event.index < 2 else held.append(event)
    client, _ = await make_client(edge_batch_max_in_flight=1)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        # long enough for three lines' rounds (each fsyncs its journal) on a slow disk before it expires, and
        # for a stall of a loaded box (CI) on top
        created = await run(sdk, [chat_line(i) for i in range(5)], window="5s")
        await _eventually(lambda: len(held) == 1)
        await _expire(batch_log, held)
        done = await until(sdk, created.id, "expired")
        assert done.expired_at is not None
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (2, 3)
        assert len(await lines_of(sdk, done.output_file_id)) == 2
        errors = await lines_of(sdk, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["req-2", "req-3", "req-4"]
    assert errors[0]["response"]["body"]["error"]["code"] == "timeout"  # it ran, and passed the deadline
    assert [e["error"]["code"] for e in errors[1:]] == ["batch_expired", "batch_expired"]  # never ran
    assert {e.index for e in batch_log.lines} == {0, 1, 2}  # nothing was published after the expiry
    assert {e.deadline for e in batch_log.lines} == {batch_log.lines[0].deadline}  # the batch's expiry


async def test_partial_output_is_readable_while_the_batch_runs(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    batch_log.respond = lambda event: complete(event) if event.index in (1, 3) else None
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(5)])
        running = await until(sdk, created.id, "in_progress")
        await _eventually_async(lambda: _counted(sdk, created.id, 2))
        partial = await lines_of(sdk, running.output_file_id)
        assert [line["custom_id"] for line in partial] == ["req-1", "req-3"]
        for file_id in (running.input_file_id, running.output_file_id or ""):  # whole, and so far
            headers = (await sdk.files.content(file_id)).response.headers
            assert (headers["content-disposition"], headers["x-content-type-options"]) == (
                "attachment",
                "nosniff",
            )


async def test_a_download_begun_as_its_batch_ends_reads_the_lines_settled(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """Found by a review: the lines of a running batch's output were read from its journal only at the first
    line, after the response's headers; a batch ending in between removes its journal, and the download
    then read an empty file (a 500 past the headers, or a cut download). The journal is opened at once."""
    batch_log.respond = lambda event: complete(event) if event.index in (1, 3) else None
    client, edge = await make_client()
    runner = edge.batches
    assert runner is not None
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(5)])
        running = await until(sdk, created.id, "in_progress")
        await _eventually_async(lambda: _counted(sdk, created.id, 2))
        assert running.output_file_id is not None
        partial = runner.partial_output(DEMO_TENANT, running.output_file_id)
        assert partial is not None
        (job,) = runner._jobs.values()
        job.journal_path.unlink()  # the batch ended meanwhile (what _drop does)
        assert [json.loads(line)["custom_id"] for line in partial] == ["req-1", "req-3"]


async def test_a_running_batchs_files_are_served_as_written_so_far(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """The ids a running batch names are files: their metadata and content so far, the error file's too
    (both answered 404 before)."""
    batch_log.respond = lambda event: (
        complete(event)
        if event.index == 1
        else failing("invalid_request")(event)
        if event.index == 3
        else None
    )
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(5)])
        await _eventually_async(lambda: _counted(sdk, created.id, 1))
        running = await until(sdk, created.id, "in_progress")
        assert running.request_counts is not None
        assert running.request_counts.failed == 1
        assert running.output_file_id is not None
        assert running.error_file_id is not None
        for file_id, kind, custom_ids in (
            (running.output_file_id, "output", ["req-1"]),
            (running.error_file_id, "error", ["req-3"]),
        ):
            meta = await sdk.files.retrieve(file_id)
            content = (await sdk.files.content(file_id)).content
            assert [json.loads(line)["custom_id"] for line in content.splitlines()] == custom_ids
            assert (meta.id, meta.filename, meta.purpose) == (
                file_id,
                f"{created.id}_{kind}.jsonl",
                "batch_output",
            )
            assert (meta.bytes, meta.status) == (len(content), "uploaded")
            assert meta.status_details is not None
            assert "1 lines so far" in meta.status_details
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=OTHER_KEY, max_retries=0) as other:
        for file_id in (running.output_file_id, running.error_file_id):
            for call in (other.files.retrieve(file_id), other.files.content(file_id)):
                with pytest.raises(openai.NotFoundError):
                    await call


async def test_a_batch_names_an_error_file_only_once_a_line_failed(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """A batch that ends without errors has no error file: while it runs, it names none either (the id
    used to turn into null at the end)."""
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: complete(event) if event.index == 0 else held.append(event)
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(3)])
        await _eventually_async(lambda: _counted(sdk, created.id, 1))
        running = await sdk.batches.retrieve(created.id)
        assert (running.status, running.error_file_id) == ("in_progress", None)
        assert running.output_file_id is not None
        await _eventually(lambda: len(held) == 2)
        for event in held:
            batch_log.answer(complete(event))
        done = await until(sdk, created.id, "completed")
    assert (done.error_file_id, done.output_file_id) == (None, running.output_file_id)


def _lines_counted(outcome: str) -> float:
    return REGISTRY.get_sample_value("sluice_batch_lines_total", {"model": GEN, "outcome": outcome}) or 0.0


async def _counted(sdk: AsyncOpenAI, batch_id: str, completed: int) -> bool:
    batch = await sdk.batches.retrieve(batch_id)
    return batch.request_counts is not None and batch.request_counts.completed == completed


async def _eventually(check: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def _eventually_async(check: Any, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def test_a_restarted_edge_resumes_its_batch_and_each_line_ends_once(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: complete(event) if event.index < 3 else held.append(event)
    first, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(12)])
        await _eventually_async(lambda: _counted(sdk, created.id, 3))
    await _eventually(lambda: len(held) == 5)
    await first.close()  # the edge stops mid-batch: lines 3-7 published, 8-11 not yet
    before = len(batch_log.lines)

    batch_log.respond = complete
    second, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        await _eventually(lambda: len(batch_log.lines) == before + 9)
        for event in held:  # the first run's copies finish too, late: duplicates of the re-published ones
            batch_log.answer(complete(event))
        done = await until(sdk, created.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
        out = await lines_of(sdk, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in range(12)]
    # the first edge skipped the results written before its batch; the restarted one read from where the
    # first had committed (its lines' results may have landed while it was down)
    assert batch_log.follows == [True, False]
    again = batch_log.lines[before:]
    assert sorted(e.index for e in again) == list(range(3, 12))  # what had no result, nothing else
    first_ids = {e.index: e.request_id for e in batch_log.lines[:before]}
    assert all(first_ids[e.index] == e.request_id for e in again if e.index in first_ids)  # same requests


async def completed_while_down(
    make_client: MakeClient, batch_log: FakeBatchLog, *, cancel: bool = False
) -> Any:
    """A batch of 5 lines running on an edge that stops (after a cancel answered ``cancelling``, if
    ``cancel``), whose lines complete while it is down: the batch as created."""
    held: list[BatchItemRequested] = []
    batch_log.respond = held.append
    first, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(5)])
        await _eventually(lambda: len(held) == 5)
        if cancel:
            assert (await sdk.batches.cancel(created.id)).status == "cancelling"
    await first.close()
    for event in held:
        batch_log.answer(complete(event))
    return created


async def test_a_line_whose_result_is_read_while_it_is_prepared_again_stays_done(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit (2026-12-01, under ``sluice up``, 2 of 2 restarts): a restarted edge puts every
    line without a result back to pending and reads the results written since its last commit; a line
    being prepared for publishing again when its result was read was marked in flight over done, and
    published. The workers skip a request already finished, so no result came again: the batch stayed
    ``in_progress`` with 64 completed, billed lines unreported until its window ran out."""
    created = await completed_while_down(make_client, batch_log)
    prepare = BatchRunner._line_events

    def slowly(self: BatchRunner, *args: Any) -> list[Any]:
        time.sleep(0.5)  # the results written meanwhile are read while the lines are prepared again
        return prepare(self, *args)

    monkeypatch.setattr(BatchRunner, "_line_events", slowly)
    batch_log.respond = lambda event: None  # as the workers: a request already finished is not run again
    second, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, created.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
        out = await lines_of(sdk, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in range(5)]


async def test_a_batch_that_expired_while_its_edge_was_down_keeps_the_results_written_meanwhile(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """Found by an audit: an edge killed mid-batch and back after the batch's window had passed ended the
    batch at once, before it had read the results its lines wrote while it was down: lines that had
    completed (and were billed) were reported ``batch_expired``. The batch now ends once those are read."""
    held: list[BatchItemRequested] = []
    batch_log.respond = held.append
    first, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(5)], window="2s")
        await _eventually(lambda: len(held) == 5)
    await first.close()
    for event in held:  # the lines complete while the edge is down
        batch_log.answer(complete(event))
    await asyncio.sleep(2.2)  # and the window passes

    second, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, created.id, "expired", "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
        out = await lines_of(sdk, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in range(5)]
    assert len(batch_log.lines) == 5, "nothing ran again"


async def test_a_batch_cancelling_while_its_edge_was_down_keeps_the_results_written_meanwhile(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: the twin of the expiry above with a cancel. A batch reloaded ``cancelling`` had
    its ending set without the time it began, 0.0, so its wait for the results written while the edge was
    down ran from the machine's boot and was over at once: lines that had completed (and were billed)
    were reported ``batch_cancelled``. The limit is made 5 s so that the bug shows whatever the machine's
    uptime (with the default, 300 s, it showed only on a box up for longer than that)."""
    import ingest.batches

    monkeypatch.setattr(ingest.batches, "CATCH_UP_LIMIT_S", 5.0)
    # stopped while its 5 running lines had not reported yet; they had completed on the workers before
    # the cancel reached them
    created = await completed_while_down(make_client, batch_log, cancel=True)

    second, _ = await make_client(edge_batch_max_in_flight=5)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, created.id, "cancelled", "completed")
        assert done.status == "cancelled"
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
        out = await lines_of(sdk, done.output_file_id)
    assert [line["custom_id"] for line in out] == [f"req-{i}" for i in range(5)]
    assert len(batch_log.lines) == 5, "nothing ran again"


async def test_a_batch_cancelling_when_its_edge_was_killed_cancels_its_lines_at_the_restart(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a cancel writes ``cancelling`` before it sends its lines' cancels, and a restart
    took a batch found ``cancelling`` for one whose cancels had gone out. An edge killed between the two
    left its running lines to run to their end. The restarted edge cancels every line that may have been
    running (in flight or past the last result by at most the in-flight window), and no settled one."""
    held: list[BatchItemRequested] = []
    batch_log.respond = held.append
    first, _ = await make_client(edge_batch_max_in_flight=3)
    monkeypatch.setattr(BatchRunner, "_cancel_running", lambda self, job: None)  # killed before them
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(8)])
        await _eventually(lambda: len(held) == 3)
        batch_log.answer(complete(held[0]))  # line 0 completes; 3 is published in its place
        await _eventually(lambda: len(held) == 4)
        assert (await sdk.batches.cancel(created.id)).status == "cancelling"
    await first.close()
    assert batch_log.cancels == []
    running = {e.request_id for e in held[1:]}

    monkeypatch.undo()
    second, _ = await make_client(edge_batch_max_in_flight=3)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        await _eventually(lambda: len(batch_log.cancels) > 0)
        cancelled = {c.request_id for c in batch_log.cancels}
        assert running <= cancelled, "every line running at the kill is cancelled"
        assert held[0].request_id not in cancelled
        assert len(cancelled) <= 3 + 3, "only lines the window could have published"
        for event in held[1:]:
            result = failing("cancelled")(event)
            assert result is not None
            batch_log.answer(result)
        done = await until(sdk, created.id, "cancelled")
    assert done.request_counts is not None
    assert done.request_counts.completed == 1
    assert len(batch_log.lines) == 4, "nothing ran again"


async def test_a_batch_ends_even_when_the_results_log_never_catches_up(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Waiting for the results written while the edge was down is bounded: a log that cannot be read
    (found by a review: a partition retention had emptied, before the fix) must not hold a batch for good."""
    import ingest.batches

    monkeypatch.setattr(ingest.batches, "CATCH_UP_LIMIT_S", 0.3)
    batch_log.respond = lambda event: None  # held
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(3)])
        await _eventually(lambda: len(batch_log.lines) == 3)
        batch_log._backlog = 10**9  # as if a backlog never read stood behind the group's offsets
        await sdk.batches.cancel(created.id)
        done = await until(sdk, created.id, "cancelled", within_s=5)
    assert done.request_counts is not None
    assert done.request_counts.failed == 3


async def test_a_retry_that_cannot_be_published_does_not_keep_the_pump_awake(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """Found by an audit: with its model's window full, a line's retry that was due woke the pump every
    10 ms (80-90 rounds a second) until a result made room; so did one whose tenant was out of budget, or
    whose batch was cancelled. Such a retry waits for the result that makes room (or the next progress
    round); one due that could be published still wakes the pump on time."""
    batch_log.respond = lambda event: (
        failing("queue_full")(event) if event.index == 0 and event.ref.attempt == 0 else None
    )  # line 0 fails once (retriable), every other line is held: the window stays full
    client, edge = await make_client(edge_batch_max_in_flight=2, edge_batch_retry_backoff_s=0.05)
    runner = edge.batches
    assert runner is not None
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(10)])
        await until(sdk, created.id, "in_progress")
        await _eventually(lambda: len(batch_log.lines) == 3)  # 0, its failure made room for 1 and 2
        (job,) = runner._jobs.values()
        assert job.next_retry_due() is not None
        await asyncio.sleep(0.1)  # the retry is due now; the window holds lines 1 and 2
        assert runner._next_wake() > 0.5
        job.retries[0] = (time.monotonic() - 1, job.retries[0][1])
        runner._in_flight[GEN] -= 1  # room: the due retry wakes the pump at once
        assert runner._next_wake() == pytest.approx(0.01)
        runner._in_flight[GEN] += 1
        await sdk.batches.cancel(created.id)
        await until(sdk, created.id, "cancelling", "cancelled")
        assert job.retries == [], "a cancelled batch's retries never run"


async def test_a_batch_says_when_its_output_files_expire(make_client: MakeClient) -> None:
    """OpenAI's ``output_expires_after`` (an audit found the SDK's parameter refused as an unknown field)."""
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(0)], output_expires_s=7200)
        done = await until(sdk, created.id, "completed")
        assert done.output_file_id is not None
        output = await sdk.files.retrieve(done.output_file_id)
        assert output.expires_at == output.created_at + 7200
        with pytest.raises(openai.BadRequestError) as refused:
            await run(sdk, [chat_line(0)], output_expires_s=60)
        assert refused.value.code == "invalid_expires_after"


async def test_a_stopped_runner_writes_nothing_after_its_stop_returns(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopping cancels the runner's tasks, but file work already on a thread runs on: ``stop`` waits for it,
    so a batch's state is never written by an edge that stopped (its successor may be reading it by then;
    CI saw the two writers' temporary files collide)."""
    writing, written = threading.Event(), threading.Event()
    original = Job.write_state

    def slow_write(job: Job, state: Any) -> None:
        writing.set()
        time.sleep(0.5)
        original(job, state)
        written.set()

    batch_log.respond = lambda event: None  # lines stay in flight
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        await run(sdk, [chat_line(i) for i in range(3)])
        monkeypatch.setattr(Job, "write_state", slow_write)
        await _eventually(writing.is_set)
    await client.close()
    assert written.is_set(), "the edge stopped while its runner was still writing a batch's state"


async def test_the_edge_reads_results_only_while_a_batch_is_unfinished(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """Every request's terminal event passes through the results topic: an edge with no batch does not
    read it. It starts before the first line is published (the fake refuses a line published before) and
    stops ``follow_idle_s`` after the last batch ended; the next batch starts it again, from the end."""
    client, edge = await make_client()
    assert edge.batches is not None
    edge.batches.follow_idle_s = 1.0  # it still reads when the test sees the batch completed, stalls and all
    await asyncio.sleep(0.2)
    assert (batch_log.following, batch_log.follows) == (False, [])
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        first = await run(sdk, [chat_line(i) for i in range(4)])
        await until(sdk, first.id, "completed")
        assert batch_log.following
        await _eventually(lambda: not batch_log.following)
        assert (batch_log.follows, batch_log.unfollows) == ([True], 1)
        second = await run(sdk, [chat_line(i) for i in range(3)])
        done = await until(sdk, second.id, "completed")
        assert done.request_counts is not None
        assert done.request_counts.completed == 3
    assert batch_log.follows == [True, True]
    assert len(batch_log.lines) == 7


async def test_a_batch_created_while_the_edge_stops_reading_results_still_completes(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """The edge stops reading results (it takes a while: a consumer thread stops) just as a new batch
    comes in: none of its lines is published before the edge reads results again, so none is lost."""
    client, edge = await make_client()
    assert edge.batches is not None
    edge.batches.follow_idle_s = 0.2
    stopped = asyncio.Event()  # the stop lasts until the batch is created (1.5 s of it lost that race)
    batch_log.unfollow_gate = stopped
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        await until(sdk, (await run(sdk, [chat_line(0)])).id, "completed")
        lines = io.BytesIO(jsonl([chat_line(i) for i in range(5)]))
        uploaded = await sdk.files.create(file=("in.jsonl", lines), purpose="batch")  # before: it fsyncs
        await _eventually(lambda: batch_log.unfollowing)
        second = await sdk.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
        assert batch_log.unfollowing, "created while the log stops"
        await until(sdk, second.id, "in_progress")  # validated meanwhile,
        assert len(batch_log.lines) == 1  # and none of its lines out before the edge reads results again
        stopped.set()
        done = await until(sdk, second.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (5, 0)
    assert batch_log.follows == [True, True]
    assert edge.failure is None


async def test_the_runner_stops_when_it_is_woken_as_it_is_stopped(make_client: MakeClient) -> None:
    """A wake-up (a result, a new batch) in the same moment as the stop: the runner's loop still ends (with
    asyncio.wait_for it swallowed the cancel on Python 3.11 and the edge's shutdown hung)."""
    _, edge = await make_client()
    assert edge.batches is not None
    await asyncio.sleep(0.1)  # its loop waits for a wake-up
    edge.batches._wake.set()
    stopping = asyncio.create_task(edge.batches.stop())
    done, _ = await asyncio.wait({stopping}, timeout=5)
    assert done, "the runner's loop went on after its cancel"


async def test_a_runner_that_dies_fails_the_edge_so_that_it_restarts(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    _, edge = await make_client()
    assert edge.failure is None
    batch_log.broken = RuntimeError("the results consumer died")
    await _eventually(lambda: edge.failure is not None)
    assert "results consumer died" in str(edge.failure)


async def test_a_batch_cancelled_before_its_edge_stopped_ends_cancelled_after_the_restart(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: held.append(event)
    first, _ = await make_client(edge_batch_max_in_flight=2)
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(6)])
        await _eventually(lambda: len(held) == 2)
        assert (await sdk.batches.cancel(created.id)).status == "cancelling"
    await first.close()  # stopped while its two running lines had not ended yet
    published = len(batch_log.lines)

    second, _ = await make_client(edge_batch_max_in_flight=2)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, created.id, "cancelled")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (0, 6)
    assert len(batch_log.lines) == published  # nothing ran again after the restart


async def test_a_big_batch_never_holds_another_tenants_small_one_back(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    held: list[BatchItemRequested] = []  # the big batch's lines run long; the small one's end at once
    batch_log.respond = lambda event: complete(event) if event.tenant == "other" else held.append(event)
    client, _ = await make_client(edge_batch_max_in_flight=4)
    url = str(client.make_url("/v1"))
    async with (
        AsyncOpenAI(base_url=url, api_key=DEMO_KEY, max_retries=0) as big,
        AsyncOpenAI(base_url=url, api_key=OTHER_KEY, max_retries=0) as small,
    ):
        first = await run(big, [chat_line(i) for i in range(40)])
        await _eventually(lambda: len(held) == 4)  # the big batch fills the window
        second = await run(small, [chat_line(i) for i in range(3)])
        await until(small, second.id, "in_progress")
        batch_log.answer(complete(held.pop(0)))  # one slot frees: the small batch, below its share, gets it
        done = await until(small, second.id, "completed")
        assert done.request_counts is not None
        assert done.request_counts.completed == 3
        assert (await big.batches.retrieve(first.id)).status == "in_progress"  # it goes on meanwhile
    await _eventually(lambda: len(held) == 4)  # and the window is its own again (the runner's next round)


async def test_output_files_bigger_than_the_upload_limit_are_written_whole(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """The upload limit bounds what a tenant sends, not the files a batch writes (an embeddings batch's
    output is many times its input)."""
    client, edge = await make_client(edge_file_max_bytes=8192)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        lines = [chat_line(i) for i in range(40)]
        assert len(jsonl(lines)) < 8192
        done = await until(sdk, (await run(sdk, lines)).id, "completed", "failed")
        assert done.status == "completed", done.errors
        assert done.output_file_id is not None
        assert (await sdk.files.retrieve(done.output_file_id)).bytes > 8192
        assert [line["custom_id"] for line in await lines_of(sdk, done.output_file_id)] == [
            f"req-{i}" for i in range(40)
        ]
    assert edge.failure is None


def _disk_full(_self: FileWriter, _chunk: bytes) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_batch_whose_files_cannot_be_written_fails_alone(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: held.append(event)
    client, edge = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(3)])
        await _eventually(lambda: len(held) == 3)
        monkeypatch.setattr(FileWriter, "write", _disk_full)
        for event in held:
            batch_log.answer(complete(event))
        failed = await until(sdk, created.id, "failed")
        monkeypatch.undo()
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [e.code for e in failed.errors.data] == ["output_write_failed"]
        assert "No space left on device" in (failed.errors.data[0].message or "")
        assert (failed.output_file_id, failed.error_file_id) == (None, None)
        assert failed.request_counts is not None
        assert (failed.request_counts.completed, failed.request_counts.failed) == (3, 0)
        assert [f.id for f in (await sdk.files.list()).data] == [created.input_file_id]  # nothing half-made
        assert edge.failure is None
        batch_log.respond = complete
        other = await until(sdk, (await run(sdk, [chat_line(0)])).id, "completed")  # the edge goes on
        assert other.request_counts is not None
        assert other.request_counts.completed == 1


def _files_stuck(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """A batch's files being written until ``release`` (the edge stops meanwhile), then failing: (set once
    the writing began, release)."""
    writing, release = threading.Event(), threading.Event()

    def stuck(_self: BatchRunner, *_args: Any) -> int:
        writing.set()
        release.wait(5)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(BatchRunner, "_write_files", stuck)
    return writing, release


async def test_a_batch_left_finalizing_whose_files_cannot_be_written_fails_after_the_restart(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The edge stopped while it wrote a batch's files, and they cannot be written after the restart either:
    the batch fails, and the restarted edge stays up (it used to die again on every start)."""
    writing, release = _files_stuck(monkeypatch)
    first, _ = await make_client()
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(3)])
        await until(sdk, created.id, "finalizing")
        await _eventually(writing.is_set)
    await first.close()  # stopped while it wrote the files
    release.set()

    monkeypatch.setattr(FileWriter, "write", _disk_full)
    monkeypatch.setattr(BatchRunner, "_write_files", _WRITE_FILES)
    second, edge = await make_client()
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        failed = await until(sdk, created.id, "failed")
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [e.code for e in failed.errors.data] == ["output_write_failed"]
        await asyncio.sleep(0.2)
        assert edge.failure is None
    await second.close()
    _, edge = await make_client()  # it is over: a later start finds nothing to do
    await asyncio.sleep(0.2)
    assert edge.failure is None
    assert [s.status for s in batch_log.states if s.batch_id == created.id][-1] == "failed"


_WRITE_FILES = BatchRunner._write_files


async def test_a_batch_left_finalizing_as_it_expired_ends_expired_after_the_restart(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by a review: a batch whose window passed with every line settled in the expiry's grace (they
    ran to their deadline) was stopped while it wrote its files; the restarted edge saw no line unsettled
    and ended it ``completed``. The expiry is kept with the ``finalizing`` state."""
    held: list[BatchItemRequested] = []
    batch_log.respond = held.append
    writing, release = _files_stuck(monkeypatch)
    first, _ = await make_client(edge_batch_max_in_flight=3)
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(3)], window="2s")
        await _eventually(lambda: len(held) == 3)
        await _expire(batch_log, held)
        finalizing = await until(sdk, created.id, "finalizing")
        await _eventually(writing.is_set)
    assert finalizing.expired_at is not None
    await first.close()  # stopped while it wrote the files
    release.set()

    monkeypatch.setattr(BatchRunner, "_write_files", _WRITE_FILES)
    second, _ = await make_client(edge_batch_max_in_flight=3)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        done = await until(sdk, created.id, "expired", "completed", "failed")
        assert done.status == "expired"
        assert done.expired_at == finalizing.expired_at
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (0, 3)
        errors = await lines_of(sdk, done.error_file_id)
    assert [e["response"]["body"]["error"]["code"] for e in errors] == ["timeout"] * 3


async def test_the_input_file_of_a_batch_that_has_not_ended_cannot_be_deleted(
    sdk: AsyncOpenAI, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow(self: BatchRunner, job: Any, tenant: Any) -> Any:
        release.wait(5)  # a big file takes a while to validate
        return _CHECK_FILE(self, job, tenant)

    monkeypatch.setattr(BatchRunner, "_check_file", slow)
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: held.append(event)
    created = await run(sdk, [chat_line(i) for i in range(3)])
    for status in ("validating", "in_progress"):
        assert (await sdk.batches.retrieve(created.id)).status == status
        with pytest.raises(openai.ConflictError) as refused:
            await sdk.files.delete(created.input_file_id)
        assert refused.value.code == "file_in_use"
        assert created.id in refused.value.message
        release.set()
        await until(sdk, created.id, "in_progress")
    await _eventually(lambda: len(held) == 3)
    for event in held:
        batch_log.answer(complete(event))
    await until(sdk, created.id, "completed")
    assert (await sdk.files.delete(created.input_file_id)).deleted
    with pytest.raises(openai.NotFoundError):
        await sdk.files.retrieve(created.input_file_id)


_CHECK_FILE = BatchRunner._check_file


async def test_a_batch_whose_input_file_is_gone_while_it_runs_fails_alone(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The input file goes (it expired, or another edge sharing the files dir deleted it) after validation
    read it and before a line was published: the batch fails with a clear error, the edge goes on."""

    def check_then_lose_it(self: BatchRunner, job: Any, tenant: Any) -> Any:
        checked = _CHECK_FILE(self, job, tenant)
        self.store.delete(job.state.tenant, job.state.input_file_id)
        return checked

    monkeypatch.setattr(BatchRunner, "_check_file", check_then_lose_it)
    client, edge = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(5)])
        failed = await until(sdk, created.id, "failed")
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [(e.code, e.param) for e in failed.errors.data] == [("input_file_missing", "input_file_id")]
        assert created.input_file_id in (failed.errors.data[0].message or "")
        assert failed.request_counts is not None
        assert (failed.request_counts.total, failed.request_counts.failed) == (5, 5)
        assert failed.output_file_id is None
        assert batch_log.lines == []
        assert edge.failure is None
        monkeypatch.undo()
        other = await until(sdk, (await run(sdk, [chat_line(0)])).id, "completed")  # the edge goes on
        assert other.request_counts is not None
        assert other.request_counts.completed == 1
    assert edge.failure is None


async def test_a_batch_whose_input_file_is_gone_after_a_restart_fails(
    make_client: MakeClient, batch_log: FakeBatchLog, tmp_path: Path
) -> None:
    held: list[BatchItemRequested] = []
    batch_log.respond = lambda event: held.append(event)
    first, _ = await make_client(edge_batch_max_in_flight=2)
    async with AsyncOpenAI(base_url=str(first.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        created = await run(sdk, [chat_line(i) for i in range(4)])
        await _eventually(lambda: len(held) == 2)
        batch_log.answer(complete(held[0]))
        await _eventually_async(lambda: _counted(sdk, created.id, 1))
        await _eventually(lambda: len(held) == 3)  # a slot freed: line 2 went out
    await first.close()
    published = len(batch_log.lines)
    FileStore(tmp_path / "files", max_bytes=1).delete("demo", created.input_file_id)  # it expired, say

    second, edge = await make_client(edge_batch_max_in_flight=2)
    async with AsyncOpenAI(base_url=str(second.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        failed = await until(sdk, created.id, "failed")
        assert failed.errors is not None
        assert failed.errors.data is not None
        assert [e.code for e in failed.errors.data] == ["input_file_missing"]
        assert failed.request_counts is not None
        assert (failed.request_counts.total, failed.request_counts.completed) == (4, 1)
        assert failed.request_counts.failed == 3
    assert edge.failure is None
    await _eventually(
        lambda: [s.status for s in batch_log.states if s.batch_id == created.id][-1] == "failed"
    )
    assert len(batch_log.lines) == published  # nothing ran after the restart


async def test_a_batch_cancelled_while_it_validates_ends_cancelled_and_nothing_runs(
    sdk: AsyncOpenAI, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, validated = threading.Event(), threading.Event()

    def slow(self: BatchRunner, job: Any, tenant: Any) -> Any:
        release.wait(5)  # a big file takes a while to validate
        checked = _CHECK_FILE(self, job, tenant)
        validated.set()
        return checked

    monkeypatch.setattr(BatchRunner, "_check_file", slow)
    created = await run(sdk, [chat_line(i) for i in range(5)])
    assert (await sdk.batches.cancel(created.id)).status == "cancelling"
    cancelled = await until(sdk, created.id, "cancelled")
    release.set()
    await _eventually(validated.is_set)
    await asyncio.sleep(0.3)  # what validation found comes back meanwhile: it changes nothing
    again = await sdk.batches.retrieve(created.id)
    assert again.status == "cancelled"
    assert again.cancelled_at == cancelled.cancelled_at
    assert (again.output_file_id, again.error_file_id, again.in_progress_at) == (None, None, None)
    assert again.request_counts is not None
    assert (again.request_counts.total, again.request_counts.completed, again.request_counts.failed) == (
        0,
        0,
        0,
    )
    assert batch_log.lines == []
    states = [s.status for s in batch_log.states if s.batch_id == created.id]
    assert states == ["validating", "cancelling", "cancelled"]


async def test_a_finalizing_batch_cannot_be_cancelled(
    sdk: AsyncOpenAI, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()

    def slow(self: BatchRunner, *args: Any) -> int:
        release.wait(5)  # writing a big batch's files takes a while
        return _WRITE_FILES(self, *args)

    monkeypatch.setattr(BatchRunner, "_write_files", slow)
    created = await run(sdk, [chat_line(i) for i in range(3)])
    await until(sdk, created.id, "finalizing")
    with pytest.raises(openai.BadRequestError) as refused:
        await sdk.batches.cancel(created.id)
    assert refused.value.code == "batch_not_cancellable"
    assert "finalizing" in refused.value.message
    release.set()
    done = await until(sdk, created.id, "completed", "cancelled")
    assert (done.status, done.cancelling_at) == ("completed", None)
    assert "cancelling" not in [s.status for s in batch_log.states if s.batch_id == created.id]


@pytest.mark.parametrize(
    "window", ["\u00b2h", "\u0661h", "0h", "169h", "8d", "h", "", "1.5h", "-1h", " 1h", "9" * 5000 + "h"]
)
def test_a_bad_completion_window_is_refused_naming_it(window: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_window(window)
    assert refused.value.param == "completion_window"
    assert refused.value.code == "invalid_completion_window"  # a review: null, unlike every other 400


async def test_lines_wait_while_their_model_is_redeployed_and_run_after(
    make_client: MakeClient, batch_log: FakeBatchLog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 503 while a line is prepared (its model's new version is not loaded on this edge yet) is not the
    line's fault: validation passes it, and the line waits and runs once the model is back, never failed."""
    redeploying = threading.Event()
    prepare_sync = Preparer.prepare_sync

    def prepare(self: Preparer, *args: Any, **kwargs: Any) -> Any:
        if redeploying.is_set():
            raise Unavailable("The model is being redeployed; retry shortly.")
        return prepare_sync(self, *args, **kwargs)

    monkeypatch.setattr(Preparer, "prepare_sync", prepare)
    client, _ = await make_client(edge_batch_retry_backoff_s=0.01)
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        redeploying.set()
        created = await run(sdk, [chat_line(i) for i in range(4)])
        running = await until(sdk, created.id, "in_progress", "failed")
        assert running.status == "in_progress", running.errors
        await asyncio.sleep(0.3)
        waiting = await sdk.batches.retrieve(created.id)
        assert waiting.request_counts is not None
        assert (waiting.status, waiting.request_counts.failed) == ("in_progress", 0)
        assert batch_log.lines == []
        redeploying.clear()
        done = await until(sdk, created.id, "completed")
        assert done.request_counts is not None
        assert (done.request_counts.completed, done.request_counts.failed) == (4, 0)
    assert sorted((e.index, e.attempt) for e in batch_log.lines) == [(i, 0) for i in range(4)]


async def test_a_line_whose_body_has_a_field_of_the_wrong_type_is_refused_as_the_endpoint_refuses_it(
    client: Client,
) -> None:
    """Found by review: a body with ``"seed": "7"`` was refused as "not a JSON object" (param ``body``),
    where the endpoint says which field is wrong and how."""
    line = chat_line(0, seed="7")
    direct = await client.post(CHAT, json=line["body"], headers={"Authorization": f"Bearer {DEMO_KEY}"})
    said = (await direct.json())["error"]
    assert (direct.status, said["param"]) == (400, "seed")
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        failed = await until(sdk, (await run(sdk, [line])).id, "failed")
    assert failed.errors is not None
    assert failed.errors.data is not None
    (error,) = failed.errors.data
    assert (error.code, error.param) == ("invalid_value", "seed")
    assert error.message is not None
    assert "Expected `int | null`, got `str`" in error.message


async def test_a_delete_racing_a_create_never_deletes_the_input_of_an_accepted_batch(
    make_client: MakeClient, batch_log: FakeBatchLog
) -> None:
    """Found by review: a delete read every batch state (awaited, on a thread) and then deleted the file;
    a create for the file accepted meanwhile (200, ``validating``) then failed ``input_file_missing``
    where the docs promise the delete a 409 ``file_in_use``. The delete looks again, without awaiting, at
    the batches this edge accepted meanwhile."""
    client, edge = await make_client()
    runner = edge.batches
    assert runner is not None
    real_listing = runner.listing
    listed, release = asyncio.Event(), asyncio.Event()

    async def slow_listing(tenant: str) -> list[Any]:  # the listing's thread, as a loaded box runs it
        states = await real_listing(tenant)
        listed.set()
        await release.wait()
        return states

    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        up = await sdk.files.create(file=("in.jsonl", io.BytesIO(jsonl([chat_line(0)]))), purpose="batch")
        runner.listing = slow_listing  # type: ignore[method-assign]
        deleting = asyncio.ensure_future(sdk.files.delete(up.id))
        await listed.wait()
        runner.listing = real_listing  # type: ignore[method-assign]
        created = await sdk.batches.create(input_file_id=up.id, endpoint=CHAT, completion_window="24h")
        release.set()
        with pytest.raises(openai.ConflictError):
            await deleting
        done = await until(sdk, created.id, "completed", "failed")
        assert done.status == "completed", done.errors
