"""A consumer registered for the first time: where it starts, and the snapshot it starts with.

A consumer that registers while the outbox still holds every change since serversync was
installed (sync.outbox_history) starts at the outbox's start and reads the whole history. Once
cleanup has deleted rows, or a table that already held rows was tracked, the outbox no longer
tells the whole story: by default such a consumer registers at the current end of the outbox
and starts with a snapshot of the tables it carries, for it alone. Its leader writes that
snapshot beside the live stream (consumer/runtime/snapshotting.py).

The registration and the snapshot's request are one transaction: a process killed in between
leaves neither, and the next start decides again. Counting the tables' rows for the snapshot's
progress happens before that transaction, so the transaction (which holds an xid, and so the
read horizon of every consumer) stays a few statements short.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import psycopg

from consumer.core.errors import first_line
from consumer.core.events import Position
from consumer.store.admin import AdminError
from consumer.store.queries import query
from consumer.store.snapshots import (
    SnapshotTable,
    create_snapshot,
    outbox_history_complete,
    plan_tables,
)

__all__ = [
    "REQUESTED_BY",
    "START_CHOICES",
    "Registration",
    "RegistrationError",
    "StartFrom",
    "record_error",
    "register_consumer",
]

# Where a consumer registered for the first time starts: "auto" (the outbox's start while it
# holds the whole history, else its current end with a snapshot), "now" (its current end, no
# snapshot), "earliest" (its start, no snapshot: the behaviour before snapshots).
StartFrom = Literal["auto", "now", "earliest"]
START_CHOICES: tuple[StartFrom, ...] = ("auto", "now", "earliest")
# sync.snapshots.requested_by of the snapshot a new consumer starts with.
REQUESTED_BY = "new consumer"


class RegistrationError(AdminError):
    """Where a new consumer starts cannot be decided; the message says what to do, in one line."""


@dataclass(frozen=True)
class Registration:
    """What registering did: `registered` False when the consumer was registered already
    (nothing changed); else where it starts, and the snapshot it starts with (None: none)."""

    registered: bool
    position: Position | None = None
    snapshot_id: int | None = None
    # Whether the outbox held the whole history when it registered (None: not asked).
    history_complete: bool | None = None


async def register_consumer(
    conn: psycopg.AsyncConnection[Any],
    consumer: str,
    *,
    start: StartFrom = "earliest",
    entity_types: frozenset[str] | None = None,
) -> Registration:
    """Register `consumer` unless it is registered, starting where `start` says; with "auto"
    and an incomplete history, also ask for a snapshot of the tracked tables of `entity_types`
    (None: every tracked table) for it alone, in the same transaction. `conn` is an autocommit
    connection. RegistrationError when this role may not read what the decision needs."""
    if start == "earliest":
        # The behaviour before snapshots: one statement, nothing to decide.
        cur = await conn.execute(query("ensure_consumer"), _offset_row(consumer, Position.start()))
        registered = await cur.fetchone() is not None
        return Registration(registered, Position.start() if registered else None)
    try:
        return await _register(conn, consumer, start, entity_types)
    except psycopg.errors.InsufficientPrivilege as exc:
        raise RegistrationError(
            f"consumer {consumer}: cannot decide where it starts ({first_line(exc)}): grant its "
            "role what docs/security.md lists for a consumer, or start it once with --from-now "
            "or --from-earliest"
        ) from None


async def _register(
    conn: psycopg.AsyncConnection[Any],
    consumer: str,
    start: StartFrom,
    entity_types: frozenset[str] | None,
) -> Registration:
    if await _registered(conn, consumer):
        return Registration(False)
    planned: list[SnapshotTable] | None = None
    while True:
        if start == "auto" and planned is None and not await outbox_history_complete(conn):
            planned = await _plan(conn, entity_types)
        async with conn.transaction():
            complete = await outbox_history_complete(conn)
            snapshot = start == "auto" and not complete
            if snapshot and planned is None:
                # The history became incomplete since it was read: count the tables outside
                # this transaction, then decide again.
                raise psycopg.Rollback()
            position = await _now(conn) if snapshot or start == "now" else Position.start()
            cur = await conn.execute(query("ensure_consumer"), _offset_row(consumer, position))
            if await cur.fetchone() is None:
                # Another process of this consumer registered it meanwhile (and asked for its
                # snapshot, if one was due).
                return Registration(False)
            snapshot_id = None
            if snapshot and planned:
                snapshot_id = await create_snapshot(
                    conn, planned, consumer=consumer, requested_by=REQUESTED_BY
                )
            return Registration(True, position, snapshot_id, complete)


async def _registered(conn: psycopg.AsyncConnection[Any], consumer: str) -> bool:
    cur = await conn.execute(query("consumer_registered"), {"consumer": consumer})
    row = await cur.fetchone()
    return bool(row and row[0])


async def _plan(
    conn: psycopg.AsyncConnection[Any], entity_types: frozenset[str] | None
) -> list[SnapshotTable]:
    # A table the consumer's role may not read is planned all the same: the snapshot is asked
    # for, its leader says what to grant, and an operator may run it as the tables' owner.
    return await plan_tables(conn, entity_types=entity_types, uncounted_when_unreadable=True)


async def _now(conn: psycopg.AsyncConnection[Any]) -> Position:
    # The end of what is final now: (horizon xmin, 0). Every row of a transaction older than
    # the horizon is behind it, every row of one still open (txid >= xmin, seq >= 1) after it,
    # so a consumer registered here delivers those. It passes the same rows as the last final
    # row's position would (`position_latest`), and holds where that has none: while an old
    # transaction anywhere on the server holds the horizon below every row, "the start" would
    # replay the whole outbox.
    cur = await conn.execute(query("horizon_xmin"))
    row = await cur.fetchone()
    assert row is not None
    return Position(int(row[0]), 0)


def _offset_row(consumer: str, position: Position) -> dict[str, Any]:
    return {"consumer": consumer, "txid": str(position.txid), "seq": position.seq}


async def record_error(
    conn: psycopg.AsyncConnection[Any], consumer: str, epoch: int, error: str
) -> None:
    """Keep an error that is not a delivery's (its snapshot cannot be written) where `serversync
    status` shows it, until the next offset commit; only while `epoch` still leads."""
    await conn.execute(
        query("record_error"), {"consumer": consumer, "epoch": epoch, "error": error[:2000]}
    )
