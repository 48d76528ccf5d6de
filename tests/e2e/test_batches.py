"""Async batches on the real broker, real workers and a real ``sluice edge`` process, driven by the official
``openai`` SDK: a 10k-line embeddings batch and a 1k-line chat batch complete while each model's worker is
killed with -9 (and restarted) and the edge is killed with -9 (and restarted). Every input gets exactly
one output line, in input order, equal to what a direct call of the same body returns, and each line has
exactly one completed (so billed) result on the log."""

from __future__ import annotations

import asyncio
import io
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import IO, Any

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import Batch

from infra.kafka.broker import free_port
from ingest.auth import DEMO_KEY
from schemas.events import RequestFinished
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from tests.e2e.conftest import GPT, TopicLog

pytestmark = pytest.mark.integration
MINILM = "all-minilm-l6-v2"
EMBEDDING_LINES = 10_000
CHAT_LINES = 1_000
TOPICS = ["river", "mountain", "city", "forest", "ocean", "desert", "garden", "bridge", "library", "harbour"]


class Services:
    """``sluice worker`` per model and ``sluice edge`` as processes, each killable and restartable."""

    def __init__(self, settings: PlatformSettings, data_dir: Path, logs: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
        env.update(
            SLUICE_KAFKA_BOOTSTRAP=settings.bootstrap,
            SLUICE_TOPIC_PREFIX=settings.topic_prefix,
            SLUICE_DATA_DIR=str(data_dir),
            SLUICE_WORKER_SESSION_TIMEOUT_MS="6000",
            SLUICE_WORKER_OPS_PORT="0",
            SLUICE_EDGE_PORT=str(self.port),
            SLUICE_EDGE_ID="batch-edge",
            SLUICE_EDGE_BATCH_RETRY_BACKOFF_S="0.2",
            SLUICE_LOG_LEVEL="info",
        )
        self._env, self._logs = env, logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._files: list[IO[bytes]] = []
        self.starts: Counter[str] = Counter()

    def start(self, name: str) -> None:
        command = ["edge"] if name == "edge" else ["worker", "--model", name]
        self.starts[name] += 1
        log = (self._logs / f"{name}-{self.starts[name]}.log").open("wb")
        self._files.append(log)
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "sluice", *command], env=self._env, stdout=log, stderr=subprocess.STDOUT
        )

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for log in self._files:
            log.close()

    def tails(self) -> str:
        return "\n".join(
            f"--- {path.name}\n" + path.read_text(errors="replace")[-3000:]
            for path in sorted(self._logs.glob("*.log"))
        )


@pytest.fixture
def services(e2e_settings: PlatformSettings, prepared_models: None, tmp_path: Path) -> Iterator[Services]:
    (tmp_path / "logs").mkdir()
    made = Services(e2e_settings, tmp_path / "data", tmp_path / "logs")
    try:
        for name in (GPT, MINILM, "edge"):
            made.start(name)
        yield made
    finally:
        made.stop()


def embedding_line(i: int) -> dict[str, Any]:
    text = f"a note about the {TOPICS[i % len(TOPICS)]} number {i}"
    return {
        "custom_id": f"emb-{i}",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": MINILM, "input": text},
    }


def chat_line(i: int) -> dict[str, Any]:
    body = {
        "model": GPT,
        "messages": [{"role": "user", "content": f"Tell me about the {TOPICS[i % len(TOPICS)]} {i}."}],
        "max_tokens": 12,
        "temperature": 0,
        "seed": i,
    }
    return {"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def retrying(call: Callable[[], Any], within_s: float = 120.0) -> Any:
    """A call to the edge that may be down for a moment (it is being restarted)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return call()
        except (openai.APIConnectionError, openai.InternalServerError, httpx.HTTPError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def wait_for(check: Callable[[], bool], what: str, services: Services, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {within_s:.0f}s\n{services.tails()}")
        for name, proc in services.procs.items():
            if proc.poll() is not None:
                raise AssertionError(f"{name} exited with {proc.returncode}\n{services.tails()}")
        time.sleep(0.5)


def settled(sdk: OpenAI, batch_id: str) -> int:
    batch: Batch = retrying(lambda: sdk.batches.retrieve(batch_id))
    counts = batch.request_counts
    return 0 if counts is None else counts.completed + counts.failed


def completed(sdk: OpenAI, batch_id: str) -> bool:
    batch: Batch = retrying(lambda: sdk.batches.retrieve(batch_id))
    return batch.status == "completed"


def file_lines(sdk: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    assert file_id is not None
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()]


@pytest.mark.timeout(900)
def test_batches_complete_exactly_once_in_order_through_worker_and_edge_kills(
    services: Services, e2e_settings: PlatformSettings
) -> None:
    settings = e2e_settings
    results = TopicLog(settings.kafka, TopicNames(settings.topic_prefix).results)
    results._thread.start()
    sdk = OpenAI(base_url=f"http://127.0.0.1:{services.port}/v1", api_key=DEMO_KEY, max_retries=0, timeout=60)
    try:
        _run(services, sdk, results)
    finally:
        sdk.close()
        results._thread.stop()


def _run(services: Services, sdk: OpenAI, results: TopicLog) -> None:
    retrying(lambda: sdk.models.list())  # the edge is up
    embeddings = [embedding_line(i) for i in range(EMBEDDING_LINES)]
    chats = [chat_line(i) for i in range(CHAT_LINES)]
    began = time.monotonic()
    emb_file = sdk.files.create(file=("emb.jsonl", io.BytesIO(jsonl(embeddings))), purpose="batch")
    chat_file = sdk.files.create(file=("chat.jsonl", io.BytesIO(jsonl(chats))), purpose="batch")
    emb = sdk.batches.create(input_file_id=emb_file.id, endpoint="/v1/embeddings", completion_window="24h")
    chat = sdk.batches.create(
        input_file_id=chat_file.id, endpoint="/v1/chat/completions", completion_window="24h"
    )

    # Kill each model's worker with -9 mid-batch (their unfinished lines go to the restarted one), then the
    # edge (the runner resumes from its journal and the results topic's committed offsets).
    at_kill: list[tuple[str, int, int]] = []

    def kill(name: str, batch: Batch, total: int, after: int) -> None:
        wait_for(lambda: settled(sdk, batch.id) >= after, f"{after} lines of {batch.id}", services, 300)
        done = settled(sdk, batch.id)
        services.kill(name)
        at_kill.append((name, done, total))
        services.start(name)

    kill(GPT, chat, CHAT_LINES, 50)
    kill(MINILM, emb, EMBEDDING_LINES, 1500)
    kill("edge", emb, EMBEDDING_LINES, 4000)
    for batch_id in (emb.id, chat.id):
        wait_for(partial(completed, sdk, batch_id), f"batch {batch_id} completed", services, 600)
    took = time.monotonic() - began
    assert services.starts == Counter({GPT: 2, MINILM: 2, "edge": 2})
    print(f"\nprogress at each kill -9 (name, lines settled, of): {at_kill}")
    assert all(done < total for _, done, total in at_kill)  # every kill hit a batch mid-way

    for batch, lines in ((emb, embeddings), (chat, chats)):
        done = sdk.batches.retrieve(batch.id)
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (
            len(lines),
            len(lines),
            0,
        ), done
        assert done.error_file_id is None
        out = file_lines(sdk, done.output_file_id)
        assert [line["custom_id"] for line in out] == [
            line["custom_id"] for line in lines
        ]  # one each, in order
        assert all(line["response"]["status_code"] == 200 for line in out)
        _same_as_direct_calls(sdk, lines, out)
        _one_completed_result_per_line(results, done.id, len(lines))
    print(f"\n{EMBEDDING_LINES} embedding + {CHAT_LINES} chat lines in {took:.0f}s with 3 kills")


def _same_as_direct_calls(sdk: OpenAI, lines: list[dict[str, Any]], out: list[dict[str, Any]]) -> None:
    for i in range(0, len(lines), max(1, len(lines) // 25)):
        body = lines[i]["body"]
        got = out[i]["response"]["body"]
        if lines[i]["url"] == "/v1/embeddings":
            direct = sdk.embeddings.create(model=body["model"], input=body["input"]).data[0].embedding
            batched = got["data"][0]["embedding"]
            assert len(batched) == len(direct) == 384
            assert max(abs(a - b) for a, b in zip(batched, direct, strict=True)) < 1e-4
            assert math.isclose(sum(a * a for a in batched), 1.0, rel_tol=1e-3)
        else:
            direct_chat = sdk.chat.completions.create(**body)
            assert got["choices"][0]["message"]["content"] == direct_chat.choices[0].message.content
            assert direct_chat.usage is not None
            assert got["usage"]["completion_tokens"] == direct_chat.usage.completion_tokens


def _one_completed_result_per_line(results: TopicLog, batch_id: str, total: int) -> None:
    """Billing is per completed terminal event (the warehouse keeps one row per request id): each line has
    exactly one completed request, whatever was re-run or re-published."""
    asyncio.run(results.caught_up())
    completed: dict[int, set[str]] = {}
    for event in results.all():
        if (
            isinstance(event, RequestFinished)
            and event.batch is not None
            and event.batch.batch_id == batch_id
        ) and event.status == "completed":
            completed.setdefault(event.batch.index, set()).add(event.request_id)
    assert sorted(completed) == list(range(total))
    assert all(len(ids) == 1 for ids in completed.values())
