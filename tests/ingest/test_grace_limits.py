"""A request whose client left runs on for the disconnect grace: it keeps its place under the tenant's
``max_concurrency`` until its cancel goes out, and a client coming back for it takes that place over.

Found by an audit: the place was given back as the client left, so with a grace a client that opened
streams and closed them at once had any number running past its limit."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from ingest.auth import DEMO_KEY, Tenant, TenantDirectory, hash_key
from ingest.models import ModelCatalogue
from schemas.manifest import current_model_dir, read_manifest, write_manifest
from tests.ingest.conftest import AUTH, EMB, GEN, Client, MakeClient, eventually, parse_sse
from tests.ingest.fake_gateway import FakeGateway

CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hello"}], "stream": True}
GRACE_S = 30.0  # never runs out within a test; each ends by the edge's shutdown sending the cancel
OTHER_GEN = "tiny-gpt-b"
"""A second generation model, for a resume whose body names another model than its stream's."""


@pytest.fixture
def catalogue(model_cache: Path, tmp_path: Path) -> ModelCatalogue:
    other = tmp_path / OTHER_GEN
    other.mkdir()
    gen = current_model_dir(model_cache, GEN)
    manifest = msgspec.structs.replace(read_manifest(gen), model_id=OTHER_GEN, version="bbbbbbbbbbbb")
    (other / "tokenizer.json").write_bytes((gen / "tokenizer.json").read_bytes())
    write_manifest(other, manifest)
    return ModelCatalogue.from_cache(model_cache, [GEN, EMB], [f"{OTHER_GEN}={other}"])


@pytest.fixture
def tenants() -> TenantDirectory:
    return TenantDirectory(
        {"demo": Tenant(key_sha256=[hash_key(DEMO_KEY)], allow_ignore_eos=True, max_concurrency=1)}
    )


async def left_after_a_token(client: Client, gateway: FakeGateway, headers: dict[str, str]) -> str:
    """A streamed chat whose client read a token and left; its request id."""
    response = await client.post("/v1/chat/completions", json=CHAT, headers=headers)
    assert response.status == 200
    await response.content.readuntil(b" t1")
    response.close()
    await eventually(lambda: all(stream.closed for stream in gateway.streams))
    return gateway.submitted[-1].request_id


async def refused(client: Client) -> bool:
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": False}, headers=AUTH)
    if response.status == 429:
        assert (await response.json())["error"]["code"] == "concurrency_limit_exceeded"
        return True
    assert response.status == 200
    return False


async def test_a_request_running_on_after_its_client_left_keeps_its_place(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    await left_after_a_token(client, gateway, AUTH)
    assert gateway.cancels == []  # it runs on, within the grace
    assert await refused(client)  # ... in the tenant's one place
    await edge.ctx.dispatcher.drain()  # the delayed cancel goes out now: the place is free
    assert [c.reason for c in gateway.cancels] == ["client_disconnect"]
    gateway.hold_after = None
    assert not await refused(client)


@pytest.mark.parametrize("how", ["last_event_id", "stream_get"])
async def test_a_client_coming_back_takes_its_place_over(
    make_client: MakeClient, gateway: FakeGateway, how: str
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    rid = await left_after_a_token(client, gateway, AUTH)
    resume = {**AUTH, "Last-Event-ID": f"{rid}:1"}
    if how == "last_event_id":
        response = await client.post("/v1/chat/completions", json=CHAT, headers=resume)
    else:
        response = await client.get(f"/v1/streams/{rid}", headers=resume)
    assert response.status == 200  # not 429: the place it held is its own
    gateway.release.set()
    events = parse_sse(await response.text())
    assert events[-1][1] == "[DONE]"
    assert gateway.cancels == []  # taken back: no cancel, and its place free once it ended
    assert not await refused(client)


async def test_a_retry_with_the_idempotency_key_takes_its_place_over(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    keyed = {**AUTH, "Idempotency-Key": "order-7"}
    rid = await left_after_a_token(client, gateway, keyed)
    retry = await client.post("/v1/chat/completions", json=CHAT, headers=keyed)
    assert retry.status == 200
    assert retry.headers["x-request-id"] == rid
    gateway.release.set()
    assert parse_sse(await retry.text())[-1][1] == "[DONE]"
    assert len(gateway.submitted) == 1
    assert gateway.cancels == []
    assert not await refused(client)


async def test_a_resume_whose_own_deadline_passes_leaves_the_request_as_a_disconnect_does(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by an audit: a request taken back within the grace by a resume was cancelled at once when the
    resume's deadline passed (the 60 s default of a resume, whatever the request's own deadline was)."""
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    rid = await left_after_a_token(client, gateway, AUTH)
    resume = {**AUTH, "Last-Event-ID": f"{rid}:1", "X-Request-Timeout": "0.2"}
    response = await client.post("/v1/chat/completions", json=CHAT, headers=resume)
    events = parse_sse(await response.text())
    assert "timeout" in events[-2][1]  # the reader's deadline: an error event, then [DONE]
    assert gateway.cancels == []  # the request runs on through the grace, as after a disconnect
    await edge.ctx.dispatcher.drain()
    assert [(c.request_id, c.reason) for c in gateway.cancels] == [(rid, "client_disconnect")]


async def test_a_resume_refused_for_its_cursor_leaves_the_place_held(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by review: a WebSocket resume of a held request took its place over, then was refused for a
    malformed ``after`` (400): the request ran on, its cancel still delayed, in no place, and the tenant
    got another request past its ``max_concurrency``."""
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    rid = await left_after_a_token(client, gateway, AUTH)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_json({"type": "resume", "id": 1, "request_id": rid, "after": "not-a-cursor"})
        frame = await ws.receive_json(timeout=5)
        assert (frame["type"], frame["error"]["param"]) == ("error", "after")
    assert gateway.cancels == []
    assert await refused(client)  # still the held request's place
    await edge.ctx.dispatcher.drain()
    assert [(c.request_id, c.reason) for c in gateway.cancels] == [(rid, "client_disconnect")]
    gateway.hold_after = None
    assert not await refused(client)


async def test_a_retry_with_the_key_and_another_body_leaves_the_place_held(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by review, as above: the 422 for a key reused with another body came after its flight took
    the held request's place over by the key."""
    client, _ = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    keyed = {**AUTH, "Idempotency-Key": "order-8"}
    await left_after_a_token(client, gateway, keyed)
    other = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=keyed)
    assert other.status == 422
    assert (await other.json())["error"]["code"] == "idempotency_key_reused"
    assert await refused(client)


async def test_a_resume_naming_another_model_leaves_the_request_as_it_found_it(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by review: a resume whose body named another model took the held request back (its delayed
    cancel dropped) before its replies showed the mismatch (404 ``stream_not_found``); no cancel was ever
    sent, the request ran to its end unread, and its place was free for another past the limit."""
    client, edge = await make_client(edge_disconnect_grace_s=GRACE_S)
    gateway.hold_after = 2
    rid = await left_after_a_token(client, gateway, AUTH)
    resume = {**AUTH, "Last-Event-ID": f"{rid}:0"}
    response = await client.post("/v1/chat/completions", json={**CHAT, "model": OTHER_GEN}, headers=resume)
    assert "stream_not_found" in await response.text()
    assert await refused(client)  # the request still holds its place
    await edge.ctx.dispatcher.drain()
    assert [(c.request_id, c.reason) for c in gateway.cancels] == [(rid, "client_disconnect")]
