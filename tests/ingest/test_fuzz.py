"""Fuzzing the edge: schemathesis drives every operation of the served ``/openapi.json`` over a real socket,
and seeded garbage goes down the WebSocket. Never a 5xx, every refusal in OpenAI's error shape, the edge
healthy afterwards, and nothing invalid published."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import Counter
from typing import Any

import hypothesis
import schemathesis
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


def _no_server_error(case: Case[Any], status: int, body: Any) -> None:
    if status == 504 and body["error"]["code"] == "timeout" and _asked_for_a_short_deadline(case):
        return
    assert status < 500, (case.as_curl_command(), status, body)


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
        seen[f"{mode} {status}"] += 1
        if status >= 400:
            assert _is_openai_error(response.json()), (case.as_curl_command(), response.text)
            _no_server_error(case, status, response.json())

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

