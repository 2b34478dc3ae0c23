"""Instructions the relay adds to a producer's statement, counted with callgrind.

pgbench's tps on this machine vary by up to 45 % from one run to the next, too much to see a
change of a few percent in the relay. An instruction count repeats to about 0.1 %: a
single-user PostgreSQL backend (`postgres --single`) runs the statements under valgrind's
callgrind, on a fresh copy of one stopped cluster for every count, each statement its own
transaction as a producer's single-row transactions are. Every figure is a marginal count per
statement: the difference between a long and a short run over the difference in statements,
which leaves out the backend's start and end.

The tables are the producer bench's (bench/producer.py): untracked, tracked by the relay (the
wake-up check on, no consumer waiting) and under the minimal trigger; what the relay and the
minimal trigger add is their count less the untracked one. Where the server has PgQ, its C row
trigger (`pgq.logutriga`, bench/pgq.py) is counted the same way, apart (`pgq`), with the relay's
count over its own. Instructions are not time: under
load, on two shared cores, each of them costs more than in this single backend alone.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from psycopg import sql

from bench import producer
from bench.harness import BACKEND_DB, progress
from consumer.devtools.devdb import (
    PrivateCluster,
    as_server_user,
    fresh_database,
    start_private_cluster,
)

# Statements in the short and the long run of each count.
RUNS = (300, 1300)
QUICK_RUNS = (20, 120)


class NoValgrindError(Exception):
    """valgrind is not installed."""


def _statements(kind: str, table: str, count: int) -> str:
    """`count` single-row statements, a line each (the single-user backend's statement end)."""
    if kind == "insert":
        insert = sql.SQL(
            "INSERT INTO {} (id, v, note) VALUES (nextval({}), 1, repeat('x', 200));\n"
        ).format(sql.Identifier(table), sql.Literal(f"{table}_ids"))
        return count * insert.as_string(None)
    # Rows spread over the seed rows, the same ones in every table.
    update = sql.SQL("UPDATE {} SET v = v + 1 WHERE id = {};\n")
    return "".join(
        update.format(sql.Identifier(table), i * 37 % producer.SEED_ROWS + 1).as_string(None)
        for i in range(count)
    )


def _count(cluster: PrivateCluster, valgrind: str, name: str, script: str) -> int:
    """Instructions of one single-user backend running `script` on a copy of the cluster."""
    copy, out = cluster.root / f"copy-{name}", cluster.root / f"callgrind-{name}.out"
    statements = cluster.root / f"{name}.sql"
    statements.write_text(script)
    # cp -a keeps the files' owner, which postgres checks.
    subprocess.run(["cp", "-a", str(cluster.datadir), str(copy)], check=True)
    try:
        with statements.open("rb") as stdin:
            result = subprocess.run(
                as_server_user(
                    [
                        valgrind,
                        "--tool=callgrind",
                        f"--callgrind-out-file={out}",
                        str(cluster.bindir / "postgres"),
                        "--single",
                        "-D",
                        str(copy),
                        *("-c", "fsync=off", "-c", "synchronous_commit=off"),
                        *("-c", "full_page_writes=off", "-c", "autovacuum=off"),
                        BACKEND_DB,
                    ]
                ),
                stdin=stdin,
                capture_output=True,
                text=True,
                check=False,
            )
        if result.returncode != 0 or "ERROR:" in result.stdout + result.stderr:
            raise RuntimeError(f"single-user backend failed on {name}: {result.stderr[-500:]}")
        for line in out.read_text().splitlines():
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
        raise RuntimeError(f"{out}: no instruction total")
    finally:
        shutil.rmtree(copy, ignore_errors=True)
        out.unlink(missing_ok=True)
        statements.unlink(missing_ok=True)


async def _template() -> tuple[PrivateCluster, str | None]:
    """A stopped private cluster with the backend migrated and the producer bench's tables; and
    why PgQ's table is not among them (None when it is)."""
    cluster = start_private_cluster()
    try:
        backend = await fresh_database(cluster.dsn, BACKEND_DB, ["backend"])
        pgq_missing = await producer.prepare_tables(backend)
        cluster.stop("fast")
    except BaseException:
        cluster.destroy()
        raise
    return cluster, pgq_missing


def run_instructions(*, quick: bool = False) -> dict[str, Any]:
    """Thousands of instructions per single-row statement, per table and kind, and what the
    relay and the minimal trigger add to each (`quick`: short runs, a smoke check)."""
    short, long = QUICK_RUNS if quick else RUNS
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        raise NoValgrindError("valgrind is not installed (Debian: apt-get install valgrind)")
    cluster, pgq_missing = asyncio.run(_template())
    tables = dict(producer.RELAY_COST_TABLES)
    if pgq_missing is None:
        tables["pgq"] = producer.PGQ_TABLE
    try:
        jobs = {
            (kind, which, count): _statements(kind, table, count)
            for kind in producer.KINDS
            for which, table in tables.items()
            for count in (short, long)
        }
        progress(f"instructions: {len(jobs)} single-user runs under callgrind")
        with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
            totals = dict(
                zip(
                    jobs,
                    pool.map(
                        lambda job: _count(cluster, valgrind, "-".join(map(str, job[0])), job[1]),
                        jobs.items(),
                    ),
                    strict=True,
                )
            )
    finally:
        cluster.destroy()
    per_statement = {
        f"{kind}_{which}": round(
            (totals[kind, which, long] - totals[kind, which, short]) / (long - short) / 1000, 1
        )
        for kind in producer.KINDS
        for which in tables
    }
    pgq_counts = {kind: per_statement.pop(f"{kind}_pgq", None) for kind in producer.KINDS}

    def added(which: str) -> dict[str, float]:
        return {
            kind: round(per_statement[f"{kind}_{which}"] - per_statement[f"{kind}_untracked"], 1)
            for kind in producer.KINDS
        }

    relay, minimal = added("tracked"), added("minimal")
    pgq: dict[str, Any] = {"measured": pgq_missing is None, "note": pgq_missing}
    if pgq_missing is None:
        pgq_added = {
            kind: round(float(count or 0) - per_statement[f"{kind}_untracked"], 1)
            for kind, count in pgq_counts.items()
        }
        pgq |= {
            "thousand_instructions_per_statement": pgq_counts,
            "added": pgq_added,
            "relay_to_pgq_trigger": {
                kind: round(relay[kind] / pgq_added[kind], 2) for kind in producer.KINDS
            },
        }
    return {
        "pgq": pgq,
        "statements": long - short,
        "thousand_instructions_per_statement": per_statement,
        "relay_added": relay,
        "minimal_trigger_added": minimal,
        "relay_to_minimal_trigger": {
            kind: round(relay[kind] / minimal[kind], 2) for kind in producer.KINDS
        },
    }
