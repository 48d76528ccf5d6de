"""A terminal event's HTTP answer: a client's error code is the client's 4xx, any other failure a 5xx."""

from __future__ import annotations

import pytest

from ingest.errors import ContextLengthExceeded, InvalidRequest, UpstreamFailed, from_finished
from schemas.events import CLIENT_ERROR_CODES, ErrorInfo, RequestFinished, Usage


def failed(code: str, *, retriable: bool = False) -> RequestFinished:
    return RequestFinished(
        tenant="acme",
        model="demo-gpt",
        request_id="r1",
        source="gpu/worker-0",
        status="failed",
        finish_reason="error",
        usage=Usage(prompt_tokens=1, completion_tokens=0, total_tokens=1),
        error=ErrorInfo(code=code, message="no", retriable=retriable),
    )


def test_a_prompt_too_long_for_the_worker_is_the_edges_own_400() -> None:
    refused = from_finished(failed("context_length_exceeded"))
    assert isinstance(refused, ContextLengthExceeded)
    assert (refused.status, refused.code) == (400, "context_length_exceeded")


@pytest.mark.parametrize("code", sorted(CLIENT_ERROR_CODES))
def test_every_client_error_code_is_a_4xx_and_no_other_failure_is(code: str) -> None:
    """The codes the SLIs leave out (schemas.events.CLIENT_ERROR_CODES) are exactly those answered 4xx."""
    refused = from_finished(failed(code))
    assert isinstance(refused, InvalidRequest)
    assert (refused.status, refused.code) == (400, code)
    assert failed(code).failed_by_client()


@pytest.mark.parametrize("code", ["worker_error", "invalid_request", "out_of_memory"])
def test_a_failure_of_the_service_is_a_5xx(code: str) -> None:
    answer = from_finished(failed(code))
    assert isinstance(answer, UpstreamFailed)
    assert answer.status == 500
    assert not failed(code).failed_by_client()
