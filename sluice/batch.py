"""``sluice batch``: async batches (the OpenAI Batch API) as operators see them, read from the batches topic.

The edge that runs a batch publishes its whole state after every change as a ``BatchStateChanged`` on the
compacted ``<prefix>.batches`` topic (key ``batch:<id>``), so the latest record of a batch is what the batch
is. The commands here read that topic to its end (``status``, ``list``) and, with ``status --watch``, follow
the batch's partition live until the batch ends.

:func:`fold_batches` is the whole rule for "latest": the highest ``seq`` wins, a tie goes to the later
offset, and a tombstone (a record without a value) forgets the batch. Only the latest state of each batch
is kept while reading, so memory grows with the number of batches, not with the number of changes.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, get_args

import typer
from rich.console import Group, RenderableType
from rich.markup import escape
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from schemas.events import BatchStateChanged, BatchStatus
from sluice.groups import command_group
from sluice.printable import printable

if TYPE_CHECKING:
    from confluent_kafka import Message

    from schemas.codec import HeaderValue
    from schemas.settings import KafkaConnection

CLIENT_ID = "sluice-batch"
READ_TIMEOUT_S = 120.0
"""The longest reading the batches topic to its end may take."""

STATUSES: tuple[str, ...] = get_args(BatchStatus)
ACTIVE = "active"
"""``list --status active``: every batch that has not ended yet."""

EXIT_ENDED_UNSUCCESSFULLY = 3
"""``status --watch``'s exit code when the batch ended failed, expired or cancelled."""

_STATUS_HELP = (
    "Statuses: validating (the edge checks the input file), failed (the input file was refused; the "
    "errors say why), in_progress (its lines are being served), finalizing (every line answered; the "
    "output and error files are being written), completed (the output file is ready; lines that failed "
    "are in the error file), expired (not done within its completion window; finished lines are in the "
    "output file), cancelling (cancel asked; lines in flight finish), cancelled. A batch ends "
    "failed, completed, expired or cancelled."
)
_SOURCE_HELP = (
    "Read from the compacted <SLUICE_TOPIC_PREFIX>.batches topic, where the edge running each batch "
    "publishes its whole state after every change (`sluice topics apply` creates the topic)."
)

_STATUS_COMMAND_HELP = "\n\n".join(
    (
        "One batch's state and progress; --watch follows it until it ends.",
        "Shows tenant, model, endpoint, status, line counts, files, times, the errors of a failed batch, "
        "and a bar of the lines answered (completed + failed) out of all. With --watch the bar follows the "
        "batch live (a line per change when the output is not a terminal) until the batch ends; then its "
        "final state is printed.",
        "Exit codes: 0 the batch was found (without --watch, whatever its status); 1 no such batch, or "
        "Kafka cannot be read; with --watch, 0 when the batch completed (lines that failed are in its "
        f"error file) and {EXIT_ENDED_UNSUCCESSFULLY} when it ended failed, expired or cancelled. A script "
        "waits for a batch with `sluice batch status ID --watch && next-step`.",
        _STATUS_HELP,
        _SOURCE_HELP,
    )
)
_LIST_COMMAND_HELP = "\n\n".join(
    (
        "The latest state of every batch, newest first.",
        "Newest by creation time; --tenant and --status narrow the list. Exit code 1 when Kafka cannot be "
        "read.",
        _STATUS_HELP,
        _SOURCE_HELP,
    )
)

_COLOURS = {
    "validating": "cyan",
    "in_progress": "yellow",
    "finalizing": "yellow",
    "completed": "green",
    "failed": "red",
    "expired": "red",
    "cancelling": "magenta",
    "cancelled": "magenta",
}

# ---------------------------------------------------------------- the fold


@dataclass(frozen=True, slots=True)
class BatchRecord:
    """One record of the batches topic: where it is, whose it is, and the state it holds (None: a
    tombstone, the batch is forgotten)."""

    partition: int
    offset: int
    batch_id: str
    state: BatchStateChanged | None


@dataclass(frozen=True, slots=True)
class Latest:
    """A batch's latest state and the record it came from."""

    state: BatchStateChanged
    partition: int
    offset: int


def fold_batches(
    records: Iterable[BatchRecord], latest: dict[str, Latest] | None = None
) -> dict[str, Latest]:
    """Fold ``records`` into ``latest`` (a new dict when None), batch id -> its latest state, and return it.

    A state replaces the kept one when its ``seq`` is higher, or equal and its offset later (a re-published
    state); an older ``seq`` arriving later is ignored. A tombstone later than the kept state forgets the
    batch. Records of one batch share a partition (the key picks it), so their offsets compare."""
    folded: dict[str, Latest] = {} if latest is None else latest
    for record in records:
        kept = folded.get(record.batch_id)
        if record.state is None:
            if kept is not None and record.offset > kept.offset:
                del folded[record.batch_id]
            continue
        if kept is None or (record.state.seq, record.offset) > (kept.state.seq, kept.offset):
            folded[record.batch_id] = Latest(record.state, record.partition, record.offset)
    return folded


KEY_PREFIX = "batch:"


def to_record(
    partition: int,
    offset: int,
    key: bytes | None,
    value: bytes | None,
    headers: Sequence[tuple[str, HeaderValue]] | None = None,
) -> BatchRecord | None:
    """The :class:`BatchRecord` in a raw record of the batches topic, or None when it holds no batch
    state: not an event, another event type, or a tombstone whose key names no batch."""
    from schemas.codec import DecodeError, decode

    if value is None:
        name = (key or b"").decode("utf-8", "replace")
        if not name.startswith(KEY_PREFIX) or len(name) == len(KEY_PREFIX):
            return None
        return BatchRecord(partition, offset, name[len(KEY_PREFIX) :], None)
    try:
        event = decode(value, headers)
    except DecodeError:
        return None
    if not isinstance(event, BatchStateChanged):
        return None
    return BatchRecord(partition, offset, event.batch_id, event)


@dataclass
class BatchLog:
    """The latest state of every batch (or of one, ``only``) seen so far, fed record by record, and how
    many records held no batch state (undecodable, another event type)."""

    only: str | None = None
    latest: dict[str, Latest] = field(default_factory=dict)
    skipped: int = 0

    def add(self, message: Message) -> None:
        from bus.consumer import UnreadableHeaders, record_headers

        try:
            head = record_headers(message)
        except UnreadableHeaders:  # not a record this platform wrote
            self.skipped += 1
            return
        record = to_record(
            message.partition() or 0, message.offset() or 0, message.key(), message.value(), head
        )
        if record is None:
            self.skipped += 1
        elif self.only is None or record.batch_id == self.only:
            fold_batches([record], self.latest)


# ---------------------------------------------------------------- Kafka


class BatchTopicMissing(Exception):
    """The batches topic does not exist."""


@dataclass
class Snapshot:
    """The batches topic read to its end: the log, and the end offset of every partition when read."""

    log: BatchLog
    ends: dict[int, int]


def read_batches(
    kafka: KafkaConnection, topic: str, only: str | None = None, timeout_s: float = READ_TIMEOUT_S
) -> Snapshot:
    """Every record of ``topic`` up to its current end, folded. Raises :class:`BatchTopicMissing` when
    there is no such topic and ``bus.errors.BusError`` when Kafka cannot be read."""
    from confluent_kafka import Consumer

    from bus.consumer import consumer_config
    from bus.positions import read_to_end, topic_extent

    extent = topic_extent(kafka, topic, CLIENT_ID)
    if extent is None:
        raise BatchTopicMissing(topic)
    starts, ends = extent
    log = BatchLog(only=only)
    consumer = Consumer(consumer_config(kafka, None, CLIENT_ID))
    try:
        for message in read_to_end(consumer, starts, ends, timeout_s):
            log.add(message)
    finally:
        consumer.close()
    return Snapshot(log, ends)


class BatchGone(Exception):
    """A tombstone removed the batch while it was watched."""


def follow(
    kafka: KafkaConnection,
    topic: str,
    seen: Latest,
    start: int,
    show: Callable[[BatchStateChanged], None],
    interval_s: float,
) -> BatchStateChanged:
    """Follow one batch on its partition from offset ``start`` (where the read that found ``seen`` ended),
    calling ``show`` with its state at once and every ``interval_s`` (sooner when it changes), until the
    state is terminal; return that state. Raises :class:`BatchGone` on a tombstone and
    ``bus.errors.BusError`` when the consumer fails."""
    from confluent_kafka import TopicPartition

    from bus.consumer import ConsumerThread, consumer_config
    from bus.errors import BusError

    batch_id = seen.state.batch_id
    log = BatchLog(only=batch_id, latest={batch_id: seen})
    lock = threading.Lock()
    changed = threading.Event()

    def handle(messages: list[Message]) -> None:
        with lock:
            for message in messages:
                log.add(message)
        changed.set()

    thread = ConsumerThread(
        consumer_config(kafka, None, CLIENT_ID),
        handle,
        assign=[TopicPartition(topic, seen.partition, start)],
        name=f"{CLIENT_ID}-watch",
        stats_interval_ms=0,
    )
    thread.start()
    try:
        while True:
            with lock:
                current = log.latest.get(batch_id)
            if current is None:
                raise BatchGone(batch_id)
            show(current.state)
            if current.state.terminal:
                return current.state
            changed.wait(interval_s)
            changed.clear()
            if thread.failure is not None:
                raise BusError(f"following {topic} failed: {thread.failure}")
    finally:
        # The loop above raises a failure of the consumer while it matters; once the batch ended, or while
        # another error propagates, one at shutdown changes nothing.
        with contextlib.suppress(BusError):
            thread.stop()


# ---------------------------------------------------------------- rendering


def _when(value: datetime | None) -> str:
    return "" if value is None else value.strftime("%Y-%m-%d %H:%M:%SZ")


def _status(status: str) -> Text:
    return Text(status, style=_COLOURS.get(status, ""))


def done_of(state: BatchStateChanged) -> int:
    """Lines answered, successfully or not."""
    return state.counts.completed + state.counts.failed


def progress_text(state: BatchStateChanged) -> str:
    counts = state.counts
    if counts.total == 0:
        return "no lines yet" if state.status == "validating" else "no lines"
    share = done_of(state) / counts.total
    return f"{done_of(state)}/{counts.total} lines answered ({share:.0%}), {counts.failed} failed"


def progress_bar(state: BatchStateChanged, width: int = 40) -> RenderableType:
    """A bar of the lines answered (completed + failed) out of all; it pulses while the count is unknown."""
    total = state.counts.total
    if total == 0:
        bar = ProgressBar(total=None if not state.terminal else 1, completed=0, width=width)
    else:
        bar = ProgressBar(
            total=total,
            completed=min(done_of(state), total),
            width=width,
            complete_style=_COLOURS.get(state.status, "yellow"),
            finished_style="red" if state.counts.failed else "green",
        )
    line = Table.grid(padding=(0, 1))
    line.add_row(bar, Text(progress_text(state)))
    return line


def status_time(state: BatchStateChanged) -> datetime | None:
    """When the batch entered its current status (None while validating: ``created`` says)."""
    return {
        "in_progress": state.in_progress_at,
        "finalizing": state.finalizing_at,
        "completed": state.completed_at,
        "failed": state.failed_at,
        "expired": state.expired_at,
        "cancelling": state.cancelling_at,
        "cancelled": state.cancelled_at,
    }.get(state.status)


def _unknown_model(status: str) -> str:
    """Why a batch names no model: it is learnt from the input's lines while validating, so a batch refused
    or cancelled then never had one (a review: a failed batch said "not known while validating", which it
    no longer was)."""
    if status == "validating":
        return "(not known while validating)"
    if status == "failed":
        return "(none: the input was refused)"
    return "-"


def render_state(state: BatchStateChanged) -> RenderableType:
    """The batch as a short table, its progress bar, and its errors when it has any."""
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    since = status_time(state)
    status = _status(state.status)
    if since is not None:
        status.append(f"  since {_when(since)}", style="dim")
    counts = state.counts
    rows: list[tuple[str, str | Text]] = [
        ("batch", state.batch_id),
        ("tenant", state.tenant),
        ("model", state.model or _unknown_model(state.status)),
        ("endpoint", state.endpoint),
        ("status", status),
        ("counts", f"total {counts.total}, completed {counts.completed}, failed {counts.failed}"),
        ("input file", state.input_file_id),
        ("output file", state.output_file_id or "-"),
        ("error file", state.error_file_id or "-"),
        ("created", _when(state.created_at)),
        ("expires", f"{_when(state.expires_at)} (window {state.completion_window})"),
        ("edge", f"{state.edge_id} (change {state.seq})"),
    ]
    if state.metadata:
        rows.append(("metadata", ", ".join(f"{k}={v}" for k, v in sorted(state.metadata.items()))))
    for name, value in rows:
        table.add_row(name, value if isinstance(value, Text) else Text(printable(value)))
    parts: list[RenderableType] = [table, progress_bar(state)]
    if state.errors:
        errors = Table("line", "code", "param", "message", title="errors", title_justify="left")
        for error in state.errors:
            errors.add_row(
                "" if error.line is None else str(error.line),
                printable(error.code),
                printable(error.param or ""),
                Text(printable(error.message)),
                style="red",
            )
        parts.append(errors)
    return Group(*parts)


def change_line(state: BatchStateChanged) -> str:
    """One line per change, for ``--watch`` when the output is not a terminal (a log, a script)."""
    return f"{_when(state.time)} {state.batch_id} {state.status}: {progress_text(state)}"


def select(
    latest: Iterable[Latest], tenant: str | None = None, status: str | None = None
) -> list[BatchStateChanged]:
    """The states that match, newest first (by creation; the batch id breaks ties)."""
    states = [
        s.state
        for s in latest
        if (tenant is None or s.state.tenant == tenant)
        and (status is None or s.state.status == status or (status == ACTIVE and not s.state.terminal))
    ]
    states.sort(key=lambda s: s.batch_id, reverse=True)
    states.sort(key=lambda s: s.created_at, reverse=True)
    return states


def render_list(states: list[BatchStateChanged], title: str) -> Table:
    """One row per batch; ids are never cut short (an operator copies them into ``status``)."""
    table = Table(title=title)
    table.add_column("batch", no_wrap=True, min_width=max((len(s.batch_id) for s in states), default=5))
    table.add_column("tenant")
    table.add_column("model")
    table.add_column("status", no_wrap=True)
    table.add_column("answered", no_wrap=True)
    table.add_column("failed")
    table.add_column("created", no_wrap=True)
    table.add_column("endpoint")
    for s in states:
        answered = f"{done_of(s)}/{s.counts.total}" if s.counts.total else "-"
        table.add_row(
            Text(s.batch_id),
            Text(s.tenant),
            Text(s.model),
            _status(s.status),
            answered,
            str(s.counts.failed),
            _when(s.created_at),
            s.endpoint.removeprefix("/v1/"),
        )
    return table


# ---------------------------------------------------------------- commands


batch_app = command_group(
    help="Async batches (the OpenAI Batch API): their state and progress. " + _SOURCE_HELP
)


def _read(only: str | None = None) -> tuple[Snapshot, str]:
    """The batches topic read to its end, or a red line and exit 1."""
    from bus.errors import BusError
    from schemas.topics import TopicNames
    from sluice.cli import console, fail, settings

    platform = settings()
    topic = TopicNames(platform.topic_prefix).batches
    try:
        with console.status(f"reading {topic}"):
            snapshot = read_batches(platform.kafka, topic, only)
    except BatchTopicMissing:
        raise fail(f"no topic {topic} at {platform.bootstrap} (`sluice topics apply` creates it)") from None
    except BusError as exc:
        raise fail(f"cannot read {topic} at {platform.bootstrap}: {exc} (is `sluice up` running?)") from None
    if snapshot.log.skipped:
        console.print(
            f"[yellow]skipped {snapshot.log.skipped} records of {topic} that hold no batch state[/]"
        )
    return snapshot, topic


@batch_app.command("status", help=_STATUS_COMMAND_HELP)
def batch_status(
    batch_id: Annotated[str, typer.Argument(help="the batch id, e.g. batch_0192...")],
    watch: Annotated[
        bool,
        typer.Option(
            "--watch",
            help="follow the batch live until it ends, then print its final state; exit 0 when it "
            f"completed, {EXIT_ENDED_UNSUCCESSFULLY} when it failed, expired or was cancelled",
        ),
    ] = False,
    interval: Annotated[
        float, typer.Option("--interval", min=0.1, help="seconds between redraws of --watch's display")
    ] = 1.0,
) -> None:
    """Show one batch (see ``_STATUS_COMMAND_HELP``)."""
    from rich.live import Live

    from sluice.cli import fail, out

    snapshot, topic = _read(only=batch_id)
    seen = snapshot.log.latest.get(batch_id)
    if seen is None:
        raise fail(f"no batch {batch_id} on {topic}")
    final = seen.state
    if watch and not final.terminal:
        if out.is_terminal:
            with Live(render_state(final), console=out, auto_refresh=False, transient=True) as live:

                def redraw(state: BatchStateChanged) -> None:
                    live.update(render_state(state), refresh=True)

                final = _follow(snapshot, topic, seen, redraw, interval)
        else:
            shown: list[tuple[str, int, int, int]] = []

            def log_change(state: BatchStateChanged) -> None:
                key = (state.status, state.counts.total, state.counts.completed, state.counts.failed)
                if not shown or shown[-1] != key:
                    shown.append(key)
                    out.print(change_line(state), highlight=False)

            final = _follow(snapshot, topic, seen, log_change, interval)
    out.print(render_state(final))
    if watch and final.status != "completed":
        raise typer.Exit(EXIT_ENDED_UNSUCCESSFULLY)


def _follow(
    snapshot: Snapshot, topic: str, seen: Latest, show: Callable[[BatchStateChanged], None], interval: float
) -> BatchStateChanged:
    from bus.errors import BusError
    from sluice.cli import fail, settings

    platform = settings()
    try:
        return follow(platform.kafka, topic, seen, snapshot.ends.get(seen.partition, 0), show, interval)
    except BatchGone:
        raise fail(f"batch {seen.state.batch_id} was deleted from {topic} while watched") from None
    except BusError as exc:
        raise fail(f"cannot follow {topic} at {platform.bootstrap}: {exc}") from None


@batch_app.command("list", help=_LIST_COMMAND_HELP)
def batch_list(
    tenant: Annotated[str | None, typer.Option("--tenant", help="only this tenant's batches")] = None,
    status: Annotated[
        str | None,
        typer.Option(
            "--status",
            help=f"only batches in this status: {', '.join(STATUSES)}, or {ACTIVE} (not ended yet)",
        ),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="at most this many, newest first")] = 50,
) -> None:
    """List batches (see ``_LIST_COMMAND_HELP``)."""
    from sluice.cli import out

    if status is not None and status not in (*STATUSES, ACTIVE):
        raise typer.BadParameter(f"expected one of {', '.join((*STATUSES, ACTIVE))}", param_hint="--status")
    snapshot, topic = _read()
    states = select(snapshot.log.latest.values(), tenant, status)
    filters = "".join(
        f" {name} {value}" for name, value in (("tenant", tenant), ("status", status)) if value is not None
    )
    if not states:
        out.print(escape(f"no batches{filters} on {topic}"))  # a tenant '[/x]' is not markup (a review)
        return
    shown = states[:limit]
    title = f"batches{filters} on {topic}: {len(shown)} of {len(states)}, newest first"
    out.print(render_list(shown, escape(title)))
