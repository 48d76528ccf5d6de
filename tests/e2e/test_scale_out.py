"""Scale-out as an operator runs it: ``sluice up --edges 2 --autoscale`` on a 3-broker cluster (replication 3,
``min.insync.replicas`` 2) under streaming load from the ``openai`` SDK.

One run, in order:

1. a load step: the autoscaler publishes a ``WorkersScaled`` and the worker count rises (a warm standby
   joins at once);
2. under that load a broker is killed with -9 and restarted, then the second edge is killed with -9 (its
   streaming clients resume on the first edge with ``Last-Event-ID``), then a worker is killed with -9;
3. the load drops to a trickle: the count falls back, one drained worker at a time, with requests running.

Then: every request the log accepted ended exactly once (the results topic, the warehouse's count and
distinct ids agree), every client's text is the text its request ended with, the audit chains verify and
hold the scaling decisions.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from confluent_kafka import Consumer, TopicPartition
from openai import AsyncOpenAI

from bus.consumer import consumer_config
from bus.positions import read_to_end, watermarks
from infra.kafka.broker import free_port, pid_alive
from ingest.auth import DEMO_KEY
from schemas.codec import DecodeError, decode
from schemas.events import RequestFinished
from schemas.settings import KafkaConnection
from tests.infra.test_cluster import _free_run
from tests.sluice.test_cli import sluice

pytestmark = pytest.mark.integration
GPT = "demo-gpt"
MAX_TOKENS = 40
LONG_TOKENS = 240
"""The resuming clients' streams: long enough (seconds under load) that the edge's kill cuts them midway,
not after the edge has written them whole into the socket."""
SCALE_OUT_WITHIN_S = 30.0
SCALE_IN_WITHIN_S = 45.0


class Output:
    """Every line ``sluice up`` prints, read on a thread; wait for a pattern from a given line on."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._proc = proc
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def wait(self, pattern: str, timeout: float, start: int = 0) -> tuple[int, re.Match[str]]:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            with self._lock:
                for index in range(start, len(self.lines)):
                    found = regex.search(self.lines[index])
                    if found:
                        return index, found
            if self._proc.poll() is not None:
                break
            time.sleep(0.1)
        tail = "\n".join(line for line in self.lines[-60:] if not line.startswith("{"))
        raise AssertionError(f"{pattern!r} not printed within {timeout:.0f}s; sluice up printed:\n{tail}")

    def mark(self) -> int:
        with self._lock:
            return len(self.lines)


@dataclass
class Ledger:
    """What the clients saw: request id -> the text they assembled, and how each phase went."""

    texts: dict[str, str] = field(default_factory=dict)
    resumed: list[str] = field(default_factory=list)
    unresumed: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    """Streams through the second edge with tokens on the way now."""
    cut: set[str] = field(default_factory=set)
    """Streams through the second edge that broke after their first tokens (the edge's kill)."""
    done_at: dict[str, list[float]] = field(default_factory=dict)
    """Client kind -> when each of its requests finished (to see each edge serving through the kills)."""
    trail: dict[str, list[str]] = field(default_factory=dict)
    """A resumer's request id -> each connection of its stream: the edge, the ids it went from and to, and
    how much text it brought (what a failure shows)."""

    def finish(self, kind: str, request_id: str, text: str) -> None:
        self.texts[request_id] = text
        self.done_at.setdefault(kind, []).append(time.monotonic())

    """Streams cut and never finished on another edge (must stay empty)."""
    refused: Counter[str] = field(default_factory=Counter)
    """Requests the platform did not accept (an error before any event), by why: none of them is on the log."""


def _children(parent: int, word: str, *, serving: bool = False) -> list[int]:
    """Pids of ``parent``'s child processes whose command line has ``word`` (``edge``, ``worker``); with
    ``serving``, not a warm standby."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != parent or word.encode() not in cmdline:
                continue
            if serving and b"SLUICE_WORKER_STANDBY=true" in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:  # a process that ended while we looked
            continue
        found.append(int(entry.name))
    return found


async def _sdk_client(client: AsyncOpenAI, ledger: Ledger, stop: asyncio.Event, n: int) -> None:
    """Streamed chat completions one after another through the official SDK until ``stop``."""
    i = 0
    while not stop.is_set():
        i += 1
        text, request_id = "", ""
        try:
            stream = await client.chat.completions.create(
                model=GPT,
                messages=[{"role": "user", "content": f"client {n} story {i}"}],
                max_tokens=MAX_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                request_id = request_id or chunk.id.removeprefix("chatcmpl-")
                if chunk.choices and chunk.choices[0].delta.content:
                    text += chunk.choices[0].delta.content
        except Exception as exc:
            if not request_id:
                ledger.refused[type(exc).__name__] += 1
                await asyncio.sleep(0.2)
                continue
            raise
        ledger.finish("sdk", request_id, text)


async def _sse(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    ledger: Ledger,
    *,
    json_body: object = None,
    last: str | None = None,
    key: str | None = None,
    track: bool = False,
) -> tuple[str, str, bool]:
    """(last event id, text, finished) of an SSE stream, until it ends or the connection breaks."""
    headers = {"Authorization": f"Bearer {DEMO_KEY}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    if last is not None:
        headers["Last-Event-ID"] = last
    event_id, text, done = last or "", "", False
    try:
        async with session.request(method, url, json=json_body, headers=headers) as response:
            if response.status != 200:
                ledger.refused[f"HTTP {response.status}: {(await response.text())[:120]}"] += 1
                return event_id, text, False
            async for raw in response.content:
                line = raw.decode().rstrip("\r\n")
                if line.startswith("id: "):
                    event_id = line[4:]
                    if track:
                        ledger.live.add(event_id.split(":")[0])
                elif line == "data: [DONE]":
                    done = True
                elif line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice.get("delta", {}).get("content") or ""
    except (aiohttp.ClientError, ConnectionError) as exc:
        if not event_id:
            ledger.refused[type(exc).__name__] += 1
        elif track:
            ledger.cut.add(event_id.split(":")[0])
    finally:
        ledger.live.discard(event_id.split(":")[0])
    return event_id, text, done


async def _resuming_client(
    session: aiohttp.ClientSession, edges: list[str], ledger: Ledger, stop: asyncio.Event, n: int
) -> None:
    """Raw SSE against the second edge, each request with an ``Idempotency-Key`` (its claim on Kafka is how
    another edge finds the stream); a broken stream is resumed on the first edge from its last event (the
    same body and key again with ``Last-Event-ID``: the edge replays the log after it, generating nothing)."""
    i = 0
    while not stop.is_set():
        i += 1
        body = {
            "model": GPT,
            "messages": [{"role": "user", "content": f"resumer {n} story {i}"}],
            "max_tokens": LONG_TOKENS,
            "stream": True,
            "ignore_eos": True,
        }
        key = f"resumer-{n}-{i}"  # claimed on Kafka: what lets any edge find the stream
        event_id, text, done = await _sse(
            session, "POST", f"{edges[1]}/v1/chat/completions", ledger, json_body=body, key=key, track=True
        )
        if not event_id:  # never accepted (or its id never reached us): try again
            await asyncio.sleep(0.2)
            continue
        request_id = event_id.split(":")[0]
        trail = ledger.trail.setdefault(request_id, [])
        trail.append(f"edge 1: {event_id} +{len(text)} chars{' (done)' if done else ''}")
        for _ in range(60):  # the edge died mid-stream: the same stream from another edge, after what we have
            if done:
                ledger.finish("resumer", request_id, text)
                if request_id in ledger.resumed:  # a cut stream, finished on the other edge
                    ledger.done_at.setdefault("resumed", []).append(time.monotonic())
                break
            ledger.resumed.append(request_id)
            event_id_before = event_id
            event_id, more, done = await _sse(
                session,
                "POST",
                f"{edges[0]}/v1/chat/completions",
                ledger,
                json_body=body,
                last=event_id,
                key=key,
            )
            trail.append(
                f"edge 0 after {event_id_before}: {event_id} +{len(more)} chars{' (done)' if done else ''}"
            )
            text += more
            if not done:
                await asyncio.sleep(0.5)
        else:
            ledger.unresumed.append(request_id)


async def _until(check: Callable[[], bool], within: float, what: str) -> None:
    deadline = time.monotonic() + within
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within:.0f}s")
        await asyncio.sleep(0.05)


def _finished(kafka: KafkaConnection, topic: str) -> dict[str, list[RequestFinished]]:
    """Every terminal event on ``topic`` now, by request id."""
    consumer = Consumer(consumer_config(kafka, None, "scale-out-test"))
    try:
        parts = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        ends = {p: watermarks(consumer, topic, p)[1] for p in parts}
        out: dict[str, list[RequestFinished]] = {}
        for message in read_to_end(consumer, [TopicPartition(topic, p, 0) for p in parts], ends, 60):
            try:
                event = decode(message.value() or b"")
            except DecodeError:
                continue
            if isinstance(event, RequestFinished):
                out.setdefault(event.request_id, []).append(event)
        return out
    finally:
        consumer.close()


def _sql(env: dict[str, str], query: str) -> list[str]:
    result = sluice("sql", query, "-f", "csv", env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[1:]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env.update(
        SLUICE_DATA_DIR=str(tmp_path / "data"),
        SLUICE_MODELS=GPT,
        SLUICE_KAFKA_PORT=str(_free_run(6)),
        SLUICE_KAFKA_BROKERS="3",
        SLUICE_KAFKA_REPLICATION_FACTOR="3",
        SLUICE_EDGE_PORT=str(_free_run(2)),
        SLUICE_STREAMS_PORT=str(free_port()),
        SLUICE_WORKER_OPS_PORT=str(free_port()),
        SLUICE_WORKER_SESSION_TIMEOUT_MS="6000",
        SLUICE_DRIFT_SAMPLE="0",
        SLUICE_FLEET_TARGET_LAG="6",
        SLUICE_FLEET_SCALE_IN_AFTER_S="6",
        SLUICE_FLEET_SCALE_INTERVAL_S="1",
        # The load is one tenant's: keyed over 6 salts it spreads over the request partitions (unsalted, it
        # sits on one, which one worker serves: the autoscaler adds none past the partitions holding lag)
        SLUICE_EDGE_HOT_TENANTS="demo=6",
        # Three brokers, two edges and up to three workers on 2 cores: this test is about losing nothing
        # through kills and scaling, not throughput, and split in halves the box took 30 s longer.
        SLUICE_FLEET_WORKER_CPUS="off",
    )
    return env


@pytest.fixture
def up(env: dict[str, str], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Output]]:
    """``sluice up`` with two edges and autoscaled workers (1..2, one warm) on the 3-broker cluster."""
    args = ["up", "--edges", "2", "--autoscale", "--max-workers", "2", "--warm-workers", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "sluice", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out = Output(proc)
    try:
        yield proc, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        # the cluster stops with `sluice up`; if that died first, nothing of it may outlive the test
        down = sluice("kafka", "down", env=env)
        assert down.returncode in (0, 1), down.stdout + down.stderr
        (tmp_path / "up.log").write_text("\n".join(out.lines))
        print(f"sluice up's output: {tmp_path / 'up.log'}")


@pytest.mark.timeout(600)
async def test_scale_out_survives_broker_edge_and_worker_kills_and_autoscales_without_loss(
    env: dict[str, str], up: tuple[subprocess.Popen[str], Output]
) -> None:
    await _run(*up, env)


async def _run(proc: subprocess.Popen[str], out: Output, env: dict[str, str]) -> None:
    out.wait(r"sluicegate is up", timeout=300)
    _, edges_line = out.wait(r"edges: (\S+)/v1\s+(\S+)/v1", timeout=5)
    edges = [edges_line.group(1), edges_line.group(2)]
    out.wait(r"warm for demo-gpt: joins its group on SIGUSR1", timeout=120)  # the standby has loaded
    data = Path(env["SLUICE_DATA_DIR"])
    bootstrap = ",".join(f"127.0.0.1:{int(env['SLUICE_KAFKA_PORT']) + 2 * i}" for i in range(3))
    kafka = KafkaConnection(bootstrap)
    ledger = Ledger()
    stop_load, stop_trickle = asyncio.Event(), asyncio.Event()
    timeout = aiohttp.ClientTimeout(total=180, sock_read=30)
    sdk = AsyncOpenAI(base_url=f"{edges[0]}/v1", api_key=DEMO_KEY, max_retries=0, timeout=180)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        # 1. A load step: 16 SDK clients and 4 resuming clients, as fast as they are served.
        mark = out.mark()
        started = time.monotonic()
        load = [asyncio.create_task(_sdk_client(sdk, ledger, stop_load, n)) for n in range(16)]
        load += [
            asyncio.create_task(_resuming_client(session, edges, ledger, stop_load, n)) for n in range(4)
        ]
        trickle = [asyncio.create_task(_sdk_client(sdk, ledger, stop_trickle, 100 + n)) for n in range(2)]
        index, _ = await asyncio.to_thread(out.wait, r"autoscaler: demo-gpt@\S+ 1 -> 2 workers", 60, mark)
        scaled_out_s = time.monotonic() - started
        await asyncio.to_thread(out.wait, r"joins from the warm pool", 10, index)
        print(f"scaled out 1 -> 2 workers {scaled_out_s:.1f}s after the load step")

        # 2. Under that load: the second edge (while streams run through it), a worker, then a broker,
        # each killed with -9.
        await _until(lambda: len(ledger.live) >= 2, 30, "two streams running through the second edge")
        (edge_pid,) = _children(proc.pid, "edge")
        before = len(ledger.texts)
        on_it = len(ledger.live)
        os.kill(edge_pid, signal.SIGKILL)
        killed_edge = time.monotonic()
        await asyncio.sleep(3)
        (worker_pid, *_) = _children(proc.pid, "worker", serving=True)
        os.kill(worker_pid, signal.SIGKILL)
        await asyncio.sleep(3)
        victim = 2
        broker_pid = int((data / "kafka" / f"node-{victim}" / "broker.pid").read_text())
        os.kill(broker_pid, signal.SIGKILL)
        killed_broker = time.monotonic()
        await asyncio.sleep(3)
        back = await asyncio.to_thread(sluice, "kafka", "up", "--brokers", "3", env=env)
        assert back.returncode == 0, back.stdout + back.stderr
        broker_back_s = time.monotonic() - killed_broker
        assert not pid_alive(broker_pid)
        await asyncio.sleep(3)
        stop_load.set()
        async with asyncio.timeout(200):
            await asyncio.gather(*load)
        during_kills = len(ledger.texts) - before
        resumed_within = max(ledger.done_at.get("resumed", [killed_edge])) - killed_edge
        print(
            f"edge killed with {on_it} streams on it ({len(ledger.cut)} cut), a worker killed, broker {victim} killed and back in "
            f"{broker_back_s:.1f}s; {during_kills} requests completed meanwhile, "
            f"{len(set(ledger.resumed))} streams resumed (the last done {resumed_within:.1f}s after the kill); "
            f"refused so far: {dict(ledger.refused)}"
        )

        # 3. A trickle: the count falls back to 1 while requests run, the stopping worker drains first.
        mark = out.mark()
        low = time.monotonic()
        await asyncio.to_thread(out.wait, r"autoscaler: demo-gpt@\S+ 2 -> 1 workers", SCALE_IN_WITHIN_S, mark)
        scaled_in_s = time.monotonic() - low
        await asyncio.sleep(3)  # requests run on through the drain and the rebalance
        stop_trickle.set()
        async with asyncio.timeout(200):
            await asyncio.gather(*trickle)
    await sdk.close()
    print(f"scaled in 2 -> 1 {scaled_in_s:.1f}s after the load dropped")
    assert scaled_out_s < SCALE_OUT_WITHIN_S, f"scaled out {scaled_out_s:.1f}s after the load step"
    assert ledger.cut, "the edge's kill cut no stream: the resume was not exercised"
    assert ledger.cut <= set(ledger.resumed), "a stream cut by the edge's kill was not resumed"
    assert not ledger.unresumed, (
        f"cut streams never finished elsewhere: {ledger.unresumed} ({ledger.refused})"
    )

    # Every request the log accepted ended exactly once; the clients have each one's whole text.
    finished: dict[str, list[RequestFinished]] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        finished = await asyncio.to_thread(_finished, kafka, "sluice.results")
        if set(ledger.texts) <= set(finished):
            break
        await asyncio.sleep(1)
    missing = set(ledger.texts) - set(finished)
    assert not missing, f"{len(missing)} requests a client finished have no terminal event"
    duplicated = {rid: len(events) for rid, events in finished.items() if len(events) > 1}
    assert not duplicated, f"requests ended more than once: {duplicated}"
    for request_id, text in ledger.texts.items():
        (final,) = finished[request_id]
        assert final.status == "completed", (request_id, final.status, final.error)
        assert text == final.text, (
            f"{request_id}: the client's text is not the text it ended with; its stream: "
            f"{ledger.trail.get(request_id, 'one connection (an SDK client)')}"
        )

    # One row per request as the warehouse's readers see it (FINAL, as every view reads it): a sink that
    # re-does the batches it had in flight when a broker or a rebalance cut its commit inserts their rows
    # again, and the table collapses them on the request's key (docs/streams.md). Seen once in CI: 192 rows
    # for 191 requests before the merge, the results topic with 191 terminal events, one per request.
    accepted = len(finished)
    rows: list[str] = []
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        rows = await asyncio.to_thread(
            _sql, env, "SELECT count(), uniqExact(request_id) FROM request_facts FINAL"
        )
        if rows and rows[0] == f"{accepted},{accepted}":
            break
        await asyncio.sleep(2)
    assert rows == [f"{accepted},{accepted}"], f"warehouse {rows}, results topic {accepted}"
    verify = await asyncio.to_thread(sluice, "audit", "verify", env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    decisions = await asyncio.to_thread(
        _sql, env, "SELECT decision FROM audit_log WHERE action = 'workers.scale' ORDER BY seq"
    )
    assert decisions[:2] == ["2", "1"], decisions
    print(
        f"{accepted} requests accepted, {len(ledger.texts)} seen whole by clients, {sum(ledger.refused.values())} refused "
        f"before acceptance ({dict(ledger.refused)}); lost 0, duplicated 0; audit verified"
    )
    proc.send_signal(signal.SIGINT)
    assert await asyncio.to_thread(proc.wait, 90) == 0
