"""A resume that takes its request back within the disconnect grace (a WebSocket ``resume`` frame, ``GET
/v1/streams/{id}``) goes on as that request: its cancels name the request's model, and it reads until the
request's own deadline, its embeddings in the encoding its request asked.

Found by a review: the resume's flight (model ``""``) learnt its model only from a reply passing through
it; a cancel before one (a cancel frame, the socket dropping again, a deadline, the edge's shutdown)
published ``CancelRequested(model="")``, which no worker takes (each acts on its own model's cancels
alone). The request ran on to its end, unread and billed, and its place in flight was given back."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from tests.ingest.conftest import AUTH, EMB, GEN, Client, MakeClient, eventually, parse_sse
from tests.ingest.fake_gateway import FakeGateway
from tests.ingest.test_ws import CHAT, frames_until, request

GRACE_S = 30.0  # never runs out within a test


async def left_mid_stream(
    client: Client, gateway: FakeGateway, body: dict[str, Any] = CHAT
) -> tuple[str, str]:
    """A WebSocket request whose client read one token and dropped while its worker is busy (nothing more
    comes for a while: a long step, a queue); its request id and its token's cursor."""
    gateway.hold_after = 1
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("a", {**body, "max_tokens": 8}))
        accepted = await ws.receive_json(timeout=5)
        token = await ws.receive_json(timeout=5)
    await eventually(lambda: all(stream.closed for stream in gateway.streams))
    assert gateway.cancels == []  # within the grace: it runs on, its cancel delayed
    return accepted["request_id"], token["cursor"]


async def test_a_cancel_frame_after_a_resume_names_the_requests_model(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid, cursor = await left_mid_stream(client, gateway)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": "r", "request_id": rid, "after": cursor})
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        await ws.send_json({"type": "cancel", "id": "r"})
        done = await ws.receive_json(timeout=5)
        assert (done["type"], done["status"]) == ("done", "cancelled")
    await eventually(lambda: len(gateway.cancels) == 1)
    (cancel,) = gateway.cancels
    assert (cancel.request_id, cancel.reason, cancel.model) == (rid, "client_cancel", GEN)


async def test_a_resumed_socket_dropped_again_names_the_requests_model(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid, cursor = await left_mid_stream(client, gateway)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": "r", "request_id": rid, "after": cursor})
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
    await eventually(lambda: not edge.ctx.admission.flights)
    await edge.ctx.dispatcher.drain()  # the grace ends: the delayed cancel goes out
    (cancel,) = gateway.cancels
    assert (cancel.request_id, cancel.reason, cancel.model) == (rid, "client_disconnect", GEN)


async def test_a_stream_read_dropped_again_names_the_requests_model(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid, cursor = await left_mid_stream(client, gateway)
    response = await client.get(f"/v1/streams/{rid}", headers={**AUTH, "Last-Event-ID": f"{rid}:{cursor}"})
    assert response.status == 200
    response.close()  # the reader drops again before the next token
    await eventually(lambda: not edge.ctx.admission.flights)
    await edge.ctx.dispatcher.drain()
    (cancel,) = gateway.cancels
    assert (cancel.request_id, cancel.reason, cancel.model) == (rid, "client_disconnect", GEN)


# Its deadline. Found by the same review: a WebSocket resume read for the edge's default deadline whatever
# the request's own was, and its frame could ask for no other; a resume that had taken its request back
# also cancelled it there, its client still reading.

SHORT_S = 0.1  # stands for the 60 s default
QUIET_S = 0.5  # several defaults: long enough for a resume cut at the default to have said so


async def test_a_websocket_resume_taking_the_request_back_reads_to_its_own_deadline(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S, edge_default_timeout_s=SHORT_S)
    rid, cursor = await left_mid_stream(client, gateway, {**CHAT, "timeout": 30})
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": "r", "request_id": rid, "after": cursor})
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        with pytest.raises(TimeoutError):  # not cut at the default
            await ws.receive_json(timeout=QUIET_S)
        gateway.release.set()
        frames = await frames_until(ws, 1)
    assert frames[-1]["type"] == "done"
    assert gateway.cancels == []


async def test_a_stream_read_taking_the_request_back_reads_to_its_own_deadline(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S, edge_default_timeout_s=SHORT_S)
    rid, cursor = await left_mid_stream(client, gateway, {**CHAT, "timeout": 30})
    response = await client.get(f"/v1/streams/{rid}", headers={**AUTH, "Last-Event-ID": f"{rid}:{cursor}"})
    assert response.status == 200
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(QUIET_S):
            await response.content.readuntil(b"\n\n")
    gateway.release.set()
    assert b'"type":"error"' not in await response.read()
    assert gateway.cancels == []


async def test_a_resume_taking_the_request_back_ends_it_at_its_own_deadline(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Passing the request's own deadline (not a reader's) cancels it at once, as it does its submitter."""
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid, cursor = await left_mid_stream(client, gateway, {**CHAT, "timeout": QUIET_S})
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        resume = {"type": "resume", "id": "r", "request_id": rid, "after": cursor, "timeout": 30}
        await ws.send_json(resume)
        frames = await frames_until(ws, 1)
    assert (frames[-1]["type"], frames[-1]["error"]["code"]) == ("error", "timeout")
    await eventually(lambda: len(gateway.cancels) == 1)  # not delayed by the grace
    assert [(c.request_id, c.reason, c.model) for c in gateway.cancels] == [(rid, "client_cancel", GEN)]


async def test_a_websocket_resume_reads_for_its_frames_timeout(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """A resume that does not own the request (its client is still connected) reads for the default, or
    for the ``timeout`` its frame asks."""
    client, _ = await make_client(edge_default_timeout_s=SHORT_S)
    gateway.hold_after = 1
    async with (
        client.ws_connect("/v1/ws", headers=AUTH) as first,
        client.ws_connect("/v1/ws", headers=AUTH) as second,
    ):
        await first.send_json(request("a", {**CHAT, "timeout": 30}))
        rid = (await first.receive_json(timeout=5))["request_id"]
        cursor = (await first.receive_json(timeout=5))["cursor"]
        plain = {"type": "resume", "id": "r1", "request_id": rid, "after": cursor}
        await second.send_json(plain)
        frames = await frames_until(second, 1)
        assert (frames[-1]["type"], frames[-1]["error"]["code"]) == ("error", "timeout")
        await second.send_json({**plain, "id": "r2", "timeout": 30})
        assert (await second.receive_json(timeout=5))["type"] == "accepted"
        with pytest.raises(TimeoutError):
            await second.receive_json(timeout=QUIET_S)
        gateway.release.set()
        assert (await frames_until(second, 1))[-1]["type"] == "done"
    assert gateway.cancels == []


# Its replies' encoding. Found by the same review: an embeddings request asked in base64 (as OpenAI's SDKs
# ask by default) came back, resumed, as float lists: a client's parser for the first answer broke on it.

BASE64 = {"model": EMB, "input": "fox", "encoding_format": "base64"}


async def embeddings_left(client: Client, gateway: FakeGateway) -> str:
    """A base64 embeddings request over the WebSocket whose client dropped before its end; its request id."""
    gateway.hold_embeddings = True
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json(request("e", BASE64, "embeddings"))
        accepted = await ws.receive_json(timeout=5)
    await eventually(lambda: all(stream.closed for stream in gateway.streams))
    return str(accepted["request_id"])


async def test_a_websocket_resume_taking_an_embeddings_request_back_keeps_its_encoding(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await embeddings_left(client, gateway)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": "r", "request_id": rid})
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        gateway.release.set()
        done = (await frames_until(ws, 1))[-1]
        assert isinstance(done["result"]["data"][0]["embedding"], str)  # base64, as the request asked
        # once it has ended, a resume no longer knows how it was asked for: float lists, as documented
        await ws.send_json({"type": "resume", "id": "again", "request_id": rid})
        again = (await frames_until(ws, 1))[-1]
    assert again["result"]["data"][0]["embedding"] == [3.0, 14.0, 0.0]


async def test_a_stream_read_taking_an_embeddings_request_back_keeps_its_encoding(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await embeddings_left(client, gateway)
    response = await client.get(f"/v1/streams/{rid}", headers=AUTH)
    assert response.status == 200
    gateway.release.set()
    (done,) = [data for _, data in parse_sse(await response.text()) if data != "[DONE]"]
    assert isinstance(msgspec.json.decode(done)["result"]["data"][0]["embedding"], str)


# Found by the same review, left open then: once a request has ended (or from another edge), a resume
# knows nothing of how its request asked for the vectors, and gave a base64 client float lists. The
# reader names its own encoding (a frame's or the query's ``encoding_format``), which wins in either case.


async def test_a_websocket_resume_after_the_end_takes_the_encoding_its_frame_names(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await embeddings_left(client, gateway)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": "r", "request_id": rid})  # takes it back: base64
        assert (await ws.receive_json(timeout=5))["type"] == "accepted"
        gateway.release.set()
        assert isinstance((await frames_until(ws, 1))[-1]["result"]["data"][0]["embedding"], str)
        await ws.send_json({"type": "resume", "id": "b", "request_id": rid, "encoding_format": "base64"})
        done = (await frames_until(ws, 1))[-1]
        assert done["result"]["data"][0]["embedding"] == "AABAQAAAYEEAAAAA"  # [3, 14, 0] as float32
        await ws.send_json({"type": "resume", "id": "f", "request_id": rid, "encoding_format": "float"})
        assert (await frames_until(ws, 1))[-1]["result"]["data"][0]["embedding"] == [3.0, 14.0, 0.0]
        await ws.send_json({"type": "resume", "id": "x", "request_id": rid, "encoding_format": "int8"})
        refused = await ws.receive_json(timeout=5)
    assert (refused["type"], refused["error"]["type"]) == ("error", "invalid_request_error")


async def test_a_stream_read_takes_the_encoding_its_query_names(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await embeddings_left(client, gateway)
    response = await client.get(f"/v1/streams/{rid}?encoding_format=float", headers=AUTH)
    assert response.status == 200
    gateway.release.set()
    (done,) = [data for _, data in parse_sse(await response.text()) if data != "[DONE]"]
    assert msgspec.json.decode(done)["result"]["data"][0]["embedding"] == [3.0, 14.0, 0.0]  # the query wins
    response = await client.get(f"/v1/streams/{rid}?encoding_format=base64", headers=AUTH)
    (done,) = [data for _, data in parse_sse(await response.text()) if data != "[DONE]"]
    assert msgspec.json.decode(done)["result"]["data"][0]["embedding"] == "AABAQAAAYEEAAAAA"
    refused = await client.get(f"/v1/streams/{rid}?encoding_format=int8", headers=AUTH)
    assert refused.status == 400
    assert (await refused.json())["error"]["param"] == "encoding_format"
