"""A resume that takes its request back within the disconnect grace (a WebSocket ``resume`` frame, ``GET
/v1/streams/{id}``) goes on as that request: its cancels name the request's model.

Found by a review: the resume's flight (model ``""``) learnt its model only from a reply passing through
it; a cancel before one (a cancel frame, the socket dropping again, a deadline, the edge's shutdown)
published ``CancelRequested(model="")``, which no worker takes (each acts on its own model's cancels
alone). The request ran on to its end, unread and billed, and its place in flight was given back."""

from __future__ import annotations

from typing import Any

from tests.ingest.conftest import AUTH, GEN, Client, MakeClient, eventually
from tests.ingest.fake_gateway import FakeGateway
from tests.ingest.test_ws import CHAT, request

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
