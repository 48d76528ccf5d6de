"""The official ``openai`` package against the edge (real TCP on 127.0.0.1, fake gateway behind)."""

from __future__ import annotations

import openai
import pytest
from openai import AsyncOpenAI

from ingest.auth import DEMO_KEY
from schemas.events import GenerationRequested
from tests.ingest.conftest import AUTH, EMB, GEN, MakeClient
from tests.ingest.fake_gateway import FakeGateway


async def test_openai_sdk_round_trip(make_client: MakeClient, gateway: FakeGateway) -> None:
    client, _ = await make_client()
    base_url = str(client.make_url("/v1"))
    assert base_url.startswith("http://127.0.0.1:")
    async with AsyncOpenAI(base_url=base_url, api_key=DEMO_KEY, max_retries=0) as sdk:
        stream = await sdk.chat.completions.create(
            model=GEN,
            messages=[{"role": "user", "content": "tell me a story"}],
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=4,
        )
        chunks = [chunk async for chunk in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " t0 t1 t2 t3"
        assert chunks[-2].choices[0].finish_reason == "length"
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 4

        completion = await sdk.completions.create(model=GEN, prompt="hello world", max_tokens=3)
        assert completion.choices[0].text == " t0 t1 t2"
        assert completion.usage is not None
        assert completion.usage.completion_tokens == 3
        assert completion.id == f"cmpl-{gateway.submitted[-1].request_id}"

        floats = await sdk.embeddings.create(model=EMB, input=["hello world", "fox"], encoding_format="float")
        assert [d.embedding for d in floats.data] == [[4.0, 14.0, 0.0], [3.0, 14.0, 1.0]]
        by_default = await sdk.embeddings.create(model=EMB, input="hello world")  # the SDK asks for base64
        assert by_default.data[0].embedding == [4.0, 14.0, 0.0]

        models = await sdk.models.list()
        assert sorted(m.id for m in models.data) == [EMB, GEN]

        with pytest.raises(openai.NotFoundError) as missing:
            await sdk.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
        assert missing.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError) as invalid:
            await sdk.chat.completions.create(
                model=GEN, messages=[{"role": "user", "content": "x"}], max_tokens=0
            )
        assert invalid.value.param == "max_tokens"
    assert len(gateway.submitted) == 4


async def test_openai_sdk_sees_bad_keys(make_client: MakeClient) -> None:
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="sk-wrong", max_retries=0) as sdk:
        with pytest.raises(openai.AuthenticationError):
            await sdk.models.list()


async def test_the_sdk_retrieves_a_model_and_sees_when_it_was_prepared(make_client: MakeClient) -> None:
    """Found by an audit: ``models.retrieve`` was a 404 for every model (no route), and every model's
    ``created`` was 0."""
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        model = await sdk.models.retrieve(GEN)
        assert (model.id, model.object, model.owned_by) == (GEN, "model", "sluicegate")
        assert model.created > 1_700_000_000
        assert [m.created for m in (await sdk.models.list()).data if m.id == GEN] == [model.created]
        with pytest.raises(openai.NotFoundError) as caught:
            await sdk.models.retrieve("no-such-model")
        assert caught.value.code == "model_not_found"


async def test_null_stream_and_echo_are_their_defaults(make_client: MakeClient, gateway: FakeGateway) -> None:
    """OpenAI documents ``stream`` and ``echo`` as "boolean or null"; null was a 400."""
    client, _ = await make_client()
    chat = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "stream": None}
    assert (await client.post("/v1/chat/completions", json=chat, headers=AUTH)).status == 200
    completion = {"model": GEN, "prompt": "hi", "stream": None, "echo": None}
    response = await client.post("/v1/completions", json=completion, headers=AUTH)
    assert response.status == 200
    assert (await response.json())["object"] == "text_completion"
    last = gateway.submitted[-1]
    assert isinstance(last, GenerationRequested)
    assert not last.stream


async def test_a_developer_message_is_the_models_system_instruction(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    """OpenAI's ``developer`` role replaces ``system``: it reached the prompt as ``<|developer|>``, a turn the
    model's chat format does not have (six plain tokens to demo-gpt)."""
    client, _ = await make_client()
    for role in ("developer", "system"):
        body = {
            "model": GEN,
            "messages": [{"role": role, "content": "be brief"}, {"role": "user", "content": "hi"}],
        }
        assert (await client.post("/v1/chat/completions", json=body, headers=AUTH)).status == 200
    developer, system = gateway.submitted[-2:]
    assert isinstance(developer, GenerationRequested)
    assert isinstance(system, GenerationRequested)
    assert developer.prompt == system.prompt
    assert developer.input_ids == system.input_ids


async def test_the_sdks_multi_turn_idiom_is_accepted(make_client: MakeClient, gateway: FakeGateway) -> None:
    """Found by a review: ``messages.append(response.choices[0].message)`` sends the answer back as the edge
    rendered it, ``"refusal": null`` with it; a message had no such field, so every second turn of a
    conversation through the SDK was a 400."""
    client, _ = await make_client()
    async with AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=DEMO_KEY, max_retries=0) as sdk:
        history: list[object] = [{"role": "user", "content": "hello"}]
        first = await sdk.chat.completions.create(model=GEN, messages=history, max_tokens=2)  # type: ignore[arg-type]
        history += [first.choices[0].message, {"role": "user", "content": "more"}]
        second = await sdk.chat.completions.create(model=GEN, messages=history, max_tokens=2)  # type: ignore[arg-type]
    assert second.choices[0].message.content == " t0 t1"
    assert len(gateway.submitted) == 2
