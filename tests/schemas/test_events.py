from __future__ import annotations

import ast
import base64
import math
import random
import struct
import sys
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import get_args

import msgspec
import pytest

import schemas
from schemas.codec import DecodeError, decode, encode
from schemas.events import (
    EVENT_TYPES,
    REQUEST_TYPES,
    BatchRef,
    CancelRequested,
    DriftFeatures,
    ErrorInfo,
    Event,
    Float32Vectors,
    GenerationRequested,
    ReplyTo,
    RequestCommon,
    RequestFinished,
    SamplingParams,
    Timings,
    Usage,
    event_type_name,
)
from schemas.examples import example_events
from schemas.ids import (
    Uuid7Generator,
    derive_seed,
    derived_uuid7,
    uuid7,
    uuid7_from_parts,
    uuid7_time,
    uuid7_unix_ms,
)

# --- UUIDv7 -----------------------------------------------------------------------------------------------


def test_uuid7_has_version_7_and_rfc_variant() -> None:
    for _ in range(100):
        value = uuid.UUID(uuid7())
        assert value.version == 7
        assert value.variant == uuid.RFC_4122
        assert (value.int >> 62) & 0b11 == 0b10


def test_uuid7_carries_the_current_unix_milliseconds() -> None:
    before = datetime.now(UTC) - timedelta(milliseconds=1)
    made = uuid7_time(uuid7())
    after = datetime.now(UTC) + timedelta(milliseconds=1)
    assert before <= made <= after


def test_uuid7_is_strictly_increasing_and_unique() -> None:
    made = [uuid7() for _ in range(20_000)]
    assert made == sorted(made)
    assert len(set(made)) == len(made)
    assert [uuid7_unix_ms(v) for v in made] == sorted(uuid7_unix_ms(v) for v in made)


def test_uuid7_stays_monotonic_when_the_clock_stands_still_or_steps_back() -> None:
    now = [1_700_000_000_000_000_000]
    generator = Uuid7Generator(clock=lambda: now[0])
    first = generator()
    second = generator()
    now[0] -= 5_000_000_000  # five seconds back
    third = generator()
    assert first < second < third
    assert uuid7_unix_ms(first) == uuid7_unix_ms(third) == 1_700_000_000_000
    now[0] += 10_000_000_000
    assert uuid7_unix_ms(generator()) == 1_700_000_005_000


def test_uuid7_moves_to_the_next_millisecond_when_the_random_part_overflows() -> None:
    generator = Uuid7Generator(clock=lambda: 1_700_000_000_000_000_000, randbits=lambda n: (1 << n) - 1)
    first = generator()
    second = generator()
    assert first < second
    assert uuid7_unix_ms(second) == uuid7_unix_ms(first) + 1


def test_uuid7_from_parts_lays_out_the_fields() -> None:
    value = uuid7_from_parts(0x0123456789AB, (0xCDE << 62) | 0x3FFF_FFFF_FFFF_FFFF)
    assert value == "01234567-89ab-7cde-bfff-ffffffffffff"
    assert uuid7_unix_ms(value) == 0x0123456789AB


@pytest.mark.parametrize(("unix_ms", "rand"), [(-1, 0), (1 << 48, 0), (0, -1), (0, 1 << 74)])
def test_uuid7_from_parts_rejects_out_of_range_parts(unix_ms: int, rand: int) -> None:
    with pytest.raises(ValueError, match="bits"):
        uuid7_from_parts(unix_ms, rand)


def test_uuid7_unix_ms_rejects_other_versions() -> None:
    with pytest.raises(ValueError, match="version 7"):
        uuid7_unix_ms(str(uuid.uuid4()))


def test_uuid7_unix_ms_reads_the_forms_uuid_accepts_and_nothing_else() -> None:
    value = uuid7_from_parts(0x0123456789AB, 99)
    assert value == str(uuid.UUID(value))
    for form in (value, value.upper(), "{" + value + "}", value.replace("-", ""), "urn:uuid:" + value):
        assert uuid7_unix_ms(form) == 0x0123456789AB
    for bad in (value + "\n", value[:-1] + "g", value[:-1], value.replace("-7", "-4", 1)):
        with pytest.raises(ValueError):  # uuid's own message varies by the flaw
            uuid7_unix_ms(bad)


# --- the sampling seed ------------------------------------------------------------------------------------


def test_seed_is_a_pinned_function_of_the_request_id() -> None:
    """Logged requests carry this value and replays re-run with it (a redelivered or resumed request must
    sample the same tokens as before): it must never change."""
    assert derive_seed("01a20297-4e3d-72a5-8000-000000000000") == 2264185528031817339
    assert derive_seed("0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b") == 2156553938529864395
    assert derive_seed("0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5c") == 8411372545041013622
    assert derive_seed("") == 8203414616412130826
    rid = uuid7()
    assert 0 <= derive_seed(rid) < 2**63
    assert derive_seed(rid) != derive_seed(uuid7())


def test_a_derived_id_is_a_pinned_function_of_its_time_and_key() -> None:
    """Audit entries, batch lines and usage records take derived ids so that a consumer drops a copy (a
    redelivery, a replay) by id: one rebuilt by a later release must get the same id, so the function must
    never change. Its random bits are the top 74 of SHA-256 over the key (``e3b0c44298fc1c149afb...`` for
    ``""``)."""
    assert derived_uuid7(0, "") == "00000000-0000-7e3b-8311-0a63f070526b"
    assert derived_uuid7(1_795_000_000_000, "acme\x00req") == "01a1ee56-5e00-79ac-96ad-e6c67b1d7135"
    assert uuid7_unix_ms(derived_uuid7(1_795_000_000_000, "acme\x00req")) == 1_795_000_000_000
    assert derived_uuid7(1_795_000_000_000, "acme\x00req2") != derived_uuid7(1_795_000_000_000, "acme\x00req")


# --- event types ------------------------------------------------------------------------------------------


def test_event_types_are_the_event_union() -> None:
    assert set(EVENT_TYPES) == set(get_args(Event))
    assert len(EVENT_TYPES) == len(set(EVENT_TYPES))
    assert set(REQUEST_TYPES) <= set(EVENT_TYPES)


def test_type_names_are_unique_snake_case_tags() -> None:
    names = [event_type_name(cls) for cls in EVENT_TYPES]
    assert len(set(names)) == len(names)
    for name in names:
        assert name.isidentifier()
        assert name == name.lower()
    assert event_type_name(CancelRequested) == "cancel_requested"


def test_event_type_name_rejects_a_non_event() -> None:
    with pytest.raises(TypeError, match="RequestCommon"):
        event_type_name(RequestCommon)


def test_schema_versions_start_at_one() -> None:
    assert all(cls.schema_version >= 1 for cls in EVENT_TYPES)


def test_id_and_time_default_to_a_fresh_uuid7_and_now() -> None:
    before = datetime.now(UTC)
    event = CancelRequested(tenant="t", model="m", request_id="r", source="ingest/edge-1", reason="shutdown")
    other = CancelRequested(tenant="t", model="m", request_id="r", source="ingest/edge-1", reason="shutdown")
    assert uuid.UUID(event.id).version == 7
    assert event.id < other.id
    assert event.time.tzinfo is not None
    assert before <= event.time <= datetime.now(UTC)
    assert event.traceparent is None


def test_generation_defaults() -> None:
    event = GenerationRequested(tenant="t", model="m", source="s", model_version="m@1", input_ids=[1])
    assert event.request_id == ""
    assert event.sampling.max_tokens == 16
    assert event.sampling.stop == ()
    assert (event.stream, event.chat, event.deadline, event.reply, event.priority) == (
        False,
        False,
        None,
        None,
        0,
    )


def sampled(sampling: SamplingParams) -> GenerationRequested:
    """A request with ``sampling``, as another producer than the edge may write one."""
    return GenerationRequested(
        tenant="t", model="m", source="s", model_version="m@1", input_ids=[1], sampling=sampling
    )


@pytest.mark.parametrize("seed", [2**63, 2**64, -(2**63) - 1, 10**30])
def test_a_seed_outside_int64_fails_to_decode_so_the_record_is_dead_lettered(seed: int) -> None:
    """As the edge bounds it: ``torch.Generator.manual_seed`` raised on such a seed inside a worker's step."""
    event = sampled(SamplingParams(seed=seed))
    with pytest.raises(DecodeError, match="seed"):
        decode(encode(event))
    for edge in (-(2**63), 2**63 - 1, 0, None):
        fine = msgspec.structs.replace(event, sampling=SamplingParams(seed=edge))
        assert decode(encode(fine)) == fine


@pytest.mark.parametrize(
    "stop", [("a",) * 5, ("",), ("x" * 257,), ("s",) * 800_000], ids=["five", "empty", "long", "800k"]
)
def test_stop_strings_past_the_edges_bounds_fail_to_decode_so_the_record_is_dead_lettered(
    stop: tuple[str, ...],
) -> None:
    """Found by a review: the worker looks for every stop string at every token on the model's thread, and
    one record of 800,000 (8 MB, under the record limit) slowed every request of the worker to 1 s a token;
    an empty one stopped every completion at once. Bounded as the edge bounds them."""
    event = sampled(SamplingParams(stop=stop))
    with pytest.raises(DecodeError, match="stop"):
        decode(encode(event))
    fine = msgspec.structs.replace(event, sampling=SamplingParams(stop=("a", "b" * 256, "c", "d")))
    assert decode(encode(fine)) == fine


@pytest.mark.parametrize("field", ["prompt_tokens", "completion_tokens", "total_tokens"])
def test_a_token_count_past_the_warehouses_uint32_fails_to_decode(field: str) -> None:
    """``request_facts`` keeps token counts as UInt32: 2**32 prompt tokens were stored as 0 (and a cost of
    2**62 tokens modulo 2**64), silently, in the facts and the ledger."""
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, field: 2**32}
    event = RequestFinished(
        tenant="t",
        model="m",
        source="s",
        request_id="r",
        status="completed",
        finish_reason="stop",
        usage=Usage(**usage),
    )
    with pytest.raises(DecodeError, match=field):
        decode(encode(event))
    fine = msgspec.structs.replace(event, usage=Usage(**{**usage, field: 2**32 - 1}))
    assert decode(encode(fine)) == fine


_LONG = "w" * 7_000_000


@pytest.mark.parametrize(
    "change",
    [
        {"worker_id": _LONG},
        {"edge_id": _LONG},
        {"model_version": _LONG},
        {"idempotency_key": _LONG},
        {"shadow_of": _LONG},
        {"error": ErrorInfo(code=_LONG, message="m")},
        {"batch": BatchRef(batch_id=_LONG, custom_id="c", index=0)},
        {"batch": BatchRef(batch_id="b", custom_id="c" * 513, index=0)},
    ],
    ids=["worker", "edge", "version", "key", "shadow", "error-code", "batch-id", "custom-id"],
)
def test_a_terminal_event_with_an_id_past_its_bound_fails_to_decode(change: dict[str, object]) -> None:
    """Each id is a detail of the request's audit entry: a 7 MB ``worker_id`` from another producer made
    an entry no broker takes, and the streams sink stopped on it (a review). The platform makes none over
    256 characters (a custom id: 512, as the edge bounds it); a record with one is dead-lettered."""
    event = finished(status="failed", finish_reason="error")
    with pytest.raises(DecodeError):
        decode(encode(msgspec.structs.replace(event, **change)))
    fine = msgspec.structs.replace(
        event,
        worker_id="w" * 256,
        edge_id="e" * 256,
        model_version="v" * 255,
        error=ErrorInfo(code="c" * 256, message="m" * 10_000),
        batch=BatchRef(batch_id="b" * 256, custom_id="c" * 512, index=0),
    )
    assert decode(encode(fine)) == fine


@pytest.mark.parametrize("field", ["model_version", "idempotency_key", "shadow_of"])
def test_a_request_with_an_id_past_its_bound_fails_to_decode(field: str) -> None:
    """The worker copies these into the terminal event: bounded where they enter the log."""
    event = msgspec.structs.replace(sampled(SamplingParams()), **{field: "x" * 257})
    with pytest.raises(DecodeError, match=field):
        decode(encode(event))
    reply = ReplyTo(topic="replies", partition=0, edge_id="e" * 257)
    with pytest.raises(DecodeError, match="edge_id"):
        decode(encode(msgspec.structs.replace(sampled(SamplingParams()), reply=reply)))


def test_events_are_frozen() -> None:
    event = example_events()[0]
    with pytest.raises(AttributeError):
        event.tenant = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    "when",
    [datetime(2026, 1, 1), datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=2)))],
    ids=["naive", "plus-2h"],
)
def test_times_must_be_utc(when: datetime) -> None:
    with pytest.raises(ValueError, match="time must be an aware UTC datetime"):
        CancelRequested(time=when, tenant="t", model="m", source="s", reason="shutdown")
    with pytest.raises(ValueError, match="deadline must be an aware UTC datetime"):
        GenerationRequested(tenant="t", model="m", source="s", model_version="v", input_ids=[], deadline=when)
    with pytest.raises(ValueError, match="first_token must be an aware UTC datetime"):
        Timings(first_token=when)


# --- examples ---------------------------------------------------------------------------------------------


def test_examples_hold_every_event_type_exactly_once() -> None:
    assert sorted(type(e).__name__ for e in example_events()) == sorted(cls.__name__ for cls in EVENT_TYPES)


def test_examples_are_deterministic() -> None:
    assert example_events() == example_events()


def _none_fields(value: msgspec.Struct, path: str) -> list[str]:
    found = []
    for name in value.__struct_fields__:
        field = getattr(value, name)
        if field is None:
            found.append(f"{path}.{name}")
        elif isinstance(field, msgspec.Struct):
            found += _none_fields(field, f"{path}.{name}")
    return found


LEGACY_FIELDS = ["RequestFinished.embeddings"]
"""Fields only old events carry (their bytes are pinned by older golden snapshots): examples leave them out."""


def test_examples_are_fully_populated() -> None:
    found = [name for event in example_events() for name in _none_fields(event, type(event).__name__)]
    assert found == LEGACY_FIELDS


# --- the package is a leaf --------------------------------------------------------------------------------


def test_schemas_imports_only_stdlib_msgspec_and_itself() -> None:
    allowed = set(sys.stdlib_module_names) | {"msgspec", "schemas", "__future__"}
    package = Path(schemas.__file__).parent
    for source in package.glob("*.py"):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{source.name} imports {roots}"


# --- result vectors ---------------------------------------------------------------------------------------


def finished(**vectors: object) -> RequestFinished:
    event = RequestFinished(
        tenant="acme", model="m", request_id="r", source="test", status="completed", finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=0, total_tokens=1),
    )  # fmt: skip
    return msgspec.structs.replace(event, **vectors)


VECTORS = [[0.25, -0.5, 1e-30], [1.0, 0.0, -3.5]]


def test_packed_vectors_round_trip_through_the_codec_as_base64_float32() -> None:
    event = finished(embeddings_f32=Float32Vectors.pack(VECTORS, 3))
    value = encode(event)
    assert b'"embeddings_f32":{"dim":3,"data":"' in value
    back = decode(value)
    assert isinstance(back, RequestFinished)
    assert back == event
    assert back.vectors() == [[struct.unpack("<f", struct.pack("<f", x))[0] for x in v] for v in VECTORS]
    packed = back.packed_vectors()
    assert packed is not None
    assert len(packed) == 2
    assert packed.rows() == [struct.pack("<3f", *v) for v in VECTORS]


def test_old_events_with_json_floats_read_the_same_through_the_accessors() -> None:
    exact = [[0.25, -0.5, 0.125], [1.0, 0.0, -3.5]]  # float32 values, as workers wrote them
    old, new = finished(embeddings=exact), finished(embeddings_f32=Float32Vectors.pack(exact, 3))
    assert old.vectors() == new.vectors() == exact
    assert old.packed_vectors() == new.packed_vectors()
    assert finished().vectors() is None
    assert finished().packed_vectors() is None


def test_packed_vectors_must_be_whole_rows() -> None:
    with pytest.raises(msgspec.ValidationError, match="not whole rows"):
        msgspec.json.decode(b'{"dim":2,"data":"AAAAAA=="}', type=Float32Vectors)
    with pytest.raises(msgspec.ValidationError, match="Expected `int` >= 1"):
        msgspec.json.decode(b'{"dim":0,"data":""}', type=Float32Vectors)
    with pytest.raises(ValueError, match="a vector of 2 floats"):
        Float32Vectors.pack([[1.0, 2.0, 3.0], [1.0, 2.0]], 3)


def test_packed_vectors_take_a_quarter_of_json_floats() -> None:
    rng = random.Random(7)
    vectors = [[rng.uniform(-0.2, 0.2) for _ in range(384)] for _ in range(64)]
    exact = Float32Vectors.pack(vectors, 384).tolist()  # what a float32 model produces
    as_floats, packed = finished(embeddings=exact), finished(embeddings_f32=Float32Vectors.pack(exact, 384))
    assert len(encode(packed)) * 3.5 < len(encode(as_floats))


def test_a_drift_embedding_past_float32_fails_to_decode_so_the_record_is_dead_lettered() -> None:
    """Found by a review: 1e300 is a finite float64 that decoded, and the warehouse's Float32 column stored
    it as inf, which drift math then met."""
    from schemas.events import FLOAT32_MAX, DriftFeatures

    def with_embedding(vector: list[float]) -> RequestFinished:
        return RequestFinished(
            tenant="t", model="m", source="s", request_id="r", status="completed", finish_reason="stop",
            usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
            features=DriftFeatures(embedding=vector),
        )  # fmt: skip

    with pytest.raises(DecodeError, match="embedding"):
        decode(encode(with_embedding([1e300, 0.25])))
    fine = with_embedding([FLOAT32_MAX, -FLOAT32_MAX, 0.25])
    assert decode(encode(fine)) == fine


def with_features(features: DriftFeatures) -> RequestFinished:
    return RequestFinished(
        tenant="t", model="m", source="s", request_id="r", status="completed", finish_reason="stop",
        usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2), features=features,
    )  # fmt: skip


def test_a_drift_embedding_of_more_than_4096_components_fails_to_decode() -> None:
    """Found by a review: the dimension had no bound, so one 8 MiB terminal event carried 4M components,
    and a few such rows made the drift monitor load hundreds of MiB per window. Such a record is now
    dead-lettered; every golden snapshot's embedding is far below the bound."""
    from schemas.events import EMBEDDING_MAX_DIM

    assert EMBEDDING_MAX_DIM == 4096
    widest = with_features(DriftFeatures(embedding=[0.0] * EMBEDDING_MAX_DIM))
    assert decode(encode(widest)) == widest
    with pytest.raises(DecodeError, match="embedding"):
        decode(encode(with_features(DriftFeatures(embedding=[0.0] * (EMBEDDING_MAX_DIM + 1)))))


def test_a_positive_mean_logprob_fails_to_decode() -> None:
    """A log-probability is at most 0: a producer's positive value made its window a ``data_quality``
    verdict (which outranks ``drift``, and set ``sluice_drift_detected`` to 0) instead of a dead letter."""
    zero = with_features(DriftFeatures(mean_logprob=0.0))
    assert decode(encode(zero)) == zero
    with pytest.raises(DecodeError, match="mean_logprob"):
        decode(encode(with_features(DriftFeatures(mean_logprob=0.5))))


@pytest.mark.parametrize(
    "vectors",
    [
        {"embeddings_f32": {"dim": 2, "data": base64.b64encode(struct.pack("<2f", 1.0, math.nan)).decode()}},
        {"embeddings_f32": {"dim": 1, "data": base64.b64encode(struct.pack("<2f", 0.5, -math.inf)).decode()}},
        {"embeddings": [[1e300, 1.0]]},
        {"embeddings": [[]]},
        {"embeddings": [[0.5, 0.25], [0.5]]},
    ],
    ids=["f32-nan", "f32-inf", "json-past-float32", "empty-row", "ragged"],
)
def test_result_vectors_the_edge_cannot_render_fail_to_decode(vectors: dict[str, object]) -> None:
    """Another producer's NaN or infinity reached the client as ``null`` for a number, and an empty or
    ragged row of the old JSON form was a 500 (a review): such a record is dead-lettered."""
    value = msgspec.json.encode({**msgspec.to_builtins(finished()), **vectors})
    with pytest.raises(DecodeError, match="embeddings"):
        decode(value)


def test_finite_extremes_and_empty_results_still_decode() -> None:
    extremes = [3.4028234663852886e38, -3.4028234663852886e38, 1e-45, -0.0]
    for event in (
        finished(embeddings_f32=Float32Vectors.pack([extremes], 4)),
        finished(embeddings=[extremes, extremes]),
        finished(embeddings=[]),
        finished(embeddings_f32=Float32Vectors(dim=4, data=b"")),
    ):
        assert decode(encode(event)) == event
