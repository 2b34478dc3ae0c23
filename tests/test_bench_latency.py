"""`python -m bench latency`: not a test of speed, but of where its latencies start. An event's
latency must start no later than its commit, whatever the bench's own event loop is doing: a
start read late makes an event arrive before it was sent (a busy machine measured negative
percentiles that way)."""

from __future__ import annotations

import asyncio
import time

import psycopg

from bench.latency import PathRun
from tests.support.backend import execute

# How long the producer's event loop is held once its INSERT reached the server: far longer
# than the server takes to commit and a reader to see the row.
STALL_SEC = 0.3


def first_seen(dsn: str, *, timeout: float = 10.0) -> tuple[str, float]:
    """The first call log another connection sees, and the database's clock (seconds since the
    epoch) when it saw it: no earlier than that row's commit. Polls from a thread of its own, so
    it goes on while the event loop is held."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while time.monotonic() < deadline:
            row = conn.execute(
                "SELECT id::text, extract(epoch FROM clock_timestamp())::float8"
                " FROM call_logs LIMIT 1"
            ).fetchone()
            if row is not None:
                return row[0], row[1]
    raise AssertionError("no call log committed")


async def test_an_event_s_latency_starts_before_its_commit_however_late_the_bench_runs(
    backend_dsn: str,
) -> None:
    # A notice the row's trigger sends reaches the producer while its INSERT is answered; the
    # handler holds the event loop there, as a busy machine would.
    await execute(
        backend_dsn,
        "CREATE FUNCTION stall_notice() RETURNS trigger LANGUAGE plpgsql AS"
        " $$BEGIN RAISE NOTICE 'inserted'; RETURN NULL; END$$;"
        " CREATE TRIGGER stall AFTER INSERT ON call_logs FOR EACH ROW"
        " EXECUTE FUNCTION stall_notice()",
    )
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        conn.add_notice_handler(lambda _diagnostic: time.sleep(STALL_SEC))
        run = PathRun("serversync", [conn], [conn.info.backend_pid])
        watcher = asyncio.create_task(asyncio.to_thread(first_seen, backend_dsn))
        await run.produce(rate=1.0, total=1, started=time.monotonic())
        seen_id, seen_at = await watcher
    ((entity_id, latency_start),) = run.committed.items()
    assert seen_id == entity_id
    assert latency_start <= seen_at
    # The stall is in the round trip the bench times, not in the latency.
    assert run.commit_ms[0] >= STALL_SEC * 1000
