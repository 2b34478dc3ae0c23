"""What every process needs before it starts: connections that explain their failures, the
migration check, a connection pool, and stop signals."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool

from consumer.app.settings import ConfigError
from consumer.core.errors import first_line
from consumer.store import migrations
from consumer.store.db import connect, connect_kwargs, mask_dsn


class StartupError(Exception):
    """The process cannot start: the message says what to fix, in one line."""


async def connect_or_explain(dsn: str, role: str, what: str) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection, or a StartupError naming the variable and the masked DSN."""
    try:
        conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        # libpq's parse errors quote the offending piece of the string: it may be the password.
        raise ConfigError(
            f"{what} is not a valid connection string (key=value pairs, or a postgresql:// URL "
            "with special characters percent-encoded)"
        ) from None
    try:
        return await connect(dsn, role)
    except psycopg.Error as exc:
        raise StartupError(
            f"cannot connect to {what} ({mask_dsn(dsn)}): {first_line(exc)}"
        ) from None


async def check_database(dsn: str, components: list[str], what: str) -> None:
    """Fail with a clear message if the database is unreachable or lacks migrations."""
    async with await connect_or_explain(dsn, "check", what) as conn:
        for component in components:
            try:
                todo = await migrations.pending(conn, component)
            except migrations.MigrationError as exc:
                raise StartupError(str(exc)) from None
            if todo:
                raise StartupError(
                    f"{what} lacks {len(todo)} {component} migration(s) "
                    f"(first: {todo[0].label}); run `serversync migrate`"
                )


@contextlib.asynccontextmanager
async def open_pool(
    dsn: str, role: str, *, max_size: int = 4, synchronous_commit: bool = True
) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A psycopg pool for the hot path.

    No check on checkout: it would cost a round trip per query. A connection broken by a server
    restart fails its next query, the pool drops it, and the caller's retry gets a new one.
    """
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs={
            "autocommit": True,
            **connect_kwargs(role, synchronous_commit=synchronous_commit),
        },
        open=False,
        reconnect_timeout=0,
        timeout=30,
    )
    await pool.open(wait=False)
    try:
        yield pool
    finally:
        await pool.close()


def install_stop_handlers(stop: Callable[[], object]) -> None:
    """Call `stop` on SIGTERM and SIGINT (the running event loop's handlers)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
