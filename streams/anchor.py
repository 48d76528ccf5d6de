"""Audit chains anchored on the log: the ``audit`` topic, not the warehouse, says where each chain ends.

The streams worker publishes every audit entry on the ``audit`` topic and waits until it is durable before
it inserts the entry's ``audit_log`` row, so the topic holds every entry the table should hold (for the
topic's retention, 365 days). Rows deleted, edited or replaced in the warehouse are still on the topic; a
crash between publishing and inserting leaves the topic ahead of the table. Two readers compare the two:

- :func:`anchor_chains`, the worker at start. Each chain goes on from the topic's head. Where the table is
  *behind* (its last row is the topic's entry of that seq and the topic goes further: a cut tail, or that
  crash) the missing entries are inserted from the topic: the warehouse heals. Where the table *disagrees*
  (another hash at the seq they share, rows past the topic's head, or a topic chain that forks) the chain is
  a conflict: its new entries still go on from the topic's head and onto the topic, but their rows are
  withheld from ``audit_log`` until an operator resolves it (docs/streams.md); the worker logs an error and
  sets ``sluice_streams_audit_conflicts``.
- :func:`verify_anchored`, ``sluice audit verify``: the warehouse's own check
  (:func:`streams.audit.verify_warehouse`) plus, against the topic, a cut tail (or a whole chain deleted),
  rows past the topic's head, rows that differ from the topic's entry of the same seq, and inconsistencies
  of the topic's own chains.

A chain is read in its partition's order (the topic is keyed by chain). Memory: a pass over the topic keeps
a few values per chain (:class:`TopicChain`); only chains already known to differ keep their hashes by seq,
and healing inserts in chunks as it reads.
"""

from __future__ import annotations

import hashlib
import logging
import time
import zlib
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec
from confluent_kafka import TIMESTAMP_NOT_AVAILABLE, Consumer, TopicPartition

from bus.consumer import consumer_config
from bus.positions import read_to_end, topic_extent
from bus.producer import Position
from schemas.codec import UNREADABLE_JSON, DecodeError, decode
from schemas.events import AuditEntry
from schemas.settings import KafkaConnection, PlatformSettings
from schemas.topics import TopicNames
from streams import StreamsError
from streams.audit import (
    GENESIS,
    AuditHead,
    Problem,
    VerifyReport,
    canonical,
    newest_times,
    row_canonical,
    rows_at,
    verify_warehouse,
    warehouse_rows,
)

__all__ = [
    "AUDIT_HEADS",
    "ORIGIN",
    "AnchorError",
    "Anchored",
    "AnchoredReport",
    "TopicChain",
    "advance",
    "anchor_chains",
    "audit_extent",
    "audit_records",
    "read_chains",
    "resumed",
    "verify_anchored",
]

log = logging.getLogger(__name__)

ORIGIN = "results_offset"
"""The audit entry detail naming the partition and offset (of ``results`` or ``control``) it was built from."""
AUDIT_HEADS = (
    "SELECT tenant, max(seq) AS head_seq, argMax(entry_hash, seq) AS head_hash, "
    "argMax(details, seq) AS head_details FROM audit_log FINAL GROUP BY tenant"
)
"""Each chain's last row in the warehouse."""

_DETAILS = msgspec.json.Decoder(dict[str, str])
"""An ``audit_log`` row's ``details``: a JSON object of strings."""

Placed = tuple[AuditEntry, int, int]
"""An entry read from the topic, with the partition and offset it is stored at."""
Extent = tuple[list[TopicPartition], dict[int, int]]
"""Where a read of the topic starts (per partition) and the end offsets it reads up to."""


class AnchorError(StreamsError, RuntimeError):
    """The audit topic does not exist."""


# ------------------------------------------------------------------------------------------ the topic


def audit_extent(kafka: KafkaConnection, topic: str, client_id: str) -> Extent:
    """The audit topic from its first retained offsets to its end now. Raises :class:`AnchorError` when
    it does not exist, :class:`~bus.errors.BusError` when the cluster cannot say."""
    extent = topic_extent(kafka, topic, client_id)
    if extent is None:
        raise AnchorError(
            f"the audit topic {topic} does not exist at {kafka.bootstrap}: run `sluice topics apply`"
        )
    return extent


def resumed(extent: Extent, read: Mapping[int, int]) -> Extent:
    """``extent`` from where an earlier read stopped (``read``: per partition, the end it reached): only
    what was appended since. A partition not read before, or one whose end is now before the end read (the
    topic was made again), is read from its first retained offset, as is one whose records up to there were
    deleted by retention."""
    starts, ends = extent
    since: list[TopicPartition] = []
    for start in starts:
        reached = read.get(start.partition, -1)
        offset = reached if start.offset <= reached <= ends.get(start.partition, 0) else start.offset
        since.append(TopicPartition(start.topic, start.partition, offset))
    return since, ends


def audit_records(
    kafka: KafkaConnection,
    extent: Extent,
    client_id: str,
    *,
    timeout_s: float,
    firsts: dict[int, int] | None = None,
) -> Iterator[Placed]:
    """Every audit entry within ``extent``, each partition in offset order (records that are not audit
    entries are skipped and counted in a warning). :class:`~bus.errors.BusError` past ``timeout_s``.
    ``firsts``, if given, gets each partition's first record's Kafka timestamp (unix ms, the producer's
    clock as it published), where the partition has one: how far back its retention reaches."""
    starts, ends = extent
    consumer = Consumer(consumer_config(kafka, None, client_id))
    skipped = 0
    try:
        for message in read_to_end(consumer, starts, ends, timeout_s):
            partition, offset = message.partition() or 0, message.offset() or 0
            if offset >= ends.get(partition, 0):
                continue  # appended after the extent was taken
            if firsts is not None and partition not in firsts:
                kind, stamp = message.timestamp()
                if kind != TIMESTAMP_NOT_AVAILABLE:
                    firsts[partition] = stamp
            try:
                event = decode(message.value() or b"")
            except DecodeError:
                event = None
            if isinstance(event, AuditEntry):
                yield event, partition, offset
            else:
                skipped += 1
    finally:
        consumer.close()
    if skipped:
        log.warning("audit: skipped %d records on %s that are not audit entries", skipped, starts[0].topic)


@dataclass(slots=True)
class TopicChain:
    """One chain as a pass over the topic saw it, in read order (its partition's order)."""

    chain: str
    probe: int = -1
    """A seq to look at (the warehouse's last): ``probed`` is the hash there, ``probe_next`` the prev_hash
    of the seq after it (-1: ``probe_next`` is seq 0's)."""
    hashes: dict[int, str] | None = None
    """Every seq's hash, kept only for chains compared row by row."""
    first: int = -1
    """The lowest seq read (retention deletes the oldest entries)."""
    head: AuditHead | None = None
    """The last entry read: where the chain goes on."""
    origins: dict[int, int] = field(default_factory=dict)
    """The last offset each source partition of its entries reached (``details[ORIGIN]``): a chain whose
    tenant moved partition (the ``results`` topic grew) has entries from two."""
    entries: int = 0
    problem: Problem | None = None
    """The first inconsistency of the topic's own chain: a fork, a gap, an entry that does not hash."""
    probed: str | None = None
    probe_next: str | None = None
    _mark: AuditHead | None = None
    """Where the chain stood when entries from an earlier seq came again; cleared when they reach it."""

    def add(self, entry: AuditEntry, *, check_hash: bool = False) -> None:
        seq, digest = entry.seq, entry.entry_hash
        if check_hash and hashlib.sha256(canonical(entry)).hexdigest() != digest:
            self._flag(seq, "the entry does not hash to its entry_hash")
        head = self.head
        if head is not None:
            if seq == head.seq + 1:
                if entry.prev_hash != head.entry_hash:
                    self._flag(seq, f"its prev_hash is not seq {head.seq}'s entry_hash: the chain forks")
            elif seq > head.seq + 1:
                self._flag(head.seq + 1, f"seq {_span(head.seq + 1, seq - 1)} missing between entries")
            elif seq < head.seq or digest != head.entry_hash:
                # Published again from an earlier seq: the same entries (a batch rebuilt after a crash) or
                # a fork, told apart when the run reaches the seq the chain had reached.
                self._mark = self._mark or head
            mark = self._mark
            if mark is not None and seq >= mark.seq:
                if seq == mark.seq and digest != mark.entry_hash:
                    self._flag(seq, f"seq {seq} is on the topic twice with different hashes: the chain forks")
                self._mark = None
        self.first = seq if self.first < 0 else min(self.first, seq)
        self.head = AuditHead(seq=seq, entry_hash=digest)
        place = origin_of(entry.details.get(ORIGIN, ""))
        if place is not None:
            self.origins[place[0]] = max(place[1], self.origins.get(place[0], -1))
        self.entries += 1
        if seq == self.probe:
            self.probed = digest
        elif seq == self.probe + 1:
            self.probe_next = entry.prev_hash
        if self.hashes is not None:
            self.hashes[seq] = digest

    def finish(self) -> None:
        """The end of the pass: a run of entries published again that stops short of where the chain
        had reached is a fork (the entries after it on the topic went on from another head)."""
        mark, head = self._mark, self.head
        if mark is not None and head is not None:
            self._flag(
                head.seq,
                f"entries from an earlier seq came again after seq {mark.seq} and end at seq {head.seq}: "
                "the chain forks",
            )
        self._mark = None

    def _flag(self, seq: int, reason: str) -> None:
        if self.problem is None:
            self.problem = Problem(self.chain, seq, f"on the audit topic: {reason}")


def origin_of(origin: str) -> Position | None:
    """The (partition, offset) an entry's ``details[ORIGIN]`` names (``"3:41"``), if it names one."""
    partition, sep, offset = origin.partition(":")
    if sep and partition.isdigit() and offset.isdigit():
        return int(partition), int(offset)
    return None


def read_chains(
    records: Iterable[Placed],
    *,
    tenant: str | None = None,
    probes: Mapping[str, int] | None = None,
    keep_hashes: Collection[str] = (),
    check_hashes: bool = False,
) -> tuple[dict[str, TopicChain], int]:
    """Every chain on the topic (``tenant``'s only, when given) and how many entries were read."""
    chains: dict[str, TopicChain] = {}
    read = 0
    for entry, _, _ in records:
        read += 1
        name = entry.tenant
        if tenant is not None and name != tenant:
            continue
        chain = chains.get(name)
        if chain is None:
            probe = (probes or {}).get(name, -1)
            chain = chains[name] = TopicChain(name, probe, {} if name in keep_hashes else None)
        chain.add(entry, check_hash=check_hashes)
    for chain in chains.values():
        chain.finish()
    return chains, read


# ------------------------------------------------------------------------------------------ the worker


@dataclass(frozen=True, slots=True)
class Anchored:
    """Where each chain goes on, and what the worker found at start."""

    heads: dict[str, AuditHead]
    offsets: dict[str, dict[int, int]]
    """Per chain, per source partition: the last offset its entries were built from; redelivered events up
    to it are skipped. Per partition: after the ``results`` topic grew, a tenant's chain goes on from
    another partition, and a crash then redelivered the first one's records, chained again (an audit:
    duplicate entries that verified)."""
    healed: dict[str, tuple[int, int]]
    """Per chain the warehouse was behind on: the first and last seq inserted from the topic."""
    conflicts: dict[str, str]
    """Per chain whose warehouse rows disagree with the topic: why. Its rows are withheld."""
    topic_problems: list[Problem]
    entries: int
    """Entries read on the topic (per pass)."""


Heal = Callable[[Sequence[Placed]], None]
"""Inserts entries from the topic (``audit_log`` and ``events_raw`` rows), a chunk at a time."""


def anchor_chains(
    warehouse_heads: Iterable[Mapping[str, object]],
    records: Callable[[], Iterable[Placed]],
    heal: Heal,
    *,
    chunk: int = 5000,
) -> Anchored:
    """Each chain's head from the topic, compared with the warehouse's (:data:`AUDIT_HEADS` rows).

    ``records()`` reads the topic from its start to its end as it was before (called once, and once more
    to heal); ``heal`` gets the missing entries of every chain the warehouse is behind on, ``chunk`` at a
    time. A chain the topic does not hold (older than its retention) goes on from the warehouse's head.
    """
    stored: dict[str, tuple[AuditHead, str]] = {}
    malformed: dict[str, str] = {}
    for row in warehouse_heads:
        name = str(row["tenant"])
        head = AuditHead(seq=_int(row["head_seq"]), entry_hash=str(row["head_hash"]))
        try:
            details = _DETAILS.decode(str(row["head_details"] or "{}"))
        except UNREADABLE_JSON as exc:  # not JSON, or not an object of strings: an edited row
            details = {}
            malformed[name] = f"the warehouse's seq {head.seq} is a malformed row (details: {exc})"
        stored[name] = (head, details.get(ORIGIN, ""))
    chains, read = read_chains(records(), probes={name: head.seq for name, (head, _) in stored.items()})
    heads: dict[str, AuditHead] = {}
    offsets: dict[str, dict[int, int]] = {}
    conflicts: dict[str, str] = {}
    behind: dict[str, int] = {}
    for name in sorted(stored.keys() | chains.keys()):
        logged = chains.get(name)
        if logged is None or logged.head is None:
            heads[name], origin = stored[name]
            place = origin_of(origin)
            origins = {place[0]: place[1]} if place is not None else {}
            if name in malformed:
                conflicts[name] = malformed[name]
        else:
            heads[name], origins = logged.head, dict(logged.origins)
            last = stored[name][0] if name in stored else None
            reason = malformed.get(name) or _disagreement(last, logged)
            if reason is not None:
                conflicts[name] = reason
            elif logged.head.seq > (last.seq if last is not None else -1):
                behind[name] = last.seq if last is not None else -1
        if origins:
            offsets[name] = origins
    healed = _heal(records(), behind, heal, chunk) if behind else {}
    problems = [c.problem for c in chains.values() if c.problem is not None]
    return Anchored(heads, offsets, healed, conflicts, problems, read)


def advance(
    heads: dict[str, AuditHead], offsets: dict[str, dict[int, int]], chains: Mapping[str, TopicChain]
) -> None:
    """Move ``heads`` and ``offsets`` (the worker's, as of an earlier read of the topic) on to what a read of
    the entries appended since found (:func:`read_chains` over :func:`resumed`): each chain read goes on
    from its last entry there, and its source partitions' offsets reach at least what those entries came
    from. The topic is read to an end taken after everything this worker published was durable, so a
    chain's last entry read is its head, whoever appended it."""
    for name, chain in chains.items():
        if chain.head is None:
            continue
        heads[name] = chain.head
        reached = offsets.setdefault(name, {})
        for partition, offset in chain.origins.items():
            reached[partition] = max(offset, reached.get(partition, -1))


def _disagreement(stored: AuditHead | None, logged: TopicChain) -> str | None:
    """Why the warehouse's chain (its last row ``stored``) is not the topic's or a prefix of it."""
    head = logged.head
    if head is None:
        return None
    last = stored.seq if stored is not None else -1
    if stored is not None and head.seq < stored.seq:
        return (
            f"the warehouse has seq {_span(head.seq + 1, stored.seq)} past the audit topic's last entry "
            f"(seq {head.seq}): rows the log never had"
        )
    if stored is not None and logged.probed is not None and logged.probed != stored.entry_hash:
        return (
            f"the warehouse's seq {stored.seq} has entry_hash {stored.entry_hash[:12]}…, the audit "
            f"topic's {logged.probed[:12]}…"
        )
    if head.seq == last:
        return None  # in step (the head's hash compared above)
    if logged.problem is not None:
        return f"the warehouse is behind an inconsistent topic chain ({logged.problem.reason})"
    link = stored.entry_hash if stored is not None else GENESIS
    if logged.probe_next is not None and logged.probe_next != link:
        return f"the audit topic's seq {last + 1} does not link to the warehouse's seq {last}"
    return None


def _heal(
    records: Iterable[Placed], behind: Mapping[str, int], heal: Heal, chunk: int
) -> dict[str, tuple[int, int]]:
    """Hand every entry past the warehouse's last seq of the ``behind`` chains to ``heal``, in chunks."""
    reached = dict(behind)
    firsts: dict[str, int] = {}
    pending: list[Placed] = []
    for placed in records:
        entry = placed[0]
        last = reached.get(entry.tenant)
        if last is None or entry.seq <= last:
            continue  # not behind, or already there (an entry published again)
        reached[entry.tenant] = entry.seq
        firsts.setdefault(entry.tenant, entry.seq)
        pending.append(placed)
        if len(pending) >= chunk:
            heal(pending)
            pending = []
    if pending:
        heal(pending)
    return {name: (first, reached[name]) for name, first in firsts.items()}


# ------------------------------------------------------------------------------------------ verifying


class AnchoredReport(msgspec.Struct, frozen=True, kw_only=True):
    """What ``sluice audit verify`` found: the warehouse's chains checked alone and against the topic."""

    warehouse: VerifyReport
    problems: list[Problem]
    """Every problem, the warehouse's own and those against the topic, by chain then seq."""
    topic_entries: int
    """Entries read on the audit topic."""
    anchored: int
    """Chains found on the topic (and compared with it)."""
    unanchored: list[str]
    """Chains in the warehouse with no entry left on the topic (older than its retention): checked by
    their own hashes alone."""

    @property
    def ok(self) -> bool:
        return not self.problems


VERIFY_CLIENT = "sluice-audit-verify"


def verify_anchored(
    settings: PlatformSettings,
    *,
    tenant: str | None = None,
    page_rows: int = 5000,
    timeout_s: float = 600.0,
    settle_s: float = 3.0,
) -> AnchoredReport:
    """Verify the warehouse's chains (``tenant``'s only, when given), then compare them with the topic.

    The warehouse is read first and the topic's end taken after, so every row read is within the topic
    read: a row past the topic's head was never on it. Entries the topic has past a chain's last row may
    be in flight (published, not yet inserted, on a running platform): those chains are asked again for
    up to ``settle_s`` before they count as a cut tail. Raises :class:`~infra.warehouse.WarehouseError`,
    :class:`AnchorError` or :class:`~bus.errors.BusError` when the warehouse or the topic cannot be read.
    """
    report = verify_warehouse(settings, tenant=tenant, page_rows=page_rows)
    extent = audit_extent(settings.kafka, TopicNames(settings.topic_prefix).audit, VERIFY_CLIENT)
    probes = {name: head.seq for name, head in report.heads.items()}
    suspects = {problem.tenant for problem in report.problems}

    firsts: dict[int, int] = {}  # each partition's first retained record's time (the first scan's)

    def scan(keep: Collection[str], *, check: bool) -> tuple[dict[str, TopicChain], int]:
        records = audit_records(settings.kafka, extent, VERIFY_CLIENT, timeout_s=timeout_s, firsts=firsts)
        return read_chains(records, tenant=tenant, probes=probes, keep_hashes=keep, check_hashes=check)

    chains, read = scan(suspects, check=True)
    problems = list(report.problems)
    compare = set(suspects)
    cut: dict[str, TopicChain] = {}
    unanchored: list[str] = []
    for name in sorted(report.heads.keys() | chains.keys()):
        stored, logged = report.heads.get(name), chains.get(name)
        if logged is None or logged.head is None:
            unanchored.append(name)
            continue
        if logged.problem is not None:
            problems.append(logged.problem)
        if stored is None or logged.head.seq > stored.seq:
            cut[name] = logged
        elif logged.head.seq < stored.seq:
            problems.append(
                Problem(
                    name,
                    logged.head.seq + 1,
                    f"seq {_span(logged.head.seq + 1, stored.seq)} are in the warehouse but not on the audit "
                    f"topic, whose chain ends at seq {logged.head.seq} (rows added)",
                )
            )
            compare.add(name)
        if stored is not None and logged.probed is not None and logged.probed != stored.entry_hash:
            compare.add(name)  # the rows differ from the topic's at or before the warehouse's last seq
    problems += _added_chains(settings, report, unanchored, dict(firsts), len(extent[0]))
    unanchored = [name for name in unanchored if name not in {p.tenant for p in problems}]
    for name in _settle(settings, cut, settle_s):
        problems.append(_cut_tail(name, report.heads.get(name), cut[name]))
    later = {name for name in compare - suspects if name in chains}
    if later:
        more, _ = scan(later, check=False)
        for name in later:
            chains[name].hashes = more[name].hashes
    hashes = {name: chains[name].hashes or {} for name in compare if name in chains}
    problems += _differing(settings, hashes, page_rows)
    problems.sort(key=lambda problem: (problem.tenant, problem.seq))
    return AnchoredReport(
        warehouse=report, problems=problems, topic_entries=read, anchored=len(chains), unanchored=unanchored
    )


def _added_chains(
    settings: PlatformSettings,
    report: VerifyReport,
    unanchored: Sequence[str],
    firsts: Mapping[int, int],
    partitions: int,
) -> list[Problem]:
    """The chains with no entry on the topic whose newest row is no older than the first record its
    partition still holds: not aged out by the topic's retention, so never on it (an audit: a chain
    fabricated in ``audit_log`` with valid hashes, dated now, verified as "older than its retention").

    A chain's entries are keyed by its tenant, so they all go to one partition (:func:`chain_partition`),
    and retention deletes each partition's oldest segments on its own: the bound is that partition's first
    retained record, by its Kafka timestamp (the streams worker's clock as it published). It was the
    oldest entry's ``time`` over the whole topic: one entry dated long ago (a worker's clock, or a quiet
    partition's old segment) made every aged-out chain look added. A chain whose partition holds nothing
    cannot be dated, and is not judged."""
    if not unanchored or not firsts or partitions <= 0:
        return []
    problems: list[Problem] = []
    for name, newest_ms in sorted(newest_times(settings, unanchored).items()):
        first_ms = firsts.get(chain_partition(name, partitions))
        if first_ms is None or newest_ms < first_ms:
            continue  # nothing to date it by, or older than what the partition keeps
        newest = datetime.fromtimestamp(newest_ms / 1000, UTC)
        first = datetime.fromtimestamp(first_ms / 1000, UTC)
        head = report.heads.get(name)
        problems.append(
            Problem(
                name,
                head.seq if head is not None else 0,
                f"the chain has no entry on the audit topic, yet its newest row ({newest:{STAMP}}) "
                f"is no older than the first record its partition holds ({first:{STAMP}}): rows added",
            )
        )
    return problems


def chain_partition(tenant: str, partitions: int) -> int:
    """The audit topic partition of ``tenant``'s chain: where librdkafka's default partitioner
    (``consistent_random``: CRC-32 of the key, modulo the partition count) puts records keyed by the
    tenant, as every audit entry is (:func:`schemas.codec.kafka_key`)."""
    return zlib.crc32(tenant.encode()) % partitions


STAMP = "%Y-%m-%d %H:%M:%S"


def _settle(settings: PlatformSettings, cut: Mapping[str, TopicChain], settle_s: float) -> list[str]:
    """The chains of ``cut`` whose topic head is still not in the warehouse after up to ``settle_s``."""
    waiting = {name: chain.head for name, chain in cut.items() if chain.head is not None}
    deadline = time.monotonic() + settle_s
    while waiting:
        found = rows_at(settings, [(name, head.seq) for name, head in waiting.items()])
        for name, head in list(waiting.items()):
            row = found.get((name, head.seq))
            if row is not None and row.get("entry_hash") == head.entry_hash:
                del waiting[name]  # it was in flight
        if not waiting or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    return sorted(waiting)


def _cut_tail(name: str, stored: AuditHead | None, logged: TopicChain) -> Problem:
    head = logged.head
    last = head.seq if head is not None else logged.first
    if stored is None:
        return Problem(
            name,
            logged.first,
            f"cut tail: seq {_span(logged.first, last)} are on the audit topic, none in the warehouse "
            "(the chain's rows were deleted)",
        )
    return Problem(
        name,
        stored.seq + 1,
        f"cut tail: the audit topic's chain runs to seq {last}, the warehouse's stops at seq {stored.seq}: "
        f"seq {_span(stored.seq + 1, last)} missing (rows deleted)",
    )


def _differing(
    settings: PlatformSettings, hashes: Mapping[str, Mapping[int, str]], page_rows: int
) -> list[Problem]:
    """Rows of these chains that are not the topic's entry of the same seq (by content and by stored
    hash), as runs of consecutive seqs."""
    problems: list[Problem] = []
    run: tuple[str, int, int] | None = None

    def close(run: tuple[str, int, int]) -> None:
        name, first, last = run
        reason = (
            "differs from the audit topic's entry of the same seq (row replaced or edited)"
            if first == last
            else f"seq {first}..{last} differ from the audit topic's entries (rows replaced or edited)"
        )
        problems.append(Problem(name, first, reason))

    for row in warehouse_rows(settings, tenants=list(hashes), page_rows=page_rows):
        name, seq = str(row["tenant"]), _int(row["seq"])
        logged = hashes[name].get(seq)
        if logged is None or _row_hash(row) == logged == row.get("entry_hash"):
            continue  # not on the topic (older than its retention, or reported above), or the same entry
        if run is not None and run[0] == name and run[2] == seq - 1:
            run = (name, run[1], seq)
            continue
        if run is not None:
            close(run)
        run = (name, seq, seq)
    if run is not None:
        close(run)
    return problems


def _row_hash(row: Mapping[str, object]) -> str | None:
    try:
        return hashlib.sha256(row_canonical(row)).hexdigest()
    except (KeyError, TypeError, ValueError):
        return None


def _span(first: int, last: int) -> str:
    return str(first) if first == last else f"{first}..{last}"


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"expected an integer, got {value!r}")
    return int(value)
