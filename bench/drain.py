"""Drain: how fast a backlog of N events empties after an outage, next to two references.

(a) the in-database ceiling: one INSERT ... SELECT ... ON CONFLICT from the outbox into a
    receiver-shaped table; (b) a plain Python loop (psycopg, batch 1000) reading the outbox and
    upserting into the receiver's table with executemany, committing an offset per batch;
(c) a Python read-only walk of the outbox (the same read, rows fetched and dropped): the floor
    of any Python consumer's read path, which the runtime with a null sink is held against.
"""

from __future__ import annotations

import asyncio
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.types.json import Jsonb

from bench.harness import (
    BenchEnv,
    cpu_meter,
    event_position,
    execute,
    ingest_server,
    outbox_end,
    peak_rss_mb,
    progress,
    start_service,
    watch_drain,
)
from consumer.core.events import Position
from consumer.store.db import connect_kwargs

RECEIVER_UPSERT = """
INSERT INTO ingest.entities AS t
    (entity_type, entity_id, seq, deleted, payload, source_created_at, applied_at)
VALUES (%s, %s, %s, %s, %s, %s, now())
ON CONFLICT (entity_type, entity_id) DO UPDATE
SET seq = EXCLUDED.seq, deleted = EXCLUDED.deleted, payload = EXCLUDED.payload,
    source_created_at = EXCLUDED.source_created_at, applied_at = EXCLUDED.applied_at
WHERE t.seq < EXCLUDED.seq
"""


def _figures(events: int, seconds: float, cpu: dict[str, float]) -> dict[str, Any]:
    """What every reference reports: its events, time, rate and CPU per event."""
    return {
        "events": events,
        "seconds": seconds,
        "events_per_sec": events / seconds,
        "cpu_us_per_event": cpu,
    }


def _window_source(window: int | None) -> sql.Composable:
    """What a drain reads: the whole outbox, or its first `window` events in delivery order (a
    drain of the start of a backlog too large to drain whole)."""
    if window is None:
        return sql.SQL("sync.events_outbox")
    return sql.SQL("(SELECT * FROM sync.events_outbox ORDER BY txid, seq LIMIT {}) AS w").format(
        sql.Literal(window)
    )


async def in_database_ceiling(env: BenchEnv, window: int | None = None) -> dict[str, Any]:
    """Reference (a): the whole outbox (or its first `window` events) into a receiver-shaped
    table in one statement."""
    await execute(env.backend, "DROP TABLE IF EXISTS bench_ref_entities")
    await execute(
        env.backend,
        "CREATE TABLE bench_ref_entities (entity_type text, entity_id text, seq bigint NOT NULL,"
        " deleted boolean NOT NULL, payload jsonb, source_created_at timestamptz,"
        " applied_at timestamptz NOT NULL, PRIMARY KEY (entity_type, entity_id))",
    )
    # Its own connection, open across the CPU window (a backend that ends inside it is lost).
    work = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    async with work, cpu_meter(env, {}) as meter:
        await meter.mark()
        started = time.perf_counter()
        # The count from the command's tag: a RETURNING counted in a CTE would keep a row per
        # event in a tuplestore (on disk past work_mem), work the reference does not need.
        cur = await work.execute(
            sql.SQL(
                "INSERT INTO bench_ref_entities AS t SELECT entity_type,"
                " entity_id, seq, op = 'delete', payload, created_at, now() FROM {}"
                " ON CONFLICT (entity_type, entity_id) DO UPDATE SET seq = EXCLUDED.seq,"
                " deleted = EXCLUDED.deleted, payload = EXCLUDED.payload,"
                " source_created_at = EXCLUDED.source_created_at,"
                " applied_at = EXCLUDED.applied_at"
                " WHERE t.seq < EXCLUDED.seq"
            ).format(_window_source(window))
        )
        seconds = time.perf_counter() - started
        events = cur.rowcount
        cpu = await meter.per_event(events)
    await execute(env.backend, "DROP TABLE bench_ref_entities")
    return _figures(events, seconds, cpu)


async def python_loop(env: BenchEnv, batch_size: int) -> dict[str, Any]:
    """Reference (b): read a batch, executemany into the receiver, commit an offset; repeat."""
    await execute(env.frontend, "TRUNCATE ingest.entities")
    await execute(
        env.backend,
        "INSERT INTO sync.consumer_offsets (consumer) VALUES ('bench-python-loop')"
        " ON CONFLICT (consumer) DO UPDATE SET last_txid = '0', last_seq = 0",
    )
    # The connection settings of the product's own read and offset connections (UTC timestamps are
    # the cheap ones to load; offset commits do not wait for the WAL flush), so that the
    # references differ from it only in what they do.
    source = await psycopg.AsyncConnection.connect(
        env.backend, autocommit=True, **connect_kwargs("bench-loop", synchronous_commit=False)
    )
    target = await psycopg.AsyncConnection.connect(env.frontend, **connect_kwargs("bench-loop"))
    events = batches = 0
    position = Position.start()
    async with source, target, cpu_meter(env, {"python": os.getpid()}) as meter:
        total = await (await source.execute("SELECT count(*) FROM sync.events_outbox")).fetchone()
        expected = int(total[0]) if total else 0
        await meter.mark()
        started = time.perf_counter()
        while events < expected:
            cur = await source.execute(
                "SELECT o.txid::text, o.seq, o.op, o.entity_type, o.entity_id, o.payload,"
                " o.created_at FROM sync.events_outbox o WHERE (o.txid, o.seq) > (%s::xid8, %s)"
                " AND o.txid < pg_snapshot_xmin(pg_current_snapshot())"
                " ORDER BY o.txid, o.seq LIMIT %s",
                (str(position.txid), position.seq, batch_size),
            )
            rows = await cur.fetchall()
            if not rows:
                # Held back by a transaction open elsewhere in the cluster: look again shortly,
                # as the product's consumer does, rather than stop short of the outbox's end.
                await asyncio.sleep(0.01)
                continue
            async with target.cursor() as wcur:
                await wcur.executemany(
                    RECEIVER_UPSERT,
                    [(r[3], r[4], r[1], r[2] == "delete", Jsonb(r[5]), r[6]) for r in rows],
                )
            await target.commit()
            position = Position(int(rows[-1][0]), rows[-1][1])
            await source.execute(
                "UPDATE sync.consumer_offsets SET last_txid = %s::xid8, last_seq = %s,"
                " updated_at = now() WHERE consumer = 'bench-python-loop'",
                (str(position.txid), position.seq),
            )
            events += len(rows)
            batches += 1
        seconds = time.perf_counter() - started
        cpu = await meter.per_event(events)
    return {**_figures(events, seconds, cpu), "batches": batches}


async def read_walk(env: BenchEnv, batch_size: int) -> dict[str, Any]:
    """Reference (c): read the whole outbox in batches, fetching every column, doing nothing."""
    conn = await psycopg.AsyncConnection.connect(
        env.backend, autocommit=True, **connect_kwargs("bench-walk")
    )
    events = 0
    position = Position.start()
    async with conn, cpu_meter(env, {"python": os.getpid()}) as meter:
        await meter.mark()
        started = time.perf_counter()
        while True:
            cur = await conn.execute(
                "SELECT o.txid::text, o.seq, o.op, o.entity_type, o.entity_id, o.payload::text,"
                " o.created_at FROM sync.events_outbox o WHERE (o.txid, o.seq) > (%s::xid8, %s)"
                " AND o.txid < pg_snapshot_xmin(pg_current_snapshot())"
                " ORDER BY o.txid, o.seq LIMIT %s",
                (str(position.txid), position.seq, batch_size),
                prepare=True,
                binary=True,
            )
            rows = await cur.fetchall()
            if not rows:
                break
            position = Position(int(rows[-1][0]), rows[-1][1])
            events += len(rows)
        seconds = time.perf_counter() - started
        cpu = await meter.per_event(events)
    return _figures(events, seconds, cpu)


@dataclass(frozen=True)
class ReceiverSide:
    """Where the drain through HTTP lands: the receiver's database, its mapping file (None: the
    generic store), how to empty it before a drain and how to count what it holds after."""

    name: str
    dsn: str
    mapping: Path | None = None
    reset: tuple[str, ...] = ("TRUNCATE ingest.entities",)
    count: str = "SELECT count(*) FROM ingest.entities"


async def product(
    env: BenchEnv,
    batch_size: int,
    sink: str,
    timeout: float,
    side: ReceiverSide | None = None,
    *,
    window: int | None = None,
    consumer_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """`serversync run frontend-sync` draining the whole outbox (through HTTP into `side`,
    by default the generic receiver, or into a null sink); with `window`, until it has passed
    the outbox's first `window` events (it goes on until it is stopped just after)."""
    side = side or ReceiverSide("generic", env.frontend)
    for statement in side.reset:
        await execute(side.dsn, statement)
    await execute(
        env.backend,
        "INSERT INTO sync.consumer_offsets (consumer) VALUES ('frontend-sync')"
        " ON CONFLICT (consumer) DO UPDATE SET last_txid = '0', last_seq = 0,"
        " delivered_total = 0",
    )
    if window is None:
        end = await outbox_end(env.backend)
        total = (await execute(env.backend, "SELECT count(*) FROM sync.events_outbox"))[0][0]
    else:
        last = await event_position(env.backend, window)
        if last is None:
            raise ValueError(f"the outbox holds fewer than {window:,} events")
        end, total = last, window
    # One connection for all the polling: a connection per poll would cost the server a
    # backend start every 20 ms, on the cores the product runs on.
    monitor = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    receiving = ingest_server(
        env, dsn=side.dsn, mapping=side.mapping, log=f"ingest-server-{side.name}"
    )
    async with monitor, receiving as (url, receiver):
        consumer = start_service(
            ["run", "frontend-sync", "--sink", "null" if sink == "null" else "default"],
            {
                "DATABASE_URL": env.backend,
                "FRONTEND_BASE_URL": url,
                "SYNC_BATCH_SIZE": str(batch_size),
                "SYNC_LOG_LEVEL": "WARNING",
                # Settings under comparison (bench/mechanisms.py).
                **(consumer_env or {}),
            },
            env.workdir / f"consumer-{sink}-{side.name}.log",
        )
        processes = {"consumer": consumer.pid}
        if sink == "http":
            processes["receiver"] = receiver.pid
        try:
            async with cpu_meter(env, processes) as meter:
                run = await watch_drain(
                    monitor,
                    meter,
                    consumer="frontend-sync",
                    end=end,
                    total=total,
                    label=sink,
                    timeout=timeout,
                    every=0.02,
                    watching=[consumer, receiver],
                )
                delivered, seconds, cpu = run.events, run.seconds, run.cpu
            consumer_rss = peak_rss_mb(consumer.pid)
            receiver_rss = peak_rss_mb(receiver.pid)
        finally:
            consumer.stop()
    if sink == "http":
        applied = (await execute(side.dsn, side.count))[0][0]
        distinct = (
            await execute(
                env.backend,
                sql.SQL("SELECT count(DISTINCT (entity_type, entity_id)) FROM {}").format(
                    _window_source(window)
                ),
            )
        )[0][0]
        # Past a window the consumer went on delivering until it was stopped.
        if (applied != distinct) if window is None else (applied < distinct):
            raise RuntimeError(
                f"the {side.name} receiver holds {applied} entities, expected {distinct}"
            )
    return {
        "sink": sink,
        "events": delivered,
        "seconds": seconds,
        "events_per_sec": delivered / seconds,
        "batches_per_sec": math.ceil(delivered / batch_size) / seconds,
        "consumer_peak_rss_mb": round(consumer_rss, 1),
        "receiver_peak_rss_mb": round(receiver_rss, 1) if sink == "http" else None,
        "cpu_us_per_event": cpu,
    }


async def ceiling_and_http_rounds(
    env: BenchEnv, batch_size: int, rounds: int, timeout: float
) -> dict[str, Any]:
    """The in-database ceiling and frontend-sync through HTTP, `rounds` times interleaved, each
    round's order the other way round from the last: "in_database" and "product_http" are the
    rounds with the median events/s, "share_of_ceiling" the median of each round's HTTP drain
    over its own ceiling (a machine that slows down for a while weighs on both sides of one
    round), "rounds" each round's figures."""
    ceilings: list[dict[str, Any]] = []
    drains: list[dict[str, Any]] = []
    for number in range(1, rounds + 1):
        order = ("ceiling", "http") if number % 2 else ("http", "ceiling")
        for which in order:
            if which == "ceiling":
                progress(f"drain: (a) in-database ceiling, round {number}/{rounds}")
                ceilings.append(await in_database_ceiling(env))
            else:
                progress(f"drain: frontend-sync through HTTP, round {number}/{rounds}")
                drains.append(await product(env, batch_size, "http", timeout))
    shares = [
        drained["events_per_sec"] / ceiling["events_per_sec"]
        for drained, ceiling in zip(drains, ceilings, strict=True)
    ]
    return {
        "in_database": _median_run(ceilings),
        "product_http": _median_run(drains),
        "share_of_ceiling": round(statistics.median(shares), 3),
        "rounds": [
            {
                "in_database_events_per_sec": round(ceiling["events_per_sec"]),
                "http_events_per_sec": round(drained["events_per_sec"]),
                "share_of_ceiling": round(share, 3),
            }
            for ceiling, drained, share in zip(ceilings, drains, shares, strict=True)
        ],
    }


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run whose events/s is the median (the lower of the middle two for an even count):
    a real run, so its CPU figures belong to its rate."""
    ranked = sorted(runs, key=lambda run: run["events_per_sec"])
    return ranked[(len(ranked) - 1) // 2]
