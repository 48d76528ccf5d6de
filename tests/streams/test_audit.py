"""The audit chain: building entries, the canonical form, and what verification catches (in memory, in
chDB, and through ``sluice audit verify``)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from infra.warehouse import WarehouseQueryServer, migrate, open_warehouse
from infra.warehouse.client import Client
from schemas.codec import decode, encode, headers
from schemas.events import AuditEntry, BatchRef, ErrorInfo, RequestFinished, Usage
from schemas.ids import uuid7_from_parts, uuid7_unix_ms
from schemas.settings import PlatformSettings
from streams.audit import (
    AUDIT_COLUMNS,
    GENESIS,
    AuditHead,
    Problem,
    admin_entry,
    append,
    audit_row,
    canonical,
    request_entry,
    row_canonical,
    verify,
    verify_warehouse,
)

T0 = datetime(2026, 11, 22, 9, 30, 0, 125_678, tzinfo=UTC)
REQUEST_ID = uuid7_from_parts(1_795_000_000_000, 12345)
REPO_ROOT = Path(__file__).resolve().parents[2]


def finished(**changes: Any) -> RequestFinished:
    fields: dict[str, Any] = {
        "tenant": "acme",
        "model": "demo-gpt",
        "request_id": REQUEST_ID,
        "source": "gpu/worker-0",
        "time": T0,
        "status": "completed",
        "finish_reason": "stop",
        "usage": Usage(prompt_tokens=3, completion_tokens=6, total_tokens=9),
        "text": "the secret completion",
        "embeddings": [[0.25, -0.5]],
        "worker_id": "worker-0",
        "model_version": "3f2a9c",
        "kind": "chat",
        "stream": True,
        "edge_id": "edge-1",
        "idempotency_key": "order-7",
    }
    fields.update(changes)
    return RequestFinished(**fields)


def chain(tenant: str, length: int, *, start: datetime = T0) -> list[AuditEntry]:
    """``length`` linked entries: requests and administrative actions alternating."""
    entries: list[AuditEntry] = []
    head: AuditHead | None = None
    for index in range(length):
        if index % 2:
            entry = admin_entry(
                head,
                tenant=tenant,
                actor="admin:alice",
                action="budget.update",
                resource=f"budget:{tenant}",
                decision="allowed",
                details={"limit_micros": str(1000 * index), "reason": "raise é"},
                source="test/admin",
                time=start + timedelta(seconds=index),
            )
        else:
            event = finished(
                tenant=tenant, request_id=f"req-{tenant}-{index}", time=start + timedelta(seconds=index)
            )
            entry = request_entry(head, event, source="streams/audit")
        entries.append(entry)
        head = AuditHead(seq=entry.seq, entry_hash=entry.entry_hash)
    return entries


def rows(entries: list[AuditEntry]) -> list[dict[str, Any]]:
    return [dict(zip(AUDIT_COLUMNS, audit_row(entry), strict=True)) for entry in entries]


def rehash(row: dict[str, Any]) -> dict[str, Any]:
    """What a forger with write access does: recompute the row's own hash after changing it."""
    return {**row, "entry_hash": hashlib.sha256(row_canonical(row)).hexdigest()}


# ------------------------------------------------------------------------------------------ building


def test_a_chain_starts_at_genesis_and_links_each_entry() -> None:
    entries = chain("acme", 4)
    assert [e.seq for e in entries] == [0, 1, 2, 3]
    assert entries[0].prev_hash == GENESIS == "0" * 64
    for previous, entry in itertools.pairwise(entries):
        assert entry.prev_hash == previous.entry_hash
    for entry in entries:
        assert entry.entry_hash == hashlib.sha256(canonical(entry)).hexdigest()
        assert len(entry.entry_hash) == 64
    assert len({e.entry_hash for e in entries}) == 4


def test_the_same_inputs_give_the_same_entry_hash_and_id() -> None:
    head = AuditHead(seq=6, entry_hash="ab" * 32)
    first, again = (request_entry(head, finished(), source="streams/audit") for _ in range(2))
    assert first == again
    assert (first.seq, first.prev_hash) == (7, "ab" * 32)
    other_tenant = request_entry(head, finished(tenant="globex"), source="streams/audit")
    assert other_tenant.id != first.id
    assert other_tenant.entry_hash != first.entry_hash
    fixed: dict[str, Any] = {
        "tenant": "acme", "model": "", "request_id": "", "actor": "admin:alice", "action": "key.create",
        "resource": "key:k1", "decision": "allowed", "details": {"b": "2", "a": "1"}, "model_version": "",
        "source": "test", "time": T0, "entry_id": uuid7_from_parts(1, 2),
    }  # fmt: skip
    assert append(None, **fixed) == append(None, **{**fixed, "details": {"a": "1", "b": "2"}})


def test_the_canonical_form_is_plain_sorted_json_of_the_row_and_is_pinned() -> None:
    entry = append(
        None,
        tenant="acme",
        model="demo-gpt",
        request_id="req-1",
        actor="admin:alice",
        action="model.deploy",
        resource="model:demo-gpt",
        decision="allowed",
        details={"version": "4", "note": 'ünïcode "quoted"\n'},
        model_version="3f2a9c",
        source="test",
        time=T0,
        entry_id=uuid7_from_parts(1_795_000_000_000, 7),
    )
    assert entry.time == datetime(2026, 11, 22, 9, 30, 0, 125_000, tzinfo=UTC)  # floored to the ms
    row = dict(zip(AUDIT_COLUMNS, audit_row(entry), strict=True))
    assert row["time"] == entry.time
    # What an auditor would write from the docs, with nothing but the table row and the stdlib.
    form = {k: v for k, v in row.items() if k != "entry_hash"}
    form["time"] = "2026-11-22T09:30:00.125Z"
    form["details"] = json.loads(row["details"])
    expected = json.dumps(form, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    assert canonical(entry) == expected
    assert entry.entry_hash == hashlib.sha256(expected).hexdigest()
    # Pinned: a change to the canonical form would orphan every stored chain.
    assert entry.entry_hash == "ada1c55033b8c0bc2b4899609ac5b7567038866cccec4a1753a077727ae81897"


def test_an_entry_hashes_the_same_form_as_its_table_row() -> None:
    """The sink hashes an entry from its fields (no row built); verify hashes the row: they must agree."""
    rng = random.Random(5)
    head: AuditHead | None = None
    for n in range(200):
        when = T0 + timedelta(microseconds=rng.randrange(10**12))
        entry = request_entry(
            head, finished(time=when, tenant=rng.choice(["acme", "ünï", 'a"b\\c'])), source="t"
        )
        if n % 3 == 0:
            entry = admin_entry(
                head,
                tenant=entry.tenant,
                actor="admin:ål",
                action="key.create",
                resource="key:k\n1",
                decision="allowed",
                details={"z": "1", "a": "\u2028", "é": ""},
                source="t",
                time=when,
            )
        row = dict(zip(AUDIT_COLUMNS, audit_row(entry), strict=True))
        assert canonical(entry) == row_canonical(row)
        assert entry.entry_hash == hashlib.sha256(row_canonical(row)).hexdigest()
        head = AuditHead(seq=entry.seq, entry_hash=entry.entry_hash)


def test_a_time_is_written_with_milliseconds_in_utc_whatever_its_year_or_zone() -> None:
    row = dict(zip(AUDIT_COLUMNS, audit_row(chain("acme", 1)[0]), strict=True))
    for when, text in [
        (datetime(2026, 1, 2, 3, 4, 5, 999_999, tzinfo=UTC), "2026-01-02T03:04:05.999Z"),
        (datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2))), "2026-01-02T01:04:05.000Z"),
        (datetime(2026, 1, 2, 3, 4, 5, 1_000), "2026-01-02T03:04:05.001Z"),  # naive: read as UTC
        (datetime(999, 1, 2, 3, 4, 5, tzinfo=UTC), "999-01-02T03:04:05.000Z"),  # as strftime's %Y writes it
    ]:
        assert json.loads(row_canonical({**row, "time": when}))["time"] == text


def test_an_entry_whose_details_are_not_strings_cannot_be_hashed() -> None:
    with pytest.raises(TypeError, match="details"):
        append(
            None,
            tenant="acme",
            model="",
            request_id="",
            actor="a",
            action="b",
            resource="c",
            decision="d",
            details={"count": 3},  # type: ignore[dict-item]
            model_version="",
            source="t",
        )


@pytest.mark.parametrize(
    ("kind", "action"),
    [
        ("chat", "chat.completions.create"),
        ("completion", "completions.create"),
        ("embedding", "embeddings.create"),
        ("", "request"),
    ],
)
def test_a_request_entry_records_who_what_and_the_decision_without_content(kind: str, action: str) -> None:
    event = finished(
        kind=kind,
        status="failed",
        finish_reason="error",
        error=ErrorInfo(code="worker_oom", message="out of memory near 'the secret prompt'"),
        time=T0,
    )
    entry = request_entry(None, event, source="streams/audit")
    assert (entry.tenant, entry.model, entry.model_version, entry.request_id) == (
        "acme", "demo-gpt", "3f2a9c", REQUEST_ID,
    )  # fmt: skip
    assert (entry.actor, entry.action, entry.resource, entry.decision) == (
        "tenant:acme", action, "model:demo-gpt", "failed",
    )  # fmt: skip
    assert entry.source == "streams/audit"
    assert entry.time == T0.replace(microsecond=125_000)
    assert entry.details == {
        "finish_reason": "error",
        "prompt_tokens": "3",
        "completion_tokens": "6",
        "worker_id": "worker-0",
        "edge_id": "edge-1",
        "error_code": "worker_oom",
    }
    stored = encode(entry) + json.dumps(audit_row(entry), default=str).encode()
    assert b"secret" not in stored
    assert b"0.25" not in stored


def test_a_batch_lines_entry_names_its_batch_and_line_but_not_its_custom_id() -> None:
    plain = request_entry(None, finished(), source="streams/audit")
    assert not {"batch_id", "batch_index"} & set(plain.details)  # other entries: as before
    ref = BatchRef(batch_id="batch_9", custom_id="the client's own words", index=12, attempt=1)
    line = request_entry(None, finished(batch=ref), source="streams/audit")
    assert (line.details["batch_id"], line.details["batch_index"]) == ("batch_9", "12")
    assert {k: v for k, v in line.details.items() if not k.startswith("batch_")} == plain.details
    assert "the client's own words" not in json.dumps(line.details)
    assert line.entry_hash != plain.entry_hash


def test_a_completed_request_has_no_error_code() -> None:
    entry = request_entry(None, finished(), source="streams/audit")
    assert entry.decision == "completed"
    assert "error_code" not in entry.details
    assert entry.details["finish_reason"] == "stop"


def test_a_request_entry_id_is_a_uuid7_at_the_request_time_and_survives_kafka() -> None:
    entry = request_entry(AuditHead(seq=0, entry_hash="cd" * 32), finished(), source="streams/audit")
    assert uuid7_unix_ms(entry.id) == uuid7_unix_ms(REQUEST_ID)
    plain_id = request_entry(None, finished(request_id="not-a-uuid"), source="streams/audit").id
    assert uuid7_unix_ms(plain_id) == 0
    decoded = decode(encode(entry), headers(entry))
    assert decoded == entry
    assert isinstance(decoded, AuditEntry)
    assert hashlib.sha256(canonical(decoded)).hexdigest() == entry.entry_hash


def test_an_entry_needs_an_aware_utc_time_and_a_tenant() -> None:
    with pytest.raises(ValueError, match="UTC"):
        admin_entry(
            None, tenant="acme", actor="a", action="x", resource="r", decision="d", details={}, source="s",
            time=datetime(2026, 1, 1),
        )  # fmt: skip
    with pytest.raises(ValueError, match="tenant"):
        admin_entry(
            None, tenant="", actor="a", action="x", resource="r", decision="d", details={}, source="s"
        )


# ------------------------------------------------------------------------------------------ verifying


def test_verify_passes_for_several_tenants_given_in_any_order() -> None:
    chains = {tenant: chain(tenant, 5) for tenant in ("acme", "globex", "o'brien\\co")}
    shuffled = [row for entries in chains.values() for row in rows(entries)]
    random.Random(7).shuffle(shuffled)
    report = verify(shuffled)
    assert report.ok
    assert (report.tenants, report.entries, report.problems) == (3, 15, [])
    assert report.heads == {t: AuditHead(seq=4, entry_hash=e[-1].entry_hash) for t, e in chains.items()}
    assert verify([]).ok


@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("decision", "denied"),
        ("actor", "tenant:globex"),
        ("details", '{"finish_reason":"stop"}'),
        ("time", datetime(2026, 11, 22, 9, 30, 2, 126_000, tzinfo=UTC)),
        ("model_version", "0000"),
        ("entry_id", uuid7_from_parts(5, 5)),
        ("request_id", "req-other"),
    ],
)
def test_verify_catches_a_changed_field(column: str, value: object) -> None:
    tampered = rows(chain("acme", 5)) + rows(chain("globex", 3))
    tampered[2] = {**tampered[2], column: value}
    assert tampered[2] != rows(chain("acme", 5))[2]
    report = verify(tampered)
    assert report.problems == [Problem("acme", 2, "hash mismatch (row altered)")]
    assert not report.ok


def test_verify_catches_a_deleted_middle_row_and_a_deleted_first_row() -> None:
    good = rows(chain("acme", 6))
    assert verify(good[:2] + good[4:]).problems == [
        Problem("acme", 4, "gap before seq 4: seq 2..3 missing (rows deleted)")
    ]
    assert verify(good[1:]).problems == [Problem("acme", 1, "gap before seq 1: seq 0 missing (rows deleted)")]


def test_verify_catches_swapped_entries_and_a_wrong_prev_hash() -> None:
    good = rows(chain("acme", 5))
    swapped = list(good)
    swapped[1], swapped[2] = {**good[2], "seq": 1}, {**good[1], "seq": 2}
    problems = verify(swapped).problems
    assert {(p.seq, p.reason) for p in problems} >= {
        (1, "prev_hash does not link to seq 0's entry_hash"),
        (1, "hash mismatch (row altered)"),
        (2, "hash mismatch (row altered)"),
    }
    relinked = list(good)
    relinked[3] = {**good[3], "prev_hash": good[1]["entry_hash"]}
    assert verify(relinked).problems == [
        Problem("acme", 3, "prev_hash does not link to seq 2's entry_hash"),
        Problem("acme", 3, "hash mismatch (row altered)"),
    ]
    first = list(good)
    first[0] = rehash({**good[0], "prev_hash": "1" * 64})
    assert Problem("acme", 0, "prev_hash does not link to genesis") in verify(first).problems


def test_verify_catches_a_forged_row_whose_own_hash_was_recomputed() -> None:
    good = rows(chain("acme", 5))
    forged = list(good)
    forged[2] = rehash({**good[2], "decision": "denied", "details": "{}"})
    # The forged row is self-consistent; the next entry still points at the original.
    assert verify(forged).problems == [Problem("acme", 3, "prev_hash does not link to seq 2's entry_hash")]
    # Forging with a recomputed hash *and* a prev_hash that is not the chain's: caught at the row itself.
    unlinked = list(good)
    unlinked[4] = rehash({**good[4], "prev_hash": "2" * 64})
    assert verify(unlinked).problems == [Problem("acme", 4, "prev_hash does not link to seq 3's entry_hash")]


def test_a_rewritten_or_cut_tail_is_only_visible_against_a_head_kept_elsewhere() -> None:
    """The documented limit: the chain alone cannot tell a cut or re-forged tail from a shorter log."""
    entries = chain("acme", 5)
    kept = AuditHead(seq=entries[-1].seq, entry_hash=entries[-1].entry_hash)
    good = rows(entries)
    cut = verify(good[:3])
    reforged = verify([*good[:4], rehash({**good[4], "decision": "denied"})])
    assert cut.ok
    assert reforged.ok
    assert cut.heads["acme"] != kept
    assert reforged.heads["acme"] != kept


def test_verify_catches_details_that_give_a_key_twice() -> None:
    """Found by review: a copy of a key prepended to a row's ``details`` kept its hash (the hash reads the
    last copy) while ClickHouse's ``JSONExtract*`` reads the first: a forged price table in the ``prices``
    saved query, and a chain that verified."""
    good = rows(chain("acme", 3))
    forged = list(good)
    details = str(good[1]["details"])
    (key, *_) = json.loads(details)
    forged[1] = {**good[1], "details": "{" + json.dumps(key) + ':"forged",' + details[1:]}
    (problem,) = verify(forged).problems
    assert (problem.tenant, problem.seq) == ("acme", 1)
    assert "details give a key twice" in problem.reason


def test_verify_reports_an_unreadable_row_instead_of_failing() -> None:
    good = rows(chain("acme", 3))
    broken = list(good)
    broken[1] = {**good[1], "details": "not json"}
    (problem,) = verify(broken).problems
    assert (problem.tenant, problem.seq) == ("acme", 1)
    assert problem.reason.startswith("malformed row")
    assert verify([{**good[0], "time": "2026-11-22T09:30:00.125+00:00"}]).ok  # as query_warehouse gives it


# ------------------------------------------------------------------------------------------ in chDB


@pytest.fixture
def settings(tmp_path: Path) -> PlatformSettings:
    return PlatformSettings(data_dir=str(tmp_path / "data"))


@contextlib.contextmanager
def warehouse(settings: PlatformSettings) -> Iterator[Client]:
    """This process's chDB engine on the test's directory, closed again so others (or the CLI) can open."""
    with contextlib.closing(open_warehouse(settings)) as client:
        yield client


def insert_chains(settings: PlatformSettings, chains: dict[str, int]) -> dict[str, list[AuditEntry]]:
    made = {tenant: chain(tenant, length) for tenant, length in chains.items()}
    with warehouse(settings) as client:
        migrate(client)
        table_rows = [audit_row(entry) for entries in made.values() for entry in entries]
        client.insert("audit_log", table_rows, column_names=AUDIT_COLUMNS)
    return made


@pytest.mark.integration
def test_the_warehouse_chain_verifies_and_an_sql_update_is_caught(settings: PlatformSettings) -> None:
    insert_chains(settings, {"acme": 7, "globex": 4, "o'brien\\co": 3})
    report = verify_warehouse(settings, page_rows=3)  # several pages, across tenants
    assert (report.ok, report.tenants, report.entries) == (True, 3, 14)
    one = verify_warehouse(settings, tenant="o'brien\\co", page_rows=2)
    assert (one.ok, one.tenants, one.entries) == (True, 1, 3)

    with warehouse(settings) as client:
        client.command(
            "ALTER TABLE audit_log UPDATE decision = 'denied' WHERE tenant = 'acme' AND seq = 4 "
            "SETTINGS mutations_sync = 1"
        )
    report = verify_warehouse(settings)
    assert report.problems == [Problem("acme", 4, "hash mismatch (row altered)")]
    assert verify_warehouse(settings, tenant="globex").ok


@pytest.mark.integration
def test_a_replacement_row_with_the_same_key_is_caught(settings: PlatformSettings) -> None:
    made = insert_chains(settings, {"acme": 5, "globex": 5})
    original = dict(zip(AUDIT_COLUMNS, audit_row(made["globex"][2]), strict=True))
    with warehouse(settings) as client:
        # What an attacker with INSERT rights does on a ReplacingMergeTree: a newer row for (tenant, seq).
        replacement = rehash({**original, "decision": "cancelled"})
        client.insert("audit_log", [[replacement[c] for c in AUDIT_COLUMNS]], column_names=AUDIT_COLUMNS)
    report = verify_warehouse(settings)
    assert report.problems == [Problem("globex", 3, "prev_hash does not link to seq 2's entry_hash")]


@pytest.mark.integration
async def test_verify_reads_through_a_running_owner_that_caps_rows(settings: PlatformSettings) -> None:
    """With the platform up, reads go through its query server, which may cut pages shorter than asked."""
    insert_chains(settings, {"acme": 5, "globex": 4})
    with warehouse(settings) as client:
        async with WarehouseQueryServer(client, settings, max_rows=2):
            report = await asyncio.to_thread(verify_warehouse, settings, page_rows=3)
            assert (report.ok, report.tenants, report.entries) == (True, 2, 9)
            client.command(
                "ALTER TABLE audit_log DELETE WHERE tenant = 'globex' AND seq = 1 SETTINGS mutations_sync = 1"
            )
            report = await asyncio.to_thread(verify_warehouse, settings, page_rows=3)
    assert report.problems == [Problem("globex", 2, "gap before seq 2: seq 1 missing (rows deleted)")]


# ------------------------------------------------------------------------------------------ the CLI


def sluice(settings: PlatformSettings, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    env["SLUICE_DATA_DIR"] = settings.data_dir
    env["SLUICE_TOPIC_PREFIX"] = settings.topic_prefix
    if settings.kafka_bootstrap is not None:
        env["SLUICE_KAFKA_BOOTSTRAP"] = settings.kafka_bootstrap
    return subprocess.run(
        [sys.executable, "-m", "sluice", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


@pytest.mark.integration
def test_sluice_audit_verify_passes_then_fails_after_tampering(settings: PlatformSettings) -> None:
    """The table's own checks (``--warehouse-only``: no broker here); against the audit topic in
    test_audit_anchor.py."""
    missing = sluice(settings, "audit", "verify", "--warehouse-only")
    assert missing.returncode == 2, missing.stderr
    assert "no embedded warehouse" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1

    insert_chains(settings, {"acme": 4, "globex": 2})
    passed = sluice(settings, "audit", "verify", "--warehouse-only")
    assert passed.returncode == 0, passed.stderr
    assert "audit log verified: 6 entries in 2 tenant chains" in passed.stdout
    shown = sluice(settings, "audit", "show", "--tenant", "acme", "--limit", "2")
    assert shown.returncode == 0, shown.stderr
    assert "budget.update" in shown.stdout
    assert "chat.completions.create" in shown.stdout
    assert "globex" not in shown.stdout

    with warehouse(settings) as client:
        client.command(
            "ALTER TABLE audit_log UPDATE decision = 'completed' WHERE tenant = 'acme' AND seq = 1 "
            "SETTINGS mutations_sync = 1"
        )
    failed = sluice(settings, "audit", "verify", "--warehouse-only")
    assert failed.returncode == 1, failed.stderr
    assert "tenant 'acme' seq 1: hash mismatch (row altered)" in failed.stdout
    assert "FAILED" in failed.stdout
    assert sluice(settings, "audit", "verify", "--warehouse-only", "--tenant", "globex").returncode == 0


def test_a_scaling_decision_is_an_admin_entry_on_its_models_chain() -> None:
    from schemas.events import WorkersScaled
    from schemas.examples import example_events
    from streams.app import admin_action, chain_of

    (event,) = [e for e in example_events() if isinstance(e, WorkersScaled)]
    chain = chain_of(event)
    assert chain == "admin:scale:demo-gpt"
    entry = admin_action(None, chain, event, {"topic": "control"})
    assert (entry.action, entry.resource, entry.decision) == ("workers.scale", "model:demo-gpt", "3")
    assert entry.details["previous"] == "1"
    assert entry.details["lag"] == "140"
    assert entry.details["bounds"] == "1..4"
    assert entry.details["reason"] == "lag 140 over 1 worker x 50"
    assert entry.id == event.id  # a re-read of the same event is the same entry


def test_an_operators_drift_rebaseline_is_an_admin_entry_on_its_versions_chain() -> None:
    from schemas.events import DriftRebaselined
    from schemas.examples import example_events
    from streams.app import admin_action, chain_of

    (event,) = [e for e in example_events() if isinstance(e, DriftRebaselined)]
    chain = chain_of(event)
    assert chain == "admin:rebaseline:demo-gpt:530b56af490a"
    entry = admin_action(None, chain, event, {"topic": "control"})
    assert (entry.action, entry.resource, entry.decision) == (
        "drift.rebaseline",
        "model:demo-gpt",
        "530b56af490a",
    )
    assert entry.details["reason"] == event.reason
    assert entry.details["actor"] == "operator"
    assert entry.id == event.id


def test_a_change_whose_entry_would_not_fit_a_record_keeps_its_details_cut_and_hashed() -> None:
    """Found by an audit: an entry quotes a change's evidence and traffic as JSON inside JSON, escaped
    again; a 990 KB change (it fitted a 1 MB record) made a 1.98 MB entry, which the audit topic refused,
    again at every redelivery: the streams worker stopped there. (Here: a change just under the limit.)"""
    import hashlib

    import msgspec

    from schemas.codec import MAX_RECORD_BYTES, encode, fits_record
    from schemas.events import DeploymentChanged, GateResult
    from schemas.examples import example_events
    from streams.app import DETAIL_CHARS, admin_action, chain_of

    (event,) = [e for e in example_events() if isinstance(e, DeploymentChanged)]
    quoted = '"' * (MAX_RECORD_BYTES // 2 - 10_000)  # each written as two characters
    change = msgspec.structs.replace(
        event, evidence=[GateResult(gate="error_ratio", state="pass", detail=quoted)]
    )
    assert fits_record(encode(change))
    entry = admin_action(None, chain_of(change), change, {"topic": "control"})
    assert fits_record(encode(entry))
    evidence = msgspec.json.encode(change.evidence).decode()
    kept = entry.details["evidence"]
    assert kept.startswith(evidence[:DETAIL_CHARS])
    assert f"of {len(evidence)} characters; sha256 {hashlib.sha256(evidence.encode()).hexdigest()}" in kept
    assert entry.details["phase"] == change.phase  # the short ones whole
    small = admin_action(None, chain_of(event), event, {"topic": "control"})
    assert small.details["evidence"] == msgspec.json.encode(event.evidence).decode()  # as before
