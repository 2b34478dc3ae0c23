"""The wake-up policy: producers NOTIFY only while a consumer says it waits, and no wake-up is
ever lost to the race between a commit and that announcement."""

from __future__ import annotations

import asyncio
import random

import psycopg

from consumer.store.queries import query
from tests.conftest import WAITING_COUNT, fetch_all, fetch_value, make_settings, running_consumer
from tests.support.waiting import wait_delivered_events, wait_until

WAIT_LOG = """
CREATE TABLE wait_log (n bigserial PRIMARY KEY, consumer text, waiting boolean);
CREATE FUNCTION log_wait() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO wait_log (consumer, waiting) VALUES (NEW.consumer, NEW.waiting);
    RETURN NULL;
END $$;
CREATE TRIGGER log_wait AFTER INSERT OR UPDATE ON sync.consumer_waits
FOR EACH ROW EXECUTE FUNCTION log_wait();
"""


async def _waiting(dsn: str) -> bool:
    value = await fetch_value(
        dsn, "SELECT waiting FROM sync.consumer_waits WHERE consumer = 'frontend-sync'"
    )
    return bool(value)


async def test_idle_consumer_asks_for_wakeups_and_stops_asking_when_busy(
    backend_dsn: str, receiver_url: str
) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(WAIT_LOG.encode())
        settings = make_settings(backend_dsn, receiver_url, SYNC_POLL_INTERVAL_SEC=60)
        async with running_consumer(settings) as runtime:
            await wait_until(lambda: _waiting(backend_dsn), what="the idle consumer to wait")
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) "
                "SELECT 'c' || g, 'x' FROM generate_series(1, 450) g"
            )
            await wait_delivered_events(runtime, 450)
            await wait_until(lambda: _waiting(backend_dsn), what="the consumer to wait again")
            assert runtime.stats.poll_wakeups == 0
    log = [
        row[0] for row in await fetch_all(backend_dsn, "SELECT waiting FROM wait_log ORDER BY n")
    ]
    # Cleared on taking the lead, asked for wake-ups when idle, stopped asking while draining
    # (no producer NOTIFY during the drain), asked again once idle, and cleared on stopping (a
    # stopped consumer must not keep producers sending NOTIFYs).
    assert log[:4] == [False, True, False, True]
    assert log[-2:] == [True, False]


async def test_no_wakeup_is_lost_to_commits_racing_the_announcement(
    backend_dsn: str, receiver_url: str
) -> None:
    # Commits spaced around the linger time land before, during and after the consumer's
    # announcement; with a 60 s poll timer, a lost wake-up would show as a stuck event.
    rng = random.Random(7)
    settings = make_settings(backend_dsn, receiver_url, SYNC_POLL_INTERVAL_SEC=60, SYNC_LINGER_MS=5)
    async with running_consumer(settings) as runtime:
        await wait_until(lambda: _waiting(backend_dsn), what="the idle consumer to wait")
        conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
        async with conn:
            for i in range(150):
                # Workload pacing inside the database, not test synchronisation.
                await conn.execute(
                    "SELECT pg_sleep(%s)", (rng.choice([0, 0.002, 0.005, 0.008, 0.02]),)
                )
                await conn.execute(
                    "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                    (f"race-{i}",),
                )
        await wait_delivered_events(
            runtime, 150, timeout=5, what="every event, well before the 60 s poll timer"
        )
        assert runtime.stats.poll_wakeups == 0


async def test_without_listen_the_consumer_polls_and_never_asks_for_wakeups(
    backend_dsn: str, receiver_url: str
) -> None:
    settings = make_settings(
        backend_dsn, receiver_url, SYNC_LISTEN=False, SYNC_POLL_INTERVAL_SEC=0.3
    )
    async with running_consumer(settings) as runtime:
        await fetch_all(
            backend_dsn,
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('p', 'x') RETURNING 1",
        )
        await wait_delivered_events(runtime, 1, what="the polled event")
        await wait_until(lambda: runtime.stats.poll_wakeups > 0, what="a poll wake-up")
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.consumer_waits") == 0


SET_WAITING = query("set_waiting")  # what a consumer runs to announce or clear its flag


async def test_the_relay_reads_a_count_of_waiting_consumers_kept_by_every_change(
    backend_dsn: str,
) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:

        async def count() -> int:
            row = await (await conn.execute(WAITING_COUNT)).fetchone()
            assert row is not None
            return int(row[0])

        async def notified_by_a_write() -> bool:
            listener = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
            async with listener:
                await listener.execute("LISTEN sync_outbox")
                await conn.execute(
                    "INSERT INTO call_logs (caller_number, callee_number) VALUES ('n', 'x')"
                )
                return [n.payload async for n in listener.notifies(timeout=0.3)] == [""]

        assert await count() == 0
        assert not await notified_by_a_write()
        await conn.execute(SET_WAITING, {"consumer": "frontend-sync", "waiting": True})
        await conn.execute(SET_WAITING, {"consumer": "recording-upload", "waiting": True})
        assert await count() == 2
        assert await notified_by_a_write()
        await conn.execute(SET_WAITING, {"consumer": "frontend-sync", "waiting": False})
        assert await count() == 1
        assert await notified_by_a_write()
        await conn.execute("DELETE FROM sync.consumer_waits WHERE consumer = 'recording-upload'")
        assert await count() == 0
        assert not await notified_by_a_write()
        await conn.execute(SET_WAITING, {"consumer": "recording-upload", "waiting": True})
        await conn.execute("TRUNCATE sync.consumer_waits")
        assert await count() == 0
        assert not await notified_by_a_write()


async def test_flags_changed_at_once_are_counted_one_after_the_other(backend_dsn: str) -> None:
    # b announces in a transaction still open while a stops waiting: a recount that did not
    # wait for b's commit would miss b and leave the count at 0 while b sleeps.
    announcing = await psycopg.AsyncConnection.connect(backend_dsn)
    stopping = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with announcing, stopping:
        await stopping.execute(SET_WAITING, {"consumer": "a", "waiting": True})
        await announcing.execute(SET_WAITING, {"consumer": "b", "waiting": True})
        stopping_pid = stopping.info.backend_pid
        stopped = asyncio.create_task(
            stopping.execute(SET_WAITING, {"consumer": "a", "waiting": False})
        )

        async def stopping_waits_for_the_recount_lock() -> bool:
            state = await fetch_value(
                backend_dsn,
                "SELECT wait_event FROM pg_stat_activity WHERE pid = %s",
                (stopping_pid,),
            )
            return bool(state == "advisory")

        await wait_until(stopping_waits_for_the_recount_lock, what="the second recount to queue")
        await announcing.commit()
        await stopped
    assert await fetch_value(backend_dsn, WAITING_COUNT) == 1
