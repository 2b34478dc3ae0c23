"""Gap safety of the consumer runtime under adversarial interleavings: concurrent producers
(overlapping transactions, rollbacks, savepoints, a naive reader alongside) and every committed
change delivered exactly once in a run without faults, in the outbox's (txid, seq) order, to a
recording sink and through the HTTP receiver; a contended entity converges to its last commit.
How the read treats seq gaps, the held-back horizon, lost NOTIFYs and offset resets is in
tests/test_gap_safety_reads.py.

The backend databases of this file live on the private cluster: the read horizon is cluster-wide,
so an open transaction of any other process on a shared server would hold these consumers back
and make the timing assertions meaningless.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest

from consumer.core.events import Position
from consumer.runtime.worker import ConsumerRuntime
from consumer.sinks.frontend_sync import FrontendSyncSink
from tests.conftest import fetch_all, fetch_value
from tests.support.backend import OutboxRow, insert_call, offset, outbox_in_delivery_order
from tests.support.runtime import RecordingSink, running_runtime, store_of
from tests.support.waiting import wait_position

UTC = "-c TimeZone=UTC"


# The configurations the proofs run under: SyncSettings' defaults, as users run them (two
# batches in flight, read pacing on); the same with pacing after every short batch (at the
# defaults' rate threshold the workload may never pace); and the strictest, one batch at a time
# and no pacing.
CONFIGS = {
    "defaults": {},
    "always-paced": {"SYNC_BATCH_WAIT_MIN_RATE": 0},
    "one-at-a-time": {"SYNC_MAX_IN_FLIGHT": 1, "SYNC_BATCH_WAIT_MS": 0},
}


# -- the concurrency proof ----------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One change a producer saw commit: what the relay must turn into exactly one event."""

    entity_type: str
    entity_id: str
    op: str
    # call_logs.summary or recordings.s3_url of the row in the event's payload.
    marker: str


@dataclass
class OwnRows:
    """The rows one producer owns, as its committed (or in-flight) transactions left them."""

    calls: dict[str, str] = field(default_factory=dict)  # id -> summary
    recordings: dict[str, tuple[str, str]] = field(default_factory=dict)  # id -> (call, s3_url)

    def copy(self) -> OwnRows:
        return OwnRows(dict(self.calls), dict(self.recordings))


@dataclass
class ProducerReport:
    committed: list[Change] = field(default_factory=list)
    committed_tx: int = 0
    rolled_back_tx: int = 0
    savepoints_rolled_back: int = 0
    rows: OwnRows = field(default_factory=OwnRows)


STATUSES = ("in_progress", "ringing", "answered", "completed", "failed")


async def _change(
    conn: psycopg.AsyncConnection[Any],
    rng: random.Random,
    rows: OwnRows,
    out: list[Change],
    *,
    owner: str,
    token: str,
) -> None:
    """One random insert/update/delete on the producer's own rows, recorded in `out`.

    Every producer touches only rows it created, so no two transactions ever write the same
    entity: its events are then in seq order in every order of transactions (see
    test_contended_entity_follows_txid_order_and_the_receiver_converges for the other case)."""
    kinds = ["insert_call"]
    if rows.calls:
        kinds += ["update_call", "update_call", "delete_call", "insert_recording", "bulk_update"]
    if rows.recordings:
        kinds += ["update_recording", "update_recording"]
    kind = rng.choice(kinds)
    if kind == "insert_call":
        call = str(uuid.uuid4())
        await conn.execute(
            "INSERT INTO call_logs (id, caller_number, callee_number, summary) "
            "VALUES (%s, %s, '03', %s)",
            (call, owner, token),
        )
        rows.calls[call] = token
        out.append(Change("call_log", call, "upsert", token))
    elif kind == "update_call":
        call = rng.choice(sorted(rows.calls))
        cur = await conn.execute(
            "UPDATE call_logs SET summary = %s, status = %s, updated_at = clock_timestamp() "
            "WHERE id = %s",
            (token, rng.choice(STATUSES), call),
        )
        assert cur.rowcount == 1
        rows.calls[call] = token
        out.append(Change("call_log", call, "upsert", token))
    elif kind == "delete_call":
        call = rng.choice(sorted(rows.calls))
        cur = await conn.execute("DELETE FROM call_logs WHERE id = %s", (call,))
        assert cur.rowcount == 1
        out.append(Change("call_log", call, "delete", rows.calls.pop(call)))
        # ON DELETE CASCADE: the relay sees every cascaded recording delete too.
        for rec, (rec_call, url) in sorted(rows.recordings.items()):
            if rec_call == call:
                del rows.recordings[rec]
                out.append(Change("recording", rec, "delete", url))
    elif kind == "insert_recording":
        call = rng.choice(sorted(rows.calls))
        rec = str(uuid.uuid4())
        await conn.execute(
            "INSERT INTO recordings (id, call_log_id, file_path, s3_url) VALUES (%s, %s, %s, %s)",
            (rec, call, f"{call}/mixed.wav", token),
        )
        rows.recordings[rec] = (call, token)
        out.append(Change("recording", rec, "upsert", token))
    elif kind == "update_recording":
        rec = rng.choice(sorted(rows.recordings))
        cur = await conn.execute(
            "UPDATE recordings SET s3_url = %s, upload_status = 'uploaded', "
            "updated_at = clock_timestamp() WHERE id = %s",
            (token, rec),
        )
        assert cur.rowcount == 1
        rows.recordings[rec] = (rows.recordings[rec][0], token)
        out.append(Change("recording", rec, "upsert", token))
    else:  # bulk_update: one statement, one event per row
        cur = await conn.execute(
            "UPDATE call_logs SET summary = %s || ':' || id::text WHERE caller_number = %s",
            (token, owner),
        )
        assert cur.rowcount == len(rows.calls)
        for call in sorted(rows.calls):
            rows.calls[call] = f"{token}:{call}"
            out.append(Change("call_log", call, "upsert", rows.calls[call]))


async def _hold(conn: psycopg.AsyncConnection[Any], rng: random.Random) -> None:
    """Keep the transaction open a while (server-side: the workload, not synchronisation)."""
    seconds = rng.uniform(0.15, 0.3) if rng.random() < 0.05 else rng.uniform(0.0, 0.03)
    await conn.execute("SELECT pg_sleep(%s)", (seconds,))


async def produce(dsn: str, seed: int, index: int, transactions: int) -> ProducerReport:
    """One producer connection: transactions of random length with savepoints (some rolled back
    to) and whole rollbacks; reports exactly the changes that committed."""
    rng = random.Random(f"{seed}:{index}")
    owner = f"producer-{index}"
    report = ProducerReport()
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, options=UTC)
    async with conn:
        for t in range(transactions):
            rows = report.rows.copy()
            pending: list[Change] = []
            roll_back = rng.random() < 0.2
            async with conn.transaction() as tx:
                for step in range(rng.randint(1, 4)):
                    token = f"{owner}.{t}.{step}"
                    if rng.random() < 0.35:
                        saved, saved_len = rows.copy(), len(pending)
                        async with conn.transaction() as savepoint:
                            await _change(conn, rng, rows, pending, owner=owner, token=token)
                            await _hold(conn, rng)
                            if rng.random() < 0.5:
                                report.savepoints_rolled_back += 1
                                rows = saved
                                del pending[saved_len:]
                                raise psycopg.Rollback(savepoint)
                    else:
                        await _change(conn, rng, rows, pending, owner=owner, token=token)
                    await _hold(conn, rng)
                if roll_back:
                    raise psycopg.Rollback(tx)
            if roll_back:
                report.rolled_back_tx += 1
            else:
                report.committed_tx += 1
                report.rows = rows
                report.committed.extend(pending)
    return report


async def naive_reader(dsn: str, stop: asyncio.Event) -> set[int]:
    """What a `seq > last_seq` reader sees while the producers run (its poll: 5 ms)."""
    seen: set[int] = set()
    last = 0
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        while True:
            stopping = stop.is_set()
            cur = await conn.execute(
                "SELECT seq FROM sync.events_outbox WHERE seq > %s ORDER BY seq", (last,)
            )
            seqs = [seq for (seq,) in await cur.fetchall()]
            seen.update(seqs)
            last = max([last, *seqs])
            if stopping:
                return seen
            await conn.execute("SELECT pg_sleep(0.005)")


@dataclass
class Workload:
    reports: list[ProducerReport]
    naive_seen: set[int]

    @property
    def committed(self) -> list[Change]:
        return [change for report in self.reports for change in report.committed]


async def run_workload(
    dsn: str, seed: int, *, producers: int = 10, transactions: int = 14
) -> Workload:
    stop = asyncio.Event()
    naive = asyncio.create_task(naive_reader(dsn, stop))
    try:
        reports = await asyncio.gather(
            *(produce(dsn, seed, i, transactions) for i in range(producers))
        )
    finally:
        stop.set()
    return Workload(list(reports), await naive)


def per_entity(changes: list[tuple[str, str, str, str]]) -> dict[tuple[str, str], list[str]]:
    """(entity_type, entity_id, op, marker) in order -> per entity: op:marker in order."""
    by_entity: dict[tuple[str, str], list[str]] = defaultdict(list)
    for entity_type, entity_id, op, marker in changes:
        by_entity[(entity_type, entity_id)].append(f"{op}:{marker}")
    return dict(by_entity)


def entry_marker(entry: dict[str, Any]) -> str:
    key = "summary" if entry["entityType"] == "call_log" else "s3_url"
    return str(entry["payload"][key])


async def check_exactly_once_in_order(
    dsn: str, runtime: ConsumerRuntime, sink: RecordingSink, workload: Workload
) -> list[OutboxRow]:
    """Wait until the consumer caught up, then check delivery against outbox and producers."""
    outbox = await outbox_in_delivery_order(dsn)
    assert outbox, "the workload committed nothing"
    end = Position(outbox[-1].txid, outbox[-1].seq)
    await wait_position(runtime, end)

    delivered = sink.seqs
    outbox_seqs = [row.seq for row in outbox]
    # Nothing twice (no faults in this run), nothing missing, nothing that did not commit.
    duplicates = sorted(s for s, n in Counter(delivered).items() if n > 1)
    assert not duplicates, f"delivered twice: {duplicates}"
    assert set(delivered) - set(outbox_seqs) == set(), "delivered events that are not in the outbox"
    missing = sorted(set(outbox_seqs) - set(delivered))
    assert not missing, f"committed events never delivered: {missing}"
    # ... in exactly the documented delivery order.
    assert delivered == outbox_seqs
    # The producers' own account of what committed agrees, event for event.
    committed = workload.committed
    assert len(committed) == len(outbox) == len(delivered) == runtime.stats.delivered_events
    expected = per_entity([(c.entity_type, c.entity_id, c.op, c.marker) for c in committed])
    got = per_entity(
        [(e["entityType"], e["entityId"], e["op"], entry_marker(e)) for e in sink.entries]
    )
    assert got == expected
    # Per entity, delivery order is seq order.
    seqs_by_entity: dict[tuple[str, str], list[int]] = defaultdict(list)
    for e in sink.entries:
        seqs_by_entity[(e["entityType"], e["entityId"])].append(int(e["seq"]))
    out_of_order = {k: v for k, v in seqs_by_entity.items() if v != sorted(set(v))}
    assert not out_of_order, f"entities delivered out of seq order: {out_of_order}"
    # Batches respect the limit and add up to the outbox.
    assert all(1 <= b.count <= 7 for b in sink.batches)
    assert sum(b.count for b in sink.batches) == len(outbox)
    assert await offset(dsn) == end
    return outbox


def check_workload_was_adversarial(workload: Workload, outbox: list[OutboxRow]) -> None:
    """The run must really contain what breaks a naive reader, or the test proves nothing."""
    assert sum(r.rolled_back_tx for r in workload.reports) > 0
    assert sum(r.savepoints_rolled_back for r in workload.reports) > 0
    outbox_seqs = {row.seq for row in outbox}
    # Rolled-back work leaves holes in seq.
    assert max(outbox_seqs) > len(outbox_seqs)
    # Transactions committed out of seq order: a `seq > last_seq` reader running alongside
    # skipped some committed events for good.
    naive_skipped = outbox_seqs - workload.naive_seen
    assert naive_skipped, "no commit-order inversion happened; the workload proves nothing"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [101, 202, 303])
async def test_concurrent_producers_every_committed_change_delivered_once_in_order(
    private_backend_dsn: str, seed: int, config: str
) -> None:
    """10 producers, overlapping transactions of random length, savepoints and rollbacks, while
    a consumer reads in batches of 7: what it delivers is exactly what committed, once each, in
    (txid, seq) order and per entity in seq order, although a `seq > last_seq` reader running
    alongside skips events."""
    sink = RecordingSink()
    async with running_runtime(private_backend_dsn, sink, **CONFIGS[config]) as runtime:
        workload = await run_workload(private_backend_dsn, seed)
        outbox = await check_exactly_once_in_order(private_backend_dsn, runtime, sink, workload)
        # Open producer transactions held the horizon back while the consumer read. (Whether it
        # then re-checked or a NOTIFY came first depends on timing.)
        assert store_of(runtime).held_back_reads > 0
        assert runtime.stats.poll_wakeups == 0
        if config == "always-paced":
            assert runtime.stats.paced_waits > 0, "the proof never ran a paced read"
    check_workload_was_adversarial(workload, outbox)
    assert any(b.count == 7 for b in sink.batches)


@pytest.mark.parametrize("config", CONFIGS)
async def test_concurrent_producers_through_the_http_receiver(
    private_backend_dsn: str, receiver_dsn: str, receiver_url: str, config: str
) -> None:
    """The same workload delivered over HTTP: the receiver ends with the backend's tables."""
    sink = RecordingSink(forward=FrontendSyncSink(receiver_url, timeout_sec=5))
    async with running_runtime(private_backend_dsn, sink, **CONFIGS[config]) as runtime:
        workload = await run_workload(private_backend_dsn, seed=404)
        outbox = await check_exactly_once_in_order(private_backend_dsn, runtime, sink, workload)
    check_workload_was_adversarial(workload, outbox)

    # Payloads were built in UTC sessions (timestamps in to_jsonb); compare in UTC too.
    backend = await _fetch_utc(
        private_backend_dsn,
        "SELECT 'call_log', id::text, to_jsonb(c) FROM call_logs c "
        "UNION ALL SELECT 'recording', id::text, to_jsonb(r) FROM recordings r",
    )
    assert backend, "the workload left no rows"
    live = await fetch_all(
        receiver_dsn, "SELECT entity_type, entity_id, payload FROM ingest.live_entities"
    )
    assert {(t, i): p for t, i, p in live} == {(t, i): p for t, i, p in backend}
    # Every entity the outbox ever named is known to the receiver; the deleted ones as tombstones.
    entities = await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.entities")
    assert entities == len({(row.entity_type, row.entity_id) for row in outbox})


async def _fetch_utc(dsn: str, statement: str) -> list[tuple[Any, ...]]:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True, options=UTC)
    async with conn:
        cur = await conn.execute(statement)
        return await cur.fetchall()


async def test_contended_entity_follows_txid_order_and_the_receiver_converges(
    private_backend_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    """Two transactions writing one entity: the older transaction (lower txid) writes it last.
    Delivery follows (txid, seq), so the entity's newer event (higher seq) is delivered first,
    in another batch than the older one. docs/wire-contract.md promises no seq order across
    batches; the receiver's version guard must keep the newer state."""
    x = await insert_call(private_backend_dsn, "x")
    y = await insert_call(private_backend_dsn, "y")
    older = await psycopg.AsyncConnection.connect(private_backend_dsn, options=UTC)
    younger = await psycopg.AsyncConnection.connect(private_backend_dsn, options=UTC)
    async with older, younger:
        await older.execute("UPDATE call_logs SET summary = 'older-y' WHERE id = %s", (y,))
        await younger.execute("UPDATE call_logs SET summary = 'younger-x' WHERE id = %s", (x,))
        await younger.commit()
        await older.execute("UPDATE call_logs SET summary = 'older-x' WHERE id = %s", (x,))
        await older.commit()
    outbox = await outbox_in_delivery_order(private_backend_dsn)
    x_seqs_in_delivery_order = [row.seq for row in outbox if row.entity_id == x]
    assert len(x_seqs_in_delivery_order) == 3
    assert x_seqs_in_delivery_order[1] > x_seqs_in_delivery_order[2]

    sink = RecordingSink(forward=FrontendSyncSink(receiver_url, timeout_sec=5))
    async with running_runtime(private_backend_dsn, sink, SYNC_BATCH_SIZE=2) as runtime:
        await wait_position(runtime, Position(outbox[-1].txid, outbox[-1].seq))
    assert sink.seqs == [row.seq for row in outbox]
    assert [b.count for b in sink.batches] == [2, 2, 1]

    stored = await fetch_all(
        receiver_dsn,
        "SELECT seq, payload->>'summary' FROM ingest.live_entities WHERE entity_id = %s",
        (x,),
    )
    assert stored == [(max(x_seqs_in_delivery_order), "older-x")]
    assert await fetch_value(
        private_backend_dsn, "SELECT summary FROM call_logs WHERE id = %s", (x,)
    ) == ("older-x")
