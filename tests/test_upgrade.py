"""Upgrading a database that holds data. A database of a pre-release build (which ran the
migrations that 0001_baseline squashed) is adopted as being at the baseline: nothing written
before is lost, reordered or delivered twice, its dead objects go, its relays are generated
again, and the relay works after. One that ran only part of them is refused in one line. A
migration written after the baseline applies on top of it, alone, keeping what is stored; an
applied migration that was edited is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from consumer.store import migrations
from consumer.store.queries import sql_dir
from tests.conftest import fetch_all, fetch_value, make_settings, running_consumer
from tests.support.backend import execute, insert_calls
from tests.support.waiting import wait_delivered_events

OUTBOX = "SELECT o.txid::text, o.seq, o.op, o.entity_id, o.payload::text FROM sync.events_outbox o"
RECORDS = "SELECT version, name FROM {}.schema_migrations WHERE component = %s ORDER BY version"
TRIGGERS = (
    "SELECT tgname FROM pg_trigger WHERE tgrelid = 'call_logs'::regclass AND NOT tgisinternal"
    " ORDER BY tgname"
)


async def _migrate(dsn: str, component: str = "backend") -> list[migrations.Migration]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return await migrations.migrate(conn, [component])


async def _pending(dsn: str, component: str = "backend") -> list[migrations.Migration]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return await migrations.pending(conn, component)


async def _record_as_prerelease(dsn: str, component: str, names: tuple[str, ...]) -> None:
    """Replace a component's records with those a pre-release build wrote for `names`."""
    table = sql.Identifier(migrations.RECORD_SCHEMA[component], "schema_migrations")
    # One transaction, committed when the block ends.
    async with await psycopg.AsyncConnection.connect(dsn) as conn:
        await conn.execute(
            sql.SQL("DELETE FROM {} WHERE component = %s").format(table), (component,)
        )
        for name in names:
            await conn.execute(
                sql.SQL(
                    "INSERT INTO {} (component, version, name, checksum)"
                    " VALUES (%s, %s, %s, 'pre-release')"
                ).format(table),
                (component, name[:4], name[5:]),
            )


async def _delivered_through(receiver_url: str, dsn: str, total: int) -> None:
    async with running_consumer(make_settings(dsn, receiver_url)) as runtime:
        await wait_delivered_events(runtime, total)


async def test_a_pre_release_database_is_adopted_as_the_baseline_and_keeps_every_event(
    empty_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    dsn = empty_dsn
    await _migrate(dsn)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrations.apply_examples(conn)
    # What a pre-release build left: its records, the generic relay and the created_at index it
    # never dropped, a relay older than today's (no rekey trigger), and a consumer that
    # delivered part of the outbox.
    await insert_calls(dsn, 10, tag="before")
    [(txid, seq)] = await fetch_all(
        dsn, "SELECT o.txid::text, o.seq FROM sync.events_outbox o ORDER BY o.txid, o.seq OFFSET 9"
    )
    await fetch_all(
        dsn,
        "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq, delivered_total)"
        " VALUES ('frontend-sync', %s::xid8, %s, 10) RETURNING consumer",
        (txid, seq),
    )
    await execute(
        dsn,
        "CREATE FUNCTION sync.relay() RETURNS trigger LANGUAGE plpgsql"
        " AS $$ BEGIN RETURN NULL; END $$",
        "CREATE INDEX idx_dlq_messages_created_at ON sync.dlq_messages (created_at)",
        "DROP TRIGGER sync_rekey ON call_logs",
    )
    await _record_as_prerelease(dsn, "backend", migrations.PRERELEASE["backend"])
    await insert_calls(dsn, 20, tag="waiting", transactions=2)
    written = await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq")

    # `serversync run` and the operator commands refuse it, in one line that says what to do.
    with pytest.raises(migrations.MigrationError) as refused:
        await _pending(dsn)
    message = str(refused.value)
    assert "pre-release" in message and "run `serversync migrate`" in message, message
    assert "\n" not in message

    applied = await _migrate(dsn)
    assert [m.label for m in applied] == [
        "backend/0001_baseline (adopted: the schema of the pre-release "
        "0001_outbox .. 0012_relay_least_privilege)",
        "backend/0002_both_directions",
        "backend/0003_snapshots",
        "backend/functions/enqueue.sql",
        "backend/functions/horizon.sql",
        "backend/functions/relay.sql",
        "backend/functions/snapshot.sql",
        "backend/functions/track.sql",
    ]
    assert await _pending(dsn) == []
    assert await fetch_all(dsn, RECORDS.format("sync"), ("backend",)) == [
        (m.version, m.name) for m in migrations.available("backend")
    ]
    assert await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq") == written
    dead = await fetch_all(
        dsn,
        "SELECT to_regprocedure('sync.relay()'), to_regclass('sync.idx_dlq_messages_created_at')",
    )
    assert dead == [(None, None)]
    assert await fetch_all(dsn, TRIGGERS) == [
        ("sync_rekey",),
        ("sync_relay",),
        ("sync_relay_delete",),
        ("sync_relay_update",),
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
    delivered = await fetch_value(
        dsn, "SELECT delivered_total FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'"
    )
    assert delivered == 35


async def test_a_pre_release_receiver_database_is_adopted_with_its_entities(
    receiver_dsn: str,
) -> None:
    dsn = receiver_dsn
    await execute(
        dsn,
        "INSERT INTO ingest.entities (entity_type, entity_id, seq, payload)"
        """ VALUES ('call_log', 'b', 5, '{"status": "old-b"}')""",
    )
    await _record_as_prerelease(dsn, "receiver", migrations.PRERELEASE["receiver"])
    applied = await _migrate(dsn, "receiver")
    assert [(m.label, m.adopted) for m in applied] == [
        (
            "receiver/0001_baseline (adopted: the schema of the pre-release "
            "0001_ingest .. 0002_byte_order_keys)",
            True,
        )
    ]
    assert await fetch_all(dsn, RECORDS.format("ingest"), ("receiver",)) == [("0001", "baseline")]
    live = await fetch_all(dsn, "SELECT entity_id, seq FROM ingest.live_entities")
    assert live == [("b", 5)]


async def test_a_database_that_ran_part_of_the_pre_release_migrations_is_refused(
    backend_dsn: str,
) -> None:
    dsn = backend_dsn
    await _record_as_prerelease(dsn, "backend", migrations.PRERELEASE["backend"][:10])
    recorded = await fetch_all(dsn, RECORDS.format("sync"), ("backend",))
    for attempt in (_migrate, _pending):
        with pytest.raises(migrations.MigrationError) as refused:
            await attempt(dsn)
        message = str(refused.value)
        assert "pre-release" in message and "0010_unattended_delivery" in message, message
        assert "recreate it" in message and "\n" not in message, message
    assert await fetch_all(dsn, RECORDS.format("sync"), ("backend",)) == recorded


@pytest.fixture
def sql_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of sql/ that the runner reads instead, for migrations written after the baseline."""
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    monkeypatch.setattr(migrations, "sql_dir", lambda: copy)
    return copy


async def test_a_migration_after_the_baseline_applies_alone_and_keeps_what_is_stored(
    backend_dsn: str, sql_copy: Path
) -> None:
    dsn = backend_dsn
    await insert_calls(dsn, 3, tag="kept")
    await execute(dsn, "INSERT INTO sync.consumer_offsets (consumer) VALUES ('frontend-sync')")
    written = await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq")
    (sql_copy / "backend" / "0004_pause_consumers.sql").write_text(
        "ALTER TABLE sync.consumer_offsets ADD COLUMN paused boolean NOT NULL DEFAULT false;\n"
    )

    applied = await _migrate(dsn)
    # The function files did not change: they are not applied again.
    assert [m.label for m in applied] == ["backend/0004_pause_consumers"]
    assert await _migrate(dsn) == []
    assert await fetch_all(dsn, OUTBOX + " ORDER BY o.txid, o.seq") == written
    assert await fetch_all(dsn, "SELECT consumer, paused FROM sync.consumer_offsets") == [
        ("frontend-sync", False)
    ]
    await insert_calls(dsn, 1, tag="after")
    assert len(await fetch_all(dsn, OUTBOX)) == 4


async def test_an_applied_migration_that_was_edited_is_refused(
    backend_dsn: str, sql_copy: Path
) -> None:
    baseline = sql_copy / "backend" / "0001_baseline.sql"
    baseline.write_text(baseline.read_text() + "\n-- edited\n")
    for attempt in (_migrate, _pending):
        with pytest.raises(migrations.MigrationError, match="0001_baseline was changed after"):
            await attempt(backend_dsn)
