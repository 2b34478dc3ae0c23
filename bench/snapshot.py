"""Snapshots: how fast a snapshot writes a table's rows into the outbox, and what a running
snapshot costs the producers writing that table.

The table is shaped like a call log (a bigint key, a few text columns, a timestamptz; about 230
bytes a row) and filled before it is tracked, as a table that held rows before serversync was
installed is. No consumer runs: the outbox only grows.

Reading (`reads`): the same rows moved four ways, in interleaved repeats (the order reversed in
every other one, so a machine that speeds up or slows down favours none), each figure the median
of its repeats:

* `copy`: `COPY (SELECT * FROM t) TO STDOUT` read by psycopg, the bytes counted and dropped: the
  fastest way PostgreSQL hands a table's rows to a client (psycopg's loop, a message per row,
  costs more CPU than PostgreSQL's side: `cpu_us_per_row` says how much).
* `copy_json`: the same with `to_json(t.*)`, the JSON a snapshot writes for each row.
* `snapshot_chunk_1000` and `snapshot_chunk_10000`: `run_snapshot` of the table into the outbox
  with the default chunk size and a ten times larger one (wall time of `run_snapshot`; planning
  and recording the snapshot are not timed). A snapshot does more than a COPY: it locks each
  chunk's rows FOR SHARE (a WAL record and a dirtied page each), and writes every row into the
  outbox and its indexes, WAL-logged. `outbox_bytes_per_row` and `wal_bytes_per_row` say how
  much it writes (the WAL figure counts the whole server's WAL: on a quiet server only).

Before every measurement the outbox and the snapshots are emptied, the table is vacuumed and a
checkpoint is taken, so every run starts from the same state (the first change of a page after a
checkpoint writes the whole page into the WAL).

Producers (`producers`): pgbench, prepared statements, single-row UPDATEs of random ids of the same
table from a few connections for a fixed time, alone and while snapshots of the table run back to
back for the whole run (alternating which comes first); tps, pgbench's average latency and the
p50/p99 of its per-transaction log, and the snapshot's rows/s under that load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import time
from typing import Any

import psycopg
from psycopg import conninfo, sql

from bench.harness import BenchEnv, CpuMeter, cpu_meter, execute, progress
from bench.producer import pgbench_path
from consumer.store.snapshot_writer import run_snapshot
from consumer.store.snapshots import (
    CHUNK_SIZE,
    SnapshotTable,
    cancel_snapshot,
    create_snapshot,
    plan_tables,
)

TABLE = "bench_snapshot_calls"
ENTITY_TYPE = "bench_snapshot_call"
LARGE_CHUNK_SIZE = 10_000
# The snapshots measured, by their chunk sizes: the default and a ten times larger one.
SNAPSHOT_READS = {f"snapshot_chunk_{size}": size for size in (CHUNK_SIZE, LARGE_CHUNK_SIZE)}
# The ways of reading the table, in the order of a forward pass.
READS = ("copy", "copy_json", *SNAPSHOT_READS)
DEFAULT_CHUNKS, LARGE_CHUNKS = SNAPSHOT_READS
# What the summary and the chart call each.
LABELS = {
    "copy": "COPY",
    "copy_json": "COPY to_json",
    **{key: f"snapshot, chunk {size}" for key, size in SNAPSHOT_READS.items()},
}
# Each ratio: (numerator, denominator) of rows_per_sec.
RATIOS = {
    "snapshot_to_copy": (DEFAULT_CHUNKS, "copy"),
    "snapshot_to_copy_json": (DEFAULT_CHUNKS, "copy_json"),
    "large_chunks_to_copy": (LARGE_CHUNKS, "copy"),
    "large_chunks_to_default": (LARGE_CHUNKS, DEFAULT_CHUNKS),
    "copy_json_to_copy": ("copy_json", "copy"),
}
PRODUCER_CLIENTS = 4
# A snapshot paced with `serversync snapshot --max-rate` (rows a second), for the producers'
# figures beside an unpaced one: what an operator who wants producers undisturbed would run.
PACED_RATE = 10_000.0
# The producers' runs: alone, while unpaced snapshots run back to back, while paced ones do
# (each the max_rate of its snapshots).
MODES: dict[str, float | None] = {
    "alone": None,
    "during_snapshot": None,
    "during_paced_snapshot": PACED_RATE,
}
FILL_CHUNK = 100_000

CREATE_TABLE = sql.SQL(
    """CREATE TABLE public.{} (
    id            bigint      PRIMARY KEY,
    caller_number text        NOT NULL,
    callee_number text        NOT NULL,
    status        text        NOT NULL,
    summary       text        NOT NULL,
    started_at    timestamptz NOT NULL
)"""
).format(sql.Identifier(TABLE))
# About 150 characters of summary: a row of ~225 bytes on its page, ~290 as JSON.
FILL = sql.SQL(
    "INSERT INTO public.{} SELECT g, '090' || lpad(g::text, 8, '0'), '0312345678', 'completed',"
    " 'call ' || g || ': ' || repeat(md5(g::text), 4), now() - g * interval '1 second'"
    " FROM generate_series(%s::bigint, %s::bigint) g"
).format(sql.Identifier(TABLE))
# The producers' transaction: one row, by a random key, a column that no index holds.
UPDATE_SCRIPT = (
    "\\set id random(1, {rows})\n"
    "UPDATE public.{table} SET status = 'edited', started_at = now() WHERE id = :id;\n"
)


async def prepare_table(env: BenchEnv, rows: int) -> dict[str, Any]:
    """The table with `rows` rows, filled untracked, then tracked; its size."""
    await execute(
        env.backend, sql.SQL("DROP TABLE IF EXISTS public.{}").format(sql.Identifier(TABLE))
    )
    await execute(env.backend, CREATE_TABLE)
    for first in range(1, rows + 1, FILL_CHUNK):
        await execute(env.backend, FILL, (first, min(first + FILL_CHUNK - 1, rows)))
    await execute(env.backend, sql.SQL("VACUUM ANALYZE public.{}").format(sql.Identifier(TABLE)))
    # Tracked once it holds its rows: they are in no outbox row, only a snapshot sends them.
    await execute(env.backend, "SELECT sync.track(%s, %s)", (f"public.{TABLE}", ENTITY_TYPE))
    found = await execute(
        env.backend,
        sql.SQL(
            "SELECT count(*), avg(pg_column_size(t.*))::int, pg_relation_size(%s::regclass),"
            " avg(octet_length(to_json(t.*)::text))::int FROM public.{} t"
        ).format(sql.Identifier(TABLE)),
        (f"public.{TABLE}",),
    )
    count, row_bytes, table_bytes, json_bytes = found[0]
    progress(f"snapshot: {count:,} rows of {row_bytes} bytes ({table_bytes / 2**20:,.0f} MiB)")
    return {
        "rows": int(count),
        "row_bytes": int(row_bytes),
        "json_bytes": int(json_bytes),
        "table_mib": round(table_bytes / 2**20, 1),
    }


async def _clean(env: BenchEnv) -> None:
    """The state every measurement starts from: an empty outbox and no snapshot recorded, the
    table vacuumed (what an earlier run locked or updated is cleared), and a fresh checkpoint."""
    await execute(env.backend, "TRUNCATE sync.events_outbox, sync.snapshot_tables, sync.snapshots")
    await execute(env.backend, sql.SQL("VACUUM ANALYZE public.{}").format(sql.Identifier(TABLE)))
    await execute(env.backend, "CHECKPOINT")


async def _wal_lsn(conn: psycopg.AsyncConnection[Any]) -> str:
    cur = await conn.execute("SELECT pg_current_wal_lsn()::text")
    row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def _wal_since(conn: psycopg.AsyncConnection[Any], lsn: str) -> int:
    cur = await conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (lsn,))
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def _outbox_bytes(conn: psycopg.AsyncConnection[Any]) -> int:
    cur = await conn.execute("SELECT pg_total_relation_size('sync.events_outbox')")
    row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def _copy(
    conn: psycopg.AsyncConnection[Any], meter: CpuMeter, statement: sql.Composed
) -> dict[str, Any]:
    """Read a COPY TO STDOUT to its end, counting its rows (one message each) and bytes."""
    rows = size = 0
    await meter.mark()
    started = time.perf_counter()
    async with conn.cursor() as cur, cur.copy(statement) as copy:
        async for data in copy:
            rows += 1
            size += len(data)
    seconds = time.perf_counter() - started
    return {
        "rows": rows,
        "seconds": seconds,
        "cpu_us_per_row": await meter.per_event(rows),
        "bytes_per_row": round(size / max(rows, 1), 1),
    }


async def _snapshot(
    conn: psycopg.AsyncConnection[Any], meter: CpuMeter, chunk_size: int
) -> dict[str, Any]:
    """A snapshot of the table for every consumer, planned and recorded first (not timed), then
    written by `run_snapshot` (timed); what it wrote into the outbox."""
    tables = await plan_tables(conn, [f"public.{TABLE}"])
    snapshot_id = await create_snapshot(conn, tables)
    outbox_before = await _outbox_bytes(conn)
    await meter.mark()
    started = time.perf_counter()
    state = await run_snapshot(conn, snapshot_id, chunk_size=chunk_size)
    seconds = time.perf_counter() - started
    cpu = await meter.per_event(state.rows_sent)
    if state.state != "done":
        raise RuntimeError(f"snapshot {snapshot_id} ended {state.state}, not done")
    cur = await conn.execute(
        "SELECT count(*) FROM sync.events_outbox WHERE snapshot_id = %s AND op = 'upsert'",
        (snapshot_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    written = int(row[0])
    return {
        "rows": state.rows_sent,
        "seconds": seconds,
        "cpu_us_per_row": cpu,
        "outbox_rows": written,
        "outbox_bytes_per_row": round(
            (await _outbox_bytes(conn) - outbox_before) / max(written, 1), 1
        ),
    }


async def _read_once(env: BenchEnv, meter: CpuMeter, kind: str) -> dict[str, Any]:
    """One measurement of `kind` (one of READS), on a connection of its own."""
    await _clean(env)
    table = sql.Identifier(TABLE)
    conn = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    async with conn:
        lsn = await _wal_lsn(conn)
        if kind == "copy":
            statement = sql.SQL("COPY (SELECT * FROM public.{}) TO STDOUT").format(table)
            figures = await _copy(conn, meter, statement)
        elif kind == "copy_json":
            statement = sql.SQL("COPY (SELECT to_json(t.*) FROM public.{} t) TO STDOUT").format(
                table
            )
            figures = await _copy(conn, meter, statement)
        else:
            figures = await _snapshot(conn, meter, SNAPSHOT_READS[kind])
        rows = max(figures["rows"], 1)
        figures["wal_bytes_per_row"] = round(await _wal_since(conn, lsn) / rows, 1)
    figures["rows_per_sec"] = round(figures["rows"] / figures["seconds"], 1)
    figures["seconds"] = round(figures["seconds"], 6)
    return figures


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the runs, the runs' rates kept beside it."""
    figures: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            parts = set.intersection(*(set(run[key]) for run in runs))
            figures[key] = {
                part: round(statistics.median(run[key][part] for run in runs), 2)
                for part in sorted(parts)
            }
        else:
            figures[key] = round(statistics.median(run[key] for run in runs), 6)
    figures["rows_per_sec_runs"] = [run["rows_per_sec"] for run in runs]
    if "outbox_rows" in runs[0]:
        figures["outbox_rows_runs"] = [run["outbox_rows"] for run in runs]
    return figures


async def measure_reads(env: BenchEnv, repeats: int) -> dict[str, Any]:
    """Each way of READS `repeats` times, interleaved; medians and the ratios of their rates."""
    runs: dict[str, list[dict[str, Any]]] = {kind: [] for kind in READS}
    async with cpu_meter(env, {"bench": os.getpid()}) as meter:
        for number in range(repeats):
            order = READS if number % 2 == 0 else tuple(reversed(READS))
            for kind in order:
                figures = await _read_once(env, meter, kind)
                progress(
                    f"snapshot: {kind}, {number + 1} of {repeats}: "
                    f"{figures['rows_per_sec']:,.0f} rows/s"
                )
                runs[kind].append(figures)
    reads = {kind: _median(kind_runs) for kind, kind_runs in runs.items()}
    return {
        **reads,
        "ratios": {
            name: round(reads[top]["rows_per_sec"] / reads[bottom]["rows_per_sec"], 3)
            for name, (top, bottom) in RATIOS.items()
        },
    }


def _percentile(values: list[int], share: float) -> float:
    """The nearest-rank percentile of `values` (microseconds) in milliseconds."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(share * len(ordered)) - 1))
    return round(ordered[index] / 1000, 3)


# Where the producers' statements spend their time, sampled every WAIT_SAMPLE_SECONDS: each
# pgbench backend running a statement, by its wait event (CPU: running, or waiting for a CPU).
WAIT_SAMPLE_SECONDS = 0.01
PRODUCER_WAITS = """
SELECT coalesce(wait_event_type || ':' || wait_event, 'CPU'), count(*)
FROM pg_stat_activity
WHERE application_name = 'pgbench' AND state = 'active' AND pid <> pg_backend_pid()
GROUP BY 1
"""


async def _producer_waits(dsn: str, ended: asyncio.Event) -> dict[str, float]:
    """Until `ended`: the share of the producers' sampled statements in each wait event (lock
    waits on the snapshot's chunks, WAL flushes, CPU), the largest first."""
    counts: dict[str, int] = {}
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        while not ended.is_set():
            cur = await conn.execute(PRODUCER_WAITS)
            for event, count in await cur.fetchall():
                counts[event] = counts.get(event, 0) + int(count)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), WAIT_SAMPLE_SECONDS)
    total = max(sum(counts.values()), 1)
    return {
        event: round(count / total, 3)
        for event, count in sorted(counts.items(), key=lambda item: -item[1])
    }


async def _pgbench(
    env: BenchEnv, rows: int, seconds: int, label: str, started: asyncio.Event
) -> dict[str, Any]:
    """One pgbench run of the producers' UPDATEs: tps, average latency, p50/p99 from its log."""
    params = conninfo.conninfo_to_dict(env.backend)
    script = env.workdir / "snapshot_update.sql"
    script.write_text(UPDATE_SCRIPT.format(rows=rows, table=TABLE))
    prefix = env.workdir / f"pgbench-snapshot-{label}"
    for old in env.workdir.glob(f"{prefix.name}.*"):
        old.unlink()
    process = await asyncio.create_subprocess_exec(
        pgbench_path(),
        *("-n", "-M", "prepared", "-T", str(seconds), "-c", str(PRODUCER_CLIENTS), "-j", "2"),
        *("-f", str(script), "-l", f"--log-prefix={prefix}"),
        *("-h", str(params.get("host", "127.0.0.1")), "-p", str(params.get("port", 5432))),
        *("-U", str(params.get("user", "postgres")), str(params["dbname"])),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={
            "PATH": "/usr/bin:/bin",
            **({"PGPASSWORD": str(params["password"])} if "password" in params else {}),
        },
    )
    started.set()
    ended = asyncio.Event()
    sampler = asyncio.create_task(_producer_waits(env.backend, ended))
    try:
        out_bytes, err_bytes = await process.communicate()
    finally:
        ended.set()
    waits = await sampler
    out, err = out_bytes.decode(), err_bytes.decode()
    tps = re.search(r"tps = ([0-9.]+)", out)
    average = re.search(r"latency average = ([0-9.]+) ms", out)
    if process.returncode != 0 or not tps or not average:
        raise RuntimeError(f"pgbench failed: {err.strip() or out.strip()}")
    # Per transaction: client, number, latency in microseconds, script, epoch seconds, us.
    latencies = [
        int(line.split()[2])
        for log in sorted(env.workdir.glob(f"{prefix.name}.*"))
        for line in log.read_text().splitlines()
        if line.strip()
    ]
    if not latencies:
        raise RuntimeError(f"pgbench logged no transaction: {out.strip()}")
    return {
        "tps": round(float(tps.group(1)), 1),
        "transactions": len(latencies),
        "latency_avg_ms": float(average.group(1)),
        "latency_p50_ms": _percentile(latencies, 0.50),
        "latency_p99_ms": _percentile(latencies, 0.99),
        "waits": waits,
    }


async def _snapshots_meanwhile(
    env: BenchEnv,
    tables: list[SnapshotTable],
    started: asyncio.Event,
    stop: asyncio.Event,
    max_rate: float | None,
) -> dict[str, Any]:
    """Snapshots of the table back to back from when pgbench starts until `stop`: rows written
    and their rate over that time (the last one is stopped where it stands, and cancelled)."""
    conn = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    async with conn:
        await started.wait()
        begun = time.perf_counter()
        rows = snapshots = 0
        while not stop.is_set():
            snapshot_id = await create_snapshot(conn, tables)
            snapshots += 1
            state = await run_snapshot(conn, snapshot_id, stop=stop, max_rate=max_rate)
            rows += state.rows_sent
            if state.state == "running":
                await cancel_snapshot(conn, snapshot_id)
        seconds = time.perf_counter() - begun
    return {
        "snapshot_rows": rows,
        "snapshots": snapshots,
        "snapshot_rows_per_sec": round(rows / seconds, 1),
    }


async def _producers_once(
    env: BenchEnv, rows: int, seconds: int, mode: str, label: str
) -> dict[str, Any]:
    """One pgbench run, alone or with snapshots running beside it (paced or not; MODES), from a
    clean outbox."""
    await _clean(env)
    started, stop = asyncio.Event(), asyncio.Event()
    if mode == "alone":
        return await _pgbench(env, rows, seconds, label, started)
    conn = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    async with conn:
        # Counted once: the count is for progress only, and would else be timed as snapshot work.
        tables = await plan_tables(conn, [f"public.{TABLE}"])
    snapshots = asyncio.create_task(_snapshots_meanwhile(env, tables, started, stop, MODES[mode]))
    try:
        figures = await _pgbench(env, rows, seconds, label, started)
    finally:
        stop.set()
        started.set()
        meanwhile = await snapshots
    return {**figures, **meanwhile}


def _producer_median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure over the runs; of each wait's share, counting a run that never
    saw that wait as 0."""
    figures: dict[str, Any] = {
        key: round(statistics.median(run[key] for run in runs), 3)
        for key, value in runs[0].items()
        if not isinstance(value, dict)
    }
    events = {event for run in runs for event in run["waits"]}
    waits = {
        event: round(statistics.median(run["waits"].get(event, 0.0) for run in runs), 3)
        for event in events
    }
    figures["waits"] = dict(sorted(waits.items(), key=lambda item: -item[1]))
    return figures


async def measure_producers(env: BenchEnv, rows: int, seconds: int, repeats: int) -> dict[str, Any]:
    """pgbench's UPDATEs of the table alone and while snapshots run, `repeats` times each
    (alternating which comes first); medians and the ratio of the tps during to alone."""
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in MODES}
    for number in range(repeats):
        order = list(MODES) if number % 2 == 0 else list(reversed(MODES))
        for name in order:
            figures = await _producers_once(env, rows, seconds, name, f"{name}-{number}")
            progress(
                f"snapshot: producers {name}, {number + 1} of {repeats}: {figures['tps']:,.0f} tps,"
                f" p99 {figures['latency_p99_ms']} ms"
                + (
                    f"; snapshot {figures['snapshot_rows_per_sec']:,.0f} rows/s"
                    if name != "alone"
                    else ""
                )
            )
            runs[name].append(figures)
    medians = {name: _producer_median(runs[name]) for name in MODES}
    alone = medians["alone"]
    return {
        "clients": PRODUCER_CLIENTS,
        "seconds": seconds,
        "repeats": repeats,
        "paced_rate": PACED_RATE,
        **medians,
        "tps_runs": {name: [run["tps"] for run in kind] for name, kind in runs.items()},
        "tps_during_to_alone": round(medians["during_snapshot"]["tps"] / alone["tps"], 3),
        "tps_during_paced_to_alone": round(
            medians["during_paced_snapshot"]["tps"] / alone["tps"], 3
        ),
    }


async def run_snapshot_bench(
    env: BenchEnv, *, rows: int, seconds: int, repeats: int
) -> dict[str, Any]:
    """The whole measurement: the table, the reads, the producers."""
    figures: dict[str, Any] = {
        **await prepare_table(env, rows),
        "repeats": repeats,
        "chunk_sizes": [CHUNK_SIZE, LARGE_CHUNK_SIZE],
    }
    figures["reads"] = await measure_reads(env, repeats)
    figures["producers"] = await measure_producers(env, figures["rows"], seconds, repeats)
    await _clean(env)
    return figures
