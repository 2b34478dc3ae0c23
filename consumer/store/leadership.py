"""The leader lock: a session advisory lock on a dedicated connection, one per consumer name.

PostgreSQL releases the lock the moment the holder's session ends, so a SIGKILLed leader frees
its consumer at once. The lock alone does not fence: a leader cut off from its lock connection may
still hold a pool connection, so every offset write also names the leader epoch
(store.outbox.OutboxStore.commit_offset).
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from consumer.store.db import connect
from consumer.store.queries import query


class LeaderLock:
    """Try, hold and release the leader lock of one consumer."""

    def __init__(self, dsn: str, consumer: str) -> None:
        self._dsn = dsn
        self._consumer = consumer
        # Kept open while standing by too, so a standby does not reconnect on every try.
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._held = False

    async def try_acquire(self) -> bool:
        """Take the lock if nobody holds it; never waits."""
        if self._conn is None or self._conn.closed:
            self._conn = await connect(self._dsn, f"leader:{self._consumer}")
        try:
            cur = await self._conn.execute(query("try_leader_lock"), {"consumer": self._consumer})
            row = await cur.fetchone()
        except psycopg.Error:
            await self._drop()
            raise
        self._held = bool(row and row[0])
        return self._held

    async def check(self) -> None:
        """Raise psycopg.OperationalError if the lock's session is gone."""
        if self._conn is None or not self._held:
            raise psycopg.OperationalError("leader lock is not held")
        await self._conn.execute("SELECT 1")

    async def release(self) -> None:
        """Give the lock up (closing the session releases it in any case)."""
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(psycopg.Error):
                await self._conn.execute(query("unlock_leader"), {"consumer": self._consumer})
        await self._drop()

    async def _drop(self) -> None:
        self._held = False
        if self._conn is not None:
            try:
                await self._conn.close()
            finally:
                self._conn = None
