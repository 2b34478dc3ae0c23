"""Wake-ups: LISTEN on its own autocommit connection, outside the pool, with keepalive and
reconnect. A NOTIFY only says "look now"; losing one never loses data, because the worker also
reads on start, after every reconnect, and on the poll timer."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg

from consumer.core.errors import first_line
from consumer.runtime.backoff import Backoff
from consumer.store.db import connect

log = logging.getLogger("serversync.wakeup")


class NotifyListener:
    """Sets `event` on every NOTIFY on `sync_outbox` and after every (re)connect."""

    def __init__(self, dsn: str, role: str, *, keepalive_sec: float = 10.0) -> None:
        self._dsn = dsn
        self._role = role
        self._keepalive = keepalive_sec
        self.event = asyncio.Event()
        self.connected = asyncio.Event()
        self.notifications = 0
        self.reconnects = 0
        self._task: asyncio.Task[None] | None = None
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def start(self) -> None:
        """Start listening in the background."""
        self._task = asyncio.create_task(self._run(), name=f"listen:{self._role}")

    async def stop(self) -> None:
        """Stop listening and close the connection."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        backoff = Backoff(0.1, 5.0)
        first = True
        while True:
            try:
                self._conn = await connect(self._dsn, f"listen:{self._role}")
                # The channel the relay notifies on (pg_notify in sql/backend/).
                await self._conn.execute("LISTEN sync_outbox")
                backoff.reset()
                if not first:
                    self.reconnects += 1
                    log.info("listener reconnected; catching up")
                first = False
                self.connected.set()
                # Anything committed while we were not listening must be read now.
                self.event.set()
                await self._listen(self._conn)
            except asyncio.CancelledError:
                raise
            except psycopg.Error as exc:
                self.connected.clear()
                delay = backoff.next_delay()
                log.warning(
                    "listener connection lost (%s); reconnecting in %.1fs", first_line(exc), delay
                )
                await asyncio.sleep(delay)
            finally:
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None

    async def _listen(self, conn: psycopg.AsyncConnection[Any]) -> None:
        while True:
            async for _ in conn.notifies(timeout=self._keepalive):
                self.notifications += 1
                self.event.set()
            # No notification for a while: make sure the session is still there.
            await conn.execute("SELECT 1")
