"""Upgrading a database that holds data: backend 0006 rebuilds the outbox's key and regenerates
every relay, 0007 regenerates them again as statement triggers, 0008 with a wake-up check that
reads a counter, and drops the BRIN, 0009 as one function per operation, 0011 with every name
quoted and every column qualified; nothing written before is lost, reordered or delivered twice,
and the relay works after. Receiver 0002 re-collates the entity keys; stored entities and their
versions stay."""

from __future__ import annotations

import orjson
import psycopg
import pytest

from consumer.app.wiring import open_pool
from consumer.receiver.store import EntityStore
from consumer.store import migrations
from tests.conftest import fetch_all, make_settings, running_consumer, wait_until
from tests.helpers_processes import insert_calls

OUTBOX = "SELECT o.txid::text, o.seq, o.op, o.entity_id, o.payload::text FROM sync.events_outbox o"


async def _delivered_through(receiver_url: str, dsn: str, total: int) -> None:
    async with running_consumer(make_settings(dsn, receiver_url)) as runtime:

        async def caught_up() -> bool:
            return runtime.stats.delivered_events == total

        await wait_until(caught_up, what=f"{total} events delivered")


async def _committed_by_an_older_consumer(dsn: str, count: int) -> None:
    """Where a consumer of the older version stood after delivering the first `count` events.
    (The current consumer needs the current schema: `serversync run` refuses a database with
    pending migrations, so an upgrade migrates before the consumers restart.)"""
    rows = await fetch_all(
        dsn, "SELECT o.txid::text, o.seq FROM sync.events_outbox o ORDER BY o.txid, o.seq"
    )
    txid, seq = rows[count - 1]
    await fetch_all(
        dsn,
        "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq, delivered_total)"
        " VALUES ('frontend-sync', %s::xid8, %s, %s) RETURNING consumer",
        (txid, seq, count),
    )


async def test_upgrading_to_the_lean_outbox_keeps_every_event_and_its_order(
    empty_dsn: str,
    receiver_dsn: str,
    receiver_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dsn = empty_dsn

    # A database as 0005 left it, with a consumer that delivered part of the outbox.
    everything = migrations.available
    monkeypatch.setattr(
        migrations,
        "available",
        lambda component: [
            m for m in everything(component) if component != "backend" or m.version < "0006"
        ],
    )
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrations.migrate(conn, ["backend"])
        await migrations.apply_examples(conn)
    await insert_calls(dsn, 10, tag="before")
    await _committed_by_an_older_consumer(dsn, 10)
    await insert_calls(dsn, 20, tag="waiting", transactions=2)
    written = await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq")

    monkeypatch.undo()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        applied = await migrations.migrate(conn, ["backend"])
    assert [m.version for m in applied] == ["0006", "0007", "0008", "0009", "0010", "0011", "0012"]

    assert await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq") == written
    constraints = await fetch_all(
        dsn,
        "SELECT contype, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = 'sync.events_outbox'::regclass ORDER BY contype",
    )
    assert constraints == [("p", "PRIMARY KEY (txid, seq)")]
    indexes = await fetch_all(
        dsn,
        "SELECT indexname FROM pg_indexes WHERE schemaname = 'sync'"
        " AND tablename = 'events_outbox'",
    )
    assert indexes == [("events_outbox_pkey",)]
    triggers = await fetch_all(
        dsn,
        "SELECT tgname, (tgtype & 1) = 1 AS per_row FROM pg_trigger"
        " WHERE tgrelid = 'call_logs'::regclass AND NOT tgisinternal ORDER BY tgname",
    )
    assert triggers == [
        ("sync_rekey", True),
        ("sync_relay", False),
        ("sync_relay_delete", False),
        ("sync_relay_update", False),
    ]
    await insert_calls(dsn, 5, tag="after")
    # The 20 left waiting and the 5 written since; the first 10 are not sent again.
    await _delivered_through(receiver_url, dsn, 25)
    callers = await fetch_all(
        receiver_dsn,
        "SELECT split_part(payload->>'caller_number', '-', 1), count(*) FROM ingest.entities"
        " GROUP BY 1 ORDER BY 1",
    )
    assert callers == [("after", 5), ("waiting", 20)]
    delivered = await fetch_all(
        dsn, "SELECT delivered_total FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'"
    )
    assert delivered == [(35,)]


def _entries(*entries: tuple[str, int, str]) -> bytes:
    return orjson.dumps(
        {
            "entries": [
                {
                    "entityType": "call_log",
                    "entityId": key,
                    "op": "upsert",
                    "seq": seq,
                    "payload": {"status": status},
                    "createdAt": "2026-11-26T00:00:00Z",
                }
                for key, seq, status in entries
            ]
        }
    )


async def test_upgrading_the_receiver_to_byte_order_keys_keeps_entities_and_their_versions(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """0002 changes the key columns' collation and rebuilds the primary key: what was stored is
    kept, and entries sent again after the upgrade still meet the stored versions."""
    dsn = empty_dsn
    everything = migrations.available
    monkeypatch.setattr(migrations, "available", lambda component: everything(component)[:1])
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrations.migrate(conn, ["receiver"])
    async with open_pool(dsn, "test-upgrade") as pool:
        store = EntityStore(pool)
        assert await store.apply(_entries(("b", 5, "old-b"), ("a", 3, "old-a"))) == 2

        monkeypatch.undo()
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            applied = await migrations.migrate(conn, ["receiver"])
        assert [m.version for m in applied] == ["0002"]

        # A stale copy of "b" changes nothing; "a" moves on; "B" is a key of its own.
        assert await store.apply(_entries(("b", 4, "stale"), ("a", 6, "new-a"), ("B", 1, "x"))) == 2
    live = await fetch_all(
        dsn,
        "SELECT entity_id, seq, payload->>'status' FROM ingest.live_entities ORDER BY entity_id",
    )
    assert live == [("B", 1, "x"), ("a", 6, "new-a"), ("b", 5, "old-b")]
    collations = await fetch_all(
        dsn,
        "SELECT a.attname, c.collname FROM pg_attribute a JOIN pg_collation c"
        " ON c.oid = a.attcollation WHERE a.attrelid = 'ingest.entities'::regclass"
        " AND a.attname IN ('entity_type', 'entity_id') ORDER BY 1",
    )
    assert collations == [("entity_id", "C"), ("entity_type", "C")]
