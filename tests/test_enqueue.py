"""sync.enqueue (sql/backend/functions/enqueue.sql): an event that is not a row, written in the
caller's transaction in the relay's order, waking a waiting consumer as the relay does, written
once per idempotency key (sequentially and concurrently), with the origin of an apply
transaction; `serversync cleanup` removes keys with the outbox rows of the same age. Who may call
it: tests/test_privileges.py."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import psycopg
import pytest

from consumer.store import retention
from consumer.store.queries import query
from tests.conftest import fetch_all, fetch_value, wait_until
from tests.support.backend import execute

ENQUEUE = "SELECT sync.enqueue(%s, %s, %s::json, %s, %s)"
EVENTS = "SELECT txid, seq, op, entity_type, entity_id, payload::text FROM sync.events_outbox"


async def _enqueue(
    conn: psycopg.AsyncConnection[Any],
    entity_id: str,
    *,
    key: str | None = None,
    op: str = "upsert",
    payload: str = '{"n": 1}',
) -> int | None:
    row = await (await conn.execute(ENQUEUE, ("notice", entity_id, payload, op, key))).fetchone()
    assert row is not None
    value = row[0]
    assert value is None or isinstance(value, int)
    return value


async def test_an_event_takes_its_place_among_the_transactions_changes(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('1', 'x')")
        seq = await _enqueue(conn, "n-1", payload='{"text": "between"}')
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('2', 'x')")
        await conn.commit()
        rolled_back = await _enqueue(conn, "n-2")
        await conn.rollback()
    rows = await fetch_all(backend_dsn, EVENTS + " ORDER BY txid, seq")
    assert [(op, entity_type) for _, _, op, entity_type, _, _ in rows] == [
        ("upsert", "call_log"),
        ("upsert", "notice"),
        ("upsert", "call_log"),
    ]
    assert len({txid for txid, *_ in rows}) == 1  # one transaction, one txid
    assert rows[1][1:] == (seq, "upsert", "notice", "n-1", '{"text": "between"}')
    assert rolled_back is not None and rolled_back > rows[-1][1]
    # Whose origin: none here; an apply transaction's node inside one.
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute("SELECT set_config('serversync.origin', 'back', true)")
        applied = await _enqueue(conn, "n-3", op="delete")
        await conn.commit()
    origins = await fetch_all(
        backend_dsn, "SELECT seq, op, origin FROM sync.events_outbox WHERE entity_type = 'notice'"
    )
    assert sorted(origins) == [(seq, "upsert", None), (applied, "delete", "back")]


async def test_an_event_wakes_a_waiting_consumer(backend_dsn: str) -> None:
    listener = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with listener:
        await listener.execute("LISTEN sync_outbox")
        await execute(
            backend_dsn,
            query("set_waiting"),
            params={"consumer": "frontend-sync", "waiting": True},
        )
        conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
        async with conn:
            await _enqueue(conn, "wake")

        async def woken() -> bool:
            return [n.payload async for n in listener.notifies(timeout=0.3)] == [""]

        await wait_until(woken, what="the NOTIFY of an enqueued event")


async def test_a_repeated_key_writes_nothing_and_returns_null(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        first = await _enqueue(conn, "k", key="order-17")
        assert first is not None
        assert await _enqueue(conn, "k", key="order-17") is None  # the same transaction
        await conn.commit()
        assert await _enqueue(conn, "other", key="order-17", op="delete") is None  # a later one
        assert await _enqueue(conn, "k", key="order-18") is not None  # another key
        assert await _enqueue(conn, "k") is not None  # no key: always written
        assert await _enqueue(conn, "k") is not None
        await conn.commit()
    rows = await fetch_all(backend_dsn, EVENTS + " WHERE entity_type = 'notice'")
    assert len(rows) == 4
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.enqueue_keys") == 2


async def _blocked_on_a_lock(dsn: str, pid: int) -> bool:
    found = await fetch_value(
        dsn, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s", (pid,)
    )
    return bool(found)


@pytest.mark.parametrize("first_ends", ["commit", "rollback"])
async def test_concurrent_enqueues_of_one_key_write_one_event(
    backend_dsn: str, first_ends: str
) -> None:
    """The second waits for the first transaction: NULL once it committed, its own event once
    it rolled back."""
    first = await psycopg.AsyncConnection.connect(backend_dsn)
    second = await psycopg.AsyncConnection.connect(backend_dsn)
    async with first, second:
        assert await _enqueue(first, "a", key="once") is not None
        racing = asyncio.create_task(_enqueue(second, "b", key="once"))
        await wait_until(
            lambda: _blocked_on_a_lock(backend_dsn, second.info.backend_pid),
            what="the second enqueue to wait for the first",
        )
        assert not racing.done()
        await (first.commit() if first_ends == "commit" else first.rollback())
        result = await asyncio.wait_for(racing, timeout=10)
        await second.commit()
    ids = [row[4] for row in await fetch_all(backend_dsn, EVENTS + " ORDER BY txid, seq")]
    if first_ends == "commit":
        assert result is None and ids == ["a"]
    else:
        assert result is not None and ids == ["b"]


REFUSED = [
    (("not an identifier", "1", "{}", "upsert"), psycopg.errors.InvalidParameterValue),
    ((None, "1", "{}", "upsert"), psycopg.errors.InvalidParameterValue),
    (("notice", "", "{}", "upsert"), psycopg.errors.CheckViolation),
    (("notice", None, "{}", "upsert"), psycopg.errors.CheckViolation),
    (("notice", "1", "{}", "insert"), psycopg.errors.InvalidParameterValue),
    (("notice", "1", None, "upsert"), psycopg.errors.NotNullViolation),
]


@pytest.mark.parametrize(("arguments", "error"), REFUSED)
async def test_what_the_outbox_readers_rely_on_is_refused(
    backend_dsn: str, arguments: tuple[str | None, ...], error: type[Exception]
) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        with pytest.raises(error, match=r"^sync\.enqueue: "):
            await conn.execute(ENQUEUE, (*arguments, "refused-key"))
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == 0
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.enqueue_keys") == 0


async def test_cleanup_removes_keys_older_than_the_retention(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for key in ("old-1", "old-2", "young"):
            await _enqueue(conn, key, key=key)
        await conn.execute(
            "UPDATE sync.enqueue_keys SET created_at = now() - interval '40 days'"
            " WHERE idempotency_key LIKE 'old-%'"
        )
        planned = await retention.cleanup(conn, older_than=timedelta(days=30), dry_run=True)
        assert (planned.enqueue_keys_old, planned.enqueue_keys_deleted) == (2, 0)
        assert "would delete 0 resolved dead letter(s) and 2 idempotency key(s)" in (
            planned.summary()
        )
        report = await retention.cleanup(conn, older_than=timedelta(days=30), batch_size=1)
        assert report.to_dict()["enqueue_keys"] == {"old": 2, "deleted": 2, "batches": 2}
        # An old key may be used again; a young one still stops a repeat.
        assert await _enqueue(conn, "again", key="old-1") is not None
        assert await _enqueue(conn, "again", key="young") is None
    keys = await fetch_all(backend_dsn, "SELECT idempotency_key FROM sync.enqueue_keys ORDER BY 1")
    assert keys == [("old-1",), ("young",)]
