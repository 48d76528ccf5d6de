"""``sluice up`` as a user runs it: Kafka, topics, warehouse, models, workers and the edge come up; the API
answers; other processes can query the warehouse; Ctrl-C stops everything cleanly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest

from bus.placement import available_cpus, format_cpus, split_box
from gpu_workers.features import DRIFT_THREAD_NAME
from gpu_workers.models import QUIET_THREAD_NAME
from infra.kafka.broker import free_port, port_open
from infra.topics import make_admin
from ingest.auth import DEMO_KEY
from schemas.settings import KafkaConnection

pytestmark = pytest.mark.integration


def _post(url: str, body: dict[str, object], headers: dict[str, str] | None = None) -> dict[str, Any]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={
            "Authorization": f"Bearer {DEMO_KEY}",
            "Content-Type": "application/json",
            **(headers or {}),
        },
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env.update(
        SLUICE_DATA_DIR=str(tmp_path / "data"),
        SLUICE_KAFKA_PORT=str(free_port()),
        SLUICE_EDGE_PORT=str(free_port()),
        SLUICE_WORKER_OPS_PORT=str(free_port()),
        SLUICE_STREAMS_PORT=str(free_port()),
    )
    return env


def _wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"{needle!r} not seen; output so far:\n{''.join(lines)}")


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _check_ops(edge: str, worker_port: int) -> None:
    """Every service answers /healthz, /readyz and /metrics; the counts reflect the requests just made."""
    assert _get(f"{edge}/healthz")[0] == 200
    assert _get(f"{edge}/readyz")[0] == 200
    status, text = _get(f"{edge}/metrics")
    assert status == 200
    assert 'sluice_requests_total{model="demo-gpt",outcome="completed",tenant="demo"' in text
    for port, model in ((worker_port, "demo-gpt"), (worker_port + 1, "all-minilm-l6-v2")):
        worker = f"http://127.0.0.1:{port}"
        assert _get(f"{worker}/healthz")[0] == 200
        status, body = _get(f"{worker}/readyz")
        assert status == 200, body
        assert json.loads(body)["checks"]["model_loaded"] is True
        status, text = _get(f"{worker}/metrics")
        assert status == 200
        assert f'sluice_worker_requests_total{{model="{model}",status="completed"' in text
        assert f'sluice_model_memory_bytes{{device="cpu",model="{model}"}}' in text


@pytest.mark.timeout(360)  # the whole operator's flow, a candidate worker's start included, on 2 cores
def test_up_serves_kafka_topics_and_warehouse_then_stops_on_sigint(tmp_path: Path) -> None:
    env = _env(tmp_path)
    port = int(env["SLUICE_KAFKA_PORT"])
    edge_port = env.pop("SLUICE_EDGE_PORT")  # the README's `sluice up --port N` instead
    with subprocess.Popen(
        [sys.executable, "-m", "sluice", "up", "--port", edge_port],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        _drive(proc, env, port, edge_port=int(edge_port))
    assert not port_open(port), "the broker sluice up started must stop with it"
    assert not (tmp_path / "data" / "warehouse" / ".owner.json").exists()


def _check_placement(up: int, lines: list[str]) -> None:
    """On a box of 2+ cores the workers run on the upper half; ``sluice up`` (the edge), Kafka and the streams
    worker on the rest; a worker's Python threads on its cores, librdkafka's native threads on the rest."""
    split = split_box(available_cpus())
    if split is None:  # one core: nothing to place
        assert not any(line.startswith("cores:") for line in lines)
        return
    workers, rest = split
    assert any(line.startswith(f"cores: workers {format_cpus(workers)};") for line in lines), lines
    assert os.sched_getaffinity(up) == rest
    children = {child.pid: " ".join(child.cmdline()) for child in psutil.Process(up).children()}
    serving = [pid for pid, cmd in children.items() if " worker --model " in cmd]
    assert len(serving) == 2, children
    others = [pid for pid in children if pid not in serving]
    assert others, "Kafka and the streams worker"
    assert all(os.sched_getaffinity(pid) == rest for pid in others)
    helpers = drift = 0
    for pid in serving:
        native = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/comm") as comm:
                    name = comm.read().strip()
                affinity = os.sched_getaffinity(int(task))
            except (FileNotFoundError, ProcessLookupError):
                continue  # a thread that ended while we looked
            native += name.startswith("rdk:")
            helpers += name == QUIET_THREAD_NAME
            drift += name == DRIFT_THREAD_NAME
            # the embedding worker's quiet team: torch's helper threads on the rest too (gpu_workers.models);
            # the generation worker's drift embedder, at idle priority, on all of them (gpu_workers.features)
            expected = rest if name.startswith("rdk:") or name == QUIET_THREAD_NAME else workers
            expected = workers | rest if name == DRIFT_THREAD_NAME else expected
            assert affinity == expected, (pid, task, name)
        assert native, "the worker's Kafka clients run native threads"
    assert helpers, "the embedding worker's quiet team has a helper thread on the rest"
    assert drift == 1, "the generation worker's drift embedder runs on every core it may use"


def _drive(proc: subprocess.Popen[str], env: dict[str, str], port: int, edge_port: int) -> None:
    try:
        lines = _wait_for_line(proc, "sluicegate is up", timeout=240)
        url = lines[-1].split()[3]  # "sluicegate is up  http://127.0.0.1:PORT/v1   API key: ..."
        assert url == f"http://127.0.0.1:{edge_port}/v1"
        ops = int(env["SLUICE_WORKER_OPS_PORT"])
        for worker in (ops, ops + 1):  # "up" waited for them: a first request does not wait for a model load
            status, body = _get(f"http://127.0.0.1:{worker}/readyz")
            assert status == 200, body
        completion = _post(
            f"{url}/completions", {"model": "demo-gpt", "prompt": "The river", "max_tokens": 4}
        )
        assert completion["usage"]["completion_tokens"] >= 1
        embedding = _post(f"{url}/embeddings", {"model": "all-minilm-l6-v2", "input": "a river"})
        assert len(embedding["data"][0]["embedding"]) == 384
        _check_ops(url.removesuffix("/v1"), int(env["SLUICE_WORKER_OPS_PORT"]))
        _check_placement(proc.pid, lines)
        streams = f"http://127.0.0.1:{env['SLUICE_STREAMS_PORT']}"
        assert _get(f"{streams}/readyz")[0] == 200
        status, page = _get(f"{streams}/dashboard")
        assert status == 200
        assert "plotly" in page
        status, text = _get(f"{streams}/metrics")
        assert status == 200
        assert "sluice_streams_freshness_seconds_count" in text
        topics = make_admin(KafkaConnection(f"127.0.0.1:{port}")).list_topics(timeout=10).topics
        assert "sluice.requests.demo-gpt" in topics
        assert "sluice.control" in topics
        sql = subprocess.run(
            [
                sys.executable,
                "-m",
                "sluice",
                "sql",
                "SELECT count() AS n FROM schema_migrations",
                "-f",
                "csv",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert sql.returncode == 0, sql.stderr
        assert sql.stdout.splitlines()[0] == "n"
        assert int(sql.stdout.splitlines()[1]) >= 1
        _rollout(proc, env, url)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # a failed check: stop it as an operator would, then harder
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            # the broker runs in a session of its own: if sluice up died first, it must not outlive the test
            _sluice(env, "kafka", "down")


CANDIDATE = "uptest000001"


def _sluice(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _rollout(proc: subprocess.Popen[str], env: dict[str, str], url: str) -> None:
    """The operator's flow on the running platform: a second version of demo-gpt, a rollout that makes
    `sluice up` start its worker and the edge split sessions between the versions, then an abort that
    stops that worker and puts every session back on the stable version."""
    from schemas.manifest import current_model_dir, models_root
    from schemas.settings import PlatformSettings
    from tests.conftest import add_candidate

    cache = env.get("SLUICE_CACHE_DIR") or PlatformSettings().cache_dir
    stable = add_candidate(models_root(cache) / "demo-gpt", current_model_dir(cache, "demo-gpt"), CANDIDATE)
    try:
        _canary_then_abort(proc, env, url, stable)
    finally:  # the shared model cache keeps no test version
        shutil.rmtree(models_root(cache) / "demo-gpt" / CANDIDATE, ignore_errors=True)


def _canary_then_abort(proc: subprocess.Popen[str], env: dict[str, str], url: str, stable: str) -> None:
    started = _sluice(env, "rollout", "start", "demo-gpt", "--version", CANDIDATE, "--canary", "50",
                      "--step-min-s", "3600")  # fmt: skip
    assert started.returncode == 0, started.stdout + started.stderr
    _wait_for_line(proc, f"worker for demo-gpt version {CANDIDATE} started", timeout=30)

    def versions(prefix: str, n: int) -> set[str]:
        seen = set()
        for i in range(n):
            body = {"model": "demo-gpt", "prompt": "The river", "max_tokens": 2}
            seen.add(
                _post(f"{url}/completions", body, {"X-Session-Id": f"{prefix}-{i}"})["system_fingerprint"]
            )
        return seen

    # While the candidate's worker loads, the rollout warms up with every session on the stable version;
    # its first step (the candidate's share) follows the worker's readiness, so no request waits for a
    # model still loading (before, these requests needed a deadline past the edge's default 60 s).
    phases = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        status = _sluice(env, "rollout", "status", "demo-gpt")
        assert status.returncode == 0, status.stderr
        phases.append(next(p for p in ("warming", "canary") if p in status.stdout))
        if phases[-1] == "canary":
            break
        time.sleep(0.5)
    assert phases[-1] == "canary", "the candidate's worker never said it was ready"
    assert versions("canary", 16) == {stable, CANDIDATE}  # the odds of one version only: 2 in 65536
    aborted = _sluice(env, "rollout", "abort", "demo-gpt", "--reason", "test")
    assert aborted.returncode == 0, aborted.stderr
    _wait_for_line(proc, f"worker for demo-gpt version {CANDIDATE} stopping", timeout=30)
    assert versions("after", 8) == {stable}
