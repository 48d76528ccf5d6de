"""The edge's connections over real sockets: what aiohttp would answer itself leaves in OpenAI's shape, and
the edge holds at most ``SLUICE_EDGE_MAX_CONNECTIONS`` of them (ingest/protocol.py)."""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from ingest.app import Edge
from ingest.auth import TenantDirectory
from ingest.models import ModelCatalogue
from ingest.protocol import ensure_descriptors
from monitoring import metrics
from monitoring.ops import parse_message
from tests.ingest.conftest import AUTH, EMB, settings
from tests.ingest.fake_gateway import FakeGateway

HOST = "Host: 127.0.0.1\r\n"
MALFORMED = {
    "bad_content_length": f"POST /v1/embeddings HTTP/1.1\r\n{HOST}Content-Length: abc\r\n\r\n",
    "two_content_lengths": f"POST /v1/embeddings HTTP/1.1\r\n{HOST}Content-Length: 2\r\nContent-Length: 3\r\n\r\n{{}}",
    "no_host": "GET /v1/models HTTP/1.1\r\n\r\n",
    "header_over_8k": f"GET /v1/models HTTP/1.1\r\n{HOST}X-A: {'a' * 9000}\r\n\r\n",
    "url_over_8k": f"GET /{'a' * 9000} HTTP/1.1\r\n{HOST}\r\n",
    "too_many_headers": f"GET /v1/models HTTP/1.1\r\n{HOST}"
    + "".join(f"X-{i}: 1\r\n" for i in range(200))
    + "\r\n",
    "brotli_body": f"POST /v1/embeddings HTTP/1.1\r\n{HOST}Content-Encoding: br\r\nContent-Length: 2\r\n\r\n{{}}",
    "bad_method": f"G@T /v1/models HTTP/1.1\r\n{HOST}\r\n",
    "bad_version": f"GET /v1/models HTTP/9.9\r\n{HOST}\r\n",
    "bad_chunk": f"POST /v1/embeddings HTTP/1.1\r\n{HOST}Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "chunked_and_length": (
        f"POST /v1/embeddings HTTP/1.1\r\n{HOST}Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n0\r\n\r\n"
    ),
}


@pytest.fixture
async def edge(catalogue: ModelCatalogue, gateway: FakeGateway) -> AsyncIterator[Edge]:
    async with Edge(settings(edge_max_connections=3), gateway, catalogue, TenantDirectory.demo()) as running:
        yield running


async def exchange(edge: Edge, raw: bytes, *, within_s: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` on a new connection and read until the edge closes it: status, headers, body."""
    reader, writer = await asyncio.open_connection(edge.ctx.settings.edge_host, edge.port)
    try:
        writer.write(raw)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), timeout=within_s)
    finally:
        writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, body


def rejections(code: str) -> float:
    return sum(
        sample.value
        for family in metrics.REJECTIONS.collect()
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("reason") == code
    )


@pytest.mark.parametrize("case", sorted(MALFORMED))
async def test_a_request_aiohttp_cannot_parse_is_a_400_in_openai_shape(
    edge: Edge, gateway: FakeGateway, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found by an audit: each of these was a text/plain 400 with aiohttp's own wording (the bytes it could
    not parse quoted back, "Please install `Brotli`"), and a traceback at ERROR in the edge's log for every
    one a client sent."""
    before = rejections("malformed_http")
    with caplog.at_level(logging.INFO):
        status, headers, body = await exchange(edge, MALFORMED[case].encode())
    assert status == 400
    assert headers["content-type"].startswith("application/json")
    error = msgspec.json.decode(body)["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "malformed_http"
    assert error["message"].startswith("The request could not be parsed as HTTP: ")
    assert "b'" not in error["message"]
    assert "Please install" not in error["message"]
    assert len(error["message"]) < 300
    assert rejections("malformed_http") == before + 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], (
        "a traceback was logged"
    )
    assert gateway.submitted == []


async def test_a_body_left_unread_that_does_not_decode_logs_no_traceback(
    edge: Edge, caplog: pytest.LogCaptureFixture
) -> None:
    """A request refused before its body is read (no API key) whose zstd body is garbage: aiohttp drains the
    body after the answer and logged "Unhandled exception" with three chained tracebacks."""
    raw = f"POST /v1/embeddings HTTP/1.1\r\n{HOST}Content-Encoding: zstd\r\nContent-Length: 2\r\n\r\n{{}}"
    with caplog.at_level(logging.INFO):
        status, _, body = await exchange(edge, raw.encode())
    assert status == 401
    assert msgspec.json.decode(body)["error"]["code"] == "invalid_api_key"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], (
        "a traceback was logged"
    )


async def test_connections_past_the_cap_are_answered_503_and_closed(edge: Edge, gateway: FakeGateway) -> None:
    """The edge held every connection it was offered: each idle one costs ~10 KB and a file descriptor, and
    past ``ulimit -n`` accepting fails for everyone. With a cap of 3, three clients hold their connections and
    keep being served; a fourth is told 503 at once, and once one of the three leaves, a new one is served."""
    before = rejections("too_many_connections")
    url = f"{edge.url}/v1/embeddings"
    body = {"model": EMB, "input": "hello"}
    sessions = [aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) for _ in range(3)]
    try:
        for session in sessions:  # each keeps its one connection alive between requests
            async with session.post(url, json=body, headers=AUTH) as response:
                assert response.status == 200
        status, headers, answer = await exchange(edge, f"GET /v1/models HTTP/1.1\r\n{HOST}\r\n".encode())
        assert status == 503
        assert headers["retry-after"] == "1"
        assert headers["connection"] == "close"
        error = msgspec.json.decode(answer)["error"]
        assert error["code"] == "too_many_connections"
        assert error["type"] == "server_error"
        assert rejections("too_many_connections") == before + 1
        for session in sessions:  # the three are still served on their own connections
            async with session.post(url, json=body, headers=AUTH) as response:
                assert response.status == 200
        await sessions.pop().close()
        for _ in range(50):  # the server sees the close a moment later
            if await _served(edge):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("a connection freed under the cap was not served")
    finally:
        for session in sessions:
            await session.close()


async def _served(edge: Edge) -> bool:
    status, _, _ = await exchange(edge, f"GET /healthz HTTP/1.1\r\n{HOST}Connection: close\r\n\r\n".encode())
    return status == 200


def test_parse_message_keeps_the_first_line_without_the_quoted_bytes() -> None:
    assert parse_message(None, "Invalid method encountered:\n\n  b'G@T / HTTP/1.1'\n     ^", 400) == (
        "Invalid method encountered"
    )
    assert parse_message(None, "Got more than 8190 bytes when reading: bytearray(b'/aaaa", 400) == (
        "Got more than 8190 bytes when reading"
    )
    assert parse_message(None, "", 400) == "HTTP 400"
    assert len(parse_message(None, "x" * 5000, 400)) == 200


def test_the_open_file_limit_is_raised_to_fit_the_connections() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        if hard != resource.RLIM_INFINITY and hard < 1024:
            pytest.skip(f"the hard limit here ({hard}) leaves no room to raise the soft one")
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, hard))
        assert ensure_descriptors(600) == 856
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 856
        assert ensure_descriptors(100) == 856  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
