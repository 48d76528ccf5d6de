"""Pins today's encoded bytes of every example event, so an incompatible change to a contract fails.

``tests/schemas/golden/<type>.json`` holds ``encode(example)`` plus one trailing newline. The test asserts
both directions: today's encoder writes exactly those bytes, and today's decoder reads them back into the
example. When a change is deliberate (a new field, a bumped ``schema_version``), regenerate and review the
diff::

    python -m tests.schemas.test_compat --regen
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from schemas.codec import EVENT_TYPES, Event, decode, encode, event_type_name, headers
from schemas.events import DriftReport, RequestFinished
from schemas.examples import example_events

GOLDEN = Path(__file__).parent / "golden"


def golden_path(event: Event) -> Path:
    return GOLDEN / f"{event_type_name(type(event))}.json"


def golden_bytes(event: Event) -> bytes:
    return encode(event) + b"\n"


def regen() -> list[Path]:
    """Rewrite every golden file from today's examples; remove files of types that no longer exist."""
    GOLDEN.mkdir(exist_ok=True)
    written = []
    for event in example_events():
        path = golden_path(event)
        path.write_bytes(golden_bytes(event))
        written.append(path)
    for stale in set(GOLDEN.glob("*.json")) - set(written):
        stale.unlink()
    return written


def _ids(event: Event) -> str:
    return event_type_name(type(event))


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_encoding_matches_the_pinned_bytes(event: Event) -> None:
    assert golden_path(event).read_bytes() == golden_bytes(event), (
        "the wire format changed; if that is deliberate, run `python -m tests.schemas.test_compat --regen`"
    )


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_pinned_bytes_decode_to_the_example(event: Event) -> None:
    value = golden_path(event).read_bytes().removesuffix(b"\n")
    assert decode(value, headers(event)) == event


def test_every_event_type_is_pinned_and_nothing_else() -> None:
    assert sorted(p.stem for p in GOLDEN.glob("*.json")) == sorted(event_type_name(c) for c in EVENT_TYPES)


V1 = GOLDEN / "v1"
"""The bytes every event type had before drift features were added (optional fields, no version bump):
today's decoder must still read them, so events already on the log stay readable."""


@pytest.mark.parametrize("path", sorted(V1.glob("*.json")), ids=lambda p: p.stem)
def test_events_written_before_drift_features_still_decode(path: Path) -> None:
    value = path.read_bytes().removesuffix(b"\n")
    event = decode(value)
    assert event_type_name(type(event)) == path.stem
    assert encode(decode(encode(event))) == encode(event)
    if isinstance(event, RequestFinished):
        assert event.features is None
    if isinstance(event, DriftReport):
        assert event.verdict is None
        assert event.effective_verdict == ("drift" if event.drifted else "no_drift")


def test_v1_pins_every_type_that_existed_then() -> None:
    assert len(list(V1.glob("*.json"))) == 13


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--regen", action="store_true", help="rewrite the golden files from today's examples")
    if parser.parse_args().regen:
        for path in regen():
            print(path)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
