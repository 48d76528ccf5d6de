"""The WebSocket: multiplexing, cancel, resume, limits, bad frames and backpressure."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import WSCloseCode, web

import ingest.ws
from ingest.app import Edge
from ingest.auth import DEMO_KEY, TenantDirectory
from ingest.ws import NOT_READING, WsSession
from schemas.events import GenerationRequested
from tests.ingest.conftest import AUTH, EMB, GEN, OTHER_AUTH, Client, MakeClient, assert_healthy, eventually
from tests.ingest.fake_gateway import FakeGateway

CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hello"}]}


def request(
    client_id: Any, body: dict[str, Any] = CHAT, endpoint: str = "chat.completions"
) -> dict[str, Any]:
    return {"type": "request", "id": client_id, "endpoint": endpoint, "body": body}


async def frames_until(ws: aiohttp.ClientWebSocketResponse, done: int) -> list[dict[str, Any]]:
    """Frames until ``done`` terminal (done/error) frames have arrived."""
    frames: list[dict[str, Any]] = []
    while sum(f["type"] in ("done", "error") for f in frames) < done:
        frames.append(msgspec.json.decode(await ws.receive_str(timeout=5)))
    return frames


async def test_two_requests_multiplexed(client: Client, gateway: FakeGateway) -> None:
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("a", {**CHAT, "max_tokens": 2}))
        await ws.send_json(
            request(7, {"model": EMB, "input": "fox", "encoding_format": "base64"}, "embeddings")
        )
        frames = await frames_until(ws, 2)
    by_id: dict[Any, list[dict[str, Any]]] = {}
    for frame in frames:
        by_id.setdefault(frame["id"], []).append(frame)
    chat, emb = by_id["a"], by_id[7]
    rid = chat[0]["request_id"]
    assert [f["type"] for f in chat] == ["accepted", "token", "token", "done"]
    assert [f.get("seq") for f in chat[1:3]] == [0, 1]
    assert chat[1] == {
        "type": "token",
        "id": "a",
        "request_id": rid,
        "seq": 0,
        "cursor": "1.3",
        "offset": 0,
        "text": " t0",
        "token_ids": [0],
    }
    assert chat[-1]["finish_reason"] == "length"
    assert chat[-1]["usage"]["completion_tokens"] == 2
    assert "text" not in chat[-1]  # its tokens carried it
    assert [f["type"] for f in emb] == ["accepted", "done"]
    assert emb[-1]["result"]["object"] == "list"
    assert isinstance(emb[-1]["result"]["data"][0]["embedding"], str)
    assert len(gateway.submitted) == 2


@pytest.mark.parametrize("stream", [None, False])
async def test_a_generation_is_streamed_whatever_its_body_says(
    client: Client, gateway: FakeGateway, stream: bool | None
) -> None:
    """Found by an audit: a body without ``"stream": true`` (as this module's own tests sent them, passing
    only because the fake gateway streamed every request) was published not streamed: its worker sent no
    token and the ``done`` frame had no text, the answer billed and never read."""
    body = {**CHAT, "max_tokens": 2} | ({} if stream is None else {"stream": stream})
    # another audit: stream_options without stream was refused, as an HTTP body without stream is
    body["stream_options"] = {"include_usage": True}
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("a", body))
        frames = await frames_until(ws, 1)
    assert [f["type"] for f in frames] == ["accepted", "token", "token", "done"], frames
    assert "".join(f["text"] for f in frames if f["type"] == "token") == " t0 t1"
    (event,) = gateway.submitted
    assert isinstance(event, GenerationRequested)
    assert event.stream


async def test_ping_cancel_and_resume(client: Client, gateway: FakeGateway) -> None:
    gateway.hold_after = 1
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "ping", "id": 1})
        assert await ws.receive_json() == {"type": "pong", "id": 1}
        await ws.send_json(request("x"))
        accepted = await ws.receive_json()
        assert (await ws.receive_json())["seq"] == 0
        await ws.send_json({"type": "cancel", "id": "x"})
        done = await ws.receive_json()
        assert (done["type"], done["id"], done["finish_reason"]) == ("done", "x", "cancelled")
        await eventually(lambda: len(gateway.cancels) == 1)
        assert gateway.cancels[0].reason == "client_cancel"
        assert gateway.cancels[0].request_id == accepted["request_id"]
        # the log holds what was generated before the cancel; a resume replays it from there
        await ws.send_json(
            {"type": "resume", "id": "again", "request_id": accepted["request_id"], "after_seq": -1}
        )
        replay = await frames_until(ws, 1)
        await ws.send_json(  # after the token frame's cursor: only the end is left
            {"type": "resume", "id": "after", "request_id": accepted["request_id"], "after": "1.3"}
        )
        rest = await frames_until(ws, 1)
        await ws.send_json(
            {"type": "resume", "id": "bad", "request_id": accepted["request_id"], "after": "1.x"}
        )
        refused = await ws.receive_json()
    assert [f["type"] for f in replay] == ["accepted", "token", "error"]
    assert replay[-1]["error"]["code"] == "stream_cancelled"  # final: a resume replays that end every time
    assert [f["type"] for f in rest] == ["accepted", "error"]
    assert (refused["type"], refused["error"]["param"]) == ("error", "after")
    assert len(gateway.submitted) == 1


async def test_duplicate_id_and_inflight_limit(make_client: MakeClient, gateway: FakeGateway) -> None:
    client, _ = await make_client(edge_ws_max_inflight=2)
    gateway.hold_after = 0
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("a"))
        assert (await ws.receive_json())["type"] == "accepted"
        await ws.send_json(request("a"))
        duplicate = await ws.receive_json()
        assert (duplicate["type"], duplicate["id"], duplicate["error"]["code"]) == (
            "error",
            "a",
            "duplicate_id",
        )
        await ws.send_json(request("b"))
        assert (await ws.receive_json())["type"] == "accepted"
        await ws.send_json(request("c"))
        limited = await ws.receive_json()
        assert (limited["id"], limited["error"]["code"]) == ("c", "too_many_inflight")
        assert len(gateway.submitted) == 2
        gateway.release.set()
        await frames_until(ws, 2)


BAD_FRAMES: list[tuple[str, str | bytes, Any, str]] = [
    ("binary", b"\x00\x01", None, "invalid_request_error"),
    ("junk", "{not json", None, "invalid_request_error"),
    ("unknown type", '{"type": "shout", "id": "q"}', "q", "invalid_request_error"),
    ("no id", '{"type": "request", "endpoint": "completions", "body": {}}', None, "invalid_request_error"),
    (
        "bad endpoint",
        '{"type": "request", "id": "e", "endpoint": "images", "body": {}}',
        "e",
        "invalid_request_error",
    ),
    (
        "invalid body",
        '{"type": "request", "id": "v", "endpoint": "chat.completions", "body": {"model": "tiny-gpt"}}',
        "v",
        "invalid_request_error",
    ),
    (
        "unknown model",
        '{"type": "request", "id": "m", "endpoint": "completions", "body": {"model": "nope", "prompt": "x"}}',
        "m",
        "invalid_request_error",
    ),
    ("cancel unknown", '{"type": "cancel", "id": "zz"}', "zz", "invalid_request_error"),
    # a review: the error frame echoed ids no frame may have
    ("boolean id", '{"type": "request", "id": true, "endpoint": "chat"}', None, "invalid_request_error"),
    ("empty id", '{"type": "request", "id": "", "endpoint": "chat"}', None, "invalid_request_error"),
]


@pytest.mark.parametrize(
    ("frame", "client_id", "error_type"), [c[1:] for c in BAD_FRAMES], ids=[c[0] for c in BAD_FRAMES]
)
async def test_bad_frames_get_an_error_frame(
    client: Client, gateway: FakeGateway, frame: str | bytes, client_id: Any, error_type: str
) -> None:
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        if isinstance(frame, bytes):
            await ws.send_bytes(frame)
        else:
            await ws.send_str(frame)
        error = await ws.receive_json(timeout=5)
        assert (error["type"], error["id"], error["error"]["type"]) == ("error", client_id, error_type)
        await ws.send_json({"type": "ping"})
        assert (await ws.receive_json())["type"] == "pong"  # the socket survived
    assert gateway.submitted == []
    await assert_healthy(client, gateway)


async def test_auth_by_header_or_query(client: Client, gateway: FakeGateway) -> None:
    async with client.ws_connect(f"/v1/ws?api_key={DEMO_KEY}") as ws:
        await ws.send_json({"type": "ping"})
        assert (await ws.receive_json())["type"] == "pong"
    with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
        await client.ws_connect("/v1/ws", headers={"Authorization": "Bearer sk-nope"})
    assert refused.value.status == 401
    with pytest.raises(aiohttp.WSServerHandshakeError):
        await client.ws_connect("/v1/ws")


async def test_socket_close_cancels_in_flight(client: Client, gateway: FakeGateway) -> None:
    gateway.hold_after = 1
    ws = await client.ws_connect("/v1/ws", headers=AUTH)
    await ws.send_json(request(1))
    await ws.receive_json()
    await ws.receive_json()
    await ws.close()
    await eventually(lambda: len(gateway.cancels) == 1)
    assert gateway.cancels[0].reason == "client_disconnect"


def blocked_session(
    edge: Edge, closed: list[int] | None = None
) -> tuple[WsSession, list[str], asyncio.Event]:
    """A demo tenant's socket session whose sends wait until the event is set: a reader that fell behind.
    Returns the session (started), what it sent so far, and the event that lets sends go on; ``closed``
    gets the code of each close of its socket."""
    unblock = asyncio.Event()
    sent: list[str] = []

    async def send(text: str) -> None:
        await unblock.wait()
        sent.append(text)

    async def close_socket(code: WSCloseCode, _reason: bytes) -> None:
        if closed is not None:
            closed.append(code)

    tenant = TenantDirectory.demo().authenticate(f"Bearer {DEMO_KEY}")
    session = WsSession(edge.ctx, tenant, send, close_socket)
    session.start()
    return session, sent, unblock


async def test_a_slow_reader_stops_the_gateway_stream(make_client: MakeClient, gateway: FakeGateway) -> None:
    """With the send blocked, the request reads from the gateway only what fills the bounded queue."""
    _, edge = await make_client(edge_ws_send_queue=4)
    gateway.tokens = 1000
    session, sent, unblock = blocked_session(edge)
    await session.handle_text(msgspec.json.encode(request("slow", {**CHAT, "max_tokens": 16})).decode())
    await eventually(lambda: bool(gateway.submitted))
    rid = gateway.submitted[0].request_id
    # accepted (held by the blocked writer) + 4 queued + 1 blocked in put = 5 token chunks pulled
    await eventually(lambda: gateway.pulled[rid] == 5)
    for _ in range(100):
        await asyncio.sleep(0)
    assert gateway.pulled[rid] == 5
    unblock.set()
    await eventually(lambda: len(sent) == 18)  # accepted, 16 tokens, done
    assert msgspec.json.decode(sent[-1])["type"] == "done"
    await session.close()


async def test_a_socket_closed_while_its_accepted_frames_wait_cancels_every_request(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by an audit: a request's ``accepted`` frame waited for room in the send queue outside the
    request's guard, its concurrency slot held: closing the socket then cancelled the wait, but published no
    cancel and left the reply stream open (1 cancel of 32 requests)."""
    _, edge = await make_client(edge_ws_send_queue=1)
    gateway.tokens = 1000
    session, _, _ = blocked_session(edge)
    for i in range(6):
        await session.handle_text(msgspec.json.encode(request(i, {**CHAT, "max_tokens": 16})).decode())
    await eventually(lambda: len(gateway.submitted) == 6)
    await session.close()
    submitted = {e.request_id for e in gateway.submitted}
    await eventually(
        lambda: {c.request_id for c in gateway.cancels} == submitted
    )  # published in the background
    assert all(stream.closed for stream in gateway.streams)
    assert not edge.ctx.admission.flights


async def test_a_peer_that_takes_no_frame_for_two_heartbeats_is_gone(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by an audit: the waits for room in the send queue had no end. A peer that stopped reading
    (its TCP window full) held the socket's requests and their slots past every deadline, and its reader
    blocked in a reply it could not queue, where a heartbeat's close could not end it either."""
    from ingest.ws import PeerNotReading

    _, edge = await make_client(edge_ws_send_queue=1, edge_heartbeat_s=0.2)
    gateway.tokens = 1000
    session, _, _ = blocked_session(edge)
    for i in range(3):
        await session.handle_text(msgspec.json.encode(request(i, {**CHAT, "max_tokens": 16})).decode())
    await eventually(lambda: len(gateway.submitted) == 3)
    await eventually(lambda: not edge.ctx.admission.flights, within_s=3.0)
    submitted = {e.request_id for e in gateway.submitted}
    await eventually(
        lambda: {c.request_id for c in gateway.cancels} == submitted
    )  # published in the background
    with pytest.raises(PeerNotReading):  # the reader too: what it must answer cannot be queued
        await session.handle_text(msgspec.json.encode({"type": "ping", "id": "p"}).decode())
    await session.close()


async def test_the_send_queue_is_bounded_in_bytes_not_only_frames(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Frames of 2 KB against a 4 KB bound: with the send blocked, only what fits 4 KB is pulled from the
    gateway (by frames alone, 256 of them, the whole 16-chunk stream would be)."""
    _, edge = await make_client(edge_ws_send_queue_bytes=4096)
    gateway.tokens = 16
    gateway.text_size = 2000
    session, sent, unblock = blocked_session(edge)
    await session.handle_text(msgspec.json.encode(request("big", {**CHAT, "max_tokens": 16})).decode())
    await eventually(lambda: bool(gateway.submitted))
    rid = gateway.submitted[0].request_id
    await eventually(lambda: gateway.pulled[rid] >= 2)
    for _ in range(200):
        await asyncio.sleep(0)
    assert gateway.pulled[rid] <= 4  # one in the blocked writer, about two queued, one waiting for room
    unblock.set()
    await eventually(lambda: len(sent) == 18)  # accepted, 16 tokens, done
    await session.close()


async def test_a_tenant_holds_at_most_its_sockets_on_an_edge(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_ws_max_per_tenant=2)
    async with client.ws_connect("/v1/ws", headers=AUTH), client.ws_connect("/v1/ws", headers=AUTH):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect("/v1/ws", headers=AUTH)
        assert refused.value.status == 429
        async with client.ws_connect("/v1/ws", headers=OTHER_AUTH):  # another tenant is not counted
            pass
    async with client.ws_connect("/v1/ws", headers=AUTH):  # closed ones are given back
        pass


async def test_json_nested_too_deep_is_an_error_frame_and_the_socket_stays_open(client: Client) -> None:
    """Found by the fuzz suite: the id lookup of a bad frame hit RecursionError and the socket closed."""
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_str('{"type": "cancel", "x": ' + "[" * 100_000)
        error = await ws.receive_json()
        assert error["type"] == "error"
        assert error["error"]["code"] == "invalid_frame"
        await ws.send_str('{"type": "ping", "id": 1}')
        assert await ws.receive_json() == {"type": "pong", "id": 1}


async def test_a_request_whose_body_is_nested_too_deep_is_an_error_frame_and_its_siblings_go_on(
    client: Client, gateway: FakeGateway
) -> None:
    """Balanced JSON nested ~1000 deep inside a request's body made msgspec's raw capture recurse: the
    RecursionError escaped the receive loop, the socket closed and its other requests were cancelled."""
    gateway.hold_after = 1
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("keep", {**CHAT, "max_tokens": 5}))
        assert (await ws.receive_json())["type"] == "accepted"
        assert (await ws.receive_json())["type"] == "token"
        depth = 1000
        await ws.send_str(
            '{"type": "request", "id": 1, "endpoint": "chat.completions", "body": '
            + "[" * depth
            + "]" * depth
            + "}"
        )
        error = await ws.receive_json(timeout=5)  # its id is as deep to find as the body (msgspec recurses)
        assert (error["type"], error["id"], error["error"]["code"]) == ("error", None, "invalid_frame")
        await ws.send_json({"type": "ping", "id": 2})
        assert await ws.receive_json(timeout=5) == {"type": "pong", "id": 2}
    assert [c.reason for c in gateway.cancels] == ["client_disconnect"], "only when the client left"
    assert len(gateway.submitted) == 1


async def test_an_unexpected_failure_of_one_request_is_an_error_frame_not_silence(
    client: Client, gateway: FakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request frame whose handling raised anything but an IngestError vanished: no accepted, no error
    frame, and a later cancel of its id answered unknown_id."""

    async def broken(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(gateway, "submit", broken)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("x"))
        error = await ws.receive_json(timeout=5)
        assert (error["type"], error["id"], error["error"]["type"]) == ("error", "x", "server_error")
        await ws.send_json({"type": "ping", "id": 1})
        assert await ws.receive_json(timeout=5) == {"type": "pong", "id": 1}


async def test_a_frame_whose_wait_for_room_is_cancelled_gives_its_bytes_back(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by an audit: a frame counted its bytes against the socket's bound before it waited for a place
    in the full queue, and a cancel of that wait (a client cancel, the deadline, the peer not reading) never
    gave them back. The bound shrank for good: a later frame of more than what was left waited for a queue
    that never emptied, and its request got only ``accepted``."""
    _, edge = await make_client(edge_ws_send_queue=2, edge_ws_send_queue_bytes=4096)
    gateway.tokens = 1000
    gateway.text_size = 900  # token frames of ~1 KB: two fill the queue by frames, far from 4 KB
    session, sent, unblock = blocked_session(edge)
    await session.handle_text(msgspec.json.encode(request("slow", {**CHAT, "max_tokens": 16})).decode())
    await eventually(lambda: bool(gateway.submitted))
    rid = gateway.submitted[0].request_id
    # accepted in the blocked writer, t0 and t1 queued, t2 waiting for a place with its bytes counted
    await eventually(lambda: gateway.pulled[rid] == 3)
    for _ in range(100):
        await asyncio.sleep(0)
    cancel = asyncio.create_task(
        session.handle_text(msgspec.json.encode({"type": "cancel", "id": "slow"}).decode())
    )
    await eventually(lambda: len(gateway.cancels) == 1)
    unblock.set()
    await cancel
    await eventually(lambda: len(sent) == 4)  # accepted, t0, t1, done (cancelled)
    assert msgspec.json.decode(sent[-1])["status"] == "cancelled"
    gateway.text_size = 3500  # one token frame of ~3.6 KB: fits 4 KB only if nothing was left counted
    await session.handle_text(msgspec.json.encode(request("big", {**CHAT, "max_tokens": 1})).decode())
    await eventually(lambda: len(sent) == 7)  # accepted, t0, done
    assert [msgspec.json.decode(f)["type"] for f in sent[4:]] == ["accepted", "token", "done"]
    await session.close()


async def test_a_request_whose_frames_wait_two_heartbeats_closes_its_socket(
    make_client: MakeClient, gateway: FakeGateway, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by an audit: a request whose own wait for room ran out (``PeerNotReading``) was taken for a peer
    already gone. It ended with no frame, and its socket stayed open with its other requests held; only the
    reader's wait running out closed it. Here the peer's window is full from the first token frame on
    (the peer reads nothing more but the heartbeat's pings), and the reader has nothing to answer."""
    client, edge = await make_client(edge_ws_send_queue=1, edge_heartbeat_s=1.0)
    send_str = web.WebSocketResponse.send_str

    async def send(self: web.WebSocketResponse, data: str, compress: int | None = None) -> None:
        if '"type":"token"' in data:
            await asyncio.Event().wait()  # never sent: the transport does not drain
        await send_str(self, data, compress)

    monkeypatch.setattr(web.WebSocketResponse, "send_str", send)
    gateway.tokens = 1000
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        gateway.hold_after = 0  # "held" waits for its first token
        await ws.send_json(request("held"))
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        gateway.hold_after = None
        await ws.send_json(request("big", {**CHAT, "max_tokens": 16}))
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        async with asyncio.timeout(5):  # not receive's own: the heartbeat's pings renew it
            closing = await ws.receive()  # once its token frames waited for room two heartbeats (2 s)
    assert (closing.type, closing.data) == (aiohttp.WSMsgType.CLOSE, NOT_READING)
    submitted = {e.request_id for e in gateway.submitted}
    await eventually(lambda: {c.request_id for c in gateway.cancels} == submitted)
    assert {c.reason for c in gateway.cancels} == {"client_disconnect"}
    assert not edge.ctx.admission.flights


async def test_a_peer_not_reading_the_error_frame_of_a_request_closes_its_socket(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """A request whose deadline passed while its frame waited for room, and whose error frame then waited
    two heartbeats too: the ``PeerNotReading`` of that wait escaped the request's task ("Task exception was
    never retrieved") and the socket stayed open."""
    _, edge = await make_client(edge_ws_send_queue=1, edge_heartbeat_s=0.2)
    gateway.tokens = 1000
    closed: list[int] = []
    session, _, _ = blocked_session(edge, closed)
    body = {**CHAT, "max_tokens": 16, "timeout": 0.1}
    await session.handle_text(msgspec.json.encode(request("late", body)).decode())
    task = session._work["late"].task
    (outcome,) = await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), timeout=5)
    assert outcome is None
    assert closed == [NOT_READING]
    await session.close()


async def test_a_page_of_another_site_cannot_open_a_websocket(make_client: MakeClient) -> None:
    """An audit: browsers apply no same-origin rule to WebSockets and send the edge's own Host, so any page a
    developer visited could stream from a local edge with the public demo key. A browser's upgrade says its
    page's Origin; one not allowed (``SLUICE_EDGE_ALLOWED_ORIGINS``, else the allowed hosts) is a 403."""
    client, _ = await make_client()
    for origin in ("https://evil.example", "null", "http://127.0.0.1.evil.example:8080"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await client.ws_connect(f"/v1/ws?api_key={DEMO_KEY}", headers={"Origin": origin})
        assert refused.value.status == 403, origin
    for maybe in (None, "http://localhost:3000", "http://127.0.0.1:8080"):  # no Origin: not a browser
        headers = {"Origin": maybe} if maybe else {}
        ws = await client.ws_connect(f"/v1/ws?api_key={DEMO_KEY}", headers=headers)
        await ws.send_json({"type": "ping", "id": 1})
        assert (await ws.receive_json())["type"] == "pong"
        await ws.close()
    allowed, _ = await make_client(edge_allowed_origins=("app.example.com",))
    ws = await allowed.ws_connect(f"/v1/ws?api_key={DEMO_KEY}", headers={"Origin": "https://app.example.com"})
    await ws.close()
    with pytest.raises(aiohttp.WSServerHandshakeError):
        await allowed.ws_connect(f"/v1/ws?api_key={DEMO_KEY}", headers={"Origin": "http://localhost:3000"})


async def test_a_close_cancelled_while_its_requests_end_still_stops_the_writer(
    make_client: MakeClient,
) -> None:
    """Found by an audit (2026-12-01): a socket dropped at the TCP level mid-stream logged "Task was
    destroyed but it is pending" for the session's writer: the handler was cancelled while ``close`` waited
    for the requests to end, and the writer, never cancelled, was left waiting on a queue nobody held."""
    _, edge = await make_client()
    session, _, _ = blocked_session(edge)
    ending = asyncio.Event()

    async def slow_to_end() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await ending.wait()  # its cancellation takes a while (it publishes its cancel)
            raise

    from ingest.ws import _Work

    session._work["r"] = _Work(task=asyncio.create_task(slow_to_end()))
    await asyncio.sleep(0)
    closing = asyncio.create_task(session.close())
    await asyncio.sleep(0.05)
    closing.cancel()  # the handler's connection is lost meanwhile
    with pytest.raises(asyncio.CancelledError):
        await closing
    assert session._writer is not None
    assert session._writer.done()
    ending.set()


async def test_a_frame_with_a_lone_surrogate_is_named_as_such(client: Client, gateway: FakeGateway) -> None:
    """msgspec calls a lone surrogate escape "Input data was truncated" (an audit: a WebSocket client was
    told its whole frame was cut short)."""
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_str('{"type":"ping","id":"\\ud800"}')
        error = await ws.receive_json(timeout=5)
        assert error["error"]["code"] == "invalid_frame"
        assert "\\ud800, half of a surrogate pair" in error["error"]["message"]
    response = await client.post(
        "/v1/completions",
        data=b'{"model":"%s","prompt":"a\\ud83d"}' % GEN.encode(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    assert response.status == 400
    assert "\\ud83d, half of a surrogate pair" in (await response.json())["error"]["message"]
    assert gateway.submitted == []


async def test_frames_past_the_concurrency_limit_are_refused_before_their_bodies_are_tokenised(
    catalogue: Any, gateway: FakeGateway
) -> None:
    """A WebSocket's requests still being tokenised count against the tenant's ``max_concurrency``: of 6
    frames sent at once, one body is prepared and 5 get an error frame without theirs being read."""
    from aiohttp.test_utils import TestClient, TestServer

    from ingest.auth import Tenant, hash_key
    from tests.ingest.conftest import settings

    edge = Edge(
        settings(),
        gateway,
        catalogue,
        TenantDirectory({"narrow": Tenant(key_sha256=[hash_key(DEMO_KEY)], max_concurrency=1)}),
    )
    original, gate, prepared = edge.ctx.preparer.prepare, asyncio.Event(), []

    async def slow_prepare(*args: Any, **kwargs: Any) -> Any:
        prepared.append(args[0])
        await gate.wait()
        return await original(*args, **kwargs)

    edge.ctx.preparer.prepare = slow_prepare  # type: ignore[method-assign]
    async with TestClient(TestServer(edge.app)) as client, client.ws_connect("/v1/ws", headers=AUTH) as ws:
        for n in range(6):
            await ws.send_json(request(n, {**CHAT, "max_tokens": 1}))
        refused = [await ws.receive_json(timeout=5) for _ in range(5)]
        assert {(f["type"], f["error"]["code"]) for f in refused} == {("error", "concurrency_limit_exceeded")}
        assert len(prepared) == 1
        gate.set()
        served = await frames_until(ws, 1)
        assert [f["type"] for f in served] == ["accepted", "token", "done"]
    await edge.stop()


def _counted(family: Any, **labels: str) -> float:
    return sum(
        float(s.value)
        for metric in family.collect()
        for s in metric.samples
        if s.name.endswith("_total") and all(s.labels[k] == v for k, v in labels.items())
    )


@pytest.mark.parametrize("transport", ["http", "ws"])
async def test_a_request_shed_because_the_log_cannot_take_it_counts_against_availability(
    client: Client, gateway: FakeGateway, transport: str
) -> None:
    """Over the WebSocket, a 503 from admission or from a log that could not take the request was counted
    nowhere, so a WebSocket-only tenant's outage never moved the availability SLI nor paged (a review)."""
    from monitoring import metrics

    gateway.fail_submit = True
    shed = _counted(metrics.REQUESTS, model=GEN, outcome="shed")
    refused = _counted(metrics.REJECTIONS, model=GEN, status="503")
    body = {**CHAT, "stream": True}
    if transport == "http":
        response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
        assert response.status == 503
    else:
        async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
            await ws.send_json(request("a", body))
            (frame,) = await frames_until(ws, 1)
        assert (frame["type"], frame["error"]["type"]) == ("error", "server_error"), frame
    assert _counted(metrics.REQUESTS, model=GEN, outcome="shed") == shed + 1
    assert _counted(metrics.REJECTIONS, model=GEN, status="503") == refused + 1
    assert gateway.submitted == []


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (b'{"type": "ping", "id": "' + b"x" * 8192 + b'"}', WSCloseCode.MESSAGE_TOO_BIG),
        (b'{"type": "ping", "id": "\xff"}', WSCloseCode.INVALID_TEXT),
    ],
    ids=["too-big", "not-utf8"],
)
async def test_a_frame_the_websocket_layer_refuses_closes_the_socket_as_documented(
    make_client: MakeClient, gateway: FakeGateway, frame: bytes, code: WSCloseCode
) -> None:
    """Found by a review: a text frame over the size limit, or not UTF-8, closes the socket (1009, 1007)
    without an ``error`` frame and cancels the requests on it, where the docs promised an ``error`` frame
    and an open socket for every bad frame: a client could not tell it from a dropped connection."""
    client, _ = await make_client(edge_max_body_bytes=4096)
    gateway.hold_after = 1
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("keep"))
        assert [(await ws.receive_json(timeout=5))["type"] for _ in range(2)] == ["accepted", "token"]
        # the client's own API sends only valid text: its writer sends the raw frame
        await ws._writer.send_frame(frame, aiohttp.WSMsgType.TEXT)
        closing = await ws.receive(timeout=5)
    assert (closing.type, closing.data) == (aiohttp.WSMsgType.CLOSE, code)
    await eventually(lambda: [c.reason for c in gateway.cancels] == ["client_disconnect"])
    doc = ingest.ws.__doc__ or ""
    assert f"{int(code)} (" in doc  # the docs say so, and what the limit is
    assert "SLUICE_EDGE_MAX_BODY_BYTES" in doc
