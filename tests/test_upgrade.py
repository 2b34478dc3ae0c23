"""Upgrading a database that holds events: 0006 rebuilds the outbox's key and regenerates every
relay; nothing written before is lost, reordered or delivered twice, and the relay works after."""

from __future__ import annotations

import psycopg
import pytest

from consumer import migrations
from tests.conftest import fetch_all, make_settings, running_consumer, wait_until
from tests.helpers_processes import insert_calls

OUTBOX = "SELECT o.txid::text, o.seq, o.op, o.entity_id, o.payload::text FROM sync.events_outbox o"


async def _delivered_through(receiver_url: str, dsn: str, total: int) -> None:
    async with running_consumer(make_settings(dsn, receiver_url)) as runtime:

        async def caught_up() -> bool:
            return runtime.stats.delivered_events == total

        await wait_until(caught_up, what=f"{total} events delivered")


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
        await migrations.migrate(conn, ["backend", "voicebot"])
    await insert_calls(dsn, 10, tag="before")
    await _delivered_through(receiver_url, dsn, 10)
    await insert_calls(dsn, 20, tag="waiting", transactions=2)
    written = await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq")

    monkeypatch.undo()
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        applied = await migrations.migrate(conn, ["backend", "voicebot"])
    assert [m.version for m in applied] == ["0006"]

    assert await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq") == written
    constraints = await fetch_all(
        dsn,
        "SELECT contype, pg_get_constraintdef(oid) FROM pg_constraint"
        " WHERE conrelid = 'sync.events_outbox'::regclass ORDER BY contype",
    )
    assert constraints == [("p", "PRIMARY KEY (txid, seq)")]
    await insert_calls(dsn, 5, tag="after")
    # The 20 left waiting and the 5 written since; the first 10 are not sent again.
    await _delivered_through(receiver_url, dsn, 25)
    callers = await fetch_all(
        receiver_dsn,
        "SELECT split_part(payload->>'caller_number', '-', 1), count(*) FROM ingest.entities"
        " GROUP BY 1 ORDER BY 1",
    )
    assert callers == [("after", 5), ("before", 10), ("waiting", 20)]
    delivered = await fetch_all(
        dsn, "SELECT delivered_total FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'"
    )
    assert delivered == [(35,)]
