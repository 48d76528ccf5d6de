"""Fuzzing the edge: schemathesis drives every operation of the served ``/openapi.json`` over a real socket,
and seeded garbage goes down the WebSocket. Never a 5xx, every refusal in OpenAI's error shape, the edge
healthy afterwards, and nothing invalid published."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
from collections import Counter
from typing import Any

import hypothesis
import msgspec
import pytest
import schemathesis
from aiohttp import WSCloseCode, WSMsgType
from hypothesis import HealthCheck, given
from schemathesis import Case, GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from schemas.codec import decode, encode
from tests.ingest.conftest import AUTH, EMB, GEN, Client, MakeClient, assert_healthy
from tests.ingest.fake_gateway import FakeGateway

EXAMPLES_PER_OPERATION = 60
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]
SHORT_DEADLINE_S = 1.0


def _asked_for_a_short_deadline(case: Case[Any]) -> bool:
    """A client deadline the edge cannot meet: its 504 is the deadline passing, not a server fault."""
    body: Any = case.body
    asked: list[Any] = [body.get("timeout")] if isinstance(body, dict) else []
    headers: Any = case.headers or {}
    asked.append(headers.get("X-Request-Timeout"))
    for value in asked:
        with contextlib.suppress(TypeError, ValueError):
            if 0 < float(value) < SHORT_DEADLINE_S:
                return True
    return False


def _own_deadline(case: Case[Any], status: int, body: Any) -> bool:
    """Whether a 5xx is the 504 of the client's own sub-second deadline (not a server fault)."""
    return status == 504 and body["error"]["code"] == "timeout" and _asked_for_a_short_deadline(case)


def _is_openai_error(body: Any) -> bool:
    error = body.get("error") if isinstance(body, dict) else None
    return isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()


def _fuzz_operation(operation: Any, mode: GenerationMode, base_url: str, seen: Counter[str]) -> None:
    """A fixed, derandomized number of cases of one operation in one mode; counts the statuses seen.

    Valid bodies name a served model (a random name is a 404 before any of the interesting work)."""
    model = EMB if operation.path == "/v1/embeddings" else GEN

    @hypothesis.settings(
        max_examples=EXAMPLES_PER_OPERATION,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate],
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Case[Any]) -> None:
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body["model"] = model
        response = case.call(base_url=base_url, headers=AUTH, timeout=10)
        case.validate_response(response, checks=CHECKS)
        status = response.status_code
        if status >= 400:
            assert _is_openai_error(response.json()), (case.as_curl_command(), response.text)
        if status >= 500 and _own_deadline(case, status, response.json()):
            seen[f"{mode} its own deadline"] += 1
            return
        seen[f"{mode} {status}"] += 1
        assert status < 500, (case.as_curl_command(), status, response.text)

    try:
        run()
    except hypothesis.errors.Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE  # nothing to break in a route with no inputs


def _fuzz(raw_schema: dict[str, Any], base_url: str) -> Counter[str]:
    """Every operation of the document, in both modes."""
    schema = schemathesis.openapi.from_dict(raw_schema)
    seen: Counter[str] = Counter()
    for result, mode in itertools.product(schema.get_all_operations(), GenerationMode):
        _fuzz_operation(result.ok(), mode, base_url, seen)
    return seen


@pytest.mark.timeout(360)  # ~45 s alone; 120 s was passed on a box busy with other work
async def test_schemathesis_finds_no_server_error_and_every_refusal_is_openai_shaped(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_default_timeout_s=5.0, edge_max_timeout_s=5.0)
    raw = await (await client.get("/openapi.json")).json()
    base_url = str(client.make_url("")).rstrip("/")
    seen = await asyncio.to_thread(_fuzz, raw, base_url)
    assert not any(status.split()[1].startswith("5") for status in seen), seen
    assert seen["positive 200"] > 50, seen
    assert seen["negative 400"] > 100, seen
    await assert_healthy(client, gateway)
    for event in gateway.submitted:  # whatever got through is a valid event on the wire
        assert decode(encode(event)) == event
        assert event.tenant == "demo"


# --- WebSocket frames -------------------------------------------------------------------------------------

WS_FRAMES = 2_000
WS_BATCH = 100
SERVER_FRAMES = {"accepted", "token", "done", "error", "pong"}


def _junk_json(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value: wrong types, huge numbers, odd strings, nesting."""
    pick = rng.randrange(9 if depth < 4 else 6)
    leaves: list[Any] = [
        None,
        rng.choice([True, False]),
        rng.choice([0, -1, 2**63, -(2**64), 10**30, rng.randrange(-(10**6), 10**6)]),
        rng.choice([0.5, -0.0, 1e308, -1e-320, 3.14]),
        "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(0, 20))),
        rng.choice(["", "x" * 300, "\u0000", "\ud7ff", "chat.completions", "request"]),
    ]
    if pick < len(leaves):
        return leaves[pick]
    if pick == 6:
        return [_junk_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["type", "id", "endpoint", "body", "request_id", "after_seq", "model", "messages", "zz"]
    return {rng.choice(keys): _junk_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def _valid_body(rng: random.Random) -> dict[str, Any]:
    return {
        "model": GEN,
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": rng.randrange(1, 4),
    }


def _frame(rng: random.Random) -> str | bytes:
    """One client frame: mostly broken, some well-formed with junk inside, a few fully valid."""
    ids: list[Any] = [rng.randrange(50), 2**64, -(2**70), "a" * 129, "", 1.5, None, [1], {"x": 1}, "id-7"]
    kind = rng.randrange(10)
    if kind == 0:
        return rng.randbytes(rng.randrange(1, 64))  # a binary frame
    if kind == 1:
        return rng.randbytes(rng.randrange(1, 64)).decode("latin-1")  # not JSON
    if kind == 2:
        whole = msgspec.json.encode({"type": "request", "id": 1, "endpoint": "completions", "body": {}})
        return whole[: rng.randrange(len(whole))].decode()  # truncated JSON
    if kind == 3:
        return "[" * rng.choice([10, 1_000, 100_000]) + "]" * rng.choice([0, 10])  # deep nesting
    if kind == 4:
        return msgspec.json.encode(_junk_json(rng)).decode()
    if kind == 6:
        valid = {"type": "request", "id": rng.randrange(10**12), "endpoint": "chat.completions"}
        return msgspec.json.encode({**valid, "body": _valid_body(rng)}).decode()
    frame: dict[str, Any] = {
        "type": rng.choice(["request", "cancel", "resume", "ping", "pong", "REQUEST", 7, None]),
        "id": rng.choice(ids),
    }
    if kind == 5:
        frame["endpoint"] = rng.choice(["chat.completions", "completions", "embeddings", "nope", 3])
        frame["body"] = rng.choice([_valid_body(rng), _junk_json(rng)])
    elif kind == 7:
        frame["request_id"] = rng.choice(["0190a5b0-0000-7000-8000-000000000000", "x", 5, "../../etc"])
        frame["after_seq"] = rng.choice([-1, -2, 0, 2**63, "1", None])
    elif kind == 8:
        frame[rng.choice(["extra", "body", "after_seq"])] = _junk_json(rng)
    return msgspec.json.encode(frame).decode()


async def test_websocket_frame_fuzz_gets_answers_never_a_crash(client: Client, gateway: FakeGateway) -> None:
    rng = random.Random(11)
    frames = [_frame(rng) for _ in range(WS_FRAMES)]
    answered = 0
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        for start in range(0, WS_FRAMES, WS_BATCH):
            batch = frames[start : start + WS_BATCH]
            for frame in batch:
                await (ws.send_bytes(frame) if isinstance(frame, bytes) else ws.send_str(frame))
            sentinel = f"sentinel-{start}"
            await ws.send_str(msgspec.json.encode({"type": "ping", "id": sentinel}).decode())
            while True:
                reply = await asyncio.wait_for(ws.receive_json(), 10)
                assert reply["type"] in SERVER_FRAMES, reply
                if reply["type"] == "error":
                    assert _is_openai_error(reply), reply
                    assert reply["error"]["type"] != "server_error", reply
                if reply == {"type": "pong", "id": sentinel}:
                    break
                answered += 1
            assert not ws.closed
    assert answered >= WS_FRAMES  # every frame got at least one answer
    assert len(gateway.submitted) > 50  # the well-formed requests among the junk went through
    await assert_healthy(client, gateway)
    for event in gateway.submitted:
        assert decode(encode(event)) == event


async def test_a_websocket_frame_over_the_size_limit_closes_only_that_socket(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client(edge_max_body_bytes=4096)
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        await ws.send_str("x" * 5000)
        closing = await ws.receive()
        assert closing.type in (WSMsgType.CLOSE, WSMsgType.CLOSED, WSMsgType.CLOSING)
    assert ws.close_code == WSCloseCode.MESSAGE_TOO_BIG
    await assert_healthy(client, gateway)
