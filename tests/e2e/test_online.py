"""Done-when of the online path, on the real broker with the real models."""

from __future__ import annotations

import asyncio
import base64
import json

import aiohttp
import numpy as np
import pytest
from openai import AsyncOpenAI

from gpu_workers.models import MINILM_ID
from gpu_workers.service import WorkerService
from ingest.auth import DEMO_KEY
from schemas.events import CancelRequested, GenerationRequested, RequestFinished, TokenChunk
from schemas.ids import uuid7
from tests.e2e.conftest import GPT, Platform

pytestmark = pytest.mark.integration
AUTH = {"Authorization": f"Bearer {DEMO_KEY}"}
CHAT = {"model": GPT, "messages": [{"role": "user", "content": "Tell me about the river."}]}


def _generations(platform: Platform) -> list[GenerationRequested]:
    return [e for e in platform.requests.all() if isinstance(e, GenerationRequested)]


async def test_openai_sdk_streams_completes_and_embeds(
    platform: Platform, workers: list[WorkerService]
) -> None:
    async with AsyncOpenAI(base_url=platform.base_url, api_key=DEMO_KEY, max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            model=GPT,
            messages=[{"role": "user", "content": "Tell me about the river."}],
            stream=True,
            max_tokens=24,
            temperature=0,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        usage = chunks[-1].usage
        assert usage is not None
        assert 0 < usage.completion_tokens <= 24
        request_id = chunks[0].id.removeprefix("chatcmpl-")
        await platform.results.wait(lambda: bool(platform.results.of(request_id)))
        (result,) = platform.results.of(request_id)
        assert isinstance(result, RequestFinished)
        assert result.text == text
        assert result.usage.completion_tokens == usage.completion_tokens

        completion = await sdk.completions.create(model=GPT, prompt="The river", max_tokens=12, temperature=0)
        assert completion.usage is not None
        assert completion.usage.prompt_tokens > 0
        assert completion.choices[0].finish_reason in ("stop", "length")

        embeddings = await sdk.embeddings.create(model=MINILM_ID, input=["a river", "a stream", "tax law"])
        vectors = [d.embedding for d in embeddings.data]
        assert len(vectors) == 3
        assert all(len(v) == 384 for v in vectors)
        near = sum(a * b for a, b in zip(vectors[0], vectors[1], strict=True))
        far = sum(a * b for a, b in zip(vectors[0], vectors[2], strict=True))
        assert near > far


async def test_as_many_embedding_inputs_as_openai_allows_come_back_in_one_answer(
    platform: Platform, workers: list[WorkerService]
) -> None:
    """2,048 inputs (OpenAI's limit; LangChain sends 1,000 at a time): their terminal event, 4.2 MB of packed
    vectors, is one record of the real broker's topics (480 fitted Kafka's default 1 MB), and the answer
    carries every vector in order, as floats and as base64."""
    texts = [f"river number {i}" for i in range(2048)]
    async with AsyncOpenAI(base_url=platform.base_url, api_key=DEMO_KEY, max_retries=0, timeout=120) as sdk:
        floats = await sdk.embeddings.create(model=MINILM_ID, input=texts)
        packed = await sdk.embeddings.create(model=MINILM_ID, input=texts, encoding_format="base64")
    assert [d.index for d in floats.data] == list(range(2048))
    assert all(len(d.embedding) == 384 for d in floats.data)
    assert floats.usage.prompt_tokens > 2048
    for a, b in zip(floats.data, packed.data, strict=True):  # asked for by name, the SDK leaves base64 as is
        text: object = b.embedding  # typed list[float]; the SDK passes the base64 string through
        assert isinstance(text, str)
        decoded = np.frombuffer(base64.b64decode(text), dtype="<f4")
        assert np.abs(decoded - np.asarray(a.embedding)).max() < 1e-6
    assert floats.data[0].embedding != floats.data[1].embedding
    async with aiohttp.ClientSession() as http:
        too_many = await http.post(
            f"{platform.base_url}/embeddings",
            json={"model": MINILM_ID, "input": [*texts, "one more"]},
            headers=AUTH,
        )
        assert too_many.status == 400
        assert "2048" in (await too_many.json())["error"]["message"]


async def test_websocket_multiplexes_ten_requests_and_cancels_one(
    platform: Platform, workers: list[WorkerService]
) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{platform.edge.url}/v1/ws", headers=AUTH) as ws,
    ):
        for i in range(10):
            body = {
                **CHAT,
                "max_tokens": 60 if i else 250,
                "temperature": 0.7,
                "stream": True,
                "ignore_eos": i == 0,
            }
            await ws.send_json(
                {"type": "request", "id": f"r{i}", "endpoint": "chat.completions", "body": body}
            )
        done: dict[str, dict[str, object]] = {}
        tokens: dict[str, int] = {}
        cancelled_sent = False
        while len(done) < 10:
            frame = json.loads((await asyncio.wait_for(ws.receive(), 60)).data)
            if frame["type"] == "token":
                tokens[frame["id"]] = tokens.get(frame["id"], 0) + len(frame["token_ids"])
                if frame["id"] == "r0" and not cancelled_sent:
                    await ws.send_json({"type": "cancel", "id": "r0"})
                    cancelled_sent = True
            elif frame["type"] == "done":
                done[frame["id"]] = frame
            else:
                assert frame["type"] in ("accepted", "pong"), frame
    assert done["r0"]["status"] == "cancelled"
    assert all(done[f"r{i}"]["status"] == "completed" for i in range(1, 10))
    assert all(tokens.get(f"r{i}", 0) > 0 for i in range(1, 10))


async def test_disconnect_mid_stream_cancels_the_work(
    platform: Platform, workers: list[WorkerService]
) -> None:
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{platform.base_url}/chat/completions",
            headers=AUTH,
            json={**CHAT, "stream": True, "max_tokens": 250, "temperature": 0.8, "ignore_eos": True},
        )
        assert response.status == 200
        request_id = ""
        async for line in response.content:
            if line.startswith(b"id: "):
                request_id = line[4:].decode().strip().split(":")[0]
                break
        response.close()  # the client goes away mid-stream
    await platform.results.wait(lambda: bool(platform.results.of(request_id)))
    (result,) = platform.results.of(request_id)
    assert isinstance(result, RequestFinished)
    assert result.status == "cancelled"
    assert result.usage.completion_tokens < 250
    await platform.cancels.caught_up()  # this test's reader of the cancels may be behind the worker's
    cancels = platform.cancels.of(request_id)
    assert [c.reason for c in cancels if isinstance(c, CancelRequested)] == ["client_disconnect"]
    await platform.replies.caught_up()  # the terminal event reached results first; replies may lag a little
    replies = platform.replies.of(request_id)
    assert isinstance(replies[-1], RequestFinished)  # no token after the terminal event
    streamed = sum(len(e.token_ids) for e in replies if isinstance(e, TokenChunk))
    assert streamed == result.usage.completion_tokens


async def test_idempotency_key_executes_once(platform: Platform, workers: list[WorkerService]) -> None:
    key = f"order-{uuid7()}"
    headers = {**AUTH, "Idempotency-Key": key}
    body = {**CHAT, "max_tokens": 16, "temperature": 0.9}
    async with aiohttp.ClientSession() as session:
        first = await session.post(f"{platform.base_url}/chat/completions", headers=headers, json=body)
        second = await session.post(f"{platform.base_url}/chat/completions", headers=headers, json=body)
        first_body, second_body = await first.json(), await second.json()
        clash = await session.post(
            f"{platform.base_url}/chat/completions", headers=headers, json={**body, "max_tokens": 3}
        )
    assert first.status == second.status == 200
    assert first_body == second_body
    # where the first run's time went; the replay was not run, so it says nothing
    stages = [part.split(";dur=") for part in first.headers["Server-Timing"].split(", ")]
    assert [name for name, _ in stages] == ["edge", "queue", "model", "return", "total"]
    assert float(dict(stages)["model"]) > 0
    assert "Server-Timing" not in second.headers
    request_id = first_body["id"].removeprefix("chatcmpl-")
    await platform.results.wait(lambda: bool(platform.results.of(request_id)))
    await platform.requests.caught_up()
    await platform.results.caught_up()
    # by the key, not the first id: a second execution would be a new request with a new id
    published = [e for e in _generations(platform) if e.idempotency_key == key]
    assert [e.request_id for e in published] == [request_id]
    ended = [e for e in platform.results.all() if isinstance(e, RequestFinished) and e.idempotency_key == key]
    assert [e.request_id for e in ended] == [request_id]
    assert clash.status == 422


async def test_last_event_id_resumes_from_the_log(platform: Platform, workers: list[WorkerService]) -> None:
    body = {**CHAT, "stream": True, "max_tokens": 40, "temperature": 0}
    async with aiohttp.ClientSession() as session:
        response = await session.post(f"{platform.base_url}/chat/completions", headers=AUTH, json=body)
        original = [line async for line in response.content]
        ids = [line[4:].decode().strip() for line in original if line.startswith(b"id: ")]
        request_id = ids[0].split(":")[0]
        await platform.requests.caught_up()
        published = len(_generations(platform))
        resumed = await session.post(
            f"{platform.base_url}/chat/completions", headers={**AUTH, "Last-Event-ID": ids[1]}, json=body
        )
        rest = [line async for line in resumed.content]
    assert resumed.status == 200
    data = [line for line in original if line.startswith(b"data: ")]
    tail = [line for line in rest if line.startswith(b"data: ")]
    # data[0] opens the stream (the assistant role, no id); data[1], data[2] carry seq 0 and 1
    assert tail == data[3:]  # everything after seq 1, byte for byte
    await platform.requests.caught_up()
    await platform.results.caught_up()
    assert len(_generations(platform)) == published  # no new generation
    assert len([e for e in platform.results.of(request_id)]) == 1


@pytest.mark.parametrize(
    ("body", "headers", "status"),
    [
        (b"{not json", AUTH, 400),
        (json.dumps({**CHAT, "max_tokens": "many"}).encode(), AUTH, 400),
        (json.dumps({**CHAT, "model": "no-such-model"}).encode(), AUTH, 404),
        (json.dumps(CHAT).encode(), {}, 401),
        (json.dumps({**CHAT, "messages": [{"role": "user", "content": "word " * 2000}]}).encode(), AUTH, 400),
        (json.dumps({**CHAT, "max_tokens": 10**9}).encode(), AUTH, 400),
    ],
    ids=["malformed-json", "wrong-type", "unknown-model", "missing-key", "over-long", "absurd-max-tokens"],
)
async def test_bad_input_is_refused_and_nothing_is_published(
    platform: Platform, workers: list[WorkerService], body: bytes, headers: dict[str, str], status: int
) -> None:
    await platform.requests.caught_up()
    before = len(platform.requests.all())
    async with aiohttp.ClientSession() as session:
        response = await session.post(
            f"{platform.base_url}/chat/completions",
            data=body,
            headers={**headers, "Content-Type": "application/json"},
        )
        error = await response.json()
        assert response.status == status
        assert set(error["error"]) >= {"message", "type", "param", "code"}
        healthy = await session.post(
            f"{platform.base_url}/completions",
            headers=AUTH,
            json={"model": GPT, "prompt": "ok", "max_tokens": 2},
        )
        assert healthy.status == 200
    await platform.requests.wait(lambda: len(platform.requests.all()) >= before + 1)
    await platform.requests.caught_up()
    assert len(platform.requests.all()) == before + 1  # only the healthy one


async def test_binary_junk_on_the_websocket_gets_an_error_frame(
    platform: Platform, workers: list[WorkerService]
) -> None:
    await platform.requests.caught_up()
    before = len(platform.requests.all())
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"{platform.edge.url}/v1/ws", headers=AUTH) as ws,
    ):
        await ws.send_bytes(b"\x00\xff\xfe junk")
        frame = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
        assert frame["type"] == "error"
        await ws.send_str("{not json")
        frame = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
        assert frame["type"] == "error"
        await ws.send_json({"type": "ping"})
        frame = json.loads((await asyncio.wait_for(ws.receive(), 10)).data)
        assert frame["type"] == "pong"
    await platform.requests.caught_up()
    assert len(platform.requests.all()) == before
