"""Registered consumers: finding one, the sessions of its running processes, and deregistering
one that no longer runs (`serversync consumers remove`). Retention (retention.py) reports a
consumer that pins old outbox rows and names this as the way to let them go.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from consumer.core.events import Position
from consumer.store.admin import (
    AdminError,
    UnknownConsumerError,
    consumer_status,
    holding_consumer_lock,
)
from consumer.store.db import APPLICATION_PREFIX
from consumer.store.queries import query


@dataclass(frozen=True)
class RegisteredConsumer:
    """A registered consumer as `consumers remove` shows it before removing it."""

    consumer: str
    position: Position
    updated_at: datetime
    dead_letters: int


@dataclass(frozen=True)
class RemovedConsumer:
    """What `remove_consumer` did."""

    consumer: str
    position: Position
    # The consumer's dead letters: deleted with it (purge_dlq) or kept.
    dead_letters_deleted: int
    dead_letters_kept: int


async def _known(conn: psycopg.AsyncConnection[Any]) -> str:
    names = [r["consumer"] for r in await consumer_status(conn)]
    return ", ".join(names) or "none"


async def find_consumer(conn: psycopg.AsyncConnection[Any], consumer: str) -> RegisteredConsumer:
    """The registered consumer `consumer`, or UnknownConsumerError naming the known ones."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query("retention_consumer"), {"consumer": consumer})
        row = await cur.fetchone()
    if row is None:
        raise UnknownConsumerError(f"no consumer named {consumer!r} (known: {await _known(conn)})")
    return RegisteredConsumer(
        consumer,
        Position(int(row["last_txid"]), int(row["last_seq"])),
        row["updated_at"],
        int(row["dead_letters"]),
    )


def leader_lock_prefix(consumer: str) -> str:
    """How the application_name of a consumer process's leader-lock session begins.

    LeaderLock connects with role `leader:NAME` (consumer/store/db.py application_name, cut at 63
    characters as PostgreSQL does); cut short, the prefix may also match a consumer whose name
    extends this one, which only makes a removal refuse.
    """
    return f"{APPLICATION_PREFIX}:leader:{consumer}:"[:63]


async def consumer_sessions(
    conn: psycopg.AsyncConnection[Any], consumer: str
) -> list[dict[str, Any]]:
    """The sessions of the consumer's running processes, leader and standbys: pid and
    application_name (which names the host and the process id)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            query("retention_consumer_sessions"), {"prefix": leader_lock_prefix(consumer)}
        )
        return await cur.fetchall()


async def remove_consumer(
    conn: psycopg.AsyncConnection[Any], consumer: str, *, purge_dlq: bool = False
) -> RemovedConsumer:
    """Deregister a consumer that no longer runs: its offset row and its waiting flag go, its
    dead letters stay unless `purge_dlq`.

    `conn` must be in autocommit mode. UnknownConsumerError for an unknown name; AdminError while
    a process of the consumer runs: its leader holds the leader lock, and a standby (which would
    take over the moment the lock is free and find no offset row) keeps a session open for it.
    """
    await find_consumer(conn, consumer)
    async with holding_consumer_lock(conn, consumer):
        # Holding the lock keeps a standby from taking over meanwhile; it must not stay behind.
        sessions = await consumer_sessions(conn, consumer)
        if sessions:
            who = ", ".join(f"{s['application_name']} (backend {s['pid']})" for s in sessions)
            raise AdminError(
                f"consumer {consumer} has a standby process running: {who}; stop it first"
            )
        async with conn.transaction():
            cur = await conn.execute(query("retention_remove_consumer"), {"consumer": consumer})
            row = await cur.fetchone()
            if row is None:  # removed by someone else since find_consumer
                raise UnknownConsumerError(
                    f"no consumer named {consumer!r} (known: {await _known(conn)})"
                )
            await conn.execute(query("retention_forget_waiting"), {"consumer": consumer})
            await conn.execute(query("retention_cancel_snapshots"), {"consumer": consumer})
            deleted = kept = 0
            if purge_dlq:
                cur = await conn.execute(query("retention_purge_dlq"), {"consumer": consumer})
                deleted = cur.rowcount
            else:
                count = await (
                    await conn.execute(query("dlq_count"), {"consumer": consumer, "status": None})
                ).fetchone()
                kept = int(count[0]) if count else 0
    return RemovedConsumer(consumer, Position(int(row[0]), int(row[1])), deleted, kept)
