"""Read pacing (SYNC_BATCH_WAIT_MS, SYNC_BATCH_WAIT_MIN_RATE): while events arrive fast, a consumer
that has caught up waits a little before reading again, so they gather into fewer batches; while
they arrive slowly, each one is read at once.

Real PostgreSQL and the reference receiver on loopback; the producers' spacing is paced inside
the database (pg_sleep between commits), every wait on the consumer is a wait_until. The pacing
policy itself (ReadPacer) is tested without a database in tests/test_policies.py."""

from __future__ import annotations

import time

import psycopg
import pytest

from tests.conftest import make_settings, running_consumer, wait_until

SPACED_EVENTS = 10


async def _commit_spaced_events(dsn: str, prefix: str, spacing_sec: float) -> None:
    """SPACED_EVENTS single-event transactions, `spacing_sec` apart."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        for i in range(SPACED_EVENTS):
            await conn.execute("SELECT pg_sleep(%s)", (spacing_sec,))
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                (f"{prefix}-{i}",),
            )


@pytest.mark.parametrize(
    ("batch_wait_ms", "most_batches", "fewest_batches"),
    [
        # Paced: the first event is read at once, the next ten gather during the 400 ms wait.
        (400, 3, 2),
        # Unpaced (the control): ten commits 20 ms apart come in as (nearly) ten batches.
        (0, SPACED_EVENTS + 1, 6),
    ],
)
async def test_fast_traffic_gathers_into_fewer_batches(
    backend_dsn: str,
    receiver_url: str,
    batch_wait_ms: int,
    most_batches: int,
    fewest_batches: int,
) -> None:
    settings = make_settings(
        backend_dsn,
        receiver_url,
        SYNC_POLL_INTERVAL_SEC=60,
        SYNC_BATCH_WAIT_MS=batch_wait_ms,
        # Any traffic at all counts as fast here: one event in the window is enough.
        SYNC_BATCH_WAIT_MIN_RATE=0.1,
    )
    async with running_consumer(settings) as runtime:
        conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
        async with conn:
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES ('first', 'x')"
            )
        await wait_until(lambda: runtime.stats.delivered_events == 1, what="the first event")
        await _commit_spaced_events(backend_dsn, "fast", 0.02)
        await wait_until(
            lambda: runtime.stats.delivered_events == 1 + SPACED_EVENTS,
            timeout=10,
            what="every event",
        )
        batches = runtime.stats.delivered_batches
        assert fewest_batches <= batches <= most_batches
        assert (runtime.stats.paced_waits > 0) == (batch_wait_ms > 0)


async def test_slow_traffic_is_read_at_once_however_long_the_wait(
    backend_dsn: str, receiver_url: str
) -> None:
    settings = make_settings(
        backend_dsn,
        receiver_url,
        SYNC_POLL_INTERVAL_SEC=60,
        SYNC_BATCH_WAIT_MS=5000,
        SYNC_BATCH_WAIT_MIN_RATE=1000,
    )
    async with running_consumer(settings) as runtime:
        started = time.monotonic()
        await _commit_spaced_events(backend_dsn, "slow", 0.05)
        # Ten events in ~0.5 s is 20/s, far below the rate: none waits the 5 s.
        await wait_until(
            lambda: runtime.stats.delivered_events == SPACED_EVENTS,
            timeout=4,
            what="every event, well before one 5 s wait",
        )
        assert time.monotonic() - started < 4
        assert runtime.stats.paced_waits == 0
