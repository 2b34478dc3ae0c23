"""Producer cost: what tracking a table costs its writers, measured with pgbench.

Single-row insert/update transactions from 8 concurrent connections into an untracked table and
into the same table tracked by the relay, with wake-ups off, with a NOTIFY in every transaction
(the naive relay), and with serversync's default wake-up policy while a consumer runs (with its
read pacing on, as by default, and off). The in-database reference is the same table with the
least an outbox row trigger can be (its row's JSON into a table with a serial key):
`tracked_to_minimal_trigger` is what serversync's relay costs beyond it. The `bulk_` modes
repeat the untracked, tracked and minimal-trigger runs with transactions of one 100-row
statement, where the relay's once-per-statement trigger and a row trigger part ways.

PgQ, the in-database queue of Skytools' replication, is measured in the same interleaved runs
where the server has its extension (Debian: postgresql-15-pgq3): its C row trigger
`pgq.logutriga` on the same table shape, with its ticker running (bench/pgq.py) and no consumer,
and with a consumer of its batches as well, in single-row and 100-row transactions.
`relay_to_pgq` is the relay's tps over PgQ's in each of those four settings, the relay with no
consumer (`tracked_no_notify`) and with serversync's consumer at its defaults
(`tracked_wakeups_on`), and in a fifth, single-row, with serversync's consumer reading as often
as PgQ's (`tracked_wakeups_on_pgq_cadence`: pacing at PgQ's tick, where the default paces at
20 ms for a fifth of the latency under load). On a server without the extension the PgQ modes
are left out and the result says why (`pgq.note`).

A saturated machine's tps moves from run to run by as much as these settings differ. The `steady_`
modes run the single-row settings again at one steady rate (pgbench -R at half the untracked
tps of the same run), where every mode does the same transactions and the machine's CPU per
transaction says what each costs: `steady.relay_to_pgq_cpu` is the relay's over PgQ's, with no
consumer, with each one's consumer, and with serversync's at PgQ's cadence.

The bench's private cluster runs with fsync and synchronous_commit off, so every transaction is
pure CPU and the trigger's share of it is as large as it can be. On a private cluster the
untracked and the wake-ups-on runs are repeated with PostgreSQL's durable defaults (fsync,
full_page_writes, synchronous_commit on), as a production server runs.

Every run also reports the machine's CPU per transaction (`cpu_us_per_tx`): pgbench's, the
consumer's, and the rest, which is PostgreSQL's; the machine is CPU-bound in these runs, so that
figure says where each mode's transactions went. On a server on this machine PostgreSQL's part is
also split, over a window inside the run, into the producers' backends, the consumer's sessions
(serversync's consumer, or PgQ's ticker and consumer) and the server's own processes: whether a
consumer makes the producers' own statements dearer, or costs the server in its own sessions.

Before the pgbench runs, `relay_cost_per_row` times single-row statements on one connection to
the server, untracked, tracked and under the minimal trigger, all in one transaction and each
in its own: the relay's own cost per changed row, without pgbench's run-to-run noise.
"""

from __future__ import annotations

import asyncio
import re
import resource
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg
from psycopg import conninfo, sql

from bench import pgq
from bench.harness import (
    BenchEnv,
    Service,
    cpu_meter,
    execute,
    machine_cpu,
    outbox_end,
    process_cpu_seconds,
    progress,
    server_is_local,
    start_service,
    wait_for,
)
from consumer.core.events import Position
from consumer.devtools.devdb import find_bindir

SEED_ROWS = 10_000
INSERT_SCRIPT = (
    "INSERT INTO {table} (id, v, note) VALUES (nextval('{table}_ids'), 1, repeat('x', 200));\n"
)
UPDATE_SCRIPT = "\\set id random(1, {seed_rows})\nUPDATE {table} SET v = v + 1 WHERE id = :id;\n"
# Multi-row statements: `rows` new rows, or `rows` neighbouring seed rows of a range each client
# has to itself (no client waits on another's row locks, which would measure lock waits rather
# than what the relay costs).
BULK_INSERT_SCRIPT = (
    "INSERT INTO {table} (id, v, note)"
    " SELECT nextval('{table}_ids'), 1, repeat('x', 200) FROM generate_series(1, {rows});\n"
)
BULK_UPDATE_SCRIPT = (
    "\\set id 1 + :client_id * {span} + random(0, {span} - {rows})\n"
    "UPDATE {table} SET v = v + 1 WHERE id BETWEEN :id AND :id + {rows} - 1;\n"
)


def pgbench_path() -> str:
    """pgbench from the PostgreSQL binaries."""
    bindir = find_bindir()
    if bindir is not None and (bindir / "pgbench").is_file():
        return str(bindir / "pgbench")
    found = shutil.which("pgbench")
    if not found:
        raise RuntimeError("pgbench not found: install the PostgreSQL client binaries")
    return found


# The in-database reference for producers: the least an outbox row trigger can be, the kind of
# trigger the "outbox row trigger" reference figure describes (a row's JSON into a table with a
# serial key, nothing else). The relay's cost beyond it is what serversync's outbox row
# (position, entity, wake-up) adds.
MINIMAL_TRIGGER = [
    "DROP TABLE IF EXISTS bench_minimal_outbox",
    "CREATE TABLE bench_minimal_outbox (id bigserial PRIMARY KEY, payload json NOT NULL)",
    """CREATE OR REPLACE FUNCTION bench_minimal_relay() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO bench_minimal_outbox (payload) VALUES (row_to_json(NEW));
        RETURN NULL;
    END;
    $$""",
    "CREATE TRIGGER bench_minimal_relay AFTER INSERT OR UPDATE ON bench_minimal"
    " FOR EACH ROW EXECUTE FUNCTION bench_minimal_relay()",
]


PGQ_TABLE = "bench_pgq"


async def prepare_tables(backend: str) -> str | None:
    """The bench's tables in the `backend` database, seeded alike: untracked, tracked by the
    relay, under the minimal trigger, and under PgQ's trigger where the server has PgQ; returns
    why PgQ is not measured (None when it is)."""
    pgq_missing = await pgq.unavailable(backend)
    tables = ["bench_plain", "bench_tracked", "bench_minimal"]
    if pgq_missing is None:
        tables.append(PGQ_TABLE)
    for table in tables:
        name, ids = sql.Identifier(table), sql.Identifier(f"{table}_ids")
        for statement in (
            sql.SQL("DROP TABLE IF EXISTS {}").format(name),
            sql.SQL("DROP SEQUENCE IF EXISTS {}").format(ids),
            sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, v int NOT NULL, note text)").format(
                name
            ),
            sql.SQL("CREATE SEQUENCE {} START {}").format(ids, SEED_ROWS + 1),
            sql.SQL("INSERT INTO {} SELECT g, 0, 'seed' FROM generate_series(1, {}) g").format(
                name, SEED_ROWS
            ),
        ):
            await execute(backend, statement)
    await execute(backend, "SELECT sync.track('public.bench_tracked', 'bench_item')")
    for ddl in MINIMAL_TRIGGER:
        await execute(backend, ddl)
    if pgq_missing is None:
        await pgq.create_queue(backend, PGQ_TABLE)
    return pgq_missing


def _pgbench(env: BenchEnv, mode: Mode, seconds: int, clients: int) -> tuple[float, int]:
    """tps and the number of transactions of one pgbench run: half inserts, half updates."""
    params = conninfo.conninfo_to_dict(env.backend)
    folder: Path = env.workdir
    table = mode.table
    insert, update = (
        folder / f"insert_{table}_{mode.rows}.sql",
        folder / f"update_{table}_{mode.rows}.sql",
    )
    if mode.rows == 1:
        insert.write_text(INSERT_SCRIPT.format(table=table))
        update.write_text(UPDATE_SCRIPT.format(table=table, seed_rows=SEED_ROWS))
    else:
        span = SEED_ROWS // clients
        if span < mode.rows:
            raise ValueError(
                f"{clients} clients leave {span} seed rows each, fewer than {mode.rows}"
            )
        insert.write_text(BULK_INSERT_SCRIPT.format(table=table, rows=mode.rows))
        update.write_text(BULK_UPDATE_SCRIPT.format(table=table, rows=mode.rows, span=span))
    command = [
        pgbench_path(),
        "-n",
        "-T",
        str(seconds),
        "-c",
        str(clients),
        "-j",
        "2",
        *(["-R", str(mode.rate)] if mode.rate else []),
        "-f",
        f"{insert}@1",
        "-f",
        f"{update}@1",
        "-h",
        str(params.get("host", "127.0.0.1")),
        "-p",
        str(params.get("port", 5432)),
        "-U",
        str(params.get("user", "postgres")),
        str(params["dbname"]),
    ]
    result = subprocess.run(
        command,
        capture_output=True,
        text=True,
        check=False,
        env={
            "PGOPTIONS": f"-c sync.notify={mode.notify}",
            "PATH": "/usr/bin:/bin",
            **({"PGPASSWORD": str(params["password"])} if "password" in params else {}),
        },
    )
    tps = re.search(r"tps = ([0-9.]+)", result.stdout)
    done = re.search(r"number of transactions actually processed: ([0-9]+)", result.stdout)
    if result.returncode != 0 or not tps or not done:
        raise RuntimeError(f"pgbench failed: {result.stderr.strip() or result.stdout.strip()}")
    return float(tps.group(1)), int(done.group(1))


def _durable(env: BenchEnv, on: bool) -> None:
    """Restart the private cluster with PostgreSQL's crash-safe defaults, or without them
    (fsync and friends are set on its command line, which no reload can override)."""
    cluster = env.server.cluster
    assert cluster is not None
    cluster.durable = on
    cluster.restart()


@dataclass(frozen=True)
class Mode:
    """One producer run: which table, the sync.notify setting, and the consumer beside it."""

    name: str
    table: str
    notify: str
    # None: no consumer runs; else the consumer's extra environment.
    consumer: dict[str, str] | None = None
    durable: bool = False
    # Rows each statement changes (one statement per transaction).
    rows: int = 1
    # A PgQ mode: None, or what runs beside pgbench: PgQ's ticker alone ("ticker"), or the
    # ticker and a consumer of the queue's batches ("consumer").
    pgq: str | None = None
    # None: as fast as the connections go; else pgbench's -R, transactions per second in all.
    rate: int | None = None


PACING_OFF = {"SYNC_BATCH_WAIT_MS": "0"}
# Pacing at PgQ's tick, and batches as large as a tick's events at any rate pgbench reaches here
# (PgQ's batches have no cap but the tick).
PGQ_CADENCE = {
    "SYNC_BATCH_WAIT_MS": str(round(pgq.TICK_EVERY_SEC * 1000)),
    "SYNC_BATCH_SIZE": "50000",
}
MODES = [
    Mode("untracked", "bench_plain", "auto"),
    Mode("tracked_no_notify", "bench_tracked", "off"),
    Mode("minimal_trigger", "bench_minimal", "off"),
    Mode("pgq_trigger", PGQ_TABLE, "off", pgq="ticker"),
    Mode("tracked_wakeups_on", "bench_tracked", "auto", {}),
    # A consumer that keeps up just as closely without any NOTIFY (no LISTEN, polling every 5 ms):
    # what the consumer's own reads cost producers, with no wake-up machinery at all.
    Mode(
        "tracked_consumer_running_no_notify",
        "bench_tracked",
        "off",
        {"SYNC_LISTEN": "false", "SYNC_POLL_INTERVAL_SEC": "0.005"},
    ),
    # The consumer reading as soon as it has settled a batch, however fast events arrive.
    Mode("tracked_wakeups_on_unpaced", "bench_tracked", "auto", PACING_OFF),
    # The consumer reading as often as PgQ's consumer gets a batch: once a tick under load, a
    # tick's events a batch. By default it reads every 20 ms under load (SYNC_BATCH_WAIT_MS),
    # for a fifth of the latency at about four times the reads.
    Mode("tracked_wakeups_on_pgq_cadence", "bench_tracked", "auto", PGQ_CADENCE),
    Mode("pgq_consumer_running", PGQ_TABLE, "off", pgq="consumer"),
    # Last in its round, so that no measured mode runs in the wake of its notification flood.
    Mode("tracked_notify_every_tx", "bench_tracked", "always", {}),
]
BULK_ROWS = 100
# Transactions of one 100-row statement: what the relay costs bulk writers, against the same
# statements untracked and under the row triggers (one trigger call per row), PgQ's with and
# without its consumer beside the relay with and without serversync's.
BULK_MODES = [
    Mode("bulk_untracked", "bench_plain", "auto", rows=BULK_ROWS),
    Mode("bulk_tracked_no_notify", "bench_tracked", "off", rows=BULK_ROWS),
    Mode("bulk_minimal_trigger", "bench_minimal", "off", rows=BULK_ROWS),
    Mode("bulk_pgq_trigger", PGQ_TABLE, "off", rows=BULK_ROWS, pgq="ticker"),
    Mode("bulk_tracked_wakeups_on", "bench_tracked", "auto", {}, rows=BULK_ROWS),
    Mode("bulk_pgq_consumer_running", PGQ_TABLE, "off", rows=BULK_ROWS, pgq="consumer"),
]
# The relay against PgQ, each setting a pair of modes of the same run: (relay, PgQ).
RELAY_VS_PGQ = {
    "single_row": ("tracked_no_notify", "pgq_trigger"),
    "single_row_consumer_running": ("tracked_wakeups_on", "pgq_consumer_running"),
    # Each consumer reading as often as the other: what is left once the cadence is the same.
    "single_row_consumer_same_cadence": ("tracked_wakeups_on_pgq_cadence", "pgq_consumer_running"),
    "bulk": ("bulk_tracked_no_notify", "bulk_pgq_trigger"),
    "bulk_consumer_running": ("bulk_tracked_wakeups_on", "bulk_pgq_consumer_running"),
}
# The same comparisons at a steady rate below what the machine can do (pgbench -R): every mode then
# runs the same transactions, so the machine's CPU per transaction says what each one costs, where
# the tps of a saturated machine moves with the run's noise as much as with the cost. The rate is
# STEADY_SHARE of the untracked table's tps in the same run.
STEADY_SHARE = 0.5
STEADY_MODES = [
    Mode("steady_tracked_no_notify", "bench_tracked", "off"),
    Mode("steady_tracked_wakeups_on", "bench_tracked", "auto", {}),
    Mode("steady_tracked_wakeups_on_pgq_cadence", "bench_tracked", "auto", PGQ_CADENCE),
    Mode("steady_pgq_trigger", PGQ_TABLE, "off", pgq="ticker"),
    Mode("steady_pgq_consumer_running", PGQ_TABLE, "off", pgq="consumer"),
]
# The relay's machine CPU per transaction over PgQ's at the steady rate, each setting a pair of
# steady modes (relay, PgQ): below 1.0 the relay costs the machine less.
RELAY_VS_PGQ_STEADY = {
    "single_row": ("steady_tracked_no_notify", "steady_pgq_trigger"),
    "single_row_consumer_running": ("steady_tracked_wakeups_on", "steady_pgq_consumer_running"),
    "single_row_consumer_same_cadence": (
        "steady_tracked_wakeups_on_pgq_cadence",
        "steady_pgq_consumer_running",
    ),
}
DURABLE_MODES = [
    Mode("durable_untracked", "bench_plain", "auto", durable=True),
    Mode("durable_tracked_wakeups_on", "bench_tracked", "auto", {}, durable=True),
]


async def _caught_up(env: BenchEnv, consumer: Service) -> None:
    """Wait until the consumer has delivered what the modes before left in the outbox: a
    backlog drained while pgbench runs would be charged to this mode's producers."""
    end = await outbox_end(env.backend)

    async def there() -> bool:
        rows = await execute(
            env.backend,
            "SELECT last_txid::text, last_seq FROM sync.consumer_offsets"
            " WHERE consumer = 'frontend-sync'",
        )
        return bool(rows) and Position(int(rows[0][0]), rows[0][1]) >= end

    await wait_for(
        there,
        timeout=300,
        what=f"the consumer to catch up (see {consumer.log})",
        every=0.05,
        watching=[consumer],
    )


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's children that have ended (pgbench, once it returns)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# PostgreSQL's CPU by whose work it does, measured inside a run while pgbench's sessions live:
# pgbench's backends (the producers: their statements and the trigger each fires), the
# sessions of serversync's consumer or of PgQ's ticker and consumer (reads, ticks and offset
# commits), and the server's own processes (WAL writer, checkpointer, autovacuum).
SESSION_PARTS = ("postgres_producers", "postgres_consumer", "postgres_background")
# The window leaves pgbench this long at its end (its sessions end there), and is measured only
# when it lasts at least SESSION_MIN_WINDOW_SEC (CPU times come in 10 ms ticks per process).
SESSION_MARGIN_SEC = 0.5
SESSION_MONITOR = "serversync-bench-producer"
SESSION_MIN_WINDOW_SEC = 1.0


async def _sessions_split(
    env: BenchEnv, mode: Mode, clients: int, *, ends: float, run: asyncio.Task[Any]
) -> dict[str, float]:
    """CPU microseconds per transaction of each of SESSION_PARTS over a window inside a pgbench
    run; empty for a server on another machine, whose processes this one cannot read, and for a
    window that could not be measured whole (pgbench connecting too late, or ending inside it).

    The window opens once all of pgbench's sessions are connected and closes before pgbench
    ends them. Its transactions are counted by the table's id sequence, which only the inserts
    take from (`rows` ids each): half the transactions are inserts (pgbench draws each script
    with weight 1), so their number is twice the inserts' (the draw's spread: about 1 % at the
    10,000 transactions of a bulk mode's window, less for single rows)."""
    if not server_is_local(env.backend):
        return {}
    # This connection's own queries are the bench's, neither the producers' nor the consumer's.
    monitor = await psycopg.AsyncConnection.connect(
        env.backend, autocommit=True, application_name=SESSION_MONITOR
    )
    parts = {"pgbench": "producers", SESSION_MONITOR: "bench"}
    async with monitor, cpu_meter(env, {}, applications=parts) as meter:

        async def connected() -> bool:
            if run.done():
                run.result()  # pgbench failed: raise its error, not a timeout
                return True  # it ended before all its sessions were seen: no window
            cur = await monitor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgbench'"
                " AND datname = current_database()"
            )
            row = await cur.fetchone()
            return row is not None and row[0] >= clients

        await wait_for(connected, timeout=30, what="pgbench's sessions")
        closes = ends - SESSION_MARGIN_SEC
        if run.done() or closes - time.monotonic() < SESSION_MIN_WINDOW_SEC:
            return {}
        ids = sql.SQL("SELECT last_value FROM {}").format(sql.Identifier(f"{mode.table}_ids"))

        async def inserted() -> int:
            return int((await (await monitor.execute(ids)).fetchone() or (0,))[0])

        first = await inserted()
        await meter.mark()
        await asyncio.sleep(max(0.0, closes - time.monotonic()))
        transactions = 2 * (await inserted() - first) / mode.rows
        figures = await meter.per_event(round(transactions))
    if run.done():
        # pgbench ended inside the window: its sessions' CPU went with them.
        return {}
    # The consumer's (or PgQ's) sessions are the backend database's other client sessions;
    # another database's sessions are not this run's.
    names = {
        "postgres_producers": "postgres producers",
        "postgres_consumer": "postgres backend",
        "postgres_background": "postgres background",
    }
    return {part: figures.get(name, 0.0) for part, name in names.items()}


async def run_mode(
    env: BenchEnv, mode: Mode, seconds: int, clients: int, round_: int
) -> tuple[float, dict[str, float]]:
    """tps of one run of `mode`, and the machine's CPU microseconds per transaction: PostgreSQL
    (with whatever else ran), pgbench, the consumer, their total, and the hypervisor's steal;
    and PostgreSQL's split by sessions over a window inside the run (SESSION_PARTS)."""
    consumer = None
    # PgQ's ticker, and its consumer in a "consumer" mode, as one process.
    pgq_part = {"ticker": "pgq_ticker", "consumer": "pgq_consumer"}.get(mode.pgq or "")
    if pgq_part is not None:
        consumer = pgq.start(
            env.backend,
            env.workdir / f"pgq-producer-{mode.name}-{round_}.log",
            consume=mode.pgq == "consumer",
        )
        await pgq.started(env.backend, consumer, consume=mode.pgq == "consumer")
        if mode.pgq == "consumer":
            await pgq.caught_up(env.backend, consumer)
    elif mode.consumer is not None:
        consumer = start_service(
            ["run", "frontend-sync", "--sink", "null"],
            {
                "DATABASE_URL": env.backend,
                "SYNC_BATCH_SIZE": "1000",
                "SYNC_LOG_LEVEL": "WARNING",
                # The bench's tables were seeded before they were tracked, so a consumer's first
                # start with the default `auto` would write a snapshot of them beside the live
                # stream, inside the first measured run: that is the snapshot bench's figure,
                # not the producers'. PgQ's consumer starts from its queue's events alone too.
                "SYNC_START": "earliest",
                **mode.consumer,
            },
            env.workdir / f"consumer-producer-{mode.name}-{round_}.log",
        )
        await _caught_up(env, consumer)
    try:
        progress(f"  producer: {mode.name} for {seconds}s at {clients} connections")
        # pgbench ends its backends as it exits, so their CPU cannot be read per process
        # afterwards: the machine's busy time is, less pgbench and the consumer, PostgreSQL's
        # (the bench itself only samples the sessions twice meanwhile).
        machine_before = machine_cpu()
        pgbench_before = _children_cpu_seconds()
        consumer_before = process_cpu_seconds(consumer.pid) if consumer is not None else None
        started = time.monotonic()
        run = asyncio.create_task(asyncio.to_thread(_pgbench, env, mode, seconds, clients))
        try:
            sessions = await _sessions_split(env, mode, clients, ends=started + seconds, run=run)
        except BaseException:
            # pgbench's own end first: its error says more, and nothing may outlive the mode.
            await asyncio.wait({run})
            failed = None if run.cancelled() else run.exception()
            if failed is not None:
                raise failed from None
            raise
        tps, transactions = await run
        if pgq_part is not None and consumer is not None:
            consumer.check_alive()  # a ticker or consumer that failed midway voids the figure
        machine_after = machine_cpu()
        busy = machine_after[0] - machine_before[0]
        pgbench_used = _children_cpu_seconds() - pgbench_before
        used = {"postgres": busy - pgbench_used, "pgbench": pgbench_used}
        if consumer is not None and consumer_before is not None:
            part = pgq_part or "consumer"
            used[part] = (process_cpu_seconds(consumer.pid) or 0.0) - consumer_before
            used["postgres"] -= used[part]
        used["total"] = busy
        used["steal"] = machine_after[1] - machine_before[1]
        cpu = {part: seconds_ * 1e6 / transactions for part, seconds_ in used.items()}
        cpu.update(sessions)
        progress(
            f"    {tps:,.0f} tps; CPU us per transaction: "
            + ", ".join(f"{part} {us:.1f}" for part, us in cpu.items())
        )
        return tps, cpu
    finally:
        if consumer is not None:
            consumer.stop()
        await execute(env.backend, "VACUUM ANALYZE")


# One connection writes single-row statements in a server-side loop, so the figure is the server's
# own cost per statement: no client, no round trip, no other connection to share the CPU with.
# The tracked minus the untracked figure is what the relay adds to each changed row. The loop
# runs twice: all in one transaction, and committing after every statement as a producer's
# single-statement transactions do (PL/pgSQL sets up each expression a trigger evaluates once
# per transaction, so the relay costs more there). The statements are static (planned once, as
# a producer's prepared statements would be).
TIMED_WRITES = """
CREATE OR REPLACE PROCEDURE {procedure}(kind text, n int, commit_each boolean, INOUT us float8)
LANGUAGE plpgsql AS $$
DECLARE
    started timestamptz := clock_timestamp();
BEGIN
    IF kind = 'insert' THEN
        FOR i IN 1..n LOOP
            INSERT INTO {table} (id, v, note) VALUES (nextval({ids}), 1, repeat('x', 200));
            IF commit_each THEN
                COMMIT;
            END IF;
        END LOOP;
    ELSE
        FOR i IN 1..n LOOP
            UPDATE {table} SET v = v + 1 WHERE id = i % 10000 + 1;
            IF commit_each THEN
                COMMIT;
            END IF;
        END LOOP;
    END IF;
    us := extract(epoch FROM clock_timestamp() - started) * 1e6 / n;
END;
$$
"""
# The single-row statements both relay cost measurements time, and their tables.
KINDS = ("insert", "update")
RELAY_COST_TABLES = {
    "untracked": "bench_plain",
    "tracked": "bench_tracked",
    "minimal": "bench_minimal",
}


async def relay_cost_per_row(env: BenchEnv, *, statements: int, rounds: int) -> dict[str, Any]:
    """Server time per single-row INSERT and UPDATE statement, untracked, tracked (wake-up
    check on, nobody waiting) and under the minimal trigger, all in one transaction and each in
    its own; medians of `rounds` alternating runs; and what the relay and the minimal trigger
    add to each changed row."""
    for table in RELAY_COST_TABLES.values():
        await execute(
            env.backend,
            sql.SQL(TIMED_WRITES).format(
                procedure=sql.Identifier(f"time_writes_{table}"),
                table=sql.Identifier(table),
                ids=sql.Literal(f"{table}_ids"),
            ),
        )
    runs: dict[str, dict[str, list[float]]] = {"one_transaction": {}, "own_transactions": {}}
    for round_ in range(rounds):
        progress(f"producer: relay cost per row, round {round_ + 1}/{rounds}")
        for commit_each, timings in ((False, "one_transaction"), (True, "own_transactions")):
            for kind in KINDS:
                for which, table in RELAY_COST_TABLES.items():
                    rows = await execute(
                        env.backend,
                        sql.SQL("CALL {}(%s, %s, %s, NULL)").format(
                            sql.Identifier(f"time_writes_{table}")
                        ),
                        (kind, statements, commit_each),
                    )
                    runs[timings].setdefault(f"{kind}_{which}", []).append(
                        round(float(rows[0][0]), 2)
                    )

    def added(us: dict[str, float], which: str) -> dict[str, float]:
        return {kind: round(us[f"{kind}_{which}"] - us[f"{kind}_untracked"], 2) for kind in KINDS}

    result: dict[str, Any] = {"statements": statements, "rounds": rounds}
    for timings, per_name in runs.items():
        us = {name: statistics.median(values) for name, values in per_name.items()}
        result[timings] = {
            "us_per_statement": {k: round(v, 2) for k, v in us.items()},
            "us_per_statement_runs": per_name,
            "relay_us_per_row": added(us, "tracked"),
            "minimal_trigger_us_per_row": added(us, "minimal"),
        }
    return result


async def run_producer(
    env: BenchEnv, *, seconds: int, clients: int = 8, rounds: int = 3, statements: int = 20_000
) -> dict[str, Any]:
    """tps of each mode and the ratios to the untracked table (and, on a private cluster, the
    same ratio with durable settings).

    Single runs on this machine vary by up to 45 % from one to the next, so the modes run in
    `rounds` interleaved rounds (every mode once per round) and each figure is the median of its
    runs; the runs themselves are kept in the result.
    """
    pgq_missing = await prepare_tables(env.backend)
    if pgq_missing is not None:
        progress(f"producer: PgQ not measured: {pgq_missing}")
    per_row = await relay_cost_per_row(env, statements=statements, rounds=max(rounds, 3))
    runs: dict[str, list[float]] = {}
    cpu_runs: dict[str, list[dict[str, float]]] = {}
    blocks = [MODES, BULK_MODES, STEADY_MODES]
    if env.server.cluster is not None:
        blocks.append(DURABLE_MODES)
    steady_rate = 0
    for block in blocks:
        if block[0].durable:
            _durable(env, True)
        modes = block
        if block is STEADY_MODES:
            untracked = statistics.median(runs["untracked"])
            steady_rate = max(100, round(STEADY_SHARE * untracked / 100) * 100)
            modes = [replace(mode, rate=steady_rate) for mode in block]
        for round_ in range(rounds):
            progress(f"producer: round {round_ + 1}/{rounds}")
            for mode in modes:
                if mode.pgq is not None and pgq_missing is not None:
                    continue
                tps, cpu = await run_mode(env, mode, seconds, clients, round_)
                runs.setdefault(mode.name, []).append(round(tps, 1))
                cpu_runs.setdefault(mode.name, []).append(cpu)
        if block[0].durable:
            _durable(env, False)
    # A snapshot written beside the live stream would have been charged to the producers.
    snapshots = (await execute(env.backend, "SELECT count(*) FROM sync.snapshots"))[0][0]
    if snapshots:
        raise RuntimeError(f"{snapshots} snapshot(s) were written during the producer runs")
    figures = {name: statistics.median(values) for name, values in runs.items()}
    cpu_us_per_tx = {
        name: {
            part: round(statistics.median(run[part] for run in cpus), 1)
            for part in cpus[0]
            if all(part in run for run in cpus)
        }
        for name, cpus in cpu_runs.items()
    }
    steady_names = {mode.name for mode in STEADY_MODES}

    def base(mode: str) -> float:
        for block in ("durable_", "bulk_"):
            if mode.startswith(block):
                return figures[f"{block}untracked"]
        return figures["untracked"]

    return {
        "clients": clients,
        "seconds": seconds,
        "rounds": rounds,
        "tps": {k: round(v, 1) for k, v in figures.items()},
        "tps_runs": runs,
        "ratio_to_untracked": {
            k: round(v / base(k), 3) for k, v in figures.items() if k not in steady_names
        },
        # The relay against the least an outbox row trigger can be, neither with a consumer.
        "tracked_to_minimal_trigger": round(
            figures["tracked_no_notify"] / figures["minimal_trigger"], 3
        ),
        "bulk_rows_per_statement": BULK_ROWS,
        "bulk_tracked_to_minimal_trigger": round(
            figures["bulk_tracked_no_notify"] / figures["bulk_minimal_trigger"], 3
        ),
        # Medians over the rounds, part by part: where each mode's CPU per transaction goes.
        # PostgreSQL's split by sessions only where every round measured it (a run too short
        # for its window has none).
        "cpu_us_per_tx": cpu_us_per_tx,
        "relay_cost": per_row,
        "pgq": {
            "measured": pgq_missing is None,
            "note": pgq_missing,
            "tick_every_sec": pgq.TICK_EVERY_SEC,
        },
        # The relay's tps over PgQ's in each setting (absent when PgQ was not measured).
        "relay_to_pgq": {
            setting: round(figures[relay] / figures[queue], 3)
            for setting, (relay, queue) in RELAY_VS_PGQ.items()
            if queue in figures
        },
        # The steady modes ran at this rate (their tps is what pgbench reached); the relay's
        # machine CPU per transaction over PgQ's in each setting.
        "steady": {
            "rate_tps": steady_rate,
            "share_of_untracked": STEADY_SHARE,
            "relay_to_pgq_cpu": {
                setting: round(cpu_us_per_tx[relay]["total"] / cpu_us_per_tx[queue]["total"], 3)
                for setting, (relay, queue) in RELAY_VS_PGQ_STEADY.items()
                if queue in cpu_us_per_tx
            },
        },
    }
