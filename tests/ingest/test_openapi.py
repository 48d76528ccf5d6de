"""``/openapi.json``: written from the routes the app really serves, with the real request structs."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest
from aiohttp import web

from ingest.openapi_doc import OPERATIONS, document, registered
from tests.ingest.conftest import AUTH, GEN, Client, MakeClient


async def _doc(client: Client, path: str = "/openapi.json") -> dict[str, Any]:
    response = await client.get(path)  # no API key
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    body: dict[str, Any] = await response.json()
    return body


def _documented(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(method.upper(), path) for path, item in doc["paths"].items() for method in item}


async def test_every_served_route_is_documented_and_nothing_else(make_client: MakeClient) -> None:
    client, edge = await make_client()
    doc = await _doc(client)
    served = registered(edge.app)
    assert _documented(doc) == served
    assert ("GET", "/v1/ws") in served  # the routes the Edge adds itself count too
    assert served <= OPERATIONS.keys()
    assert await _doc(client, "/v1/openapi.json") == doc


def test_an_undocumented_route_is_an_error() -> None:
    app = web.Application()

    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app.router.add_get("/v1/secret", handler)
    with pytest.raises(LookupError, match="/v1/secret"):
        document(app)


async def test_request_bodies_are_the_structs_schemas(client: Client) -> None:
    doc = await _doc(client)
    assert doc["openapi"].startswith("3.1")
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    schemas = doc["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    assert chat["additionalProperties"] is False
    assert {"CompletionRequest", "EmbeddingRequest", "ChatMessage", "Error"} <= schemas.keys()
    # a body the edge accepts is valid against the document, and one it refuses is not
    schema = {"$ref": "#/components/schemas/ChatCompletionRequest", "components": doc["components"]}
    ok = {"model": GEN, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    jsonschema.validate(ok, schema)
    assert (await client.post("/v1/chat/completions", json=ok, headers=AUTH)).status == 200
    bad = {**ok, "temperature": 3.0}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    assert (await client.post("/v1/chat/completions", json=bad, headers=AUTH)).status == 400


async def test_errors_auth_and_public_routes(client: Client) -> None:
    doc = await _doc(client)
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {"type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearerAuth": []}]
    for path in ("/healthz", "/readyz", "/openapi.json"):
        assert doc["paths"][path]["get"]["security"] == []
    # an audit: it said /metrics needs nothing, where SLUICE_OPS_TOKEN makes it answer 401 without the token
    assert doc["paths"]["/metrics"]["get"]["security"] == [{"opsToken": []}, {}]
    assert doc["components"]["securitySchemes"]["opsToken"]["scheme"] == "bearer"
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert "security" not in chat
    error = {"$ref": "#/components/schemas/Error"}
    assert chat["responses"]["4XX"]["content"]["application/json"]["schema"] == error
    assert chat["responses"]["5XX"]["content"]["application/json"]["schema"] == error
    refused = await client.post("/v1/chat/completions", json={})
    jsonschema.validate(await refused.json(), doc["components"]["schemas"]["Error"])


async def test_the_websockets_query_key_and_when_to_retry_are_documented(client: Client) -> None:
    """An audit: the document said nothing of ``/v1/ws``'s ``api_key`` query parameter (a browser's only
    way to pass a key) nor of the ``Retry-After`` a 429 carries."""
    doc = await _doc(client)
    assert doc["components"]["securitySchemes"]["queryKey"] == {
        **doc["components"]["securitySchemes"]["queryKey"],
        "type": "apiKey",
        "in": "query",
        "name": "api_key",
    }
    assert doc["paths"]["/v1/ws"]["get"]["security"] == [{"bearerAuth": []}, {"queryKey": []}]
    for path, method in (("/v1/chat/completions", "post"), ("/v1/embeddings", "post"), ("/v1/ws", "get")):
        limited = doc["paths"][path][method]["responses"]["429"]
        assert set(limited["headers"]) == {"Retry-After", "retry-after-ms"}
    assert "429" not in doc["paths"]["/healthz"]["get"]["responses"]
