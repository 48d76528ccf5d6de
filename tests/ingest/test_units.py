"""Settings, the model catalogue and the pure helpers."""

from __future__ import annotations

import base64
import struct
from pathlib import Path

import msgspec
import pytest

from ingest import openai, render
from ingest.errors import CatalogueError, InvalidRequest, ModelNotFound
from ingest.models import ModelCatalogue
from ingest.openai import ChatCompletionRequest, decode_body
from ingest.prepare import Shape, body_hash
from ingest.settings import EdgeSettings
from schemas.events import Float32Vectors, RequestFinished, Usage
from schemas.ids import uuid7
from schemas.settings import SettingsError, load_settings
from tests.ingest.conftest import EMB, GEN


def test_settings_from_the_environment() -> None:
    assert load_settings(EdgeSettings, {}) == EdgeSettings()
    defaults = EdgeSettings()
    assert (defaults.edge_host, defaults.edge_port, defaults.edge_tenants_file) == ("127.0.0.1", 8080, None)
    loaded = load_settings(
        EdgeSettings,
        {
            "SLUICE_EDGE_PORT": "9000",
            "SLUICE_EDGE_ID": "edge-7",
            "SLUICE_EDGE_TENANTS_FILE": "/etc/sluice/tenants.toml",
            "SLUICE_EDGE_WS_SEND_QUEUE": "8",
            "SLUICE_EDGE_SHUTDOWN_GRACE_S": "2.5",
        },
    )
    assert (loaded.edge_port, loaded.edge_id, loaded.edge_ws_send_queue) == (9000, "edge-7", 8)
    assert (loaded.edge_tenants_file, loaded.edge_shutdown_grace_s) == ("/etc/sluice/tenants.toml", 2.5)


@pytest.mark.parametrize(
    "env",
    [
        {"SLUICE_EDGE_PORT": "70000"},
        {"SLUICE_EDGE_ID": "has space"},
        {"SLUICE_EDGE_DEFAULT_TIMEOUT_S": "100", "SLUICE_EDGE_MAX_TIMEOUT_S": "10"},
        {"SLUICE_EDGE_PROT": "1"},
    ],
)
def test_bad_settings(env: dict[str, str]) -> None:
    with pytest.raises(SettingsError):
        load_settings(EdgeSettings, env)


def test_catalogue(catalogue: ModelCatalogue) -> None:
    assert sorted(m.model_id for m in catalogue) == [EMB, GEN]
    gen = catalogue.get(GEN)
    assert gen.chat_prompt([("user", "{x}")]) == "<|user|>\n{x}\n<|assistant|>\n"
    emb = catalogue.get(EMB)
    (ids,) = emb.encode(["the quick brown fox jumps"], "input")
    assert ids[0] == 2
    assert ids[-1] == 3
    assert len(ids) == 7
    with pytest.raises(ModelNotFound):
        catalogue.get("nope")


def test_catalogue_load_errors(tmp_path: Path, model_cache: Path) -> None:
    with pytest.raises(CatalogueError, match=r"no sluice-manifest\.json"):
        ModelCatalogue.from_cache(tmp_path, ["absent"])
    with pytest.raises(CatalogueError, match="id=/path"):
        ModelCatalogue.from_cache(tmp_path, [], ["no-equals-sign"])
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sluice-manifest.json").write_bytes(
        (model_cache / "models" / GEN / "current" / "sluice-manifest.json").read_bytes()
    )
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(CatalogueError, match=r"tokenizer\.json"):
        ModelCatalogue.from_cache(tmp_path, [], [f"x={broken}"])
    extra = ModelCatalogue.from_cache(model_cache, [], [f"alias={model_cache / 'models' / GEN / 'current'}"])
    assert [m.model_id for m in extra] == ["alias"]


def test_decode_errors_name_the_param() -> None:
    cases = {
        b'{"model": "m", "messages": [{"role": "user"}]}': "messages[0].content",
        b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "bogus": 1}': "bogus",
        b'{"messages": [{"role": "user", "content": "x"}]}': "model",
        b'{"model": 1, "messages": []}': "model",
    }
    for raw, param in cases.items():
        with pytest.raises(InvalidRequest) as caught:
            decode_body(raw, ChatCompletionRequest)
        assert caught.value.param == param


def test_body_hash_is_canonical() -> None:
    assert body_hash("chat", b'{"a": 1, "b": [1, 2]}') == body_hash("chat", b'{"b":[1,2],"a":1}')
    assert body_hash("chat", b'{"a": 1}') != body_hash("completion", b'{"a": 1}')
    assert body_hash("chat", b'{"a": 1}') != body_hash("chat", b'{"a": 2}')


def test_embeddings_base64_is_little_endian_float32() -> None:
    packed = Float32Vectors.pack([[1.5, -2.0], [0.25, 3.0]], 2)
    body = openai.embeddings("m", packed, 3, "base64")
    rows = [struct.unpack("<2f", base64.b64decode(d["embedding"])) for d in body["data"]]
    assert rows == [(1.5, -2.0), (0.25, 3.0)]
    assert [d["embedding"] for d in openai.embeddings("m", packed, 3, "float")["data"]] == [
        [1.5, -2.0],
        [0.25, 3.0],
    ]


def test_embedding_replies_read_old_json_float_events_and_packed_ones_alike() -> None:
    exact = [[1.5, -2.0], [0.25, 3.0]]
    usage = Usage(prompt_tokens=3, completion_tokens=0, total_tokens=3)
    old = RequestFinished(
        tenant="t", model="m", request_id="r", source="s", status="completed", finish_reason="stop",
        usage=usage, embeddings=exact,
    )  # fmt: skip
    new = msgspec.structs.replace(old, embeddings=None, embeddings_f32=Float32Vectors.pack(exact, 2))
    for encoding_format in ("float", "base64"):
        shape = Shape("embedding", "m", uuid7(), "fp", encoding_format=encoding_format)
        assert render.final_body(shape, "", old) == render.final_body(shape, "", new)
        assert render.native(old, shape) == render.native(new, shape)
    float_shape = Shape("embedding", "m", uuid7(), "fp")
    assert [d["embedding"] for d in render.final_body(float_shape, "", old)["data"]] == exact


def test_usage_chunk_shape() -> None:
    usage = Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3)
    chunk = openai.chat_chunk("r", "m", 1, "f", delta=None, with_usage=True, usage=usage)
    assert chunk["choices"] == []
    assert chunk["usage"]["total_tokens"] == 3
    plain = openai.completion_chunk("r", "m", 1, "f", text="x")
    assert "usage" not in plain
    assert plain["choices"][0]["finish_reason"] is None


@pytest.mark.parametrize("encoding_format", ["float", "base64"])
@pytest.mark.parametrize("n", [1, openai.EMBEDDINGS_PER_PART, openai.EMBEDDINGS_PER_PART + 1, 1000])
async def test_many_vectors_render_in_parts_to_the_same_json_with_the_loop_served_between(
    encoding_format: str, n: int
) -> None:
    """An audit: 2,048 vectors as floats (~15 MB of JSON) rendered in one go on the edge's loop, ~100 ms
    with every other request waiting. Many render part by part, byte for byte the same answer."""
    import asyncio
    import random

    rng = random.Random(n)
    packed = Float32Vectors.pack([[rng.uniform(-1, 1) for _ in range(8)] for _ in range(n)], 8)
    usage = Usage(prompt_tokens=n, completion_tokens=0, total_tokens=n)
    finished = RequestFinished(
        tenant="t", model="m", request_id="r", source="s", status="completed", finish_reason="stop",
        usage=usage, embeddings_f32=packed,
    )  # fmt: skip
    shape = Shape("embedding", "m", uuid7(), "fp", encoding_format=encoding_format)
    whole = msgspec.json.encode(render.final_body(shape, "", finished))
    assert b"".join(openai.embeddings_json("m", packed, n, encoding_format)) == whole
    turns = 0

    async def other() -> None:  # another request's work on the same loop
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    beside = asyncio.create_task(other())
    await asyncio.sleep(0)
    turns = 0
    assert await render.final_json(shape, "", finished) == whole
    beside.cancel()
    parts = -(-n // openai.EMBEDDINGS_PER_PART)
    assert turns == (parts + 2 if n > openai.EMBEDDINGS_PER_PART else 0)
    assert [item["index"] for item in msgspec.json.decode(whole)["data"]] == list(range(n))
    # A WebSocket's done frame too (a review: rendered in one go, ~100 ms for 2,048 vectors).
    beside = asyncio.create_task(other())
    await asyncio.sleep(0)
    turns = 0
    frame = await render.native_json(finished, shape, 7)
    beside.cancel()
    assert turns == (parts + 2 if n > openai.EMBEDDINGS_PER_PART else 0)
    assert msgspec.json.decode(frame) == {
        **msgspec.json.decode(msgspec.json.encode(render.native(finished, shape))),
        "id": 7,
    }
    assert msgspec.json.decode(frame)["result"] == msgspec.json.decode(whole)
