"""Tables tracked both ways (sql/backend/0002_both_directions.sql, functions/track.sql): every
change of a row gets a version in sync.row_versions, a local edit by the hybrid clock (strictly
after every version this node has seen of the row), a receiver's applied change with the version
it came with; the outbox row carries the version as created_at and the origin; deletes and the
old key of a changed key are versions too; a one-way table records an apply's origin through the
outbox column's default. Also the node's name (`serversync migrate --node`) and the entries'
origin on the wire (read_batch, a dead letter's retry)."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from consumer.core.events import DeadLetter, Position
from consumer.store import migrations
from consumer.store.dlq import DlqStore
from consumer.store.outbox import OutboxStore
from consumer.wire.entries import encode_entries
from tests.conftest import cli_env, fetch_all, fetch_value, wait_until
from tests.support.backend import execute
from tests.support.cli import assert_ok, assert_one_line_error, run_cli

NODE = "front"
REMOTE = "back"
MICROSECOND = timedelta(microseconds=1)
OUTBOX = (
    "SELECT op, entity_id, created_at, origin FROM sync.events_outbox"
    " WHERE entity_type = %s ORDER BY txid, seq"
)
VERSIONS = (
    "SELECT entity_id, version_ts, version_node, deleted FROM sync.row_versions"
    " WHERE entity_type = %s ORDER BY entity_id"
)
APPLYING = "SELECT set_config('serversync.origin', %s, true)"
WRITE_VERSION = (
    "INSERT INTO sync.row_versions"
    " (entity_type, entity_id, version_ts, version_node, deleted, applied_xact)"
    " VALUES (%s, %s, %s, %s, %s, pg_current_xact_id())"
    " ON CONFLICT (entity_type, entity_id) DO UPDATE SET version_ts = EXCLUDED.version_ts,"
    " version_node = EXCLUDED.version_node, deleted = EXCLUDED.deleted,"
    " applied_xact = EXCLUDED.applied_xact"
)


async def _setting_table(dsn: str, *, partitioned: bool, name: str = "setting") -> None:
    """A table `settings` (id int key, value text) of this node, tracked both ways."""
    if partitioned:
        create = (
            "CREATE TABLE settings (id int NOT NULL, value text) PARTITION BY RANGE (id);"
            "CREATE TABLE settings_low PARTITION OF settings FOR VALUES FROM (0) TO (100);"
            "CREATE TABLE settings_high PARTITION OF settings FOR VALUES FROM (100) TO (1000);"
        )
    else:
        create = "CREATE TABLE settings (id int PRIMARY KEY, value text);"
    await execute(
        dsn,
        create,
        f"SELECT sync.set_node_name('{NODE}')",
        f"SELECT sync.track('settings', '{name}', 'id', both_ways => true)",
    )


def _strictly_increasing(times: list[datetime]) -> bool:
    return all(a < b for a, b in itertools.pairwise(times))


@pytest.mark.parametrize("partitioned", [False, True], ids=["table", "partitioned"])
async def test_local_edits_get_strictly_increasing_versions_even_in_one_transaction(
    backend_dsn: str, partitioned: bool
) -> None:
    await _setting_table(backend_dsn, partitioned=partitioned)
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        # now() stands still for the whole transaction; the versions may not.
        await conn.execute("INSERT INTO settings VALUES (1, 'a'), (2, 'b')")
        for value in ("c", "d", "e"):
            await conn.execute("UPDATE settings SET value = %s WHERE id = 1", (value,))
        await conn.execute("UPDATE settings SET value = 'f'")  # both rows, one statement
        await conn.commit()
    events = await fetch_all(backend_dsn, OUTBOX, ("setting",))
    for key, count in (("1", 5), ("2", 2)):
        times = [created for _, entity_id, created, _ in events if entity_id == key]
        assert len(times) == count and _strictly_increasing(times), (key, times)
    assert {origin for *_, origin in events} == {None}  # made here
    versions = await fetch_all(backend_dsn, VERSIONS, ("setting",))
    last = {entity_id: created for _, entity_id, created, _ in events}
    assert versions == [("1", last["1"], NODE, False), ("2", last["2"], NODE, False)]


@pytest.mark.parametrize("partitioned", [False, True], ids=["table", "partitioned"])
async def test_a_local_edit_follows_an_applied_version_from_a_clock_ahead(
    backend_dsn: str, partitioned: bool
) -> None:
    """Causality: a version seen from another node whose clock runs an hour ahead is followed
    by the next local edit (by one microsecond), not overtaken by this node's clock."""
    await _setting_table(backend_dsn, partitioned=partitioned)
    ahead = datetime.now(UTC) + timedelta(hours=1)
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute(WRITE_VERSION, ("setting", "7", ahead, REMOTE, False))
        await conn.execute("INSERT INTO settings VALUES (7, 'theirs')")
        await conn.commit()
        await conn.execute("UPDATE settings SET value = 'mine' WHERE id = 7")
        await conn.execute("UPDATE settings SET value = 'mine again' WHERE id = 7")
        await conn.commit()
    assert await fetch_all(backend_dsn, OUTBOX, ("setting",)) == [
        ("upsert", "7", ahead, REMOTE),
        ("upsert", "7", ahead + MICROSECOND, None),
        ("upsert", "7", ahead + 2 * MICROSECOND, None),
    ]
    assert await fetch_all(backend_dsn, VERSIONS, ("setting",)) == [
        ("7", ahead + 2 * MICROSECOND, NODE, False)
    ]


@pytest.mark.parametrize("partitioned", [False, True], ids=["table", "partitioned"])
async def test_an_applied_change_is_relayed_with_its_version_and_origin(
    backend_dsn: str, partitioned: bool
) -> None:
    """The receiver writes the version first, then the row: the outbox row takes the applied
    version as created_at and its node as origin, upserts and deletes alike."""
    await _setting_table(backend_dsn, partitioned=partitioned)
    made = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    gone = made + timedelta(seconds=1)
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute(WRITE_VERSION, ("setting", "3", made, REMOTE, False))
        await conn.execute(WRITE_VERSION, ("setting", "150", made, "other-node", False))
        await conn.execute("INSERT INTO settings VALUES (3, 'x'), (150, 'y')")
        await conn.commit()
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute(WRITE_VERSION, ("setting", "3", gone, REMOTE, True))
        await conn.execute("DELETE FROM settings WHERE id = 3")
        await conn.commit()
    events = await fetch_all(backend_dsn, OUTBOX, ("setting",))
    assert sorted(events[:2]) == [
        ("upsert", "150", made, "other-node"),
        ("upsert", "3", made, REMOTE),
    ]
    assert events[2:] == [("delete", "3", gone, REMOTE)]
    # The versions are the receiver's, untouched by the relay.
    assert await fetch_all(backend_dsn, VERSIONS, ("setting",)) == [
        ("150", made, "other-node", False),
        ("3", gone, REMOTE, True),
    ]


async def test_a_row_an_apply_wrote_no_version_for_is_versioned_as_a_local_edit(
    backend_dsn: str,
) -> None:
    """A change inside an apply transaction that the receiver did not version (one made by a
    trigger of the user's, say) is not lost: it is this node's change."""
    await _setting_table(backend_dsn, partitioned=False)
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute("INSERT INTO settings VALUES (9, 'side effect')")
        await conn.commit()
    [(op, entity_id, created, origin)] = await fetch_all(backend_dsn, OUTBOX, ("setting",))
    assert (op, entity_id, origin) == ("upsert", "9", None)
    assert await fetch_all(backend_dsn, VERSIONS, ("setting",)) == [("9", created, NODE, False)]


async def test_a_versioned_row_an_apply_did_not_write_is_a_local_edit(backend_dsn: str) -> None:
    """A row that already holds a version from the other node, changed inside an apply
    transaction by something other than the receiver (a trigger of the user's): a new local
    version after the stored one, not the stored one again (which the other node would take for
    a change it already has, and drop)."""
    await _setting_table(backend_dsn, partitioned=False)
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute(APPLYING, (REMOTE,))
        ahead = datetime.now(UTC) + timedelta(hours=1)
        await conn.execute(WRITE_VERSION, ("setting", "9", ahead, REMOTE, False))
        await conn.execute("INSERT INTO settings VALUES (9, 'applied')")
        await conn.commit()
        # A later transaction of the receiver's, which versions other rows only.
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute("UPDATE settings SET value = 'side effect' WHERE id = 9")
        await conn.commit()
    events = await fetch_all(backend_dsn, OUTBOX, ("setting",))
    assert [(op, origin) for op, _, _, origin in events] == [("upsert", REMOTE), ("upsert", None)]
    ((_, _, applied, _), (_, _, local, _)) = events
    assert local > applied
    assert await fetch_all(backend_dsn, VERSIONS, ("setting",)) == [("9", local, NODE, False)]


@pytest.mark.parametrize("partitioned", [False, True], ids=["table", "partitioned"])
async def test_deletes_and_the_old_key_of_a_changed_key_are_versions(
    backend_dsn: str, partitioned: bool
) -> None:
    await _setting_table(backend_dsn, partitioned=partitioned)
    await execute(
        backend_dsn,
        "INSERT INTO settings VALUES (1, 'a'), (2, 'b')",
        "UPDATE settings SET id = 5 WHERE id = 1",
        "DELETE FROM settings WHERE id = 2",
        "INSERT INTO settings VALUES (2, 'back again')",
    )
    events = await fetch_all(backend_dsn, OUTBOX, ("setting",))
    assert [(op, entity_id) for op, entity_id, *_ in events] in (
        [("upsert", "1"), ("upsert", "2"), ("delete", "1"), ("upsert", "5"), ("delete", "2"),
         ("upsert", "2")],
        [("upsert", "2"), ("upsert", "1"), ("delete", "1"), ("upsert", "5"), ("delete", "2"),
         ("upsert", "2")],
    )  # fmt: skip
    last = {entity_id: created for _, entity_id, created, _ in events}
    assert await fetch_all(backend_dsn, VERSIONS, ("setting",)) == [
        ("1", last["1"], NODE, True),
        ("2", last["2"], NODE, False),
        ("5", last["5"], NODE, False),
    ]
    for key in ("1", "2"):
        times = [created for _, entity_id, created, _ in events if entity_id == key]
        assert _strictly_increasing(times), (key, times)


async def test_keys_swapped_in_one_statement_are_two_versioned_upserts(backend_dsn: str) -> None:
    """No old key is left behind, so no delete goes out and no version says deleted."""
    await execute(
        backend_dsn,
        "CREATE TABLE swaps (id int UNIQUE DEFERRABLE INITIALLY DEFERRED, value text)",
        f"SELECT sync.set_node_name('{NODE}')",
        "SELECT sync.track('swaps', 'swap', 'id', true)",
        "INSERT INTO swaps VALUES (1, 'a'), (2, 'b')",
        "UPDATE swaps SET id = 3 - id",
    )
    events = await fetch_all(backend_dsn, OUTBOX, ("swap",))
    assert sorted((op, entity_id) for op, entity_id, *_ in events[2:]) == [
        ("upsert", "1"),
        ("upsert", "2"),
    ]
    versions = await fetch_all(backend_dsn, VERSIONS, ("swap",))
    assert [(entity_id, deleted) for entity_id, _, _, deleted in versions] == [
        ("1", False),
        ("2", False),
    ]


async def test_a_one_way_table_written_in_an_apply_records_the_origin(backend_dsn: str) -> None:
    """The outbox column's default: the one-way templates do not change, and a write outside an
    apply transaction (on the same connection, after one) has no origin."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('a', 'b')")
        await conn.commit()
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('c', 'd')")
        await conn.commit()
    rows = await fetch_all(backend_dsn, "SELECT origin FROM sync.events_outbox ORDER BY txid, seq")
    assert rows == [(REMOTE,), (None,)]
    # The one-way relay writes no version.
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.row_versions") == 0


async def test_tracking_both_ways_needs_a_node_name(backend_dsn: str) -> None:
    await execute(backend_dsn, "CREATE TABLE settings (id int PRIMARY KEY, value text)")
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState) as refused:
            await conn.execute("SELECT sync.track('settings', 'setting', 'id', true)")
    assert "has no node name" in str(refused.value)
    assert refused.value.diag.message_hint is not None
    assert "serversync migrate --node" in refused.value.diag.message_hint
    assert await fetch_value(backend_dsn, "SELECT sync.node_name()") is None


async def test_tracked_tables_shows_both_ways_and_sync_track_switches_it(backend_dsn: str) -> None:
    await _setting_table(backend_dsn, partitioned=False)
    listed = (
        "SELECT table_name::text, entity_type, key_column, both_ways FROM sync.tracked_tables"
        " WHERE table_name::text IN ('settings', 'call_logs') ORDER BY 1"
    )
    assert await fetch_all(backend_dsn, listed) == [
        ("call_logs", "call_log", "id", False),
        ("settings", "setting", "id", True),
    ]
    # Tracked again one way: versions are no longer written.
    await execute(
        backend_dsn,
        "SELECT sync.track('settings', 'setting')",
        "INSERT INTO settings VALUES (1, 'a')",
    )
    assert (await fetch_all(backend_dsn, listed))[1] == ("settings", "setting", "id", False)
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.row_versions") == 0


async def test_regenerated_relays_stay_both_ways(empty_dsn: str) -> None:
    """functions/track.sql, applied again, regenerates a both-ways relay as a both-ways one."""
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        await migrations.migrate(conn, ["backend"])
    await _setting_table(empty_dsn, partitioned=True)
    await execute(
        empty_dsn,
        "UPDATE sync.schema_migrations SET checksum = 'changed'"
        " WHERE version = 'functions/track.sql'",
    )
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        applied = await migrations.migrate(conn, ["backend"])
    assert [m.label for m in applied] == ["backend/functions/track.sql"]
    await execute(empty_dsn, "INSERT INTO settings VALUES (1, 'a')")
    assert await fetch_value(empty_dsn, "SELECT both_ways FROM sync.tracked_tables") is True
    assert await fetch_value(empty_dsn, "SELECT count(*) FROM sync.row_versions") == 1


# -- the origin on the wire ----------------------------------------------------------------------


def _row(origin: str | None) -> tuple[Any, ...]:
    created = datetime(2024, 5, 6, 7, 8, 9, tzinfo=UTC)
    return (True, "1", None, 4, "upsert", "t", "k", '{"a":1}', created, origin, None)


def test_an_entry_carries_its_origin_or_this_nodes_name_or_none() -> None:
    [theirs, ours, unnamed] = [
        orjson.loads(encode_entries([_row(origin)], local_node=local))[0]
        for origin, local in ((REMOTE, NODE), (None, NODE), (None, None))
    ]
    assert theirs["origin"] == REMOTE
    assert ours["origin"] == NODE
    assert "origin" not in unnamed
    assert list(unnamed) == ["entityType", "entityId", "op", "seq", "payload", "createdAt"]


async def test_read_batch_and_a_dead_letters_retry_carry_the_origin(backend_dsn: str) -> None:
    await execute(backend_dsn, f"SELECT sync.set_node_name('{NODE}')")
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute(APPLYING, (REMOTE,))
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('a', 'b')")
        await conn.commit()
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('c', 'd')")
        await conn.commit()
    async with AsyncConnectionPool(backend_dsn, min_size=1, max_size=2, open=False) as pool:
        store = OutboxStore(pool)
        local = await store.node_name()
        assert local == NODE

        async def both_readable() -> bool:
            # Another database's open transaction holds the horizon back for a while.
            found = await store.read_batch(Position.start(), 10)
            return found.batch is not None and found.batch.count == 2

        await wait_until(both_readable, what="both events below the read horizon")
        read = await store.read_batch(Position.start(), 10, local_node=local)
        assert read.batch is not None
        entries = orjson.loads(read.batch.entries_json)
        assert [e["origin"] for e in entries] == [REMOTE, NODE]
        unnamed = await store.read_batch(Position.start(), 10)
        assert unnamed.batch is not None
        assert [e.get("origin") for e in orjson.loads(unnamed.batch.entries_json)] == [
            REMOTE,
            None,
        ]
        # Parked as delivered, retried with the origin it was parked with.
        await store.ensure_consumer("frontend-sync")
        leadership = await store.take_leadership("frontend-sync")
        letters = [
            DeadLetter(entry_json=raw, code="HTTP_422", message="refused")
            for raw in read.batch.raw_entries()
        ]
        await store.commit_offset(
            "frontend-sync", leadership.epoch, read.batch.end, 0, parked=letters
        )
        parked = await fetch_all(
            backend_dsn, "SELECT id, origin FROM sync.dlq_messages ORDER BY seq"
        )
        assert [origin for _, origin in parked] == [REMOTE, NODE]
        await execute(backend_dsn, "UPDATE sync.dlq_messages SET origin = NULL")
        dlq = DlqStore.over_pool(pool)
        claimed = await dlq.claim(parked[1][0])
        assert orjson.loads(claimed.batch.entries_json)[0]["origin"] == NODE
        renamed = await dlq.claim(parked[0][0], local_node="elsewhere")
        assert orjson.loads(renamed.batch.entries_json)[0]["origin"] == "elsewhere"


# -- serversync migrate --node -------------------------------------------------------------------


async def test_migrate_names_and_renames_the_node_and_refuses_a_bad_name(
    backend_dsn: str,
) -> None:
    env = cli_env(DATABASE_URL=backend_dsn)
    named = await run_cli("migrate", "--node", "backend", env=env)
    assert_ok(named)
    assert named.stdout.splitlines() == [
        "DATABASE_URL: up to date (backend)",
        "node: backend (named)",
    ]
    assert await fetch_value(backend_dsn, "SELECT sync.node_name()") == "backend"

    again, renamed = [await run_cli("migrate", *args, env=env) for args in
                      (["--node", "backend"], ["--node", "backend-2"])]  # fmt: skip
    assert again.stdout.splitlines()[-1] == "node: backend (unchanged)"
    assert renamed.stdout.splitlines()[-1] == "node: backend-2 (renamed from backend)"
    plain = await run_cli("migrate", env=env)
    assert plain.stdout.splitlines()[-1] == "node: backend-2"

    for bad in ("Backend", "1node", "a" * 64, "no spaces", ""):
        refused = await run_cli("migrate", "--node", bad, env=env)
        assert_one_line_error(refused, 2, "is not a node name")
    assert await fetch_value(backend_dsn, "SELECT sync.node_name()") == "backend-2"


async def test_the_node_name_is_checked_in_the_database_too(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for bad in ("Upper", "", None):
            with pytest.raises(psycopg.errors.InvalidParameterValue, match="is not a node name"):
                await conn.execute("SELECT sync.set_node_name(%s)", (bad,))
        with pytest.raises(psycopg.errors.CheckViolation):
            await conn.execute("INSERT INTO sync.node (name) VALUES ('Bad Name')")
        await conn.execute("SELECT sync.set_node_name('one')")
        with pytest.raises(psycopg.errors.UniqueViolation):
            await conn.execute("INSERT INTO sync.node (one_row, name) VALUES (true, 'two')")
    assert await fetch_value(backend_dsn, "SELECT sync.node_name()") == "one"
