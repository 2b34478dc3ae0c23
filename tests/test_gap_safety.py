"""Gap safety of the consumer runtime: every committed change is delivered, exactly once in a
run without faults, in the outbox's (txid, seq) order, however transactions overlap; an open
transaction holds the horizon back only as long as it stays open; a lost NOTIFY loses nothing.

The backend databases of this file live on the private cluster: the read horizon is cluster-wide,
so an open transaction of any other process on a shared server would hold these consumers back
and make the timing assertions meaningless.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
from psycopg import sql

from consumer.app.settings import runtime_config
from consumer.app.wiring import open_pool
from consumer.core.events import Batch, Outcome, Position, Sink
from consumer.devtools.devdb import PrivateCluster
from consumer.runtime.wakeup import NotifyListener
from consumer.runtime.worker import ConsumerRuntime
from consumer.sinks.frontend_sync import FrontendSyncSink
from consumer.store.admin import plan_reset
from consumer.store.leadership import LeaderLock
from consumer.store.outbox import OutboxStore, ReadResult
from consumer.store.queries import query
from tests.conftest import (
    Databases,
    fetch_all,
    fetch_value,
    make_settings,
    wait_until,
    waiting_for_notify,
)

CONSUMER = "frontend-sync"
UTC = "-c TimeZone=UTC"


@pytest.fixture
def gap_dsn(private_databases: Databases) -> str:
    """A fresh backend database on the private cluster (no foreign transactions there)."""
    return private_databases.create("backend")


# -- a real sink that remembers what it delivered -----------------------------------------------


class RecordingSink:
    """Keeps every delivered batch, in the order the runtime sent them; optionally delivers on
    to another sink first (then it keeps only what that sink accepted).

    Send order, not the order of the answers: with several batches in flight the receiver may
    answer a newer batch first, while the runtime sends (and commits) them in outbox order."""

    name = "recording"

    def __init__(self, forward: Sink | None = None) -> None:
        self.forward = forward
        # One slot per delivery call, in call order; None until that delivery is accepted.
        self._sent: list[Batch | None] = []

    async def start(self) -> None:
        """Start the sink delivered on to, if any."""
        if self.forward is not None:
            await self.forward.start()

    async def deliver(self, batch: Batch) -> Outcome:
        """Deliver on (if forwarding), then remember the batch in the slot of this call."""
        slot = len(self._sent)
        self._sent.append(None)
        outcome = Outcome.DELIVERED
        if self.forward is not None:
            outcome = await self.forward.deliver(batch)
        self._sent[slot] = batch
        return outcome

    async def close(self) -> None:
        """Close the sink delivered on to, if any."""
        if self.forward is not None:
            await self.forward.close()

    @property
    def batches(self) -> list[Batch]:
        """The accepted batches, in the order they were sent."""
        return [batch for batch in self._sent if batch is not None]

    @property
    def entries(self) -> list[dict[str, Any]]:
        """The accepted entries, in the order they were sent."""
        return [entry for batch in self.batches for entry in batch.entries()]

    @property
    def seqs(self) -> list[int]:
        """Delivered seqs in delivery order."""
        return [int(e["seq"]) for e in self.entries]


class WatchedStore(OutboxStore):
    """The real outbox store; it also counts its reads and keeps what the last one returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0
        self.full_reads = 0
        self.held_back_reads = 0
        self.last: ReadResult | None = None

    async def read_batch(self, after: Position, limit: int) -> ReadResult:
        """OutboxStore.read_batch, counted."""
        result = await super().read_batch(after, limit)
        self.reads += 1
        self.full_reads += result.batch is not None and result.batch.count == limit
        self.held_back_reads += result.held_back
        self.last = result
        return result


# The configurations the proofs run under: SyncSettings' defaults, as users run them (two
# batches in flight, read pacing on); the same with pacing after every short batch (at the
# defaults' rate threshold the workload may never pace); and the strictest, one batch at a time
# and no pacing.
CONFIGS = {
    "defaults": {},
    "always-paced": {"SYNC_BATCH_WAIT_MIN_RATE": 0},
    "one-at-a-time": {"SYNC_MAX_IN_FLIGHT": 1, "SYNC_BATCH_WAIT_MS": 0},
}


@contextlib.asynccontextmanager
async def running_runtime(dsn: str, sink: Sink, **settings: Any) -> AsyncIterator[ConsumerRuntime]:
    """A ConsumerRuntime wired like wiring.consumer_runtime but with the given sink, configured
    like a user's from tests.conftest.make_settings plus `settings` (SYNC_* variables; batches
    of 7 and a 20 ms re-check unless given), running in this loop; yielded once it leads and
    listens, stopped (errors raised) on exit."""
    config = runtime_config(
        make_settings(
            dsn,
            # Not called: the sink is given.
            "http://127.0.0.1:9",
            **{"SYNC_BATCH_SIZE": 7, "SYNC_RECHECK_INTERVAL_MS": 20, **settings},
        )
    )
    async with open_pool(dsn, f"run:{CONSUMER}") as pool:
        runtime = ConsumerRuntime(
            CONSUMER,
            store=WatchedStore(pool),
            sink=sink,
            lock=LeaderLock(dsn, CONSUMER),
            listener=NotifyListener(dsn, CONSUMER),
            config=config,
        )
        task = asyncio.create_task(runtime.run())
        try:

            def ready() -> bool:
                return task.done() or (
                    runtime.stats.is_leader and listener_of(runtime).connected.is_set()
                )

            await wait_until(ready, what="the consumer to lead and listen")
            if task.done():
                task.result()  # raises what stopped it
                raise AssertionError("the consumer stopped on its own")
            yield runtime
        finally:
            runtime.request_stop()
            await asyncio.wait_for(task, timeout=15)


def listener_of(runtime: ConsumerRuntime) -> NotifyListener:
    """The runtime's NOTIFY listener (running_runtime always gives it one)."""
    listener = runtime.listener
    assert listener is not None
    return listener


def store_of(runtime: ConsumerRuntime) -> WatchedStore:
    store = runtime.store
    assert isinstance(store, WatchedStore)
    return store


def parked(runtime: ConsumerRuntime) -> bool:
    """Whether the consumer sleeps after a read that found nothing and was not held back: its
    next read then follows a NOTIFY, the poll timer or a stop, nothing else. A set listener
    event is a NOTIFY wake-up that the loop has not acted on yet."""
    return runtime.stats.sleeping == "wakeup" and not listener_of(runtime).event.is_set()


# -- the outbox as the database has it ---------------------------------------------------------


@dataclass(frozen=True)
class OutboxRow:
    txid: int
    seq: int
    entity_type: str
    entity_id: str
    op: str


async def outbox_in_delivery_order(dsn: str) -> list[OutboxRow]:
    """Every outbox row, in the documented delivery order (txid, seq)."""
    rows = await fetch_all(
        dsn,
        # Qualified: a bare `txid` in ORDER BY would be the text output column.
        "SELECT o.txid::text, o.seq, o.entity_type, o.entity_id, o.op "
        "FROM sync.events_outbox o ORDER BY o.txid, o.seq",
    )
    return [OutboxRow(int(t), s, et, eid, op) for t, s, et, eid, op in rows]


async def committed_offset(dsn: str) -> Position:
    rows = await fetch_all(
        dsn,
        "SELECT last_txid::text, last_seq FROM sync.consumer_offsets WHERE consumer = %s",
        (CONSUMER,),
    )
    assert len(rows) == 1
    return Position(int(rows[0][0]), rows[0][1])


async def wait_caught_up(runtime: ConsumerRuntime, end: Position, timeout: float = 20.0) -> None:
    def caught_up() -> bool:
        return runtime.stats.position == end

    await wait_until(
        caught_up, timeout=timeout, what=f"the consumer to reach {end} (stats: {runtime.stats})"
    )


async def insert_call(dsn: str, caller: str) -> str:
    """One committed call_logs row (one upsert event, one NOTIFY); returns its id."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, '03') "
            "RETURNING id::text",
            (caller,),
        )
        row = await cur.fetchone()
    assert row is not None
    return str(row[0])


# -- 1. the concurrency proof -------------------------------------------------------------------


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
    await wait_caught_up(runtime, end)

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
    assert await committed_offset(dsn) == end
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
    gap_dsn: str, seed: int, config: str
) -> None:
    """10 producers, overlapping transactions of random length, savepoints and rollbacks, while
    a consumer reads in batches of 7: what it delivers is exactly what committed, once each, in
    (txid, seq) order and per entity in seq order, although a `seq > last_seq` reader running
    alongside skips events."""
    sink = RecordingSink()
    async with running_runtime(gap_dsn, sink, **CONFIGS[config]) as runtime:
        workload = await run_workload(gap_dsn, seed)
        outbox = await check_exactly_once_in_order(gap_dsn, runtime, sink, workload)
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
    gap_dsn: str, receiver_dsn: str, receiver_url: str, config: str
) -> None:
    """The same workload delivered over HTTP: the receiver ends with the backend's tables."""
    sink = RecordingSink(forward=FrontendSyncSink(receiver_url, timeout_sec=5))
    async with running_runtime(gap_dsn, sink, **CONFIGS[config]) as runtime:
        workload = await run_workload(gap_dsn, seed=404)
        outbox = await check_exactly_once_in_order(gap_dsn, runtime, sink, workload)
    check_workload_was_adversarial(workload, outbox)

    # Payloads were built in UTC sessions (timestamps in to_jsonb); compare in UTC too.
    backend = await _fetch_utc(
        gap_dsn,
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
    gap_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    """Two transactions writing one entity: the older transaction (lower txid) writes it last.
    Delivery follows (txid, seq), so the entity's newer event (higher seq) is delivered first,
    in another batch than the older one. docs/wire-contract.md promises no seq order across
    batches; the receiver's version guard must keep the newer state."""
    x = await insert_call(gap_dsn, "x")
    y = await insert_call(gap_dsn, "y")
    older = await psycopg.AsyncConnection.connect(gap_dsn, options=UTC)
    younger = await psycopg.AsyncConnection.connect(gap_dsn, options=UTC)
    async with older, younger:
        await older.execute("UPDATE call_logs SET summary = 'older-y' WHERE id = %s", (y,))
        await younger.execute("UPDATE call_logs SET summary = 'younger-x' WHERE id = %s", (x,))
        await younger.commit()
        await older.execute("UPDATE call_logs SET summary = 'older-x' WHERE id = %s", (x,))
        await older.commit()
    outbox = await outbox_in_delivery_order(gap_dsn)
    x_seqs_in_delivery_order = [row.seq for row in outbox if row.entity_id == x]
    assert len(x_seqs_in_delivery_order) == 3
    assert x_seqs_in_delivery_order[1] > x_seqs_in_delivery_order[2]

    sink = RecordingSink(forward=FrontendSyncSink(receiver_url, timeout_sec=5))
    async with running_runtime(gap_dsn, sink, SYNC_BATCH_SIZE=2) as runtime:
        await wait_caught_up(runtime, Position(outbox[-1].txid, outbox[-1].seq))
    assert sink.seqs == [row.seq for row in outbox]
    assert [b.count for b in sink.batches] == [2, 2, 1]

    stored = await fetch_all(
        receiver_dsn,
        "SELECT seq, payload->>'summary' FROM ingest.live_entities WHERE entity_id = %s",
        (x,),
    )
    assert stored == [(max(x_seqs_in_delivery_order), "older-x")]
    assert await fetch_value(gap_dsn, "SELECT summary FROM call_logs WHERE id = %s", (x,)) == (
        "older-x"
    )


# -- 2. a naive `seq > last_seq` reader skips; ours does not --------------------------------------


async def read_when_ready(store: OutboxStore, after: Position) -> Batch:
    """read_batch until it returns a batch (another session may hold the horizon briefly)."""
    found: list[Batch] = []

    async def ready() -> bool:
        result = await store.read_batch(after, 100)
        if result.batch is not None:
            found.append(result.batch)
        return bool(found)

    await wait_until(ready, what=f"a batch after {after}")
    return found[0]


async def test_naive_seq_reader_skips_an_event_the_gap_safe_read_delivers(gap_dsn: str) -> None:
    t1 = await psycopg.AsyncConnection.connect(gap_dsn)
    t2 = await psycopg.AsyncConnection.connect(gap_dsn)
    async with t1, t2, open_pool(gap_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        # T1 writes first (takes the lower seq) and stays open.
        await t1.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('t1', '0')")
        cur = await t1.execute("SELECT seq, txid::text FROM sync.events_outbox")
        t1_row = await cur.fetchone()
        assert t1_row is not None
        seq1 = t1_row[0]
        # T2 writes (higher seq) and commits.
        await t2.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('t2', '0')")
        cur = await t2.execute("SELECT seq, txid::text FROM sync.events_outbox")
        t2_row = await cur.fetchone()
        assert t2_row is not None
        seq2, txid2 = t2_row[0], int(t2_row[1])
        assert seq1 < seq2
        await t2.commit()

        # A naive reader sees only T2's row and would advance past T1's seq ...
        naive = await fetch_all(gap_dsn, "SELECT seq FROM sync.events_outbox WHERE seq > 0")
        assert naive == [(seq2,)]
        naive_last = seq2
        # ... while the gap-safe read delivers nothing yet and says why.
        result = await store.read_batch(Position.start(), 100)
        assert result.batch is None
        assert result.held_back is True

        await t1.commit()

    # T1's event is committed now, but behind the naive reader's position for good.
    assert (
        await fetch_all(gap_dsn, "SELECT seq FROM sync.events_outbox WHERE seq > %s", (naive_last,))
        == []
    )
    assert await fetch_value(gap_dsn, "SELECT count(*) FROM sync.events_outbox") == 2

    async with open_pool(gap_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        batch = await read_when_ready(store, Position.start())
        entries = batch.entries()
        assert [e["seq"] for e in entries] == [seq1, seq2]
        assert [e["payload"]["caller_number"] for e in entries] == ["t1", "t2"]
        assert batch.end == Position(txid2, seq2)
        after = await store.read_batch(batch.end, 100)
        assert after.batch is None


async def test_lower_seq_delivered_after_higher_seq_is_not_skipped(gap_dsn: str) -> None:
    """The position is (txid, seq), not seq: an event whose seq is below the position's seq but
    whose transaction is younger is still delivered."""
    older = await psycopg.AsyncConnection.connect(gap_dsn)
    younger = await psycopg.AsyncConnection.connect(gap_dsn)
    async with older, younger, open_pool(gap_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        cur = await older.execute("SELECT pg_current_xact_id()::text")  # the older xid
        xid_row = await cur.fetchone()
        assert xid_row is not None
        # The younger transaction writes first (lower seq) and stays open ...
        await younger.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('young', '0')"
        )
        # ... the older one writes next (higher seq) and commits.
        await older.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('old', '0')"
        )
        await older.commit()

        first = await read_when_ready(store, Position.start())
        assert [e["payload"]["caller_number"] for e in first.entries()] == ["old"]
        high_seq = first.end.seq
        assert first.end.txid == int(xid_row[0])

        await younger.commit()
        second = await read_when_ready(store, first.end)
        entries = second.entries()
        assert [e["payload"]["caller_number"] for e in entries] == ["young"]
        assert entries[0]["seq"] < high_seq  # a `seq > last_seq` reader would never see it
        assert (await store.read_batch(second.end, 100)).batch is None


# -- 3. the held-back horizon -------------------------------------------------------------------


@pytest.mark.parametrize("blocker", ["xid-other-database", "write-untracked-table"])
async def test_held_back_event_arrives_via_recheck_soon_after_blocker_ends(
    gap_dsn: str, private_cluster: PrivateCluster, blocker: str
) -> None:
    if blocker == "xid-other-database":
        # Another database of the same cluster: the horizon is cluster-wide.
        blocker_dsn, blocker_sql = private_cluster.dsn, "SELECT pg_current_xact_id()"
    else:
        async with await psycopg.AsyncConnection.connect(gap_dsn, autocommit=True) as conn:
            await conn.execute("CREATE TABLE scratch (n int)")
        blocker_dsn, blocker_sql = gap_dsn, "INSERT INTO scratch VALUES (1)"

    sink = RecordingSink()
    async with running_runtime(
        gap_dsn, sink, SYNC_POLL_INTERVAL_SEC=60, SYNC_RECHECK_INTERVAL_MS=50
    ) as runtime:
        await wait_until(lambda: parked(runtime), what="the consumer to wait, idle")
        notified = runtime.stats.notify_wakeups
        conn = await psycopg.AsyncConnection.connect(blocker_dsn)
        async with conn:
            await conn.execute(blocker_sql)  # holds an xid older than the event's
            await insert_call(gap_dsn, "held")

            def woken() -> bool:
                return runtime.stats.notify_wakeups > notified

            await wait_until(woken, what="the NOTIFY of the insert")
            rechecks = runtime.stats.recheck_wakeups

            def rechecked_a_few_times() -> bool:
                return runtime.stats.recheck_wakeups >= rechecks + 4

            await wait_until(rechecked_a_few_times, what="re-checks while held back")
            assert sink.entries == [], "delivered past an open older transaction"
            # `serversync status` agrees: one committed event waits behind the horizon.
            assert await fetch_value(gap_dsn, query("horizon_state")) == 1
            notified = runtime.stats.notify_wakeups
            rechecks = runtime.stats.recheck_wakeups
            await conn.rollback()  # the blocker ends; nothing notifies about that
            ended = time.monotonic()

            def delivered() -> bool:
                return len(sink.entries) == 1

            await wait_until(delivered, timeout=5, interval=0.005, what="the held-back event")
            latency = time.monotonic() - ended
        assert latency < 1.0, f"took {latency:.3f}s after the blocker ended"
        assert runtime.stats.recheck_wakeups > rechecks
        assert runtime.stats.notify_wakeups == notified
        assert runtime.stats.poll_wakeups == 0
    assert sink.entries[0]["payload"]["caller_number"] == "held"


# -- 4. lost NOTIFY and no NOTIFY ---------------------------------------------------------------

LISTENER_BACKENDS = (
    "SELECT pid FROM pg_stat_activity "
    "WHERE datname = current_database() AND application_name LIKE 'serversync:listen:%'"
)


def kill_listener_then_commit(dsn: str, callers: list[str]) -> int:
    """Terminate the listener's backend and commit events before the listener can reconnect.

    Deliberately synchronous: the listener runs in this test's event loop, which is blocked
    until this returns, so the commits (and their NOTIFY) certainly happen while nobody
    listens. Returns the terminated backend's pid."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        pids = [pid for (pid,) in conn.execute(LISTENER_BACKENDS).fetchall()]
        assert len(pids) == 1, f"expected one listener backend, found {pids}"
        row = conn.execute("SELECT pg_terminate_backend(%s, 5000)", (pids[0],)).fetchone()
        assert row is not None
        assert row[0] is True
        assert conn.execute(LISTENER_BACKENDS).fetchall() == []
        for caller in callers:
            conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, '0')", (caller,)
            )
        assert conn.execute(LISTENER_BACKENDS).fetchall() == []
        return int(pids[0])


async def test_lost_notify_during_listener_reconnect_is_caught_up(gap_dsn: str) -> None:
    sink = RecordingSink()
    async with running_runtime(gap_dsn, sink, SYNC_POLL_INTERVAL_SEC=60) as runtime:
        listener = listener_of(runtime)

        # Before that, "before" would be read without any NOTIFY to wait for.
        await wait_until(
            lambda: waiting_for_notify(gap_dsn), what="the idle consumer to wait for a NOTIFY"
        )
        await insert_call(gap_dsn, "before")

        def first_delivered_and_notified() -> bool:
            return len(sink.entries) == 1 and listener.notifications >= 1

        await wait_until(first_delivered_and_notified, what="the first event and its NOTIFY")
        # Asleep again before the listener goes: a consumer still between its reads after the
        # first event would find the next ones by itself, whatever became of their NOTIFY.
        await wait_until(lambda: parked(runtime), what="the consumer to wait again")
        notifications, reconnects = listener.notifications, listener.reconnects

        killed = kill_listener_then_commit(gap_dsn, ["lost-1", "lost-2", "lost-3"])
        started = time.monotonic()

        def caught_up() -> bool:
            return len(sink.entries) == 4

        await wait_until(caught_up, timeout=10, what="the events whose NOTIFY was lost")
        elapsed = time.monotonic() - started
        assert elapsed < 5.0, f"took {elapsed:.1f}s: looks like the 60 s poll timer"
        assert listener.reconnects == reconnects + 1
        # The NOTIFY went to nobody: the catch-up read after the reconnect found the events.
        assert listener.notifications == notifications
        assert runtime.stats.poll_wakeups == 0
        pids = [pid for (pid,) in await fetch_all(gap_dsn, LISTENER_BACKENDS)]
        assert len(pids) == 1
        assert pids[0] != killed
    assert [e["payload"]["caller_number"] for e in sink.entries] == [
        "before",
        "lost-1",
        "lost-2",
        "lost-3",
    ]


def insert_into_outbox_without_notify(dsn: str) -> None:
    """Write an event straight into the outbox: no trigger there, so no NOTIFY.

    Deliberately synchronous: the consumer runs in this test's event loop, so it cannot start a
    read before this has committed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload) "
            "VALUES ('upsert', 'call_log', 'no-notify', '{\"id\": \"no-notify\"}')"
        )


async def test_event_without_notify_is_picked_up_by_the_poll_timer(gap_dsn: str) -> None:
    sink = RecordingSink()
    async with running_runtime(gap_dsn, sink, SYNC_POLL_INTERVAL_SEC=0.5) as runtime:
        listener = listener_of(runtime)
        await wait_until(lambda: parked(runtime), what="the consumer to wait for its poll timer")
        # No await from here until the event is committed: the consumer stays parked.
        notifications = listener.notifications
        notify_wakeups = runtime.stats.notify_wakeups
        polls = runtime.stats.poll_wakeups
        insert_into_outbox_without_notify(gap_dsn)

        def delivered() -> bool:
            return len(sink.entries) == 1

        await wait_until(delivered, timeout=5, what="the event nobody notified about")
        assert runtime.stats.poll_wakeups > polls
        assert runtime.stats.poll_wakeups > 0
        assert listener.notifications == notifications
        assert runtime.stats.notify_wakeups == notify_wakeups
    assert sink.entries[0]["entityId"] == "no-notify"


# -- offset resets across a txid digit boundary -------------------------------------------------


async def burn_xids_past_a_power_of_ten(dsn: str) -> None:
    """Consume xids until the next one has one more decimal digit than the current one."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute("SELECT pg_current_xact_id()::text")
        row = await cur.fetchone()
        assert row is not None
        xid = int(row[0])
        needed = 10 ** len(str(xid)) - xid
        if needed > 300_000:
            pytest.skip(f"xid {xid} is {needed} xids short of a power of ten; too slow to burn")
        await conn.execute(
            sql.SQL(
                "DO $$ BEGIN FOR i IN 1..{} LOOP PERFORM pg_current_xact_id(); COMMIT; "
                "END LOOP; END $$"
            ).format(sql.Literal(needed))
        )


async def test_offset_reset_targets_order_txids_as_numbers(gap_dsn: str) -> None:
    """A reset must not land past events whose txid has fewer digits: ordered as text, txid
    '10000' sorts before '9999', and a replay from such a target skips events for good."""
    for i in range(3):
        await insert_call(gap_dsn, f"short-txid-{i}")
    await burn_xids_past_a_power_of_ten(gap_dsn)
    for i in range(3):
        await insert_call(gap_dsn, f"long-txid-{i}")
    outbox = await outbox_in_delivery_order(gap_dsn)
    assert len(outbox) == 6
    assert len(str(outbox[0].txid)) < len(str(outbox[-1].txid))
    positions = [Position(row.txid, row.seq) for row in outbox]
    first_created = await fetch_value(
        gap_dsn, "SELECT created_at FROM sync.events_outbox WHERE seq = %s", (outbox[0].seq,)
    )

    conn = await psycopg.AsyncConnection.connect(gap_dsn, autocommit=True)
    async with conn:
        # The consumer has delivered everything.
        await conn.execute(
            "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq) "
            "VALUES (%s, %s::xid8, %s)",
            (CONSUMER, str(positions[-1].txid), positions[-1].seq),
        )
        latest = await plan_reset(conn, CONSUMER, to_latest=True)
        assert (latest.target, latest.replayed, latest.skipped) == (positions[-1], 0, 0)
        by_seq = await plan_reset(conn, CONSUMER, to_seq=outbox[0].seq - 1)
        assert by_seq.target == Position(outbox[0].txid, outbox[0].seq - 1)
        assert by_seq.replayed == 6
        by_time = await plan_reset(conn, CONSUMER, to_datetime=first_created)
        assert by_time.replayed == 6
        back = await plan_reset(conn, CONSUMER, shift_by=-4)
        assert (back.target, back.replayed) == (positions[1], 4)

        await conn.execute(
            "UPDATE sync.consumer_offsets SET last_txid = '0', last_seq = 0 WHERE consumer = %s",
            (CONSUMER,),
        )
        forward = await plan_reset(conn, CONSUMER, shift_by=4)
        assert (forward.target, forward.skipped) == (positions[3], 4)
