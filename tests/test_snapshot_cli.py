"""`serversync snapshot` as an operator runs it: what a dry run counts, the rows a snapshot writes
into the outbox (one upsert per row, in key order, its payload the row's to_json), whatever the
names of the table and its columns; for one consumer; with sweep markers; stopped by a signal
and resumed by the same command; shown by `status`. And the two ways the outbox stops holding
the whole history: `cleanup` deleting rows, `sync.track` on a table that holds rows. Real
PostgreSQL, the CLI as a real subprocess."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import sql

from consumer.store import snapshot_writer, snapshots
from tests.conftest import (
    ROOT,
    cli_env,
    fetch_all,
    fetch_value,
    finish,
    start_cli,
    wait_until,
)
from tests.support.backend import execute
from tests.support.cli import assert_ok, assert_one_line_error, run_cli
from tests.support.snapshots import (
    history,
    rows_sent,
    snapshot_cli,
    snapshot_outbox,
    snapshot_state,
)

ITEMS = "CREATE TABLE items (id int PRIMARY KEY, name text)"
# A consumer registered as `serversync run` registers one, at the outbox's start.
REGISTER_AUDIT = (
    "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq) VALUES ('audit', '0', 0)"
)


async def make_table(dsn: str, create: str, rows: str | sql.Composed, track: str) -> None:
    """A table that holds rows before it is tracked (the case snapshots are for)."""
    await execute(dsn, create, rows, track)


async def snapshot_ids(dsn: str) -> list[int]:
    """Every recorded snapshot's id, in order."""
    return [r[0] for r in await fetch_all(dsn, "SELECT id FROM sync.snapshots ORDER BY id")]


async def only_snapshot(dsn: str) -> int:
    """The id of the one snapshot recorded."""
    ids = await snapshot_ids(dsn)
    assert len(ids) == 1, ids
    return ids[0]


async def rows_as_json(dsn: str, table: sql.Composable, key: str) -> list[tuple[str, Any]]:
    """Each row's key as text and its to_json, in key order."""
    query = sql.SQL("SELECT t.{key}::text, to_json(t) FROM {table} AS t ORDER BY t.{key}").format(
        key=sql.Identifier(key), table=table
    )
    return [(k, payload) for k, payload in await fetch_all(dsn, query)]


# -- planning ------------------------------------------------------------------------------------


async def test_a_dry_run_counts_each_tables_rows_and_writes_nothing(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 7) g",
        "SELECT sync.track('items', 'item')",
    )
    await execute(
        backend_dsn,
        "CREATE TABLE tags (code text PRIMARY KEY)",
        "SELECT sync.track('tags', 'tag', 'code')",
        "INSERT INTO tags VALUES ('a'), ('b')",
    )
    outbox_before = await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox")

    result = await snapshot_cli(backend_dsn, "items", "tags", "--dry-run")

    assert_ok(result)
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["TABLE", "ENTITY_TYPE", "KEY_COLUMN", "ROWS"]
    assert [line.split() for line in lines[1:3]] == [
        ["items", "item", "id", "7"],
        ["tags", "tag", "code", "2"],
    ]
    assert lines[3].startswith("total: 9 row(s) in 2 table(s), for every consumer"), lines
    assert "nothing written" in lines[3]
    assert await snapshot_ids(backend_dsn) == []
    assert (
        await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == outbox_before
    )


async def test_without_a_table_every_tracked_table_is_planned(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items VALUES (1, 'a')",
        "SELECT sync.track('items', 'item')",
    )
    tracked = {
        r[0]
        for r in await fetch_all(backend_dsn, "SELECT table_name::text FROM sync.tracked_tables")
    }

    result = await snapshot_cli(backend_dsn, "--dry-run")

    assert_ok(result)
    listed = {line.split()[0] for line in result.stdout.strip().splitlines()[1:-1]}
    assert listed == tracked
    assert "items" in listed


async def test_an_unknown_or_untracked_table_is_bad_input_and_nothing_is_recorded(
    backend_dsn: str,
) -> None:
    await execute(backend_dsn, "CREATE TABLE loose (id int PRIMARY KEY)")

    unknown, untracked, unclosed, dotted = await asyncio.gather(
        snapshot_cli(backend_dsn, "nowhere"),
        snapshot_cli(backend_dsn, "loose"),
        snapshot_cli(backend_dsn, '"unclosed'),
        snapshot_cli(backend_dsn, "a.b.c.d"),
    )

    assert_one_line_error(unknown, 2, "no table 'nowhere'")
    assert_one_line_error(untracked, 2, "'loose' is not tracked", "sync.track")
    assert_one_line_error(unclosed, 2, "'\"unclosed' is not a table name")
    assert_one_line_error(dotted, 2, "'a.b.c.d' is not a table name")
    assert await snapshot_ids(backend_dsn) == []


# -- what a snapshot writes ----------------------------------------------------------------------


async def test_a_snapshot_writes_one_upsert_per_row_in_key_order_with_the_rows_json(
    backend_dsn: str,
) -> None:
    # Inserted out of key order, before the table is tracked: no change ever carried them.
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM unnest(ARRAY[5, 3, 9, 1, 7, 2]) g",
        "SELECT sync.track('items', 'item')",
    )
    changes_before = await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox")

    result = await snapshot_cli(backend_dsn, "items", "--chunk-size", "4")

    assert_ok(result)
    snapshot_id = await only_snapshot(backend_dsn)
    assert result.stdout.startswith(f"snapshot {snapshot_id} done for every consumer: 6 row(s)")
    assert " in " in result.stdout and "s (" in result.stdout  # the seconds it took
    written = await snapshot_outbox(backend_dsn, snapshot_id)
    expected = await rows_as_json(backend_dsn, sql.Identifier("items"), "id")
    assert [(r.entity_id, r.payload) for r in written] == expected
    assert {(r.op, r.entity_type, r.target_consumer) for r in written} == {("upsert", "item", None)}
    # Nothing but the snapshot's rows was written.
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == (
        changes_before + len(expected)
    )
    assert (await snapshot_state(backend_dsn, snapshot_id))["state"] == "done"


async def test_max_rate_paces_the_chunks_and_a_bad_rate_is_bad_input(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 60) g",
        "SELECT sync.track('items', 'item')",
    )
    for bad in ("0", "-5", "fast", "nan"):
        refused = await snapshot_cli(backend_dsn, "items", "--max-rate", bad)
        assert refused.code == 2, (bad, refused.stderr)
        assert "--max-rate" in refused.stderr
    assert await snapshot_ids(backend_dsn) == []

    result = await snapshot_cli(backend_dsn, "items", "--chunk-size", "10", "--max-rate", "100")
    assert_ok(result)
    snapshot_id = await only_snapshot(backend_dsn)
    assert len(await snapshot_outbox(backend_dsn, snapshot_id)) == 60
    # 60 rows at 100 a second, from when it was recorded to its end: not under 0.6 s, however
    # fast the machine (unpaced, six chunks of ten rows take milliseconds).
    took = await fetch_value(
        backend_dsn,
        "SELECT extract(epoch FROM finished_at - created_at) FROM sync.snapshots WHERE id = %s",
        (snapshot_id,),
    )
    assert took >= 0.59, took


@pytest.mark.parametrize(
    ("table", "create", "rows", "track"),
    [
        (
            "codes",
            "CREATE TABLE codes (code text PRIMARY KEY, v int)",
            "INSERT INTO codes VALUES ('a', 1), ('', 2), ('b', 3)",
            "SELECT sync.track('codes', 'code', 'code')",
        ),
        (
            "badges",
            "CREATE TABLE badges (id int PRIMARY KEY, code text UNIQUE)",
            "INSERT INTO badges VALUES (1, 'a'), (2, NULL), (3, 'c')",
            "SELECT sync.track('badges', 'badge', 'code')",
        ),
    ],
    ids=["empty-key", "null-key"],
)
async def test_a_row_the_relay_would_refuse_stops_the_snapshot_with_one_line(
    backend_dsn: str, table: str, create: str, rows: str, track: str
) -> None:
    """A row with an empty or NULL key, there before the table was tracked (the relay refuses
    such a row): the snapshot stops with one line naming the table and column, and writes
    nothing of it (a NULL key, which sorts after every other, is found before the first chunk)."""
    await make_table(backend_dsn, create, rows, track)
    result = await snapshot_cli(backend_dsn, table)
    assert result.code == 1, result
    assert "Traceback" not in result.stderr
    [error] = [line for line in result.stderr.splitlines() if line.startswith("serversync:")]
    assert "empty or NULL key (column code)" in error and table in error, error
    assert await snapshot_outbox(backend_dsn, await only_snapshot(backend_dsn)) == []


async def test_hostile_table_and_column_names_are_sent_as_any_other(backend_dsn: str) -> None:
    """Quotes, spaces, %, upper case, a unicode text key named "r", and a key named "k": names
    that would break a query built as text, and aliases the chunk's own SQL uses."""
    schema = 'Sch "ema'
    # Each as an operator types it for sync.track and `serversync snapshot`.
    odd_name = '"Sch ""ema"."We""ird %s Täble"'
    k_name = '"Sch ""ema"."UPPER k"'
    odd = sql.Identifier(schema, 'We"ird %s Täble')
    keyed_k = sql.Identifier(schema, "UPPER k")
    await execute(
        backend_dsn,
        sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)),
        sql.SQL(
            'CREATE TABLE {} ("r" text PRIMARY KEY, "k" int, "%I" text, "Up Per" text, '
            '"to_json" text)'
        ).format(odd),
        sql.SQL(
            "INSERT INTO {} VALUES ('ключ', 1, '%s', 'A', 'x'), ('é', 2, '%L', 'B', 'y'),"
            " ('z', 3, '$1', 'C', 'z'), ('日本', 4, '''', 'D', NULL), ('a''b', 5, '\"', 'E', '')"
        ).format(odd),
        sql.SQL('CREATE TABLE {} ("k" int PRIMARY KEY, "r" text, "c" int)').format(keyed_k),
        sql.SQL("INSERT INTO {} SELECT g, 'r' || g, -g FROM generate_series(1, 5) g").format(
            keyed_k
        ),
    )
    for name, entity_type, key in ((odd_name, "odd.thing", "r"), (k_name, "k_thing", "k")):
        await execute(
            backend_dsn, "SELECT sync.track(%s::regclass, %s, %s)", params=(name, entity_type, key)
        )
    names = [odd_name, k_name]

    result = await snapshot_cli(backend_dsn, *names, "--chunk-size", "2")

    assert_ok(result)
    snapshot_id = await only_snapshot(backend_dsn)
    written = await snapshot_outbox(backend_dsn, snapshot_id)
    odd_rows = await rows_as_json(backend_dsn, odd, "r")
    k_rows = await rows_as_json(backend_dsn, keyed_k, "k")
    # The tables in the order named, each in key order, every row once.
    assert [(r.entity_type, r.entity_id, r.payload) for r in written] == [
        ("odd.thing", k, p) for k, p in odd_rows
    ] + [("k_thing", k, p) for k, p in k_rows]
    assert len(odd_rows) == 5 and len(k_rows) == 5


async def test_a_snapshot_for_one_consumer_targets_its_rows_at_it(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 3) g",
        "SELECT sync.track('items', 'item')",
    )
    # A registered consumer (sync.consumer_offsets) and a built-in one that never ran here.
    await execute(
        backend_dsn,
        REGISTER_AUDIT,
    )

    registered, built_in = await asyncio.gather(
        snapshot_cli(backend_dsn, "items", "--consumer", "audit"),
        snapshot_cli(backend_dsn, "items", "--consumer", "frontend-sync"),
    )

    assert_ok(registered)
    assert_ok(built_in)
    for consumer in ("audit", "frontend-sync"):
        (snapshot_id,) = [
            r[0]
            for r in await fetch_all(
                backend_dsn, "SELECT id FROM sync.snapshots WHERE consumer = %s", (consumer,)
            )
        ]
        written = await snapshot_outbox(backend_dsn, snapshot_id)
        assert [(r.entity_id, r.target_consumer) for r in written] == [
            ("1", consumer),
            ("2", consumer),
            ("3", consumer),
        ]
    assert "for consumer audit: 3 row(s)" in registered.stdout


async def test_an_unknown_consumer_is_bad_input_naming_the_known_ones(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items VALUES (1, 'a')",
        "SELECT sync.track('items', 'item')",
    )
    await execute(
        backend_dsn,
        REGISTER_AUDIT,
    )

    result = await snapshot_cli(backend_dsn, "items", "--consumer", "nobody")

    assert_one_line_error(result, 2, "unknown consumer 'nobody'", "audit", "frontend-sync")
    assert await snapshot_ids(backend_dsn) == []


async def test_a_declared_consumer_gets_the_tables_of_the_entity_types_it_carries(
    backend_dsn: str, tmp_path: Path
) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items VALUES (1, 'a')",
        "SELECT sync.track('items', 'item')",
    )
    await execute(
        backend_dsn,
        "CREATE TABLE tags (code text PRIMARY KEY)",
        "SELECT sync.track('tags', 'tag', 'code')",
    )
    declared = tmp_path / "consumers.toml"
    declared.write_text('[consumers.items-only]\nsink = "null"\nentity_types = ["item"]\n')

    planned, foreign = await asyncio.gather(
        snapshot_cli(
            backend_dsn, "--consumer", "items-only", "--dry-run", SYNC_CONSUMERS_FILE=str(declared)
        ),
        snapshot_cli(
            backend_dsn, "tags", "--consumer", "items-only", SYNC_CONSUMERS_FILE=str(declared)
        ),
    )

    assert_ok(planned)
    assert [line.split()[0] for line in planned.stdout.strip().splitlines()[1:-1]] == ["items"]
    assert "for consumer items-only" in planned.stdout
    assert_one_line_error(foreign, 2, "items-only carries entity types item only", "tags (tag)")


async def test_delete_missing_ends_with_a_sweep_marker_per_entity_type(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 4) g",
        "SELECT sync.track('items', 'item')",
    )
    await make_table(
        backend_dsn,
        "CREATE TABLE tags (code text PRIMARY KEY)",
        "INSERT INTO tags VALUES ('a'), ('b')",
        "SELECT sync.track('tags', 'tag', 'code')",
    )

    result = await snapshot_cli(backend_dsn, "items", "tags", "--delete-missing")

    assert_ok(result)
    assert "sweep marker" in result.stdout
    snapshot_id = await only_snapshot(backend_dsn)
    begin_seq = (await snapshot_state(backend_dsn, snapshot_id))["begin_seq"]
    assert begin_seq is not None
    written = await snapshot_outbox(backend_dsn, snapshot_id)
    upserts = [r for r in written if r.op == "upsert"]
    sweeps = [r for r in written if r.op == "sweep"]
    assert len(upserts) == 6
    assert [(s.entity_type, s.entity_id, s.payload) for s in sweeps] == [
        ("item", str(snapshot_id), {"snapshot": snapshot_id, "keepFromSeq": begin_seq}),
        ("tag", str(snapshot_id), {"snapshot": snapshot_id, "keepFromSeq": begin_seq}),
    ]
    # The markers end it, and every row it sent has a seq from its begin seq on.
    assert min(s.seq for s in sweeps) > max(r.seq for r in upserts)
    assert min(r.seq for r in upserts) >= begin_seq


async def test_delete_missing_refuses_to_leave_out_a_table_of_a_swept_entity_type(
    backend_dsn: str,
) -> None:
    """Two tables tracked as one entity type: a sweep after a snapshot of one would delete the
    other's entities at receivers, so such a snapshot is refused, and one of both is sent."""
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items VALUES (1, 'one')",
        "SELECT sync.track('items', 'item')",
    )
    await make_table(
        backend_dsn,
        "CREATE TABLE old_items (id int PRIMARY KEY, name text)",
        "INSERT INTO old_items VALUES (2, 'two')",
        "SELECT sync.track('old_items', 'item')",
    )
    refused = await snapshot_cli(backend_dsn, "items", "--delete-missing")
    assert_one_line_error(refused, 2, "old_items", "'item'", "--delete-missing")
    assert await snapshot_ids(backend_dsn) == []
    # Without the sweep, one table alone is fine; with both named, the sweep is too.
    assert_ok(await snapshot_cli(backend_dsn, "items"))
    assert_ok(await snapshot_cli(backend_dsn, "items", "old_items", "--delete-missing"))


async def test_an_inherited_tables_children_are_not_its_rows(backend_dsn: str) -> None:
    """A child of an inherited table is a table of its own, which the parent's relay does not
    send: neither does the parent's snapshot."""
    await make_table(
        backend_dsn,
        "CREATE TABLE animals (id int PRIMARY KEY, name text);"
        "CREATE TABLE cats (lives int) INHERITS (animals)",
        "INSERT INTO animals VALUES (1, 'dog'); INSERT INTO cats VALUES (2, 'cat', 9)",
        "SELECT sync.track('animals', 'animal')",
    )
    dry = await snapshot_cli(backend_dsn, "animals", "--dry-run")
    assert_ok(dry)
    assert "total: 1 row(s)" in dry.stdout, dry.stdout
    assert_ok(await snapshot_cli(backend_dsn, "animals"))
    written = await snapshot_outbox(backend_dsn, await only_snapshot(backend_dsn))
    assert [(r.entity_id, r.payload) for r in written] == [("1", {"id": 1, "name": "dog"})]


async def test_a_table_dropped_under_a_snapshot_stops_it_with_what_to_do(
    backend_dsn: str,
) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 5) g",
        "SELECT sync.track('items', 'item')",
    )
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        planned = await snapshots.plan_tables(conn, ["items"])
        snapshot_id = await snapshots.create_snapshot(conn, planned)
        await conn.execute("DROP TABLE items")
        with pytest.raises(psycopg.errors.UndefinedTable, match="no longer exists") as raised:
            await snapshot_writer.run_snapshot(conn, snapshot_id)
    assert f"serversync snapshot --cancel {snapshot_id}" in str(raised.value)
    cancelled = await snapshot_cli(backend_dsn, "--cancel", str(snapshot_id))
    assert_ok(cancelled)
    assert (await snapshot_state(backend_dsn, snapshot_id))["state"] == "cancelled"


async def test_removing_a_consumer_cancels_its_unfinished_snapshots(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items VALUES (1, 'one')",
        REGISTER_AUDIT,
    )
    await execute(backend_dsn, "SELECT sync.track('items', 'item')")
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        planned = await snapshots.plan_tables(conn, ["items"])
        ours = await snapshots.create_snapshot(conn, planned, consumer="audit")
        everyone = await snapshots.create_snapshot(conn, planned)
    result = await run_cli(
        "consumers", "remove", "audit", "--yes", env=cli_env(DATABASE_URL=backend_dsn)
    )
    assert_ok(result)
    assert (await snapshot_state(backend_dsn, ours))["state"] == "cancelled"
    assert (await snapshot_state(backend_dsn, everyone))["state"] == "running"


# -- stopped and resumed -------------------------------------------------------------------------


BIG = 40_000


@pytest.mark.parametrize(
    ("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"]
)
async def test_a_signalled_snapshot_stops_after_its_chunk_and_the_same_command_resumes_it(
    backend_dsn: str, signum: signal.Signals, code: int
) -> None:
    await make_table(
        backend_dsn,
        "CREATE TABLE big (id int PRIMARY KEY, v text)",
        sql.SQL("INSERT INTO big SELECT g, md5(g::text) FROM generate_series(1, {}) g").format(BIG),
        "SELECT sync.track('big', 'big')",
    )
    env = cli_env(DATABASE_URL=backend_dsn)
    # Small chunks: thousands of transactions, so the signal lands in the middle.
    process = await start_cli("snapshot", "big", "--chunk-size", "5", env=env)

    async def some_sent() -> bool:
        return await rows_sent(backend_dsn) > 0

    try:
        await wait_until(some_sent, timeout=30, what="the first chunk of the snapshot")
    except BaseException:
        process.kill()
        await process.wait()
        raise
    process.send_signal(signum)
    stopped = await finish(process)

    assert stopped.code == code, stopped
    assert "Traceback" not in stopped.stderr
    snapshot_id = await only_snapshot(backend_dsn)
    last = stopped.stderr.strip().splitlines()[-1]
    assert last.startswith(f"serversync: snapshot {snapshot_id} stopped at "), last
    assert "running the same command again resumes it" in last
    assert stopped.stdout == ""
    sent = await rows_sent(backend_dsn, snapshot_id)
    assert 0 < sent < BIG
    assert (await snapshot_state(backend_dsn, snapshot_id))["state"] == "running"
    # Chunks are transactions: what is recorded as sent is exactly what is in the outbox.
    assert len(await snapshot_outbox(backend_dsn, snapshot_id)) == sent
    listed = await snapshot_cli(backend_dsn, "--list")
    assert_ok(listed)
    assert f"snapshot {snapshot_id} for every consumer: running, {sent} of {BIG} rows" in (
        listed.stdout
    )

    resumed = await snapshot_cli(backend_dsn, "big", "--chunk-size", "5000")

    assert_ok(resumed)
    assert f"resuming snapshot {snapshot_id}: {sent} of {BIG} rows sent" in resumed.stderr
    assert resumed.stdout.startswith(
        f"snapshot {snapshot_id} done for every consumer: {BIG} row(s)"
    )
    assert f"{BIG - sent} of them in this run" in resumed.stdout
    assert await snapshot_ids(backend_dsn) == [snapshot_id]
    written = await snapshot_outbox(backend_dsn, snapshot_id)
    assert [r.entity_id for r in written] == [str(i) for i in range(1, BIG + 1)]


async def test_a_snapshot_of_another_scope_is_not_resumed_but_begun(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 3) g",
        "SELECT sync.track('items', 'item')",
    )
    unfinished = await _unfinished_snapshot(backend_dsn, "items", consumer="frontend-sync")

    other = await snapshot_cli(backend_dsn, "items")
    refused = await snapshot_cli(
        backend_dsn, "items", "--consumer", "frontend-sync", "--delete-missing"
    )

    assert_ok(other)
    assert "resuming" not in other.stderr
    assert len(await snapshot_ids(backend_dsn)) == 2
    assert_one_line_error(refused, 2, f"snapshot {unfinished}", f"--cancel {unfinished}")
    assert (await snapshot_state(backend_dsn, unfinished))["state"] == "running"


async def _unfinished_snapshot(dsn: str, *tables: str, consumer: str | None = None) -> int:
    """A snapshot of `tables` asked for by an operator that sent its first chunk of one row and
    stopped, as one stopped by a signal does."""
    stop = asyncio.Event()

    def after_a_chunk(shot: snapshots.SnapshotState) -> None:
        # Progress is also reported while it waits for older transactions to end.
        if shot.rows_sent:
            stop.set()

    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        planned = await snapshots.plan_tables(conn, tables)
        snapshot_id = await snapshots.create_snapshot(conn, planned, consumer=consumer)
        shot = await snapshot_writer.run_snapshot(
            conn, snapshot_id, chunk_size=1, progress=after_a_chunk, stop=stop
        )
    assert shot.state == "running" and shot.rows_sent == 1, shot
    return snapshot_id


# -- status, cancel ------------------------------------------------------------------------------


async def test_status_shows_a_running_snapshot_until_it_is_cancelled(backend_dsn: str) -> None:
    await make_table(
        backend_dsn,
        ITEMS,
        "INSERT INTO items SELECT g, 'n' || g FROM generate_series(1, 4) g",
        "SELECT sync.track('items', 'item')",
    )
    snapshot_id = await _unfinished_snapshot(backend_dsn, "items")
    env = cli_env(DATABASE_URL=backend_dsn)

    text, as_json = await asyncio.gather(
        run_cli("status", env=env), run_cli("status", "--json", env=env)
    )

    assert_ok(text)
    lines = text.stdout.splitlines()
    line = f"snapshot {snapshot_id} for every consumer: running, 1 of 4 rows (25%), at items"
    assert line in lines, text.stdout
    assert lines[lines.index(line) + 1] == "  items (item): 1 of 4 rows (25%)"
    assert_ok(as_json)
    (shown,) = orjson.loads(as_json.stdout)["snapshots"]
    assert (shown["id"], shown["state"], shown["rows_sent"], shown["current_table"]) == (
        snapshot_id,
        "running",
        1,
        "items",
    )

    cancelled = await snapshot_cli(backend_dsn, "--cancel", str(snapshot_id))
    again = await snapshot_cli(backend_dsn, "--cancel", str(snapshot_id))
    unknown = await snapshot_cli(backend_dsn, "--cancel", "999999")
    after = await run_cli("status", env=env)

    assert_ok(cancelled)
    assert f"cancelled snapshot {snapshot_id}" in cancelled.stdout
    assert_one_line_error(again, 1, f"snapshot {snapshot_id} is cancelled, not running")
    assert_one_line_error(unknown, 2, "no snapshot 999999")
    assert_ok(after)
    assert f"snapshot {snapshot_id}" not in after.stdout
    # What it wrote stays in the stream.
    assert len(await snapshot_outbox(backend_dsn, snapshot_id)) == 1


# -- whether the outbox holds the whole history --------------------------------------------------


async def test_cleanup_that_deletes_outbox_rows_marks_the_history_incomplete(
    backend_dsn: str,
) -> None:
    assert await history(backend_dsn) == (True, None)
    env = cli_env(DATABASE_URL=backend_dsn)
    await execute(
        backend_dsn,
        "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload, created_at)"
        " SELECT 'upsert', 'thing', g::text, '{}', now() - interval '40 days'"
        " FROM generate_series(1, 3) g",
    )
    # No consumer has passed them yet: nothing goes, the history stays whole.
    assert_ok(await run_cli("cleanup", env=env))
    assert await history(backend_dsn) == (True, None)
    await execute(
        backend_dsn,
        "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq)"
        " SELECT 'audit', o.txid, o.seq FROM sync.events_outbox o"
        " ORDER BY o.txid DESC, o.seq DESC LIMIT 1",
    )
    dry = await run_cli("cleanup", "--dry-run", env=env)
    assert_ok(dry)
    assert await history(backend_dsn) == (True, None)

    result = await run_cli("cleanup", env=env)

    assert_ok(result)
    assert "deleted 3 outbox row(s)" in result.stdout
    complete, reason = await history(backend_dsn)
    assert not complete
    assert reason is not None and reason.startswith("cleanup deleted outbox rows older than 30d"), (
        reason
    )


async def test_tracking_a_table_that_holds_rows_says_so_and_marks_the_history_incomplete(
    backend_dsn: str,
) -> None:
    assert await history(backend_dsn) == (True, None)
    notices: list[tuple[str, str | None]] = []
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        conn.add_notice_handler(lambda n: notices.append((n.message_primary or "", n.message_hint)))
        await conn.execute("CREATE TABLE empty_one (id int PRIMARY KEY)")
        await conn.execute("SELECT sync.track('empty_one', 'empty')")
        assert notices == []
        assert await history(backend_dsn) == (True, None)

        await conn.execute('CREATE TABLE "Full Of" (id int PRIMARY KEY)')
        await conn.execute('INSERT INTO "Full Of" VALUES (1), (2)')
        await conn.execute("""SELECT sync.track('"Full Of"', 'full')""")

    assert notices == [
        (
            'sync.track: table "Full Of" already holds rows: they reach consumers only by a '
            "snapshot",
            """Run `serversync snapshot '"Full Of"'` to send them.""",
        )
    ]
    complete, reason = await history(backend_dsn)
    assert not complete
    assert reason == 'table "Full Of" was tracked holding rows'


async def test_tracking_a_tracked_table_again_as_a_migration_does_keeps_the_history_whole(
    backend_dsn: str,
) -> None:
    """A migration generates every relay again through sync.track: a table tracked as it is
    tracked already, rows and all, says nothing and marks nothing."""
    await execute(
        backend_dsn,
        ITEMS,
        "SELECT sync.track('items', 'item')",
        "INSERT INTO items VALUES (1, 'a')",
    )
    assert await history(backend_dsn) == (True, None)
    notices: list[str] = []
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        conn.add_notice_handler(lambda n: notices.append(n.message_primary or ""))
        await conn.execute("SELECT sync.track('items', 'item')")
        # The function file as `serversync migrate` applies it, regeneration included.
        await conn.execute((ROOT / "sql/backend/functions/track.sql").read_bytes())
    assert [n for n in notices if "already holds rows" in n] == []
    assert await history(backend_dsn) == (True, None)
