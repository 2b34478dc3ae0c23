"""Operator commands on a large outbox: `serversync status` and `serversync cleanup` with millions
of rows.

`measure_status_and_cleanup(dsn, rows)` fills the outbox of the database it is given (migrated
here if it is not yet; its outbox must be empty) with `rows` rows written straight into
sync.events_outbox, shaped as the relay writes them:

* about 300 bytes of JSON payload a row;
* `rows / 100` transactions (at least one, at most 200,000), each holding consecutive seqs, all
  of them older than any snapshot's horizon (transaction ids are taken, and dropped, first when
  the server has not used enough of them yet), so no row is held back;
* created_at spread evenly over the last 43 days in position order: with the 30-day retention
  measured here, the first 30 % of the rows are older than the cutoff;
* two consumers: `caught-up` at the last row, `behind` at the row 60 % of the way (it has passed
  every old row, and has 40 % of the outbox to deliver).

The outbox is vacuumed and analysed afterwards, and consumer_offsets analysed, as autovacuum
would have done on a table that grew over weeks and consumers that commit offsets.

Then it times, on connections of its own:

* `status`: `serversync status`'s report as the command builds it (its queries on one connection,
  the process's start-up not included), the median of 5; and each of its queries (and the
  gauges' outbox_stats) alone, the median of 5; the first report and the first outbox_stats
  apart (again after the cleanup);
* `cleanup`: `serversync cleanup --older-than 30d --dry-run`, then the real run: total seconds,
  how many delete statements it ran and the slowest of them, and what it reported.

Timings are wall-clock seconds or milliseconds on whatever else the machine runs: compare figures
of one run with each other, not with another run's.

As a command, `python -m bench.outbox_scale --rows 100k,1m,10m [--private]` measures each size in
a database of its own (serversync_scale_bench, dropped afterwards) and writes
bench/results/scale-status-cleanup-DATE.json.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql

from bench.harness import bench_server, execute, machine, progress
from bench.report import RESULTS
from consumer.app.cli import status
from consumer.devtools.devdb import fresh_database
from consumer.store import admin, migrations, retention
from consumer.store.queries import query

RETENTION = timedelta(days=30)
# created_at runs over this span, oldest first: the first 13/43 of the rows are older than 30d.
SPAN_DAYS = 43
ROWS_PER_TRANSACTION = 100
MAX_TRANSACTIONS = 200_000
# Where the slower consumer stands, as a share of the outbox in position order.
BEHIND_AT = 0.6
CHUNK = 500_000
REPEATS = 5
CONSUMERS = ("behind", "caught-up")

# One JSON object of about 300 bytes, the shape of a call log's row.
_PAYLOAD = (
    'format(\'{"id":%%s,"caller_number":"090%%s","callee_number":"0312345678",'
    '"status":"completed","duration_sec":%%s,"summary":"%%s"}\', g, lpad(g::text, 8, \'0\'),'
    " g %% 600, repeat(md5(g::text), 5))::json"
)
_FILL = (
    "INSERT INTO sync.events_outbox (seq, txid, op, entity_type, entity_id, payload, created_at) "
    "SELECT g, (%(first_txid)s::bigint + (g - 1) * %(txids)s::bigint / %(rows)s::bigint)"
    "::text::xid8, 'upsert', 'call_log', g::text, " + _PAYLOAD + ", "
    "%(now)s::timestamptz - %(span)s::interval * (1 - g::float8 / %(rows)s::bigint) "
    "FROM generate_series(%(low)s::bigint, %(high)s::bigint) g"
)


async def _connect(dsn: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(dsn, autocommit=True)


async def _scalar(conn: psycopg.AsyncConnection[Any], statement: Any, params: Any = None) -> Any:
    row = await (await conn.execute(statement, params)).fetchone()
    assert row is not None
    return row[0]


async def _take_transaction_ids(conn: psycopg.AsyncConnection[Any], wanted: int) -> int:
    """Make sure at least `wanted` transaction ids below the current one are in the past; the
    first of them. Missing ones are taken by a loop that commits after taking each (a DO block
    at top level may commit)."""
    current = int(await _scalar(conn, "SELECT pg_current_xact_id()::text"))
    # Ids 0-2 are special; the outbox's rows take ids from 3 on.
    missing = wanted + 1 - (current - 3)
    if missing > 0:
        progress(f"taking {missing:,} transaction ids")
        await conn.execute("SET synchronous_commit = off")  # nothing here needs to be durable
        await conn.execute(
            sql.SQL(
                "DO $take$ BEGIN FOR i IN 1..{} LOOP PERFORM pg_current_xact_id(); COMMIT; "
                "END LOOP; END $take$"
            ).format(sql.Literal(missing))
        )
        await conn.execute("RESET synchronous_commit")
        current = int(await _scalar(conn, "SELECT pg_current_xact_id()::text"))
    first = current - 1 - wanted
    assert first >= 3, first
    return first


async def build_outbox(dsn: str, rows: int) -> dict[str, Any]:
    """Fill the empty outbox of `dsn` with `rows` rows and register the two consumers (see the
    module's docstring); what was built."""
    if rows < 1:
        raise ValueError(f"rows must be at least 1, not {rows}")
    conn = await _connect(dsn)
    async with conn:
        await migrations.migrate(conn, ["backend"])
        if await _scalar(conn, "SELECT EXISTS (SELECT FROM sync.events_outbox)"):
            raise ValueError("the outbox of the database to measure on must be empty")
        txids = max(1, min(MAX_TRANSACTIONS, rows // ROWS_PER_TRANSACTION))
        first_txid = await _take_transaction_ids(conn, txids)
        now = await _scalar(conn, "SELECT now()")
        started = time.monotonic()
        for low in range(1, rows + 1, CHUNK):
            high = min(rows, low + CHUNK - 1)
            await conn.execute(
                _FILL,
                {
                    "first_txid": first_txid,
                    "txids": txids,
                    "rows": rows,
                    "now": now,
                    "span": timedelta(days=SPAN_DAYS),
                    "low": low,
                    "high": high,
                },
            )
            progress(f"outbox: {high:,}/{rows:,} rows ({time.monotonic() - started:.0f}s)")
        await conn.execute("SELECT setval('sync.events_outbox_seq_seq', %s)", (rows,))
        await conn.execute("VACUUM (ANALYZE) sync.events_outbox")
        positions = {}
        for name, share in zip(CONSUMERS, (BEHIND_AT, 1.0), strict=True):
            seq = max(1, int(rows * share))
            txid = await _scalar(
                conn,
                "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq) "
                "SELECT %s, o.txid, o.seq FROM sync.events_outbox o WHERE o.seq = %s "
                "ON CONFLICT (consumer) DO UPDATE SET last_txid = EXCLUDED.last_txid, "
                "last_seq = EXCLUDED.last_seq RETURNING last_txid::text",
                (name, seq),
            )
            positions[name] = f"{txid}/{seq}"
        # Offset commits get consumer_offsets analysed within minutes of a consumer's start.
        await conn.execute("ANALYZE sync.consumer_offsets")
        table_bytes = await _scalar(
            conn, "SELECT pg_total_relation_size('sync.events_outbox'::regclass)"
        )
        build_seconds = time.monotonic() - started
    return {
        "rows": rows,
        "transactions": txids,
        "old_share": round((SPAN_DAYS - RETENTION.days) / SPAN_DAYS, 3),
        "consumers": positions,
        "outbox_total_mib": round(table_bytes / 2**20, 1),
        "build_seconds": round(build_seconds, 1),
    }


async def _median_ms(measure: Callable[[], Awaitable[Any]], repeats: int = REPEATS) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await measure()
        times.append((time.perf_counter() - started) * 1000)
    return round(statistics.median(times), 2)


async def measure_status(dsn: str) -> dict[str, Any]:
    """`serversync status`'s report and its queries, each the median of 5, in milliseconds."""
    conn = await _connect(dsn)
    async with conn:

        async def run(name: str, params: dict[str, Any] | None = None) -> None:
            await (await conn.execute(query(name), params)).fetchall()

        # The first of each reads pages into the cache (and after a cleanup, the first walk
        # from the outbox's start meets the deleted rows' index entries): timed apart.
        started = time.perf_counter()
        await run("outbox_stats")
        first_stats = (time.perf_counter() - started) * 1000
        started = time.perf_counter()
        await status.report(conn)
        first = (time.perf_counter() - started) * 1000
        return {
            "report_ms": await _median_ms(lambda: status.report(conn)),
            "report_json_ms": await _median_ms(lambda: status.report(conn, as_json=True)),
            "first_report_ms": round(first, 2),
            "first_outbox_stats_ms": round(first_stats, 2),
            "queries_ms": {
                "consumer_status": await _median_ms(
                    lambda: run(
                        "consumer_status",
                        {"consumer": None, "exact_up_to": admin.EXACT_BACKLOG_UP_TO},
                    )
                ),
                "horizon_state": await _median_ms(lambda: run("horizon_state")),
                "outbox_stats": await _median_ms(lambda: run("outbox_stats")),
            },
        }


class _BatchTimes(logging.Handler):
    """The seconds of each outbox batch, from the cleanup's per-batch log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.seconds: list[float] = []

    def emit(self, record: logging.LogRecord) -> None:
        if getattr(record, "table", None) == retention.OUTBOX:
            self.seconds.append(float(getattr(record, "seconds", 0.0)))


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 2)


async def measure_cleanup(dsn: str) -> dict[str, Any]:
    """`cleanup --older-than 30d --dry-run`, then the real cleanup: seconds, the outbox batches'
    median, 95th percentile and slowest, the delete statements (batches that deleted nothing
    included) and the slowest of them, and the two reports."""
    result: dict[str, Any] = {}
    conn = await _connect(dsn)
    async with conn:
        started = time.perf_counter()
        dry = await retention.cleanup(conn, older_than=RETENTION, dry_run=True)
        result["dry_run_seconds"] = round(time.perf_counter() - started, 3)
        result["dry_run_report"] = dry.to_dict()

        logger = logging.getLogger("serversync.retention")
        handler = _BatchTimes()
        logger.addHandler(handler)
        level = logger.level
        logger.setLevel(logging.INFO)
        try:
            started = time.perf_counter()
            done = await retention.cleanup(conn, older_than=RETENTION)
            result["seconds"] = round(time.perf_counter() - started, 3)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    batches = sorted(handler.seconds)
    if batches:
        result["batches"] = len(batches)
        result["batch_median_ms"] = _ms(statistics.median(batches))
        result["batch_p95_ms"] = _ms(batches[min(len(batches) - 1, int(len(batches) * 0.95))])
        result["batch_slowest_ms"] = _ms(batches[-1])
    result["delete_statements"] = done.outbox_statements
    result["delete_statement_slowest_ms"] = _ms(done.outbox_slowest_statement_seconds)
    result["report"] = done.to_dict()
    return result


async def measure_status_and_cleanup(dsn: str, rows: int) -> dict[str, Any]:
    """Build an outbox of `rows` rows in the database `dsn` (its outbox must be empty), then time
    `serversync status` (the median of 5) and `serversync cleanup --older-than 30d` (a dry run,
    then the real one: total seconds and the slowest delete statement).

    Returns {"rows", "outbox": what was built, "status": {"report_ms", "report_json_ms",
    "first_report_ms", "first_outbox_stats_ms", "queries_ms": {query: ms}}, "cleanup":
    {"dry_run_seconds", "dry_run_report", "seconds", "batches", "batch_median_ms",
    "batch_p95_ms", "batch_slowest_ms", "delete_statements", "delete_statement_slowest_ms",
    "report"}, "status_after_cleanup": as "status"}.
    """
    progress(f"outbox scale: building {rows:,} rows")
    built = await build_outbox(dsn, rows)
    progress("outbox scale: status")
    status_ms = await measure_status(dsn)
    progress("outbox scale: cleanup")
    cleanup = await measure_cleanup(dsn)
    progress("outbox scale: status after the cleanup")
    after = await measure_status(dsn)
    return {
        "rows": rows,
        "outbox": built,
        "status": status_ms,
        "cleanup": cleanup,
        "status_after_cleanup": after,
    }


DATABASE = "serversync_scale_bench"


def _sizes(value: str) -> tuple[int, ...]:
    """'100k,1m,10m' -> (100000, 1000000, 10000000)."""
    sizes = []
    for part in value.split(","):
        text = part.strip().lower().replace("_", "")
        unit = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
        try:
            number = int(text[:-1] if unit != 1 else text) * unit
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of sizes: {value!r}") from None
        if number < 1:
            raise argparse.ArgumentTypeError(f"sizes must be positive: {value!r}")
        sizes.append(number)
    return tuple(sizes)


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"name": args.name, "machine": machine(), "points": []}
    with bench_server(args.private) as server:
        version = await execute(server.dsn, "SHOW server_version")
        result["machine"]["postgres"] = version[0][0]
        for rows in args.rows:
            dsn = await fresh_database(server.dsn, DATABASE, ["backend"])
            try:
                result["points"].append(await measure_status_and_cleanup(dsn, rows))
            finally:
                await execute(
                    server.dsn,
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(DATABASE)
                    ),
                )
    return result


def main() -> int:
    """Measure each size and write the JSON."""
    today = datetime.now(UTC).strftime("%Y%m%d")
    parser = argparse.ArgumentParser(prog="python -m bench.outbox_scale", description=__doc__)
    parser.add_argument("--rows", type=_sizes, default=(100_000, 1_000_000, 10_000_000))
    parser.add_argument("--private", action="store_true", help="on a private throwaway cluster")
    parser.add_argument("--name", default=f"scale-status-cleanup-{today}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    result = asyncio.run(_run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
    for point in result["points"]:
        status_ms, cleanup = point["status"], point["cleanup"]
        print(
            f"{point['rows']:>12,} rows: status {status_ms['report_ms']} ms; cleanup dry run "
            f"{cleanup['dry_run_seconds']} s, real {cleanup['seconds']} s, batches median "
            f"{cleanup.get('batch_median_ms')} ms, slowest {cleanup.get('batch_slowest_ms')} ms"
        )
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
