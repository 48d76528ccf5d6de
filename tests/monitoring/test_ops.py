from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from monitoring.metrics import CONTENT_TYPE, DEAD_LETTERS
from monitoring.ops import OpsServer, Readiness
from schemas.settings import SettingsError


class Probe:
    """A readiness callback the test flips between ready, unready and raising."""

    def __init__(self) -> None:
        self.answer: Readiness | Exception = Readiness.of(kafka=True, model_loaded=True, lag=3)
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self) -> Readiness:
        with self.lock:
            self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, bytes]:
    """(status, content type, body), for error statuses too."""
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers or {}), timeout=5
        ) as response:
            return response.status, response.headers["Content-Type"], response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.headers["Content-Type"], exc.read()


def get_json(url: str) -> tuple[int, Any]:
    status, content_type, body = get(url)
    assert content_type == "application/json"
    return status, json.loads(body)


@pytest.fixture
def probe() -> Probe:
    return Probe()


@pytest.fixture
def ops(probe: Probe) -> Iterator[OpsServer]:
    with OpsServer("127.0.0.1", 0, probe, service="worker-test") as server:
        yield server


def test_readiness_of_is_ready_when_every_boolean_check_is_true() -> None:
    assert Readiness.of(kafka=True, model_loaded=True, lag=1200, version="v1").ready
    assert not Readiness.of(kafka=True, model_loaded=False, lag=0).ready
    assert Readiness.of().ready
    assert Readiness.of(lag_ok=False).checks == {"lag_ok": False}
    assert json.loads(Readiness.of(kafka=True, lag=2).to_json()) == {
        "ready": True,
        "checks": {"kafka": True, "lag": 2},
    }


def test_binds_an_ephemeral_port_and_reports_its_url(ops: OpsServer) -> None:
    assert ops.port > 0
    assert ops.url == f"http://127.0.0.1:{ops.port}"


def test_healthz_answers_ok_with_the_service_name(ops: OpsServer, probe: Probe) -> None:
    probe.answer = RuntimeError("not consulted by /healthz")
    assert get_json(f"{ops.url}/healthz") == (200, {"status": "ok", "service": "worker-test"})


def test_metrics_serve_the_exposition_with_the_prometheus_content_type(ops: OpsServer) -> None:
    DEAD_LETTERS.labels(topic="ops-test", reason="bad_json").inc(0)  # a series this test can look for
    status, content_type, body = get(f"{ops.url}/metrics")
    assert status == 200
    assert content_type == CONTENT_TYPE
    text = body.decode()
    assert "# TYPE sluice_dead_letters_total counter" in text
    assert 'sluice_dead_letters_total{reason="bad_json",topic="ops-test"}' in text


def test_readyz_follows_the_readiness_callback(ops: OpsServer, probe: Probe) -> None:
    assert get_json(f"{ops.url}/readyz") == (
        200,
        {"ready": True, "checks": {"kafka": True, "model_loaded": True, "lag": 3}},
    )
    probe.answer = Readiness.of(kafka=True, model_loaded=False)
    assert get_json(f"{ops.url}/readyz?verbose=1") == (
        503,
        {"ready": False, "checks": {"kafka": True, "model_loaded": False}},
    )
    assert probe.calls == 2


def test_readyz_is_503_with_the_error_when_the_callback_raises(ops: OpsServer, probe: Probe) -> None:
    probe.answer = RuntimeError("consumer thread died")
    status, body = get_json(f"{ops.url}/readyz")
    assert status == 503
    assert body["ready"] is False
    assert body["error"] == "RuntimeError: consumer thread died"
    assert get_json(f"{ops.url}/healthz")[0] == 200  # the server keeps serving


def test_unknown_routes_are_404_json(ops: OpsServer) -> None:
    assert get_json(f"{ops.url}/nope") == (404, {"error": "not found", "path": "/nope"})


def test_request_logging_stays_off_stderr(ops: OpsServer, capfd: pytest.CaptureFixture[str]) -> None:
    get(f"{ops.url}/healthz")
    get(f"{ops.url}/nope")
    assert capfd.readouterr().err == ""


def test_stop_releases_the_port_and_is_idempotent(probe: Probe) -> None:
    server = OpsServer("127.0.0.1", 0, probe, service="worker-test")
    server.stop()  # before start: nothing to do
    server.start()
    server.start()  # already serving: nothing to do
    url = server.url
    assert get(f"{url}/healthz")[0] == 200
    server.stop()
    server.stop()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/healthz", timeout=2)


def test_a_taken_port_is_a_clear_error() -> None:
    import socket

    from monitoring.ops import OpsServerError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = OpsServer("127.0.0.1", port, lambda: Readiness.of(ok=True), service="worker/x")
        with pytest.raises(OpsServerError, match=rf"worker/x: cannot serve /metrics on 127.0.0.1:{port}"):
            server.start()


TOKEN = "worker-ops-token-0123456789"


def test_with_a_token_metrics_want_it_and_probes_do_not(probe: Probe) -> None:
    with OpsServer("127.0.0.1", 0, probe, service="worker-test", token=TOKEN) as ops:
        status, _, body = get(f"{ops.url}/metrics")
        assert status == 401
        assert b"SLUICE_OPS_TOKEN" in body
        assert get(f"{ops.url}/metrics", {"Authorization": "Bearer not-it"})[0] == 401
        status, content_type, _ = get(f"{ops.url}/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert (status, content_type) == (200, CONTENT_TYPE)
        assert get(f"{ops.url}/healthz")[0] == 200
        assert get(f"{ops.url}/readyz")[0] == 200


def test_a_foreign_host_is_refused_but_probes_answer(ops: OpsServer) -> None:
    rebound = {"Host": f"attacker.example:{ops.port}"}
    status, _, body = get(f"{ops.url}/metrics", rebound)
    assert status == 421
    assert b"attacker.example" in body
    assert get(f"{ops.url}/metrics", {"Host": f"localhost:{ops.port}"})[0] == 200
    assert get(f"{ops.url}/healthz", rebound)[0] == 200
    assert get(f"{ops.url}/readyz", rebound)[0] == 200


def test_an_exposed_ops_port_without_a_token_does_not_start(probe: Probe) -> None:
    with pytest.raises(SettingsError, match=r"SLUICE_WORKER_OPS_HOST='0\.0\.0\.0'.*SLUICE_OPS_TOKEN"):
        OpsServer("0.0.0.0", 0, probe, service="worker-test")
    OpsServer("0.0.0.0", 0, probe, service="worker-test", token=TOKEN)


async def test_the_quiet_runner_answers_a_malformed_request_with_one_info_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An audit: the streams worker's server logged aiohttp's traceback at ERROR for every request it could
    not parse (``curl -H 'Host:'``), so anyone who could connect could fill its log."""
    import asyncio
    import logging

    from aiohttp import web

    from monitoring.ops import QuietRunner

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", ok)
    runner = QuietRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        with caplog.at_level(logging.INFO):
            for request in (b"GET / HTTP/1.1\r\n\r\n", b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(request)
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(4096), 5)
                writer.close()
                status = answer.split(b"\r\n", 1)[0]
                assert status.split(b" ")[1] == (b"400" if b"Host" not in request else b"200"), answer
    finally:
        await runner.cleanup()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    refused = [r for r in caplog.records if "refused a malformed request" in r.getMessage()]
    assert len(refused) == 1
    assert "Host" in refused[0].getMessage()
    assert refused[0].exc_info is None
