"""``kill -9`` of a worker mid-stream: every accepted request still ends in a terminal event, and the
clients' streams finish with the same text the results topic records (the re-run reproduces the tokens
and the edge skips those the client already has)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import aiohttp
import pytest

from ingest.auth import DEMO_KEY
from schemas.events import RequestFinished, TokenChunk
from schemas.settings import PlatformSettings
from tests.e2e.conftest import GPT, Platform

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}


@pytest.fixture
def worker_processes(
    e2e_settings: PlatformSettings, prepared_models: None
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env.update(
        SLUICE_KAFKA_BOOTSTRAP=e2e_settings.bootstrap,
        SLUICE_TOPIC_PREFIX=e2e_settings.topic_prefix,
        SLUICE_WORKER_SESSION_TIMEOUT_MS="6000",
        SLUICE_WORKER_FLUSH_TOKENS="4",
        SLUICE_WORKER_OPS_PORT="0",  # two workers on one host
    )
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "sluice", "worker", "--model", GPT],
            env={**env, "SLUICE_WORKER_ID": name},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name in ("crash-a", "crash-b")
    }
    try:
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _body(n: int) -> dict[str, object]:
    return {
        "model": GPT,
        "prompt": f"Story number {n}:",
        "max_tokens": 200,
        "temperature": 0.9,
        "ignore_eos": True,
        "stream": True,
    }


async def _stream(
    session: aiohttp.ClientSession, url: str, n: int, headers: dict[str, str] | None = None
) -> tuple[str, str, str, list[tuple[str, str]]]:
    """(request id, streamed text, finish reason, (event id, the text up to it) of each event with an id)
    of one streamed completion (``headers``: a resume's ``Last-Event-ID``)."""
    request_id, text, reason = "", "", ""
    ids: list[tuple[str, str]] = []
    event_id = None
    async with session.post(
        f"{url}/completions", headers={**AUTH, **(headers or {})}, json=_body(n)
    ) as response:
        assert response.status == 200
        async for line in response.content:
            if line.startswith(b"id: "):
                event_id = line[4:].decode().strip()
                request_id = request_id or event_id.split(":")[0]
            if line.startswith(b"data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                if event_id is not None:
                    ids.append((event_id, text))
                event_id = None
    return request_id, text, reason, ids


async def test_kill_9_mid_stream_still_finishes_every_request(
    platform: Platform, worker_processes: dict[str, subprocess.Popen[bytes]]
) -> None:
    # Both workers up and in the group: a warm-up request is served (the workers may still be loading their
    # model on a busy box: it waits past the edge's default 60 s).
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=180)) as session:
        warm = await session.post(
            f"{platform.base_url}/completions",
            headers={**AUTH, "X-Request-Timeout": "170"},
            json={"model": GPT, "prompt": "hi", "max_tokens": 2},
        )
        assert warm.status == 200
        streams = [asyncio.create_task(_stream(session, platform.base_url, n)) for n in range(6)]

        def first_chunk_source() -> str | None:
            chunks = [e for e in platform.replies.all() if isinstance(e, TokenChunk) and e.offset > 0]
            return chunks[0].source if chunks else None

        await platform.replies.wait(lambda: first_chunk_source() is not None, within=120)
        victim = (first_chunk_source() or "").removeprefix("gpu_workers/")
        worker_processes[victim].send_signal(signal.SIGKILL)
        async with asyncio.timeout(150):
            outcomes = await asyncio.gather(*streams)

    for request_id, *_ in outcomes:
        await platform.results.wait(lambda rid=request_id: bool(platform.results.of(rid)))  # type: ignore[misc]
    await platform.results.caught_up()  # a late second terminal event would be in the log by now
    for request_id, text, reason, _ in outcomes:
        finals = [e for e in platform.results.of(request_id) if isinstance(e, RequestFinished)]
        assert len(finals) == 1, f"{request_id} ended {len(finals)} times"
        assert finals[0].status == "completed"
        assert reason == "length"
        assert text == finals[0].text
    # at least one request was cut mid-stream on the victim and re-run from the log by the survivor
    rerun = [
        n
        for n, (rid, *_) in enumerate(outcomes)
        if {e.source for e in platform.replies.of(rid) if isinstance(e, TokenChunk)}
        == {"gpu_workers/crash-a", "gpu_workers/crash-b"}
    ]
    assert rerun
    # An audit: the SSE ids were the chunks' seq, which the re-run numbered from 0 again, so they repeated,
    # and a resume after one skipped or repeated text. Each id is unique, and a resume after any of them
    # (read back from the log) gets exactly the rest of the text.
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        for n in rerun:
            _, text, _, ids = outcomes[n]
            assert len({event_id for event_id, _ in ids}) == len(ids), ids
            for event_id, had in ids[:: max(1, len(ids) // 8)]:
                _, rest, _, _ = await _stream(session, platform.base_url, n, {"Last-Event-ID": event_id})
                assert had + rest == text, event_id
