"""A request whose client left, or cancelled it, is charged what it used, not its whole reservation.

A review: its reservation (prompt + ``max_tokens``) was kept for the quota window, since the stream that
settles a reservation at the terminal event was closed before it came; a tenant whose clients cancel long
generations was refused for tokens it never used."""

from __future__ import annotations

import msgspec
import pytest

from ingest.auth import DEMO_KEY, Tenant, TenantDirectory, hash_key
from tests.ingest.conftest import AUTH, GEN, MakeClient, eventually
from tests.ingest.fake_gateway import FakeGateway
from tests.ingest.test_take_over import _used_tokens

MAX_TOKENS = 400
CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hello"}], "max_tokens": MAX_TOKENS}


@pytest.fixture
def tenants() -> TenantDirectory:
    return TenantDirectory({"demo": Tenant(key_sha256=[hash_key(DEMO_KEY)], tokens_per_min=600)})


@pytest.mark.parametrize("how", ["http-disconnect", "ws-cancel", "ws-close"])
async def test_a_request_ended_early_is_charged_what_it_used(
    make_client: MakeClient, gateway: FakeGateway, how: str
) -> None:
    client, edge = await make_client()
    gateway.hold_after = 2  # two tokens, then it waits for its cancel
    if how == "http-disconnect":
        response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
        assert response.status == 200
        await response.content.readuntil(b" t1")
        response.close()
    else:
        async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
            await ws.send_json({"type": "request", "id": "a", "endpoint": "chat.completions", "body": CHAT})
            while msgspec.json.decode(await ws.receive_str(timeout=5)).get("seq") != 1:
                pass
            if how == "ws-cancel":
                await ws.send_json({"type": "cancel", "id": "a"})
                assert msgspec.json.decode(await ws.receive_str(timeout=5))["status"] == "cancelled"
    (request,) = gateway.submitted
    prompt = len(request.input_ids)  # type: ignore[union-attr]
    await eventually(lambda: len(gateway.cancels) == 1)
    await eventually(lambda: _used_tokens(edge) == prompt + 2)
    # The tokens it did not use are the tenant's again: a second such request is admitted.
    gateway.hold_after = None
    again = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert again.status == 200, await again.text()
