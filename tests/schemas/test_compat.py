"""Pins the encoded bytes of every example event, one snapshot per wire-format change, so a change that
breaks events already on the log fails.

``tests/schemas/golden/<date>/<type>.json`` holds ``encode(example)`` plus one trailing newline, as the code
of that date wrote it (``<date>.2`` for a second change on one day). Every snapshot must still decode with today's code (old bytes stay readable); the
newest must also be exactly what today's encoder writes. A snapshot is never rewritten: when a change is
deliberate (a new optional field, a bumped ``schema_version``), add a snapshot dated today and review it::

    python -m tests.schemas.test_compat --regen
"""

from __future__ import annotations

import argparse
import struct
from datetime import UTC, datetime
from pathlib import Path

import pytest

from schemas.codec import EVENT_TYPES, Event, decode, encode, event_type_name, headers
from schemas.events import DriftReport, RequestFinished
from schemas.examples import example_events

GOLDEN = Path(__file__).parent / "golden"


def snapshots(root: Path = GOLDEN) -> list[Path]:
    """The snapshot directories, oldest first (their names are ISO dates)."""
    return sorted(d for d in root.iterdir() if d.is_dir())


NEWEST = snapshots()[-1]


def golden_name(event: Event) -> str:
    return f"{event_type_name(type(event))}.json"


def golden_bytes(event: Event) -> bytes:
    return encode(event) + b"\n"


class SnapshotRefused(Exception):
    """Regenerating would overwrite a snapshot or repeat the newest one."""


def regen(root: Path = GOLDEN, name: str | None = None) -> list[Path]:
    """Write today's examples into a new snapshot ``root/<name>`` (default: today's UTC date)."""
    today = datetime.now(UTC).date().isoformat()
    if name is None:  # a second wire change on one day gets today.2, today.3, ...
        name = next(n for n in (today, *(f"{today}.{k}" for k in range(2, 100))) if not (root / n).exists())
    target = root / name
    if target.exists():
        raise SnapshotRefused(
            f"{target} exists; snapshots are never rewritten (delete it only if uncommitted)"
        )
    files = {golden_name(e): golden_bytes(e) for e in example_events()}
    previous = snapshots(root) if root.is_dir() else []
    if previous and {p.name: p.read_bytes() for p in previous[-1].glob("*.json")} == files:
        raise SnapshotRefused(f"today's bytes equal {previous[-1]}; no new snapshot is needed")
    target.mkdir(parents=True)
    written = []
    for file_name, data in files.items():
        path = target / file_name
        path.write_bytes(data)
        written.append(path)
    return written


def _ids(event: Event) -> str:
    return event_type_name(type(event))


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_encoding_matches_the_newest_pinned_bytes(event: Event) -> None:
    assert (NEWEST / golden_name(event)).read_bytes() == golden_bytes(event), (
        "the wire format changed; if that is deliberate, run `python -m tests.schemas.test_compat --regen`"
    )


@pytest.mark.parametrize("event", example_events(), ids=_ids)
def test_newest_pinned_bytes_decode_to_the_example(event: Event) -> None:
    value = (NEWEST / golden_name(event)).read_bytes().removesuffix(b"\n")
    assert decode(value, headers(event)) == event


def test_the_newest_snapshot_pins_every_event_type_and_nothing_else() -> None:
    assert sorted(p.stem for p in NEWEST.glob("*.json")) == sorted(event_type_name(c) for c in EVENT_TYPES)


def test_golden_files_live_only_in_dated_snapshots() -> None:
    assert not list(GOLDEN.glob("*.json"))
    for snapshot in snapshots():
        day, _, nth = snapshot.name.partition(".")  # a second change on one day: 2026-11-25.2
        assert day == datetime.strptime(day, "%Y-%m-%d").date().isoformat()
        assert not nth or (nth.isdigit() and int(nth) >= 2)


ALL_PINNED = [path for snapshot in snapshots() for path in sorted(snapshot.glob("*.json"))]


@pytest.mark.parametrize("path", ALL_PINNED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_snapshot_still_decodes(path: Path) -> None:
    value = path.read_bytes().removesuffix(b"\n")
    event = decode(value)
    assert event_type_name(type(event)) == path.stem
    assert decode(value, headers(event)) == event
    assert encode(decode(encode(event))) == encode(event)


BEFORE_DRIFT = GOLDEN / "2026-11-22"
"""The bytes every event type had before drift features were added (optional fields, no version bump)."""


@pytest.mark.parametrize("path", sorted(BEFORE_DRIFT.glob("*.json")), ids=lambda p: p.stem)
def test_events_written_before_drift_features_decode_without_them(path: Path) -> None:
    event = decode(path.read_bytes().removesuffix(b"\n"))
    if isinstance(event, RequestFinished):
        assert event.features is None
    if isinstance(event, DriftReport):
        assert event.verdict is None
        assert event.effective_verdict == ("drift" if event.drifted else "no_drift")


@pytest.mark.parametrize(
    "path", [s / "request_finished.json" for s in snapshots()], ids=lambda p: p.parent.name
)
def test_result_vectors_read_the_same_from_json_floats_and_packed_float32(path: Path) -> None:
    """Snapshots before 2026-11-25 carry ``embeddings`` as JSON floats, later ones ``embeddings_f32``."""
    event = decode(path.read_bytes().removesuffix(b"\n"))
    assert isinstance(event, RequestFinished)
    assert event.vectors() == [[0.25, -0.5], [1.0, 0.0]]
    packed = event.packed_vectors()
    assert packed is not None
    assert packed.rows() == [struct.pack("<2f", 0.25, -0.5), struct.pack("<2f", 1.0, 0.0)]
    assert (event.embeddings is None) == (path.parent.name >= "2026-11-25")


def test_the_oldest_snapshot_pins_every_type_that_existed_then() -> None:
    assert snapshots()[0] == BEFORE_DRIFT
    assert len(list(BEFORE_DRIFT.glob("*.json"))) == 13


def test_regen_adds_a_snapshot_and_never_rewrites_one(tmp_path: Path) -> None:
    first = regen(tmp_path, "2026-01-01")
    assert {p.name for p in first} == {golden_name(e) for e in example_events()}
    with pytest.raises(SnapshotRefused, match="never rewritten"):
        regen(tmp_path, "2026-01-01")
    with pytest.raises(SnapshotRefused, match="no new snapshot"):
        regen(tmp_path, "2026-01-02")
    first[0].write_bytes(b"bytes of an older encoder\n")
    second = regen(tmp_path, "2026-01-02")
    assert {p.name: p.read_bytes() for p in second} == {
        golden_name(e): golden_bytes(e) for e in example_events()
    }
    assert first[0].read_bytes() == b"bytes of an older encoder\n"
    assert snapshots(tmp_path) == [tmp_path / "2026-01-01", tmp_path / "2026-01-02"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--regen", action="store_true", help="write today's examples into a new snapshot dated today"
    )
    if parser.parse_args().regen:
        try:
            written = regen()
        except SnapshotRefused as refused:
            raise SystemExit(str(refused)) from None
        for path in written:
            print(path)
    else:
        parser.print_help()


if __name__ == "__main__":
    main()
