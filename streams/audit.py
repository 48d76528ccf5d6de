"""The audit log: one tamper-evident hash chain per tenant, and its verification.

Every terminal request and every administrative action becomes one :class:`~schemas.events.AuditEntry`:
who (``actor``), what (``action`` on ``resource``), when (``time``), which model and version, and the
``decision`` taken, with a few string ``details``. Prompts and completions are never part of an entry.

Each tenant's entries form a chain: ``seq`` counts from 0, ``prev_hash`` is the previous entry's
``entry_hash`` (:data:`GENESIS`, 64 zeros, for seq 0), and ``entry_hash`` is the SHA-256 (lowercase hex)
of the entry's canonical form. The canonical form is computed from the ``audit_log`` row alone, so an
auditor can recompute it from the table with any JSON library:

- a JSON object with exactly these keys — the table's columns except ``entry_hash``: ``action``, ``actor``,
  ``decision``, ``details``, ``entry_id``, ``model``, ``model_version``, ``prev_hash``, ``request_id``,
  ``resource``, ``seq``, ``source``, ``tenant``, ``time``;
- ``seq`` a JSON integer; ``time`` the string ``YYYY-MM-DDTHH:MM:SS.mmmZ`` (UTC, milliseconds, as the
  ``DateTime64(3, 'UTC')`` column holds it); ``details`` a JSON object of strings (the column stores it as
  JSON text; it is parsed and re-encoded); every other value a JSON string;
- keys sorted (objects nested included), no whitespace, UTF-8, non-ASCII characters not escaped — what
  Python's ``json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()`` writes.

The event's envelope ``type`` tag and trace context (``traceparent``, ``tracestate``) are transport
metadata: they are not in the table and not covered by the hash. :func:`append` floors the time to the
millisecond so the event and its row hash the same.

:func:`verify` checks rows (as dicts keyed by column) and :func:`verify_warehouse` reads the table through
:func:`infra.warehouse.query_warehouse`, the path ``sluice sql`` takes (the running platform's chDB owner,
else a read-only open of the directory, or a ClickHouse server).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Iterable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

import msgspec

from infra.warehouse import QueryResult, query_warehouse
from schemas.events import AuditEntry, RequestFinished, utc_now
from schemas.ids import derived_uuid7, uuid7, uuid7_unix_ms
from schemas.settings import PlatformSettings

__all__ = [
    "AUDIT_COLUMNS",
    "GENESIS",
    "AuditHead",
    "ChainVerifier",
    "Problem",
    "VerifyReport",
    "admin_entry",
    "append",
    "audit_row",
    "canonical",
    "latest_entries",
    "request_entry",
    "request_entry_id",
    "row_canonical",
    "rows_at",
    "verify",
    "verify_warehouse",
    "warehouse_rows",
]

GENESIS = "0" * 64
"""The ``prev_hash`` of a tenant's first entry (seq 0)."""

AUDIT_COLUMNS = (
    "tenant", "seq", "entry_id", "time", "actor", "action", "resource", "model", "model_version",
    "request_id", "decision", "details", "source", "prev_hash", "entry_hash",
)  # fmt: skip
"""The ``audit_log`` table's columns, in order (migration 0002)."""

_ACTIONS = {
    "chat": "chat.completions.create",
    "completion": "completions.create",
    "embedding": "embeddings.create",
    "": "request",
}


class AuditHead(msgspec.Struct, frozen=True):
    """A tenant's last entry: where its chain goes on."""

    seq: int
    entry_hash: str


# ------------------------------------------------------------------------------------------ building


def append(
    head: AuditHead | None,
    *,
    tenant: str,
    model: str,
    request_id: str,
    actor: str,
    action: str,
    resource: str,
    decision: str,
    details: Mapping[str, str],
    model_version: str,
    source: str,
    time: datetime | None = None,
    entry_id: str | None = None,
) -> AuditEntry:
    """The entry after ``head`` in ``tenant``'s chain (seq 0 after :data:`GENESIS` when ``head`` is None).

    ``time`` (default now) must be aware UTC and is floored to the millisecond; ``entry_id`` defaults to a
    new UUIDv7.
    """
    if not tenant:
        raise ValueError("an audit entry needs a tenant")
    when = time if time is not None else utc_now()
    when = when.replace(microsecond=when.microsecond // 1000 * 1000)
    entry_id = entry_id if entry_id is not None else uuid7()
    prev_hash = head.entry_hash if head is not None else GENESIS
    seq = head.seq + 1 if head is not None else 0
    details = dict(details)
    form = _Form(
        action=action,
        actor=actor,
        decision=decision,
        details=details,
        entry_id=entry_id,
        model=model,
        model_version=model_version,
        prev_hash=prev_hash,
        request_id=request_id,
        resource=resource,
        seq=seq,
        source=source,
        tenant=tenant,
        time=_canonical_time(when),
    )
    return AuditEntry(
        id=entry_id,
        time=when,
        tenant=tenant,
        model=model,
        request_id=request_id,
        source=source,
        actor=actor,
        action=action,
        resource=resource,
        decision=decision,
        details=details,
        prev_hash=prev_hash,
        seq=seq,
        model_version=model_version,
        entry_hash=hashlib.sha256(_checked(form)).hexdigest(),
    )


def request_entry(
    head: AuditHead | None,
    finished: RequestFinished,
    *,
    source: str,
    extra: Mapping[str, str] | None = None,
) -> AuditEntry:
    """The entry for a request's terminal event: who asked for what, and how it ended — no content.

    Built from the event alone (its time, ids, status, usage) and ``extra`` details, so a re-run on the
    same event after the same head gives the same entry, hash included.
    """
    details = {
        **(extra or {}),
        "finish_reason": finished.finish_reason or "",
        "prompt_tokens": str(finished.usage.prompt_tokens),
        "completion_tokens": str(finished.usage.completion_tokens),
        "worker_id": finished.worker_id,
        "edge_id": finished.edge_id,
    }
    if finished.error is not None:
        details["error_code"] = finished.error.code
    if finished.batch is not None:  # a line of an async batch: which batch and line (not its custom id)
        details["batch_id"] = finished.batch.batch_id
        details["batch_index"] = str(finished.batch.index)
    return append(
        head,
        tenant=finished.tenant,
        model=finished.model,
        request_id=finished.request_id,
        actor=f"tenant:{finished.tenant}",
        action=_ACTIONS[finished.kind],
        resource=f"model:{finished.model}",
        decision=finished.status,
        details=details,
        model_version=finished.model_version,
        source=source,
        time=finished.time,
        entry_id=request_entry_id(finished.tenant, finished.request_id),
    )


def request_entry_id(tenant: str, request_id: str) -> str:
    """The id of a request's audit entry: a UUIDv7 with the request id's time (when it is a UUIDv7) and
    74 bits of SHA-256 over tenant and request id, so every build of the entry has the same id."""
    try:
        unix_ms = uuid7_unix_ms(request_id)
    except ValueError:
        unix_ms = 0
    return derived_uuid7(unix_ms, f"{tenant}\x00{request_id}")


def admin_entry(
    head: AuditHead | None,
    *,
    tenant: str,
    actor: str,
    action: str,
    resource: str,
    decision: str,
    details: Mapping[str, str],
    source: str,
    model: str = "",
    model_version: str = "",
    time: datetime | None = None,
    entry_id: str | None = None,
) -> AuditEntry:
    """The entry for an administrative action, e.g. ``action="key.create"``, ``resource="key:k_12"``,
    ``actor="admin:alice"``, ``decision="allowed"``. It belongs to no request (``request_id`` empty)."""
    return append(
        head,
        tenant=tenant,
        model=model,
        request_id="",
        actor=actor,
        action=action,
        resource=resource,
        decision=decision,
        details=details,
        model_version=model_version,
        source=source,
        time=time,
        entry_id=entry_id,
    )


def audit_row(entry: AuditEntry) -> list[Any]:
    """The ``audit_log`` row of an entry, in :data:`AUDIT_COLUMNS` order (``details`` as JSON text)."""
    return [
        entry.tenant,
        entry.seq,
        entry.id,
        entry.time,
        entry.actor,
        entry.action,
        entry.resource,
        entry.model,
        entry.model_version,
        entry.request_id,
        entry.decision,
        msgspec.json.encode(entry.details, order="sorted").decode(),
        entry.source,
        entry.prev_hash,
        entry.entry_hash,
    ]


# ------------------------------------------------------------------------------------------ hashing


class _Form(msgspec.Struct, frozen=True, kw_only=True):
    """The canonical form: the ``audit_log`` row without ``entry_hash``, fields in sorted key order (msgspec
    writes a struct's fields in declaration order; the encoder sorts ``details``' keys)."""

    action: str
    actor: str
    decision: str
    details: dict[str, str]
    entry_id: str
    model: str
    model_version: str
    prev_hash: str
    request_id: str
    resource: str
    seq: int
    source: str
    tenant: str
    time: str


_FORM = msgspec.json.Encoder(order="sorted")
_TIME = msgspec.json.Encoder()


def canonical(entry: AuditEntry) -> bytes:
    """The bytes ``entry_hash`` is the SHA-256 of: the canonical form of the entry's row."""
    return _checked(
        _Form(
            action=entry.action,
            actor=entry.actor,
            decision=entry.decision,
            details=entry.details,
            entry_id=entry.id,
            model=entry.model,
            model_version=entry.model_version,
            prev_hash=entry.prev_hash,
            request_id=entry.request_id,
            resource=entry.resource,
            seq=entry.seq,
            source=entry.source,
            tenant=entry.tenant,
            time=_canonical_time(entry.time),
        )
    )


def row_canonical(row: Mapping[str, Any]) -> bytes:
    """The canonical form (see the module docstring) of an ``audit_log`` row given as a dict.

    ``time`` may be a datetime (naive is read as UTC) or an ISO 8601 string; ``details`` JSON text or a
    dict. Raises ``KeyError``, ``ValueError`` or ``TypeError`` for a row that cannot be read.
    """
    details = row["details"]
    return _checked(
        _Form(
            action=row["action"],
            actor=row["actor"],
            decision=row["decision"],
            details=_details(details) if isinstance(details, (str, bytes)) else dict(details),
            entry_id=row["entry_id"],
            model=row["model"],
            model_version=row["model_version"],
            prev_hash=row["prev_hash"],
            request_id=row["request_id"],
            resource=row["resource"],
            seq=row["seq"],
            source=row["source"],
            tenant=row["tenant"],
            time=_canonical_time(row["time"]),
        )
    )


def _details(text: str | bytes) -> dict[str, str]:
    """A row's ``details`` text as the hash reads it, refusing a key given twice: the hash reads the last
    copy, ClickHouse's ``JSONExtract*`` the first, so a copy prepended to a row (a forged price table in
    the ``prices`` saved query) left its hash intact (a review)."""
    return msgspec.convert(json.loads(text, object_pairs_hook=_unique), dict[str, str])


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    made = dict(pairs)
    if len(made) != len(pairs):
        raise ValueError("details give a key twice (the row was altered)")
    return made


def _checked(form: _Form) -> bytes:
    """The sorted compact JSON of a canonical form, once its values have the types the form allows
    (a struct's fields are not checked when it is built; the sink builds one per request)."""
    seq = form.seq
    if type(seq) is not int and (isinstance(seq, bool) or not isinstance(seq, int)):
        raise TypeError(f"seq must be an integer, got {seq!r}")
    strings: tuple[object, ...] = (  # a struct's fields are whatever was passed: checked here
        form.action, form.actor, form.decision, form.entry_id, form.model, form.model_version,
        form.prev_hash, form.request_id, form.resource, form.source, form.tenant, form.time,
    )  # fmt: skip
    for value in strings:
        if type(value) is not str and not isinstance(value, str):
            column = next(name for name in _STRINGS if getattr(form, name) is value)
            raise TypeError(f"{column} must be a string, got {value!r}")
    details = form.details
    if not isinstance(details, dict):
        raise TypeError(f"details must map strings to strings, got {details!r}")
    for key, value in details.items():  # a loop, not all(...): the sink runs this once per request
        if type(key) is not str or type(value) is not str:
            raise TypeError(f"details must map strings to strings, got {details!r}")
    return _FORM.encode(form)


_STRINGS = tuple(name for name in _Form.__struct_fields__ if name not in ("seq", "details"))


def _canonical_time(value: object) -> str:
    if type(value) is datetime and value.tzinfo is UTC:  # what the sink hands in: already UTC
        when = value
    else:
        if isinstance(value, str):
            value = datetime.fromisoformat(value)
        if not isinstance(value, datetime):
            raise TypeError(f"time must be a datetime or an ISO 8601 string, got {value!r}")
        when = value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)
    if when.year >= 1000:  # msgspec writes UTC as "YYYY-MM-DDTHH:MM:SS[.ffffff]Z", 20x faster than isoformat
        text = _TIME.encode(when)
        return f"{text[1:24].decode()}Z" if len(text) == 29 else f"{text[1:20].decode()}.000Z"
    return f"{when:%Y-%m-%dT%H:%M:%S}.{when.microsecond // 1000:03d}Z"


# ------------------------------------------------------------------------------------------ verifying


class Problem(NamedTuple):
    tenant: str
    seq: int
    reason: str


class VerifyReport(msgspec.Struct, frozen=True, kw_only=True):
    tenants: int
    """Tenant chains seen."""
    entries: int
    problems: list[Problem]
    heads: dict[str, AuditHead]
    """Each tenant's last entry as stored: compare with a copy kept elsewhere to detect a cut tail."""

    @property
    def ok(self) -> bool:
        return not self.problems


class ChainVerifier:
    """Checks rows fed in (tenant, seq) order, one tenant's chain after another, holding one row at a time.

    Per tenant: seq runs 0, 1, 2 … without gaps; ``prev_hash`` is the previous row's stored ``entry_hash``
    (:data:`GENESIS` for seq 0); ``entry_hash`` is the SHA-256 of the row's canonical form.
    """

    def __init__(self) -> None:
        self._problems: list[Problem] = []
        self._heads: dict[str, AuditHead] = {}
        self._entries = 0
        self._tenant: str | None = None
        self._expected = 0
        self._prev = GENESIS

    def add(self, row: Mapping[str, Any]) -> None:
        tenant, seq = row["tenant"], row["seq"]
        if not isinstance(tenant, str) or isinstance(seq, bool) or not isinstance(seq, int):
            raise TypeError(f"a row needs a string tenant and an integer seq, got {tenant!r}, {seq!r}")
        if tenant != self._tenant:
            if tenant in self._heads:
                raise ValueError(f"rows must come grouped by tenant; {tenant!r} came back after another")
            self._tenant, self._expected, self._prev = tenant, 0, GENESIS
        elif seq < self._expected:
            reason = "duplicate seq" if seq == self._expected - 1 else "rows out of seq order"
            self._problems.append(Problem(tenant, seq, reason))
            return
        self._entries += 1
        stored = row.get("entry_hash")
        if seq > self._expected:
            missing = str(self._expected) if seq == self._expected + 1 else f"{self._expected}..{seq - 1}"
            self._problems.append(
                Problem(tenant, seq, f"gap before seq {seq}: seq {missing} missing (rows deleted)")
            )
        elif row.get("prev_hash") != self._prev:
            after = "genesis" if seq == 0 else f"seq {seq - 1}'s entry_hash"
            self._problems.append(Problem(tenant, seq, f"prev_hash does not link to {after}"))
        try:
            recomputed = hashlib.sha256(row_canonical(row)).hexdigest()
        except (KeyError, TypeError, ValueError) as exc:
            self._problems.append(Problem(tenant, seq, f"malformed row: {type(exc).__name__}: {exc}"))
        else:
            if recomputed != stored:
                self._problems.append(Problem(tenant, seq, "hash mismatch (row altered)"))
        self._expected, self._prev = seq + 1, stored if isinstance(stored, str) else ""
        self._heads[tenant] = AuditHead(seq=seq, entry_hash=self._prev)

    def report(self) -> VerifyReport:
        return VerifyReport(
            tenants=len(self._heads),
            entries=self._entries,
            problems=list(self._problems),
            heads=dict(self._heads),
        )


def verify(rows: Iterable[Mapping[str, Any]]) -> VerifyReport:
    """Check ``audit_log`` rows (dicts keyed by column, in any order) chain by chain."""
    verifier = ChainVerifier()
    for row in sorted(rows, key=lambda r: (r["tenant"], r["seq"])):
        verifier.add(row)
    return verifier.report()


def verify_warehouse(
    settings: PlatformSettings, *, tenant: str | None = None, page_rows: int = 5000
) -> VerifyReport:
    """Read ``audit_log FINAL`` in (tenant, seq) order, ``page_rows`` at a time, and verify it.

    Reads where ``sluice sql`` reads; raises :class:`~infra.warehouse.WarehouseError` (or its subclasses)
    when the warehouse cannot answer.
    """
    verifier = ChainVerifier()
    for row in warehouse_rows(settings, tenants=None if tenant is None else [tenant], page_rows=page_rows):
        verifier.add(row)
    return verifier.report()


def warehouse_rows(
    settings: PlatformSettings, *, tenants: Collection[str] | None = None, page_rows: int = 5000
) -> Iterator[dict[str, Any]]:
    """``audit_log FINAL`` rows (dicts keyed by column) in (tenant, seq) order, of ``tenants`` only when
    given, read ``page_rows`` at a time (one page in memory)."""
    if page_rows < 1:
        raise ValueError("page_rows must be at least 1")
    if tenants is not None and not tenants:
        return
    after: tuple[str, int] | None = None
    while True:
        where = [f"tenant IN ({', '.join(map(_literal, sorted(tenants)))})"] if tenants is not None else []
        if after is not None:
            where.append(f"(tenant, seq) > ({_literal(after[0])}, {after[1]})")
        result = query_warehouse(settings, _select(where, "tenant, seq", page_rows), max_rows=page_rows)
        for values in result.rows:
            yield dict(zip(result.columns, values, strict=True))
        if not result.rows or (len(result.rows) < page_rows and not result.truncated):
            return
        last = dict(zip(result.columns, result.rows[-1], strict=True))
        after = (str(last["tenant"]), int(last["seq"]))


def newest_times(settings: PlatformSettings, tenants: Collection[str]) -> dict[str, int]:
    """Each chain's newest entry time in ``audit_log`` (unix ms; those with any), for ``tenants``."""
    found: dict[str, int] = {}
    ordered = sorted(set(tenants))
    for start in range(0, len(ordered), 500):
        chunk = ordered[start : start + 500]
        sql = (
            f"SELECT tenant, toUnixTimestamp64Milli(max(time)) AS newest FROM audit_log FINAL "  # noqa: S608
            f"WHERE tenant IN ({', '.join(map(_literal, chunk))}) GROUP BY tenant"
        )
        result = query_warehouse(settings, sql, max_rows=len(chunk))
        for tenant, newest in result.rows:
            found[str(tenant)] = int(str(newest))
    return found


def rows_at(
    settings: PlatformSettings, keys: Collection[tuple[str, int]]
) -> dict[tuple[str, int], dict[str, Any]]:
    """The ``audit_log FINAL`` rows at these (tenant, seq) keys, those that exist, keyed like ``keys``."""
    found: dict[tuple[str, int], dict[str, Any]] = {}
    ordered = sorted(set(keys))
    for start in range(0, len(ordered), 500):
        chunk = ordered[start : start + 500]
        pairs = ", ".join(f"({_literal(tenant)}, {int(seq)})" for tenant, seq in chunk)
        sql = _select([f"(tenant, seq) IN ({pairs})"], "tenant, seq", len(chunk))
        result = query_warehouse(settings, sql, max_rows=len(chunk))
        for values in result.rows:
            row = dict(zip(result.columns, values, strict=True))
            found[(str(row["tenant"]), int(row["seq"]))] = row
    return found


def latest_entries(settings: PlatformSettings, *, tenant: str | None = None, limit: int = 20) -> QueryResult:
    """The ``limit`` most recent entries (newest first), of one tenant or all."""
    if limit < 1:
        raise ValueError("limit must be at least 1")
    where = [f"tenant = {_literal(tenant)}"] if tenant is not None else []
    return query_warehouse(settings, _select(where, "time DESC, tenant, seq DESC", limit), max_rows=limit)


def _select(where: list[str], order_by: str, limit: int) -> str:
    condition = f" WHERE {' AND '.join(where)}" if where else ""
    # Every value in `where` went through _literal or is an int: nothing from outside is spliced in raw.
    return (
        f"SELECT {', '.join(AUDIT_COLUMNS)} FROM audit_log FINAL{condition} ORDER BY {order_by} LIMIT {limit}"  # noqa: S608
    )


def _literal(value: str) -> str:
    """A ClickHouse string literal: backslashes and quotes escaped, so a value cannot end the string."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
