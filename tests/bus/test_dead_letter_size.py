"""A dead letter always fits in a record, however large the junk it carries (no broker needed)."""

from __future__ import annotations

import base64

import pytest

from bus.dead_letter import DEAD_LETTER_KEEP_BYTES, dead_letter_event, dead_letter_reason
from schemas.codec import MAX_RECORD_BYTES, DecodeError, decode, encode
from schemas.events import DeadLetter
from schemas.examples import example_events


def _letter(value: bytes, header_list: list[tuple[str, str | bytes | None]]) -> DeadLetter:
    return dead_letter_event("test", ("t.requests.m", 0, 7), value, DecodeError("bad"), header_list)


def test_a_small_record_goes_whole() -> None:
    letter = _letter(b"{junk", [("ce_type", b"x")])
    assert base64.b64decode(letter.payload_b64) == b"{junk"
    assert letter.headers == {"ce_type": "x"}
    assert letter.reason == "bad"


def test_a_record_near_the_limit_is_cut_so_its_letter_fits() -> None:
    """Found by the fuzz suite: the letter of a 990 kB record was over the limit, failed to produce and
    stopped the worker."""
    value = b"x" * (MAX_RECORD_BYTES - 10_000)
    letter = _letter(value, [("h", b"y" * 200_000)])
    assert len(encode(letter)) < MAX_RECORD_BYTES
    assert base64.b64decode(letter.payload_b64) == value[:DEAD_LETTER_KEEP_BYTES]
    assert f"of {len(value)} bytes" in letter.reason
    assert letter.headers == {}


def test_a_letter_fits_whatever_its_reason_quotes_and_its_headers_escape_to() -> None:
    """Found by review: a header check's reason quotes the header whole (``\\x01`` as four characters), and
    JSON writes a control character as a six-byte escape, so a 300 kB header made a 1.5 MB letter, which
    Kafka refused: the worker failed on it at every start."""
    control = b"\x01" * 300_000
    reason = DecodeError(f"header ce_type: expected 'x', got {control!r}")
    letter = dead_letter_event("test", ("t.requests.m", 0, 7), b"{}", reason, [("ce_type", control)])
    assert len(encode(letter)) < MAX_RECORD_BYTES
    assert "reason cut" in letter.reason
    assert letter.headers == {}
    big = b"x" * 600_000
    letter = dead_letter_event(
        "test", ("t.requests.m", 0, 7), big, DecodeError("bad"), [("h", b"\x01" * 62_000)]
    )
    assert len(encode(letter)) < MAX_RECORD_BYTES
    assert "headers left out" in letter.reason


@pytest.mark.parametrize(
    "value",
    [
        encode(example_events()[0]).replace(b'"tenant":"', b'"tenant":"\xff', 1),
        encode(example_events()[0])[:-1] + b',"zz":' + b"[" * 100_000 + b"}",
    ],
    ids=["a string that is not UTF-8", "nested too deep"],
)
def test_json_msgspec_cannot_read_is_counted_as_bad_json(value: bytes) -> None:
    with pytest.raises(DecodeError) as caught:
        decode(value)
    assert dead_letter_reason(value, caught.value) == "bad_json"
