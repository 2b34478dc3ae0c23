"""Operator queries: consumer status, the read horizon, and offset resets (Kafka's model)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from consumer.core.events import Position
from consumer.store.queries import query


class AdminError(Exception):
    """An operator command cannot be carried out; the message says why, in one line."""


class UnknownConsumerError(AdminError):
    """No consumer of that name is registered: bad input, as a bad option is."""


# Backlogs up to this many events are counted exactly; larger ones are estimated from seq
# numbers (sql/queries.sql, consumer_status), so that reading them costs the same at any size.
EXACT_BACKLOG_UP_TO = 10_000


async def consumer_status(
    conn: psycopg.AsyncConnection[Any],
    consumer: str | None = None,
    *,
    exact_up_to: int = EXACT_BACKLOG_UP_TO,
) -> list[dict[str, Any]]:
    """One dict per consumer: position, backlog (exact up to `exact_up_to` events, else an
    estimate, with `backlog_estimated` set), lag, leader, last error."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            query("consumer_status"), {"consumer": consumer, "exact_up_to": exact_up_to}
        )
        rows = await cur.fetchall()
    for row in rows:
        row["running"] = row["lock_backend_pid"] is not None
    return rows


async def outbox_stats(conn: psycopg.AsyncConnection[Any]) -> dict[str, Any]:
    """outbox_rows (an estimate) and oldest_age_seconds (None when the outbox is empty)."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query("outbox_stats"))
        row = await cur.fetchone()
    assert row is not None
    return row


async def horizon(conn: psycopg.AsyncConnection[Any], limit: int = 3) -> dict[str, Any]:
    """Committed events held back by older open transactions (held_back_events: exact up to
    EXACT_BACKLOG_UP_TO, else an estimate, with held_back_estimated set), the age of the oldest,
    and those transactions."""
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query("horizon_state"))
        state = await cur.fetchone() or {}
        blockers: list[dict[str, Any]] = []
        if state.get("held_back_events"):
            await cur.execute(query("horizon_blockers"), {"limit": limit})
            blockers = await cur.fetchall()
    return {**state, "blockers": blockers}


@dataclass(frozen=True)
class ResetPlan:
    """Where a reset moves a consumer, and how many events that replays (or skips)."""

    consumer: str
    current: Position
    target: Position
    replayed: int
    skipped: int


async def _position(cur: psycopg.AsyncCursor[Any]) -> Position | None:
    row = await cur.fetchone()
    return Position(int(row[0]), int(row[1])) if row else None


async def _latest(conn: psycopg.AsyncConnection[Any]) -> Position:
    return await _position(await conn.execute(query("position_latest"))) or Position.start()


async def _horizon_floor(conn: psycopg.AsyncConnection[Any]) -> Position:
    """Nothing may be placed beyond this: rows of open transactions could still land behind it."""
    row = await (await conn.execute(query("horizon_xmin"))).fetchone()
    assert row is not None
    return Position(int(row[0]), 0)


async def plan_reset(
    conn: psycopg.AsyncConnection[Any],
    consumer: str,
    *,
    to_earliest: bool = False,
    to_latest: bool = False,
    to_seq: int | None = None,
    to_datetime: datetime | None = None,
    shift_by: int | None = None,
) -> ResetPlan:
    """Work out a reset without changing anything (exactly one target option must be given)."""
    chosen = [
        to_earliest,
        to_latest,
        to_seq is not None,
        to_datetime is not None,
        shift_by is not None,
    ]
    if sum(chosen) != 1:
        raise AdminError(
            "give exactly one of --to-earliest, --to-latest, --to-seq, --to-datetime, --shift-by"
        )
    rows = await consumer_status(conn, consumer)
    if not rows:
        known = [r["consumer"] for r in await consumer_status(conn)]
        raise UnknownConsumerError(
            f"no consumer named {consumer!r} (known: {', '.join(known) or 'none'})"
        )
    current = Position(int(rows[0]["last_txid"]), int(rows[0]["last_seq"]))

    target: Position | None
    if to_earliest:
        target = Position.start()
    elif to_latest:
        target = await _latest(conn)
    elif to_seq is not None:
        if to_seq < 0:
            raise AdminError("--to-seq must be 0 or more")
        target = await _position(await conn.execute(query("position_before_seq"), {"seq": to_seq}))
    elif to_datetime is not None:
        target = await _position(
            await conn.execute(query("position_before_time"), {"at": to_datetime})
        )
    else:
        assert shift_by is not None
        target = await _shift(conn, current, shift_by)
    if target is None:  # nothing at or after the requested point: the end
        target = await _latest(conn)
    target = min(target, max(await _horizon_floor(conn), current))

    replayed = skipped = 0
    if target < current:
        replayed = await _count_between(conn, target, current)
    elif target > current:
        skipped = await _count_between(conn, current, target)
    return ResetPlan(consumer, current, target, replayed, skipped)


async def _shift(conn: psycopg.AsyncConnection[Any], current: Position, by: int) -> Position | None:
    params = {"txid": str(current.txid), "seq": current.seq, "n": abs(by)}
    if by == 0:
        return current
    if by > 0:
        return await _position(await conn.execute(query("position_forward"), params))
    return await _position(await conn.execute(query("position_backward"), params)) or (
        Position.start()
    )


async def _count_between(conn: psycopg.AsyncConnection[Any], a: Position, b: Position) -> int:
    cur = await conn.execute(
        query("count_between"),
        {"a_txid": str(a.txid), "a_seq": a.seq, "b_txid": str(b.txid), "b_seq": b.seq},
    )
    row = await cur.fetchone()
    return int(row[0]) if row else 0


@contextlib.asynccontextmanager
async def holding_consumer_lock(
    conn: psycopg.AsyncConnection[Any], consumer: str
) -> AsyncIterator[None]:
    """Hold the consumer's leader lock, so that no leader runs meanwhile; refuse if one does.

    `conn` must be in autocommit mode.
    """
    cur = await conn.execute(query("try_leader_lock"), {"consumer": consumer})
    row = await cur.fetchone()
    if not row or not row[0]:
        running = await consumer_status(conn, consumer)
        who = ""
        if running and running[0]["leader_pid"]:
            who = f" (pid {running[0]['leader_pid']} on {running[0]['leader_host']})"
        raise AdminError(f"consumer {consumer} is running{who}; stop it first")
    try:
        yield
    finally:
        await conn.execute(query("unlock_leader"), {"consumer": consumer})


async def apply_reset(conn: psycopg.AsyncConnection[Any], plan: ResetPlan) -> None:
    """Move the offset as planned (call while holding_consumer_lock)."""
    await conn.execute(
        query("set_position"),
        {"consumer": plan.consumer, "txid": str(plan.target.txid), "seq": plan.target.seq},
    )
