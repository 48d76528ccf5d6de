"""A request's deadline bounds the wait for the log to take it too.

Found by a review on a real broker: the deadline started once the log had acknowledged the request
(:meth:`ingest.dispatch.Dispatcher.guard`), so while the broker was away (stopped, restarting, slow) a
request with ``X-Request-Timeout: 3`` waited on librdkafka's 30 s delivery timeout: a 503 after 30.3 s with
the broker down, a 504 after 25.3 s with it back after 21 s, its client's connection and place in flight
held all along."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.ingest.conftest import AUTH, GEN, MakeClient, eventually
from tests.ingest.fake_gateway import FakeGateway
from tests.ingest.test_ws import request

PUBLISH_S = 4.0  # how long the log takes to acknowledge the request (a broker restarting)


class SlowLog(FakeGateway):
    publish_s = PUBLISH_S

    async def submit(self, event: Any) -> Any:
        await asyncio.sleep(self.publish_s)
        return await super().submit(event)


@pytest.fixture
async def gateway() -> AsyncIterator[SlowLog]:
    fake = SlowLog()
    yield fake
    fake.release.set()
    await fake.close()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_request_is_answered_by_its_deadline_while_the_log_has_not_taken_it(
    make_client: MakeClient, gateway: FakeGateway, stream: bool
) -> None:
    client, edge = await make_client()
    began = time.monotonic()
    response = await client.post(
        "/v1/completions",
        json={"model": GEN, "prompt": "hello world", "max_tokens": 4, "stream": stream},
        headers={**AUTH, "X-Request-Timeout": "0.5"},
    )
    body = await response.json()
    took = time.monotonic() - began
    assert took < PUBLISH_S / 2, f"asked for 0.5 s, answered {response.status} after {took:.1f} s"
    assert (response.status, body["error"]["code"]) == (504, "timeout")
    await eventually(lambda: len(gateway.cancels) == 1)  # in case the log takes it later
    (cancel,) = gateway.cancels
    assert (cancel.model, cancel.reason) == (GEN, "client_cancel")
    await eventually(lambda: not edge.ctx.admission.flights)  # its place in flight given back


async def test_a_websocket_request_is_answered_by_its_deadline_while_the_log_has_not_taken_it(
    make_client: MakeClient, gateway: FakeGateway
) -> None:
    client, _ = await make_client()
    async with client.ws_connect("/v1/ws", headers=AUTH) as ws:
        began = time.monotonic()
        body = {"model": GEN, "prompt": "hello", "max_tokens": 4, "timeout": 0.5}
        await ws.send_json(request("a", body, "completions"))
        frame = await ws.receive_json(timeout=PUBLISH_S * 2)
        took = time.monotonic() - began
    assert took < PUBLISH_S / 2, f"asked for 0.5 s, answered {frame} after {took:.1f} s"
    assert (frame["type"], frame["error"]["code"]) == ("error", "timeout")


async def test_the_wait_for_the_log_counts_against_the_deadline_after_it(
    make_client: MakeClient, gateway: SlowLog
) -> None:
    """A request the log took late has only what is left of its deadline to finish in, not a fresh one."""
    gateway.publish_s = 0.6
    gateway.hold_after = 1  # a token, then nothing: it runs to its deadline
    client, _ = await make_client()
    began = time.monotonic()
    response = await client.post(
        "/v1/completions",
        json={"model": GEN, "prompt": "hello world", "max_tokens": 4},
        headers={**AUTH, "X-Request-Timeout": "1"},
    )
    took = time.monotonic() - began
    assert response.status == 504
    assert took < 1.4, f"a 1 s deadline answered after {took:.2f} s (the wait for the log not counted)"
