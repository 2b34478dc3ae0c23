"""Gap safety of the read and of the wake-ups: a naive `seq > last_seq` reader skips what the
gap-safe read delivers; an open transaction holds the horizon back only as long as it stays open
and the re-check delivers soon after it ends; a lost NOTIFY or none at all loses nothing; offset
resets order txids as numbers. The concurrent producers are in tests/test_gap_safety.py.

The backend databases of this file live on the private cluster: the read horizon is cluster-wide,
so an open transaction of any other process on a shared server would hold these consumers back
and make the timing assertions meaningless.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

from consumer.app.wiring import open_pool
from consumer.core.events import Batch, Position
from consumer.devtools.devdb import PrivateCluster
from consumer.store.admin import plan_reset
from consumer.store.outbox import OutboxStore
from consumer.store.queries import query
from tests.conftest import fetch_all, fetch_value, wait_until, waiting_for_notify
from tests.support.backend import (
    CONSUMER,
    burn_xids_past_a_power_of_ten,
    insert_call,
    insert_calls,
    outbox_in_delivery_order,
)
from tests.support.runtime import RecordingSink, listener_of, parked, running_runtime

# -- a naive `seq > last_seq` reader skips; ours does not ---------------------------------------


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


async def test_naive_seq_reader_skips_an_event_the_gap_safe_read_delivers(
    private_backend_dsn: str,
) -> None:
    t1 = await psycopg.AsyncConnection.connect(private_backend_dsn)
    t2 = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with t1, t2, open_pool(private_backend_dsn, "test-read") as pool:
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
        naive = await fetch_all(
            private_backend_dsn, "SELECT seq FROM sync.events_outbox WHERE seq > 0"
        )
        assert naive == [(seq2,)]
        naive_last = seq2
        # ... while the gap-safe read delivers nothing yet and says why.
        result = await store.read_batch(Position.start(), 100)
        assert result.batch is None
        assert result.held_back is True

        await t1.commit()

    # T1's event is committed now, but behind the naive reader's position for good.
    assert (
        await fetch_all(
            private_backend_dsn, "SELECT seq FROM sync.events_outbox WHERE seq > %s", (naive_last,)
        )
        == []
    )
    assert await fetch_value(private_backend_dsn, "SELECT count(*) FROM sync.events_outbox") == 2

    async with open_pool(private_backend_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        batch = await read_when_ready(store, Position.start())
        entries = batch.entries()
        assert [e["seq"] for e in entries] == [seq1, seq2]
        assert [e["payload"]["caller_number"] for e in entries] == ["t1", "t2"]
        assert batch.end == Position(txid2, seq2)
        after = await store.read_batch(batch.end, 100)
        assert after.batch is None


async def test_lower_seq_delivered_after_higher_seq_is_not_skipped(
    private_backend_dsn: str,
) -> None:
    """The position is (txid, seq), not seq: an event whose seq is below the position's seq but
    whose transaction is younger is still delivered."""
    older = await psycopg.AsyncConnection.connect(private_backend_dsn)
    younger = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with older, younger, open_pool(private_backend_dsn, "test-read") as pool:
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


# -- the held-back horizon ----------------------------------------------------------------------


async def test_held_back_only_when_committed_events_wait_behind_the_horizon(
    private_backend_dsn: str, private_cluster: PrivateCluster
) -> None:
    """A transaction that is merely open holds nothing back: re-reading then would only cost
    reads (a producer's commit notifies). Only committed events behind it make a read say
    held_back, and the consumer re-checks soon."""
    blocker = await psycopg.AsyncConnection.connect(private_backend_dsn)
    writer = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with blocker, writer, open_pool(private_backend_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        # An xid in this database, and an outbox row not yet committed.
        await blocker.execute("SELECT pg_current_xact_id()")
        await writer.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('open', '0')"
        )
        idle = await store.read_batch(Position.start(), 100)
        assert idle.batch is None
        assert idle.held_back is False
        # Committed behind the blocker's horizon: now something waits.
        await writer.commit()
        waiting = await store.read_batch(Position.start(), 100)
        assert waiting.batch is None
        assert waiting.held_back is True
        await blocker.rollback()
        batch = await read_when_ready(store, Position.start())
        assert [e["payload"]["caller_number"] for e in batch.entries()] == ["open"]
        after = await store.read_batch(batch.end, 100)
        assert (after.batch, after.held_back) == (None, False)


async def test_another_database_s_open_transaction_holds_nothing_back(
    private_backend_dsn: str, private_cluster: PrivateCluster
) -> None:
    """A transaction of another database of the server cannot write this outbox: events
    committed after it are read at once, the read says nothing runs here, and status lists no
    blocker. A prepared transaction, whose database pg_stat_activity does not show, still holds
    the horizon, and so does one of this database while the other's runs."""
    other = await psycopg.AsyncConnection.connect(private_cluster.dsn)
    ours = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with other, ours, open_pool(private_backend_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        await other.execute("SELECT pg_current_xact_id()")
        await insert_call(private_backend_dsn, "after-other")
        read = await store.read_batch(Position.start(), 100)
        assert read.batch is not None
        assert [e["payload"]["caller_number"] for e in read.batch.entries()] == ["after-other"]
        assert (read.held_back, read.running) == (False, False)
        assert await fetch_value(private_backend_dsn, query("horizon_state")) == 0
        blockers = await fetch_all(private_backend_dsn, query("horizon_blockers"), {"limit": 10})
        assert other.info.backend_pid not in [row[0] for row in blockers]

        # This database's open transaction holds the next event back, the other's still open.
        await ours.execute("SELECT pg_current_xact_id()")
        await insert_call(private_backend_dsn, "after-ours")
        held = await store.read_batch(read.batch.end, 100)
        assert (held.batch, held.held_back) == (None, True)
        await ours.rollback()
        released = await read_when_ready(store, read.batch.end)
        assert [e["payload"]["caller_number"] for e in released.entries()] == ["after-ours"]

        # A prepared transaction of the other database: no backend shows its xid.
        await other.execute("PREPARE TRANSACTION 'held-by-a-prepared-one'")
        try:
            await insert_call(private_backend_dsn, "after-prepared")
            prepared = await store.read_batch(released.end, 100)
            assert (prepared.batch, prepared.held_back) == (None, True)
            blockers = await fetch_all(
                private_backend_dsn, query("horizon_blockers"), {"limit": 10}
            )
            assert "prepared: held-by-a-prepared-one" in [row[3] for row in blockers]
        finally:
            async with await psycopg.AsyncConnection.connect(
                private_cluster.dsn, autocommit=True
            ) as admin:
                await admin.execute("ROLLBACK PREPARED 'held-by-a-prepared-one'")
        last = await read_when_ready(store, released.end)
        assert [e["payload"]["caller_number"] for e in last.entries()] == ["after-prepared"]


async def test_a_caller_s_own_uncommitted_rows_are_never_below_the_horizon(
    private_backend_dsn: str, private_cluster: PrivateCluster
) -> None:
    """The caller's own xid is not in its snapshot's running list: the horizon stays at or below
    it, though every transaction that is running is another database's."""
    other = await psycopg.AsyncConnection.connect(private_cluster.dsn)
    ours = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with other, ours:
        await other.execute("SELECT pg_current_xact_id()")
        await ours.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('mine', '0')"
        )
        # A later transaction commits: the snapshot's xmax passes the caller's own xid.
        await insert_call(private_backend_dsn, "later")
        cur = await ours.execute(
            "WITH h AS MATERIALIZED (SELECT sync.read_horizon(pg_current_snapshot()) AS x)"
            " SELECT (SELECT x FROM h) <= pg_current_xact_id(),"
            " (SELECT count(*) FROM sync.events_outbox o, h WHERE o.txid < h.x"
            "  AND o.txid = pg_current_xact_id())"
        )
        assert await cur.fetchone() == (True, 0)
        await ours.rollback()
        await other.rollback()


def _scans_of(plan: dict[str, Any], relation: str) -> list[str]:
    """The node types of every scan of `relation` in an EXPLAIN (FORMAT JSON) plan tree."""
    found = [plan["Node Type"]] if plan.get("Relation Name") == relation else []
    for child in plan.get("Plans", []):
        found += _scans_of(child, relation)
    return found


async def test_the_held_back_probe_reads_the_index_not_the_outbox(private_backend_dsn: str) -> None:
    """Whether committed events wait behind the horizon is asked on every read while any
    transaction is open: it must cost a few index entries at any outbox size, never a scan of
    the outbox (which an EXISTS over `txid >= xmin` was planned as)."""
    await insert_calls(private_backend_dsn, 5000)
    async with await psycopg.AsyncConnection.connect(private_backend_dsn, autocommit=True) as conn:
        await conn.execute("ANALYZE sync.events_outbox")
    blocker = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with blocker:
        await blocker.execute("SELECT pg_current_xact_id()")
        await insert_call(private_backend_dsn, "behind")
        rows = await fetch_all(
            private_backend_dsn,
            sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + sql.SQL(query("read_batch")),
            {"txid": "0", "seq": 0, "limit": 100, "consumer": CONSUMER, "announced": False},
        )
        await blocker.rollback()
    plan = rows[0][0][0]["Plan"]
    scans = _scans_of(plan, "events_outbox")
    assert "Seq Scan" not in scans, scans
    # The probe ran (a transaction was open) and found the committed event behind it.
    assert len(scans) == 2, scans


@pytest.mark.parametrize("blocker", ["xid-only", "write-untracked-table"])
async def test_held_back_event_arrives_via_recheck_soon_after_blocker_ends(
    private_backend_dsn: str, blocker: str
) -> None:
    if blocker == "xid-only":
        # A transaction that took an xid and wrote nothing the relay sees.
        blocker_dsn, blocker_sql = private_backend_dsn, "SELECT pg_current_xact_id()"
    else:
        async with await psycopg.AsyncConnection.connect(
            private_backend_dsn, autocommit=True
        ) as conn:
            await conn.execute("CREATE TABLE scratch (n int)")
        blocker_dsn, blocker_sql = private_backend_dsn, "INSERT INTO scratch VALUES (1)"

    sink = RecordingSink()
    async with running_runtime(
        private_backend_dsn, sink, SYNC_POLL_INTERVAL_SEC=60, SYNC_RECHECK_INTERVAL_MS=50
    ) as runtime:
        await wait_until(lambda: parked(runtime), what="the consumer to wait, idle")
        notified = runtime.stats.notify_wakeups
        conn = await psycopg.AsyncConnection.connect(blocker_dsn)
        async with conn:
            await conn.execute(blocker_sql)  # holds an xid older than the event's
            await insert_call(private_backend_dsn, "held")

            def woken() -> bool:
                return runtime.stats.notify_wakeups > notified

            await wait_until(woken, what="the NOTIFY of the insert")
            rechecks = runtime.stats.recheck_wakeups

            def rechecked_a_few_times() -> bool:
                return runtime.stats.recheck_wakeups >= rechecks + 4

            await wait_until(rechecked_a_few_times, what="re-checks while held back")
            assert sink.entries == [], "delivered past an open older transaction"
            # `serversync status` agrees: one committed event waits behind the horizon.
            assert await fetch_value(private_backend_dsn, query("horizon_state")) == 1
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


async def test_an_event_written_before_the_wait_was_announced_arrives_by_the_recheck(
    private_backend_dsn: str,
) -> None:
    """The relay decides at the write whether to notify: a producer that wrote its row before
    the consumer announced its wait commits without a NOTIFY. While any transaction runs, the
    consumer therefore re-checks at its re-check interval, never waits for the poll timer."""
    producer = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with producer:
        # Written while no consumer waits: this transaction will send no NOTIFY.
        await producer.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('early', '0')"
        )
        sink = RecordingSink()
        async with running_runtime(
            private_backend_dsn, sink, SYNC_POLL_INTERVAL_SEC=60, SYNC_RECHECK_INTERVAL_MS=50
        ) as runtime:
            await wait_until(
                lambda: runtime.stats.recheck_wakeups >= 2,
                what="the consumer re-checking while the producer's transaction runs",
            )
            await producer.commit()
            await wait_until(lambda: len(sink.entries) == 1, timeout=5, what="the early event")
            assert runtime.stats.notify_wakeups == 0
            assert runtime.stats.poll_wakeups == 0
    assert sink.entries[0]["payload"]["caller_number"] == "early"


async def test_a_producer_that_missed_the_announcement_is_seen_running_though_no_snapshot_lists_it(
    private_backend_dsn: str,
) -> None:
    """The announcement takes its xid, then counts the waiting consumers. A producer that takes
    a later xid and checks the count before it changes commits without a NOTIFY, and while it
    runs no snapshot lists it (its xid is at the snapshot's xmax: no later one has ended). Here
    the count waits on its advisory lock while the producer writes; the read made with the wait
    announced must still say that a transaction runs, so that the consumer re-checks rather
    than sleeping until the poll timer."""
    recount = await psycopg.AsyncConnection.connect(private_backend_dsn)
    producer = await psycopg.AsyncConnection.connect(private_backend_dsn)
    async with recount, producer, open_pool(private_backend_dsn, "test-read") as pool:
        store = OutboxStore(pool)
        await recount.execute("SELECT pg_advisory_xact_lock(hashtext('sync.waiting_consumers'))")
        announcing = asyncio.create_task(store.set_waiting(CONSUMER, True))
        waiting_xids: list[str] = []

        async def announcement_waits() -> bool:
            rows = await fetch_all(
                private_backend_dsn,
                "SELECT backend_xid::text FROM pg_stat_activity WHERE wait_event = 'advisory'"
                " AND datname = current_database() AND backend_xid IS NOT NULL",
            )
            waiting_xids[:] = [row[0] for row in rows]
            return bool(waiting_xids)

        await wait_until(announcement_waits, what="the announcement waiting for the count's lock")
        (announcer_xid,) = waiting_xids
        await producer.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('unannounced', '0')"
        )
        producer_xid = await (
            await producer.execute("SELECT pg_current_xact_id()::text")
        ).fetchone()
        assert producer_xid is not None and int(producer_xid[0]) > int(announcer_xid)
        await recount.commit()
        await announcing
        snapshot = await fetch_value(private_backend_dsn, "SELECT pg_current_snapshot()::text")
        assert int(snapshot.split(":")[1]) <= int(producer_xid[0]), snapshot

        announced = await store.read_batch(Position.start(), 100, announced=True)
        assert (announced.batch, announced.running) == (None, True)
        # Without the announcement, the same snapshot says nothing runs (a consumer that has
        # not announced its wait is not asleep on a NOTIFY).
        unannounced = await store.read_batch(Position.start(), 100)
        assert (unannounced.batch, unannounced.running) == (None, False)
        await producer.commit()
        batch = await read_when_ready(store, Position.start())
        assert [e["payload"]["caller_number"] for e in batch.entries()] == ["unannounced"]


# -- lost NOTIFY and no NOTIFY ------------------------------------------------------------------

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


async def test_lost_notify_during_listener_reconnect_is_caught_up(private_backend_dsn: str) -> None:
    sink = RecordingSink()
    async with running_runtime(private_backend_dsn, sink, SYNC_POLL_INTERVAL_SEC=60) as runtime:
        listener = listener_of(runtime)

        # Before that, "before" would be read without any NOTIFY to wait for.
        await wait_until(
            lambda: waiting_for_notify(private_backend_dsn),
            what="the idle consumer to wait for a NOTIFY",
        )
        await insert_call(private_backend_dsn, "before")

        def first_delivered_and_notified() -> bool:
            return len(sink.entries) == 1 and listener.notifications >= 1

        await wait_until(first_delivered_and_notified, what="the first event and its NOTIFY")
        # Asleep again before the listener goes: a consumer still between its reads after the
        # first event would find the next ones by itself, whatever became of their NOTIFY.
        await wait_until(lambda: parked(runtime), what="the consumer to wait again")
        notifications, reconnects = listener.notifications, listener.reconnects

        killed = kill_listener_then_commit(private_backend_dsn, ["lost-1", "lost-2", "lost-3"])
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
        pids = [pid for (pid,) in await fetch_all(private_backend_dsn, LISTENER_BACKENDS)]
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


async def test_event_without_notify_is_picked_up_by_the_poll_timer(
    private_backend_dsn: str,
) -> None:
    sink = RecordingSink()
    async with running_runtime(private_backend_dsn, sink, SYNC_POLL_INTERVAL_SEC=0.5) as runtime:
        listener = listener_of(runtime)
        await wait_until(lambda: parked(runtime), what="the consumer to wait for its poll timer")
        # No await from here until the event is committed: the consumer stays parked.
        notifications = listener.notifications
        notify_wakeups = runtime.stats.notify_wakeups
        polls = runtime.stats.poll_wakeups
        insert_into_outbox_without_notify(private_backend_dsn)

        def delivered() -> bool:
            return len(sink.entries) == 1

        await wait_until(delivered, timeout=5, what="the event nobody notified about")
        assert runtime.stats.poll_wakeups > polls
        assert runtime.stats.poll_wakeups > 0
        assert listener.notifications == notifications
        assert runtime.stats.notify_wakeups == notify_wakeups
    assert sink.entries[0]["entityId"] == "no-notify"


# -- offset resets across a txid digit boundary -------------------------------------------------


async def test_offset_reset_targets_order_txids_as_numbers(private_backend_dsn: str) -> None:
    """A reset must not land past events whose txid has fewer digits: ordered as text, txid
    '10000' sorts before '9999', and a replay from such a target skips events for good."""
    for i in range(3):
        await insert_call(private_backend_dsn, f"short-txid-{i}")
    await burn_xids_past_a_power_of_ten(private_backend_dsn)
    for i in range(3):
        await insert_call(private_backend_dsn, f"long-txid-{i}")
    outbox = await outbox_in_delivery_order(private_backend_dsn)
    assert len(outbox) == 6
    assert len(str(outbox[0].txid)) < len(str(outbox[-1].txid))
    positions = [Position(row.txid, row.seq) for row in outbox]
    first_created = await fetch_value(
        private_backend_dsn,
        "SELECT created_at FROM sync.events_outbox WHERE seq = %s",
        (outbox[0].seq,),
    )

    conn = await psycopg.AsyncConnection.connect(private_backend_dsn, autocommit=True)
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
