"""``sluice batch``: the fold of batch states, their rendering, the commands (the topic faked out), and the
real command against the session's broker (``status``, ``list``, ``status --watch``)."""

from __future__ import annotations

import io
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from confluent_kafka import Message
from rich.console import Console
from typer.testing import CliRunner

import sluice.batch
import sluice.cli
from bus.producer import EventProducer
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from schemas.codec import encode, headers, kafka_key
from schemas.events import BatchCounts, BatchLineError, BatchStateChanged, DeadLetter
from schemas.settings import KafkaConnection, PlatformSettings, load_settings
from schemas.topics import TopicNames
from sluice.batch import (
    BatchGone,
    BatchLog,
    BatchRecord,
    BatchTopicMissing,
    Latest,
    Snapshot,
    fold_batches,
    render_list,
    render_state,
    select,
    to_record,
)
from sluice.cli import app

T0 = datetime(2026, 11, 25, 9, 0, tzinfo=UTC)


def state(
    batch_id: str = "batch_a",
    status: Any = "in_progress",
    *,
    seq: int = 0,
    total: int = 0,
    completed: int = 0,
    failed: int = 0,
    tenant: str = "acme",
    created: datetime = T0,
    **extra: Any,
) -> BatchStateChanged:
    return BatchStateChanged(
        tenant=tenant,
        model="" if status == "validating" else "demo-gpt",
        source="ingest/edge-1",
        batch_id=batch_id,
        status=status,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        input_file_id=f"file-in-{batch_id}",
        edge_id="edge-1",
        seq=seq,
        counts=BatchCounts(total=total, completed=completed, failed=failed),
        created_at=created,
        expires_at=created + timedelta(hours=24),
        **extra,
    )


def record(offset: int, s: BatchStateChanged, partition: int = 0) -> BatchRecord:
    return BatchRecord(partition, offset, s.batch_id, s)


def tombstone(offset: int, batch_id: str = "batch_a", partition: int = 0) -> BatchRecord:
    return BatchRecord(partition, offset, batch_id, None)


def statuses(latest: dict[str, Latest]) -> dict[str, tuple[str, int, int]]:
    return {k: (v.state.status, v.state.seq, v.offset) for k, v in latest.items()}


# --- the fold ---------------------------------------------------------------------------------------------


def test_fold_keeps_the_highest_seq_whatever_the_order() -> None:
    validating, running, done = (
        state(status="validating", seq=0),
        state(status="in_progress", seq=1),
        state(status="completed", seq=2),
    )
    in_order = fold_batches([record(0, validating), record(1, running), record(2, done)])
    assert statuses(in_order) == {"batch_a": ("completed", 2, 2)}
    # A stale state re-published later (an edge retrying an old change) does not go back in time.
    stale_later = fold_batches([record(0, validating), record(1, done), record(2, running)])
    assert statuses(stale_later) == {"batch_a": ("completed", 2, 1)}


def test_fold_breaks_a_seq_tie_by_the_later_offset() -> None:
    first = state(status="in_progress", seq=3, total=10, completed=1)
    again = state(status="in_progress", seq=3, total=10, completed=2)
    latest = fold_batches([record(7, first), record(9, again)])
    assert latest["batch_a"].state.counts.completed == 2
    assert latest["batch_a"].offset == 9
    # An earlier offset with the same seq (read after the later one) does not replace it.
    assert fold_batches([record(9, again), record(7, first)])["batch_a"].offset == 9


def test_fold_keeps_batches_apart_and_remembers_the_partition() -> None:
    latest = fold_batches(
        [
            record(0, state("batch_a", "validating"), partition=2),
            record(0, state("batch_b", "validating"), partition=5),
            record(1, state("batch_b", "in_progress", seq=1), partition=5),
        ]
    )
    assert statuses(latest) == {"batch_a": ("validating", 0, 0), "batch_b": ("in_progress", 1, 1)}
    assert (latest["batch_a"].partition, latest["batch_b"].partition) == (2, 5)


def test_a_later_tombstone_forgets_a_batch_and_an_earlier_one_does_not() -> None:
    assert fold_batches([record(3, state()), tombstone(4)]) == {}
    assert statuses(fold_batches([tombstone(2), record(3, state())])) == {"batch_a": ("in_progress", 0, 3)}
    assert statuses(fold_batches([record(3, state()), tombstone(1)])) == {"batch_a": ("in_progress", 0, 3)}
    # After a tombstone the key may be used again, whatever its seq.
    reborn = fold_batches([record(3, state(seq=5)), tombstone(4), record(5, state(status="validating"))])
    assert statuses(reborn) == {"batch_a": ("validating", 0, 5)}


def test_fold_adds_to_a_given_dict() -> None:
    latest = fold_batches([record(0, state(seq=0))])
    same = fold_batches([record(1, state(status="completed", seq=1))], latest)
    assert same is latest
    assert latest["batch_a"].state.status == "completed"


# --- records ----------------------------------------------------------------------------------------------


def message(
    value: bytes | None,
    key: bytes | None = b"batch:batch_a",
    hdrs: Sequence[tuple[str, bytes]] = (),
    offset: int = 4,
) -> Message:
    kept: list[tuple[str, str | bytes | None]] = list(hdrs)
    return Message(topic="t.batches", partition=1, offset=offset, key=key, value=value, headers=kept)


def test_a_record_decodes_into_a_batch_record() -> None:
    s = state(total=3)
    found = to_record(1, 4, kafka_key(s), encode(s), list(headers(s)))
    assert found == BatchRecord(1, 4, "batch_a", s)


def test_records_without_a_batch_state_are_none() -> None:
    other = DeadLetter(
        tenant="",
        model="",
        source="x",
        source_topic="t",
        partition=0,
        offset=0,
        reason="r",
        payload_b64="",
    )
    assert to_record(0, 0, b"k", b"{not json", None) is None
    assert to_record(0, 0, b"k", encode(other), list(headers(other))) is None
    s = state()
    lying = [(k, b"someone-else" if k == "ce_tenant" else v) for k, v in headers(s)]
    assert to_record(0, 0, kafka_key(s), encode(s), lying) is None  # headers disagree with the body
    assert to_record(0, 0, b"budget:acme", None) is None  # a tombstone of no batch
    assert to_record(0, 0, b"batch:", None) is None
    assert to_record(0, 9, b"batch:batch_z", None) == BatchRecord(0, 9, "batch_z", None)


def test_the_log_counts_what_it_skips_and_keeps_only_what_it_is_asked_for() -> None:
    a, b = state("batch_a", total=2), state("batch_b")
    log = BatchLog()
    for i, msg in enumerate(
        [
            message(encode(a), kafka_key(a), headers(a)),
            message(b"junk"),
            message(encode(b), kafka_key(b), headers(b)),
            message(None, b"not-a-batch"),
        ]
    ):
        log.add(msg)
        assert log.skipped == [0, 1, 1, 2][i]
    assert sorted(log.latest) == ["batch_a", "batch_b"]
    assert log.latest["batch_a"].partition == 1
    only = BatchLog(only="batch_b")
    only.add(message(encode(a), kafka_key(a), headers(a)))
    only.add(message(encode(b), kafka_key(b), headers(b)))
    assert sorted(only.latest) == ["batch_b"]
    only.add(message(None, b"batch:batch_b", offset=5))
    assert only.latest == {}


class _UnreadableHeaders:
    """A record with a header key that is not UTF-8: confluent-kafka raises reading its headers."""

    def partition(self) -> int:
        return 1

    def offset(self) -> int:
        return 6

    def key(self) -> bytes:
        return b"batch:batch_a"

    def value(self) -> bytes:
        return encode(state("batch_a"))

    def headers(self) -> list[tuple[str, bytes]]:
        raise SystemError("<method 'headers'> returned a result with an exception set")


def test_a_record_whose_headers_cannot_be_read_is_skipped() -> None:
    """Found by a review: it raised out of ``sluice batch`` (it is not a record this platform wrote)."""
    log = BatchLog()
    log.add(cast(Message, _UnreadableHeaders()))
    assert (log.skipped, log.latest) == (1, {})


# --- rendering --------------------------------------------------------------------------------------------


def rendered(renderable: Any) -> str:
    console = Console(record=True, width=200, force_terminal=False, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_tenants_escape_sequences_never_reach_the_operators_terminal() -> None:
    """Found by an audit: a batch's metadata and its errors' messages (a line's url) went to the terminal
    as they were: ``\x1b[2J`` cleared the operator's screen, an OSC sequence set the window's title."""
    from schemas.events import BatchLineError

    evil = "\x1b]0;PWNED\x07\x1b[2J\x9b31m\rtext"
    s = state(status="failed", metadata={"note": evil})
    s = msgspec.structs.replace(s, errors=[BatchLineError(code="mismatched_endpoint", message=evil, line=1)])
    console = Console(file=io.StringIO(), width=300, force_terminal=True)
    console.print(render_state(s))
    shown = console.file.getvalue()  # type: ignore[attr-defined]
    for raw in ("\x1b]", "\x07", "\x1b[2J", "\x9b", "\r"):
        assert raw not in shown
    assert "\\x1b]0;PWNED\\x07\\x1b[2J\\x9b31m\\x0dtext" in shown


def test_printable_keeps_text_tabs_and_newlines() -> None:
    from sluice.printable import printable

    assert printable("héllo\tworld\n日本") == "héllo\tworld\n日本"
    assert printable("\x00\x1b\x7f\x9f") == "\\x00\\x1b\\x7f\\x9f"


def test_render_state_shows_the_batch_and_its_progress() -> None:
    s = state(
        status="in_progress",
        seq=4,
        total=20,
        completed=14,
        failed=3,
        in_progress_at=T0 + timedelta(minutes=1),
        output_file_id="file-out",
        metadata={"job": "nightly"},
    )
    text = rendered(render_state(s))
    for expected in (
        "batch_a",
        "acme",
        "demo-gpt",
        "/v1/chat/completions",
        "in_progress  since 2026-11-25 09:01:00Z",
        "total 20, completed 14, failed 3",
        "file-in-batch_a",
        "file-out",
        "2026-11-25 09:00:00Z",
        "2026-11-26 09:00:00Z (window 24h)",
        "edge-1 (change 4)",
        "job=nightly",
        "17/20 lines answered (85%), 3 failed",
    ):
        assert expected in text, (expected, text)
    assert "━" in text  # the bar
    assert "errors" not in text


def test_render_state_of_a_failed_batch_lists_its_errors() -> None:
    s = state(
        status="failed",
        seq=1,
        failed_at=T0,
        errors=[
            BatchLineError(code="duplicate_custom_id", message="custom_id 'a' repeats", line=2),
            BatchLineError(code="invalid_json", message="line is not JSON [sic]", line=5, param="body"),
        ],
    )
    text = rendered(render_state(s))
    assert "failed  since 2026-11-25 09:00:00Z" in text
    assert "no lines" in text
    assert "(not known" not in text  # the model is known once past validation
    for expected in ("errors", "duplicate_custom_id", "custom_id 'a' repeats", "invalid_json", "[sic]"):
        assert expected in text, (expected, text)


def test_render_state_while_validating() -> None:
    text = rendered(render_state(state(status="validating")))
    assert "no lines yet" in text
    assert "(not known while validating)" in text
    refused = rendered(render_state(msgspec.structs.replace(state(status="failed"), model="")))  # a review
    assert "(not known" not in refused
    assert "(none: the input was refused)" in refused


def test_select_is_newest_first_and_filters() -> None:
    latest = fold_batches(
        [
            record(0, state("b1", "completed", created=T0, tenant="acme")),
            record(1, state("b2", "in_progress", created=T0 + timedelta(hours=2), tenant="globex")),
            record(2, state("b3", "validating", created=T0 + timedelta(hours=1), tenant="acme")),
            record(3, state("b0", "cancelled", created=T0 + timedelta(hours=1), tenant="acme")),
        ]
    ).values()
    assert [s.batch_id for s in select(latest)] == ["b2", "b3", "b0", "b1"]
    assert [s.batch_id for s in select(latest, tenant="acme")] == ["b3", "b0", "b1"]
    assert [s.batch_id for s in select(latest, status="completed")] == ["b1"]
    assert [s.batch_id for s in select(latest, status="active")] == ["b2", "b3"]
    assert [s.batch_id for s in select(latest, tenant="acme", status="active")] == ["b3"]
    assert select(latest, tenant="nobody") == []


def test_render_list_has_a_row_per_batch() -> None:
    text = rendered(
        render_list(
            [state("b1", "in_progress", total=4, completed=1, failed=1), state("b2", "validating")], "T"
        )
    )
    lines = [line for line in text.splitlines() if "b1" in line or "b2" in line]
    assert len(lines) == 2
    assert "2/4" in lines[0]
    assert "in_progress" in lines[0]
    assert "validating" in lines[1]


# --- the commands, with the topic faked out ---------------------------------------------------------------


class FakeTopic:
    """Stands in for reading the batches topic to its end."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
        self.records: list[BatchRecord] = []
        self.skipped = 0
        self.missing = False
        self.read: list[tuple[str, str | None]] = []
        monkeypatch.setattr(sluice.batch, "read_batches", self.read_batches)
        monkeypatch.setattr(
            sluice.cli,
            "_settings",
            load_settings(
                PlatformSettings,
                {
                    "SLUICE_TOPIC_PREFIX": "fake",
                    "SLUICE_DATA_DIR": str(tmp_path),
                    "SLUICE_CACHE_DIR": str(tmp_path),
                },
            ),
        )

    def read_batches(self, kafka: KafkaConnection, topic: str, only: str | None = None) -> Snapshot:
        self.read.append((topic, only))
        if self.missing:
            raise BatchTopicMissing(topic)
        log = BatchLog(only=only, skipped=self.skipped)
        fold_batches((r for r in self.records if only is None or r.batch_id == only), log.latest)
        ends: dict[int, int] = {}
        for r in self.records:
            ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
        return Snapshot(log, ends)


@pytest.fixture
def topic(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeTopic:
    return FakeTopic(monkeypatch, tmp_path)


def rows(stdout: str) -> list[str]:
    """The batch ids of a ``list`` table, top to bottom."""
    return [line.split()[1] for line in stdout.splitlines() if "batch_" in line and "│" in line]


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["batch", *args])


def test_status_shows_the_latest_state(topic: FakeTopic) -> None:
    topic.records = [
        record(0, state(status="validating")),
        record(1, state(status="completed", seq=2, total=3, completed=2, failed=1, completed_at=T0)),
        record(2, state("batch_b", "in_progress")),
    ]
    result = invoke("status", "batch_a")
    assert result.exit_code == 0, result.output
    assert "completed" in result.stdout
    assert "total 3, completed 2, failed 1" in result.stdout
    assert "3/3 lines answered (100%), 1 failed" in result.stdout
    assert topic.read == [("fake.batches", "batch_a")]


def test_status_of_an_unknown_batch_is_one_red_line_and_exit_1(topic: FakeTopic) -> None:
    topic.records = [record(0, state())]
    result = invoke("status", "batch_nope")
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.strip() == "error: no batch batch_nope on fake.batches"


def test_a_missing_topic_says_how_to_create_it(topic: FakeTopic) -> None:
    topic.missing = True
    for args in (["status", "batch_a"], ["list"]):
        result = invoke(*args)
        assert result.exit_code == 1
        assert "no topic fake.batches" in result.stderr
        assert "`sluice topics apply`" in result.stderr


def test_skipped_records_are_reported(topic: FakeTopic) -> None:
    topic.records = [record(0, state())]
    topic.skipped = 2
    result = invoke("list")
    assert result.exit_code == 0, result.output
    assert "skipped 2 records of fake.batches" in result.stderr


@pytest.mark.parametrize(
    ("status", "code"), [("completed", 0), ("failed", 3), ("expired", 3), ("cancelled", 3)]
)
def test_watch_of_an_ended_batch_exits_at_once_with_its_outcome(
    topic: FakeTopic, status: str, code: int
) -> None:
    topic.records = [record(0, state(status=status, seq=1))]
    result = invoke("status", "batch_a", "--watch")
    assert result.exit_code == code, result.output
    assert status in result.stdout
    plain = invoke("status", "batch_a")  # without --watch the outcome does not change the exit code
    assert plain.exit_code == 0, plain.output


class FakeFollow:
    """Stands in for following the topic: shows ``states`` in turn and returns the last (or raises)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, states: list[BatchStateChanged]) -> None:
        self.states = states
        self.calls: list[tuple[str, int, int, float]] = []
        monkeypatch.setattr(sluice.batch, "follow", self.follow)

    def follow(
        self,
        kafka: KafkaConnection,
        topic: str,
        seen: Latest,
        start: int,
        show: Callable[[BatchStateChanged], None],
        interval_s: float,
    ) -> BatchStateChanged:
        self.calls.append((seen.state.batch_id, seen.partition, start, interval_s))
        show(seen.state)
        for s in self.states:
            show(s)
        if not self.states:
            raise BatchGone(seen.state.batch_id)
        return self.states[-1]


def test_watch_logs_a_line_per_change_when_not_on_a_terminal(
    topic: FakeTopic, monkeypatch: pytest.MonkeyPatch
) -> None:
    topic.records = [record(0, state(status="in_progress", seq=1, total=4), partition=3)]
    running = state(status="in_progress", seq=2, total=4, completed=1)
    expired = state(status="expired", seq=3, total=4, completed=3, failed=1, expired_at=T0)
    follow = FakeFollow(monkeypatch, [running, running, expired])
    result = invoke("status", "batch_a", "--watch", "--interval", "0.5")
    assert result.exit_code == 3, result.output
    assert follow.calls == [("batch_a", 3, 1, 0.5)]  # from its partition's end when read
    changes = [line for line in result.stdout.splitlines() if "lines answered" in line and "batch_a" in line]
    assert [line.split(" ", 3)[3] for line in changes] == [
        "in_progress: 0/4 lines answered (0%), 0 failed",
        "in_progress: 1/4 lines answered (25%), 0 failed",  # shown twice, logged once
        "expired: 4/4 lines answered (100%), 1 failed",
    ]
    assert "total 4, completed 3, failed 1" in result.stdout  # the final state's table


def test_watch_redraws_in_place_on_a_terminal(topic: FakeTopic, monkeypatch: pytest.MonkeyPatch) -> None:
    screen = io.StringIO()
    monkeypatch.setattr(sluice.cli, "out", Console(file=screen, force_terminal=True, width=150))
    topic.records = [record(0, state(status="validating"))]
    done = state(status="completed", seq=5, total=2, completed=2, completed_at=T0)
    FakeFollow(monkeypatch, [state(status="in_progress", seq=1, total=2, completed=1), done])
    result = invoke("status", "batch_a", "--watch")
    assert result.exit_code == 0, result.output
    drawn = screen.getvalue()
    assert "1/2 lines answered (50%)" in drawn  # the live display was redrawn with the change
    assert "total 2, completed 2, failed 0" in drawn  # the final state, printed once the display ends
    assert "batch_a in_progress:" not in drawn  # no line-per-change log on a terminal


def test_watch_of_a_deleted_batch_exits_1(topic: FakeTopic, monkeypatch: pytest.MonkeyPatch) -> None:
    topic.records = [record(0, state())]
    FakeFollow(monkeypatch, [])
    result = invoke("status", "batch_a", "--watch")
    assert result.exit_code == 1
    assert "batch batch_a was deleted from fake.batches while watched" in result.stderr


def test_list_is_newest_first_filtered_and_limited(topic: FakeTopic) -> None:
    topic.records = [
        record(
            i, state(f"batch_{i}", "completed" if i % 2 else "in_progress", created=T0 + timedelta(hours=i))
        )
        for i in range(5)
    ]
    result = invoke("list", "--limit", "3")
    assert result.exit_code == 0, result.output
    assert rows(result.stdout) == ["batch_4", "batch_3", "batch_2"]
    assert "3 of 5, newest first" in result.stdout
    active = invoke("list", "--status", "active")
    assert rows(active.stdout) == ["batch_4", "batch_2", "batch_0"]
    none = invoke("list", "--tenant", "globex")
    assert none.exit_code == 0
    assert "no batches tenant globex on fake.batches" in none.stdout


def test_list_refuses_an_unknown_status(topic: FakeTopic) -> None:
    result = invoke("list", "--status", "running")
    assert result.exit_code == 2
    assert "expected one of validating, failed" in result.output
    assert topic.read == []


@pytest.mark.parametrize("args", [["batch"], ["batch", "status"], ["batch", "list"]])
def test_help_explains_statuses_and_the_source(args: list[str]) -> None:
    result = CliRunner().invoke(app, [*args, "--help"])
    assert result.exit_code == 0, result.output
    assert "batches topic" in result.stdout
    if args != ["batch"]:
        assert "validating (the edge checks the input file)" in result.stdout


# --- against the session's broker -------------------------------------------------------------------------


def sluice_run(*args: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sluice", "batch", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def publish(kafka: KafkaConnection, topic: str, *events: BatchStateChanged | DeadLetter) -> None:
    """Produce ``events`` and return once every one is durable (stop flushes, and raises if one is not)."""
    with EventProducer(kafka, "test-batch-edge") as producer:
        for event in events:
            producer.produce(topic, event)


class Watch:
    """``sluice batch status ID --watch`` running, its stdout collected line by line on a thread."""

    def __init__(self, batch_id: str, env: dict[str, str]) -> None:
        self.lines: list[str] = []
        self._arrived = threading.Condition()
        self._ended = False
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "batch", "status", batch_id, "--watch", "--interval", "0.2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._arrived:
                self.lines.append(line.rstrip("\n"))
                self._arrived.notify_all()
        with self._arrived:  # end of output: the process ended
            self._ended = True
            self._arrived.notify_all()

    def wait_for_line(self, text: str, timeout: float = 60) -> None:
        """Until a line of stdout holds ``text``; fails when the process ends first or time runs out."""
        deadline = time.monotonic() + timeout
        with self._arrived:
            while not any(text in line for line in self.lines):
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    raise AssertionError(f"no line with {text!r} in {self.lines}")
                self._arrived.wait(left)

    def finish(self, timeout: float = 60) -> tuple[int, str, str]:
        """Wait for the process to exit by itself; its exit code, stdout and stderr."""
        try:
            code = self.proc.wait(timeout)
        finally:
            stderr = self.close()
        return code, "\n".join(self.lines), stderr

    def close(self) -> str:
        """Kill the process if it still runs, close its pipes; its stderr (empty once closed)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._reader.join(10)
        stderr = ""
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            stderr = self.proc.stderr.read()
            self.proc.stderr.close()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return stderr


@pytest.fixture
def watches() -> Iterator[list[Watch]]:
    started: list[Watch] = []
    yield started
    for watch in started:
        watch.close()


@pytest.mark.integration
def test_status_list_and_watch_against_kafka(
    kafka: KafkaConnection, cli_env: dict[str, str], topic_prefix: str, watches: list[Watch]
) -> None:
    names = TopicNames(topic_prefix)
    missing = sluice_run("list", env=cli_env)
    assert missing.returncode == 1
    assert f"no topic {names.batches}" in missing.stderr
    (batches,) = (s for s in platform_topics(names, [], TopicSizing(events=2)) if s.name == names.batches)
    apply_topics(make_admin(kafka), [batches])

    done = "batch_done"
    junk = DeadLetter(
        tenant="", model="", source="x", source_topic="t", partition=0, offset=0, reason="r", payload_b64=""
    )
    publish(
        kafka,
        names.batches,
        state(done, "validating", seq=0),
        junk,
        state(done, "in_progress", seq=1, total=3, in_progress_at=T0),
        state(
            done, "completed", seq=3, total=3, completed=2, failed=1, completed_at=T0, output_file_id="file-o"
        ),
        state(
            "batch_running",
            "in_progress",
            seq=1,
            total=5,
            completed=1,
            tenant="globex",
            created=T0 + timedelta(hours=1),
        ),
    )

    shown = sluice_run("status", done, env=cli_env)
    assert shown.returncode == 0, shown.stderr
    assert "completed" in shown.stdout
    assert "total 3, completed 2, failed 1" in shown.stdout
    assert "file-o" in shown.stdout
    assert "skipped 1 records" in shown.stderr

    listed = sluice_run("list", env=cli_env)
    assert listed.returncode == 0, listed.stderr
    assert rows(listed.stdout) == ["batch_running", done]
    only_acme = sluice_run("list", "--tenant", "acme", "--status", "completed", env=cli_env)
    assert rows(only_acme.stdout) == [done]

    unknown = sluice_run("status", "batch_nope", env=cli_env)
    assert unknown.returncode == 1
    assert f"no batch batch_nope on {names.batches}" in unknown.stderr

    # --watch follows two batches until they end: one completes (exit 0), one is cancelled (exit 3).
    publish(
        kafka,
        names.batches,
        state("batch_w1", "in_progress", seq=1, total=2),
        state("batch_w2", "cancelling", seq=2, total=2, completed=1),
    )
    watches += [Watch("batch_w1", cli_env), Watch("batch_w2", cli_env)]
    for watch in watches:
        watch.wait_for_line("lines answered")  # following now: the first state is shown
    assert all(w.proc.poll() is None for w in watches)  # a batch that has not ended keeps the watch going

    ends = threading.Thread(
        target=publish,
        args=(
            kafka,
            names.batches,
            state("batch_w1", "in_progress", seq=2, total=2, completed=1),
            state("batch_w1", "completed", seq=4, total=2, completed=2, completed_at=T0),
            state("batch_w2", "cancelled", seq=3, total=2, completed=1, cancelled_at=T0),
        ),
    )
    ends.start()
    ends.join(60)
    assert not ends.is_alive()
    code1, out1, err1 = watches[0].finish()
    code2, out2, err2 = watches[1].finish()
    assert code1 == 0, (out1, err1)
    assert "batch_w1 completed: 2/2 lines answered (100%), 0 failed" in out1
    assert "total 2, completed 2, failed 0" in out1  # the final state's table
    assert code2 == 3, (out2, err2)
    assert "batch_w2 cancelled: 1/2 lines answered (50%)" in out2


def test_listing_no_batch_of_a_tenant_named_like_markup_says_so(topic: FakeTopic) -> None:
    """Found by review: ``--tenant '[/x]'`` with no batch of it printed a rich MarkupError traceback."""
    topic.records = [record(0, state())]
    result = invoke("list", "--tenant", "[/x]")
    assert result.exit_code == 0, result.output
    assert "no batches tenant [/x] on" in result.output
