"""The OpenAI-compatible routes against the fake gateway: shapes, events, streaming."""

from __future__ import annotations

import base64
import struct
import time
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
import pytest
from aiohttp import web

from ingest.models import ModelCatalogue
from schemas.events import EmbeddingRequested, GenerationRequested
from schemas.ids import derive_seed, uuid7_unix_ms
from tests.ingest.conftest import AUTH, EMB, GEN, Client, MakeClient, eventually, parse_sse
from tests.ingest.fake_gateway import FakeGateway

CHAT = {
    "model": GEN,
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}],
}


async def test_chat_completion_is_one_json_body(
    client: Client, gateway: FakeGateway, catalogue: ModelCatalogue
) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=AUTH)
    assert response.status == 200
    body = await response.json()
    (event,) = gateway.submitted
    assert isinstance(event, GenerationRequested)
    assert response.headers["x-request-id"] == event.request_id
    assert body == {
        "id": f"chatcmpl-{event.request_id}",
        "object": "chat.completion",
        "created": uuid7_unix_ms(event.request_id) // 1000,
        "model": GEN,
        "system_fingerprint": "0123456789ab",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " t0 t1 t2", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": len(event.input_ids),
            "completion_tokens": 3,
            "total_tokens": len(event.input_ids) + 3,
        },
    }


async def test_the_event_carries_what_the_workers_need(
    client: Client, gateway: FakeGateway, catalogue: ModelCatalogue
) -> None:
    before = datetime.now(UTC)
    await client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.5, "stop": "x"}, headers=AUTH)
    after = datetime.now(UTC)
    (event,) = gateway.submitted
    assert isinstance(event, GenerationRequested)
    model = catalogue.get(GEN)
    prompt = "<|system|>\nbe brief\n<|user|>\nhello\n<|assistant|>\n"
    assert event.prompt == prompt
    assert event.input_ids == model.tokenizer.encode(prompt).ids
    assert event.chat
    assert not event.stream
    assert event.tenant == "demo"
    assert event.model == GEN
    assert event.model_version == "0123456789ab"
    assert event.source == "ingest/edge-test"
    assert event.reply == gateway.reply_to
    assert event.sampling.temperature == 0.5
    assert event.sampling.stop == ("x",)
    assert event.sampling.max_tokens == 8  # the manifest's default
    assert event.sampling.seed == derive_seed(event.request_id)
    assert event.deadline is not None
    # default timeout 60 s, from the moment the edge took the request: between before and after (a loaded
    # box may stall the request for seconds; timed from ``before`` alone that read as a wrong timeout)
    second = timedelta(seconds=1)
    assert before + 59 * second <= event.deadline <= after + 61 * second
    assert uuid7_unix_ms(event.request_id) > 0


async def test_a_given_seed_is_kept_and_max_tokens_is_clamped(client: Client, gateway: FakeGateway) -> None:
    await client.post("/v1/chat/completions", json={**CHAT, "seed": 7, "max_tokens": 999_999}, headers=AUTH)
    await client.post("/v1/completions", json={"model": GEN, "prompt": "the " * 60}, headers=AUTH)
    chat, near_full = gateway.submitted
    assert isinstance(chat, GenerationRequested)
    assert isinstance(near_full, GenerationRequested)
    assert chat.sampling.seed == 7
    assert chat.sampling.max_tokens == 16  # manifest.max_output_tokens
    assert near_full.sampling.max_tokens == 64 - len(near_full.input_ids)  # what is left of the context
    assert 0 < near_full.sampling.max_tokens < 8


async def test_streamed_chat_is_sse_with_resumable_ids(client: Client, gateway: FakeGateway) -> None:
    response = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    assert response.status == 200
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events = parse_sse(await response.text())
    (event,) = gateway.submitted
    rid = event.request_id
    assert events[-1] == (None, "[DONE]")
    chunks = [msgspec.json.decode(data) for _, data in events[:-1]]
    # each id: the tokens and characters the client has after that event (" t0" ... " t4": one token, 3 chars)
    assert [eid for eid, _ in events[:-1]] == [None, *(f"{rid}:{i}.{3 * i}" for i in range(1, 6)), None]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == " t0 t1 t2 t3 t4"
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == f"chatcmpl-{rid}" for c in chunks)
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all("usage" not in c for c in chunks)


async def test_include_usage_adds_a_usage_chunk(client: Client, gateway: FakeGateway) -> None:
    body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 2}
    response = await client.post("/v1/chat/completions", json=body, headers=AUTH)
    events = parse_sse(await response.text())
    chunks = [msgspec.json.decode(data) for _, data in events[:-1]]
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    prompt = len(gateway.submitted[0].input_ids)  # type: ignore[union-attr]
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": 2,
        "total_tokens": prompt + 2,
    }
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


async def test_completions_stream_and_not(client: Client, gateway: FakeGateway) -> None:
    plain = await client.post(
        "/v1/completions", json={"model": GEN, "prompt": "hello", "max_tokens": 2}, headers=AUTH
    )
    body = await plain.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"] == [{"text": " t0 t1", "index": 0, "logprobs": None, "finish_reason": "length"}]
    streamed = await client.post(
        "/v1/completions", json={"model": GEN, "prompt": ["hello"], "stream": True}, headers=AUTH
    )
    events = parse_sse(await streamed.text())
    chunks = [msgspec.json.decode(data) for _, data in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks] == [" t0", " t1", " t2", " t3", " t4", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[0][0] is not None
    assert events[0][0].endswith(":1.3")  # one token and " t0" delivered


async def test_completion_from_token_ids(client: Client, gateway: FakeGateway) -> None:
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        response = await client.post("/v1/completions", json={"model": GEN, "prompt": prompt}, headers=AUTH)
        assert response.status == 200
    first, second = gateway.submitted
    assert isinstance(first, GenerationRequested)
    assert isinstance(second, GenerationRequested)
    assert first.input_ids == second.input_ids == [5, 6, 7]
    assert first.prompt is None
    assert not first.chat


async def test_embeddings_float_and_base64(
    client: Client, gateway: FakeGateway, catalogue: ModelCatalogue
) -> None:
    response = await client.post(
        "/v1/embeddings", json={"model": EMB, "input": ["hello world", "fox"]}, headers=AUTH
    )
    assert response.status == 200
    body = await response.json()
    (event,) = gateway.submitted
    assert isinstance(event, EmbeddingRequested)
    assert event.inputs == [[2, 4, 5, 3], [2, 9, 3]]  # [CLS] … [SEP], not truncated to 4 by the file
    assert event.texts == ["hello world", "fox"]
    assert body["object"] == "list"
    assert body["model"] == EMB
    assert body["data"] == [
        {"object": "embedding", "index": 0, "embedding": [4.0, 14.0, 0.0]},
        {"object": "embedding", "index": 1, "embedding": [3.0, 14.0, 1.0]},
    ]
    assert body["usage"] == {"prompt_tokens": 7, "total_tokens": 7}
    encoded = await client.post(
        "/v1/embeddings", json={"model": EMB, "input": [[4, 5]], "encoding_format": "base64"}, headers=AUTH
    )
    data = (await encoded.json())["data"][0]["embedding"]
    assert struct.unpack("<3f", base64.b64decode(data)) == (2.0, 9.0, 0.0)
    assert gateway.submitted[1].inputs == [[4, 5]]  # type: ignore[union-attr]
    # OpenAI takes an explicit null as the default; LiteLLM sends one whenever its caller set none
    # (BerriAI/litellm#19174), and every such client had a 400 (a review).
    null = await client.post(
        "/v1/embeddings", json={"model": EMB, "input": [[4, 5]], "encoding_format": None}, headers=AUTH
    )
    assert (await null.json())["data"][0]["embedding"] == [2.0, 9.0, 0.0]


def _server_timing(header: str) -> dict[str, float]:
    parts = [part.strip().split(";dur=") for part in header.split(",")]
    return {name: float(duration) for name, duration in parts}


async def test_a_non_streamed_answer_says_where_its_time_went(make_client: MakeClient) -> None:
    client, _ = await make_client()
    embedded = await client.post("/v1/embeddings", json={"model": EMB, "input": "hello"}, headers=AUTH)
    completed = await client.post(
        "/v1/completions", json={"model": GEN, "prompt": "hi", "max_tokens": 2}, headers=AUTH
    )
    for response in (embedded, completed):
        assert response.status == 200
        timing = _server_timing(response.headers["Server-Timing"])
        assert list(timing) == ["edge", "queue", "model", "return", "total"]
        assert all(duration >= 0 for duration in timing.values())
        assert timing["total"] >= timing["edge"]
    streamed = await client.post(
        "/v1/completions", json={"model": GEN, "prompt": "hi", "max_tokens": 2, "stream": True}, headers=AUTH
    )
    await streamed.read()
    assert "Server-Timing" not in streamed.headers  # sent before the stream's timings exist
    quiet, _ = await make_client(edge_server_timing=False)
    plain = await quiet.post("/v1/embeddings", json={"model": EMB, "input": "hello"}, headers=AUTH)
    assert plain.status == 200
    assert "Server-Timing" not in plain.headers


async def test_a_whole_answer_leaves_before_the_bookkeeping(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client, edge = await make_client()
    answers: list[web.StreamResponse] = []
    sent_at_release: list[bool] = []

    prepare = web.StreamResponse.prepare

    async def prepared(response: web.StreamResponse, request: web.BaseRequest) -> Any:
        answers.append(response)
        return await prepare(response, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", prepared)
    ledger = edge.ctx.admission.ledger
    release = ledger.release

    def released(reservation: Any) -> None:  # the request's flight ends: its bookkeeping unwinds
        sent_at_release.append(bool(answers) and answers[-1].prepared)
        release(reservation)

    monkeypatch.setattr(ledger, "release", released)
    for path, body in (
        ("/v1/embeddings", {"model": EMB, "input": "hello"}),
        ("/v1/completions", {"model": GEN, "prompt": "hi", "max_tokens": 2}),
    ):
        response = await client.post(path, json=body, headers=AUTH)
        assert response.status == 200
        assert (await response.json())["object"] in ("list", "text_completion")
    assert sent_at_release == [True, True]


async def test_models_health_and_readiness(make_client: MakeClient, gateway: FakeGateway) -> None:
    client, _ = await make_client()
    models = await (await client.get("/v1/models", headers=AUTH)).json()
    assert models["object"] == "list"
    assert sorted(m["id"] for m in models["data"]) == [EMB, GEN]
    assert (await client.get("/healthz")).status == 200
    ready = await client.get("/readyz")
    assert ready.status == 200
    assert (await ready.json())["checks"]["models"] == 2  # named only to the ops token (test_ops_access)
    gateway.is_ready = False
    assert (await client.get("/readyz")).status == 503
    assert (await client.get("/healthz")).status == 200


async def test_failed_request_maps_to_openai_error(client: Client, gateway: FakeGateway) -> None:
    from schemas.events import ErrorInfo

    gateway.fail_with = ErrorInfo(code="worker_oom", message="out of memory")
    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status == 500
    assert (await response.json())["error"]["code"] == "worker_oom"
    # the request ran: its error names it, as OpenAI's do (an audit: the SDK's request_id was None)
    assert response.headers["x-request-id"] == gateway.submitted[-1].request_id
    streamed = await client.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=AUTH)
    events = parse_sse(await streamed.text())
    assert msgspec.json.decode(events[-2][1])["error"]["code"] == "worker_oom"
    assert events[-1][1] == "[DONE]"


async def test_gateway_down_is_503(client: Client, gateway: FakeGateway) -> None:
    gateway.fail_submit = True
    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status == 503
    assert response.headers["x-should-retry"] == "true"
    assert (await response.json())["error"]["code"] == "gateway_unavailable"


async def test_a_tenant_over_budget_gets_402_and_nothing_is_published(
    client: Client, gateway: FakeGateway
) -> None:
    gateway.exhausted.add("demo")
    response = await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)
    assert response.status == 402
    error = (await response.json())["error"]
    assert error["code"] == "budget_exceeded"
    assert error["type"] == "insufficient_quota"
    assert gateway.submitted == []
    gateway.exhausted.clear()  # the budget was raised: served again
    assert (await client.post("/v1/chat/completions", json=CHAT, headers=AUTH)).status == 200


async def test_aiohttps_own_refusals_are_openai_errors(client: Client) -> None:
    """Found by the fuzz suite: a GET of /v1/ws without an upgrade was aiohttp's text/plain 400."""
    response = await client.get("/v1/ws", headers=AUTH)
    assert response.status == 400
    body = await response.json()
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "bad_request"
    assert response.headers["x-should-retry"] == "false"


async def test_json_nested_too_deep_is_a_400(client: Client) -> None:
    for path, field in (
        ("/v1/chat/completions", "messages"),
        ("/v1/completions", "prompt"),
        ("/v1/embeddings", "input"),
    ):
        for body in ("[" * 100_000, '{"' + field + '": ' + "[" * 100_000, '{"zz": ' + "[" * 100_000):
            response = await client.post(
                path, data=body, headers={**AUTH, "Content-Type": "application/json"}
            )
            assert response.status == 400, (path, body[:20], await response.text())


async def test_a_whole_answer_its_client_does_not_read_frees_its_slot_after_the_deadline(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """Found by an audit: a large non-streamed answer its client never read held the request's
    concurrency slot for good (the edge waited to send it, outside the deadline's guard). It now gets the
    deadline again, at least a second, and then the connection is dropped."""
    import socket

    client, edge = await make_client(edge_default_timeout_s=1.0)
    gateway.tokens, gateway.text_size = 16, 1_000_000  # a 16 MB answer: more than both sockets' buffers hold
    body = msgspec.json.encode(
        {"model": GEN, "messages": [{"role": "user", "content": "x"}], "max_tokens": 16}
    )
    port = client.server.port
    assert port is not None
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {AUTH['Authorization']}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    stalled.sendall(head.encode() + body)  # and never read
    try:
        await eventually(lambda: len(gateway.submitted) == 1 and len(edge.ctx.admission.flights) == 1)
        began = time.monotonic()
        await eventually(lambda: not edge.ctx.admission.flights, within_s=10.0)
        assert time.monotonic() - began < 5.0
    finally:
        stalled.close()
