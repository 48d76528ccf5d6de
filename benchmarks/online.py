"""Platform vs the raw model and two peers, in one run on this machine: generation throughput at
saturation, added time to first token at low load, embeddings with dynamic batching vs batch-1 serving,
and the same load (embeddings and generation at 1 and 64 clients) against a naive aiohttp server and Ray
Serve, with the ratios platform/raw, platform/Ray and platform/naive.

    python benchmarks/online.py [--quick] [--peers naive,ray] [--ray-python PATH] [--worker-cpus auto]
                                [--edges auto] [--out FILE]

It starts its own Kafka (unless SLUICE_KAFKA_BOOTSTRAP is set) on free ports, one ``sluice worker`` per
model and one or more ``sluice edge`` as separate processes, and drives them over HTTP (``loadgen.py``).
The saturation phases below spread their clients over every edge, one client process per edge
(``loadgen.spread_rate``): on a GPU the model outruns what one Python process serves or sends (MiniLM at
batch 64 on an H200: 15k embeddings/s, one edge ~1.2k requests/s), as it does not on a few CPU cores
(``--edges auto``: one edge per 4 cores left to the rest of the box, at least one; 1 on a 2-core box).
Everything else, the peers' profiles included, runs from this process through the first edge: one server
process against one, like the peers.

The raw baseline runs first, alone, in a child process (``raw_model.py``); after the platform has stopped,
each peer runs alone (``peers/naive.py``, then ``peers/ray_serve.py``), with the same models, dtype and
torch threads, driven by the same load generator.

Ray is optional (the ``bench`` extra). Without it the Ray columns say ``not installed`` and everything
else runs (CI runs ``--quick`` that way). To include it, give it a venv of its own that sees the
project's packages, e.g.:

    R=~/.cache/sluicegate/venvs/ray-peer; python3.11 -m venv $R
    python -c 'import site; print(site.getsitepackages()[0])' > $R/lib/python3.11/site-packages/sg.pth
    $R/bin/pip install "ray[serve]>=2.40"

with the project's venv active (``python`` is its Python: the peer then runs the project's torch). That
path is found by default (or pass ``--ray-python``). Ray runs with its dashboard and usage stats off,
inside a loopback-only network namespace (``unshare -rn``) where the machine allows one, since its
start-up probes outside addresses; its start-up (~1 min here) is not measured.

Everything shares this machine's cores: the ratios say what the platform costs here, not on a dedicated
serving box, and other work on the machine moves them a lot (load average is printed). So beside the raw
model at its best (alone, torch's threads on every core) the table gives the **floor**: the same model on
the threads a worker gets (``--torch-threads``, default ``default_torch_threads()``: half the cores), the
share of the box the platform can give the model while Kafka, the edge and the clients run on the rest.
While the platform runs, the box is split as ``sluice up`` splits it (``--worker-cpus``, default ``auto``):
the workers on the upper half of the cores, this process (the clients), Kafka and the edge on the rest.
The floor runs twice, alone, just before the platform and just after it (minutes apart), and again
beside each saturation phase: for up to 3 s just before it and just after it (``raw_model.py --serve``'s
``rate``, whole rounds), the platform's processes, the broker this run started and the naive peer stopped
meanwhile (SIGSTOP, then SIGCONT; their lengths are in the JSON), so it runs nearly alone, as the runs
apart do (the bare echo's child stays up, idle). The platform's ratios to the floor are to the mean of the two samples beside
the phase: a shared box drifts by a third within minutes (docs/perf, M26 and M29), and a sample seconds away
drifts with it. The table also shows the ratios to the mean of the runs minutes apart. With ``--rounds N``
each saturation phase runs N times, a floor sample between each two: each round is judged against the two
samples around it and the ratio is the median of the rounds' ratios (the box's speed moves by a quarter
within a minute, so one round is one draw). Generation is also judged against the engine alone under the
load's churn (a request joining as one ends; ``gpu_workers.engine.churn_throughput``), sampled in the same
pauses for half as long: continuous batching's own floor, which a static batch does not pay.

Generation throughput at saturation is measured with twice as many clients as the worker's batch (the raw
model's best): a closed-loop client holds its slot empty for its own round trip, so as many clients as
slots would measure round trips, not the server (vLLM's throughput benchmark offers all requests at once).
That phase, and embeddings at 64 clients with dynamic batching and with batch-1 serving, are measured at
steady state: what completes in a window after a ramp-up (8 s after 2 s; 1.5 s after 0.5 s with --quick).
Time to first token at low load is measured after them, on a warm broker (a fresh JVM compiles through its
first thousands of requests; ``kafka_floor.py`` measures its floor warm too), over 400 streamed completions
of 2 tokens one after another (30 with --quick): its p99 is their fifth slowest.

Where one client's embedding time goes: 200 more requests (30 with --quick), one at a time, in 4 blocks (3)
with the raw forward of batch 1 sampled alone before, between and after them (``raw_model.py --serve``, a
child started before the box is split; in a loop on every core and on the worker's threads): the box's
speed moves by more between minutes than the platform adds at one client, so P6's added latency for one
client's embedding is these requests' p50 over the forward sampled beside them (the one against the raw run
minutes before is kept as ``added_ms_apart``). One client's completions likewise: 48 more (6), in the same
number of blocks, with the raw ``generate`` of batch 1 (4 calls at each point; 1) sampled beside them on the
worker's threads; P6's added latency for one client's generation is their p50 over that sample's (the
profile the peers are compared on, 24 completions, stays as it was). Each embedding request is also set beside
the timings its terminal event carries (read back off the results topic, one machine, one clock): edge in,
to the worker, model, back, total (p50 ms), with the raw forward of batch 1 in a loop and after 5 ms idle
(``raw_model.py``): an idle core starts a forward slower, and one client's requests always meet one. The
time to first token's requests are set beside theirs the same way (model: the prefill to the first token),
and beside the TTFT the platform adds, its floor in the same run: the raw forward after 5 ms idle on the
worker's threads over the raw loop's, plus the two Kafka hops alone after 5 ms idle
(``kafka_floor.hops_after_idle``, on this run's broker once the platform has stopped). P2's target for the
p50 is +5 ms, or 1.2x that floor where the floor is above +5 ms (the issue's rule for targets out of reach).
One client's embedding gets a floor the same way (``comparison.ratios``): what the naive peer adds (HTTP,
JSON, tokenising; less its forward's slowdown after idle) plus what two bare Kafka hops around MiniLM's
forward add to that forward sampled beside the platform (``kafka_floor.around_forward_echo``: the forward
leaves the cores cold for the hop back), never less than those hops as its own echo timed them. Both run
beside the platform's one-client blocks as the raw forward does, between them: the echo on this run's
broker (on every core, its driver here with the clients and the edge), the naive peer's one-client
embeddings against a naive server started with the raw reference (its part: their p50 over the raw forward
on the workers' threads sampled there). Run after the platform, minutes away, the hops drifted with the box
by more than the margin judged (M16 and M18 in docs/perf); the naive peer's profile, the table's
platform/naive, still runs apart. P6 at one
client is a quarter of what Ray adds, or 1.2x that floor where the floor is above a quarter. P3 (dynamic
batching at 64 clients over batch-1 serving, 4x) is within 1.2x of the model's own gain where that is under
4x (its best batch over batch 1 on the worker's threads, alone): no server's batching gives more than the
model's (``floors.batching_target``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform as host
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, cast

import aiohttp
import comparison
import kafka_floor
import psutil
from floors import beside, drift, floor_summary, mean_run, rounds_note, ttft_floor
from harness import broker_process, cpu_model, kafka, pct, reap, service_env
from loadgen import (
    NEW_TOKENS,
    QUICK_TOKENS,
    closed_loop,
    completion,
    embed,
    embed_stamped,
    job_for,
    profile_all,
    spread_rate,
    ttft_stamped,
)
from reference import (
    BESIDE,
    BESIDE_WORKER,
    NAIVE_BESIDE,
    RawReference,
    beside_platform,
    one_client_generation,
)
from stages import BACK_SPLIT, RAW_IDLE_WORKER, STAGES, server_timing, where_time_goes

from bus.placement import available_cpus, pin_process, place_box
from gpu_workers.models import default_torch_threads
from infra.kafka.broker import free_port
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from ingest.main import more_edge_ids
from schemas.settings import PlatformSettings, load_settings
from schemas.topics import TopicNames

ROOT = Path(__file__).resolve().parent.parent


class Services:
    """The worker and edge processes, each started with ``sluice`` like an operator would, each on its own
    free ops port, each with its output in a log file under ``logs`` (shown when something fails)."""

    def __init__(self, env: dict[str, str], logs: Path, worker_env: dict[str, str] | None = None) -> None:
        self.env = env
        self.logs = logs
        self.worker_env = worker_env or {}
        """Every worker's extra environment (its cores, ``place_box``), restarts included."""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.ops: dict[str, int] = {}

    def start(self, name: str, args: list[str], extra: dict[str, str] | None = None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        ops = free_port()
        with (self.logs / f"{name}.log").open("wb") as log:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", "sluice", *args],
                env={
                    **self.env,
                    **(self.worker_env if args[0] == "worker" else {}),
                    "SLUICE_WORKER_OPS_PORT": str(ops),
                    **(extra or {}),
                },
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.ops[name] = ops

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def print_tails(self) -> None:
        """Each process's last log lines on stderr (a run that failed says why)."""
        for name in self.procs:
            print(f"--- {name} ({self.logs / name}.log)\n{self.tail(name)}", file=sys.stderr)

    async def ready(self, session: aiohttp.ClientSession, name: str, url: str) -> bool:
        """The process is alive and its ``/readyz`` says 200."""
        self.check_alive()
        try:
            async with session.get(url) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    @contextmanager
    def paused(self, paused_s: list[float], *others: int | None) -> Iterator[None]:
        """Every process of the platform stopped (SIGSTOP; ``others`` too: the pids of the broker this run
        started and the naive peer), then continued, the pause's length appended to ``paused_s``: the floor
        sampled beside a phase runs alone on the box, as the runs minutes apart do (idle, the platform
        takes ~10 % of a core and wakes the cores up often, which slowed that floor by up to a sixth). A
        few seconds (a generation sample ~5 s with its churn sample, an embedding one ~3 s): inside the
        consumers' session timeout (10 s) and the broker's own (9 s). A watchdog
        continues them all after :data:`PAUSE_WATCHDOG_S` even if this process is killed meanwhile."""
        stopped: list[psutil.Process] = []
        pids = [p.pid for p in self.procs.values()] + [pid for pid in others if pid is not None]
        for proc in map(psutil.Process, pids):
            stopped += [proc, *proc.children(recursive=True)]
        watchdog = subprocess.Popen(
            ["sh", "-c", f"sleep {PAUSE_WATCHDOG_S:g}; kill -CONT {' '.join(str(p.pid) for p in stopped)}"],
            start_new_session=True,  # its own group: killed whole below, its `sleep` with it
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        began = time.perf_counter()
        try:
            for each in stopped:
                with suppress(psutil.NoSuchProcess):  # a child that exited meanwhile
                    each.suspend()
            yield
        finally:
            for each in reversed(stopped):
                with suppress(psutil.NoSuchProcess):
                    each.resume()
            paused_s.append(time.perf_counter() - began)
            os.killpg(watchdog.pid, signal.SIGKILL)
            watchdog.wait()

    def stop(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.send_signal(signal.SIGTERM)
        reap(proc)

    def stop_all(self) -> None:
        for name in list(self.procs):
            self.stop(name)


TTFT_REQUESTS = 400
"""Streamed 2-token completions one after another for time to first token at low load (p50, p99)."""


async def until_ok(call: Callable[[], Awaitable[bool]], within: float = 180) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if await call():
                return
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError("the platform did not come up")


FIRST_EDGE = "bench-edge"
EDGES_PER_CORE = 1 / 4
"""``--edges auto``: one edge (and one client process) per this many of the cores the workers do not get."""


def edge_count(choice: str, rest: int) -> int:
    """``--edges``: a number, or ``auto`` (:data:`EDGES_PER_CORE` of the ``rest`` cores, at least one)."""
    if choice == "auto":
        return max(1, int(rest * EDGES_PER_CORE))
    if not choice.isdigit() or not 1 <= int(choice) <= 16:
        raise SystemExit(f"--edges: auto or 1 to 16, not {choice!r}")
    return int(choice)


def edge_service(index: int) -> str:
    """The name :class:`Services` knows the ``index``-th edge by (the first is ``edge``)."""
    return "edge" if index == 0 else f"edge{index}"


def start_edges(services: Services, count: int, first_port: int) -> list[str]:
    """``count`` edges (``sluice edge``, each its own replies partition of ``count``); their urls."""
    ports = [first_port, *(free_port() for _ in range(count - 1))]
    ids = [FIRST_EDGE, *more_edge_ids(FIRST_EDGE, count, count)]
    for index, (edge_id, port) in enumerate(zip(ids, ports, strict=True)):
        services.start(
            edge_service(index), ["edge"], {"SLUICE_EDGE_ID": edge_id, "SLUICE_EDGE_PORT": str(port)}
        )
    return [f"http://127.0.0.1:{port}" for port in ports]


PAUSE_WATCHDOG_S = 20.0
"""A pause of the platform (:meth:`Services.paused`) ends after this long whatever happens to this process."""

RESUMED_S = 2.0
"""The platform runs at least this long between two pauses (its consumers' heartbeats are every second)."""

FLOOR_BESIDE_S = {False: 3.0, True: 0.5}
"""Seconds of the floor (the model alone on the worker's threads) sampled just before and just after each
saturation phase: as many whole measurements as fit, one at least (one of generation at batch 32 is ~1.4 s
here, so a sample can pass this by up to one; the pauses' real lengths go to the JSON)."""

ONE_CLIENT_BLOCKS = (4, 3)
"""One client's stamped embeddings, and its completions, run in this many blocks, with the raw reference
sampled before, between and after them: a full run's, --quick's."""
ONE_CLIENT_GENERATIONS = (48, 6)
"""One client's completions in those blocks: a full run's, --quick's."""
GENERATION_SAMPLES = (4, 1)
"""The raw reference's ``generate`` calls at each point between one client's blocks of completions (full,
--quick)."""


async def measure(
    urls: list[str],
    raw: dict[str, object],
    services: Services,
    quick: bool,
    reference: RawReference,
    bare: kafka_floor.Driver,
    emb_floor_batch: int,
    broker: int | None,
    naive: comparison.NaivePeer | None = None,
    rounds: int = 1,
) -> dict[str, object]:
    """Every phase of the platform (see the module's text); ``reference``, ``bare`` (an echo around the
    forward, :func:`kafka_floor.around_forward_echo`) and ``naive`` (the naive peer, one client's
    embeddings) are sampled between the blocks of one client's embeddings, and the floors (the model alone
    on the worker's threads; embeddings at ``emb_floor_batch``) just before and after each saturation
    phase, the platform, ``broker`` (the pid of the broker this run started, or None) and the naive peer
    stopped meanwhile. Each saturation phase runs ``rounds`` times, a floor sample between each two (its
    rate is the rounds' median; :func:`floors.floor_summary` judges each round against the samples around
    it)."""
    url = urls[0]
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=600)
    ) as session:

        async def ready() -> bool:
            for name in ("gen", "embed"):
                if not await services.ready(session, name, f"http://127.0.0.1:{services.ops[name]}/readyz"):
                    return False
            for index, edge in enumerate(urls):
                if not await services.ready(session, edge_service(index), f"{edge}/readyz"):
                    return False
                await completion(session, edge, 2)
                await embed(session, edge, 0)
            return True

        await until_ok(ready)
        if naive is not None:
            await naive.ready(session)
            for n in range(8):  # its connection and its model's first calls
                await embed(session, naive.url, n)
        # warm-up: every path once under load, so the measured phases see warm caches and connections
        for edge in urls:
            await closed_loop(32, 64, job_for(session, edge, "generation", 8))
            await closed_loop(32, 128, job_for(session, edge, "embeddings", 0))

        raw_gen = {int(k): float(v) for k, v in raw["generation_tokens_per_s"].items()}  # type: ignore[attr-defined]
        best_batch = max(raw_gen, key=lambda b: raw_gen[b])
        # Saturation: more requests offered than the worker's batch holds (SLUICE_WORKER_MAX_RUNNING = the
        # best batch), as vLLM's throughput benchmark offers them all at once: a closed-loop client holds
        # its slot empty for its own round trip, so as many clients as slots would measure round trips.
        concurrency = 2 * best_batch
        new_tokens = 64
        # Steady state, as every saturation phase here: a fixed number of requests would also time the
        # ramp-up and the drain (10-15 % of a few-second phase).
        warm_s, window_s = (0.5, 1.5) if quick else (2.0, 8.0)
        # The floor beside each phase, seconds before and after it, the platform stopped meanwhile: the runs
        # minutes apart drift by a third
        beside_s = FLOOR_BESIDE_S[quick]
        paused_s: list[float] = []
        others = (broker, None if naive is None else naive.pid)

        gen_churn: list[float] = []

        def gen_floor_now() -> dict[str, float]:
            with services.paused(paused_s, *others):
                floor = reference.generation_floor(beside_s, best_batch, new_tokens, quick)
                # and the same engine under the load's churn: what continuous batching costs it alone (for
                # half as long: the pause stays well inside the consumers' session timeout)
                gen_churn.append(reference.churn_floor(beside_s / 2, best_batch, new_tokens))
                return floor

        def emb_floor_now() -> float:
            with services.paused(paused_s, *others):
                return reference.embedding_floor(beside_s, emb_floor_batch, quick)

        gen_floor, gen_rounds = [gen_floor_now()], []
        for _ in range(rounds):
            gen_rounds.append(
                await spread_rate(
                    urls, concurrency, "generation", warm_s=warm_s, window_s=window_s, tokens=new_tokens
                )
            )
            gen_floor.append(gen_floor_now())
        gen_tps = statistics.median(gen_rounds)
        await asyncio.sleep(RESUMED_S)  # the consumers' heartbeats between two pauses
        emb_floor, emb_rounds = [emb_floor_now()], []
        for _ in range(rounds):
            # Warmed at this concurrency first: batches of 33-64 are new shapes to torch after the warm-up
            # above (included in ``warm_s`` here; each round warms again after the pause before it).
            emb_rounds.append(
                await spread_rate(urls, 64, "embeddings", warm_s=2 * warm_s, window_s=window_s, tokens=0)
            )
            emb_floor.append(emb_floor_now())
        dynamic = statistics.median(emb_rounds)
        # Time to first token at low load after the saturation phases: a fresh broker's JVM is still
        # compiling through its first few thousand requests (kafka_floor.py, 300 lone round trips at a time:
        # 2.7-5.0 ms p50 for the first, 1.3-1.9 once warm), and a serving platform's broker is warm.
        for _ in range(5):
            await ttft_stamped(session, url)
        # 400: a p99 of 100 is their second slowest, which one stall anywhere on the box decides (M14: +18.4
        # ms where M11-M13 had +11-12); of 400 it is the fifth slowest.
        ttft_stamps = [await ttft_stamped(session, url) for _ in range(30 if quick else TTFT_REQUESTS)]
        ttfts = [(first - sent) * 1000 for _, sent, first in ttft_stamps]
        profiles = await profile_all(session, url, quick)  # the load the peers get too
        # One client's embeddings once more, each request's id and wall-clock times kept: main() sets them
        # beside the timings of their terminal events (where_time_goes).
        # In blocks, the raw forward alone sampled before, between and after them (``reference``).
        blocks = ONE_CLIENT_BLOCKS[quick]
        size = (30 if quick else 200) // blocks
        beside: dict[str, list[float]] = {"wide": [], "narrow": []}
        bare_runs: list[tuple[float, float, float, float]] = []
        naive_ms: list[float] = []

        async def sample() -> None:
            for name, times in reference.sample(size).items():
                beside[name] += times
            bare_runs.extend(bare.around_forward(size))
            if naive is None:
                return
            for n in range(size):
                began = time.perf_counter()
                await embed(session, naive.url, n)
                naive_ms.append((time.perf_counter() - began) * 1000)

        stamps: list[tuple[str, float, float, str]] = []
        await sample()
        for block in range(blocks):
            stamps += [await embed_stamped(session, url, block * size + n) for n in range(size)]
            await sample()
        # One client's completions the same way, beside the raw generate on the worker's threads: the
        # profile above (24 requests, minutes from the raw run) is what the peers are compared on.
        tokens = QUICK_TOKENS if quick else NEW_TOKENS
        requests, samples = ONE_CLIENT_GENERATIONS[quick], GENERATION_SAMPLES[quick]
        generate = job_for(session, url, "generation", tokens)
        generations = {"platform": [], "beside": reference.sample_generation(samples, tokens)}
        for _ in range(blocks):
            for _ in range(requests // blocks):
                began = time.perf_counter()
                await generate(0)
                generations["platform"].append((time.perf_counter() - began) * 1000)
            generations["beside"] += reference.sample_generation(samples, tokens)
        # whether one client's embeddings ran on the worker's quiet team (both cores): ratios() needs it
        async with session.get(f"http://127.0.0.1:{services.ops['embed']}/metrics") as response:
            quiet = counter_total(await response.text(), QUIET_BATCHES)
        services.stop("embed")
        services.start(
            "embed", ["worker", "--model", "all-minilm-l6-v2"], {"SLUICE_WORKER_EMBED_MAX_BATCH": "1"}
        )
        await until_ok(ready)
        batch_one = await spread_rate(urls, 64, "embeddings", warm_s=warm_s, window_s=window_s, tokens=0)

    raw_emb = {int(k): float(v) for k, v in cast(dict[str, float], raw["embeddings_per_s"]).items()}
    raw_ttft = cast(dict[str, float], raw["ttft_ms"])
    return {
        "platform_profiles": profiles,
        "one_client_stamps": stamps,
        "one_client_beside": beside,
        "one_client_bare": bare_runs,
        "one_client_naive": naive_ms,
        "one_client_generations": generations,
        "ttft_stamps": ttft_stamps,
        "embedding_quiet_batches": quiet,
        "floor_beside": {
            "generation": gen_floor,
            "embeddings": emb_floor,
            "generation_platform": gen_rounds,
            "generation_churn": gen_churn,
            "embeddings_platform": emb_rounds,
            "seconds": beside_s,
            "paused_s": paused_s,
        },
        "generation": {
            "raw_best_batch": best_batch,
            "raw_tokens_per_s": raw_gen[best_batch],
            "platform_concurrency": concurrency,
            "platform_tokens_per_s": gen_tps,
            "ratio": gen_tps / raw_gen[best_batch],
            "raw_by_batch": raw_gen,
            # the raw figure at each batch is the faster of these two (raw_model.py)
            "raw_generate_by_batch": raw.get("generate_tokens_per_s"),
            "raw_engine_by_batch": raw.get("engine_tokens_per_s"),
        },
        "ttft_ms": {
            "raw_p50": raw_ttft["p50"],
            "raw_p99": raw_ttft["p99"],
            "platform_p50": statistics.median(ttfts),
            "platform_p99": pct(ttfts, 99),
            "added_p50": statistics.median(ttfts) - raw_ttft["p50"],
            "added_p99": pct(ttfts, 99) - raw_ttft["p99"],
        },
        "embeddings": {
            "raw_best_per_s": max(raw_emb.values()),
            "raw_by_batch": raw_emb,
            "dynamic_per_s": dynamic,
            "batch1_per_s": batch_one,
            "dynamic_over_batch1": dynamic / batch_one,
            "dynamic_over_raw_best": dynamic / max(raw_emb.values()),
            "concurrency": 64,
        },
        "edges": len(urls),
    }


def edges_note(result: dict[str, Any]) -> str:
    """ ", N edges" where the saturation phases were spread over more than one edge."""
    edges = int(result.get("edges", 1))
    return f", {edges} edges" if edges > 1 else ""


def table(result: dict[str, Any]) -> str:
    g, t, e, f = result["generation"], result["ttft_ms"], result["embeddings"], result["floor"]
    m = result["machine"]
    rows = [
        (
            "generation tok/s at saturation",
            f"{g['raw_tokens_per_s']:.0f} (batch {g['raw_best_batch']:.0f}, {m['raw_torch_threads']:.0f} thr)",
            f"{g['platform_tokens_per_s']:.0f} (conc. {g['platform_concurrency']:.0f}{edges_note(result)})",
            f"{g['ratio']:.2f}",
            "≥ 0.90",
        ),
        (
            f"  same, raw on the worker's {f['threads']:.0f} thread(s) beside it",
            beside(f, "generation_tokens_per_s"),
            "",
            f"{f['generation_ratio']:.2f}",
            "≥ 0.83 (1/1.2)",
        ),
        (
            "  (the same floor minutes apart)",
            drift(f, "generation_tokens_per_s"),
            "",
            f"({f['generation_ratio_apart']:.2f})",
            "",
        ),
        (
            "TTFT p50 ms (low load)",
            f"{t['raw_p50']:.1f}",
            f"{t['platform_p50']:.1f}",
            f"+{t['added_p50']:.1f} ms",
            f"≤ +{t['target_added_p50']:.1f} ms",
        ),
        (
            f"  floor: raw after {t['floor_idle_ms']:g} ms idle on the worker's {f['threads']:.0f} thr, 2 hops",
            f"{t['floor_model_after_idle_ms']:.1f} + {t['floor_two_hops_after_idle_ms']:.1f} hops",
            "",
            f"+{t['floor_added_p50']:.1f} ms floor",
            "≤ +5 ms" if t["target_added_p50"] == 5.0 else f"≤ +{t['target_added_p50']:.1f} (1.2x floor)",
        ),
        (
            "TTFT p99 ms (low load)",
            f"{t['raw_p99']:.1f}",
            f"{t['platform_p99']:.1f}",
            f"+{t['added_p99']:.1f} ms",
            "≤ +15 ms",
        ),
        (
            f"embeddings/s, conc. 64{edges_note(result)}, dynamic",
            f"{e['raw_best_per_s']:.0f} (best batch, {m['raw_torch_threads']:.0f} thr)",
            f"{e['dynamic_per_s']:.0f}",
            f"{e['dynamic_over_raw_best']:.2f}",
            "≥ 0.90",
        ),
        (
            f"  same, raw on the worker's {f['threads']:.0f} thread(s) beside it",
            beside(f, "embeddings_per_s"),
            "",
            f"{f['embeddings_ratio']:.2f}",
            "≥ 0.83 (1/1.2)",
        ),
        (
            "  (the same floor minutes apart)",
            drift(f, "embeddings_per_s"),
            "",
            f"({f['embeddings_ratio_apart']:.2f})",
            "",
        ),
        (
            "embeddings/s, conc. 64, batch-1",
            f"best/b1 {f['embeddings_batching']:.1f}x on {f['threads']:.0f} thr",
            f"{e['batch1_per_s']:.0f}",
            f"dyn/b1 {e['dynamic_over_batch1']:.1f}x",
            "≥ 4x" if f["batching_target"] >= 4 else f"≥ {f['batching_target']:.1f}x (best/b1, /1.2)",
        ),
    ]
    if f.get("generation_churn_ratio") is not None:  # continuous batching's floor, under the one apart
        at = next(i for i, r in enumerate(rows) if r[0].startswith("  (the same floor minutes apart)")) + 1
        churn = [
            (
                "  same, the engine alone under the load's churn beside it",
                beside(f, "generation_churn_tokens_per_s"),
                "",
                f"{f['generation_churn_ratio']:.2f}",
                "(continuous batching's floor)",
            )
        ]
        if note := rounds_note(f, "generation_churn_tokens_per_s"):
            churn.append((f"    {note}", "", "", "", ""))
        rows[at:at] = churn
    for key, label in (("embeddings_per_s", "embeddings/s"), ("generation_tokens_per_s", "generation tok/s")):
        note = rounds_note(f, key)
        if note:  # under the phase's line beside its floor
            at = next(i for i, r in enumerate(rows) if r[0].startswith(label)) + 2
            rows.insert(at, (f"    {note}", "", "", "", ""))
    widths = [
        max(len(str(r[i])) for r in [("metric", "raw model", "platform", "ratio", "target"), *rows])
        for i in range(5)
    ]
    lines = []
    for r in [("metric", "raw model", "platform", "ratio", "target"), *rows]:
        lines.append(" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)))
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


QUIET_BATCHES = "sluice_worker_quiet_batches_total"
"""The batches an embedding worker ran on its quiet team so far (its ``/metrics``)."""


def counter_total(metrics: str, name: str) -> float:
    """A counter's total over its series in a ``/metrics`` text."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith((f"{name} ", f"{name}{{"))
    )


def wanted_peers(args: argparse.Namespace) -> set[str]:
    return {p.strip() for p in args.peers.split(",") if p.strip()}


def run_peers(
    args: argparse.Namespace,
    raw: dict[str, object],
    floor: dict[str, object],
    platform: comparison.Profiles,
    settings: PlatformSettings,
    env: dict[str, str],
    quiet_batches: float = 0.0,
    bare_embedding_ms: float | None = None,
    idle_embedding_ms: float | None = None,
    beside: dict[str, tuple[float, float]] | None = None,
    bare_hops_ms: float | None = None,
    naive_beside: tuple[float, float] | None = None,
) -> dict[str, Any]:
    """The peers, one at a time, after the platform has stopped (this machine's cores are shared), with
    the workers' torch threads; their profiles beside the platform's and the raw model's, and the ratios.
    ``quiet_batches``: the embedding worker's batches on its quiet team (one client's phase ran there).
    ``bare_embedding_ms``: one embedding's round trip through two bare Kafka hops around the forward
    (``kafka_floor.around_forward_echo``, beside the platform), and the forward after 5 ms idle on the
    workers' threads, for the
    floor under one client's added latency (``comparison.ratios``); ``bare_hops_ms``: that round trip less
    its own forward, the least the floor counts for the hops. ``beside``: per workload, one client's
    p50 on the platform and the raw model's sampled beside it (:func:`beside_platform`); ``naive_beside``:
    the naive peer's one-client embedding p50 sampled there and that raw forward on the workers' threads."""
    wanted = wanted_peers(args)
    logs = Path(tempfile.mkdtemp(prefix="sluice-bench-peers-"))
    peer_env = comparison.child_env(env.get("SLUICE_WORKER_TORCH_THREADS"))
    profiles: dict[str, comparison.Outcome] = {
        "raw": comparison.raw_profiles(raw, args.quick),
        "platform": platform,
        "naive": "not run",
        "ray": "not run",
    }
    facts: dict[str, Any] = {}
    if "naive" in wanted:
        print("naive aiohttp peer (alone) ...", file=sys.stderr)
        started = time.perf_counter()
        profiles["naive"] = comparison.run_naive(args.quick, logs / "naive.log", peer_env)
        facts["naive"] = {"wall_s": time.perf_counter() - started}
    if "ray" in wanted:
        python, tried = comparison.find_ray_python(args.ray_python, Path(settings.cache_dir))
        if python is None:
            profiles["ray"] = "not installed"
            facts["ray"] = {"tried": tried}
        else:
            print(f"Ray Serve peer (alone; {python}) ...", file=sys.stderr)
            gen_batch = int(env["SLUICE_WORKER_MAX_RUNNING"])  # the platform's generation batch limit
            started = time.perf_counter()
            profiles["ray"], facts["ray"] = comparison.run_ray(
                python, args.quick, gen_batch, logs / "ray.log", peer_env
            )
            facts["ray"]["wall_s"] = time.perf_counter() - started
    base = comparison.raw_profiles(floor, args.quick)  # the model on the threads every server gets
    own = None
    if quiet_batches and not isinstance(profiles["raw"], str):
        # one client's embeddings ran on the worker's quiet team (both cores): its own overhead is measured
        # from the model on both cores, the peers' from the model on the workers' threads
        own = {**base, "embeddings": {**base["embeddings"], "1": profiles["raw"]["embeddings"]["1"]}}
    ratios = comparison.ratios(
        profiles,
        base,
        own,
        bare_embedding_ms,
        idle_embedding_ms,
        beside,
        bare_hops_ms=bare_hops_ms,
        naive_beside=naive_beside,
    )
    return {"profiles": profiles, "ratios": ratios, "about": facts}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="SLUICE_WORKER_TORCH_THREADS for the workers"
    )
    parser.add_argument(
        "--peers",
        default="naive,ray",
        help="peers to run after the platform, comma-separated: naive, ray (default both; '' for none)",
    )
    parser.add_argument(
        "--ray-python",
        default=None,
        help="a Python with ray[serve] (default: this one if it has Ray, else "
        "<SLUICE_CACHE_DIR>/venvs/ray-peer/bin/python if present; else Ray is 'not installed')",
    )
    parser.add_argument(
        "--worker-cpus",
        default="auto",
        help="cores for the workers while the platform runs, as `sluice up --worker-cpus` (default auto: "
        "the upper half, this process with Kafka, the edge and the clients on the rest; 'off': no pinning)",
    )
    parser.add_argument(
        "--edges",
        default="auto",
        help="edges (and client processes) the saturation phases spread over: a number, or auto (one per 4 "
        "cores the workers do not get, at least one)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run each saturation phase this many times, the floor sampled between each two; the platform's "
        "ratio to the floor is the median of the rounds' ratios (default 1; ~15 s a round). A shared box's speed moves by "
        "a quarter within a minute: more rounds decide P1 where one cannot",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "online.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    settings = load_settings(PlatformSettings)
    load_before = os.getloadavg()
    subprocess.run(
        [sys.executable, "-m", "sluice", "models", "prepare"], check=True, stdout=subprocess.DEVNULL
    )
    print("raw model baseline (alone) ...", file=sys.stderr)
    raw_cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "raw_model.py"),
        *(["--quick"] if args.quick else []),
    ]
    raw = json.loads(
        subprocess.run(raw_cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
    )
    # The floor: the same model on the threads a worker gets (the rest of the box runs Kafka, the edge, the
    # clients), at the best batch of the run above.
    threads = args.torch_threads or default_torch_threads()
    best = max(raw["generation_tokens_per_s"], key=lambda b: raw["generation_tokens_per_s"][b])
    floor_cmd = [
        *raw_cmd,
        "--threads",
        str(threads),
        "--batches",
        ",".join(sorted({"1", str(best)}, key=int)),
    ]

    def run_floor() -> dict[str, Any]:
        out = subprocess.run(floor_cmd, check=True, capture_output=True, text=True).stdout
        return cast(dict[str, Any], json.loads(out.splitlines()[-1]))

    print(f"raw model on {threads} thread(s), the floor (alone) ...", file=sys.stderr)
    floor = run_floor()
    # the forward to the first token after idle on the worker's threads: the TTFT floor's model part
    ttft_idle = cast(dict[str, float], floor["ttft_after_idle"])
    emb_floor_rates = cast(dict[str, float], floor["embeddings_per_s"])
    emb_floor_batch = int(max(emb_floor_rates, key=lambda b: emb_floor_rates[b]))  # sampled beside the phase
    # Placed as `sluice up` places it: the workers on their cores, this process (the clients) and what it
    # starts (Kafka, the edge) on the others; the peers afterwards run where the OS puts them.
    # started before the box is split: the reference runs the model alone on every core, as the raw run did
    reference = RawReference(threads, Path(tempfile.mkdtemp(prefix="sluice-bench-ref-")) / "reference.log")
    # and the naive peer, whose one-client embeddings are sampled with it (its profile still runs apart)
    naive = (
        comparison.NaivePeer(
            Path(tempfile.mkdtemp(prefix="sluice-bench-naive-")) / "naive.log",
            comparison.child_env(str(threads)),
        )
        if "naive" in wanted_peers(args)
        else None
    )
    own_cores = available_cpus()
    placed, worker_env = place_box(args.worker_cpus)
    print(placed or "no CPU placement", file=sys.stderr)
    edges = edge_count(args.edges, len(available_cpus()))  # after place_box: the cores left to the rest
    with kafka(settings) as conn:
        prefix = f"bench{int(time.time())}"
        names = TopicNames(prefix)
        apply_topics(
            make_admin(conn), platform_topics(names, settings.served_models(), TopicSizing(replies=edges))
        )
        port = free_port()
        env = service_env(
            conn,
            prefix,
            SLUICE_EDGE_PORT=str(port),
            SLUICE_WORKER_MAX_RUNNING=str(best),  # raw's best batch: the saturation phase offers twice it
        )
        env["SLUICE_WORKER_TORCH_THREADS"] = str(threads)  # the peers get the same
        services = Services(env, Path(tempfile.mkdtemp(prefix="sluice-bench-logs-")), worker_env)
        try:
            services.start("gen", ["worker", "--model", "demo-gpt"])
            services.start("embed", ["worker", "--model", "all-minilm-l6-v2"])
            urls = start_edges(services, edges, port)
            print(f"platform under load ({edges} edge(s)) ...", file=sys.stderr)
            try:
                # the bare echo beside the platform as the raw forward is: both on every core
                with kafka_floor.around_forward_echo(conn, own_cores or None) as bare:
                    result = asyncio.run(
                        measure(
                            urls,
                            raw,
                            services,
                            args.quick,
                            reference,
                            bare,
                            emb_floor_batch,
                            # only a broker this run started (a configured cluster's is not this run's)
                            broker.pid if settings.local_kafka and (broker := broker_process(conn)) else None,
                            naive,
                            args.rounds,
                        )
                    )
            finally:
                reference.close()
                if naive is not None:
                    naive.close()
            raw_batch1_ms = 1000 / float(cast(dict[str, float], raw["embeddings_per_s"])["1"])
            stamped = cast(list[tuple[str, float, float, str]], result.pop("one_client_stamps"))
            returns = {
                request_id: timing["return"]
                for request_id, _, _, header in stamped
                if "return" in (timing := server_timing(header))
            }
            where = where_time_goes(
                conn, names.results, [s[:3] for s in stamped], "finished", returns=returns
            )
            where["raw batch 1"] = raw_batch1_ms
            after_idle = cast(dict[str, float], raw["embedding_batch1_after_idle"])
            where["raw batch 1 after idle"] = after_idle["ms"]
            where["raw idle ms"] = after_idle["idle_ms"]
            # the engine is traced on a CPU: the model's eager forward beside it
            where["raw batch 1, eager"] = cast(float, raw["embedding_batch1_eager_ms"])
            # the model stage runs on the worker's threads: the same forward there, alone, after idle
            where[RAW_IDLE_WORKER] = cast(dict[str, float], floor["embedding_batch1_after_idle"])["ms"]
            around = kafka_floor.around_summary(
                cast(list[tuple[float, float, float, float]], result.pop("one_client_bare"))
            )
            beside = cast(dict[str, list[float]], result.pop("one_client_beside"))
            where[BESIDE] = statistics.median(beside["wide"])
            where[BESIDE_WORKER] = statistics.median(beside["narrow"])
            if naive_ms := cast(list[float], result.pop("one_client_naive")):
                where[NAIVE_BESIDE] = statistics.median(naive_ms)
            result["embedding_one_client_ms"] = where
            generations = cast(dict[str, list[float]], result.pop("one_client_generations"))
            result["generation_one_client_ms"] = one_client_generation(generations)
            first = where_time_goes(conn, names.results, cast(Any, result.pop("ttft_stamps")), "first_token")
            first["raw"] = cast(dict[str, float], raw["ttft_ms"])["p50"]
            first["raw after idle"] = ttft_idle["ms"]
            first["raw eager"] = cast(float, raw["ttft_eager_ms"])
            result["ttft_one_client_ms"] = first
        except BaseException:
            services.print_tails()
            raise
        finally:
            services.stop_all()
        if own_cores:
            pin_process(own_cores)
        print(f"the two Kafka hops alone, each after {ttft_idle['idle_ms']:g} ms idle ...", file=sys.stderr)
        hops = kafka_floor.hops_after_idle(conn, ttft_idle["idle_ms"], 50 if args.quick else 200)
    one_client = cast(dict[str, float], result["embedding_one_client_ms"])
    one_client.update({f"bare {key}": value for key, value in around.items() if key != "samples"})
    result["ttft_ms"] = ttft_floor(cast(dict[str, float], result["ttft_ms"]), ttft_idle["ms"], hops)
    print(
        f"raw model on {threads} thread(s) again, the floor after the platform (alone) ...", file=sys.stderr
    )
    generation, embeddings = (
        cast(dict[str, Any], result["generation"]),
        cast(dict[str, Any], result["embeddings"]),
    )
    floor_after = run_floor()
    result["floor"] = floor_summary(
        floor,
        floor_after,
        int(generation["raw_best_batch"]),
        float(generation["platform_tokens_per_s"]),
        float(embeddings["dynamic_per_s"]),
        beside=cast(dict[str, Any], result.pop("floor_beside")),
    )
    peers = run_peers(
        args,
        raw,
        mean_run(floor, floor_after),
        cast(comparison.Profiles, result.pop("platform_profiles")),
        settings,
        env,
        cast(float, result["embedding_quiet_batches"]),
        around["round_trip"],
        one_client[RAW_IDLE_WORKER],
        beside_platform(
            one_client,
            cast(float, result["embedding_quiet_batches"]),
            cast(dict[str, float], result["generation_one_client_ms"]),
        ),
        bare_hops_ms=around["hops"],
        naive_beside=(
            (one_client[NAIVE_BESIDE], one_client[BESIDE_WORKER]) if NAIVE_BESIDE in one_client else None
        ),
    )
    cpu = cpu_model()
    result["machine"] = {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "python": host.python_version(),
        "torch": raw["torch"],
        "device": raw["device"],
        "quick": args.quick,
        "worker_torch_threads": threads,
        "raw_torch_threads": raw["threads"],
        "placement": placed or "off",
        "load_avg_start": load_before,
        "load_avg_end": os.getloadavg(),
    }
    result["peers"] = peers
    print(table(result))
    where = cast(dict[str, float], result["embedding_one_client_ms"])
    print(
        "\nembeddings at 1 client, where the time goes (p50 ms; the terminal events' timings, "
        f"{where['requests']:.0f} requests): "
        + " | ".join(f"{stage} {where[stage]:.2f}" for stage in (*STAGES, *BACK_SPLIT) if stage in where)
        + f" | raw batch 1 {where['raw batch 1']:.2f} in a loop, "
        f"{where['raw batch 1 after idle']:.2f} after {where['raw idle ms']:.0f} ms idle"
        f" ({where[RAW_IDLE_WORKER]:.2f} on the worker's {threads} thread(s))"
        + f", {where['raw batch 1, eager']:.2f} eager in a loop"
        + f" | beside the blocks: raw batch 1 {where[BESIDE]:.2f} in a loop"
        f" ({where[BESIDE_WORKER]:.2f} on the worker's {threads} thread(s))"
        + f" | bare, beside them: the two hops around that forward {where['bare hops']:.2f}"
        f" (in {where['bare hop_in']:.2f},"
        f" back {where['bare hop_back']:.2f}), round trip {where['bare round_trip']:.2f}"
        + (f" | the naive server beside them {where[NAIVE_BESIDE]:.2f}" if NAIVE_BESIDE in where else "")
    )
    first, ttft = (
        cast(dict[str, float], result["ttft_one_client_ms"]),
        cast(dict[str, float], result["ttft_ms"]),
    )
    print(
        "time to first token at low load, where the time goes (p50 ms, "
        f"{first['requests']:.0f} requests; model: prefill to the first token): "
        + " | ".join(f"{stage} {first[stage]:.2f}" for stage in STAGES if stage in first)
        + f" | raw TTFT {first['raw']:.2f} in a loop ({first['raw after idle']:.2f} after"
        f" {ttft['floor_idle_ms']:g} ms idle on the worker's {threads} thread(s); the prefill as the worker"
        f" runs it, a plain eager forward {first['raw eager']:.2f})"
    )
    completions = cast(dict[str, float], result["generation_one_client_ms"])
    print(
        f"generation at 1 client beside the raw model (p50 ms, {completions['requests']:.0f} completions of"
        f" {QUICK_TOKENS if args.quick else NEW_TOKENS} tokens in {ONE_CLIENT_BLOCKS[args.quick]} blocks):"
        f" platform {completions['platform']:.1f} | the raw model beside them {completions['raw beside']:.1f}"
        f" ({completions['samples']:.0f} calls on the worker's {threads} thread(s))"
    )
    print()
    print(comparison.table(peers["profiles"], peers["ratios"]))
    load = " / ".join(f"{a:.1f}" for a in load_before), " / ".join(f"{a:.1f}" for a in os.getloadavg())
    print(
        f"\nload average (1/5/15 min) at start {load[0]}, at end {load[1]} on {os.cpu_count()} CPUs ({cpu})"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
