"""Idempotency keys and stream resumption: replays come from the log, never from a second submit."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
from prometheus_client import REGISTRY

from ingest.gateway import IdempotencyRecord
from ingest.prepare import body_hash
from ingest.reply_stream import WHOLE, After
from schemas.events import ErrorInfo
from schemas.ids import uuid7
from tests.ingest.conftest import AUTH, EMB, GEN, OTHER_AUTH, Client, MakeClient, eventually, parse_sse
from tests.ingest.fake_gateway import FakeGateway, FakeStream

CHAT = {"model": GEN, "messages": [{"role": "user", "content": "hello"}]}
KEYED = {**AUTH, "Idempotency-Key": "order-42"}


async def dropped_after_a_token(
    make_client: MakeClient, gateway: FakeGateway, grace_s: float, headers: dict[str, str]
) -> Client:
    """An edge with a disconnect grace of ``grace_s`` and a streamed chat whose client read a token and left
    (the generation held after two tokens)."""
    client, _ = await make_client(edge_disconnect_grace_s=grace_s)
    gateway.hold_after = 2
    first = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=headers)
    await first.content.readuntil(b" t1")
    first.close()
    await eventually(lambda: gateway.streams[0].closed)
    return client


async def test_same_key_same_body_replays_the_same_result(client: Client, gateway: FakeGateway) -> None:
    first = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    # the same body written differently (key order, spacing) is the same body
    same = msgspec.json.encode({"messages": CHAT["messages"], "model": GEN})
    second = await client.post("/v1/chat/completions", data=same, headers=KEYED)
    assert first.status == second.status == 200
    assert await first.json() == await second.json()
    (event,) = gateway.submitted
    assert event.idempotency_key == "order-42"
    assert gateway.resumes == [("demo", event.request_id, WHOLE)]
    assert second.headers["x-request-id"] == event.request_id


async def test_replay_of_a_stream_is_the_whole_stream(client: Client, gateway: FakeGateway) -> None:
    body = {**CHAT, "stream": True}
    first = await (await client.post("/v1/chat/completions", json=body, headers=KEYED)).text()
    second = await (await client.post("/v1/chat/completions", json=body, headers=KEYED)).text()
    assert first == second
    assert len(gateway.submitted) == 1


async def test_same_key_other_body_is_422(client: Client, gateway: FakeGateway) -> None:
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)).status == 200
    other = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1}, headers=KEYED)
    assert other.status == 422
    assert (await other.json())["error"]["code"] == "idempotency_key_reused"
    elsewhere = await client.post("/v1/completions", json={"model": GEN, "prompt": "hello"}, headers=KEYED)
    assert elsewhere.status == 422  # the endpoint is part of what the key covers
    assert len(gateway.submitted) == 1


async def test_keys_are_per_tenant(client: Client, gateway: FakeGateway) -> None:
    await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    await client.post(
        "/v1/chat/completions", json=CHAT, headers={**OTHER_AUTH, "Idempotency-Key": "order-42"}
    )
    assert [e.tenant for e in gateway.submitted] == ["demo", "other"]


async def test_losing_the_race_is_served_from_the_winner(client: Client, gateway: FakeGateway) -> None:
    winner = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    winner_id = winner.headers["x-request-id"]
    gateway.race_record = IdempotencyRecord(
        request_id=winner_id, body_hash=body_hash("chat", msgspec.json.encode(CHAT))
    )
    loser = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    assert loser.status == 200
    assert loser.headers["x-request-id"] == winner_id
    assert await loser.json() == await winner.json()
    assert len(gateway.submitted) == 1


async def test_a_key_whose_request_cannot_be_read_is_409(client: Client, gateway: FakeGateway) -> None:
    digest = body_hash("chat", msgspec.json.encode(CHAT))
    gateway.idempotency[("demo", "order-42")] = IdempotencyRecord(request_id=uuid7(), body_hash=digest)
    response = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    assert response.status == 409
    assert response.headers["x-should-retry"] == "true"
    assert gateway.submitted == []


async def test_last_event_id_resumes_after_that_event(client: Client, gateway: FakeGateway) -> None:
    """An event's id is where the stream stands after it (``<tokens>.<chars>``), not its chunk's ``seq``,
    which a request re-run after its worker died numbers from 0 again."""
    body = {**CHAT, "stream": True}
    full = parse_sse(await (await client.post("/v1/chat/completions", json=body, headers=AUTH)).text())
    rid = gateway.submitted[0].request_id
    ids = [eid for eid, _ in full if eid is not None]
    texts = [json.loads(data)["choices"][0]["delta"]["content"] for eid, data in full if eid is not None]
    assert ids == [f"{rid}:{n + 1}.{len(''.join(texts[: n + 1]))}" for n in range(len(ids))], (
        "one token a chunk here"
    )
    resumed = await client.post("/v1/chat/completions", json=body, headers={**AUTH, "Last-Event-ID": ids[2]})
    assert resumed.status == 200
    events = parse_sse(await resumed.text())
    assert [eid for eid, _ in events] == [*ids[3:], None, None]
    assert events == full[4:]  # chunks 3, 4, the finish chunk and [DONE]; no role chunk again
    assert len(gateway.submitted) == 1
    tokens, chars = ids[2].split(":")[1].split(".")
    assert gateway.resumes == [("demo", rid, After(int(tokens), int(chars)))]
    older = await client.post(  # an id an older edge gave: the chunk's seq
        "/v1/chat/completions", json=body, headers={**AUTH, "Last-Event-ID": f"{rid}:2"}
    )
    assert parse_sse(await older.text()) == full[4:]
    for bad in (f"{rid}:1.", f"{rid}:.5", f"{rid}:1.2.3", f"{rid}:-2", f"{rid}:x"):
        refused = await client.post("/v1/chat/completions", json=body, headers={**AUTH, "Last-Event-ID": bad})
        assert refused.status == 400, bad


async def test_a_resume_of_a_stream_admitted_before_the_budget_ran_out_is_served(
    client: Client, gateway: FakeGateway
) -> None:
    """Found by an audit: a reconnect with Last-Event-ID was refused 402 once the budget ran out, and the
    client lost a stream it had been admitted for (a WebSocket resume of the same stream was served). New
    work is still refused."""
    body = {**CHAT, "stream": True}
    await (await client.post("/v1/chat/completions", json=body, headers=AUTH)).text()
    rid = gateway.submitted[0].request_id
    gateway.exhausted.add("demo")
    resumed = await client.post(
        "/v1/chat/completions", json=body, headers={**AUTH, "Last-Event-ID": f"{rid}:2"}
    )
    assert resumed.status == 200
    assert len(parse_sse(await resumed.text())) == 4
    fresh = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert fresh.status == 402


async def test_resume_is_per_tenant(client: Client, gateway: FakeGateway) -> None:
    await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    rid = gateway.submitted[0].request_id
    stolen = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": True},
        headers={**OTHER_AUTH, "Last-Event-ID": f"{rid}:-1"},
    )
    assert stolen.status == 404
    assert (await stolen.json())["error"]["code"] == "stream_not_found"
    assert (await client.get(f"/v1/streams/{rid}", headers=OTHER_AUTH)).status == 404
    unknown = await client.get(f"/v1/streams/{uuid7()}", headers=AUTH)
    assert unknown.status == 404
    assert len(gateway.submitted) == 1


async def test_get_stream_replays_native_frames(client: Client, gateway: FakeGateway) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3, "stream": True}, headers=AUTH)
    rid = gateway.submitted[0].request_id
    response = await client.get(f"/v1/streams/{rid}", headers={**AUTH, "Last-Event-ID": f"{rid}:1.3"})
    events = parse_sse(await response.text())
    frames = [msgspec.json.decode(d) for _, d in events[:-1]]
    assert [f["type"] for f in frames] == ["token", "token", "done"]
    assert [f.get("seq") for f in frames] == [1, 2, None]
    assert [eid for eid, _ in events] == [f"{rid}:2.6", f"{rid}:3.9", None, None]
    assert [f.get("cursor") for f in frames] == ["2.6", "3.9", None]
    assert frames[-1]["finish_reason"] == "length"
    assert frames[-1]["usage"]["completion_tokens"] == 3
    mismatched = await client.get(f"/v1/streams/{rid}", headers={**AUTH, "Last-Event-ID": f"{uuid7()}:0"})
    assert mismatched.status == 400


async def test_a_replay_of_a_request_not_streamed_has_its_text_in_the_done_frame(
    client: Client, gateway: FakeGateway
) -> None:
    """Found by an audit: such a request's worker sends no token (its text is in the terminal event
    alone), and the ``done`` frame had no text: ``GET /v1/streams/{id}`` replayed it without its answer."""
    answer = await (
        await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=AUTH)
    ).json()
    rid = gateway.submitted[0].request_id
    events = parse_sse(await (await client.get(f"/v1/streams/{rid}", headers=AUTH)).text())
    frames = [msgspec.json.decode(d) for _, d in events[:-1]]
    assert [f["type"] for f in frames] == ["done"]
    assert frames[0]["text"] == answer["choices"][0]["message"]["content"] == " t0 t1 t2"
    streamed = await client.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 2, "stream": True}, headers=AUTH
    )
    await streamed.text()
    rid = gateway.submitted[1].request_id
    events = parse_sse(await (await client.get(f"/v1/streams/{rid}", headers=AUTH)).text())
    frames = [msgspec.json.decode(d) for _, d in events[:-1]]
    assert [f["type"] for f in frames] == ["token", "token", "done"]
    assert "text" not in frames[-1]  # its tokens carried it


async def test_a_stream_resumed_from_a_request_not_streamed_carries_its_text(
    client: Client, gateway: FakeGateway
) -> None:
    """Found by a review: such a request's answer is on the log as its terminal event's text alone; resumed
    through its endpoint as a stream it ended "completed" with no content."""
    body = {**CHAT, "max_tokens": 3}
    answer = await (await client.post("/v1/chat/completions", json=body, headers=AUTH)).json()
    rid = gateway.submitted[0].request_id
    for at, text in (("0.0", " t0 t1 t2"), ("1.3", " t1 t2"), ("3.9", "")):
        resumed = await client.post(
            "/v1/chat/completions",
            json={**body, "stream": True},
            headers={**AUTH, "Last-Event-ID": f"{rid}:{at}"},
        )
        events = [msgspec.json.decode(d) for _, d in parse_sse(await resumed.text()) if d != "[DONE]"]
        got = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        assert got == text
    assert answer["choices"][0]["message"]["content"] == " t0 t1 t2"
    assert len(gateway.submitted) == 1


async def test_reconnect_within_the_grace_keeps_the_generation(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client = await dropped_after_a_token(make_client, gateway, 30.0, AUTH)
    body = {**CHAT, "stream": True}
    rid = gateway.submitted[0].request_id
    resumed = await client.post(
        "/v1/chat/completions", json=body, headers={**AUTH, "Last-Event-ID": f"{rid}:2.6"}
    )
    gateway.release.set()
    events = parse_sse(await resumed.text())
    assert [eid for eid, _ in events][:3] == [f"{rid}:3.9", f"{rid}:4.12", f"{rid}:5.15"]
    assert events[-1][1] == "[DONE]"
    assert gateway.cancels == []
    assert len(gateway.submitted) == 1


async def test_last_event_id_on_a_json_request_returns_the_whole_body(
    client: Client, gateway: FakeGateway
) -> None:
    first = await (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).json()
    rid = gateway.submitted[0].request_id
    again = await client.post(
        "/v1/chat/completions", json=CHAT, headers={**AUTH, "Last-Event-ID": f"{rid}:3"}
    )
    assert await again.json() == first
    assert len(gateway.submitted) == 1


async def test_the_edge_rechecks_the_tenant_of_resumed_replies(client: Client, gateway: FakeGateway) -> None:
    """Even if a gateway hands out another tenant's stream, the edge does not forward it."""
    await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    rid = gateway.submitted[0].request_id
    original = gateway.resume

    async def careless(tenant: str, request_id: str, after: After) -> FakeStream | None:
        return await original("demo", request_id, after)

    gateway.resume = careless  # type: ignore[method-assign]
    stolen = await client.post(
        "/v1/chat/completions", json=CHAT, headers={**OTHER_AUTH, "Last-Event-ID": f"{rid}:-1"}
    )
    assert stolen.status == 404
    assert (await stolen.json())["error"]["code"] == "stream_not_found"


@pytest.mark.parametrize("stream", [False, True])
async def test_a_resume_through_another_endpoint_or_model_finds_no_stream(
    client: Client, gateway: FakeGateway, stream: bool
) -> None:
    """Found by a fuzz audit: a chat body resuming an embedding's request got it rendered as an empty chat
    completion (200); so did a completions body resuming a chat."""
    await client.post("/v1/embeddings", json={"model": EMB, "input": "a river"}, headers=AUTH)
    await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    embedding, chat = (event.request_id for event in gateway.submitted)
    completion = {"model": GEN, "prompt": "hello", "stream": stream}
    for path, body, rid in (
        ("/v1/chat/completions", {**CHAT, "stream": stream}, embedding),
        ("/v1/completions", completion, chat),
    ):
        resumed = await client.post(path, json=body, headers={**AUTH, "Last-Event-ID": f"{rid}:-1"})
        text = await resumed.text()
        if stream:  # the stream was open before the first reply was seen: its error ends it
            assert resumed.status == 200
            assert '"code":"stream_not_found"' in text
            assert '"content":"' not in text.replace('"content":""', "")  # no text of another's stream
        else:
            assert resumed.status == 404, text
            assert (await resumed.json())["error"]["code"] == "stream_not_found"
    same = await client.post(
        "/v1/chat/completions",
        json={**CHAT, "stream": stream},
        headers={**AUTH, "Last-Event-ID": f"{chat}:-1"},
    )
    assert same.status == 200
    assert "stream_not_found" not in await same.text()
    assert len(gateway.submitted) == 2


async def test_a_keyed_retry_within_the_grace_takes_the_request_back_as_a_resume_does(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """A client whose connection dropped retries with its Idempotency-Key: the replay used to leave the
    disconnect's delayed cancel pending, so the request was cancelled under the retry that was reading it."""
    # the retry must reach the edge within the grace: 0.5 s of it lost that race to a loaded box's stall
    grace_s = 3.0
    client = await dropped_after_a_token(make_client, gateway, grace_s, KEYED)
    body = {**CHAT, "stream": True}
    retry = asyncio.create_task(client.post("/v1/chat/completions", json=body, headers=KEYED))
    await asyncio.sleep(grace_s + 0.5)  # past the grace, while the retry reads the replay
    gateway.release.set()
    events = parse_sse(await (await retry).text())
    assert events[-1][1] == "[DONE]"
    assert all("error" not in data for _, data in events), events
    assert gateway.cancels == []
    assert len(gateway.submitted) == 1


async def test_a_keyed_retry_of_a_cancelled_request_is_a_final_409_not_a_retriable_503(
    client: Client, gateway: FakeGateway
) -> None:
    """With no grace (the default) a dropped client's request is cancelled at once; every retry with its key
    replayed that as 503 ``x-should-retry: true``, for the key's 24 hours."""
    gateway.hold_after = 1
    task = asyncio.create_task(client.post("/v1/chat/completions", json=CHAT, headers=KEYED))
    await eventually(lambda: len(gateway.submitted) == 1)
    await asyncio.sleep(0.2)
    task.cancel()  # the client's timeout
    await asyncio.gather(task, return_exceptions=True)
    await eventually(lambda: len(gateway.cancels) == 1)
    for _ in range(2):
        retry = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
        assert retry.status == 409, await retry.text()
        assert retry.headers["x-should-retry"] == "false"
        error = (await retry.json())["error"]
        assert (error["code"], error["param"]) == ("idempotency_key_cancelled", "Idempotency-Key")
        assert "new key" in error["message"]
    gateway.hold_after = None
    fresh = await client.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "Idempotency-Key": "b"})
    assert fresh.status == 200
    assert len(gateway.submitted) == 2


async def test_a_resume_of_a_cancelled_stream_is_a_final_409_not_a_retriable_503(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """An audit: a resume (``Last-Event-ID``) of a stream whose request was cancelled (its client left, no
    grace) answered 503 ``x-should-retry: true`` and an SDK retried into the same replay for ever."""
    client = await dropped_after_a_token(make_client, gateway, 0.0, AUTH)
    await eventually(lambda: len(gateway.cancels) == 1)
    rid = gateway.submitted[0].request_id
    for stream in (False, True):
        body = {**CHAT, "stream": stream}
        resumed = await client.post(
            "/v1/chat/completions", json=body, headers={**AUTH, "Last-Event-ID": f"{rid}:1.3"}
        )
        if stream:  # the stream had begun: the end comes as an error event
            assert resumed.status == 200
            text = await resumed.text()
            assert '"code":"stream_cancelled"' in text, text
            continue
        assert resumed.status == 409, await resumed.text()
        assert resumed.headers["x-should-retry"] == "false"
        error = (await resumed.json())["error"]
        assert error["code"] == "stream_cancelled"
        assert "without Last-Event-ID" in error["message"]
    frames = await client.get(f"/v1/streams/{rid}", headers=AUTH)
    assert '"code":"stream_cancelled"' in await frames.text()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_keyed_retry_of_a_request_that_failed_retriably_is_a_final_409(
    client: Client, gateway: FakeGateway, stream: bool
) -> None:
    """A request that failed for a reason worth retrying (out of memory, a full queue, its model version
    retired mid-answer) is answered 503 ``x-should-retry: true``; a retry with the same key (the OpenAI SDK's
    own retries reuse theirs) replayed that same 503 for the key's 24 hours. It is a final 409 that says to
    use a new key, and a new key runs the request again."""
    gateway.fail_with = ErrorInfo(code="version_retired", message="retired", retriable=True)
    body = {**CHAT, "stream": stream}
    first = await client.post("/v1/chat/completions", json=body, headers=KEYED)
    if stream:
        assert "version_retired" in await first.text()
    else:
        assert first.status == 503
        assert first.headers["x-should-retry"] == "true"
    for _ in range(2):
        retry = await client.post("/v1/chat/completions", json=body, headers=KEYED)
        if stream:
            assert "idempotency_key_failed" in await retry.text()
        else:
            assert retry.status == 409, await retry.text()
            assert retry.headers["x-should-retry"] == "false"
            error = (await retry.json())["error"]
            assert (error["code"], error["param"]) == ("idempotency_key_failed", "Idempotency-Key")
            assert "new key" in error["message"]
            assert "version_retired" in error["message"]
    assert len(gateway.submitted) == 1
    gateway.fail_with = None
    fresh = await client.post("/v1/chat/completions", json=CHAT, headers={**AUTH, "Idempotency-Key": "b"})
    assert fresh.status == 200
    assert len(gateway.submitted) == 2


async def test_a_keyed_retry_of_a_request_that_failed_for_good_replays_its_failure(
    client: Client, gateway: FakeGateway
) -> None:
    """A failure not worth retrying is the key's outcome as it was: replayed as it was answered."""
    gateway.fail_with = ErrorInfo(code="engine_error", message="the model failed")
    first = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    retry = await client.post("/v1/chat/completions", json=CHAT, headers=KEYED)
    assert first.status == retry.status == 500
    assert (await retry.json())["error"]["code"] == "engine_error"
    assert len(gateway.submitted) == 1


async def test_a_resumed_stream_is_counted_in_flight_under_its_model(
    client: Client, gateway: FakeGateway
) -> None:
    """Found by an audit: ``GET /v1/streams/{id}`` (and a WebSocket resume) opened its flight before the
    stream named its model and stayed counted under ``model=""``: Grafana showed resumed streams with a
    blank legend, under no model."""

    def in_flight(model: str) -> float:
        return REGISTRY.get_sample_value("sluice_edge_requests_in_flight", {"model": model}) or 0.0

    before = in_flight(GEN), in_flight("")
    gateway.hold_after = 1
    first = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    await first.content.readuntil(b"\n\n")
    rid = gateway.submitted[0].request_id
    resumed = await client.get(f"/v1/streams/{rid}", headers=AUTH)
    await resumed.content.readuntil(b"\n\n")  # its first reply named the model
    await eventually(lambda: in_flight(GEN) == before[0] + 2)  # the request and its second reader
    assert in_flight("") == before[1]
    gateway.release.set()
    await first.read()
    await resumed.read()
    await eventually(lambda: in_flight(GEN) == before[0])
    assert in_flight("") == before[1]
