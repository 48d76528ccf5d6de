"""Audit chains anchored on the ``audit`` topic: the topic's view of a chain (in memory), the worker's
anchoring at start (in memory, and a real ``sluice streams`` restarted after a cut), and what ``sluice audit
verify`` catches against the topic (real Kafka and chDB)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from confluent_kafka import TopicPartition

from bus.producer import EventProducer
from infra.kafka.broker import free_port
from infra.topics import TopicSizing, apply_topics, make_admin, platform_topics
from infra.warehouse import migrate, query_warehouse
from schemas.events import AuditEntry
from schemas.settings import PlatformSettings
from schemas.topics import TopicNames
from streams.anchor import (
    ORIGIN,
    Placed,
    TopicChain,
    advance,
    anchor_chains,
    audit_extent,
    audit_records,
    chain_partition,
    read_chains,
    resumed,
)
from streams.audit import AUDIT_COLUMNS, AuditHead, admin_entry, audit_row, row_canonical
from tests.streams.test_audit import REPO_ROOT, chain, finished, sluice, warehouse


def placed(entries: Sequence[AuditEntry]) -> list[Placed]:
    return [(entry, 0, offset) for offset, entry in enumerate(entries)]


def topic_view(entries: Sequence[AuditEntry], *, check_hash: bool = False) -> TopicChain:
    chains, read = read_chains(placed(entries), check_hashes=check_hash)
    assert read == len(entries)
    (only,) = chains.values()
    return only


def fork(after: AuditEntry, length: int, tenant: str = "acme") -> list[AuditEntry]:
    """``length`` entries that go on from ``after`` with other content: what a worker that read its head
    from a cut warehouse published."""
    head = AuditHead(seq=after.seq, entry_hash=after.entry_hash)
    made: list[AuditEntry] = []
    for index in range(length):
        entry = admin_entry(
            head, tenant=tenant, actor="admin:mallory", action="budget.update", resource=f"budget:{tenant}",
            decision="allowed", details={"n": str(index)}, source="test/fork",
        )  # fmt: skip
        made.append(entry)
        head = AuditHead(seq=entry.seq, entry_hash=entry.entry_hash)
    return made


def head_row(entry: AuditEntry) -> dict[str, object]:
    """An ``AUDIT_HEADS`` row whose last entry is ``entry``."""
    details = msgspec.json.encode(entry.details).decode()
    return {
        "tenant": entry.tenant,
        "head_seq": entry.seq,
        "head_hash": entry.entry_hash,
        "head_details": details,
    }


class Healer:
    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int]]] = []

    def __call__(self, batch: Sequence[Placed]) -> None:
        self.calls.append([(entry.tenant, entry.seq) for entry, _, _ in batch])


# ------------------------------------------------------------------------------------------ in memory


def test_the_topic_view_of_a_chain_is_its_last_entry() -> None:
    entries = chain("acme", 6)
    view = topic_view(entries, check_hash=True)
    assert (view.first, view.head, view.entries, view.problem) == (
        0, AuditHead(seq=5, entry_hash=entries[5].entry_hash), 6, None,
    )  # fmt: skip
    older_than_retention = topic_view(entries[2:])
    assert (older_than_retention.first, older_than_retention.problem) == (2, None)


def test_a_batch_published_again_after_a_crash_is_no_problem_but_a_fork_is() -> None:
    entries = chain("acme", 6)
    again = topic_view([*entries, *entries[3:], entries[5]])
    assert (again.head, again.problem) == (AuditHead(seq=5, entry_hash=entries[5].entry_hash), None)

    forked = fork(entries[2], 2)  # seq 3' and 4', after the original 3..5
    shorter = topic_view([*entries, *forked])
    assert shorter.head == AuditHead(seq=4, entry_hash=forked[-1].entry_hash)  # the last entry read
    assert shorter.problem is not None
    assert shorter.problem.reason.endswith("end at seq 4: the chain forks")
    longer = topic_view([*entries, *fork(entries[2], 4)])
    assert longer.problem is not None
    assert (longer.problem.seq, longer.problem.reason) == (
        5, "on the audit topic: seq 5 is on the topic twice with different hashes: the chain forks",
    )  # fmt: skip


def test_the_topic_view_names_a_gap_a_broken_link_and_an_entry_that_does_not_hash() -> None:
    entries = chain("acme", 5)
    gap = topic_view([*entries[:2], *entries[3:]]).problem
    assert gap is not None
    assert (gap.seq, gap.reason) == (2, "on the audit topic: seq 2 missing between entries")
    relinked = msgspec.structs.replace(entries[3], prev_hash="1" * 64)
    broken = topic_view([*entries[:3], relinked]).problem
    assert broken is not None
    assert broken.reason.startswith("on the audit topic: its prev_hash is not seq 2's entry_hash")
    edited = msgspec.structs.replace(entries[1], decision="denied")
    assert topic_view([entries[0], edited]).problem is None  # hashes are checked only when asked
    unhashed = topic_view([entries[0], edited], check_hash=True).problem
    assert unhashed is not None
    assert unhashed.reason == "on the audit topic: the entry does not hash to its entry_hash"


def test_a_chain_from_two_source_partitions_skips_redeliveries_of_both() -> None:
    """Found by an audit: the results topic grew, a tenant's chain went on from a new partition, and a
    crash redelivered the old partition's records: the worker kept only the head's (partition, offset),
    chained them again (and the new partition's after them), and the duplicates verified."""
    head: AuditHead | None = None
    entries: list[AuditEntry] = []
    for origin in ("1:5", "1:6", "2:0", "2:1"):
        entry = admin_entry(
            head, tenant="acme", actor="a", action="budget.update", resource="budget:acme",
            decision="allowed", details={ORIGIN: origin}, source="test",
        )  # fmt: skip
        entries.append(entry)
        head = AuditHead(seq=entry.seq, entry_hash=entry.entry_hash)
    anchored = anchor_chains([], lambda: placed(entries), Healer())
    assert anchored.offsets == {"acme": {1: 6, 2: 1}}


def test_anchoring_goes_on_from_the_topic_and_heals_a_warehouse_behind_it() -> None:
    acme, globex = chain("acme", 6), chain("globex", 3)
    old = admin_entry(
        None, tenant="admin:budget:x", actor="a", action="budget.enforce", resource="tenant:x",
        decision="exhausted", details={ORIGIN: "0:41"}, source="test",
    )  # fmt: skip
    topic = placed([*acme[:3], *globex, *acme[3:]])
    heal = Healer()
    calls = 0

    def records() -> list[Placed]:
        nonlocal calls
        calls += 1
        return topic

    # acme: the warehouse stops at seq 2 (a cut tail); globex: none of its rows; the admin chain is
    # older than the topic's retention.
    anchored = anchor_chains([head_row(acme[2]), head_row(old)], records, heal, chunk=2)
    assert anchored.heads == {
        "acme": AuditHead(seq=5, entry_hash=acme[5].entry_hash),
        "globex": AuditHead(seq=2, entry_hash=globex[2].entry_hash),
        "admin:budget:x": AuditHead(seq=0, entry_hash=old.entry_hash),
    }
    assert anchored.offsets == {"admin:budget:x": {0: 41}}
    assert anchored.healed == {"acme": (3, 5), "globex": (0, 2)}
    assert heal.calls == [
        [("globex", 0), ("globex", 1)],
        [("globex", 2), ("acme", 3)],
        [("acme", 4), ("acme", 5)],
    ]
    assert (anchored.conflicts, anchored.topic_problems, anchored.entries, calls) == ({}, [], 9, 2)

    in_step = anchor_chains([head_row(acme[5])], lambda: placed([*acme, *acme[4:]]), heal)
    assert (in_step.healed, in_step.conflicts, len(heal.calls)) == ({}, {}, 3)  # read once, nothing to heal


def test_anchoring_withholds_a_chain_the_warehouse_disagrees_with() -> None:
    acme, globex, initech = chain("acme", 6), chain("globex", 4), chain("initech", 6)
    edited = row_canonical(dict(zip(AUDIT_COLUMNS, audit_row(acme[3]), strict=True)))
    forged = {**head_row(acme[3]), "head_hash": hashlib.sha256(edited + b"!").hexdigest()}
    ahead = head_row(chain("globex", 6)[5])  # the warehouse has seq 4..5 the topic never had
    forked = [*initech, *fork(initech[2], 2, "initech")]  # the warehouse stops at seq 2: behind a fork
    heal = Healer()
    anchored = anchor_chains(
        [forged, ahead, head_row(initech[2])], lambda: placed([*acme, *globex, *forked]), heal
    )
    assert anchored.heads["acme"] == AuditHead(seq=5, entry_hash=acme[5].entry_hash)
    assert anchored.heads["globex"] == AuditHead(seq=3, entry_hash=globex[3].entry_hash)
    assert anchored.conflicts["acme"].startswith("the warehouse's seq 3 has entry_hash")
    assert anchored.conflicts["globex"] == (
        "the warehouse has seq 4..5 past the audit topic's last entry (seq 3): rows the log never had"
    )
    assert anchored.conflicts["initech"].startswith("the warehouse is behind an inconsistent topic chain")
    assert [p.tenant for p in anchored.topic_problems] == ["initech"]
    assert (anchored.healed, heal.calls) == ({}, [])


@pytest.mark.parametrize("details", ["not json", "[1, 2]", '"x"', '{"results_offset": 7}'])
def test_a_head_row_with_malformed_details_is_a_conflict_not_a_crash(details: str) -> None:
    acme, globex, old = chain("acme", 6), chain("globex", 3), chain("admin:budget:x", 2)
    tampered = {**head_row(acme[5]), "head_details": details}  # only the details column edited
    heal = Healer()
    anchored = anchor_chains(
        [tampered, head_row(globex[2]), {**head_row(old[1]), "head_details": details}],
        lambda: placed([*acme, *globex]),  # the admin chain is older than the topic's retention
        heal,
    )
    assert anchored.heads["acme"] == AuditHead(seq=5, entry_hash=acme[5].entry_hash)
    assert anchored.heads["admin:budget:x"] == AuditHead(seq=1, entry_hash=old[1].entry_hash)
    assert set(anchored.conflicts) == {"acme", "admin:budget:x"}  # globex goes on untouched
    assert anchored.conflicts["acme"].startswith("the warehouse's seq 5 is a malformed row (details: ")
    assert anchored.conflicts["admin:budget:x"].startswith("the warehouse's seq 1 is a malformed row")
    assert "admin:budget:x" not in anchored.offsets
    assert (anchored.healed, heal.calls) == ({}, [])


def from_partition(head: AuditHead | None, tenant: str, origins: Sequence[str]) -> list[AuditEntry]:
    """Entries that go on from ``head``, each from the source record ``origins`` names."""
    made: list[AuditEntry] = []
    for origin in origins:
        entry = admin_entry(
            head, tenant=tenant, actor="a", action="budget.update", resource=f"budget:{tenant}",
            decision="allowed", details={ORIGIN: origin}, source="test",
        )  # fmt: skip
        made.append(entry)
        head = AuditHead(seq=entry.seq, entry_hash=entry.entry_hash)
    return made


def test_a_worker_given_a_partition_goes_on_from_what_another_worker_appended_meanwhile() -> None:
    """Found by an audit: two streams workers in one group (a rolling update); the one that gained the
    results partition went on from the heads it had read at its start, and the chains forked."""
    acme = from_partition(None, "acme", ["0:0", "0:1"])
    globex = from_partition(None, "globex", ["1:0"])
    anchored = anchor_chains([], lambda: placed([*acme, *globex]), Healer())
    heads, offsets = dict(anchored.heads), {k: dict(v) for k, v in anchored.offsets.items()}
    # Meanwhile the other worker, owning partition 0, extended acme and began initech.
    tail = AuditHead(seq=acme[-1].seq, entry_hash=acme[-1].entry_hash)
    later = [*from_partition(tail, "acme", ["0:2", "0:3"]), *from_partition(None, "initech", ["0:4"])]
    chains, read = read_chains(placed(later))
    advance(heads, offsets, chains)
    assert read == 3
    assert heads == {
        "acme": AuditHead(seq=3, entry_hash=later[1].entry_hash),
        "globex": anchored.heads["globex"],  # not appended to: as it was
        "initech": AuditHead(seq=0, entry_hash=later[2].entry_hash),
    }
    assert offsets == {"acme": {0: 3}, "globex": {1: 0}, "initech": {0: 4}}
    own = {"acme": {0: 9, 1: 2}}  # a partition's offsets never go back
    advance({}, own, chains)
    assert own["acme"] == {0: 9, 1: 2}


def test_reading_the_audit_topic_again_starts_where_the_last_read_ended() -> None:
    starts = [TopicPartition("audit", p, low) for p, low in enumerate([0, 5, 0, 0])]
    ends = {0: 10, 1: 20, 2: 4, 3: 7}
    since, until = resumed((starts, ends), {0: 7, 1: 3, 2: 9})
    assert [(tp.topic, tp.partition, tp.offset) for tp in since] == [
        ("audit", 0, 7),  # appended since the last read
        ("audit", 1, 5),  # retention deleted past the last read: from the first retained
        ("audit", 2, 0),  # ends before the last read: the topic was made again
        ("audit", 3, 0),  # not read before (the topic grew)
    ]
    assert until == ends


# ------------------------------------------------------------------------------------------ on Kafka


@pytest.fixture
def anchored_settings(kafka_bootstrap: str, topic_prefix: str, tmp_path: Path) -> PlatformSettings:
    """A broker, a prefix of its own and a data dir; every platform topic exists (one partition each,
    two for the per-tenant topics, so chains share partitions)."""
    settings = PlatformSettings(
        kafka_bootstrap=kafka_bootstrap, topic_prefix=topic_prefix, data_dir=str(tmp_path / "data")
    )
    sizing = TopicSizing(requests=1, replies=1, events=2)
    apply_topics(make_admin(settings.kafka), platform_topics(TopicNames(topic_prefix), ["demo-gpt"], sizing))
    return settings


def publish_chains(settings: PlatformSettings, chains: dict[str, int]) -> dict[str, list[AuditEntry]]:
    """What the streams worker leaves behind: every entry on the audit topic, then its row."""
    made = {tenant: chain(tenant, length) for tenant, length in chains.items()}
    producer = EventProducer(settings.kafka, "test-audit")
    with producer:
        for entries in made.values():
            for entry in entries:
                producer.produce(TopicNames(settings.topic_prefix).audit, entry)
    with warehouse(settings) as client:
        migrate(client)
        rows = [audit_row(entry) for entries in made.values() for entry in entries]
        client.insert("audit_log", rows, column_names=AUDIT_COLUMNS)
    return made


def verify(settings: PlatformSettings, *args: str) -> subprocess.CompletedProcess[str]:
    return sluice(settings, "audit", "verify", *args)


def mutate(settings: PlatformSettings, sql: str) -> None:
    with warehouse(settings) as client:
        client.command(f"{sql} SETTINGS mutations_sync = 1")


@pytest.mark.integration
def test_verify_names_a_cut_tail_and_a_deleted_chain_the_warehouse_alone_cannot_see(
    anchored_settings: PlatformSettings,
) -> None:
    settings = anchored_settings
    publish_chains(settings, {"acme": 6, "globex": 3, "initech": 2})
    passed = verify(settings)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "audit log verified: 11 entries in 3 tenant chains; 3 chains checked against the audit topic" in (
        passed.stdout
    )

    mutate(
        settings, "ALTER TABLE audit_log DELETE WHERE (tenant = 'acme' AND seq >= 4) OR tenant = 'initech'"
    )
    failed = verify(settings)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert (
        "tenant 'acme' seq 4: cut tail: the audit topic's chain runs to seq 5, the warehouse's stops at seq 3: "
        "seq 4..5 missing (rows deleted)"
    ) in failed.stdout
    assert (
        "tenant 'initech' seq 0: cut tail: seq 0..1 are on the audit topic, none in the warehouse "
        "(the chain's rows were deleted)"
    ) in failed.stdout
    assert "globex" not in failed.stdout.split("FAILED")[0]
    assert "2 problem(s) in 2 chain(s)" in failed.stdout
    # What verify checked before the audit topic: the shorter chains are valid on their own.
    alone = verify(settings, "--warehouse-only")
    assert alone.returncode == 0, alone.stdout + alone.stderr
    assert "audit log verified: 7 entries in 2 tenant chains" in alone.stdout
    assert verify(settings, "--tenant", "globex").returncode == 0
    typo = verify(settings, "--tenant", "globexx")  # a review: "verified", exit 0
    assert typo.returncode == 1, typo.stdout + typo.stderr
    assert "no audit chain for tenant 'globexx' in the warehouse or on the audit topic" in typo.stderr


@pytest.mark.integration
def test_verify_flags_a_chain_added_to_the_warehouse_alone(anchored_settings: PlatformSettings) -> None:
    """Found by an audit: a chain fabricated in ``audit_log`` (valid hashes, dated now) with no entry on the
    topic verified, said to be "older than its retention". A chain with no entry on the topic is that only
    when its rows are older than the oldest entry the topic holds."""
    settings = anchored_settings
    publish_chains(settings, {"acme": 2, "wayne": 2})  # a chain on each partition
    with warehouse(settings) as client:  # a chain in the table alone, as new as the topic's
        ghost = chain("ghost", 2, start=datetime.now(UTC))
        client.insert("audit_log", [audit_row(entry) for entry in ghost], column_names=AUDIT_COLUMNS)
    failed = verify(settings)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert (
        "tenant 'ghost' seq 1: the chain has no entry on the audit topic, yet its newest row ("
        in failed.stdout
    )
    assert "rows added" in failed.stdout
    assert "acme" not in failed.stdout.split("FAILED")[0]


@pytest.mark.integration
def test_a_chain_older_than_its_partitions_first_record_aged_out_whatever_the_entries_dates(
    anchored_settings: PlatformSettings,
) -> None:
    """Left open by that audit: a chain with no entry on the topic was judged against the oldest entry's
    ``time`` over the whole topic. One entry dated long ago (a worker's clock stamps a request's entry)
    made every chain that had aged out look added. A chain is dated against its own partition's first
    retained record, by the record's Kafka timestamp (the streams worker's clock as it published)."""
    settings = anchored_settings
    long_ago = datetime(2020, 1, 1, tzinfo=UTC)
    made = {"acme": chain("acme", 2, start=long_ago), "wayne": chain("wayne", 2, start=long_ago)}
    producer = EventProducer(settings.kafka, "test-audit")
    with producer:
        for entries in made.values():
            for entry in entries:
                producer.produce(TopicNames(settings.topic_prefix).audit, entry)
    aged = chain("quiet", 3, start=datetime.now(UTC) - timedelta(days=400))  # before any record's time
    with warehouse(settings) as client:
        migrate(client)
        rows = [audit_row(entry) for entries in [*made.values(), aged] for entry in entries]
        client.insert("audit_log", rows, column_names=AUDIT_COLUMNS)
    passed = verify(settings)
    assert passed.returncode == 0, passed.stdout + passed.stderr
    assert "rows added" not in passed.stdout + passed.stderr


@pytest.mark.integration
def test_a_chain_is_dated_against_the_partition_its_tenant_is_keyed_to(
    anchored_settings: PlatformSettings,
) -> None:
    """Where :func:`streams.anchor.chain_partition` says librdkafka puts a tenant's entries, they are."""
    settings = anchored_settings
    tenants = {f"tenant-{n}": 1 for n in range(8)}
    publish_chains(settings, tenants)
    topic = TopicNames(settings.topic_prefix).audit
    extent = audit_extent(settings.kafka, topic, "test-audit")
    placed = list(audit_records(settings.kafka, extent, "test-audit", timeout_s=30))
    assert len(placed) == len(tenants)
    partitions = len(extent[0])
    assert partitions == 2
    assert {entry.tenant: partition for entry, partition, _ in placed} == {
        name: chain_partition(name, partitions) for name in tenants
    }
    assert {chain_partition(name, partitions) for name in tenants} == {0, 1}


@pytest.mark.integration
def test_verify_flags_rows_that_differ_from_the_topic_and_missing_middle_rows(
    anchored_settings: PlatformSettings,
) -> None:
    settings = anchored_settings
    made = publish_chains(settings, {"acme": 5, "globex": 4, "initech": 5})
    # globex: the last row edited and its hash recomputed, so the table alone still verifies.
    last = dict(zip(AUDIT_COLUMNS, audit_row(made["globex"][3]), strict=True))
    forged = hashlib.sha256(row_canonical({**last, "decision": "denied"})).hexdigest()
    mutate(
        settings,
        f"ALTER TABLE audit_log UPDATE decision = 'denied', entry_hash = '{forged}' "
        "WHERE tenant = 'globex' AND seq = 3",
    )
    # acme: a middle row's hash changed; initech: a middle row deleted.
    mutate(
        settings, f"ALTER TABLE audit_log UPDATE entry_hash = '{'f' * 64}' WHERE tenant = 'acme' AND seq = 2"
    )
    mutate(settings, "ALTER TABLE audit_log DELETE WHERE tenant = 'initech' AND seq = 2")
    assert "globex" not in verify(settings, "--warehouse-only").stdout

    failed = verify(settings)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    lines = [line for line in failed.stdout.splitlines() if line.startswith("tenant ")]
    assert lines == [
        "tenant 'acme' seq 2: hash mismatch (row altered)",
        "tenant 'acme' seq 2: differs from the audit topic's entry of the same seq (row replaced or edited)",
        "tenant 'acme' seq 3: prev_hash does not link to seq 2's entry_hash",
        "tenant 'globex' seq 3: differs from the audit topic's entry of the same seq (row replaced or edited)",
        "tenant 'initech' seq 3: gap before seq 3: seq 2 missing (rows deleted)",
    ]


# ------------------------------------------------------------------------------------------ a real worker


@contextlib.contextmanager
def streams_process(settings: PlatformSettings, log: Path) -> Iterator[str]:
    """``sluice streams`` on the settings' broker and data dir; yields its URL; stopped with SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_") or k == "SLUICE_CACHE_DIR"}
    port = free_port()
    env.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        SLUICE_KAFKA_BOOTSTRAP=settings.bootstrap,
        SLUICE_TOPIC_PREFIX=settings.topic_prefix,
        SLUICE_DATA_DIR=settings.data_dir,
        SLUICE_STREAMS_PORT=str(port),
        SLUICE_STREAMS_BATCH_MS="100",
    )
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sluice", "streams"], env=env, cwd=log.parent, stdout=sink, stderr=sink
        )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tail(log: Path) -> str:
    return log.read_text()[-4000:]


async def until(check: Callable[[], Any], what: str, log: Path, within: float = 120) -> Any:
    """Poll ``check`` (blocking, run in a thread) until it returns something truthy."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            result = await asyncio.to_thread(check)
            if result:
                return result
        await asyncio.sleep(0.3)
    raise AssertionError(f"no {what} within {within:.0f}s; streams log:\n{tail(log)}")


async def wait_ready(url: str, log: Path, within: float = 120) -> None:
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/readyz") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(0.3)
    raise AssertionError(f"sluice streams not ready within {within:.0f}s:\n{tail(log)}")


def audit_rows(settings: PlatformSettings, tenant: str) -> list[dict[str, Any]]:
    sql = f"SELECT seq, prev_hash, entry_hash FROM audit_log FINAL WHERE tenant = '{tenant}' ORDER BY seq"
    result = query_warehouse(settings, sql)
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


def chain_of_length(settings: PlatformSettings, tenant: str, length: int) -> Callable[[], Any]:
    def check() -> list[dict[str, Any]] | None:
        rows = audit_rows(settings, tenant)
        return rows if len(rows) == length else None

    return check


async def finish_requests(settings: PlatformSettings, tenant: str, ids: range) -> None:
    producer = EventProducer(settings.kafka, "test-results")
    with producer:
        for n in ids:
            event = finished(tenant=tenant, request_id=f"req-{tenant}-{n}", text=None, embeddings=None)
            await producer.publish(TopicNames(settings.topic_prefix).results, event)


@pytest.mark.integration
@pytest.mark.timeout(420)
async def test_a_restarted_worker_goes_on_from_the_topic_and_heals_a_cut_tail(
    anchored_settings: PlatformSettings, tmp_path: Path
) -> None:
    settings = anchored_settings
    log = tmp_path / "streams.log"
    with streams_process(settings, log) as url:
        await wait_ready(url, log)
        await finish_requests(settings, "acme", range(6))
        await finish_requests(settings, "globex", range(2))
        before = await until(chain_of_length(settings, "acme", 6), "6 acme entries", log)
    assert [row["seq"] for row in before] == list(range(6))

    mutate(settings, "ALTER TABLE audit_log DELETE WHERE tenant = 'acme' AND seq >= 3")
    cut = verify(settings)
    assert cut.returncode == 1, cut.stdout + cut.stderr
    assert "tenant 'acme' seq 3: cut tail: the audit topic's chain runs to seq 5" in cut.stdout

    with streams_process(settings, log) as url:
        await wait_ready(url, log)
        healed = audit_rows(settings, "acme")
        assert healed == before  # re-inserted from the topic at start, before it was ready
        await finish_requests(settings, "acme", range(6, 8))
        after = await until(chain_of_length(settings, "acme", 8), "8 acme entries", log)
        verified = verify(settings)  # live: through the running worker's warehouse
        assert verified.returncode == 0, verified.stdout + verified.stderr
    # The chain went on from the topic's head (seq 5), not from the cut warehouse's (seq 2).
    assert [row["seq"] for row in after] == list(range(8))
    assert after[6]["prev_hash"] == before[5]["entry_hash"]
    assert after[:6] == before
    text = log.read_text()
    assert "chain 'acme': the warehouse was behind the audit topic; seq 3..5 re-inserted from it" in text
    assert verify(settings).returncode == 0
