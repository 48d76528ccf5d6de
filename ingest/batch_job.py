"""One batch's bookkeeping on the edge that runs it: where each line stands, its journal on disk, and its
output and error files. Synchronous and free of Kafka, so it is tested as a plain object.

Memory is a few bytes per line (state, attempt, flags, the line's offset in the input file and its
result's offset in the journal): 100k lines take about 2 MB, whatever the lines hold. Results live in the
journal (``journal.jsonl``, appended and synced before the results topic's offsets are committed), the
batch's state in ``state.json``; both under ``<files dir>/batches/<tenant hash>/<batch id>/``. A restarted
edge rebuilds the job from them and goes on.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import os
import random
import threading
from array import array
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import BinaryIO, Literal

import msgspec

from ingest.batch_lines import BASE64, parse_line, unrun_line
from ingest.files import read_lines, write_atomic
from schemas.codec import UNREADABLE_JSON, decode, encode
from schemas.events import BatchCounts, BatchStateChanged
from schemas.ids import uuid7

PENDING, IN_FLIGHT, DONE, FAILED, RETRY = 0, 1, 2, 3, 4
"""A line's state: not published yet; published, no result yet; completed; failed for good; waiting to be
published again (attempt + 1) after a retriable failure."""


NO_LINE_BYTES = b"null"
MAX_ATTEMPT = 256
"""A line's attempts are counted in a byte."""


class JournalEntry(msgspec.Struct, frozen=True, array_like=True):
    """A result of line ``index`` (its ``attempt``): ``line`` is its output or error line; ``final`` False
    for a retriable failure (the line runs again)."""

    index: int
    attempt: int
    ok: bool
    final: bool
    line: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(NO_LINE_BYTES))


_ENTRY = msgspec.json.Decoder(JournalEntry)
NO_LINE = msgspec.Raw(b"null")
Ending = Literal["expired", "cancelled"]


class Job:
    def __init__(self, folder: Path, state: BatchStateChanged, input_path: Path) -> None:
        self.folder = folder
        self.state = state
        self.input_path = input_path
        self.offsets = array("Q")
        self.flags = bytearray()
        self.custom_ids: list[str] | None = None
        self.status = bytearray()
        self.attempts = bytearray()
        self.result_at = array("q")
        self.next_index = 0
        self.in_flight = 0
        self.retries: list[tuple[float, int]] = []
        self._ending: Ending | None = None
        self.ending_since = 0.0
        """When it began to end (monotonic): set with the ending by :meth:`end_as`, never apart from it."""
        self.unready_rounds = 0
        """Rounds in a row whose lines all waited (a retriable refusal): the next wait is longer."""
        self.published_seq = -1
        self.saved_seq = -1
        """The ``seq`` of the last state written to ``state.json`` (a full disk can leave it behind)."""
        self._journal: BinaryIO | None = None
        self._input: BinaryIO | None = None
        self._dirty_journal = False
        self._syncing = threading.Lock()

    @property
    def total(self) -> int:
        return len(self.offsets)

    @property
    def ending(self) -> Ending | None:
        """How the batch ends (None: it runs on); set by :meth:`end_as`."""
        return self._ending

    def end_as(self, ending: Ending, now: float) -> None:
        """The batch ends as ``ending``, from ``now`` (monotonic): how long it waits for its running lines
        and for a restarted edge to read the results written while it was down is counted from there. One
        call sets both: a restarted edge set only the ending of a batch that was cancelling, so it waited
        from 0.0 (the machine's boot), not at all, and lines that had completed, billed, while it was down
        were reported batch_cancelled (a review)."""
        self._ending, self.ending_since = ending, now

    # ------------------------------------------------------------------ lines

    def index_input(self) -> None:
        """Offsets and flags of every line of the input file (one streaming pass, nothing kept but those)."""
        offsets, flags = array("Q"), bytearray()
        for offset, raw in read_lines(self.input_path):
            if not raw.strip():
                continue
            offsets.append(offset)
            try:
                flags.append(parse_line(raw, self.state.endpoint).flags)
            except Exception:
                flags.append(0)
        self.set_index(offsets, flags)

    def set_index(self, offsets: array[int], flags: bytearray) -> None:
        """Each line's offset in the input file and its flags; every line pending."""
        self.offsets, self.flags = offsets, flags
        n = len(offsets)
        self.status = bytearray(n)
        self.attempts = bytearray(n)
        self.result_at = array("q", [-1]) * n

    def raw_line(self, index: int) -> bytes:
        if self._input is None:
            self._input = self.input_path.open("rb")
        self._input.seek(self.offsets[index])
        return self._input.readline().rstrip(b"\r\n")

    def custom_id(self, index: int) -> str:
        try:
            return parse_line(self.raw_line(index), self.state.endpoint).custom_id
        except Exception:
            return ""

    def base64(self, index: int) -> int:
        return self.flags[index] & BASE64

    # ------------------------------------------------------------------ journal

    @property
    def journal_path(self) -> Path:
        return self.folder / "journal.jsonl"

    def restore(self) -> None:
        """Replay the journal into the line states (after :meth:`index_input`)."""
        if not self.journal_path.exists():
            return
        offset = 0
        with self.journal_path.open("rb") as journal:
            for raw in journal:
                try:
                    entry = _ENTRY.decode(raw)
                except UNREADABLE_JSON:  # a ValidationError too
                    break  # a torn last write: everything after it is re-learned from the results topic
                if not (0 <= entry.index < self.total and 0 <= entry.attempt < MAX_ATTEMPT):
                    break  # no entry this edge writes: the journal is damaged from here, read as torn (an
                    # audit: an index past the end stopped every restart of the edge)
                self._apply(entry, offset, backoff=0.0, now=0.0)
                offset += len(raw)
        with self.journal_path.open("r+b") as journal:
            journal.truncate(offset)

    def record(self, entry: JournalEntry, *, backoff: float, now: float) -> bool:
        """Append a result and apply it; False (nothing written) for a line already settled."""
        if not 0 <= entry.index < self.total or self.status[entry.index] in (DONE, FAILED):
            return False
        if self._journal is None:
            self._journal = self.journal_path.open("ab")
        at = self._journal.tell()
        self._journal.write(msgspec.json.encode(entry) + b"\n")
        self._dirty_journal = True
        self._apply(entry, at, backoff=backoff, now=now)
        return True

    def _apply(self, entry: JournalEntry, at: int, *, backoff: float, now: float) -> None:
        i = entry.index
        if self.status[i] in (DONE, FAILED):
            return
        if self.status[i] == IN_FLIGHT:
            self.in_flight -= 1
        if entry.final:
            self.status[i] = DONE if entry.ok else FAILED
            self.result_at[i] = at
        else:
            self.status[i] = RETRY
            self.attempts[i] = min(255, entry.attempt + 1)
            delay = min(60.0, backoff * 2**entry.attempt) * random.uniform(0.5, 1.5)  # noqa: S311
            heapq.heappush(self.retries, (now + delay, i))

    def sync(self) -> None:
        """Make the journal durable (before the offsets of what it records are committed). A reader of the
        files (on a thread) syncs too: the flag is cleared before the flush, under a lock, so a result
        recorded meanwhile is never taken as synced, and the runner's sync waits for one in progress."""
        with self._syncing:
            journal = self._journal
            if journal is not None and self._dirty_journal:
                self._dirty_journal = False
                try:
                    journal.flush()
                    os.fsync(journal.fileno())
                except BaseException:
                    self._dirty_journal = True
                    raise

    def close(self) -> None:
        """Sync the journal and close the job's files (closed even when the sync fails: a full disk)."""
        try:
            self.sync()
        finally:
            for handle in (self._journal, self._input):
                if handle is not None:
                    with contextlib.suppress(OSError):  # its buffer cannot be written either
                        handle.close()
            self._journal = self._input = None

    # ------------------------------------------------------------------ progress

    def counts(self) -> BatchCounts:
        return BatchCounts(
            total=self.total, completed=self.status.count(DONE), failed=self.status.count(FAILED)
        )

    def settled(self) -> bool:
        return self.status.count(DONE) + self.status.count(FAILED) == self.total

    def maybe_running(self, window: int) -> list[tuple[int, int]]:
        """(line, attempt) of each line that may have been running when an edge stopped, read from the
        journal (after :meth:`restore`): lines are published in order, at most ``window`` at once, so such a
        line has no final result and lies at most ``window`` lines past the last line with a result."""
        status = self.status
        last = next((i for i in range(self.total - 1, -1, -1) if status[i] != PENDING), -1)
        end = min(self.total, last + 1 + window)
        return [(i, self.attempts[i]) for i in range(end) if status[i] in (PENDING, RETRY)]

    def next_to_publish(self, now: float) -> tuple[int, int] | None:
        """(line, attempt) to publish next: a retry that is due, else the next line never published."""
        if self.retries and self.retries[0][0] <= now:
            _, i = heapq.heappop(self.retries)
            if self.status[i] == RETRY:
                return i, self.attempts[i]
        while self.next_index < self.total:
            i = self.next_index
            self.next_index += 1
            if self.status[i] == PENDING:
                return i, self.attempts[i]
        return None

    def postpone(self, index: int, delay: float, now: float) -> None:
        """Publish line ``index`` again (the same attempt: it did not run) ``delay`` seconds from ``now``."""
        self.status[index] = RETRY
        heapq.heappush(self.retries, (now + delay, index))

    def next_retry_due(self) -> float | None:
        return self.retries[0][0] if self.retries else None

    def unsettled(self) -> Iterator[int]:
        return (i for i in range(self.total) if self.status[i] not in (DONE, FAILED))

    def save_state(self, state: BatchStateChanged) -> None:
        self.state = state
        self.write_state(state)

    def write_state(self, state: BatchStateChanged) -> None:
        """``state`` into ``state.json`` (the job's state is set apart: the runner sets it at once, and
        writes it on a thread)."""
        write_atomic(self.folder / "state.json", encode(state))
        self.saved_seq = max(self.saved_seq, state.seq)

    # ------------------------------------------------------------------ files

    def result_line(self, index: int) -> bytes | None:
        at = self.result_at[index]
        if at < 0:
            return None
        with self.journal_path.open("rb") as journal:
            journal.seek(at)
            entry = _ENTRY.decode(journal.readline())
        return bytes(entry.line) if bytes(entry.line) != NO_LINE_BYTES else None

    def lines(self, *, ok: bool, ending: Ending | None = None) -> Iterator[bytes]:
        """The output (``ok``) or error lines in input order, of what has settled by now; with ``ending``,
        the error lines of what never settled too (the batch expired or was cancelled first)."""
        # What has settled now, then synced: every result in this snapshot was written before it, so the
        # sync puts it in the file. (Synced first, a result recorded in between was read past the file's
        # end: a 500, or a download cut short; an audit.)
        status, result_at = bytes(self.status), array("q", self.result_at)
        self.sync()
        # Opened now, not at the first line: a batch ending meanwhile removes its journal (``_drop``), and a
        # download that had begun read an empty file past its headers (a review). Open, it stays readable.
        journal = self.journal_path.open("rb") if self.journal_path.exists() else io.BytesIO()
        return self._settled(journal, status, result_at, ok=ok, ending=ending)

    def _settled(
        self,
        journal: BinaryIO,
        status: bytes,
        result_at: array[int],
        *,
        ok: bool,
        ending: Ending | None,
    ) -> Iterator[bytes]:
        want = DONE if ok else FAILED
        with journal:
            for i in range(len(status)):
                if status[i] == want:
                    journal.seek(result_at[i])
                    entry = _ENTRY.decode(journal.readline())
                    if bytes(entry.line) != NO_LINE_BYTES:
                        yield bytes(entry.line)
                elif not ok and ending is not None and status[i] not in (DONE, FAILED):
                    code = "batch_expired" if ending == "expired" else "batch_cancelled"
                    why = "the batch expired" if ending == "expired" else "the batch was cancelled"
                    message = f"This line did not run to the end: {why}."
                    yield unrun_line(self.state, i, self.custom_id(i), self.attempts[i], code, message)


def load_state(path: Path) -> BatchStateChanged | None:
    try:
        event = decode(path.read_bytes())
    except (OSError, ValueError):
        return None
    return event if isinstance(event, BatchStateChanged) else None


def at_time(state: BatchStateChanged, when: datetime, **changes: object) -> BatchStateChanged:
    """The next state of a batch: ``changes`` applied, ``seq`` + 1, a new event id and time."""
    return msgspec.structs.replace(state, id=uuid7(), time=when, seq=state.seq + 1, **changes)
