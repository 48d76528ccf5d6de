"""A client that leaves before the worker's ops server answers (a Prometheus scrape or a readiness poll
that timed out) is not an error: an audit saw ERROR tracebacks of ``ConnectionResetError`` for them."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

import pytest

from monitoring.ops import OpsServer, Readiness


def test_a_client_that_resets_before_the_answer_logs_no_error(caplog: pytest.LogCaptureFixture) -> None:
    asked, answer = threading.Event(), threading.Event()

    def slow_readiness() -> Readiness:
        asked.set()
        answer.wait(5)  # the client gives up meanwhile
        return Readiness.of(ok=True)

    caplog.set_level(logging.DEBUG, logger="monitoring.ops")
    with OpsServer("127.0.0.1", 0, slow_readiness, service="worker-test") as server:
        client = socket.create_connection(("127.0.0.1", server.port))
        client.sendall(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert asked.wait(5)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        client.close()  # a reset, as a client's timeout sends
        answer.set()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any("went away" in r.message for r in caplog.records):
            if any(r.levelno >= logging.ERROR for r in caplog.records):
                break
            time.sleep(0.02)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("went away" in r.message for r in caplog.records)
