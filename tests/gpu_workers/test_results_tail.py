"""What a worker's results tail learns from a record: a terminal event of its model, read from the record's
CloudEvents headers without decoding the body, and from the body when a record has no such headers."""

from __future__ import annotations

from confluent_kafka import Message
from confluent_kafka._types import HeadersType

from gpu_workers.terminal import finished_by
from schemas.codec import encode, headers
from schemas.events import CancelRequested, RequestFinished, Usage


def _finished(model: str = "demo-gpt", source: str = "gpu_workers/another-worker") -> RequestFinished:
    return RequestFinished(
        tenant="acme",
        model=model,
        request_id="req-1",
        source=source,
        status="completed",
        finish_reason="length",
        usage=Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7),
    )


def _headers(event: RequestFinished | CancelRequested) -> HeadersType:
    return list[tuple[str, str | bytes | None]](headers(event))


def _record(
    event: RequestFinished | CancelRequested, *, with_headers: bool = True, body: bytes | None = None
) -> Message:
    return Message(
        topic="t.results",
        value=encode(event) if body is None else body,
        headers=_headers(event) if with_headers else None,
    )


def test_a_terminal_event_of_the_model_is_read_from_its_headers_alone() -> None:
    event = _finished()
    # the body is not read: junk there changes nothing when the headers say what the record is
    assert finished_by(_record(event, body=b"not json"), "demo-gpt") == "req-1"
    assert finished_by(_record(event), "all-minilm-l6-v2") is None  # another model's


def test_headers_given_as_text_or_as_a_dict_are_read_alike() -> None:
    event = _finished()
    as_text: HeadersType = [(key, value.decode()) for key, value in headers(event)]
    assert finished_by(Message(value=b"", headers=as_text), "demo-gpt") == "req-1"
    assert finished_by(Message(value=b"", headers=dict(headers(event))), "demo-gpt") == "req-1"


def test_the_workers_own_results_are_skipped() -> None:
    own = _finished(source="gpu_workers/me")
    assert finished_by(_record(own), "demo-gpt", skip_source="gpu_workers/me") is None
    assert finished_by(_record(own, with_headers=False), "demo-gpt", skip_source="gpu_workers/me") is None
    assert finished_by(_record(own), "demo-gpt", skip_source="gpu_workers/other") == "req-1"


def test_a_record_without_headers_is_decoded_and_junk_is_ignored() -> None:
    assert finished_by(_record(_finished(), with_headers=False), "demo-gpt") == "req-1"
    assert finished_by(_record(_finished(model="x"), with_headers=False), "demo-gpt") is None
    assert finished_by(Message(value=b"{not json"), "demo-gpt") is None
    cancel = CancelRequested(
        tenant="acme", model="demo-gpt", request_id="req-1", source="ingest/edge", reason="client_cancel"
    )
    assert finished_by(_record(cancel), "demo-gpt") is None  # not a terminal event
    assert finished_by(_record(cancel, with_headers=False), "demo-gpt") is None


def test_a_subject_that_is_not_utf8_falls_back_to_the_body_and_never_raises() -> None:
    """Such a record (another tool's) raised UnicodeDecodeError, which stopped the results tail, and with it
    the worker, and kept every worker of the model from starting while the record was retained."""
    event = _finished()
    bad: HeadersType = [(k, b"\xff\xfe" if k == "ce_subject" else v) for k, v in headers(event)]
    assert finished_by(Message(value=b"not json", headers=bad), "demo-gpt") is None
    assert finished_by(Message(value=encode(event), headers=bad), "demo-gpt") == "req-1"
    assert finished_by(Message(value=encode(_finished(model="x")), headers=bad), "demo-gpt") is None
