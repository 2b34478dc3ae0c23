"""Latency: single-event transactions at a steady rate; commit -> applied at the receiver."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg

from bench.harness import BenchEnv, execute, ingest_server, progress, start_service, wait_for


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99/max of `values` (milliseconds), nearest-rank."""
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
    env: BenchEnv, *, rate: float, seconds: float, listen: bool, poll_interval: float
) -> dict[str, Any]:
    """Commit `rate` single-event transactions per second for `seconds`; measure arrival."""
    await execute(env.frontend, "TRUNCATE ingest.entities")
    await execute(env.backend, "TRUNCATE call_logs CASCADE")
    await execute(
        env.backend,
        "INSERT INTO sync.consumer_offsets (consumer) VALUES ('frontend-sync')"
        " ON CONFLICT (consumer) DO NOTHING",
    )
    # Start at the end: only this run's events count.
    await execute(
        env.backend,
        "UPDATE sync.consumer_offsets o SET last_txid = e.txid, last_seq = e.seq"
        " FROM (SELECT txid, seq FROM sync.events_outbox ORDER BY txid DESC, seq DESC LIMIT 1) e"
        " WHERE o.consumer = 'frontend-sync'",
    )
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
            },
            env.workdir / f"consumer-latency-{mode}.log",
        )
        try:

            async def leading() -> bool:
                rows = await execute(
                    env.backend,
                    "SELECT leader_pid IS NOT NULL FROM sync.consumer_offsets"
                    " WHERE consumer = 'frontend-sync'",
                )
                return bool(rows and rows[0][0])

            await wait_for(
                leading, timeout=30, what="the consumer to lead", watching=[consumer, receiver]
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
                    await conn.execute(
                        "INSERT INTO call_logs (id, caller_number, callee_number) VALUES"
                        " (%s, '09000000000', '0312345678')",
                        (call_id,),
                    )
                    committed[call_id] = time.time()
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
