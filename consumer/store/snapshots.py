"""Snapshots: the current rows of tracked tables written into the stream, chunk by chunk; here,
what a snapshot is and how it is asked for, found, listed and cancelled.

A snapshot is asked for (`create_snapshot`: which tables, for every consumer or one), then
written (consumer/store/snapshot_writer.py, `run_snapshot`): it begins once every transaction
that could still write an outbox row below its begin seq has ended, then sends each table in
key order, a chunk per short transaction (functions/snapshot.sql), and ends, with a sweep marker
per entity type when asked. Every step is recorded, so a snapshot stopped or killed anywhere is
resumed where it stood by running it again. docs/design.md, Snapshots, has why no interleaving
with producers lets a snapshot row overwrite newer data at a receiver.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from consumer.store.admin import AdminError
from consumer.store.queries import query

__all__ = [
    "CHUNK_SIZE",
    "SnapshotBusyError",
    "SnapshotError",
    "SnapshotState",
    "SnapshotTable",
    "cancel_snapshot",
    "create_snapshot",
    "list_snapshots",
    "mark_history_incomplete",
    "outbox_history_complete",
    "plan_tables",
    "refuse_partial_sweep",
    "snapshot_state",
    "unfinished",
]

# Rows per chunk: each chunk's rows stay locked FOR SHARE until it commits (a few milliseconds
# at this size), so a producer editing one of them waits at most that long.
CHUNK_SIZE = 1000


class SnapshotError(AdminError):
    """A snapshot cannot be asked for or written; the message says why, in one line."""


class SnapshotBusyError(SnapshotError):
    """Another process is writing this snapshot."""


@dataclass(frozen=True)
class SnapshotTable:
    """One table of a snapshot (or of a plan for one)."""

    relation: str
    entity_type: str
    key_column: str
    both_ways: bool
    rows_total: int
    rows_sent: int = 0
    done: bool = False
    relation_oid: int = 0
    position: int = 0


@dataclass(frozen=True)
class SnapshotState:
    """A snapshot as recorded: `state` is running, done or cancelled."""

    id: int
    consumer: str | None
    requested_by: str
    delete_missing: bool
    state: str
    begin_seq: int | None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    tables: tuple[SnapshotTable, ...]

    @property
    def rows_total(self) -> int:
        """Rows of its tables when it was asked for."""
        return sum(t.rows_total for t in self.tables)

    @property
    def rows_sent(self) -> int:
        """Rows written into the outbox so far."""
        return sum(t.rows_sent for t in self.tables)

    @property
    def current(self) -> SnapshotTable | None:
        """The table being sent (the first not done), None when every table is."""
        return next((t for t in self.tables if not t.done), None)

    def describe(self) -> str:
        """One line: id, scope, progress."""
        scope = f"for consumer {self.consumer}" if self.consumer else "for every consumer"
        total = max(self.rows_total, self.rows_sent)
        percent = f" ({100 * self.rows_sent // total}%)" if total else ""
        where = ""
        if self.state == "running":
            current = self.current
            where = f", at {current.relation}" if current else ", ending"
            if self.begin_seq is None:
                where = ", waiting for older transactions to end"
        return (
            f"snapshot {self.id} {scope}: {self.state}, {self.rows_sent} of {total} rows"
            f"{percent}{where}"
        )


async def plan_tables(
    conn: psycopg.AsyncConnection[Any],
    tables: Sequence[str] = (),
    *,
    entity_types: frozenset[str] | None = None,
    uncounted_when_unreadable: bool = False,
) -> list[SnapshotTable]:
    """The tracked tables a snapshot would send, with their row counts now: `tables` as named
    (SnapshotError for a name that is no table, or no tracked one), else every tracked table
    (of `entity_types` only, when given). With `uncounted_when_unreadable`, a table this role
    may not read is planned with a count of 0 instead of failing (the count is for progress
    only; whoever writes the snapshot needs the privilege). On an autocommit connection only."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query("snapshot_tracked"))
        tracked = {row["relation_oid"]: row for row in await cur.fetchall()}
        if tables:
            chosen = []
            for name in tables:
                try:
                    await cur.execute(query("snapshot_resolve"), {"name": name})
                    row = await cur.fetchone()
                except (psycopg.errors.InvalidName, psycopg.errors.SyntaxError) as exc:
                    raise SnapshotError(f"{name!r} is not a table name: {exc}") from exc
                oid = row["relation_oid"] if row else None
                if oid is None:
                    raise SnapshotError(f"no table {name!r}")
                if oid not in tracked:
                    known = ", ".join(r["relation"] for r in tracked.values()) or "none"
                    raise SnapshotError(
                        f"table {name!r} is not tracked (tracked: {known}); track it with "
                        "sync.track first"
                    )
                if tracked[oid] not in chosen:
                    chosen.append(tracked[oid])
        else:
            chosen = [
                row
                for row in tracked.values()
                if entity_types is None or row["entity_type"] in entity_types
            ]
        for row in chosen:
            await _refuse_hidden_rows(cur, row)
        planned = []
        for position, row in enumerate(chosen, 1):
            try:
                # ONLY: an inherited table's children are not its rows (a partitioned table's
                # partitions are).
                await cur.execute(
                    sql.SQL("SELECT count(*) AS n FROM {}{}").format(
                        sql.SQL("" if row["relkind"] == "p" else "ONLY "),
                        sql.Identifier(row["schema_name"], row["table_name"]),
                    )
                )
                counted = await cur.fetchone()
            except psycopg.errors.InsufficientPrivilege:
                if not uncounted_when_unreadable:
                    raise
                counted = None
            planned.append(
                SnapshotTable(
                    relation=row["relation"],
                    entity_type=row["entity_type"],
                    key_column=row["key_column"],
                    both_ways=row["both_ways"],
                    rows_total=int(counted["n"]) if counted else 0,
                    relation_oid=int(row["relation_oid"]),
                    position=position,
                )
            )
    return planned


async def _refuse_hidden_rows(cur: psycopg.AsyncCursor[Any], row: dict[str, Any]) -> None:
    """Row level security that applies to this role would hide rows from the snapshot (and a
    sweep would then delete them at receivers): SnapshotError, to be run by a role it does not
    apply to (the table's owner, a superuser, one with BYPASSRLS)."""
    await cur.execute(query("snapshot_row_security"), {"relation_oid": row["relation_oid"]})
    found = await cur.fetchone()
    if found and found["active"]:
        raise SnapshotError(
            f"table {row['relation']} has row level security that applies to this role: a "
            "snapshot would leave out the rows it hides; run it as the table's owner or a role "
            "with BYPASSRLS"
        )


async def create_snapshot(
    conn: psycopg.AsyncConnection[Any],
    tables: Sequence[SnapshotTable],
    *,
    consumer: str | None = None,
    delete_missing: bool = False,
    requested_by: str = "operator",
) -> int:
    """Record a snapshot of `tables` (from `plan_tables`), for `consumer` only or for every
    consumer; returns its id. Nothing is written into the outbox until `run_snapshot`."""
    if not tables:
        raise SnapshotError("no tracked table to send (track one with sync.track)")
    if delete_missing:
        await refuse_partial_sweep(conn, tables)
    async with conn.transaction():
        cur = await conn.execute(
            query("snapshot_create"),
            {"consumer": consumer, "requested_by": requested_by, "delete_missing": delete_missing},
        )
        row = await cur.fetchone()
        assert row is not None
        snapshot_id = int(row[0])
        for position, table in enumerate(tables, 1):
            await conn.execute(
                query("snapshot_add_table"),
                {
                    "snapshot": snapshot_id,
                    "position": position,
                    "relation_oid": table.relation_oid,
                    "entity_type": table.entity_type,
                    "key_column": table.key_column,
                    "both_ways": table.both_ways,
                    "rows_total": table.rows_total,
                },
            )
    return snapshot_id


async def refuse_partial_sweep(
    conn: psycopg.AsyncConnection[Any], tables: Sequence[SnapshotTable]
) -> None:
    """A sweep deletes, at a receiver, every entity of its type the snapshot did not send: one
    of a tracked table left out of the snapshot would be deleted too. SnapshotError naming it."""
    planned = {t.relation for t in tables}
    types = {t.entity_type for t in tables}
    cur = await conn.execute(query("snapshot_tracked"))
    for row in await cur.fetchall():
        relation, entity_type = row[1], row[2]
        if entity_type in types and relation not in planned:
            raise SnapshotError(
                f"table {relation} is tracked as entity type {entity_type!r} too: with "
                "--delete-missing, a snapshot of that type sends every table of it (name it "
                "as well, or name no table)"
            )


async def list_snapshots(
    conn: psycopg.AsyncConnection[Any],
    *,
    running_only: bool = False,
    snapshot_id: int | None = None,
    limit: int = 20,
) -> list[SnapshotState]:
    """Snapshots, newest first, with their tables' progress."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            query("snapshot_list"),
            {"running_only": running_only, "id": snapshot_id, "limit": limit},
        )
        shots = await cur.fetchall()
        if not shots:
            return []
        await cur.execute(query("snapshot_tables"), {"ids": [s["id"] for s in shots]})
        parts: dict[int, list[SnapshotTable]] = {}
        for row in await cur.fetchall():
            parts.setdefault(row["snapshot_id"], []).append(
                SnapshotTable(
                    relation=row["relation"],
                    entity_type=row["entity_type"],
                    key_column=row["key_column"],
                    both_ways=row["both_ways"],
                    rows_total=int(row["rows_total"]),
                    rows_sent=int(row["rows_sent"]),
                    done=row["done"],
                    position=row["position"],
                )
            )
    return [
        SnapshotState(
            id=int(s["id"]),
            consumer=s["consumer"],
            requested_by=s["requested_by"],
            delete_missing=s["delete_missing"],
            state=s["state"],
            begin_seq=s["begin_seq"],
            created_at=s["created_at"],
            updated_at=s["updated_at"],
            finished_at=s["finished_at"],
            tables=tuple(parts.get(int(s["id"]), ())),
        )
        for s in shots
    ]


async def snapshot_state(conn: psycopg.AsyncConnection[Any], snapshot_id: int) -> SnapshotState:
    """The snapshot `snapshot_id`; SnapshotError when there is none."""
    found = await list_snapshots(conn, snapshot_id=snapshot_id, limit=1)
    if not found:
        raise SnapshotError(f"no snapshot {snapshot_id}")
    return found[0]


async def unfinished(
    conn: psycopg.AsyncConnection[Any],
    *,
    consumer: str | None,
    relations: Sequence[str] | None = None,
    requested_by: str | None = None,
) -> SnapshotState | None:
    """The newest running snapshot for `consumer` (None: for every consumer) of exactly the
    tables `relations` (None: whatever its tables), asked for by `requested_by` (None: anyone):
    the one to resume rather than begin another."""
    wanted = None if relations is None else sorted(relations)
    for shot in await list_snapshots(conn, running_only=True, limit=1000):
        if shot.consumer != consumer:
            continue
        if requested_by is not None and shot.requested_by != requested_by:
            continue
        if wanted is not None and sorted(t.relation for t in shot.tables) != wanted:
            continue
        return shot
    return None


async def cancel_snapshot(conn: psycopg.AsyncConnection[Any], snapshot_id: int) -> SnapshotState:
    """Stop a running snapshot for good: what it wrote stays in the stream, its sweep marker is
    never written. SnapshotError when it is not running."""
    shot = await snapshot_state(conn, snapshot_id)
    cur = await conn.execute(query("snapshot_cancel"), {"id": snapshot_id})
    if await cur.fetchone() is None:
        raise SnapshotError(f"snapshot {snapshot_id} is {shot.state}, not running")
    return await snapshot_state(conn, snapshot_id)


async def outbox_history_complete(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the outbox still holds every change since serversync was installed: no cleanup
    has deleted rows, and no table that already held rows was tracked."""
    cur = await conn.execute(query("outbox_history"))
    row = await cur.fetchone()
    return bool(row[0]) if row else True


async def mark_history_incomplete(conn: psycopg.AsyncConnection[Any], reason: str) -> None:
    """Record that the outbox no longer holds the whole history (the first reason is kept)."""
    await conn.execute(query("outbox_history_incomplete"), {"reason": reason})
