"""Test harness: a real PostgreSQL (local, given, or a private cluster), one template database
per schema built once per session, a fresh copy of it for every test, and a real receiver on
loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from aiohttp import web
from aiohttp.typedefs import Middleware
from psycopg import sql

from consumer.app.settings import SyncSettings
from consumer.app.wiring import consumer_runtime, open_pool
from consumer.devtools.devdb import PrivateCluster, Server, locate_server, start_private_cluster
from consumer.receiver.app import build_app
from consumer.receiver.store import EntityStore
from consumer.receiver.uploads import RecordingFiles
from consumer.runtime.worker import ConsumerRuntime
from consumer.store import migrations
from consumer.store.db import with_dbname

ROOT = Path(__file__).resolve().parent.parent
BACKEND_COMPONENTS = ["backend"]
RECEIVER_COMPONENTS = ["receiver"]


async def wait_until(
    condition: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> None:
    """Poll `condition` until it holds; fail the test when the deadline passes first."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)  # poll again until the deadline


class Databases:
    """Creates per-test databases from session templates on one server."""

    def __init__(self, server_dsn: str) -> None:
        self.server_dsn = server_dsn
        self.tag = f"{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self.templates: dict[str, str] = {}
        self.created: list[str] = []

    def _admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.server_dsn, autocommit=True)

    def template(self, kind: str) -> str:
        """The template database of `kind` ("backend" or "receiver"), built on first use."""
        if kind not in self.templates:
            name = f"ss_tpl_{kind}_{self.tag}"
            with self._admin() as conn:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
            components = BACKEND_COMPONENTS if kind == "backend" else RECEIVER_COMPONENTS

            async def migrate() -> None:
                conn = await psycopg.AsyncConnection.connect(
                    with_dbname(self.server_dsn, name), autocommit=True
                )
                async with conn:
                    await migrations.migrate(conn, components)
                    if kind == "backend":
                        # The voicebot tables the tests write to (`migrate --with-examples`).
                        await migrations.apply_examples(conn)

            asyncio.run(migrate())
            self.templates[kind] = name
        return self.templates[kind]

    def create(self, kind: str) -> str:
        """A fresh database copied from the template; returns its DSN."""
        return self._create(f"ss_{kind}_{uuid.uuid4().hex[:10]}", self.template(kind))

    def create_empty(self) -> str:
        """A brand-new database without any migration; returns its DSN."""
        return self._create(f"ss_empty_{uuid.uuid4().hex[:10]}", None)

    def _create(self, name: str, template: str | None) -> str:
        statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template is not None:
            statement += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
        with self._admin() as conn:
            conn.execute(statement)
        self.created.append(name)
        return with_dbname(self.server_dsn, name)

    def drop_all(self) -> None:
        """Drop every database this object made, templates last."""
        with self._admin() as conn:
            for name in [*self.created, *self.templates.values()]:
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )


@pytest.fixture(scope="session")
def pg_server() -> Iterator[Server]:
    """The shared server: DATABASE_URL, a local one, or a private cluster."""
    server = locate_server()
    yield server
    server.close()


@pytest.fixture(scope="session")
def databases(pg_server: Server) -> Iterator[Databases]:
    """Per-test databases on the shared server."""
    dbs = Databases(pg_server.dsn)
    yield dbs
    dbs.drop_all()


@pytest.fixture(scope="session")
def private_cluster() -> Iterator[PrivateCluster]:
    """A cluster of our own that tests may stop, restart or break."""
    cluster = start_private_cluster()
    yield cluster
    cluster.destroy()


@pytest.fixture(scope="session")
def private_databases(private_cluster: PrivateCluster) -> Iterator[Databases]:
    """Per-test databases on the private cluster."""
    dbs = Databases(private_cluster.dsn)
    yield dbs
    with contextlib.suppress(psycopg.Error):
        dbs.drop_all()


@pytest.fixture
def backend_dsn(databases: Databases) -> str:
    """A fresh backend database: the outbox, the relay and the voicebot tables."""
    return databases.create("backend")


@pytest.fixture
def node_dsns(databases: Databases) -> tuple[str, str]:
    """Two fresh backend databases, for two nodes that exchange changes both ways."""
    return databases.create("backend"), databases.create("backend")


@pytest.fixture
def private_backend_dsn(private_databases: Databases) -> str:
    """A fresh backend database on the private cluster: one that tests may stop, restart or
    break, and where no other process's open transaction holds the read horizon back."""
    return private_databases.create("backend")


@pytest.fixture
def empty_dsn(databases: Databases) -> str:
    """A brand-new database without any migration (dropped with the session's databases)."""
    return databases.create_empty()


@pytest.fixture
def receiver_dsn(databases: Databases) -> str:
    """A fresh receiver database."""
    return databases.create("receiver")


@contextlib.asynccontextmanager
async def serve_app(app: web.Application, *, shutdown_timeout: float = 60.0) -> AsyncIterator[str]:
    """`app` on a free loopback port until the block ends; yields its base URL."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serve_receiver(
    receiver_dsn: str,
    *,
    recordings: RecordingFiles | None = None,
    shared_secret: str | None = None,
    middlewares: Sequence[Middleware] = (),
    shutdown_timeout: float = 60.0,
) -> AsyncIterator[str]:
    """The reference receiver on a free loopback port; yields its base URL. With `recordings`
    it also takes recording uploads (and serves them); `middlewares` go in front of its own."""
    if recordings is not None:
        recordings.prepare()
    async with open_pool(receiver_dsn, "test-ingest", max_size=4) as pool:
        app = build_app(
            EntityStore(pool),
            max_body_bytes=1024 * 1024,
            shared_secret=shared_secret,
            recordings=recordings,
        )
        app.middlewares[:0] = middlewares
        async with serve_app(app, shutdown_timeout=shutdown_timeout) as url:
            yield url


@pytest.fixture
async def receiver_url(receiver_dsn: str) -> AsyncIterator[str]:
    """Base URL of a running reference receiver on its own database."""
    async with serve_receiver(receiver_dsn) as url:
        yield url


def make_settings(database_url: str, frontend_url: str, **overrides: Any) -> SyncSettings:
    """Consumer settings for tests: short timers so that tests run fast."""
    values: dict[str, Any] = {
        "DATABASE_URL": database_url,
        "FRONTEND_BASE_URL": frontend_url,
        "SYNC_POLL_INTERVAL_SEC": 30,
        "SYNC_BATCH_SIZE": 100,
        "SYNC_TIMEOUT_SEC": 5,
        "SYNC_RECHECK_INTERVAL_MS": 50,
        "SYNC_STANDBY_INTERVAL_SEC": 0.2,
        "SYNC_RETRY_INITIAL_SEC": 0.05,
        "SYNC_RETRY_MAX_SEC": 0.5,
        "SYNC_SHUTDOWN_TIMEOUT_SEC": 2,
    }
    values.update(overrides)
    return SyncSettings(**values)


@contextlib.asynccontextmanager
async def running_consumer(
    settings: SyncSettings, consumer: str = "frontend-sync", sink: str = "default"
) -> AsyncIterator[ConsumerRuntime]:
    """A consumer running in this event loop; stopped (and checked for errors) on exit."""
    async with consumer_runtime(settings, consumer, sink) as runtime:
        task = asyncio.create_task(runtime.run())
        try:
            yield runtime
        finally:
            runtime.request_stop()
            await asyncio.wait_for(task, timeout=15)


async def fetch_all(dsn: str, query: Any, params: Any = None) -> list[tuple[Any, ...]]:
    """Rows of one query on a short-lived connection."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute(query, params)
        return await cur.fetchall()


async def fetch_value(dsn: str, query: Any, params: Any = None) -> Any:
    """The first column of the first row of one query."""
    rows = await fetch_all(dsn, query, params)
    return rows[0][0] if rows else None


# The relay's count of waiting consumers (sql/backend/schema.sql); NULL after a crash until
# recounted.
WAITING_COUNT = "SELECT pg_sequence_last_value('sync.waiting_consumers')"


async def waiting_for_notify(dsn: str) -> bool:
    """Some consumer is idle and has asked producers for a NOTIFY (sql/backend/schema.sql). Until
    then a commit sends none, so a test that counts wake-ups must wait for this first."""
    return bool(await fetch_value(dsn, "SELECT bool_or(waiting) FROM sync.consumer_waits"))


def cli_env(**variables: str) -> dict[str, str]:
    """This process's environment without any serversync setting, plus `variables`."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key != "DATABASE_URL" and not key.startswith(("SYNC_", "FRONTEND_", "INGEST_"))
    }
    # A `run` serves health and metrics: on a free port, so that runs in parallel do not clash.
    env["SYNC_HTTP_PORT"] = "0"
    env.update(variables)
    return env


async def start_cli(*args: str, env: dict[str, str]) -> asyncio.subprocess.Process:
    """Start `serversync ARGS...` (as `python -m consumer`) with stdout and stderr piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "consumer",
        *args,
        env=env,
        cwd=ROOT,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


@dataclass(frozen=True)
class CliResult:
    """What one `serversync` process did."""

    code: int
    stdout: str
    stderr: str

    def logs(self) -> list[dict[str, Any]]:
        """The JSON log lines on stderr."""
        return [orjson.loads(line) for line in self.stderr.splitlines() if line.startswith("{")]


async def finish(process: asyncio.subprocess.Process, timeout: float = 60.0) -> CliResult:
    """Wait for a started command; kill it and fail if it outlives `timeout`."""
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout=timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"serversync still running after {timeout}s") from None
    assert process.returncode is not None
    return CliResult(process.returncode, out.decode(), err.decode())
