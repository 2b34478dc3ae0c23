"""PgQ beside the relay: its C row trigger, its ticker and a consumer of its batches.

PgQ (Debian: postgresql-15-pgq3) is the in-database queue Skytools' replication is built on.
Its `pgq.logutriga` is a C row trigger that writes each changed row, urlencoded, into the
queue's current event table; a ticker (pgqd in production) cuts the event stream into batches
with `pgq.ticker()`, and a consumer reads one batch at a time with `pgq.next_batch`,
`pgq.get_batch_events` and `pgq.finish_batch`.

`python -m bench.pgq [--consume]` (the database in BENCH_PGQ_DSN) is the process the producer
bench runs beside pgbench in its PgQ modes: the ticker every 100 ms always (as pgqd ticks every
queue, consumed or not; it also keeps each batch to one tick's events), and with `--consume` a
consumer that fetches every batch's events and discards them, as serversync's consumer with its
null sink does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg import sql

from bench.harness import Service, execute, wait_for

QUEUE = "bench_pgq"
CONSUMER = "bench_pgq_consumer"
TICK_EVERY_SEC = 0.1
EXTENSION = "pgq"
DSN_VARIABLE = "BENCH_PGQ_DSN"
# The process's connections, by application_name: how the bench sees that it has started.
TICKER_NAME = "bench-pgq-ticker"
CONSUMER_NAME = "bench-pgq-consumer"


async def unavailable(dsn: str) -> str | None:
    """Why PgQ cannot be measured on the server of `dsn`; None when it can (the extension is
    created, if it was not already)."""
    rows = await execute(
        dsn, "SELECT EXISTS (SELECT FROM pg_available_extensions WHERE name = %s)", (EXTENSION,)
    )
    if not rows[0][0]:
        version = (await execute(dsn, "SHOW server_version"))[0][0]
        return (
            f"the server (PostgreSQL {version}) has no pgq extension"
            " (Debian: apt-get install postgresql-15-pgq3; a server from the PostgreSQL wheel"
            " has none)"
        )
    try:
        await execute(dsn, "CREATE EXTENSION IF NOT EXISTS pgq")
    except psycopg.Error as exc:
        return f"CREATE EXTENSION pgq failed: {str(exc).strip()}"
    return None


async def create_queue(dsn: str, table: str) -> None:
    """The bench's queue, afresh, with PgQ's C trigger on `table` and a registered consumer (so
    that what the producers write with no consumer running waits for it, as the relay's outbox
    does for serversync's consumer)."""
    await execute(
        dsn,
        "SELECT pgq.drop_queue(queue_name, true) FROM pgq.queue WHERE queue_name = %s",
        (QUEUE,),
    )
    await execute(dsn, "SELECT pgq.create_queue(%s)", (QUEUE,))
    await execute(dsn, "SELECT pgq.register_consumer(%s, %s)", (QUEUE, CONSUMER))
    # The trigger's argument is the queue's name, a literal in the DDL.
    await execute(
        dsn,
        sql.SQL(
            "CREATE TRIGGER bench_pgq_logutriga AFTER INSERT OR UPDATE OR DELETE ON {}"
            " FOR EACH ROW EXECUTE FUNCTION pgq.logutriga({})"
        ).format(sql.Identifier(table), sql.Literal(QUEUE)),
    )


def start(dsn: str, log: Path, *, consume: bool) -> Service:
    """The ticker, and with `consume` the consumer, as a process of its own (its CPU is measured
    apart from PostgreSQL's and pgbench's)."""
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "bench.pgq", *(["--consume"] if consume else [])],
            # In the environment, not the command line, where a password would be in view.
            env={**os.environ, DSN_VARIABLE: dsn},
            stdout=handle,
            stderr=handle,
        )
    return Service(process, log)


async def started(dsn: str, service: Service, *, consume: bool) -> None:
    """Wait until the process has connected its ticker (and its consumer): Python's start-up
    must neither be charged to the producers of the mode measured nor compete with them."""
    names = [TICKER_NAME, *([CONSUMER_NAME] if consume else [])]

    async def connected() -> bool:
        rows = await execute(
            dsn,
            "SELECT count(DISTINCT application_name) FROM pg_stat_activity"
            " WHERE application_name = ANY(%s)",
            (names,),
        )
        return bool(rows) and rows[0][0] == len(names)

    await wait_for(
        connected,
        timeout=60,
        what=f"PgQ's ticker to start (see {service.log})",
        every=0.05,
        watching=[service],
    )


async def caught_up(dsn: str, service: Service) -> None:
    """Wait until the consumer has finished every batch of what the queue holds: a backlog
    consumed while pgbench runs would be charged to the producers of the mode measured."""
    # Without producers the ticker waits up to its max lag (3 s) to tick the last events;
    # force_tick makes its next call tick them.
    await execute(dsn, "SELECT pgq.force_tick(%s)", (QUEUE,))

    async def there() -> bool:
        rows = await execute(
            dsn,
            "SELECT q.ev_new = 0 AND c.last_tick = q.last_tick_id AND c.current_batch IS NULL"
            " FROM pgq.get_queue_info(%s) q, pgq.get_consumer_info(%s, %s) c",
            (QUEUE, QUEUE, CONSUMER),
        )
        return bool(rows) and bool(rows[0][0])

    await wait_for(
        there,
        timeout=300,
        what=f"the PgQ consumer to catch up (see {service.log})",
        every=0.05,
        watching=[service],
    )


async def _tick(dsn: str) -> None:
    """`pgq.ticker()` every TICK_EVERY_SEC, as pgqd would (it ticks a queue only when enough
    events or time have passed since its last tick)."""
    async with await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=TICKER_NAME
    ) as conn:
        while True:
            await conn.execute("SELECT pgq.ticker()")
            await asyncio.sleep(TICK_EVERY_SEC)


async def _consume(dsn: str) -> None:
    """Every batch's events fetched and dropped, a batch per transaction; between batches, a
    wait of one tick period when there is none (no batch can appear before the next tick)."""
    async with await psycopg.AsyncConnection.connect(dsn, application_name=CONSUMER_NAME) as conn:
        while True:
            async with conn.transaction():
                cur = await conn.execute("SELECT pgq.next_batch(%s, %s)", (QUEUE, CONSUMER))
                row = await cur.fetchone()
                batch = row[0] if row else None
                if batch is not None:
                    cur = await conn.execute(
                        "SELECT ev_id, ev_type, ev_data, ev_extra1 FROM pgq.get_batch_events(%s)",
                        (batch,),
                    )
                    await cur.fetchall()
                    await conn.execute("SELECT pgq.finish_batch(%s)", (batch,))
            if batch is None:
                await asyncio.sleep(TICK_EVERY_SEC)


async def _main(dsn: str, consume: bool) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    tasks = [asyncio.create_task(_tick(dsn))]
    if consume:
        tasks.append(asyncio.create_task(_consume(dsn)))
    stopping = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopping], return_when=asyncio.FIRST_COMPLETED)
    for task in [*tasks, stopping]:
        task.cancel()
    for task in done:
        if task is not stopping:
            task.result()  # a failed ticker or consumer ends the process with its error
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)


def main() -> int:
    """Entry point of the ticker and consumer process."""
    parser = argparse.ArgumentParser(prog="python -m bench.pgq", description=__doc__)
    parser.add_argument("--consume", action="store_true", help="also consume the queue's batches")
    args = parser.parse_args()
    asyncio.run(_main(os.environ[DSN_VARIABLE], args.consume))
    return 0


if __name__ == "__main__":
    sys.exit(main())
