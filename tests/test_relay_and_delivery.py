"""The relay trigger and the simplest end-to-end path: backend change -> receiver row."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from tests.conftest import fetch_all, fetch_value, make_settings, running_consumer
from tests.support.waiting import wait_delivered_events


async def test_insert_update_delete_are_relayed_in_order(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        cur = await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('0901', '03') "
            "RETURNING id::text"
        )
        row = await cur.fetchone()
        assert row is not None
        call_id = row[0]
        await conn.execute("UPDATE call_logs SET status = 'done' WHERE id = %s", (call_id,))
        await conn.execute("DELETE FROM call_logs WHERE id = %s", (call_id,))
    rows = await fetch_all(
        backend_dsn,
        "SELECT op, entity_type, entity_id, payload->>'status' "
        "FROM sync.events_outbox ORDER BY seq",
    )
    assert rows == [
        ("upsert", "call_log", call_id, "in_progress"),
        ("upsert", "call_log", call_id, "done"),
        ("delete", "call_log", call_id, "done"),
    ]


async def test_rolled_back_changes_leave_no_event(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn)
    async with conn:
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('1', '2')")
        await conn.rollback()
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == 0


async def test_key_change_emits_delete_of_old_key(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "INSERT INTO registered_numbers (id, phone_number) "
            "VALUES ('00000000-0000-0000-0000-000000000001', '0311')"
        )
        await conn.execute(
            "UPDATE registered_numbers SET id = '00000000-0000-0000-0000-000000000002'"
        )
    rows = await fetch_all(backend_dsn, "SELECT op, entity_id FROM sync.events_outbox ORDER BY seq")
    assert rows == [
        ("upsert", "00000000-0000-0000-0000-000000000001"),
        ("delete", "00000000-0000-0000-0000-000000000001"),
        ("upsert", "00000000-0000-0000-0000-000000000002"),
    ]


REKEY_COLUMNS = (
    "SELECT t.tgattr::text FROM pg_trigger t WHERE t.tgname = 'sync_rekey'"
    " AND t.tgrelid = %s::regclass"
)


async def test_a_key_changed_by_a_before_trigger_still_emits_the_delete_of_the_old_key(
    backend_dsn: str,
) -> None:
    # The rekey trigger fires only for UPDATEs that name the key column, unless the table has a
    # BEFORE UPDATE row trigger when it is tracked: that one may change the key unnamed.
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for table in ("plain_keys", "moved_keys"):
            await conn.execute(
                sql.SQL("CREATE TABLE {} (code text PRIMARY KEY, note text)").format(
                    sql.Identifier(table)
                )
            )
        await conn.execute(
            "CREATE FUNCTION move_key() RETURNS trigger LANGUAGE plpgsql AS $$"
            " BEGIN NEW.code := NEW.code || '-moved'; RETURN NEW; END $$"
        )
        await conn.execute(
            "CREATE TRIGGER move_key BEFORE UPDATE ON moved_keys"
            " FOR EACH ROW EXECUTE FUNCTION move_key()"
        )
        for table in ("plain_keys", "moved_keys"):
            await conn.execute("SELECT sync.track(%s::regclass, %s, 'code')", (table, table))
            await conn.execute(
                sql.SQL("INSERT INTO {} VALUES ('k', 'a')").format(sql.Identifier(table))
            )
            await conn.execute(sql.SQL("UPDATE {} SET note = 'b'").format(sql.Identifier(table)))
    assert await fetch_value(backend_dsn, REKEY_COLUMNS, ("plain_keys",)) == "1"
    assert await fetch_value(backend_dsn, REKEY_COLUMNS, ("moved_keys",)) == ""
    events = "SELECT op, entity_id FROM sync.events_outbox WHERE entity_type = %s ORDER BY seq"
    assert await fetch_all(backend_dsn, events, ("plain_keys",)) == [
        ("upsert", "k"),
        ("upsert", "k"),
    ]
    assert await fetch_all(backend_dsn, events, ("moved_keys",)) == [
        ("upsert", "k"),
        ("delete", "k"),
        ("upsert", "k-moved"),
    ]


async def _notifications(dsn: str, writes: list[str], *, setup: str | None = None) -> list[str]:
    """Payloads of the sync_outbox notifications that one transaction of `writes` sends."""
    listener = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with listener:
        await listener.execute("LISTEN sync_outbox")
        writer = await psycopg.AsyncConnection.connect(dsn)
        async with writer:
            if setup:
                await writer.execute(setup.encode())
            for statement in writes:
                await writer.execute(statement.encode())
            await writer.commit()
        return [n.payload async for n in listener.notifies(timeout=0.3)]


MANY_ROWS = (
    "INSERT INTO call_logs (caller_number, callee_number) "
    "SELECT 'c' || g, 'x' FROM generate_series(1, 50) g"
)
WAITING = (
    "INSERT INTO sync.consumer_waits (consumer, waiting) VALUES ('frontend-sync', true) RETURNING 1"
)


async def test_one_notify_per_transaction_and_no_event_data(backend_dsn: str) -> None:
    await fetch_all(backend_dsn, WAITING)
    assert await _notifications(backend_dsn, [MANY_ROWS, MANY_ROWS]) == [""]


async def test_no_notify_while_no_consumer_waits(backend_dsn: str) -> None:
    assert await _notifications(backend_dsn, [MANY_ROWS]) == []
    await fetch_all(
        backend_dsn,
        "INSERT INTO sync.consumer_waits (consumer, waiting) VALUES ('frontend-sync', false) "
        "RETURNING 1",
    )
    assert await _notifications(backend_dsn, [MANY_ROWS]) == []


async def test_notify_mode_setting_overrides_the_policy(backend_dsn: str) -> None:
    assert await _notifications(backend_dsn, [MANY_ROWS], setup="SET sync.notify = 'always'") == [
        ""
    ]
    await fetch_all(backend_dsn, WAITING)
    assert await _notifications(backend_dsn, [MANY_ROWS], setup="SET sync.notify = 'off'") == []


async def test_notify_sent_after_a_rolled_back_savepoint(backend_dsn: str) -> None:
    # The first row's check and its NOTIFY vanish with the savepoint; the next row checks again.
    await fetch_all(backend_dsn, WAITING)
    writes = ["SAVEPOINT s", MANY_ROWS, "ROLLBACK TO SAVEPOINT s", MANY_ROWS]
    assert await _notifications(backend_dsn, writes) == [""]


async def test_track_custom_table_with_own_key_and_untrack(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute("CREATE TABLE widgets (code text PRIMARY KEY, colour text)")
        await conn.execute("SELECT sync.track('public.widgets', 'widget', 'code')")
        await conn.execute("INSERT INTO widgets VALUES ('w-1', 'red')")
        await conn.execute("SELECT sync.untrack('public.widgets')")
        await conn.execute("INSERT INTO widgets VALUES ('w-2', 'blue')")
        with pytest.raises(psycopg.errors.UndefinedColumn, match="has no column"):
            await conn.execute("SELECT sync.track('public.widgets', 'widget', 'nope')")
    rows = await fetch_all(
        backend_dsn, "SELECT entity_type, entity_id, payload FROM sync.events_outbox"
    )
    assert rows == [("widget", "w-1", {"code": "w-1", "colour": "red"})]


async def test_changes_reach_the_receiver(
    backend_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    settings = make_settings(backend_dsn, receiver_url)
    async with running_consumer(settings) as runtime:
        conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
        async with conn:
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) "
                "SELECT 'c' || g, 'x' FROM generate_series(1, 250) g"
            )
            await conn.execute("UPDATE call_logs SET status = 'done' WHERE caller_number = 'c1'")
            await conn.execute("DELETE FROM call_logs WHERE caller_number = 'c2'")
        await wait_delivered_events(runtime, 252)
        # Woken by NOTIFY, not by the 30 s poll timer.
        assert runtime.stats.poll_wakeups == 0
    live = await fetch_all(
        receiver_dsn,
        "SELECT payload->>'caller_number', payload->>'status' FROM ingest.live_entities "
        "WHERE entity_type = 'call_log' ORDER BY 1",
    )
    assert len(live) == 249
    assert ("c1", "done") in live
    assert all(caller != "c2" for caller, _ in live)
    tombstone = await fetch_all(
        receiver_dsn, "SELECT deleted, payload FROM ingest.entities WHERE deleted"
    )
    assert tombstone == [(True, None)]
    offset = await fetch_value(
        backend_dsn, "SELECT last_seq FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'"
    )
    assert offset == 252


async def test_the_generated_relay_writes_each_key_as_its_json_text(backend_dsn: str) -> None:
    """sync.track writes a relay per table (sql/backend/functions/track.sql) that reads the key
    straight from the row: the entity id must still be the key's JSON text, as `payload ->> key`
    gives it, for keys of any type and for column names that would end a dollar quote or an
    identifier."""
    keys = {
        "k_bigint": ("bigint", "42"),
        "k_int": ("integer", "-7"),
        "k_smallint": ("smallint", "3"),
        "k_varchar": ("varchar(20)", "'v-1'"),
        "k_date": ("date", "'2026-01-02'"),
        "k_uuid": ("uuid", "'6f1c2b9e-0a4d-4c1e-9a57-1d2f3e4a5b6c'"),
        "k_numeric": ("numeric", "1.50"),
        "k_time": ("timestamptz", "'2026-01-02 03:04:05.5+09'"),
        "k_text": ("text", "E'caf\\u00e9 \"quoted\" $body$'"),
        'we$body$ird"id': ("text", "'odd-1'"),
    }
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for index, (column, (kind, value)) in enumerate(keys.items()):
            table = f"keyed_{index}"
            await conn.execute(
                sql.SQL("CREATE TABLE {} ({} {} PRIMARY KEY, note text)").format(
                    sql.Identifier(table), sql.Identifier(column), sql.SQL(kind)
                )
            )
            await conn.execute(
                "SELECT sync.track(%s::regclass, %s, %s)", (table, f"keyed{index}", column)
            )
            await conn.execute(
                sql.SQL("INSERT INTO {} VALUES ({}, 'a')").format(
                    sql.Identifier(table), sql.SQL(value)
                )
            )
            await conn.execute(sql.SQL("UPDATE {} SET note = 'b'").format(sql.Identifier(table)))
            await conn.execute(sql.SQL("DELETE FROM {}").format(sql.Identifier(table)))
    for index, column in enumerate(keys):
        events = await fetch_all(
            backend_dsn,
            "SELECT op, entity_id, payload ->> %s FROM sync.events_outbox "
            "WHERE entity_type = %s ORDER BY seq",
            (column, f"keyed{index}"),
        )
        assert [op for op, _, _ in events] == ["upsert", "upsert", "delete"], column
        for _, entity_id, key_text in events:
            assert key_text is not None, column
            assert entity_id == key_text, column
    async with await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True) as conn:
        # The generated functions: upserts, deletes and key changes; untracking drops them.
        generated = (
            "SELECT count(*) FROM pg_proc WHERE pronamespace = 'sync'::regnamespace"
            " AND proname ~ ('^(relay|relay_delete|rekey)_' || %s::regclass::oid || '$')"
        )
        assert await fetch_value(backend_dsn, generated, ("keyed_0",)) == 3
        await conn.execute("SELECT sync.untrack('keyed_0')")
        assert await fetch_value(backend_dsn, generated, ("keyed_0",)) == 0


async def test_a_row_with_an_empty_or_null_key_is_refused_with_its_table_named(
    backend_dsn: str,
) -> None:
    """The outbox has no CHECK constraints (sql/backend/schema.sql): the relay itself refuses an
    empty key, with the constraint's error class, and the producer's write is undone with it."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute("CREATE TABLE gadgets (code text, colour text)")
        await conn.execute("INSERT INTO gadgets VALUES ('', 'from before tracking')")
        await conn.execute("SELECT sync.track('public.gadgets', 'gadget', 'code')")
        refused = pytest.raises(
            psycopg.errors.CheckViolation, match="gadgets has an empty or NULL key"
        )
        with refused:
            await conn.execute("INSERT INTO gadgets VALUES ('', 'red')")
        with refused:  # one empty key refuses the whole statement
            await conn.execute("INSERT INTO gadgets VALUES ('g-2', 'blue'), ('', 'red')")
        with refused:
            await conn.execute("INSERT INTO gadgets VALUES (NULL, 'red')")
        with refused:
            await conn.execute("DELETE FROM gadgets WHERE code = ''")
        with refused:  # the delete of the old, empty key
            await conn.execute("UPDATE gadgets SET code = 'g-0' WHERE code = ''")
        await conn.execute("INSERT INTO gadgets VALUES ('g-1', 'red')")
        with refused:  # the upsert of the new, empty key
            await conn.execute("UPDATE gadgets SET code = '' WHERE code = 'g-1'")
        assert await fetch_value(backend_dsn, "SELECT count(*) FROM gadgets") == 2
        # A nullable key of a type that cannot be empty is checked for NULL.
        await conn.execute("CREATE TABLE counters (n int, label text)")
        await conn.execute("SELECT sync.track('public.counters', 'counter', 'n')")
        with pytest.raises(psycopg.errors.CheckViolation, match="counters has an empty or NULL"):
            await conn.execute("INSERT INTO counters VALUES (1, 'one'), (NULL, 'none')")
    rows = await fetch_all(
        backend_dsn, "SELECT op, entity_id FROM sync.events_outbox ORDER BY txid, seq"
    )
    assert rows == [("upsert", "g-1")]


async def test_keys_swapped_in_one_statement_leave_both_entities(backend_dsn: str) -> None:
    """Two rows trade keys in one UPDATE (a deferrable key allows it): both entities still
    exist, so no delete may go out after their upserts, or the receiver would lose one. A key
    that is really gone still gets its delete (and a rename of the table keeps that working)."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "CREATE TABLE slots (code text PRIMARY KEY DEFERRABLE INITIALLY DEFERRED, item text)"
        )
        await conn.execute("SELECT sync.track('public.slots', 'slot', 'code')")
        await conn.execute("INSERT INTO slots VALUES ('a', 'apple'), ('b', 'banana')")
        await conn.execute("UPDATE slots SET code = CASE code WHEN 'a' THEN 'b' ELSE 'a' END")
        await conn.execute("ALTER TABLE slots RENAME TO shelf_slots")
        await conn.execute("UPDATE shelf_slots SET code = 'c' WHERE code = 'a'")
    rows = await fetch_all(
        backend_dsn,
        "SELECT op, entity_id, payload->>'item' FROM sync.events_outbox ORDER BY txid, seq",
    )
    assert rows[:2] == [("upsert", "a", "apple"), ("upsert", "b", "banana")]
    assert sorted(rows[2:4]) == [("upsert", "a", "banana"), ("upsert", "b", "apple")]
    assert rows[4:] == [("delete", "a", "banana"), ("upsert", "c", "banana")]
    # What a receiver ends with, applying by seq: the newest event of each entity.
    final = {entity: (op, item) for op, entity, item in rows}
    assert final == {
        "a": ("delete", "banana"),
        "b": ("upsert", "apple"),
        "c": ("upsert", "banana"),
    }


async def test_a_statement_that_changes_many_rows_relays_each_row_in_order(
    backend_dsn: str,
) -> None:
    """Ordinary tables relay once per statement (sql/backend/functions/track.sql): every row a
    multi-row INSERT, UPDATE, DELETE, upsert, MERGE or COPY changed is one event, in the order the
    statement changed them, with the row relay's op, key and payload."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute("CREATE TABLE parcels (code text PRIMARY KEY, weight int)")
        await conn.execute("SELECT sync.track('public.parcels', 'parcel', 'code')")
        await conn.execute("INSERT INTO parcels VALUES ('p3', 3), ('p1', 1), ('p2', 2)")
        await conn.execute("UPDATE parcels SET weight = weight * 10 WHERE code <> 'p2'")
        await conn.execute("DELETE FROM parcels WHERE weight > 15")
        await conn.execute(
            "INSERT INTO parcels VALUES ('p1', 100), ('p4', 4) "
            "ON CONFLICT (code) DO UPDATE SET weight = excluded.weight"
        )
        await conn.execute(
            "MERGE INTO parcels t USING (VALUES ('p2', 200), ('p5', 5)) s (code, weight) "
            "ON t.code = s.code WHEN MATCHED THEN DELETE "
            "WHEN NOT MATCHED THEN INSERT VALUES (s.code, s.weight)"
        )
        async with conn.cursor().copy("COPY parcels FROM STDIN") as copy:
            await copy.write_row(("p6", 6))
            await copy.write_row(("p7", 7))
    rows = await fetch_all(
        backend_dsn,
        "SELECT txid::text, op, entity_id, (payload->>'weight')::int "
        "FROM sync.events_outbox ORDER BY txid, seq",
    )
    statements: dict[str, list[tuple[str, str, int]]] = {}
    for txid, op, key, weight in rows:
        statements.setdefault(txid, []).append((op, key, weight))
    inserted, updated, deleted, upserted, merged, copied = statements.values()
    assert inserted == [("upsert", "p3", 3), ("upsert", "p1", 1), ("upsert", "p2", 2)]
    assert updated == [("upsert", "p3", 30), ("upsert", "p1", 10)]
    assert deleted == [("delete", "p3", 30)]
    # An upsert's inserted and updated rows come from two statement triggers.
    assert sorted(upserted) == [("upsert", "p1", 100), ("upsert", "p4", 4)]
    assert sorted(merged) == [("delete", "p2", 2), ("upsert", "p5", 5)]
    assert copied == [("upsert", "p6", 6), ("upsert", "p7", 7)]


async def test_a_statement_that_changes_no_row_writes_and_wakes_nothing(backend_dsn: str) -> None:
    await fetch_all(backend_dsn, WAITING)
    nothing = "UPDATE call_logs SET status = 'done' WHERE false"
    assert await _notifications(backend_dsn, [nothing, "DELETE FROM call_logs"]) == []
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == 0
    assert await _notifications(backend_dsn, [nothing, MANY_ROWS, nothing]) == [""]


async def test_a_partitioned_table_relays_writes_made_through_any_partition(
    backend_dsn: str,
) -> None:
    """A partitioned table keeps the row relay, which PostgreSQL clones onto each partition
    (later ones too), so a write that names a partition is relayed as well."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "CREATE TABLE readings (id int, region text, value int, PRIMARY KEY (id, region)) "
            "PARTITION BY LIST (region)"
        )
        await conn.execute("CREATE TABLE readings_north PARTITION OF readings FOR VALUES IN ('n')")
        await conn.execute("SELECT sync.track('public.readings', 'reading')")
        await conn.execute("CREATE TABLE readings_south PARTITION OF readings FOR VALUES IN ('s')")
        await conn.execute("INSERT INTO readings VALUES (1, 'n', 10), (2, 's', 20)")
        await conn.execute("INSERT INTO readings_north VALUES (3, 'n', 30)")
        await conn.execute("UPDATE readings_south SET value = 21")
        await conn.execute("DELETE FROM readings_north WHERE id = 1")
        tracked = await fetch_all(
            backend_dsn,
            "SELECT table_name::text FROM sync.tracked_tables WHERE table_name::text ^@ 'readings'",
        )
        assert tracked == [("readings",)]  # not each partition as well
        triggers = await fetch_all(
            backend_dsn,
            "SELECT tgrelid::regclass::text, tgname, (tgtype & 1) = 1 AS per_row FROM pg_trigger"
            " WHERE tgname ^@ 'sync_relay' AND tgrelid::regclass::text ^@ 'readings' ORDER BY 1, 2",
        )
        assert triggers == [
            (table, name, True)
            for table in ("readings", "readings_north", "readings_south")
            for name in ("sync_relay", "sync_relay_delete")
        ]
        await conn.execute("SELECT sync.untrack('public.readings')")
        await conn.execute("INSERT INTO readings_south VALUES (4, 's', 40)")
        await conn.execute("DELETE FROM readings_south WHERE id = 2")
    rows = await fetch_all(
        backend_dsn,
        "SELECT op, entity_id, (payload->>'value')::int FROM sync.events_outbox ORDER BY seq",
    )
    assert rows == [
        ("upsert", "1", 10),
        ("upsert", "2", 20),
        ("upsert", "3", 30),
        ("upsert", "2", 21),
        ("delete", "1", 10),
    ]


async def test_columns_added_dropped_or_retyped_show_in_the_next_events_of_an_open_connection(
    backend_dsn: str,
) -> None:
    """A producer's connection keeps its relay's statements planned; another connection's ALTER
    TABLE must reach them (the payload is the row as it is now, not as it was when first
    planned)."""
    producer = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    other = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with producer, other:
        await producer.execute("CREATE TABLE meters (id int PRIMARY KEY, v text, w int)")
        await producer.execute("SELECT sync.track('public.meters', 'meter')")
        await producer.execute("INSERT INTO meters VALUES (1, 'one', 1)")
        await producer.execute("UPDATE meters SET v = 'uno'")
        await other.execute("ALTER TABLE meters ADD COLUMN extra text DEFAULT 'x'")
        await producer.execute("INSERT INTO meters VALUES (2, 'two', 2)")
        await other.execute("ALTER TABLE meters DROP COLUMN v")
        await producer.execute("INSERT INTO meters VALUES (3, 3, 'three')")
        await other.execute("ALTER TABLE meters ALTER COLUMN w TYPE text")
        await producer.execute("UPDATE meters SET w = 'thirty' WHERE id = 3")
    rows = await fetch_all(backend_dsn, "SELECT payload FROM sync.events_outbox ORDER BY seq")
    assert [row[0] for row in rows] == [
        {"id": 1, "v": "one", "w": 1},
        {"id": 1, "v": "uno", "w": 1},
        {"id": 2, "v": "two", "w": 2, "extra": "x"},
        {"id": 3, "w": 3, "extra": "three"},
        {"id": 3, "w": "thirty", "extra": "three"},
    ]
