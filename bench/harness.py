"""What every benchmark shares: a server, fresh databases, processes, RSS and progress."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from psycopg import conninfo

from consumer.core.events import Position
from consumer.devtools.devdb import (
    Server,
    free_port,
    fresh_database,
    locate_server,
    start_private_cluster,
)

BACKEND_DB = "serversync_bench_backend"
FRONTEND_DB = "serversync_bench_frontend"
# The table-mapping receiver's database: serversync's schema (its version guard) and the table.
MAPPED_DB = "serversync_bench_mapped"
ROOT = Path(__file__).resolve().parent.parent
# Consumers sign and the receiver checks, as in production.
BENCH_SECRET = "bench-shared-secret-0123456789abcdef"  # noqa: S105 - loopback only


def progress(message: str) -> None:
    """One progress line on stderr."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class BenchEnv:
    """The server and the two databases of a run."""

    server: Server
    backend: str
    frontend: str
    workdir: Path


async def fresh_databases(server: Server, workdir: Path) -> BenchEnv:
    """Recreate and migrate the bench's backend and receiver databases."""
    backend = await fresh_database(server.dsn, BACKEND_DB, ["backend"], examples=True)
    frontend = await fresh_database(server.dsn, FRONTEND_DB, ["receiver"])
    return BenchEnv(server, backend, frontend, workdir)


@contextlib.contextmanager
def bench_server(private: bool = False) -> Iterator[Server]:
    """The server to measure on: DATABASE_URL, local, or a private cluster (always with
    `private`: its settings are the same on every machine, see consumer/devtools/devdb.py)."""
    if private:
        cluster = start_private_cluster()
        server = Server(cluster.dsn, cluster=cluster)
    else:
        server = locate_server()
    try:
        yield server
    finally:
        server.close()


async def execute(dsn: str, statement: Any, params: Any = None) -> list[tuple[Any, ...]]:
    """Run one statement on a short-lived connection; rows if it returns any."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute(statement, params)
        return await cur.fetchall() if cur.description else []


async def produce_calls(dsn: str, n: int, *, chunk: int = 50_000) -> None:
    """Write n call_logs through the real relay trigger (about 330 bytes of payload each)."""
    done = 0
    started = time.monotonic()
    while done < n:
        size = min(chunk, n - done)
        await execute(
            dsn,
            "INSERT INTO call_logs (caller_number, callee_number, status, ended_at, duration_sec,"
            " summary) SELECT '090' || lpad(g::text, 8, '0'), '0312345678', 'completed', now(),"
            " g %% 600, 'bench call ' || g FROM generate_series(%s::bigint, %s::bigint) g",
            (done + 1, done + size),
        )
        done += size
        progress(f"produced {done:,}/{n:,} events ({done / (time.monotonic() - started):,.0f}/s)")


# Both order by o.txid, the xid8 column: a bare `txid` would name the text output column, and as
# text '10000' sorts before '9999'.
async def outbox_end(dsn: str) -> Position:
    """The last position of the outbox."""
    rows = await execute(
        dsn,
        "SELECT o.txid::text, o.seq FROM sync.events_outbox o"
        " ORDER BY o.txid DESC, o.seq DESC LIMIT 1",
    )
    return Position(int(rows[0][0]), rows[0][1]) if rows else Position.start()


async def event_position(dsn: str, n: int) -> Position | None:
    """The position of the outbox's `n`-th event in delivery order (n >= 1); None when it holds
    fewer."""
    rows = await execute(
        dsn,
        "SELECT o.txid::text, o.seq FROM sync.events_outbox o"
        " ORDER BY o.txid, o.seq OFFSET %s LIMIT 1",
        (n - 1,),
    )
    return Position(int(rows[0][0]), rows[0][1]) if rows else None


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident set size (VmHWM) in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds a process has used so far; None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def machine_cpu() -> tuple[float, float]:
    """CPU seconds all of this machine's CPUs have been busy so far (user, nice, system, irq,
    softirq), and the seconds the hypervisor gave to other guests while this one wanted to run
    (steal): a run with much steal measured a machine slower than usual."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq) / CLOCK_TICKS, steal / CLOCK_TICKS


class CpuMeter:
    """Where the CPU of a run goes: the given processes, PostgreSQL's backends by the database
    they serve, and its background processes (autovacuum included), read from /proc.

    `mark()` starts a window, `per_event(events)` ends it: CPU microseconds per event of each
    part. PostgreSQL is measured only for a server on this machine (how the bench runs). A
    backend that ends inside the window loses its share, so the measured work must keep its
    connections open until the window ends.
    """

    def __init__(
        self,
        monitor: psycopg.AsyncConnection[Any],
        processes: dict[str, int],
        databases: dict[str, str],
        *,
        local_server: bool,
        applications: dict[str, str] | None = None,
    ) -> None:
        self._monitor = monitor
        self._processes = processes
        self._databases = databases
        self._local_server = local_server
        self._applications = applications or {}
        self._start: dict[int, tuple[str, float]] = {}

    async def _sample(self) -> dict[int, tuple[str, float]]:
        pids: dict[int, str] = {pid: name for name, pid in self._processes.items()}
        if self._local_server:
            cur = await self._monitor.execute(
                "SELECT pid, datname, backend_type = 'client backend', application_name"
                " FROM pg_stat_activity WHERE pid <> pg_backend_pid()"
            )
            for pid, datname, client, application in await cur.fetchall():
                # Sessions by the application named in `applications`, else by the database
                # they serve; autovacuum and the server's own processes apart, whatever
                # database they work on.
                part = "background"
                if client:
                    part = self._applications.get(
                        application, self._databases.get(datname, "other")
                    )
                pids.setdefault(pid, "postgres " + part)
        sample = {}
        for pid, name in pids.items():
            seconds = process_cpu_seconds(pid)
            if seconds is not None:
                sample[pid] = (name, seconds)
        return sample

    async def mark(self) -> None:
        """Start the window here."""
        self._start = await self._sample()

    async def per_event(self, events: int) -> dict[str, float]:
        """End the window: CPU microseconds per event of each part since `mark()`, and the
        total of all parts."""
        used: dict[str, float] = {}
        for pid, (name, seconds) in (await self._sample()).items():
            used[name] = used.get(name, 0.0) + seconds - self._start.get(pid, (name, 0.0))[1]
        figures = {name: round(s * 1e6 / max(events, 1), 2) for name, s in sorted(used.items())}
        figures["total"] = round(sum(used.values()) * 1e6 / max(events, 1), 2)
        return figures


@contextlib.asynccontextmanager
async def cpu_meter(
    env: BenchEnv, processes: dict[str, int], *, applications: dict[str, str] | None = None
) -> AsyncIterator[CpuMeter]:
    """A CpuMeter with its own monitoring connection to the bench's server; `applications`
    names parts for client sessions by their application_name."""
    monitor = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    async with monitor:
        yield CpuMeter(
            monitor,
            processes,
            # Both receivers' databases are "receiver": their drains never overlap.
            {BACKEND_DB: "backend", FRONTEND_DB: "receiver", MAPPED_DB: "receiver"},
            local_server=server_is_local(env.backend),
            applications=applications,
        )


def server_is_local(dsn: str) -> bool:
    """Whether the server of `dsn` runs on this machine (its processes are in /proc)."""
    host = str(conninfo.conninfo_to_dict(dsn).get("host") or "")
    return host in ("", "localhost", "127.0.0.1", "::1") or host.startswith("/")


@dataclass
class Service:
    """A serversync process started for a bench."""

    process: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        """The process id."""
        return self.process.pid

    def check_alive(self) -> None:
        """Raise, with the last line of its log, if the process has exited."""
        code = self.process.poll()
        if code is None:
            return
        lines = self.log.read_text(errors="replace").strip().splitlines()
        last = lines[-1] if lines else "(its log is empty)"
        raise RuntimeError(f"{self.log.stem} exited with status {code}: {last} (log: {self.log})")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_service(args: list[str], env: dict[str, str], log: Path) -> Service:
    """`python -m consumer ARGS` with its output in `log`."""
    with log.open("wb") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", "consumer", "--log-format", "text", *args],
            # The health and metrics port on a free port: a consumer already running on this
            # host (9464 by default) must not stop the bench.
            env={**os.environ, "SYNC_SHARED_SECRET": BENCH_SECRET, "SYNC_HTTP_PORT": "0", **env},
            stdout=handle,
            stderr=handle,
        )
    return Service(process, log)


async def wait_for(
    check: Callable[[], Awaitable[bool]],
    *,
    timeout: float,
    what: str,
    every: float = 0.01,
    watching: Sequence[Service] = (),
) -> None:
    """Poll until `check` holds, or fail with what was awaited; fail at once if one of the
    `watching` processes exits (a consumer that refused to start would else be waited for until
    the timeout)."""
    deadline = time.monotonic() + timeout
    while not await check():
        for service in watching:
            service.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(every)


@contextlib.asynccontextmanager
async def bench_run(
    result: dict[str, Any], *, private: bool, keep_logs: bool
) -> AsyncIterator[BenchEnv]:
    """A measuring command's server and fresh databases, with what it measured on written into
    `result`, and a folder for its processes' logs: removed after a run that succeeded unless
    `keep_logs`; a run that fails raises through here and keeps it (its first line said where)."""
    workdir = Path(tempfile.mkdtemp(prefix="serversync-bench-"))
    progress(f"logs in {workdir}")
    with bench_server(private) as server:
        # What was measured on, not what was asked for: with no server running, a private
        # cluster is started even without --private (and the producer adds its durable modes).
        result["parameters"]["server"] = (
            "private cluster" if server.cluster is not None else "DATABASE_URL or local"
        )
        env = await fresh_databases(server, workdir)
        result["machine"]["postgres"] = (await execute(env.backend, "SHOW server_version"))[0][0]
        yield env
    if keep_logs:
        progress(f"logs kept in {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True)
class Drained:
    """A consumer's drain as its offset row tells it: the events it delivered, the seconds from
    taking the lead to its last offset commit (process start-up excluded), and the CPU per
    event from its first delivered batch on (None when the whole drain fell between two polls)."""

    events: int
    seconds: float
    cpu: dict[str, float] | None


async def watch_drain(
    monitor: psycopg.AsyncConnection[Any],
    meter: CpuMeter,
    *,
    consumer: str,
    end: Position,
    total: int,
    label: str,
    timeout: float,
    every: float,
    watching: Sequence[Service],
) -> Drained:
    """Poll `consumer`'s offset on `monitor` until it reaches `end`, reporting progress against
    `total` events every 2 s; the meter is marked at the first delivered batch, so start-up is
    not the drain's."""
    delivered_at_mark: int | None = None
    last_report = time.monotonic()
    offset = (
        "SELECT last_txid::text, last_seq, delivered_total,"
        " extract(epoch FROM updated_at - leader_since)::float8"
        " FROM sync.consumer_offsets WHERE consumer = %s"
    )

    async def drained() -> bool:
        nonlocal delivered_at_mark, last_report
        row = await (await monitor.execute(offset, (consumer,))).fetchone()
        assert row is not None
        if delivered_at_mark is None and row[2] > 0:
            await meter.mark()
            delivered_at_mark = row[2]
        if time.monotonic() - last_report > 2:
            last_report = time.monotonic()
            progress(f"  {label}: {row[2]:,}/{total:,} delivered")
        return Position(int(row[0]), row[1]) >= end

    await wait_for(
        drained, timeout=timeout, what=f"the {label} drain", every=every, watching=watching
    )
    row = await (await monitor.execute(offset, (consumer,))).fetchone()
    assert row is not None
    delivered, seconds = int(row[2]), float(row[3])
    measured = delivered - (delivered_at_mark or delivered)
    return Drained(delivered, seconds, await meter.per_event(measured) if measured else None)


@contextlib.asynccontextmanager
async def ingest_server(
    env: BenchEnv,
    *,
    dsn: str | None = None,
    mapping: Path | None = None,
    log: str = "ingest-server",
) -> AsyncIterator[tuple[str, Service]]:
    """The reference receiver as a process on `dsn` (default: the bench's receiver database),
    applying into tables with the `mapping` file if one is given; yields its base URL."""
    port = free_port()
    settings = {
        "FRONTEND_DATABASE_URL": dsn or env.frontend,
        "INGEST_PORT": str(port),
        "SYNC_LOG_LEVEL": "WARNING",
    }
    if mapping is not None:
        settings["INGEST_MAPPING_FILE"] = str(mapping)
    service = start_service(["ingest-server"], settings, env.workdir / f"{log}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def ready() -> bool:
                try:
                    async with http.get(f"{url}/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await wait_for(ready, timeout=30, what="ingest-server", every=0.05, watching=[service])
        yield url, service
    finally:
        service.stop()


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    git = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "psycopg": psycopg.__version__,
        "git_ref": git,
    }
