"""Issue 4 done-when on the real platform: mixed traffic through the edge and workers, a real ``sluice
streams`` process (killed with -9 and restarted mid-run) writing into embedded ClickHouse; the warehouse
equals what the clients saw, exactly; the audit chain verifies; a replay into an empty warehouse gives
identical aggregates; the dashboard renders the run in Chromium; the streams' spans join the requests'
traces (exported over OTLP/HTTP to a receiver in this test). The fixture ``run`` sends the traffic and
crashes the streams worker once; each test checks one part of the outcome, so a failure names it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gpu_workers.models import MINILM_ID
from gpu_workers.service import WorkerService
from infra.kafka.broker import free_port
from infra.warehouse import query_warehouse
from ingest.auth import DEMO_KEY
from schemas.events import GenerationRequested, RequestFinished, UsageRecorded
from schemas.settings import PlatformSettings
from streams.pricing import PriceTable
from tests.e2e.conftest import GPT, Platform, TopicLog

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
ROOT = Path(__file__).resolve().parents[2]

# Order-independent checksums of every derived table: equal iff the rows are equal (as multisets).
CHECKSUMS = {
    table: f"SELECT count() AS n, sum(cityHash64(*)) AS h FROM (SELECT * FROM {table})"
    for table in (
        "request_facts FINAL",
        "audit_log FINAL",
        "events_raw FINAL",
        "batches FINAL",
        "sli_minute",
        "errors_minute",
        "spend_minute",
        "spend_day",
    )
}


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint in this process: what the streams process exports lands here."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    async def _traces(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                self.spans.extend(scope.spans)
        return web.Response(status=200)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


@dataclass
class Streams:
    env: dict[str, str]
    port: int
    proc: subprocess.Popen[bytes] | None = None
    log: list[Path] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def settings(self) -> PlatformSettings:
        return PlatformSettings(
            kafka_bootstrap=self.env["SLUICE_KAFKA_BOOTSTRAP"],
            topic_prefix=self.env["SLUICE_TOPIC_PREFIX"],
            data_dir=self.env["SLUICE_DATA_DIR"],
        )

    @property
    def cwd(self) -> Path:
        """The process's working directory: it must leave nothing there (its files go under the data dir)."""
        return Path(self.env["SLUICE_DATA_DIR"]).parent / "cwd"

    def start(self) -> None:
        out = Path(self.env["SLUICE_DATA_DIR"]).parent / f"streams-{len(self.log)}.log"
        self.log.append(out)
        self.cwd.mkdir(exist_ok=True)
        with out.open("wb") as sink:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sluice", "streams"],
                env=self.env,
                cwd=self.cwd,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )

    async def ready(self, within: float = 90) -> None:
        deadline = time.monotonic() + within
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise AssertionError(f"sluice streams exited: {self.log[-1].read_text()[-3000:]}")
                try:
                    async with session.get(f"{self.url}/readyz") as response:
                        if response.status == 200:
                            return
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.2)
        raise AssertionError(f"sluice streams not ready: {self.log[-1].read_text()[-3000:]}")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    async def sql(self, sql: str) -> list[dict[str, Any]]:
        result = await asyncio.to_thread(query_warehouse, self.settings, sql)
        return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


@pytest.fixture(scope="module")
async def otlp() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    await receiver.start()
    yield receiver
    await receiver.stop()


@contextlib.contextmanager
def running_streams(settings: PlatformSettings, data_dir: Path, **env: str) -> Iterator[Streams]:
    """A real ``sluice streams`` process on its own data dir and a free port, stopped afterwards."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    # The process runs elsewhere than this checkout, and must still import its code.
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    base.update(
        SLUICE_KAFKA_BOOTSTRAP=settings.bootstrap,
        SLUICE_TOPIC_PREFIX=settings.topic_prefix,
        SLUICE_DATA_DIR=str(data_dir),
        SLUICE_STREAMS_BATCH_MS="100",
        **env,
    )
    running = Streams(env=base, port=free_port())
    running.env["SLUICE_STREAMS_PORT"] = str(running.port)
    running.start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def streams(
    e2e_settings: PlatformSettings, tmp_path_factory: pytest.TempPathFactory, otlp: OtlpReceiver
) -> Iterator[Streams]:
    with running_streams(
        e2e_settings,
        tmp_path_factory.mktemp("streams") / "data",
        SLUICE_OTLP_ENDPOINT=f"http://127.0.0.1:{otlp.port}/v1/traces",
    ) as running:
        yield running


@dataclass
class Seen:
    """What a client saw of one request."""

    request_id: str
    model: str
    outcome: str
    usage: dict[str, int] | None = None


async def _chat_stream(session: aiohttp.ClientSession, url: str, n: int) -> Seen:
    body = {
        "model": GPT,
        "messages": [{"role": "user", "content": f"Tell me story {n}."}],
        "stream": True,
        "max_tokens": 12,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    async with session.post(f"{url}/chat/completions", headers=AUTH, json=body) as response:
        assert response.status == 200
        usage = None
        async for line in response.content:
            if line.startswith(b"data: {"):
                usage = json.loads(line[6:]).get("usage") or usage
        return Seen(response.headers["x-request-id"], GPT, "completed", usage)


async def _completion(session: aiohttp.ClientSession, url: str, n: int) -> Seen:
    body = {"model": GPT, "prompt": f"The river {n}", "max_tokens": 8 + n}
    async with session.post(f"{url}/completions", headers=AUTH, json=body) as response:
        assert response.status == 200
        return Seen(response.headers["x-request-id"], GPT, "completed", (await response.json())["usage"])


async def _embedding(session: aiohttp.ClientSession, url: str, n: int) -> Seen:
    body = {"model": MINILM_ID, "input": [f"a river {n}", "a stream"]}
    async with session.post(f"{url}/embeddings", headers=AUTH, json=body) as response:
        assert response.status == 200
        return Seen(
            response.headers["x-request-id"], MINILM_ID, "completed", (await response.json())["usage"]
        )


async def _disconnect(session: aiohttp.ClientSession, url: str) -> Seen:
    body = {"model": GPT, "prompt": "A long story", "max_tokens": 250, "ignore_eos": True, "stream": True}
    response = await session.post(f"{url}/completions", headers=AUTH, json=body)
    assert response.status == 200
    request_id = response.headers["x-request-id"]
    async for line in response.content:
        if line.startswith(b"data: {"):
            break
    response.close()  # the client goes away mid-stream
    return Seen(request_id, GPT, "cancelled")


async def _expired(session: aiohttp.ClientSession, url: str) -> Seen:
    body = {"model": GPT, "prompt": "Too slow", "max_tokens": 250, "ignore_eos": True}
    headers = {**AUTH, "X-Request-Timeout": "0.05"}
    async with session.post(f"{url}/completions", headers=headers, json=body) as response:
        assert response.status == 504
        return Seen(response.headers.get("x-request-id", ""), GPT, "deadline")


async def _bad(session: aiohttp.ClientSession, url: str) -> None:
    async with session.post(f"{url}/completions", headers=AUTH, json={"model": GPT}) as response:
        assert response.status == 400  # never published: not in the warehouse


async def _traffic(
    session: aiohttp.ClientSession, url: str, base: int, *, one_at_a_time: bool = False
) -> list[Seen]:
    """Ten accepted requests (4 streamed chats, 3 completions, 2 embeddings, 1 client that leaves) and one
    refused: all at once, or one after another, so that their rows reach the warehouse over several
    batches instead of one."""
    requests: list[Callable[[], Awaitable[Seen]]] = [
        lambda: _chat_stream(session, url, base),
        lambda: _completion(session, url, base),
        lambda: _embedding(session, url, base),
        lambda: _chat_stream(session, url, base + 1),
        lambda: _completion(session, url, base + 1),
        lambda: _disconnect(session, url),
        lambda: _chat_stream(session, url, base + 2),
        lambda: _embedding(session, url, base + 1),
        lambda: _completion(session, url, base + 2),
        lambda: _chat_stream(session, url, base + 3),
    ]
    if one_at_a_time:
        seen = [await request() for request in requests]
    else:
        seen = list(await asyncio.gather(*(request() for request in requests)))
    await _bad(session, url)
    return seen


async def _facts_count(streams: Streams, where: str = "1") -> int:
    rows = await streams.sql(f"SELECT count() AS n FROM request_facts FINAL WHERE {where}")
    return int(rows[0]["n"])


async def _wait_rows(
    streams: Streams, table: str, expected: int, within: float = 60, every: float = 0.3
) -> int:
    """Poll until ``table`` holds at least ``expected`` rows; the count seen."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        rows = await streams.sql(f"SELECT count() AS n FROM {table} FINAL")
        if rows[0]["n"] >= expected:
            return int(rows[0]["n"])
        await asyncio.sleep(every)
    raise AssertionError(f"{table} did not reach {expected} rows: {rows}")


def _sluice(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


KILL_AFTER = 3
"""The streams worker is killed once it has written at least this many rows of the second half (of 10)."""


@dataclass
class Run:
    """What the clients saw of a run through a ``kill -9`` of the streams worker, and what the log holds."""

    seen: list[Seen]
    """Every request a client got an answer for (not the one that ran out of time)."""
    expired: Seen
    deadline_id: str
    """The request that ran out of time, as the log has it."""
    slow: list[GenerationRequested]
    """Its request events on the log (exactly one expected)."""
    finals: dict[str, RequestFinished]
    """The last terminal event of each request on the results topic."""
    second_half_rows_at_kill: int

    @property
    def request_ids(self) -> set[str]:
        return {s.request_id for s in self.seen} | {self.deadline_id}


@pytest.fixture(scope="module")
async def run(
    platform: Platform,
    workers: list[WorkerService],
    streams: Streams,
    span_exporter: InMemorySpanExporter,  # the edge and workers in this process record spans
) -> Run:
    """Traffic in three parts: the first is written, the streams worker is killed with -9 after it wrote
    a few rows of the second, then restarted for the rest of the second and the third."""
    url = platform.base_url
    await streams.ready()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        seen = await _traffic(session, url, 0)
        expired = await _expired(session, url)

        def slow_requests() -> list[GenerationRequested]:
            return [
                e
                for e in platform.requests.all()
                if isinstance(e, GenerationRequested) and e.prompt == "Too slow"
            ]

        await platform.requests.wait(lambda: slow_requests() != [], within=30)
        first = [s.request_id for s in seen] + [slow_requests()[0].request_id]
        listed = ", ".join(f"'{rid}'" for rid in first)
        deadline = time.monotonic() + 60
        while await _facts_count(streams, f"request_id IN ({listed})") < len(first):
            assert time.monotonic() < deadline, "the first half's rows were not written in time"
            await asyncio.sleep(0.3)
        written = await _facts_count(streams)

        # One request at a time: the rows of the second half are written over several batches, so the
        # kill lands between them (all at once, they were written in one batch).
        second = asyncio.create_task(_traffic(session, url, 100, one_at_a_time=True))
        at_kill = await _wait_rows(streams, "request_facts", written + KILL_AFTER, every=0.02)
        streams.kill()
        seen += await second
        streams.start()
        await streams.ready()
        seen += await _traffic(session, url, 200)

    slow = slow_requests()
    run = Run(seen, expired, slow[0].request_id, slow, {}, at_kill - written)

    def terminal(rid: str) -> RequestFinished | None:
        found = [e for e in platform.results.of(rid) if isinstance(e, RequestFinished)]
        return found[-1] if found else None

    await platform.results.wait(lambda: all(terminal(r) is not None for r in run.request_ids), within=60)
    await platform.results.caught_up()
    run.finals = {r: f for r in run.request_ids if (f := terminal(r)) is not None}
    return run


@pytest.fixture(scope="module")
async def written(run: Run, streams: Streams) -> Run:
    """The run, once the warehouse holds a fact and an audit entry per request."""
    await _wait_rows(streams, "request_facts", len(run.request_ids))
    await _wait_rows(streams, "audit_log", len(run.request_ids))
    return run


async def test_the_kill_came_mid_way_through_the_second_half(run: Run) -> None:
    assert KILL_AFTER <= run.second_half_rows_at_kill < 10, (
        "the streams worker was killed after it wrote the whole second half: the crash tests nothing"
    )


async def test_every_accepted_request_is_on_the_log_with_exactly_one_terminal_event(
    run: Run, platform: Platform
) -> None:
    assert len(run.slow) == 1, "the request that ran out of time was accepted (and published) once"
    assert run.expired.request_id in ("", run.deadline_id)
    assert set(run.finals) == run.request_ids
    twice = [
        r
        for r in run.request_ids
        if len([e for e in platform.results.of(r) if isinstance(e, RequestFinished)]) != 1
    ]
    assert twice == [], "a request ended more than once"


async def _facts(streams: Streams) -> dict[str, dict[str, Any]]:
    return {
        row["request_id"]: row
        for row in await streams.sql(
            "SELECT request_id, model, status, prompt_tokens, completion_tokens, cost_nanos, kind, stream "
            "FROM request_facts FINAL"
        )
    }


async def test_the_facts_equal_what_clients_saw(written: Run, streams: Streams) -> None:
    run = written
    facts = await _facts(streams)
    assert set(facts) == run.request_ids, "exactly the accepted requests, once each"
    duplicates = await streams.sql(
        "SELECT count() AS rows, uniqExact(request_id) AS ids FROM request_facts FINAL"
    )
    assert duplicates[0]["rows"] == duplicates[0]["ids"] == len(run.request_ids)

    prices = PriceTable()
    for s in run.seen:
        fact = facts[s.request_id]
        final = run.finals[s.request_id]
        assert fact["status"] == final.status
        assert fact["prompt_tokens"] == final.usage.prompt_tokens
        assert fact["completion_tokens"] == final.usage.completion_tokens
        if s.outcome == "completed":
            assert fact["status"] == "completed"
            assert s.usage is not None
            assert fact["prompt_tokens"] == s.usage["prompt_tokens"]
            assert fact["completion_tokens"] == s.usage.get("completion_tokens", 0)
        else:
            assert fact["status"] == "cancelled"
        assert fact["cost_nanos"] == prices.cost_nanos(
            s.model, fact["prompt_tokens"], fact["completion_tokens"]
        )
    assert facts[run.deadline_id]["status"] in ("expired", "cancelled")


async def test_the_ledger_and_the_slis_add_up_to_the_facts(written: Run, streams: Streams) -> None:
    run = written
    facts = await _facts(streams)
    prices = PriceTable()
    expected_cost = sum(
        prices.cost_nanos(
            s.model, facts[s.request_id]["prompt_tokens"], facts[s.request_id]["completion_tokens"]
        )
        for s in run.seen
    )
    expected_cost += facts[run.deadline_id]["cost_nanos"]
    ledger = await streams.sql("SELECT sum(cost_nanos) AS c, sum(requests) AS n FROM spend_day")
    assert ledger[0]["c"] == expected_cost
    assert ledger[0]["n"] == len(run.request_ids)
    sli = await streams.sql("SELECT sum(requests) AS n, sum(completed) AS ok FROM sli_minute")
    assert sli[0]["n"] == len(run.request_ids)
    assert sli[0]["ok"] == sum(1 for s in run.seen if s.outcome == "completed")
    top = _sluice(streams.env, "sql", "--saved", "top-tenants-by-spend", "-f", "csv")
    assert top.returncode == 0, top.stderr
    assert top.stdout.splitlines()[1].startswith("demo,")


async def test_the_usage_topic_bills_each_request_once_as_the_ledger_across_the_crash(
    written: Run, streams: Streams, platform: Platform
) -> None:
    """Found by review: nothing wrote the ``usage`` topic the docs promised billing systems. Each request
    has its usage record, across the streams worker's kill: a copy written again has the same id, and the
    records' costs add up to the ledger's."""
    log = TopicLog(platform.settings.kafka, platform.names.usage)
    log._thread.start()
    try:
        await log.wait(lambda: len({e.request_id for e in log.all()}) >= len(written.request_ids))
        await log.caught_up()
        bills = [e for e in log.all() if isinstance(e, UsageRecorded)]
    finally:
        log._thread.stop()
    first = {b.id: b for b in reversed(bills)}
    assert {b.request_id for b in first.values()} == written.request_ids
    assert len(first) == len(written.request_ids), "one id per request, whichever copy"
    facts = await _facts(streams)
    assert {b.request_id: b.cost_nanos for b in first.values()} == {
        r: f["cost_nanos"] for r, f in facts.items()
    }
    ledger = await streams.sql("SELECT sum(cost_nanos) AS c FROM spend_day")
    assert sum(b.cost_nanos or 0 for b in first.values()) == ledger[0]["c"]


async def test_the_audit_chain_has_one_entry_per_request_across_the_crash_and_verifies(
    written: Run, streams: Streams
) -> None:
    requests = "FROM audit_log FINAL WHERE tenant NOT LIKE 'admin:%'"
    audit = await streams.sql(f"SELECT count() AS n, uniqExact(request_id) AS ids {requests}")
    repeated = await streams.sql(
        f"SELECT request_id, groupArray(seq) AS seqs, groupArray(tenant) AS t {requests} "
        "GROUP BY request_id HAVING count() > 1"
    )
    assert repeated == []
    assert audit[0]["n"] == audit[0]["ids"] == len(written.request_ids)
    # the price table, published by the first start only: the restart found its version on the log
    admin = await streams.sql(
        "SELECT tenant, action, decision FROM audit_log FINAL WHERE tenant LIKE 'admin:%'"
    )
    assert admin == [
        {"tenant": "admin:prices:demo-2026-11", "action": "prices.publish", "decision": "demo-2026-11"}
    ]
    verified = _sluice(streams.env, "audit", "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr


async def test_the_dashboard_renders_the_run_without_console_errors(written: Run, streams: Streams) -> None:
    from tests.streams.browser import render

    shot = ROOT / "test-artifacts" / "dashboard-e2e.png"
    rendered = await render(f"{streams.url}/dashboard", shot)
    assert rendered.console_errors == []
    assert shot.stat().st_size > 10_000


async def test_the_streams_spans_join_the_request_traces(
    written: Run, platform: Platform, otlp: OtlpReceiver
) -> None:
    """A span of the streams process is a child of the worker's publish span."""
    finals = [f for f in written.finals.values() if f.traceparent]
    assert len(finals) == len(written.request_ids)
    parents = {(f.traceparent or "").split("-")[1]: (f.traceparent or "").split("-")[2] for f in finals}
    results_topic = platform.names.results

    def linked() -> bool:
        return any(
            span.name == f"process {results_topic}"
            and parents.get(span.trace_id.hex()) == span.parent_span_id.hex()
            for span in otlp.spans
        )

    await platform.results.wait(linked, within=30)


async def test_a_replay_into_an_empty_warehouse_gives_identical_aggregates(
    written: Run, streams: Streams
) -> None:
    async def live() -> dict[str, object]:
        return {name: (await streams.sql(sql))[0] for name, sql in CHECKSUMS.items()}

    # The live worker keeps publishing decisions (a drift window closing, a burn-rate check) and writing
    # them; a replay is compared with a live warehouse that held still while the replay read the log.
    for attempt in range(3):
        replay_env = {
            **streams.env,
            "SLUICE_DATA_DIR": str(Path(streams.env["SLUICE_DATA_DIR"]).parent / f"replay-{attempt}"),
        }
        before = await live()
        replayed = _sluice(replay_env, "replay")
        assert replayed.returncode == 0, replayed.stdout + replayed.stderr
        if await live() == before:
            break
    else:
        pytest.fail("the live warehouse changed during each of 3 replays")
    for name, sql in CHECKSUMS.items():
        again = _sluice(replay_env, "sql", sql, "-f", "json")
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout) == [before[name]], f"{name} differs after replay"
    refused = _sluice(replay_env, "replay")
    assert refused.returncode == 1
    assert "not empty" in refused.stdout + refused.stderr


async def test_the_streams_process_leaves_nothing_in_its_working_directory(
    written: Run, streams: Streams
) -> None:
    assert list(streams.cwd.iterdir()) == [], "Faust's directory belongs under SLUICE_DATA_DIR"


async def _status(session: aiohttp.ClientSession, url: str) -> int:
    body = {"model": GPT, "prompt": "Budget?", "max_tokens": 2}
    async with session.post(f"{url}/completions", headers=AUTH, json=body) as response:
        return response.status


async def test_a_tenant_over_its_daily_budget_is_refused_until_the_budget_is_raised(
    platform: Platform, workers: list[WorkerService], streams: Streams, tmp_path: Path
) -> None:
    """Spend (from the warehouse) over the limit → BudgetStateChanged on control → the edge answers 402;
    a raised limit → the edge serves the tenant again."""
    budgets = tmp_path / "budgets.toml"

    async def restart_with(limit_usd: float) -> None:
        budgets.write_text(f"[daily_usd]\ndemo = {limit_usd}\n")
        streams.stop()
        streams.env.update(SLUICE_STREAMS_BUDGETS_FILE=str(budgets), SLUICE_STREAMS_CONTROL_INTERVAL_S="0.5")
        streams.start()
        await streams.ready()

    async def wait_status(session: aiohttp.ClientSession, status: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if await _status(session, platform.base_url) == status:
                return
            await asyncio.sleep(0.3)
        raise AssertionError(f"the edge never answered {status}")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        assert await _status(session, platform.base_url) == 200  # something spent today
        await restart_with(0.000001)
        await wait_status(session, 402)
        async with session.post(
            f"{platform.base_url}/completions", headers=AUTH, json={"model": GPT, "prompt": "x"}
        ) as refused:
            assert (await refused.json())["error"]["code"] == "budget_exceeded"
        await restart_with(1000.0)
        await wait_status(session, 200)

    # Both decisions are in the audit log, on the budget's own chain, and every chain still verifies.
    deadline = time.monotonic() + 30
    decisions: list[str] = []
    while time.monotonic() < deadline and decisions != ["exhausted", "within_budget"]:
        rows = await streams.sql(
            "SELECT decision FROM audit_log FINAL WHERE tenant = 'admin:budget:demo' ORDER BY seq"
        )
        decisions = [r["decision"] for r in rows]
        await asyncio.sleep(0.3)
    assert decisions == ["exhausted", "within_budget"]
    verified = _sluice(streams.env, "audit", "verify")
    assert verified.returncode == 0, verified.stdout + verified.stderr
