"""The relay sync.track generates works for any legal identifier (sql/backend/functions/track.sql):
a column named like one of the generated code's aliases or variables stays a column, a `%` in a key
column's name is part of the name, sync.tracked_tables reads back every name it was given, and
the schema, table and column names of a tracked table may hold quotes, backslashes, reserved
words, dollar quotes and any Unicode."""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql

from consumer.store import migrations
from tests.conftest import fetch_all

EVENTS = "SELECT op, entity_id, payload::text FROM sync.events_outbox WHERE entity_type = %s"
# The node of the both-ways variant.
NODE = "here"


def _pairs(payload: str) -> list[tuple[str, Any]]:
    """A payload's fields in the order the row holds its columns."""
    pairs: list[tuple[str, Any]] = json.loads(payload, object_pairs_hook=list)
    return pairs


async def _events(dsn: str, entity_type: str) -> list[tuple[str, str, list[tuple[str, Any]]]]:
    rows = await fetch_all(dsn, EVENTS + " ORDER BY txid, seq", (entity_type,))
    return [(op, entity_id, _pairs(payload)) for op, entity_id, payload in rows]


async def test_a_column_named_like_the_relays_row_alias_is_relayed_as_a_column(
    backend_dsn: str,
) -> None:
    """The statement relay read each row as `r` (FROM sync_changed_rows AS r) and wrote
    to_json(r): with a column named r, that is the column, and the payload was its value."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            'CREATE TABLE aliased (id int PRIMARY KEY, r text, "new" text, "old" text, "R" int)'
        )
        await conn.execute("SELECT sync.track('public.aliased', 'aliased')")
        await conn.execute("INSERT INTO aliased VALUES (1, 'row', 'n', 'o', 7)")
        await conn.execute("UPDATE aliased SET r = 'changed'")
        await conn.execute("DELETE FROM aliased")
    first = [("id", 1), ("r", "row"), ("new", "n"), ("old", "o"), ("R", 7)]
    changed = [("id", 1), ("r", "changed"), ("new", "n"), ("old", "o"), ("R", 7)]
    assert await _events(backend_dsn, "aliased") == [
        ("upsert", "1", first),
        ("upsert", "1", changed),
        ("delete", "1", changed),
    ]


async def test_a_column_named_like_a_trigger_variable_leaves_writes_working(
    backend_dsn: str,
) -> None:
    """The check of an empty text key names the table by TG_RELID inside the statement that
    reads the changed rows: a column tg_relid made that reference ambiguous, and every write
    to the table failed."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "CREATE TABLE variables (code text PRIMARY KEY, tg_relid int, tg_op text, found bool)"
        )
        await conn.execute("SELECT sync.track('public.variables', 'variable', 'code')")
        await conn.execute("INSERT INTO variables VALUES ('v', 1, 'op', true)")
        with pytest.raises(psycopg.errors.CheckViolation, match="variables has an empty"):
            await conn.execute("INSERT INTO variables VALUES ('', 2, 'op', false)")
    assert await _events(backend_dsn, "variable") == [
        ("upsert", "v", [("code", "v"), ("tg_relid", 1), ("tg_op", "op"), ("found", True)])
    ]


# Key columns whose names an older relay spliced into format strings: `k%1$s` was read as the column
# kr, `share%%` as a column share% that does not exist (every write failed), and `a%sb` or
# `%I` made sync.track itself fail for want of format() arguments.
PERCENT_KEYS = ["k%1$s", "share%%", "a%sb", "%I", "%L%%s"]


async def test_a_key_column_with_percent_signs_in_its_name_is_read_as_itself(
    backend_dsn: str,
) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for index, key in enumerate(PERCENT_KEYS):
            for kind in ("int", "text"):
                name = f"percent_{kind}_{index}"
                table = sql.Identifier(name)
                await conn.execute(
                    sql.SQL("CREATE TABLE {} ({} {} PRIMARY KEY, kr int)").format(
                        table, sql.Identifier(key), sql.SQL(kind)
                    )
                )
                await conn.execute("SELECT sync.track(%s::regclass, %s, %s)", (name, name, key))
                await conn.execute(sql.SQL("INSERT INTO {} VALUES (1, 99)").format(table))
                await conn.execute(
                    sql.SQL("UPDATE {} SET {} = 2").format(table, sql.Identifier(key))
                )
    for index, key in enumerate(PERCENT_KEYS):
        for kind, one, two in (("int", 1, 2), ("text", "1", "2")):
            assert await _events(backend_dsn, f"percent_{kind}_{index}") == [
                ("upsert", "1", [(key, one), ("kr", 99)]),
                ("delete", "1", [(key, one), ("kr", 99)]),
                ("upsert", "2", [(key, two), ("kr", 99)]),
            ], (key, kind)


# An earlier sync.tracked_tables escaped the trigger's arguments (encode(tgargs, 'escape')), split
# the text at '\000' and read each part back as bytea: a name holding the text \000 was split
# inside itself and left a lone backslash, which is no bytea, so the view failed.
BACKSLASH_KEYS = ["a\\000b", "\\000", "x\\", "\\\\", "é\\000日本", "\\x41"]


async def test_tracked_tables_lists_key_columns_that_hold_backslashes_or_the_text_of_a_nul(
    backend_dsn: str,
) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for index, key in enumerate(BACKSLASH_KEYS):
            await conn.execute(
                sql.SQL("CREATE TABLE {} ({} text PRIMARY KEY)").format(
                    sql.Identifier(f"slashed_{index}"), sql.Identifier(key)
                )
            )
            await conn.execute(
                "SELECT sync.track(%s::regclass, %s, %s)", (f"slashed_{index}", "slashed", key)
            )
    tracked = await fetch_all(
        backend_dsn,
        "SELECT table_name::text, entity_type, key_column FROM sync.tracked_tables"
        " WHERE table_name::text ^@ 'slashed_' ORDER BY 1",
    )
    assert tracked == [
        (f"slashed_{index}", "slashed", key) for index, key in enumerate(BACKSLASH_KEYS)
    ]


async def test_regenerating_the_relays_keeps_tables_tracked_with_hostile_names(
    empty_dsn: str,
) -> None:
    """functions/track.sql, applied again when it changes, regenerates every tracked relay from
    what sync.tracked_tables reads back, names a splicing relay once mishandled included."""
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        await migrations.migrate(conn, ["backend"])
        await conn.execute('CREATE TABLE before_r (id int PRIMARY KEY, r text, "share%%" int)')
        await conn.execute("SELECT sync.track('before_r', 'before_r')")
        await conn.execute('CREATE TABLE before_pct ("share%%" text PRIMARY KEY, r text)')
        await conn.execute("SELECT sync.track('before_pct', 'before_pct', 'share%%')")
        await conn.execute('CREATE TABLE before_nul ("a\\000b" int PRIMARY KEY)')
        await conn.execute("SELECT sync.track('before_nul', 'before_nul', 'a\\000b')")
        # As if the file had changed: its recorded checksum no longer matches.
        await conn.execute(
            "UPDATE sync.schema_migrations SET checksum = 'changed'"
            " WHERE version = 'functions/track.sql'"
        )
        applied = await migrations.migrate(conn, ["backend"])
        assert [m.label for m in applied] == ["backend/functions/track.sql"]
        await conn.execute("INSERT INTO before_r VALUES (1, 'x', 5)")
        await conn.execute("INSERT INTO before_pct VALUES ('p', 'y')")
        await conn.execute("INSERT INTO before_nul VALUES (3)")
    assert await _events(empty_dsn, "before_r") == [
        ("upsert", "1", [("id", 1), ("r", "x"), ("share%%", 5)])
    ]
    assert await _events(empty_dsn, "before_pct") == [
        ("upsert", "p", [("share%%", "p"), ("r", "y")])
    ]
    assert await _events(empty_dsn, "before_nul") == [("upsert", "3", [("a\\000b", 3)])]
    tracked = await fetch_all(
        empty_dsn,
        "SELECT table_name::text, key_column FROM sync.tracked_tables ORDER BY 1",
    )
    assert tracked == [("before_nul", "a\\000b"), ("before_pct", "share%%"), ("before_r", "id")]


# Property test: names a user may legally give, chosen to break code that splices names.

# Every alias, variable, transition table and function name the generated code uses, and the
# columns of the outbox it writes.
GENERATED_NAMES = [
    "r", "R", "new", "old", "NEW", "OLD", "new_rows", "old_rows", "sync_changed_rows",
    "tg_relid", "tg_op", "tg_level", "tg_name", "tg_argv", "tg_table_name", "tg_table_schema",
    "found", "key_taken", "sync", "to_json", "coalesce", "nullif", "op", "entity_type",
    "entity_id", "payload", "seq", "txid", "id", "relay", "rekey",
    # The both-ways template's parts, aliases and the columns it writes.
    "changed", "applied", "made_here", "c", "d", "n", "v", "w", "version_ts", "version_node",
    "deleted", "created_at", "origin", "excluded", "EXCLUDED", "node", "row_versions",
]  # fmt: skip
HOSTILE_NAMES = [
    *GENERATED_NAMES,
    '"', "'", '""', "''", 'a"b', "it's", '"; DROP TABLE x; --',
    "%", "%%", "%I", "%s", "%L", "%1$s", "%2$I", "50%",
    "\\", "\\\\", "\\000", "a\\000b", "x\\", "\\x00", "\\n",
    " ", "two words", " lead", "trail ", "tab\there", "line\nbreak",
    "é", "日本", "🚀", "Ünïcödé", "ß",
    "select", "order", "user", "table", "from", "where", "SELECT", "Order",
    "$", "$$", "$body$", "$wake$", "$1", "a$b", "$$x$$",
    "a.b", "(", ")", ";", "--", "/*", "*/", "*",
]  # fmt: skip
SYSTEM_COLUMNS = {"tableoid", "xmin", "cmin", "xmax", "cmax", "ctid"}
# Schemas a test may not create or drop.
TAKEN_SCHEMAS = {"public", "sync", "information_schema"}


def _legal(name: str) -> bool:
    """PostgreSQL takes a name of 1 to 63 bytes without NUL (longer ones are truncated)."""
    return 0 < len(name.encode()) <= 63 and "\x00" not in name


_hostile = st.sampled_from(HOSTILE_NAMES)
NAMES = st.one_of(
    _hostile,
    st.tuples(_hostile, _hostile).map("".join),
    st.text(st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=16),
).filter(_legal)
SCHEMAS = NAMES.filter(lambda name: name not in TAKEN_SCHEMAS and not name.startswith("pg_"))
# A column's value: any text but NUL, which PostgreSQL's text cannot hold.
VALUES = st.text(st.characters(codec="utf-8", exclude_characters="\x00"), max_size=8)


@dataclass(frozen=True)
class KeyType:
    """A key column's declaration; a textual key takes drawn text, the others 1 and 2."""

    declaration: str
    textual: bool


# One of each way the relay reads a key: as it is (integer, NOT NULL), through to_json (NOT NULL
# numeric), checked for empty or NULL as text (text, varchar) or through to_json (nullable).
KEY_TYPES = [
    KeyType("bigint NOT NULL", textual=False),
    KeyType("numeric NOT NULL", textual=False),
    KeyType("text NOT NULL", textual=True),
    KeyType("varchar(40)", textual=True),
    KeyType("integer", textual=False),
]


@dataclass(frozen=True)
class Example:
    schema: str
    table: str
    partition: str
    key: str
    others: list[str]
    key_type: KeyType
    partitioned: bool
    text_keys: tuple[str, str]
    values: list[tuple[str, str]]


@st.composite
def examples(draw: st.DrawFn) -> Example:
    table, partition = draw(st.lists(NAMES, min_size=2, max_size=2, unique=True))
    columns = draw(
        st.lists(
            NAMES.filter(lambda name: name not in SYSTEM_COLUMNS),
            min_size=1,
            max_size=4,
            unique=True,
        )
    )
    others = columns[1:]
    old_key, new_key = draw(st.lists(VALUES.filter(bool), min_size=2, max_size=2, unique=True))
    return Example(
        schema=draw(SCHEMAS),
        table=table,
        partition=partition,
        key=columns[0],
        others=others,
        key_type=draw(st.sampled_from(KEY_TYPES)),
        partitioned=draw(st.booleans()),
        text_keys=(old_key, new_key),
        values=[(draw(VALUES), draw(VALUES)) for _ in others],
    )


GENERATED_FUNCTIONS = (
    "SELECT count(*) FROM pg_proc WHERE pronamespace = 'sync'::regnamespace"
    " AND proname ~ ('^(relay|relay_delete|rekey)_' || %s || '$')"
)


def _values(values: list[Any]) -> sql.Composable:
    """Values as SQL literals: a query with parameters may not hold a `%` in its names."""
    return sql.SQL(", ").join(sql.Literal(value) for value in values)


def _track_change_and_untrack(
    conn: psycopg.Connection[Any], example: Example, *, both_ways: bool = False
) -> None:
    """Track the example's table (both ways or one way), change it, check every event (and,
    both ways, every version), then untrack it."""
    table = sql.Identifier(example.schema, example.table)
    key = sql.Identifier(example.key)
    others = [sql.Identifier(name) for name in example.others]
    columns = sql.SQL(", ").join(
        [
            sql.SQL("{} {}").format(key, sql.SQL(example.key_type.declaration)),
            *(sql.SQL("{} text").format(column) for column in others),
        ]
    )
    if example.partitioned:
        conn.execute(
            sql.SQL("CREATE TABLE {} ({}) PARTITION BY LIST ({})").format(table, columns, key)
        )
        conn.execute(
            sql.SQL("CREATE TABLE {} PARTITION OF {} DEFAULT").format(
                sql.Identifier(example.schema, example.partition), table
            )
        )
    else:
        conn.execute(sql.SQL("CREATE TABLE {} ({})").format(table, columns))
    row = conn.execute(
        "SELECT c.oid FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace"
        " WHERE n.nspname = %s AND c.relname = %s",
        (example.schema, example.table),
    ).fetchone()
    assert row is not None
    oid = row[0]
    tracked = (
        "SELECT entity_type, key_column, both_ways FROM sync.tracked_tables"
        " WHERE table_name = %s::oid::regclass"
    )
    conn.execute(
        "SELECT sync.track(%s::oid::regclass, 'hostile', %s, %s)", (oid, example.key, both_ways)
    )
    assert conn.execute(tracked, (oid,)).fetchall() == [("hostile", example.key, both_ways)]
    assert conn.execute(GENERATED_FUNCTIONS, (str(oid),)).fetchone() == (3,)

    old_key, new_key = example.text_keys if example.key_type.textual else (1, 2)
    first = [value for value, _ in example.values]
    second = [value for _, value in example.values]
    conn.execute(sql.SQL("INSERT INTO {} VALUES ({})").format(table, _values([old_key, *first])))
    if others:
        conn.execute(
            sql.SQL("UPDATE {} SET ({}) = ROW({})").format(
                table, sql.SQL(", ").join(others), _values(second)
            )
        )
    else:
        conn.execute(sql.SQL("UPDATE {} SET {} = {}").format(table, key, key))
    conn.execute(sql.SQL("UPDATE {} SET {} = {}").format(table, key, sql.Literal(new_key)))
    conn.execute(sql.SQL("DELETE FROM {}").format(table))

    def payload(key_value: Any, values: list[str]) -> list[tuple[str, Any]]:
        return [(example.key, key_value), *zip(example.others, values, strict=True)]

    old_text, new_text = str(old_key), str(new_key)
    events = conn.execute(EVENTS + " ORDER BY txid, seq", ("hostile",)).fetchall()
    assert [(op, entity_id, _pairs(text)) for op, entity_id, text in events] == [
        ("upsert", old_text, payload(old_key, first)),
        ("upsert", old_text, payload(old_key, second)),
        ("delete", old_text, payload(old_key, second)),
        ("upsert", new_text, payload(new_key, second)),
        ("delete", new_text, payload(new_key, second)),
    ]
    if both_ways:
        _check_versions(conn, [old_text, new_text])

    # Untracked: no longer listed, its generated functions gone, no event for any write.
    conn.execute("SELECT sync.untrack(%s::oid::regclass)", (oid,))
    assert conn.execute(tracked, (oid,)).fetchall() == []
    assert conn.execute(GENERATED_FUNCTIONS, (str(oid),)).fetchone() == (0,)
    conn.execute(sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(table, key, _values([old_key])))
    conn.execute(sql.SQL("UPDATE {} SET {} = {}").format(table, key, sql.Literal(new_key)))
    conn.execute(sql.SQL("DELETE FROM {}").format(table))
    assert conn.execute("SELECT count(*) FROM sync.events_outbox").fetchone() == (len(events),)


def _check_versions(conn: psycopg.Connection[Any], keys: list[str]) -> None:
    """Every event of a key a version of this node's, strictly after the one before; each key's
    last version a delete."""
    events = conn.execute(
        "SELECT entity_id, created_at, origin FROM sync.events_outbox"
        " WHERE entity_type = 'hostile' ORDER BY txid, seq"
    ).fetchall()
    versions = conn.execute(
        "SELECT entity_id, version_ts, version_node, deleted FROM sync.row_versions"
        " WHERE entity_type = 'hostile' ORDER BY entity_id COLLATE \"C\""
    ).fetchall()
    for key in keys:
        times = [created for entity_id, created, _ in events if entity_id == key]
        assert all(a < b for a, b in itertools.pairwise(times)), (key, times)
        assert (key, times[-1], NODE, True) in versions, (key, versions)
    assert {origin for *_, origin in events} == {None}
    assert len(versions) == len(keys)


# The examples share one database (the fixture's): each makes its own schema and drops it.
@settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(example=examples())
def test_the_relay_works_for_tables_and_columns_of_any_legal_name(
    backend_dsn: str, example: Example
) -> None:
    with psycopg.connect(backend_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM sync.events_outbox")
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(example.schema)))
        try:
            _track_change_and_untrack(conn, example)
        finally:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(example.schema))
            )


@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(example=examples())
def test_the_both_ways_relay_works_for_tables_and_columns_of_any_legal_name(
    backend_dsn: str, example: Example
) -> None:
    with psycopg.connect(backend_dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM sync.events_outbox")
        conn.execute("DELETE FROM sync.row_versions")
        conn.execute("SELECT sync.set_node_name(%s)", (NODE,))
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(example.schema)))
        try:
            _track_change_and_untrack(conn, example, both_ways=True)
        finally:
            conn.execute(
                sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(example.schema))
            )
