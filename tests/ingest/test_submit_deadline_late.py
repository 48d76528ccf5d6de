"""What follows a request whose deadline passed before the log had it (its client has had its 504).

Found by a review of the deadline that starts at submit: the first cut cancelled the wait for the log at the
deadline, but the record stays in the producer's queue and its delivery goes on (librdkafka's message
timeout, ~30 s). When that delivery then failed nobody heard it: the Idempotency-Key's claim was never
withdrawn (every retry with the key failed for its 24 h although the broker was back) and the tenant stayed
charged prompt + max_tokens and a request. And a deadline that passed before the submit even started (a
key's lookup waiting on a claims reader catching up) published the request anyway, then cancelled it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ingest.auth import DEMO_KEY, Tenant, TenantDirectory, hash_key
from ingest.errors import GatewayUnavailable
from tests.ingest.conftest import AUTH, GEN, MakeClient, eventually
from tests.ingest.fake_gateway import FakeGateway

DELIVERY_S = 1.5  # the producer's delivery timeout (librdkafka's message.timeout.ms), shortened
BODY = {"model": GEN, "prompt": "hello world", "max_tokens": 4}


class PartitionAway(FakeGateway):
    """The requests topic's partition leader is away: a produce is queued and its delivery fails after
    DELIVERY_S (the idempotency topic, elsewhere, still takes claims). The awaited delivery is abandoned
    with its awaiting task, as the real producer's is, and its outcome arrives on a future nobody awaits."""

    away = True
    claims_behind_s = 0.0
    submit_delay_s = 0.0

    async def submit(self, event: Any) -> Any:
        if not self.away:
            await asyncio.sleep(self.submit_delay_s)
            return await super().submit(event)
        loop = asyncio.get_running_loop()
        delivery: asyncio.Future[None] = loop.create_future()

        def failed() -> None:
            if not delivery.done():
                delivery.set_exception(GatewayUnavailable("the request could not be published: timed out"))

        loop.call_later(DELIVERY_S, failed)
        await delivery
        raise AssertionError("unreachable")

    async def lookup_idempotent(self, tenant: str, key: str) -> Any:
        await asyncio.sleep(self.claims_behind_s)  # the claims reader catching up after a restart
        return await super().lookup_idempotent(tenant, key)


@pytest.fixture
def tenants() -> TenantDirectory:
    """The demo tenant with per-minute limits (an unlimited tenant is not counted at all)."""
    return TenantDirectory(
        {"demo": Tenant(key_sha256=[hash_key(DEMO_KEY)], requests_per_min=100, tokens_per_min=10_000)}
    )


@pytest.fixture
async def gateway() -> AsyncIterator[PartitionAway]:
    fake = PartitionAway()
    yield fake
    fake.release.set()
    await fake.close()


def charged(edge: Any) -> dict[Any, Any]:
    ledger = edge.ctx.admission.ledger
    return {key: ledger.used(key) for key in list(ledger._own)}


async def test_a_keyed_request_that_never_reached_the_log_does_not_strand_its_key(
    make_client: MakeClient, gateway: PartitionAway
) -> None:
    client, _ = await make_client()
    headers = {**AUTH, "Idempotency-Key": "order-42", "X-Request-Timeout": "0.3"}
    first = await client.post("/v1/completions", json=BODY, headers=headers)
    assert first.status == 504  # at its deadline, not after the delivery failed
    await asyncio.sleep(DELIVERY_S + 0.3)  # the delivery failed: the request is not on the log
    gateway.away = False  # the partition is back
    retry = await client.post("/v1/completions", json=BODY, headers={**headers, "X-Request-Timeout": "5"})
    assert retry.status == 200, await retry.text()


async def test_a_request_that_never_reached_the_log_is_not_charged(
    make_client: MakeClient, gateway: PartitionAway
) -> None:
    client, edge = await make_client()
    response = await client.post("/v1/completions", json=BODY, headers={**AUTH, "X-Request-Timeout": "0.3"})
    assert response.status == 504
    await asyncio.sleep(DELIVERY_S + 0.3)
    await eventually(lambda: not edge.ctx.admission.flights)
    assert all(requests == 0 and tokens == 0 for requests, tokens, _ in charged(edge).values()), charged(edge)
    assert gateway.cancels == []  # nothing on the log to cancel


async def test_a_request_the_log_took_after_its_deadline_is_cancelled_there(
    make_client: MakeClient, gateway: PartitionAway
) -> None:
    gateway.away = False
    gateway.submit_delay_s = 0.6  # the log acknowledges it after its deadline
    client, edge = await make_client()
    response = await client.post("/v1/completions", json=BODY, headers={**AUTH, "X-Request-Timeout": "0.3"})
    assert response.status == 504
    assert gateway.cancels == []  # not before it is on the log
    await eventually(lambda: len(gateway.cancels) == 1)
    ((submitted,), (cancel,)) = gateway.submitted, gateway.cancels
    assert (cancel.request_id, cancel.model, cancel.reason) == (submitted.request_id, GEN, "client_cancel")
    await eventually(lambda: not edge.ctx.admission.flights)


async def test_a_deadline_before_the_submit_publishes_nothing_cancels_nothing_and_charges_nothing(
    make_client: MakeClient, gateway: PartitionAway
) -> None:
    gateway.away = False
    gateway.claims_behind_s = 1.0
    client, edge = await make_client()
    headers = {**AUTH, "Idempotency-Key": "k-1", "X-Request-Timeout": "0.3"}
    response = await client.post("/v1/completions", json=BODY, headers=headers)
    assert response.status == 504
    await asyncio.sleep(1.2)  # the lookup has answered by now
    await eventually(lambda: not edge.ctx.admission.flights)
    assert gateway.submitted == []  # never published
    assert gateway.cancels == []
    assert all(requests == 0 and tokens == 0 for requests, tokens, _ in charged(edge).values()), charged(edge)
