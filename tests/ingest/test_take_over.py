"""A client coming back for its request within the disconnect grace (a WebSocket ``resume``, ``GET
/v1/streams/{id}``, an ``Idempotency-Key`` retry) takes over the place the request held: the same
reservation, under the keys it was admitted with, counted once.

Found by a review: the flight taking over was admitted afresh. A resume names no model, so the request's
place under its model's ``max_concurrency`` was given back and a second request on the model was admitted
past the limit; a keyed retry reserved the request's tokens a second time, never settled."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from ingest.auth import DEMO_KEY, Tenant, TenantDirectory, hash_key
from ingest.quota import Limits
from schemas.events import RequestFinished
from tests.ingest.conftest import AUTH, GEN, Client, MakeClient, parse_sse
from tests.ingest.fake_gateway import FakeGateway
from tests.ingest.test_grace_limits import left_after_a_token as left

CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hello"}], "stream": True}
KEYED = {**AUTH, "Idempotency-Key": "order-1"}
GRACE_S = 30.0  # never runs out within a test


@pytest.fixture
def tenants() -> TenantDirectory:
    demo = Tenant(
        key_sha256=[hash_key(DEMO_KEY)], tokens_per_min=10_000, model_limits={GEN: Limits(max_concurrency=1)}
    )
    return TenantDirectory({"demo": demo})


async def left_after_a_token(client: Client, gateway: FakeGateway, headers: dict[str, str] = AUTH) -> str:
    """A streamed chat whose client read a token and left while its request runs on; its request id."""
    gateway.hold_after = 2
    return await left(client, gateway, headers)


async def second_status(client: Client) -> int:
    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    response.close()
    return response.status


async def test_a_held_request_keeps_its_place_under_its_models_limit(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    await left_after_a_token(client, gateway)
    assert await second_status(client) == 429


async def test_a_websocket_resume_taking_the_request_back_keeps_its_models_place(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await left_after_a_token(client, gateway)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": 1, "request_id": rid, "after": "2.6"})
        frame = msgspec.json.decode(await ws.receive_str(timeout=5))
        assert frame["type"] == "accepted"  # taken back: its cancel dropped, it runs on for this socket
        assert await second_status(client) == 429


async def test_a_stream_read_taking_the_request_back_keeps_its_models_place(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await left_after_a_token(client, gateway)
    resume = await client.get(f"/v1/streams/{rid}", headers={**AUTH, "Last-Event-ID": f"{rid}:2.6"})
    assert resume.status == 200
    assert await second_status(client) == 429
    resume.close()


def _used_tokens(edge: Any) -> int:
    return int(edge.ctx.admission.ledger.used(("demo", "*"))[1])


def _actual(gateway: FakeGateway, rid: str) -> int:
    end = gateway.log(rid)[-1]
    assert isinstance(end, RequestFinished)
    assert end.status == "completed"
    return end.usage.total_tokens


async def test_a_keyed_retry_taking_the_request_back_is_charged_once(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    rid = await left_after_a_token(client, gateway, KEYED)
    retry = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    gateway.release.set()
    assert parse_sse(await retry.text())[-1][1] == "[DONE]"
    assert [e.request_id for e in gateway.submitted] == [rid]  # one request, taken back
    assert gateway.cancels == []
    assert _used_tokens(edge) == _actual(gateway, rid)  # settled to what it used, once

    replay = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)  # after its end: a replay
    assert parse_sse(await replay.text())[-1][1] == "[DONE]"
    assert _used_tokens(edge) == _actual(gateway, rid)  # refunded: nothing generated for it


async def test_a_keyed_retry_refused_takes_nothing_from_the_requests_reservation(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """A retry with the key and another body (422) took the held place over, then was refunded: the
    refund must not take back what the request running on had reserved (it is not the retry's own)."""
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    await left_after_a_token(client, gateway, KEYED)
    before = edge.ctx.admission.ledger.used(("demo", "*"))
    other = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=KEYED)
    assert other.status == 422
    assert edge.ctx.admission.ledger.used(("demo", "*")) == before
    assert await second_status(client) == 429  # the request still holds its place under the model's limit
