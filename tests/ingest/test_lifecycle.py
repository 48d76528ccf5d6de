"""Deadlines, client disconnects and graceful shutdown: each ends in a cancel to the gateway."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta

import aiohttp
import msgspec
import pytest

from ingest.app import Edge
from ingest.auth import TenantDirectory
from ingest.models import ModelCatalogue
from schemas.events import CancelRequested
from tests.ingest.conftest import AUTH, GEN, Client, MakeClient, eventually, parse_sse, settings
from tests.ingest.fake_gateway import FakeGateway

CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hello"}]}


@pytest.mark.parametrize("how", ["body", "header"])
async def test_deadline_while_waiting_is_504_and_cancels(
    client: Client, gateway: FakeGateway, how: str
) -> None:
    gateway.hold_after = 1
    body = {**CHAT, "timeout": 0.2} if how == "body" else CHAT
    headers = {**AUTH, "X-Request-Timeout": "0.2"} if how == "header" else AUTH
    response = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert response.status == 504
    assert response.headers["x-should-retry"] == "false"
    error = (await response.json())["error"]
    assert (error["type"], error["code"]) == ("timeout", "timeout")
    (event,) = gateway.submitted
    await eventually(lambda: len(gateway.cancels) == 1)
    assert gateway.cancels[0].request_id == event.request_id
    assert gateway.cancels[0].reason == "client_cancel"
    assert gateway.cancels[0].tenant == "demo"
    assert gateway.cancels[0].source == "ingest/edge-test"


async def test_deadline_mid_stream_is_an_sse_error(client: Client, gateway: FakeGateway) -> None:
    gateway.hold_after = 2
    body = {**CHAT, "stream": True, "timeout": 0.2}
    response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert response.status == 200
    events = parse_sse(await response.text())
    texts = [msgspec.json.decode(d) for _, d in events[:-1]]
    assert [t["choices"][0]["delta"].get("content") for t in texts[:-1]] == ["", " t0", " t1"]
    assert texts[-1]["error"]["code"] == "timeout"
    assert events[-1][1] == "[DONE]"
    await eventually(lambda: len(gateway.cancels) == 1)


async def test_deadline_is_clamped_to_the_maximum(make_client: MakeClient, gateway: FakeGateway) -> None:
    client, _ = await make_client(edge_max_timeout_s=30.0, edge_default_timeout_s=5.0)
    before = datetime.now(UTC)
    await client.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "X-Request-Timeout": "9999"})
    await client.post(
        "/v1/chat/completions", json={**CHAT, "timeout": 10}, headers={**AUTH, "X-Request-Timeout": "3"}
    )
    after = datetime.now(UTC)
    clamped, smaller = gateway.submitted
    assert clamped.deadline is not None
    assert smaller.deadline is not None
    # each timed from the moment the edge took it, between before and after (a loaded box may stall a
    # request for seconds: timed from ``before`` alone, the second one's 3 s read as more than 4)
    second = timedelta(seconds=1)
    assert before + 29 * second <= clamped.deadline <= after + 31 * second
    assert before + 2 * second <= smaller.deadline <= after + 4 * second


@pytest.mark.parametrize("stream", [True, False])
async def test_client_disconnect_cancels(client: Client, gateway: FakeGateway, stream: bool) -> None:
    gateway.hold_after = 2
    if stream:
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
        assert (await response.content.readuntil(b"t1")).count(b"data:") == 3
        response.close()
    else:  # the client gives up waiting for the one JSON body
        waiting = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=AUTH))
        await eventually(lambda: bool(gateway.streams))  # its request published, its replies awaited
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await eventually(lambda: len(gateway.cancels) == 1)
    (event,) = gateway.submitted
    assert (gateway.cancels[0].request_id, gateway.cancels[0].reason) == (
        event.request_id,
        "client_disconnect",
    )
    await eventually(lambda: all(s.closed for s in gateway.streams))


async def _open_stream(session: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    response = await session.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert response.status == 200
    await response.content.readuntil(b" t0")
    return response


async def test_shutdown_drains_in_flight_streams(catalogue: ModelCatalogue, gateway: FakeGateway) -> None:
    gateway.hold_after = 1
    edge = Edge(settings(edge_shutdown_grace_s=10.0), gateway, catalogue, TenantDirectory.demo())
    await edge.start()
    url = edge.url
    async with aiohttp.ClientSession() as session:
        response = await _open_stream(session, url)
        stopping = asyncio.create_task(edge.stop())
        await eventually(lambda: not edge.ctx.admission.accepting)
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"{url}/healthz")
        gateway.release.set()
        rest = await response.content.read()
        assert rest.endswith(b"data: [DONE]\n\n")
        await stopping
    assert gateway.cancels == []


async def test_shutdown_cancels_what_outlives_the_grace_and_tells_each_client(
    catalogue: ModelCatalogue, gateway: FakeGateway
) -> None:
    """Found by an audit: the requests cut by shutdown had their tasks cancelled. An SSE client read a
    truncated body (no error event, no ``[DONE]``), a WebSocket client a 1001 close with no frame for its
    ids, and a client waiting for a JSON body a dropped connection. Each now reads ``shutting_down``: the
    request was cancelled (``CancelRequested(reason="shutdown")``), so it sends it again elsewhere."""
    gateway.hold_after = 1
    edge = Edge(settings(edge_shutdown_grace_s=0.1), gateway, catalogue, TenantDirectory.demo())
    async with aiohttp.ClientSession() as session:
        async with edge:
            response = await _open_stream(session, edge.url)
            ws = await session.ws_connect(f"{edge.url}/v1/ws", headers=AUTH)
            await ws.send_json({"type": "request", "id": "w", "endpoint": "chat.completions", "body": CHAT})
            assert (await ws.receive_json(timeout=5))["type"] == "accepted"
            assert (await ws.receive_json(timeout=5))["type"] == "token"
            waiting = asyncio.create_task(
                session.post(f"{edge.url}/v1/chat/completions", json=CHAT, headers=AUTH)
            )
            await eventually(lambda: len(gateway.submitted) == 3)
        assert [c.reason for c in gateway.cancels] == ["shutdown"] * 3
        assert {c.request_id for c in gateway.cancels} == {e.request_id for e in gateway.submitted}
        events = parse_sse((await response.content.read()).decode())
        assert msgspec.json.decode(events[-2][1])["error"]["code"] == "shutting_down"
        assert events[-1][1] == "[DONE]"
        error = await ws.receive_json(timeout=5)
        assert (error["type"], error["id"], error["error"]["code"]) == ("error", "w", "shutting_down")
        message = await ws.receive(timeout=5)
        assert (message.type, message.data) == (aiohttp.WSMsgType.CLOSE, aiohttp.WSCloseCode.GOING_AWAY)
        await ws.close()
        answer = await waiting
        assert answer.status == 503
        assert answer.headers["x-should-retry"] == "true"
        assert (await answer.json())["error"]["code"] == "shutting_down"


async def test_new_requests_are_refused_while_stopping(make_client: MakeClient, gateway: FakeGateway) -> None:
    client, edge = await make_client()
    edge.ctx.admission.accepting = False
    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status == 503
    assert (await response.json())["error"]["code"] == "shutting_down"
    assert (await client.get("/readyz")).status == 503
    assert gateway.submitted == []


async def test_disconnect_grace_then_cancel(make_client: MakeClient, gateway: FakeGateway) -> None:
    """A client that left is cancelled, but not before the grace (it may come back). When the cancel went out
    is timed, not looked for "not yet" after the stream closed: with a 50 ms grace, a loaded box's stall
    between the close and the look ran the grace out first."""
    grace_s = 0.3
    client, _ = await make_client(edge_disconnect_grace_s=grace_s)
    gateway.hold_after = 1
    loop = asyncio.get_running_loop()
    sent_at: list[float] = []
    cancel = gateway.cancel

    async def timed_cancel(event: CancelRequested) -> None:
        sent_at.append(loop.time())
        await cancel(event)

    gateway.cancel = timed_cancel  # type: ignore[method-assign]
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    await response.content.readuntil(b" t0")
    left_at = loop.time()
    response.close()
    await eventually(lambda: gateway.streams[0].closed)
    await eventually(lambda: len(gateway.cancels) == 1)
    assert gateway.cancels[0].reason == "client_disconnect"
    # the grace runs from when the edge saw the client go, after ``left_at``: a stall only adds to this
    assert sent_at[0] - left_at >= grace_s - 0.01, f"cancelled {sent_at[0] - left_at:.3f}s after it left"


async def test_a_connection_idle_or_still_sending_its_headers_is_closed(
    catalogue: ModelCatalogue, gateway: FakeGateway
) -> None:
    """Found by an audit: aiohttp keeps such a connection an hour by default, and 500 connections sending
    their headers a byte at a time were all kept open. ``SLUICE_EDGE_IDLE_TIMEOUT_S`` closes them."""
    edge = Edge(settings(edge_idle_timeout_s=0.5), gateway, catalogue, TenantDirectory.demo())
    async with edge:
        host, port = edge.ctx.settings.edge_host, edge.port
        for sent in (b"", b"GET /healthz HT"):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(sent)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), timeout=5.0) == b""  # closed by the edge
            writer.close()
