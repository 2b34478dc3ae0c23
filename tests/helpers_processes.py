"""Helpers for process-level tests: a scripted fault receiver (a real aiohttp server on
loopback) and serversync processes run as real subprocesses (`python -m consumer ...`), with
their output in a file."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import orjson
import psycopg
from aiohttp import web

from tests.conftest import ROOT, fetch_all, serve_app, wait_until

CONSUMER = "frontend-sync"
INGEST_PATH = "/api/ingest/sync"

# Short timers, so that faults play out in well under a second.
FAST_ENV: dict[str, str] = {
    "SYNC_LOG_LEVEL": "DEBUG",
    "SYNC_BATCH_SIZE": "100",
    "SYNC_TIMEOUT_SEC": "20",
    "SYNC_POLL_INTERVAL_SEC": "30",
    "SYNC_RECHECK_INTERVAL_MS": "50",
    "SYNC_STANDBY_INTERVAL_SEC": "0.2",
    "SYNC_RETRY_INITIAL_SEC": "0.05",
    "SYNC_RETRY_MAX_SEC": "0.5",
    "SYNC_SHUTDOWN_TIMEOUT_SEC": "2",
    # Every process serves /healthz, /readyz and /metrics: on a free port, so that several fit.
    "SYNC_HTTP_PORT": "0",
}


# -- the scripted fault receiver ---------------------------------------------------------------


@dataclass
class Received:
    """One request as the receiver saw it."""

    index: int
    key: str
    seqs: list[int]
    arrived: float
    # None while held or delayed; then "ok" or the HTTP status that was answered.
    outcome: str | None = None


@dataclass
class FaultReceiver:
    """A real HTTP receiver on 127.0.0.1 that records every request body and can be scripted to
    hold requests until released, to answer 500 for a while, or to answer slowly.

    An event counts as delivered once the receiver accepted a request holding it (answered 200,
    or decided to while the client was already gone: a real receiver applies the body it read)."""

    url: str = ""
    requests: list[Received] = field(default_factory=list)
    # Every seq of every accepted request, duplicates included, in acceptance order.
    accepted: list[int] = field(default_factory=list)
    # Requests with index >= hold_from are held until release() (None: hold nothing).
    hold_from: int | None = None
    hold_until: int | None = None
    fail_remaining: int = 0
    # Random latency of each answer, in seconds (a receiver doing some work).
    latency: tuple[float, float] = (0.0, 0.0)
    # Answer the request with this index only after this many seconds.
    slow: dict[int, float] = field(default_factory=dict)
    # Held requests: each future's result says whether to accept the request or answer 500.
    _waiters: list[asyncio.Future[bool]] = field(default_factory=list)

    @property
    def seen(self) -> int:
        """How many requests arrived so far."""
        return len(self.requests)

    @property
    def held(self) -> int:
        """How many requests are held right now."""
        return sum(1 for w in self._waiters if not w.done())

    @property
    def delivered(self) -> set[int]:
        """Every seq accepted at least once."""
        return set(self.accepted)

    def duplicates(self) -> Counter[int]:
        """seq -> how many extra times it was accepted."""
        return Counter({s: n - 1 for s, n in Counter(self.accepted).items() if n > 1})

    def hold_next(self, count: int | None = None) -> None:
        """Hold the next `count` requests (every request from now on when None)."""
        self.hold_from = self.seen
        self.hold_until = None if count is None else self.seen + count

    def release(self, *, accept: bool = True) -> None:
        """Let every held request proceed (or answer them 500: `accept=False`), and hold no new
        ones."""
        self.hold_from = self.hold_until = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(accept)
        self._waiters.clear()

    def fail_next(self, count: int) -> None:
        """Answer the next `count` requests with HTTP 500."""
        self.fail_remaining = count

    def _should_hold(self, index: int) -> bool:
        if self.hold_from is None or index < self.hold_from:
            return False
        return self.hold_until is None or index < self.hold_until

    async def handle(self, request: web.Request) -> web.Response:
        """POST /api/ingest/sync."""
        body = await request.read()
        entries: list[dict[str, Any]] = orjson.loads(body)["entries"]
        item = Received(
            index=self.seen,
            key=request.headers.get("Idempotency-Key", ""),
            seqs=[int(e["seq"]) for e in entries],
            arrived=time.monotonic(),
        )
        self.requests.append(item)
        accept = True
        if self._should_hold(item.index):
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            accept = await waiter
        if item.index in self.slow:
            await asyncio.sleep(self.slow[item.index])  # a slow receiver, not waiting until
        low, high = self.latency
        if high > 0:
            await asyncio.sleep(random.uniform(low, high))  # simulated latency, not waiting until
        if accept and self.fail_remaining > 0:
            self.fail_remaining -= 1
            accept = False
        if not accept:
            item.outcome = "500"
            return web.json_response({"error": {"code": "SCRIPTED", "message": "no"}}, status=500)
        item.outcome = "ok"
        self.accepted.extend(item.seqs)
        return web.json_response({"ok": True, "received": len(entries), "applied": len(entries)})


@contextlib.asynccontextmanager
async def serve_fault_receiver() -> AsyncIterator[FaultReceiver]:
    """A FaultReceiver listening on a free loopback port until the block ends."""
    receiver = FaultReceiver()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post(INGEST_PATH, receiver.handle)
    async with serve_app(app, shutdown_timeout=1.0) as url:
        receiver.url = url
        try:
            yield receiver
        finally:
            # Held requests must end before the server can shut down.
            receiver.release()


# -- serversync processes ------------------------------------------------------------------------

# The line every `run` logs at start (SYNC_HTTP_PORT=0: the port is only known from it).
OPS_URL = re.compile(r"health, readiness and metrics on (http://127\.0\.0\.1:\d+)")
# Variables a test process never inherits from the environment pytest runs in: each test sets
# its own.
OWN_PREFIXES = (
    "SYNC_",
    "DATABASE_URL",
    "FRONTEND_",
    "INGEST_",
    "RECORDINGS_",
    "SERVERSYNC_",
    "PG",
    "OTEL_",
)


def lock_application_name(pid: int) -> str:
    """The application_name of a consumer process's leader lock session."""
    return f"serversync:leader:{CONSUMER}:{socket.gethostname()}:{pid}"[:63]


def pool_application_name(pid: int) -> str:
    """The application_name of a consumer process's pool connections (offset writes)."""
    return f"serversync:run:{CONSUMER}:{socket.gethostname()}:{pid}"[:63]


def process_env(**variables: str) -> dict[str, str]:
    """This process's environment without any serversync, PostgreSQL or OpenTelemetry setting,
    plus `variables`."""
    base = {key: value for key, value in os.environ.items() if not key.startswith(OWN_PREFIXES)}
    return {**base, **variables}


class ServersyncProcess:
    """`python -m consumer ARGS...` with stdout and stderr in one file (nothing else writes
    to stdout for `run` and `ingest-server`)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log_file = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consumer", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        """The process id (what a consumer writes to sync.consumer_offsets.leader_pid)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """None while running."""
        return self.proc.poll()

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM: a graceful stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def assert_alive(self) -> None:
        """Fail with the log if the process ended."""
        assert self.proc.poll() is None, (
            f"{self.name} exited with {self.proc.returncode}:\n{self.log()}"
        )

    def memory_kib(self, key: str) -> int:
        """A line of /proc/<pid>/status in KiB (VmRSS: now; VmHWM: the peak so far)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0])
        raise AssertionError(f"no {key} in /proc/{self.pid}/status")

    async def wait_exit(self, timeout: float = 10.0) -> int:
        """Wait for the process to end; its return code."""
        await wait_until(
            lambda: self.proc.poll() is not None,
            timeout=timeout,
            what=f"{self.name} (pid {self.pid}) to exit",
        )
        code = self.proc.poll()
        assert code is not None
        return code

    async def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait for the exit; the return code."""
        self.terminate()
        return await self.wait_exit(timeout)

    async def wait_log(self, pattern: str | re.Pattern[str], timeout: float = 10.0) -> str:
        """Wait until the output holds `pattern` (a substring or a regex); the first match.
        Fails at once if the process ended without logging it."""

        def find() -> str | None:
            text = self.log()
            if isinstance(pattern, str):
                return pattern if pattern in text else None
            match = pattern.search(text)
            return match.group(0) if match else None

        found: list[str] = []

        def logged() -> bool:
            # Whether it ended is asked before the log is read: what an ended process logged
            # is all in the file by then.
            ended = self.proc.poll() is not None
            if (hit := find()) is not None:
                found.append(hit)
                return True
            assert not ended, (
                f"{self.name} exited with {self.proc.returncode} before logging {pattern!r}:\n"
                + self.log()
            )
            return False

        await wait_until(logged, timeout=timeout, what=f"{self.name} to log {pattern!r}")
        return found[0]

    async def ops_url(self, timeout: float = 15.0) -> str:
        """The base URL of a consumer's /healthz, /readyz and /metrics (SYNC_HTTP_PORT=0: read
        from the line the process logs at start)."""
        line = await self.wait_log(OPS_URL, timeout)
        match = OPS_URL.search(line)
        assert match is not None
        return match.group(1)

    def close(self) -> None:
        """Kill the process if it still runs, reap it, close the log."""
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log_file.close()


class Processes:
    """Starts serversync processes for one test, with process_env(), `defaults` (FAST_ENV
    unless told) and each start's own variables; as a context manager, kills what still runs at
    the end and prints every log (pytest shows them when a test fails)."""

    def __init__(self, log_dir: Path, defaults: Mapping[str, str] = FAST_ENV) -> None:
        self.log_dir = log_dir
        self.defaults = dict(defaults)
        self.started: list[ServersyncProcess] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def launch(self, name: str, args: list[str], env: dict[str, str]) -> ServersyncProcess:
        """`serversync ARGS...` with exactly `env`."""
        process = ServersyncProcess(name, args, env, self.log_dir / f"{name}.log")
        self.started.append(process)
        return process

    def start(self, name: str, args: list[str], **env: str) -> ServersyncProcess:
        """`serversync ARGS...` with process_env(), the defaults, and `env` over them."""
        return self.launch(name, args, process_env(**{**self.defaults, **env}))

    def consumer(
        self,
        database_url: str,
        frontend_url: str,
        name: str | None = None,
        *,
        consumer: str = CONSUMER,
        log_format: str | None = "text",
        **env: str,
    ) -> ServersyncProcess:
        """`serversync [--log-format FORMAT] run CONSUMER` (None: the default format, JSON);
        `env` adds or overrides variables (SYNC_BATCH_SIZE="50", ...)."""
        args = ["--log-format", log_format] if log_format else []
        return self.start(
            name or f"consumer-{len(self.started) + 1}",
            [*args, "run", consumer],
            **{"DATABASE_URL": database_url, "FRONTEND_BASE_URL": frontend_url, **env},
        )

    def close(self) -> None:
        """Kill every process still running and print every log."""
        for process in self.started:
            process.close()
        for process in self.started:
            print(f"===== {process.name} (pid {process.pid}, exit {process.returncode}) =====")
            print(process.log())


# -- the backend side --------------------------------------------------------------------------


async def offsets_row(dsn: str) -> dict[str, Any]:
    """The frontend-sync row of sync.consumer_offsets."""
    rows = await fetch_all(
        dsn,
        "SELECT last_txid::text, last_seq, leader_epoch, leader_pid, leader_host "
        "FROM sync.consumer_offsets WHERE consumer = %s",
        (CONSUMER,),
    )
    if not rows:
        return {}
    last_txid, last_seq, epoch, pid, host = rows[0]
    return {
        "position": (int(last_txid), last_seq),
        "last_seq": last_seq,
        "epoch": epoch,
        "leader_pid": pid,
        "leader_host": host,
    }


async def outbox_seqs(dsn: str) -> list[int]:
    """Every seq in the outbox."""
    return [row[0] for row in await fetch_all(dsn, "SELECT seq FROM sync.events_outbox")]


async def outbox_end(dsn: str) -> tuple[int, int] | None:
    """The position of the last event in delivery order."""
    rows = await fetch_all(
        dsn,
        # ORDER BY o.txid: a bare `txid` would name the text output column.
        "SELECT o.txid::text, o.seq FROM sync.events_outbox o "
        "ORDER BY o.txid DESC, o.seq DESC LIMIT 1",
    )
    return (int(rows[0][0]), rows[0][1]) if rows else None


async def insert_calls(dsn: str, count: int, *, tag: str = "c", transactions: int = 1) -> None:
    """`count` call_logs inserts (one event each), spread over `transactions` transactions."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        per = -(-count // transactions)
        done = 0
        while done < count:
            n = min(per, count - done)
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) "
                "SELECT %s || '-' || g, 'x' FROM generate_series(%s::int, %s::int) g",
                (tag, done + 1, done + n),
            )
            done += n


async def insert_callers(dsn: str, callers: list[str]) -> None:
    """One call log per caller number, all in one transaction (one batch for the consumer)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) "
            "SELECT c, 'x' FROM unnest(%s::text[]) WITH ORDINALITY AS u(c, n) ORDER BY n",
            (callers,),
        )


async def leader_lock_holders(dsn: str) -> list[str]:
    """application_name of every session holding the consumer's leader lock."""
    rows = await fetch_all(
        dsn,
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND l.classid = hashtext('serversync.consumer')::oid "
        "AND l.objid = hashtext(%s)::oid",
        (CONSUMER,),
    )
    return [row[0] for row in rows]
