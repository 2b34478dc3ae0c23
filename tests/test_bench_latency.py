"""`python -m bench latency`: not a test of speed, but of where its latencies start. An event's
latency must start no later than its commit, whatever the bench's own event loop is doing: a
start read late makes an event arrive before it was sent (a busy machine measured negative
percentiles that way)."""

from __future__ import annotations

import asyncio
import threading
import time

import psycopg

from bench.latency import PathRun
from tests.support.backend import execute

# The longest the producer's event loop is held, waiting for another connection to see its row.
HOLD_DEADLINE_SEC = 10.0


def first_seen(dsn: str, seen: threading.Event) -> tuple[str, float]:
    """The first call log another connection sees, and the database's clock (seconds since the
    epoch) when it saw it: no earlier than that row's commit. Sets `seen` then. Polls from a
    thread of its own, so it goes on while the event loop is held."""
    deadline = time.monotonic() + HOLD_DEADLINE_SEC
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT id::text, extract(epoch FROM clock_timestamp())::float8"
                " FROM call_logs LIMIT 1"
            ).fetchone()
            if row is not None:
                seen.set()
                return row[0], row[1]
    raise AssertionError("no call log committed")


async def test_an_event_s_latency_starts_before_its_commit_however_late_the_bench_runs(
    backend_dsn: str,
) -> None:
    # A notice the row's trigger sends reaches the producer while its INSERT is answered; the
    # handler holds the event loop there, as a busy machine would, until another connection
    # has seen the committed row.
    await execute(
        backend_dsn,
        "CREATE FUNCTION hold_notice() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE NOTICE 'inserted'; RETURN NULL; END$$;"
        " CREATE TRIGGER hold AFTER INSERT ON call_logs FOR EACH ROW"
        " EXECUTE FUNCTION hold_notice()",
    )
    seen = threading.Event()
    # Per hold: whether the row was seen during it, and how long it lasted (seconds).
    holds: list[tuple[bool, float]] = []

    def hold(_diagnostic: psycopg.errors.Diagnostic) -> None:
        began = time.perf_counter()
        holds.append((seen.wait(HOLD_DEADLINE_SEC), time.perf_counter() - began))

    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        conn.add_notice_handler(hold)
        run = PathRun("serversync", [conn], [conn.info.backend_pid])
        watcher = asyncio.create_task(asyncio.to_thread(first_seen, backend_dsn, seen))
        await run.produce(rate=1.0, total=1, started=time.monotonic())
        seen_id, seen_at = await watcher
    ((entity_id, latency_start),) = run.committed.items()
    assert seen_id == entity_id
    ((seen_while_held, held_sec),) = holds
    assert seen_while_held
    assert latency_start <= seen_at
    # The hold is in the round trip the bench times, not in the latency.
    assert run.commit_ms[0] >= held_sec * 1000
