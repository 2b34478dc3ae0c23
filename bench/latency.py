"""Latency: single-event transactions at a steady rate; commit -> applied at the receiver.

`run_latency`: serversync alone, from one connection, with NOTIFY and polling only.

`run_comparison`: serversync against the naive relay (bench/naive.py), in the same run. Both
run at once against the same receiver: serversync's consumer delivers call_logs, the naive
process delivers naive_call_logs (the same shape), and each path has its own producer
connections committing single-row INSERT transactions at the named rate, the two paths' commits
interleaved in time. Running them side by side rather than one after the other is the closest
to "the same run": both see the same machine, the same receiver and the same background load
at the same moment, and neither benefits from having gone first. It also means each path shares
the machine with the other: at 1,000 events/s the server commits 2,000 transactions a second.

Latency runs from the producer's INSERT to the receiver's apply, both on the database's clock:
`clock_timestamp()` in the producer's transaction, just before its commit, and the time of the
receiver's transaction (`applied_at`); so it includes the commit itself.

Per path and rate: commit -> applied percentiles of the delivered events, the events the path
never delivered (lost: the naive "seq > last" reader skips a commit that lands behind one it
already read), the rate achieved, and what producing cost: the CPU of the producers' PostgreSQL
backends per committed event (read from /proc/<pid>/schedstat, nanoseconds, for exactly the
backends of that path's connections: reliable, whatever else the machine does) and the
producers' INSERT+commit round trip (timed in the bench's event loop, which all producers of
both paths share: comparable between the paths, but it includes that loop's own delays).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench import naive
from bench.harness import (
    BenchEnv,
    Service,
    execute,
    ingest_server,
    process_cpu_seconds,
    progress,
    server_is_local,
    start_service,
    wait_for,
)

# The rates of the comparison (events/s of each path), its producer connections per path.
COMPARISON_RATES = (100.0, 200.0, 500.0, 1000.0)
COMPARISON_CONNECTIONS = 8
# The two paths of the comparison: the table its producers write, the entity type it arrives as.
PATHS = ("serversync", "naive")
TABLES = {"serversync": "call_logs", "naive": "naive_call_logs"}
ENTITY_TYPES = {"serversync": "call_log", "naive": naive.ENTITY_TYPE}


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99/max of `values` (milliseconds), nearest-rank."""
    if not values:
        raise ValueError("no values to take percentiles of")
    ordered = sorted(values)

    def rank(p: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]

    return {
        "p50_ms": round(rank(50), 3),
        "p95_ms": round(rank(95), 3),
        "p99_ms": round(rank(99), 3),
        "max_ms": round(ordered[-1], 3),
    }


async def run_latency(
    env: BenchEnv,
    *,
    rate: float,
    seconds: float,
    listen: bool,
    poll_interval: float,
    consumer_env: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Commit `rate` single-event transactions per second for `seconds`; measure arrival
    (the consumer with `consumer_env` added to its settings)."""
    await start_at_outbox_end(env)
    mode = "notify" if listen else "poll-only"
    async with ingest_server(env) as (url, receiver):
        consumer = start_service(
            ["run", "frontend-sync"],
            {
                "DATABASE_URL": env.backend,
                "FRONTEND_BASE_URL": url,
                "SYNC_BATCH_SIZE": "1000",
                "SYNC_LISTEN": "true" if listen else "false",
                "SYNC_POLL_INTERVAL_SEC": str(poll_interval),
                "SYNC_LOG_LEVEL": "WARNING",
                **(consumer_env or {}),
            },
            env.workdir / f"consumer-latency-{mode}.log",
        )
        try:
            await wait_for(
                functools.partial(_leading, env),
                timeout=30,
                what="the consumer to lead",
                watching=[consumer, receiver],
            )
            committed: dict[str, float] = {}
            total = int(rate * seconds)
            conn = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
            async with conn:
                started = time.monotonic()
                for i in range(total):
                    due = started + i / rate
                    delay = due - time.monotonic()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    call_id = str(uuid.uuid4())
                    committed[call_id] = await insert_event(conn, "call_logs", call_id)
                    if i and i % max(1, int(rate * 2)) == 0:
                        progress(f"  {mode}: committed {i:,}/{total:,}")
                achieved = total / (time.monotonic() - started)

            async def arrived() -> bool:
                rows = await execute(env.frontend, "SELECT count(*) FROM ingest.entities")
                return int(rows[0][0]) >= total

            await wait_for(
                arrived,
                timeout=poll_interval * 3 + 30,
                what="every event to arrive",
                watching=[consumer, receiver],
            )
        finally:
            consumer.stop()
    rows = await execute(
        env.frontend,
        "SELECT entity_id, extract(epoch FROM applied_at)::float8 FROM ingest.entities",
    )
    latencies = [(applied - committed[entity]) * 1000 for entity, applied in rows]
    return {
        "mode": mode,
        "target_rate": rate,
        "achieved_rate": round(achieved, 1),
        "events": total,
        "poll_interval_sec": poll_interval,
        **percentiles(latencies),
    }


async def insert_event(conn: psycopg.AsyncConnection[Any], table: str, entity_id: str) -> float:
    """Commit one call log row into `table` in a transaction of its own (`conn` autocommits);
    where its latency starts: the database's clock inside that transaction, in seconds since the
    epoch. The server takes it before the commit, so no event is applied before its latency
    starts; the bench's own clock after the commit returns would be read late whenever the
    bench's event loop is (a busy machine measured negative latencies that way)."""
    cursor = await conn.execute(
        sql.SQL(
            "INSERT INTO {} (id, caller_number, callee_number)"
            " VALUES (%s, '09000000000', '0312345678')"
            " RETURNING extract(epoch FROM clock_timestamp())::float8"
        ).format(sql.Identifier(table)),
        (entity_id,),
    )
    row = await cursor.fetchone()
    assert row is not None  # an INSERT ... RETURNING of one row returns it
    started: float = row[0]
    return started


async def start_at_outbox_end(env: BenchEnv) -> None:
    """Empty the receiver and call_logs, and put frontend-sync's offset at the outbox's end:
    only the events committed from here on count."""
    await execute(env.frontend, "TRUNCATE ingest.entities")
    await execute(env.backend, "TRUNCATE call_logs CASCADE")
    await execute(
        env.backend,
        "INSERT INTO sync.consumer_offsets (consumer) VALUES ('frontend-sync')"
        " ON CONFLICT (consumer) DO NOTHING",
    )
    await execute(
        env.backend,
        "UPDATE sync.consumer_offsets o SET last_txid = e.txid, last_seq = e.seq"
        " FROM (SELECT txid, seq FROM sync.events_outbox ORDER BY txid DESC, seq DESC LIMIT 1) e"
        " WHERE o.consumer = 'frontend-sync'",
    )


async def _leading(env: BenchEnv) -> bool:
    rows = await execute(
        env.backend,
        "SELECT leader_pid IS NOT NULL FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'",
    )
    return bool(rows and rows[0][0])


def backend_cpu_ns(pid: int) -> int | None:
    """Nanoseconds a (single-threaded) process has run on a CPU so far, from
    /proc/<pid>/schedstat: exact where /proc/<pid>/stat counts in 10 ms ticks (the fallback,
    on a kernel without schedstat). None if the process is gone."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        seconds = process_cpu_seconds(pid)
        return None if seconds is None else round(seconds * 1e9)


def sum_cpu_ns(pids: Sequence[int]) -> int:
    """The CPU nanoseconds of `pids` together (those that are gone count nothing)."""
    return sum(backend_cpu_ns(pid) or 0 for pid in pids)


@dataclass
class PathRun:
    """One path's producers at one rate: what they committed, and when."""

    path: str
    connections: list[psycopg.AsyncConnection[Any]]
    backend_pids: list[int]
    # entity id -> where its latency starts: the database's clock in its transaction.
    committed: dict[str, float] = field(default_factory=dict)
    commit_ms: list[float] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() its first commit was due at
    finished: float = 0.0  # time.monotonic() after its last commit

    async def produce(self, rate: float, total: int, started: float) -> None:
        """Commit `total` single-row INSERT transactions at `rate` per second from `started`
        (time.monotonic()), connection c taking every len(connections)-th one from c."""
        self.started = started

        async def one(first: int, conn: psycopg.AsyncConnection[Any]) -> None:
            for index in range(first, total, len(self.connections)):
                delay = started + index / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                entity_id = str(uuid.uuid4())
                before = time.perf_counter()
                self.committed[entity_id] = await insert_event(conn, TABLES[self.path], entity_id)
                self.commit_ms.append((time.perf_counter() - before) * 1000)

        await asyncio.gather(*(one(c, conn) for c, conn in enumerate(self.connections)))
        self.finished = time.monotonic()


async def _applied(
    monitor: psycopg.AsyncConnection[Any], path: str, ids: list[str]
) -> list[tuple[str, float]]:
    """(entity id, applied_at as unix seconds) of those of `ids` the receiver holds for `path`."""
    cur = await monitor.execute(
        "SELECT entity_id, extract(epoch FROM applied_at)::float8 FROM ingest.entities"
        " WHERE entity_type = %s AND entity_id = ANY(%s)",
        (ENTITY_TYPES[path], ids),
    )
    return [(str(entity), float(applied)) for entity, applied in await cur.fetchall()]


async def _delivery_backends(monitor: psycopg.AsyncConnection[Any], pid: int) -> list[int]:
    """The backends of a delivery process: serversync's connections and the naive relay's end
    their application_name with the process id (consumer/store/db.py, bench/naive.py)."""
    cur = await monitor.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE %s", (f"%:{pid}",)
    )
    return [int(row[0]) for row in await cur.fetchall()]


async def run_comparison(
    env: BenchEnv,
    *,
    rates: Sequence[float] = COMPARISON_RATES,
    seconds: float,
    connections: int = COMPARISON_CONNECTIONS,
    poll_interval: float,
) -> dict[str, Any]:
    """serversync and the naive relay side by side at each of `rates` (events/s of each path)
    for `seconds`, each path from `connections` producer connections of its own."""
    await start_at_outbox_end(env)
    await naive.prepare(env.backend)
    # SYNC_* settings given to the bench reach the consumer (start_service passes the
    # environment on): the result says which were set.
    tuned = {
        key: value
        for key, value in sorted(os.environ.items())
        if key.startswith("SYNC_") and "SECRET" not in key and "TOKEN" not in key
    }
    figures: dict[str, Any] = {
        "rates": list(rates),
        "seconds": seconds,
        "connections_per_path": connections,
        "poll_interval_sec": poll_interval,
        "batch_size": naive.BATCH_SIZE,
        "consumer_env": tuned,
        "cpu_measured": server_is_local(env.backend),
        "runs": {},
    }
    async with ingest_server(env, log="ingest-server-comparison") as (url, receiver):
        consumer = start_service(
            ["run", "frontend-sync"],
            {
                "DATABASE_URL": env.backend,
                "FRONTEND_BASE_URL": url,
                # The naive reader's LIMIT: both read up to as many events at once.
                "SYNC_BATCH_SIZE": str(naive.BATCH_SIZE),
                "SYNC_LISTEN": "true",
                "SYNC_POLL_INTERVAL_SEC": str(poll_interval),
                "SYNC_LOG_LEVEL": "WARNING",
            },
            env.workdir / "consumer-comparison.log",
        )
        relay = naive.start_naive(
            env.backend, url, poll_interval, env.workdir / "naive-relay-comparison.log"
        )
        services = [consumer, relay, receiver]
        try:
            await wait_for(
                functools.partial(_leading, env),
                timeout=30,
                what="the consumer to lead",
                watching=services,
            )
            await wait_for(
                functools.partial(naive.listening, env.backend),
                timeout=30,
                what="the naive relay to listen",
                watching=services,
            )
            for rate in rates:
                progress(
                    f"latency: serversync and the naive relay, {rate:,.0f} events/s each for"
                    f" {seconds}s, {connections} connections each"
                )
                figures["runs"][rate_key(rate)] = await _compare_at(
                    env,
                    rate=rate,
                    seconds=seconds,
                    connections=connections,
                    delivery={"serversync": consumer, "naive": relay},
                    services=services,
                    timeout=poll_interval * 3 + 30,
                )
        finally:
            relay.stop()
            consumer.stop()
    return figures


def rate_key(rate: float) -> str:
    """A rate as the key of its run: 100.0 -> "100"."""
    return f"{rate:g}"


async def _compare_at(
    env: BenchEnv,
    *,
    rate: float,
    seconds: float,
    connections: int,
    delivery: dict[str, Service],
    services: list[Service],
    timeout: float,
) -> dict[str, Any]:
    total = int(rate * seconds)
    local = server_is_local(env.backend)
    monitor = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    receiver_db = await psycopg.AsyncConnection.connect(env.frontend, autocommit=True)
    runs: dict[str, PathRun] = {}
    try:
        for path in PATHS:
            conns = [
                await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
                for _ in range(connections)
            ]
            pids = [conn.info.backend_pid for conn in conns]
            runs[path] = PathRun(path, conns, pids)
        delivery_backends = {
            path: await _delivery_backends(monitor, service.pid)
            for path, service in delivery.items()
        }
        producer_cpu = {path: sum_cpu_ns(run.backend_pids) for path, run in runs.items()}
        delivery_cpu = {
            path: (process_cpu_seconds(service.pid) or 0.0) * 1e9
            + sum_cpu_ns(delivery_backends[path])
            for path, service in delivery.items()
        }
        started = time.monotonic() + 0.05
        # Half a period apart: the two paths' commits alternate.
        await asyncio.gather(
            runs["serversync"].produce(rate, total, started),
            runs["naive"].produce(rate, total, started + 0.5 / rate),
        )
        producer_cpu = {
            path: sum_cpu_ns(run.backend_pids) - producer_cpu[path] for path, run in runs.items()
        }
        ids = {path: list(run.committed) for path, run in runs.items()}

        async def serversync_delivered() -> bool:
            return len(await _applied(receiver_db, "serversync", ids["serversync"])) >= total

        await wait_for(
            serversync_delivered,
            timeout=timeout,
            what=f"serversync to deliver every event at {rate:g}/s",
            every=0.05,
            watching=services,
        )
        await wait_for(
            functools.partial(naive.caught_up, env.backend),
            timeout=timeout,
            what=f"the naive relay to read to the end of its outbox at {rate:g}/s",
            every=0.05,
            watching=services,
        )
        delivery_cpu = {
            path: (process_cpu_seconds(service.pid) or 0.0) * 1e9
            + sum_cpu_ns(delivery_backends[path])
            - delivery_cpu[path]
            for path, service in delivery.items()
        }
        result: dict[str, Any] = {"target_rate": rate}
        for path, run in runs.items():
            arrived = await _applied(receiver_db, path, ids[path])
            latencies = [(applied - run.committed[entity]) * 1000 for entity, applied in arrived]
            commit = percentiles(run.commit_ms)
            result[path] = {
                "events": total,
                "delivered": len(arrived),
                "lost": total - len(arrived),
                "achieved_rate": round(total / (run.finished - run.started), 1),
                **percentiles(latencies),
                "commit_p50_ms": commit["p50_ms"],
                "commit_p99_ms": commit["p99_ms"],
                # Whose CPU: the path's producer backends (INSERT, trigger, commit), and its
                # delivery process with its own backends (reading, posting, its offset).
                "producer_backend_cpu_us_per_event": (
                    round(producer_cpu[path] / 1000 / total, 2) if local else None
                ),
                "delivery_cpu_us_per_event": (
                    round(delivery_cpu[path] / 1000 / total, 2) if local else None
                ),
            }
        return result
    finally:
        for run in runs.values():
            for conn in run.connections:
                await conn.close()
        await monitor.close()
        await receiver_db.close()
