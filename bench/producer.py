"""Producer cost: what tracking a table costs its writers, measured with pgbench.

Single-row insert/update transactions from 8 concurrent connections into an untracked table and
into the same table tracked by the relay, with wake-ups off, with a NOTIFY in every transaction
(the naive relay), and with serversync's default wake-up policy while a consumer runs.

The bench's private cluster runs with fsync and synchronous_commit off, so every transaction is
pure CPU and the trigger's share of it is as large as it can be. On a private cluster the
untracked and the wake-ups-on runs are repeated with PostgreSQL's durable defaults (fsync,
full_page_writes, synchronous_commit on), as a production server runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from psycopg import conninfo, sql

from bench.harness import BenchEnv, execute, progress, start_service
from consumer.devdb import find_bindir

INSERT_SCRIPT = (
    "INSERT INTO {table} (id, v, note) VALUES (nextval('{table}_ids'), 1, repeat('x', 200));\n"
)
UPDATE_SCRIPT = "\\set id random(1, 10000)\nUPDATE {table} SET v = v + 1 WHERE id = :id;\n"


def pgbench_path() -> str:
    """pgbench from the PostgreSQL binaries."""
    bindir = find_bindir()
    if bindir is not None and (bindir / "pgbench").is_file():
        return str(bindir / "pgbench")
    found = shutil.which("pgbench")
    if not found:
        raise RuntimeError("pgbench not found: install the PostgreSQL client binaries")
    return found


async def _prepare(env: BenchEnv) -> None:
    for table in ("bench_plain", "bench_tracked"):
        name, ids = sql.Identifier(table), sql.Identifier(f"{table}_ids")
        for statement in (
            sql.SQL("DROP TABLE IF EXISTS {}").format(name),
            sql.SQL("DROP SEQUENCE IF EXISTS {}").format(ids),
            sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY, v int NOT NULL, note text)").format(
                name
            ),
            sql.SQL("CREATE SEQUENCE {} START 10001").format(ids),
            sql.SQL("INSERT INTO {} SELECT g, 0, 'seed' FROM generate_series(1, 10000) g").format(
                name
            ),
        ):
            await execute(env.backend, statement)
    await execute(env.backend, "SELECT sync.track('public.bench_tracked', 'bench_item')")


def _pgbench(env: BenchEnv, table: str, seconds: int, clients: int, notify: str) -> float:
    params = conninfo.conninfo_to_dict(env.backend)
    folder: Path = env.workdir
    (folder / f"insert_{table}.sql").write_text(INSERT_SCRIPT.format(table=table))
    (folder / f"update_{table}.sql").write_text(UPDATE_SCRIPT.format(table=table))
    command = [
        pgbench_path(),
        "-n",
        "-T",
        str(seconds),
        "-c",
        str(clients),
        "-j",
        "2",
        "-f",
        f"{folder / f'insert_{table}.sql'}@1",
        "-f",
        f"{folder / f'update_{table}.sql'}@1",
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
            "PGOPTIONS": f"-c sync.notify={notify}",
            "PATH": "/usr/bin:/bin",
            **({"PGPASSWORD": str(params["password"])} if "password" in params else {}),
        },
    )
    match = re.search(r"tps = ([0-9.]+)", result.stdout)
    if result.returncode != 0 or not match:
        raise RuntimeError(f"pgbench failed: {result.stderr.strip() or result.stdout.strip()}")
    return float(match.group(1))


def _durable(env: BenchEnv, on: bool) -> None:
    """Restart the private cluster with PostgreSQL's crash-safe defaults, or without them
    (fsync and friends are set on its command line, which no reload can override)."""
    cluster = env.server.cluster
    assert cluster is not None
    cluster.durable = on
    cluster.restart()


async def run_producer(env: BenchEnv, *, seconds: int, clients: int = 8) -> dict[str, Any]:
    """tps of each mode and the ratios to the untracked table (and, on a private cluster, the
    same ratio with durable settings)."""
    await _prepare(env)
    figures: dict[str, float] = {}
    modes = [
        ("untracked", "bench_plain", "auto", False),
        ("tracked_no_notify", "bench_tracked", "off", False),
        ("tracked_notify_every_tx", "bench_tracked", "always", True),
        ("tracked_wakeups_on", "bench_tracked", "auto", True),
        # The same consumer load without any NOTIFY: what the consumer's own reads cost.
        ("tracked_consumer_running_no_notify", "bench_tracked", "off", True),
    ]
    durable = env.server.cluster is not None
    if durable:
        modes += [
            ("durable_untracked", "bench_plain", "auto", False),
            ("durable_tracked_wakeups_on", "bench_tracked", "auto", True),
        ]
    for name, table, notify, with_consumer in modes:
        if name == "durable_untracked":
            _durable(env, True)
        consumer = None
        if with_consumer:
            consumer = start_service(
                ["run", "frontend-sync", "--sink", "null"],
                {
                    "DATABASE_URL": env.backend,
                    "SYNC_BATCH_SIZE": "1000",
                    "SYNC_LOG_LEVEL": "WARNING",
                },
                env.workdir / f"consumer-producer-{name}.log",
            )
        try:
            progress(f"  producer: {name} for {seconds}s at {clients} connections")
            figures[name] = _pgbench(env, table, seconds, clients, notify)
        finally:
            if consumer is not None:
                consumer.stop()
        await execute(env.backend, "VACUUM ANALYZE")
    if durable:
        _durable(env, False)

    def base(mode: str) -> float:
        return figures["durable_untracked" if mode.startswith("durable_") else "untracked"]

    return {
        "clients": clients,
        "seconds": seconds,
        "tps": {k: round(v, 1) for k, v in figures.items()},
        "ratio_to_untracked": {k: round(v / base(k), 3) for k, v in figures.items()},
    }
