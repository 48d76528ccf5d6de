"""Which of the edge's counters a request's end lands in: the availability SLI's outcomes
(``sluice_requests_total``) or the client's refusals (``sluice_rejections_total``)."""

from __future__ import annotations

import itertools

from prometheus_client import REGISTRY

from ingest.observe import RequestWatch
from schemas.events import CLIENT_ERROR_CODES, ErrorInfo, GenerationRequested, RequestFinished, Usage

_IDS = itertools.count()


def request(tenant: str) -> GenerationRequested:
    return GenerationRequested(
        tenant=tenant,
        model="demo-gpt",
        request_id=f"r{next(_IDS)}",
        source="test",
        model_version="v1",
        input_ids=[1],
    )


def failed(event: GenerationRequested, code: str) -> RequestFinished:
    return RequestFinished(
        tenant=event.tenant,
        model=event.model,
        request_id=event.request_id,
        source="gpu/worker-0",
        status="failed",
        finish_reason="error",
        usage=Usage(prompt_tokens=1, completion_tokens=0, total_tokens=1),
        error=ErrorInfo(code=code, message="no"),
    )


def counted(tenant: str) -> tuple[float, float]:
    """This tenant's failed requests and 400 refusals of demo-gpt (all codes)."""
    requests = REGISTRY.get_sample_value(
        "sluice_requests_total", {"tenant": tenant, "model": "demo-gpt", "version": "v1", "outcome": "failed"}
    )
    refused = sum(
        REGISTRY.get_sample_value(
            "sluice_rejections_total",
            {"tenant": tenant, "model": "demo-gpt", "status": "400", "reason": code},
        )
        or 0.0
        for code in CLIENT_ERROR_CODES
    )
    return requests or 0.0, refused


def served(event: GenerationRequested, result: RequestFinished) -> None:
    with RequestWatch(event, stream=False, t0=0.0) as watch:
        watch.delivered(result)


def test_a_client_error_the_worker_found_is_a_refusal_not_a_failed_request() -> None:
    """Found by review: a prompt longer than the worker's batch budget (under a long-context model's context,
    which the edge checked) ends ``context_length_exceeded``. The client is answered 400, but the edge counted
    ``outcome="failed"``, which the availability SLI's rules count as the service's failure: one tenant's
    over-long prompts paged and spent every tenant's error budget (docs/slo.md: no 4xx is in any SLI)."""
    tenant = "observe-client-errors"
    for code in sorted(CLIENT_ERROR_CODES):
        event = request(tenant)
        served(event, failed(event, code))
    assert counted(tenant) == (0.0, len(CLIENT_ERROR_CODES))


def test_a_failure_of_the_service_is_a_failed_request() -> None:
    tenant = "observe-server-errors"
    event = request(tenant)
    served(event, failed(event, "worker_error"))
    assert counted(tenant) == (1.0, 0.0)
