"""The mapping of entity types to tables (INGEST_MAPPING_FILE) checked at start against the
receiving database, refused in one line (exit 2 from `serversync ingest-server`), and names of
any kind (schema, table, columns, payload fields) applied through it, and what its options
do."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest

from consumer.receiver.mapping import MappingError, read_mapping, resolve
from tests.conftest import cli_env, fetch_all
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.mapped import (
    T2,
    VOICEBOT_MAPPING,
    entry,
    label_of,
    new_id,
    number_row,
    post,
    post_body,
    serve_mapped,
    with_receiver_schema,
)


@pytest.fixture
async def mapped_dsn(backend_dsn: str) -> str:
    """A receiving database for the mapped mode."""
    return await with_receiver_schema(backend_dsn)


ODD_TABLE = '''
CREATE SCHEMA "odd schema";
CREATE TABLE "odd schema"."tab.le ""x""" (
    "key col"                integer PRIMARY KEY,
    "Sel%ect"                integer NOT NULL,
    "x'); DROP TABLE y; --"  text,
    "r"                      numeric,
    "j"                      json,
    "jb"                     jsonb,
    "arr"                    integer[],
    "flag"                   boolean,
    "at"                     timestamptz,
    "local only"             text DEFAULT 'kept',
    "doubled"                integer GENERATED ALWAYS AS ("Sel%ect" * 2) STORED
);
'''
ODD_MAPPING = '''
[entities."odd.thing"]
table = '"odd schema"."tab.le ""x"""'
key = "key col"
[entities."odd.thing".columns]
"field one" = "Sel%ect"
"x'); DROP TABLE y; --" = "x'); DROP TABLE y; --"
'extra "q"' = "r"
j = "j"
jb = "jb"
arr = "arr"
flag = "flag"
at = "at"
'''
# Raw JSON: a number no double holds, and a field the mapping does not take.
ODD_BODY = """{"entries": [{"entityType": "odd.thing", "entityId": "7", "op": "upsert", "seq": 1,
  "createdAt": "2026-03-01T10:00:00+00:00", "origin": "frontend",
  "payload": {"field one": 21, "x'); DROP TABLE y; --": "it's \\"quoted\\"",
              "extra \\"q\\"": 123456789012345678901234567890.123456789012345678901234567890,
              "j": {"b": 1,  "a": [1, 2]}, "jb": [true, null, "x"], "arr": [1, 2, 3],
              "flag": true, "at": "2026-01-02T03:04:05.123456+09:00", "unknown": 1,
              "local only": "not mapped"}}]}"""


async def test_any_legal_names_and_column_types(mapped_dsn: str, tmp_path: Path) -> None:
    conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
    async with conn:
        await conn.execute(ODD_TABLE)
    mapping = tmp_path / "odd.toml"
    mapping.write_text(ODD_MAPPING)
    async with serve_mapped(mapped_dsn, mapping) as url:
        status, answer, _ = await post_body(url, ODD_BODY)
    assert (status, answer.get("applied")) == (200, 1), answer
    rows = await fetch_all(
        mapped_dsn,
        '''SELECT "Sel%ect", "x'); DROP TABLE y; --", "r", "j"::text, "jb", "arr", "flag",
                  "at", "local only", "doubled"
             FROM "odd schema"."tab.le ""x"""
            WHERE "key col" = 7''',
    )
    assert rows == [
        (
            21,
            'it\'s "quoted"',
            Decimal("123456789012345678901234567890.123456789012345678901234567890"),
            # The body reaches PostgreSQL as jsonb: a json column gets the value, in jsonb's text.
            '{"a": [1, 2], "b": 1}',
            [True, None, "x"],
            [1, 2, 3],
            True,
            datetime(2026, 1, 1, 18, 4, 5, 123456, tzinfo=UTC),
            "kept",  # not mapped: its default
            42,  # generated: computed by the table
        )
    ]


CHECKED_TABLE = """
CREATE TABLE public.checked (
    id       integer PRIMARY KEY,
    code     text NOT NULL,
    note     text,
    loose    integer,
    computed integer GENERATED ALWAYS AS (id * 2) STORED
);
CREATE VIEW public.checked_view AS SELECT * FROM public.checked;
"""


@pytest.mark.parametrize(
    ("toml", "fragments"),
    [
        ('table = "public.nope"', ("entities.thing", "'public.nope' does not exist")),
        ('table = "a.b.c.d"', ("entities.thing", "is not a table name")),
        ('table = "public.checked_view"', ("public.checked_view is not a table",)),
        ('table = "public.checked"\nkey = "nope"', ("has no key column 'nope'",)),
        ('table = "public.checked"\nkey = "loose"', ("'loose'", "not its primary key or unique")),
        (
            'table = "public.checked"\ncolumns = { code = "code", x = "nope" }',
            ("has no column 'nope'",),
        ),
        (
            'table = "public.checked"\ncolumns = { code = "code", c = "computed" }',
            ("'computed'", "is generated"),
        ),
        (
            'table = "public.checked"\ncolumns = { code = "code", other = "code" }',
            ("'code' and 'other' both map to column 'code'",),
        ),
        (
            'table = "public.checked"\ncolumns = { note = "note" }',
            ("'code'", "NOT NULL without a default and not mapped"),
        ),
        ('table = "public.checked"\ndeletes = "yes"', ("`deletes` must be true or false",)),
        ('table = "public.checked"\nkeys = "id"', ("unknown key 'keys'",)),
        ('key = "id"', ("`table` is required",)),
    ],
)
async def test_a_mapping_that_does_not_fit_the_database_is_refused_in_one_line(
    mapped_dsn: str, tmp_path: Path, toml: str, fragments: tuple[str, ...]
) -> None:
    conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
    async with conn:
        await conn.execute(CHECKED_TABLE)
        mapping = tmp_path / "m.toml"
        mapping.write_text(f"[entities.thing]\n{toml}\n")
        with pytest.raises(MappingError) as refused:
            await resolve(conn, read_mapping(mapping))
    message = str(refused.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize(
    ("table_grant", "versions_grant", "fragment"),
    [
        (
            "SELECT, DELETE",
            "SELECT, INSERT, UPDATE",
            "lacks SELECT, INSERT, UPDATE, DELETE on public.registered_numbers",
        ),
        ("SELECT, INSERT, UPDATE, DELETE", "SELECT", "sync.row_versions"),
    ],
    ids=["table", "versions"],
)
async def test_a_receiver_role_missing_one_privilege_is_refused_at_start(
    mapped_dsn: str, table_grant: str, versions_grant: str, fragment: str
) -> None:
    """Every privilege the apply uses is checked, each alone (PostgreSQL's
    has_table_privilege with a list is true when any one of them is held)."""
    role = f"ss_receiver_{new_id()[:8]}"
    conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
    async with conn:
        await conn.execute(f"CREATE ROLE {role} NOLOGIN")
        try:
            await conn.execute(f"GRANT USAGE ON SCHEMA sync TO {role}")
            await conn.execute(f"GRANT {table_grant} ON public.registered_numbers TO {role}")
            await conn.execute(f"GRANT {versions_grant} ON sync.row_versions TO {role}")
            await conn.execute(f"SET ROLE {role}")
            with pytest.raises(MappingError) as refused:
                await resolve(conn, read_mapping(VOICEBOT_MAPPING))
            await conn.execute("RESET ROLE")
        finally:
            await conn.execute(f"DROP OWNED BY {role}")
            await conn.execute(f"DROP ROLE {role}")
    assert fragment in str(refused.value), refused.value


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("entities = 1", "maps no entity type"),
        ("[other]\n", "unknown table 'other'"),
        ("[entities.thing\n", "not TOML"),
        ('[entities."bad type!"]\ntable = "t"\n', "not an entity type"),
    ],
)
def test_a_mapping_file_not_in_its_form_is_refused_in_one_line(
    tmp_path: Path, text: str, fragment: str
) -> None:
    mapping = tmp_path / "m.toml"
    mapping.write_text(text)
    with pytest.raises(MappingError, match=fragment):
        read_mapping(mapping)


async def test_ingest_server_stops_on_a_wrong_mapping_with_one_line_and_exit_2(
    mapped_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    wrong_table = tmp_path / "bad.toml"
    wrong_table.write_text('[entities.registered_number]\ntable = "public.registered_numberz"\n')
    wrong_column = tmp_path / "column.toml"
    wrong_column.write_text(
        '[entities.registered_number]\ntable = "public.registered_numbers"\n'
        'columns = { phone_number = "phone_number", label = "lable" }\n'
    )
    args = ["ingest-server", "--insecure", "--port", "0", "--mapping"]
    on_backend = cli_env(FRONTEND_DATABASE_URL=mapped_dsn)
    results = await asyncio.gather(
        run_cli(*args, str(wrong_table), env=on_backend),
        run_cli(*args, str(wrong_column), env=on_backend),
        # The example fits the voicebot's tables, but a database without serversync's schema
        # (a receiver's own) has no version guard to apply them with.
        run_cli(*args, str(VOICEBOT_MAPPING), env=cli_env(FRONTEND_DATABASE_URL=receiver_dsn)),
    )
    assert_one_line_error(
        results[0],
        2,
        f"INGEST_MAPPING_FILE {wrong_table}: entities.registered_number",
        "'public.registered_numberz' does not exist",
    )
    assert_one_line_error(results[1], 2, "has no column 'lable'")
    assert_one_line_error(results[2], 2, "sync.row_versions is missing", "serversync migrate")


async def test_deletes_false_ignores_delete_entries(mapped_dsn: str, tmp_path: Path) -> None:
    mapping = tmp_path / "keep.toml"
    mapping.write_text(
        '[entities.registered_number]\ntable = "public.registered_numbers"\ndeletes = false\n'
    )
    key = new_id()
    async with serve_mapped(mapped_dsn, mapping) as url:
        assert (await post(url, entry("registered_number", key, number_row(key, "a"))))[0] == 200
        # An ignored delete needs no version: it changes nothing, and counts as stale.
        gone = entry("registered_number", key, {"id": key}, op="delete", origin=None, created_at=T2)
        status, answer, _ = await post(url, gone)
        assert (status, answer["applied"], answer["stale"]) == (200, 0, 1), answer
    assert await label_of(mapped_dsn, key) == "a"


FAMILY = """
CREATE TABLE parents (id integer PRIMARY KEY, name text);
CREATE TABLE children (id integer PRIMARY KEY, parent_id integer NOT NULL REFERENCES parents);
"""
FAMILY_MAPPING = """
[entities.parent]
table = "public.parents"
[entities.child]
table = "public.children"
"""


async def test_an_entry_whose_referenced_row_has_not_arrived_is_retried_not_parked(
    mapped_dsn: str, tmp_path: Path
) -> None:
    """A child whose parent is in a batch still in flight (or comes later) is passing trouble:
    503 with Retry-After, nothing applied; once the parent is there the same batch applies."""
    conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
    async with conn:
        await conn.execute(FAMILY)
    mapping = tmp_path / "family.toml"
    mapping.write_text(FAMILY_MAPPING)
    child = entry("child", "10", {"id": 10, "parent_id": 1})
    async with serve_mapped(mapped_dsn, mapping) as url:
        status, answer, headers = await post(url, child)
        assert (status, answer["error"]["code"]) == (503, "INGEST_BUSY"), answer
        assert headers["Retry-After"] == "1"
        assert await fetch_all(mapped_dsn, "SELECT id FROM children") == []
        status, answer, _ = await post(url, entry("parent", "1", {"id": 1, "name": "p"}))
        assert status == 200, answer
        status, answer, _ = await post(url, child)
        assert (status, answer["applied"]) == (200, 1), answer
    assert await fetch_all(mapped_dsn, "SELECT id, parent_id FROM children") == [(10, 1)]


async def test_a_table_tracked_both_ways_under_another_type_is_refused(mapped_dsn: str) -> None:
    """The receiver must write versions under the names the both-ways relay reads them by."""
    conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
    async with conn:
        await conn.execute("SELECT sync.set_node_name('backend')")
        await conn.execute("SELECT sync.track('public.registered_numbers', 'number', 'id', true)")
        with pytest.raises(MappingError) as refused:
            await resolve(conn, read_mapping(VOICEBOT_MAPPING))
    assert "tracked both ways as entity type 'number'" in str(refused.value)
