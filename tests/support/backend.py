"""The backend database as the tests write and read it: call logs written as a producer would,
the outbox's rows and end, a consumer's committed offset and leader, and a frontend-sync consumer
running in this event loop."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from consumer.core.events import Position
from consumer.runtime.worker import ConsumerRuntime
from tests.conftest import fetch_all, fetch_value, make_settings, running_consumer, wait_until

CONSUMER = "frontend-sync"
# The in-process consumers' retry delays: short, so that retries play out in well under a second.
RETRY_INITIAL_SEC = 0.05
RETRY_MAX_SEC = 0.4


async def execute(
    dsn: str, *statements: str | bytes | sql.SQL | sql.Composed, params: Any = None
) -> None:
    """Each statement in order on one short-lived autocommit connection (each its own
    transaction). A str may hold several statements when no `params` are given."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        for statement in statements:
            # A str built at run time is no LiteralString: as bytes psycopg takes it as it is.
            await conn.execute(
                statement.encode() if isinstance(statement, str) else statement, params
            )


# -- what producers write --------------------------------------------------------------------


async def insert_calls(dsn: str, count: int, *, tag: str = "c", transactions: int = 1) -> None:
    """`count` call_logs inserts (one event each, caller numbers TAG-1, TAG-2, ...), spread over
    `transactions` transactions."""
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


async def insert_call(dsn: str, caller: str) -> str:
    """One committed call_logs row (one upsert event, one NOTIFY); returns its id."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, '03') "
            "RETURNING id::text",
            (caller,),
        )
        row = await cur.fetchone()
    assert row is not None
    return str(row[0])


async def insert_callers(dsn: str, callers: list[str]) -> None:
    """One call log per caller number, all in one transaction (one batch for the consumer)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) "
            "SELECT c, 'x' FROM unnest(%s::text[]) WITH ORDINALITY AS u(c, n) ORDER BY n",
            (callers,),
        )


async def add_events(dsn: str, n: int, tag: str = "e", *, wait_final: bool = True) -> None:
    """`n` call logs, each inserted in its own transaction (one event each, caller numbers TAG0,
    TAG1, ...); unless `wait_final` is False, returns once every event is final (no older
    transaction anywhere on the shared server is still open)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        for i in range(n):
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                (f"{tag}{i}",),
            )

    async def final() -> bool:
        held = await fetch_value(
            dsn,
            "SELECT count(*) FROM sync.events_outbox "
            "WHERE txid >= pg_snapshot_xmin(pg_current_snapshot())",
        )
        return bool(held == 0)

    # Offset resets and cleanups only move over final events: other tests' open transactions
    # must not skew their counts.
    if wait_final:
        await wait_until(final, timeout=30, what="the new events to become final")


# -- the outbox ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class OutboxRow:
    """One outbox row: where it stands in delivery order, and what it is about."""

    txid: int
    seq: int
    entity_type: str
    entity_id: str
    op: str


async def outbox_in_delivery_order(dsn: str) -> list[OutboxRow]:
    """Every outbox row, in the documented delivery order (txid, seq)."""
    rows = await fetch_all(
        dsn,
        # Qualified: a bare `txid` in ORDER BY would be the text output column.
        "SELECT o.txid::text, o.seq, o.entity_type, o.entity_id, o.op "
        "FROM sync.events_outbox o ORDER BY o.txid, o.seq",
    )
    return [OutboxRow(int(t), s, et, eid, op) for t, s, et, eid, op in rows]


async def outbox_seqs(dsn: str) -> list[int]:
    """Every seq in the outbox."""
    return [row[0] for row in await fetch_all(dsn, "SELECT seq FROM sync.events_outbox")]


async def outbox_end(dsn: str) -> tuple[int, int] | None:
    """(txid, seq) of the last event in delivery order; None while the outbox is empty."""
    rows = await fetch_all(
        dsn,
        # ORDER BY o.txid: a bare `txid` would name the text output column.
        "SELECT o.txid::text, o.seq FROM sync.events_outbox o "
        "ORDER BY o.txid DESC, o.seq DESC LIMIT 1",
    )
    return (int(rows[0][0]), rows[0][1]) if rows else None


async def seqs_by_caller(dsn: str) -> dict[str, int]:
    """caller_number -> seq of its call_logs event."""
    rows = await fetch_all(
        dsn, "SELECT payload->>'caller_number', seq FROM sync.events_outbox ORDER BY seq"
    )
    return {str(caller): int(seq) for caller, seq in rows}


# -- a consumer's row in sync.consumer_offsets ----------------------------------------------------


async def offset(dsn: str, consumer: str = CONSUMER) -> Position | None:
    """The consumer's committed offset; None before it first ran."""
    rows = await fetch_all(
        dsn,
        "SELECT last_txid::text, last_seq FROM sync.consumer_offsets WHERE consumer = %s",
        (consumer,),
    )
    return Position(int(rows[0][0]), rows[0][1]) if rows else None


async def committed_position(dsn: str, consumer: str = CONSUMER) -> tuple[int, int]:
    """(txid, seq) the consumer committed, comparable with outbox_end(); (0, 0) before it ran."""
    position = await offset(dsn, consumer)
    return (position.txid, position.seq) if position is not None else (0, 0)


async def offsets_row(dsn: str, consumer: str = CONSUMER) -> dict[str, Any]:
    """The consumer's position, epoch and leader ({} before it first ran)."""
    rows = await fetch_all(
        dsn,
        "SELECT last_txid::text, last_seq, leader_epoch, leader_pid, leader_host "
        "FROM sync.consumer_offsets WHERE consumer = %s",
        (consumer,),
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


async def last_error(dsn: str, consumer: str = CONSUMER) -> str | None:
    """The consumer's last recorded delivery error (cleared by the next commit)."""
    rows = await fetch_all(
        dsn, "SELECT last_error FROM sync.consumer_offsets WHERE consumer = %s", (consumer,)
    )
    return rows[0][0] if rows else None


async def leader_lock_holders(dsn: str, consumer: str = CONSUMER) -> list[str]:
    """application_name of every connection holding the consumer's leader lock."""
    rows = await fetch_all(
        dsn,
        "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2 "
        "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database()) "
        "AND l.classid = hashtext('serversync.consumer')::oid "
        "AND l.objid = hashtext(%s)::oid",
        (consumer,),
    )
    return [row[0] for row in rows]


# -- a consumer in this event loop ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def consuming(dsn: str, url: str, **overrides: Any) -> AsyncIterator[ConsumerRuntime]:
    """An in-process frontend-sync consumer delivering to `url`, with short retry delays
    (RETRY_INITIAL_SEC, RETRY_MAX_SEC) unless `overrides` set others."""
    fast = {"SYNC_RETRY_INITIAL_SEC": RETRY_INITIAL_SEC, "SYNC_RETRY_MAX_SEC": RETRY_MAX_SEC}
    settings = make_settings(dsn, url, **{**fast, **overrides})
    async with running_consumer(settings) as runtime:
        yield runtime


async def burn_xids_past_a_power_of_ten(dsn: str) -> None:
    """Consume xids until the next one has one more decimal digit than the current one."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute("SELECT pg_current_xact_id()::text")
        row = await cur.fetchone()
        assert row is not None
        xid = int(row[0])
        needed = 10 ** len(str(xid)) - xid
        if needed > 300_000:
            pytest.skip(f"xid {xid} is {needed} xids short of a power of ten; too slow to burn")
        await conn.execute(
            sql.SQL(
                "DO $$ BEGIN FOR i IN 1..{} LOOP PERFORM pg_current_xact_id(); COMMIT; "
                "END LOOP; END $$"
            ).format(sql.Literal(needed))
        )
