from __future__ import annotations

import json
from datetime import timedelta, timezone
from pathlib import Path
from typing import Any

import jsonschema  # no stubs in the dev dependencies
import msgspec
import pytest

from schemas.codec import (
    EVENT_TYPES,
    MAX_RECORD_BYTES,
    RECORD_HEADROOM_BYTES,
    DecodeError,
    Event,
    HeaderValue,
    ce_type,
    decode,
    encode,
    event_type_name,
    fits_record,
    headers,
    kafka_key,
)
from schemas.events import (
    BatchItemRequested,
    BudgetStateChanged,
    BurnRateCrossed,
    CancelRequested,
    DeadLetter,
    DeploymentChanged,
    DriftRebaselined,
    DriftReport,
    Envelope,
    GenerationRequested,
    TokenChunk,
    WorkerReady,
)
from schemas.examples import example_events
from schemas.jsonschema import event_schema, export_json_schemas, schema_file_name


def _example(cls: type[Any]) -> Any:
    (found,) = [e for e in example_events() if type(e) is cls]
    return found


def _body(cls: type[Any]) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(encode(_example(cls)))
    return body


def _ids(event: Event) -> str:
    return event_type_name(type(event))


# --- round trip -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_round_trip_returns_an_equal_event_of_the_same_type(event: Event) -> None:
    value = encode(event)
    decoded = decode(value, headers(event))
    assert type(decoded) is type(event)
    assert decoded == event
    assert encode(decoded) == value


def test_round_trip_of_defaults() -> None:
    event = GenerationRequested(tenant="t", model="m", source="s", model_version="v", input_ids=[1, 2])
    assert decode(encode(event)) == event


def test_encoding_is_compact_json_with_the_tag_first_and_sorted_dict_keys() -> None:
    event = DeploymentChanged(
        tenant="t",
        model="m",
        source="s",
        version="v2",
        action="deploy",
        traffic={"v2": 0.1, "v1": 0.9},
        reason="",
    )
    value = encode(event)
    assert value.startswith(b'{"type":"deployment_changed","id":"')
    assert b'"traffic":{"v1":0.9,"v2":0.1}' in value
    assert b" " not in value.replace(b'"reason":""', b"")


def test_decode_accepts_bytearray_and_memoryview() -> None:
    event = _example(TokenChunk)
    assert decode(bytearray(encode(event))) == event
    assert decode(memoryview(encode(event))) == event


def test_decode_ignores_unknown_fields() -> None:
    body = _body(TokenChunk) | {"added_in_a_later_release": [1, 2]}
    assert decode(json.dumps(body).encode()) == _example(TokenChunk)


# --- headers ----------------------------------------------------------------------------------------------


def test_headers_are_cloudevents_binary_binding() -> None:
    event = _example(GenerationRequested)
    assert headers(event) == [
        ("ce_specversion", b"1.0"),
        ("ce_id", event.id.encode()),
        ("ce_type", b"dev.sluicegate.generation_requested.v1"),
        ("ce_source", b"ingest/edge-1"),
        ("ce_time", b"2026-11-22T09:30:00.125000Z"),
        ("ce_subject", b"req-0001"),
        ("content-type", b"application/json"),
        ("ce_tenant", b"acme"),
        ("ce_model", b"demo-gpt"),
        ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("tracestate", b"sluice=edge-1"),
    ]


def test_headers_leave_out_an_empty_subject_and_absent_trace_context() -> None:
    event = BudgetStateChanged(
        tenant="acme", model="", source="streams/ledger", limit_micros=1, spent_micros=0, exhausted=False
    )
    keys = [key for key, _ in headers(event)]
    assert "ce_subject" not in keys
    assert "traceparent" not in keys
    assert "tracestate" not in keys


@pytest.mark.parametrize("cls", EVENT_TYPES, ids=lambda cls: cls.__name__)
def test_ce_type_names_the_tag_and_version(cls: type[Envelope]) -> None:
    assert ce_type(cls) == f"dev.sluicegate.{event_type_name(cls)}.v1"


def test_decode_accepts_consistent_headers_as_str_or_bytes_and_ignores_others() -> None:
    event = _example(TokenChunk)
    received: list[tuple[str, HeaderValue]] = [(k, v.decode()) for k, v in headers(event)]
    received += [("content-type", "application/json; charset=utf-8"), ("x-retry", None), ("ce_time", b"junk")]
    assert decode(encode(event), received) == event


# --- decode errors: always DecodeError, never a partial object --------------------------------------------


def _json(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _without(cls: type[Any], field: str) -> bytes:
    body = _body(cls)
    del body[field]
    return _json(body)


def _with(cls: type[Any], path: list[str | int], value: Any) -> bytes:
    body = _body(cls)
    target: Any = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return _json(body)


BAD_VALUES: list[tuple[str, bytes, str]] = [
    ("unknown-type", _with(TokenChunk, ["type"], "token_chunk_v9"), "$.type"),
    ("no-type", _without(TokenChunk, "type"), "type"),
    ("missing-field", _without(GenerationRequested, "input_ids"), "input_ids"),
    ("missing-envelope-field", _without(CancelRequested, "tenant"), "tenant"),
    ("wrong-type", _with(GenerationRequested, ["input_ids"], "15496 11"), "$.input_ids"),
    ("wrong-item-type", _with(GenerationRequested, ["input_ids", 1], "x"), "$.input_ids[1]"),
    ("wrong-nested-type", _with(GenerationRequested, ["sampling", "top_k"], "40"), "$.sampling.top_k"),
    ("bad-literal", _with(CancelRequested, ["reason"], "bored"), "$.reason"),
    ("below-minimum", _with(GenerationRequested, ["sampling", "max_tokens"], 0), "$.sampling.max_tokens"),
    ("not-uuid7", _with(CancelRequested, ["id"], "00000000-0000-4000-8000-000000000000"), "$.id"),
    ("naive-time", _with(CancelRequested, ["time"], "2026-11-22T09:30:00"), "$.time"),
    ("non-utc-time", _with(CancelRequested, ["time"], "2026-11-22T09:30:00+02:00"), "UTC"),
    ("non-utc-nested", _with(DriftReport, ["window_end"], "2026-11-22T09:30:00-01:00"), "UTC"),
    ("truncated", encode(_example(TokenChunk))[:-3], "malformed"),
    ("empty", b"", "no value (a tombstone?)"),  # the sink's and replay's reading of a tombstone
    ("binary-junk", b"\xff\xfe\x00\x01\x9c", "malformed"),
    ("trailing-garbage", encode(_example(TokenChunk)) + b"}", "malformed"),
    # msgspec raises UnicodeDecodeError for it, not its DecodeError: it stopped every consumer of the record
    (
        "string-not-utf8",
        encode(_example(CancelRequested)).replace(b'"tenant":"', b'"tenant":"\xff'),
        "not UTF-8",
    ),
    ("tenant-too-long", _with(CancelRequested, ["tenant"], "t" * 257), "$.tenant"),
    ("tracestate-too-long", _with(CancelRequested, ["tracestate"], "a=" + "b" * 1023), "$.tracestate"),
    # over what its warehouse column holds: it wrapped there (an index 2**64 + 1 stored as line 1)
    ("index-over-int64", _with(BatchItemRequested, ["index"], 2**64 + 1), "$.index"),
    ("attempt-over-uint32", _with(BatchItemRequested, ["attempt"], 2**32), "$.attempt"),
    ("step-over-uint16", _with(DeploymentChanged, ["step"], 70_000), "$.step"),
    ("json-null", b"null", "Expected `object`"),
    ("json-array", b"[1, 2]", "Expected `object`"),
]


@pytest.mark.parametrize(("value", "message"), [c[1:] for c in BAD_VALUES], ids=[c[0] for c in BAD_VALUES])
def test_decode_rejects_bad_values_with_decode_error(value: bytes, message: str) -> None:
    with pytest.raises(DecodeError) as info:
        decode(value)
    assert type(info.value) is DecodeError
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)


def test_decode_rejects_a_tombstone() -> None:
    with pytest.raises(DecodeError, match="tombstone"):
        decode(None)


def _replace_header(event: Event, key: str, value: HeaderValue) -> list[tuple[str, HeaderValue]]:
    received: list[tuple[str, HeaderValue]] = [(k, v) for k, v in headers(event) if k != key]
    return [*received, (key, value)]


BAD_HEADERS: list[tuple[str, type[Any], str, HeaderValue]] = [
    ("other-type", TokenChunk, "ce_type", b"dev.sluicegate.request_finished.v1"),
    ("other-version", TokenChunk, "ce_type", b"dev.sluicegate.token_chunk.v2"),
    ("type-as-str", TokenChunk, "ce_type", "dev.sluicegate.cancel_requested.v1"),
    ("no-value", TokenChunk, "ce_type", None),
    ("other-id", TokenChunk, "ce_id", b"01a20297-4e41-72a5-8000-0000000000ff"),
    ("other-tenant", TokenChunk, "ce_tenant", b"evil-corp"),
    ("other-subject", TokenChunk, "ce_subject", b"req-9999"),
    ("subject-on-control", DeploymentChanged, "ce_subject", b"req-0001"),
    ("specversion", TokenChunk, "ce_specversion", b"0.3"),
    ("structured-mode", TokenChunk, "content-type", b"application/cloudevents+json"),
]


@pytest.mark.parametrize(
    ("cls", "key", "value"), [c[1:] for c in BAD_HEADERS], ids=[c[0] for c in BAD_HEADERS]
)
def test_decode_rejects_headers_that_disagree_with_the_body(
    cls: type[Any], key: str, value: HeaderValue
) -> None:
    event = _example(cls)
    with pytest.raises(DecodeError) as info:
        decode(encode(event), _replace_header(event, key, value))
    assert type(info.value) is DecodeError
    assert key in str(info.value)


# --- keys -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "key"),
    [
        (GenerationRequested, b"acme"),
        (TokenChunk, b"acme"),
        (CancelRequested, b"acme"),
        (BudgetStateChanged, b"budget:acme"),
        (DeploymentChanged, b"deployment:demo-gpt"),
        (BurnRateCrossed, b"burn:demo-gpt:ttft-p99:1h"),
        (DriftReport, b"drift:demo-gpt"),
        (WorkerReady, b"ready:demo-gpt:530b56af490a"),
        (DriftRebaselined, b"rebaseline:demo-gpt:530b56af490a"),
        (DeadLetter, b"sluice.requests.demo-gpt:2"),
    ],
    ids=lambda value: getattr(value, "__name__", None),
)
def test_kafka_key(cls: type[Any], key: bytes) -> None:
    assert kafka_key(_example(cls)) == key


# --- JSON Schema export -----------------------------------------------------------------------------------


def test_exported_json_schemas_validate_the_encoded_examples(tmp_path: Path) -> None:
    written = export_json_schemas(tmp_path)
    assert sorted(p.name for p in written) == sorted(
        [schema_file_name(cls) for cls in EVENT_TYPES] + ["index.json"]
    )
    index = json.loads((tmp_path / "index.json").read_text())
    assert {entry["ce_type"] for entry in index["events"]} == {ce_type(cls) for cls in EVENT_TYPES}
    for event in example_events():
        schema = json.loads((tmp_path / schema_file_name(type(event))).read_text())
        assert schema["$id"].endswith(f"/{event_type_name(type(event))}/v1.schema.json")
        assert schema["title"] == ce_type(type(event))
        jsonschema.Draft202012Validator.check_schema(schema)
        validator = jsonschema.Draft202012Validator(schema)
        validator.validate(msgspec.json.decode(encode(event)))
        broken = json.loads(encode(event))
        del broken["source"]
        assert not validator.is_valid(broken)
        assert not validator.is_valid(broken | {"source": "s", "type": "something_else"})


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_a_time_the_exported_schema_accepts_is_one_the_codec_accepts(event: Event) -> None:
    """Every time was a bare ``format: date-time``, which any RFC 3339 offset meets, while the codec refuses
    all but UTC: a producer validating against the schema and writing local time had every event
    dead-lettered (a review)."""
    validator = jsonschema.Draft202012Validator(
        event_schema(type(event)), format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    body = json.loads(encode(event))
    local = event.time.astimezone(timezone(timedelta(hours=1))).isoformat()
    assert not validator.is_valid(body | {"time": local})
    with pytest.raises(DecodeError):
        decode(json.dumps(body | {"time": local}).encode())
    for utc in (event.time.isoformat(), event.time.isoformat().replace("+00:00", "Z")):
        validator.validate(body | {"time": utc})
        assert decode(json.dumps(body | {"time": utc}).encode()) == event


def test_json_schema_export_is_deterministic(tmp_path: Path) -> None:
    first = {p.name: p.read_bytes() for p in export_json_schemas(tmp_path / "a")}
    second = {p.name: p.read_bytes() for p in export_json_schemas(tmp_path / "b")}
    assert first == second


def test_an_unknown_field_nested_too_deep_is_a_decode_error() -> None:
    """Found by the fuzz suite: msgspec's RecursionError skipping the field escaped decode_or_junk
    and stopped the worker's consumer instead of dead-lettering the record."""
    valid = encode(example_events()[0])
    for junk in (b"[" * 100_000, b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(DecodeError, match="nested too deep"):
            decode(valid[:-1] + b',"zz":' + junk + b"}")


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_a_records_key_and_headers_count_against_the_record_limit_whatever_its_envelope_holds(
    event: Event,
) -> None:
    """A worker copies a request's tenant, model, id and trace context into its terminal event's key and
    headers. A 340 KB tenant made a terminal event no broker takes, and the worker died producing it (a
    fuzz audit): the envelope's strings are bounded since. Bounded in characters, not bytes: at 4 bytes a
    character they took ~11 KB beside the value, over the room the limit used to leave for them, and a
    terminal event just under the limit was refused by the producer (the worker died again, at each
    redelivery; an audit). ``fits_record`` counts the key and headers it is given."""
    wide = "\U0001d531"  # 4 bytes in UTF-8
    longest = {name: wide * 256 for name in ("tenant", "model", "request_id", "source")}
    traces = {"traceparent": wide * 1024, "tracestate": wide * 1024}
    widest = msgspec.structs.replace(event, **longest, **traces)
    assert decode(encode(widest)) == widest  # the bounds admit it
    key, head = kafka_key(widest), headers(widest)
    extra = len(key) + sum(len(name) + len(value or b"") for name, value in head)
    assert extra > RECORD_HEADROOM_BYTES  # what the value alone was once checked against
    value = b"x" * (MAX_RECORD_BYTES - RECORD_HEADROOM_BYTES)
    assert fits_record(value)
    assert not fits_record(value, key, head)
    assert fits_record(value[:-extra], key, head)
    assert not fits_record(value[: -extra + 1], key, head)
