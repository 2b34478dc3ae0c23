"""Least privilege (sql/backend/functions/track.sql): the relay's generated functions run as
serversync_relay, so a role that writes a tracked table needs only that table's privileges; it can
neither write the outbox nor make the relay write events of another table or entity type; and the
grants docs/security.md gives a producer, a consumer and an operator are enough to run each of them.

Roles belong to the cluster, not to a test's database: every role made here has a name of its
own and is dropped when its test ends."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import conninfo, sql

from consumer.devtools.devdb import Server
from consumer.store import migrations, retention
from tests.conftest import (
    CliResult,
    cli_env,
    fetch_all,
    fetch_value,
    finish,
    make_settings,
    running_consumer,
    start_cli,
    waiting_for_notify,
)
from tests.support.backend import execute, insert_callers
from tests.support.receivers import scripted_receiver
from tests.support.waiting import wait_delivered_events, wait_until

SECURITY_DOC = Path(__file__).resolve().parent.parent / "docs" / "security.md"
RELAY_ROLE = "serversync_relay"
EVENTS = "SELECT op, entity_type, entity_id, payload FROM sync.events_outbox ORDER BY txid, seq"
# The functions sync.track generates for a table.
GENERATED = (
    "SELECT p.proname, pg_get_userbyid(p.proowner), p.prosecdef, p.proconfig,"
    " p.proacl::text[] FROM pg_proc p WHERE p.pronamespace = 'sync'::regnamespace"
    " AND p.proname ~ ('^(relay|relay_delete|rekey)_' || %s::regclass::oid || '$')"
    " ORDER BY p.proname"
)
# Every privilege a role holds on the schema sync and on its tables, views and sequences.
SYNC_PRIVILEGES = """
SELECT 'schema sync: ' || p
  FROM unnest(ARRAY['USAGE', 'CREATE']) AS p
 WHERE has_schema_privilege(%(role)s, 'sync', p)
UNION ALL
SELECT c.relname || ': ' || p
  FROM pg_class c
       CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'TRIGGER']) p
 WHERE c.relnamespace = 'sync'::regnamespace AND c.relkind IN ('r', 'v')
   AND has_table_privilege(%(role)s, c.oid, p)
UNION ALL
SELECT c.relname || ': ' || p
  FROM pg_class c CROSS JOIN unnest(ARRAY['USAGE', 'SELECT', 'UPDATE']) p
 WHERE c.relnamespace = 'sync'::regnamespace AND c.relkind = 'S'
   AND has_sequence_privilege(%(role)s, c.oid, p)
"""


class Roles:
    """Roles made by one test, each with a name of its own, dropped when the test ends (with
    what they own and were granted in every database they were made for)."""

    def __init__(self, server_dsn: str) -> None:
        self.server_dsn = server_dsn
        self.names: list[str] = []
        self.dsns: list[str] = []

    async def create(self, kind: str, dsn: str, options: str = "LOGIN") -> str:
        """A new role, for use in the database of `dsn`."""
        name = f"ss_{kind}_{uuid.uuid4().hex[:8]}"
        await execute(dsn, sql.SQL("CREATE ROLE {} " + options).format(sql.Identifier(name)))
        self.names.append(name)
        if dsn not in self.dsns:
            self.dsns.append(dsn)
        return name

    async def drop_all(self) -> None:
        if not self.names:
            return
        names = sql.SQL(", ").join(sql.Identifier(name) for name in self.names)
        for dsn in self.dsns:
            conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
            async with conn:
                await conn.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(names))
                await conn.execute(sql.SQL("DROP OWNED BY {}").format(names))
        conn = await psycopg.AsyncConnection.connect(self.server_dsn, autocommit=True)
        async with conn:
            await conn.execute(sql.SQL("DROP ROLE {}").format(names))


@pytest.fixture
async def roles(pg_server: Server) -> AsyncIterator[Roles]:
    made = Roles(pg_server.dsn)
    try:
        yield made
    finally:
        await made.drop_all()


def as_role(dsn: str, role: str) -> str:
    """The same database, connecting as `role` (trust authentication in the tests' server)."""
    return conninfo.make_conninfo(dsn, user=role)


async def connect_as(dsn: str, role: str) -> psycopg.AsyncConnection[Any]:
    return await psycopg.AsyncConnection.connect(as_role(dsn, role), autocommit=True)


def grant(template: str, *roles: str) -> sql.Composed:
    """A statement naming roles: `template` holds one {} per role."""
    return sql.SQL(template).format(*(sql.Identifier(role) for role in roles))


async def give_database(dsn: str, owner: str) -> None:
    """Make `owner` the owner of the database of `dsn` (it migrates it, as no superuser)."""
    name = conninfo.conninfo_to_dict(dsn)["dbname"]
    assert isinstance(name, str)
    await execute(
        dsn,
        sql.SQL("ALTER DATABASE {} OWNER TO {}").format(
            sql.Identifier(name), sql.Identifier(owner)
        ),
    )


async def writer_of(dsn: str, roles: Roles, *tables: str, schema: str = "public") -> str:
    """A producer: USAGE on `schema`, and SELECT, INSERT, UPDATE, DELETE on `tables`."""
    writer = await roles.create("writer", dsn)
    await execute(
        dsn,
        grant(f"GRANT USAGE ON SCHEMA {schema} TO {{}}", writer),
        *(grant(f"GRANT SELECT, INSERT, UPDATE, DELETE ON {t} TO {{}}", writer) for t in tables),
    )
    return writer


async def test_a_producer_with_only_its_tables_privileges_has_every_change_relayed(
    backend_dsn: str, roles: Roles
) -> None:
    await execute(
        backend_dsn,
        "CREATE SCHEMA shop",
        "CREATE TABLE shop.items (sku text PRIMARY KEY, qty int NOT NULL)",
        "SELECT sync.track('shop.items', 'item', 'sku')",
    )
    writer = await writer_of(backend_dsn, roles, "shop.items", schema="shop")
    assert await fetch_all(backend_dsn, SYNC_PRIVILEGES, {"role": writer}) == []
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        await conn.execute("INSERT INTO shop.items VALUES ('a', 1), ('b', 2)")
        await conn.execute("UPDATE shop.items SET qty = qty + 1 WHERE sku = 'a'")
        await conn.execute("UPDATE shop.items SET sku = 'c' WHERE sku = 'b'")
        await conn.execute("DELETE FROM shop.items WHERE sku = 'a'")
    assert await fetch_all(backend_dsn, EVENTS) == [
        ("upsert", "item", "a", {"sku": "a", "qty": 1}),
        ("upsert", "item", "b", {"sku": "b", "qty": 2}),
        ("upsert", "item", "a", {"sku": "a", "qty": 2}),
        ("delete", "item", "b", {"sku": "b", "qty": 2}),  # the old key of a changed one
        ("upsert", "item", "c", {"sku": "c", "qty": 2}),
        ("delete", "item", "a", {"sku": "a", "qty": 2}),
    ]
    oid = await fetch_value(backend_dsn, "SELECT 'shop.items'::regclass::oid")
    generated = await fetch_all(backend_dsn, GENERATED, ("shop.items",))
    assert [row[0] for row in generated] == [
        f"{name}_{oid}" for name in ("rekey", "relay", "relay_delete")
    ]
    for _, owner, definer, config, acl in generated:
        # Runs as the relay's role, with a fixed search_path; no role but it may EXECUTE it.
        assert (owner, definer, config) == (RELAY_ROLE, True, ["search_path=pg_catalog, pg_temp"])
        assert acl == [f"{RELAY_ROLE}=X/{RELAY_ROLE}"]


async def test_a_producer_cannot_write_the_outbox_or_make_the_relay_write_for_another_table(
    backend_dsn: str, roles: Roles
) -> None:
    """The worst a producer may still hold: USAGE on the schema sync (granted by a setup
    older than the relay's own role, when producers needed it) and a schema of its own to create
    tables in."""
    writer = await writer_of(backend_dsn, roles, "call_logs")
    await execute(
        backend_dsn,
        grant("GRANT USAGE ON SCHEMA sync TO {}", writer),
        grant("CREATE SCHEMA own AUTHORIZATION {}", writer),
    )
    relay = "sync.relay_{}".format(
        await fetch_value(backend_dsn, "SELECT 'call_logs'::regclass::oid")
    )
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        await conn.execute("CREATE TABLE own.mine (id uuid PRIMARY KEY, caller_number text)")
        refused = [
            "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)"
            " VALUES ('delete', 'call_log', 'someone-else', '{}')",
            "UPDATE sync.events_outbox SET op = 'delete'",
            "DELETE FROM sync.events_outbox",
            "TRUNCATE sync.events_outbox",
            # A relay function called directly, or attached to a table of its own, where it
            # would send that table's rows as call logs.
            f"SELECT {relay}()",
            f"CREATE TRIGGER forge AFTER INSERT ON own.mine REFERENCING NEW TABLE AS"
            f" sync_changed_rows FOR EACH STATEMENT EXECUTE FUNCTION {relay}()",
            # Tracking a table of its own as call logs, or the call logs as something else.
            "SELECT sync.track('own.mine', 'call_log')",
            "SELECT sync.track('call_logs', 'invoice')",
            "SELECT sync.untrack('call_logs')",
        ]
        for statement in refused:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                await conn.execute(statement)
        await conn.execute(
            "INSERT INTO own.mine VALUES ('00000000-0000-0000-0000-000000000001', 'mine')"
        )
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('c', 'x')")
    rows = await fetch_all(backend_dsn, EVENTS)
    assert [
        (op, entity_type, payload["caller_number"]) for op, entity_type, _, payload in rows
    ] == [("upsert", "call_log", "c")]
    assert await fetch_all(
        backend_dsn,
        "SELECT entity_type FROM sync.tracked_tables WHERE table_name = 'call_logs'::regclass",
    ) == [("call_log",)]


async def test_only_a_tables_owner_may_track_it(backend_dsn: str, roles: Roles) -> None:
    """Tracking decides which rows go out as which entity type, and grants the relay's role a
    column of the table and adds a policy to it: a role that may add triggers to a table,
    create functions in the schema sync and call sync.track still may not track a table it
    does not own."""
    outsider = await roles.create("outsider", backend_dsn)
    await execute(
        backend_dsn,
        "CREATE TABLE notes (id int PRIMARY KEY, body text)",
        grant("GRANT TRIGGER ON notes TO {}", outsider),
        grant("GRANT USAGE, CREATE ON SCHEMA sync TO {}", outsider),
        grant(
            "GRANT EXECUTE ON FUNCTION sync.track(regclass, text, text, boolean) TO {}", outsider
        ),
    )
    conn = await connect_as(backend_dsn, outsider)
    async with conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="only the owner of table"):
            await conn.execute("SELECT sync.track('notes', 'call_log')")
    assert (
        await fetch_all(
            backend_dsn, "SELECT 1 FROM sync.tracked_tables WHERE table_name = 'notes'::regclass"
        )
        == []
    )


async def test_migrating_takes_back_outbox_writes_that_default_privileges_granted(
    empty_dsn: str, roles: Roles
) -> None:
    """Default privileges (ALTER DEFAULT PRIVILEGES, a common way to grant an application every
    new table) would give a producer the right to write the outbox, attach a trigger to it or
    take its positions as soon as the migration creates it: the migration takes every such
    right back from every role but the relay's; DELETE, which `serversync cleanup` needs and
    which makes up no event, stays."""
    writer = await roles.create("writer", empty_dsn)
    cleaner = await roles.create("cleaner", empty_dsn)
    await execute(
        empty_dsn,
        grant("ALTER DEFAULT PRIVILEGES GRANT USAGE ON SCHEMAS TO {}, {}", writer, cleaner),
        grant(
            "ALTER DEFAULT PRIVILEGES"
            " GRANT SELECT, INSERT, UPDATE, DELETE, TRIGGER ON TABLES TO {}",
            writer,
        ),
        grant("ALTER DEFAULT PRIVILEGES GRANT USAGE ON SEQUENCES TO {}", writer),
        grant("ALTER DEFAULT PRIVILEGES GRANT SELECT, DELETE ON TABLES TO {}", cleaner),
    )
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        await migrations.migrate(conn, ["backend"])
        await migrations.apply_examples(conn)
    await execute(
        as_role(empty_dsn, writer),
        "INSERT INTO call_logs (caller_number, callee_number) VALUES ('before', 'x')",
    )

    privileges = (
        "SELECT has_table_privilege(%(writer)s, 'sync.events_outbox', 'INSERT'),"
        " has_table_privilege(%(writer)s, 'sync.events_outbox', 'TRIGGER'),"
        " has_sequence_privilege(%(writer)s, 'sync.events_outbox_seq_seq', 'USAGE'),"
        " has_sequence_privilege(%(writer)s, 'sync.waiting_consumers', 'USAGE'),"
        " has_table_privilege(%(cleaner)s, 'sync.events_outbox', 'DELETE')"
    )
    assert await fetch_all(empty_dsn, privileges, {"writer": writer, "cleaner": cleaner}) == [
        (False, False, False, False, True)
    ]
    conn = await connect_as(empty_dsn, writer)
    async with conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(
                "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)"
                " VALUES ('delete', 'call_log', 'someone-else', '{}')"
            )
    await execute(
        as_role(empty_dsn, writer),
        "INSERT INTO call_logs (caller_number, callee_number) VALUES ('after', 'x')",
    )
    rows = await fetch_all(empty_dsn, EVENTS)
    assert [(op, payload["caller_number"]) for op, _, _, payload in rows] == [
        ("upsert", "before"),
        ("upsert", "after"),
    ]
    for _, owner, definer, _, _ in await fetch_all(empty_dsn, GENERATED, ("call_logs",)):
        assert (owner, definer) == (RELAY_ROLE, True)


async def test_a_partitioned_table_is_relayed_for_a_producer_without_sync_privileges(
    backend_dsn: str, roles: Roles
) -> None:
    """Row triggers, cloned onto every partition (one attached after tracking too); a key
    change inside a partition is checked against the whole table, through its parent."""
    await execute(
        backend_dsn,
        "CREATE TABLE readings (id int, region text, value int, PRIMARY KEY (id, region))"
        " PARTITION BY LIST (region)",
        "CREATE TABLE readings_north PARTITION OF readings FOR VALUES IN ('n')",
        "SELECT sync.track('public.readings', 'reading')",
        "CREATE TABLE readings_south PARTITION OF readings FOR VALUES IN ('s')",
    )
    writer = await writer_of(backend_dsn, roles, "readings", "readings_north", "readings_south")
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        await conn.execute("INSERT INTO readings VALUES (1, 'n', 10), (2, 's', 20)")
        await conn.execute("INSERT INTO readings_north VALUES (3, 'n', 30)")
        await conn.execute("UPDATE readings_south SET value = 21")
        await conn.execute("UPDATE readings SET id = 4 WHERE id = 3")
        await conn.execute("UPDATE readings_north SET id = 2 WHERE id = 1")  # 2 is in 's' too
        await conn.execute("DELETE FROM readings_north WHERE id = 4")
    rows = await fetch_all(backend_dsn, EVENTS)
    assert [(op, entity_type, key, p["value"]) for op, entity_type, key, p in rows] == [
        ("upsert", "reading", "1", 10),
        ("upsert", "reading", "2", 20),
        ("upsert", "reading", "3", 30),
        ("upsert", "reading", "2", 21),
        ("delete", "reading", "3", 30),
        ("upsert", "reading", "4", 30),
        ("delete", "reading", "1", 10),
        ("upsert", "reading", "2", 10),
        ("delete", "reading", "4", 30),
    ]


async def test_keys_swapped_in_a_partitioned_table_with_row_security_leave_both_entities(
    backend_dsn: str, roles: Roles
) -> None:
    """The rekey check reads the table as serversync_relay. Row level security would show it
    no row (so no key would ever be taken) but for the policy sync.track adds for it: here two
    rows trade keys in one UPDATE of a partitioned table, whose row triggers send each row's
    delete and upsert in turn, so a delete of a key taken meanwhile would remove an entity."""
    writer = await roles.create("writer", backend_dsn)
    await execute(
        backend_dsn,
        "CREATE TABLE slots (code text NOT NULL, shelf text, item text) PARTITION BY LIST (shelf)",
        "CREATE TABLE slots_top PARTITION OF slots FOR VALUES IN ('top')",
        "ALTER TABLE slots ENABLE ROW LEVEL SECURITY",
        grant("CREATE POLICY writer_rows ON slots TO {} USING (true) WITH CHECK (true)", writer),
        "SELECT sync.track('public.slots', 'slot', 'code')",
        grant("GRANT USAGE ON SCHEMA public TO {}", writer),
        grant("GRANT SELECT, INSERT, UPDATE ON slots TO {}", writer),
    )
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        await conn.execute("INSERT INTO slots VALUES ('a', 'top', 'apple'), ('b', 'top', 'banana')")
        await conn.execute("UPDATE slots SET code = CASE code WHEN 'a' THEN 'b' ELSE 'a' END")
        await conn.execute("UPDATE slots SET code = 'c' WHERE code = 'a'")
    rows = [(op, key, p["item"]) for op, _, key, p in await fetch_all(backend_dsn, EVENTS)]
    assert rows[:2] == [("upsert", "a", "apple"), ("upsert", "b", "banana")]
    assert sorted(rows[2:4]) == [("upsert", "a", "banana"), ("upsert", "b", "apple")]
    assert rows[4:] == [("delete", "a", "banana"), ("upsert", "c", "banana")]


async def test_a_producers_search_path_cannot_redirect_the_relay(
    backend_dsn: str, roles: Roles
) -> None:
    """The relay runs as serversync_relay with search_path pg_catalog, pg_temp: functions and
    operators a producer puts first in its own search_path are never what it calls."""
    await execute(
        backend_dsn,
        "CREATE TABLE badges (code text PRIMARY KEY, holder text)",
        "SELECT sync.track('public.badges', 'badge', 'code')",
    )
    writer = await writer_of(backend_dsn, roles, "badges")
    await execute(backend_dsn, grant("CREATE SCHEMA own AUTHORIZATION {}", writer))
    trap = "BEGIN RAISE EXCEPTION 'called as %', current_user; END"
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        for statement in [
            f"CREATE FUNCTION own.to_json(anyelement) RETURNS json LANGUAGE plpgsql AS $${trap}$$",
            f"CREATE FUNCTION own.eq(text, text) RETURNS bool LANGUAGE plpgsql AS $${trap}$$",
            f"CREATE FUNCTION own.ne(text, text) RETURNS bool LANGUAGE plpgsql AS $${trap}$$",
            "CREATE OPERATOR own.= (LEFTARG = text, RIGHTARG = text, FUNCTION = own.eq)",
            "CREATE OPERATOR own.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = own.ne)",
            f"CREATE FUNCTION own.current_setting(text, bool) RETURNS text LANGUAGE plpgsql"
            f" AS $${trap}$$",
            f"CREATE FUNCTION own.pg_notify(text, text) RETURNS void LANGUAGE plpgsql"
            f" AS $${trap}$$",
            "SET search_path = own, pg_catalog, public",
            "SET sync.notify = 'always'",
        ]:
            await conn.execute(statement)
        await conn.execute("INSERT INTO badges VALUES ('b-1', 'ann')")
        await conn.execute("UPDATE badges SET code = 'b-2'")
        await conn.execute("DELETE FROM badges")
    rows = [(op, key) for op, _, key, _ in await fetch_all(backend_dsn, EVENTS)]
    assert rows == [("upsert", "b-1"), ("delete", "b-1"), ("upsert", "b-2"), ("delete", "b-2")]


async def test_a_waiting_consumer_is_woken_by_a_producer_without_sync_privileges(
    backend_dsn: str, receiver_url: str, roles: Roles
) -> None:
    """The wake-up check (sql/backend/schema.sql, The wake-up) reads sync.waiting_consumers as the
    relay's role: the producer's commit still sends the NOTIFY an idle consumer waits for."""
    writer = await writer_of(backend_dsn, roles, "call_logs")
    settings = make_settings(backend_dsn, receiver_url, SYNC_POLL_INTERVAL_SEC=60)
    async with running_consumer(settings) as runtime:
        await wait_until(lambda: waiting_for_notify(backend_dsn), what="the idle consumer to wait")
        await execute(
            as_role(backend_dsn, writer),
            "INSERT INTO call_logs (caller_number, callee_number) VALUES ('woken', 'x')",
        )
        await wait_delivered_events(
            runtime, 1, timeout=5, what="the event, well before the 60 s poll timer"
        )
        assert runtime.stats.poll_wakeups == 0


async def may_join_relay_role(dsn: str) -> bool:
    """Whether a migrating role with CREATEROLE can make itself a member of serversync_relay.
    From PostgreSQL 16 on, CREATEROLE grants membership only in roles the grantor holds with
    ADMIN OPTION (those it created itself): a serversync_relay someone else made earlier must be
    granted to the migrating role, else the documented fallback applies (the functions stay the
    migrating role's)."""
    relay_existed = await fetch_value(dsn, "SELECT to_regrole(%s) IS NOT NULL", (RELAY_ROLE,))
    return not relay_existed or bool(
        await fetch_value(dsn, "SELECT current_setting('server_version_num')::int < 160000")
    )


async def test_a_migrating_role_that_may_create_roles_hands_the_relay_to_serversync_relay(
    empty_dsn: str, roles: Roles
) -> None:
    """No superuser: the migrating role makes itself a member of serversync_relay (made by
    an earlier migration of this cluster, or now), and sync.track lends the role CREATE on the
    schema sync only while it hands the functions over."""
    owner = await roles.create("owner", empty_dsn, "LOGIN CREATEROLE")
    await give_database(empty_dsn, owner)
    may_join = await may_join_relay_role(empty_dsn)
    conn = await connect_as(empty_dsn, owner)
    async with conn:
        await migrations.migrate(conn, ["backend"])
        await migrations.apply_examples(conn)
    expected_owner = RELAY_ROLE if may_join else owner
    for _, function_owner, definer, _, _ in await fetch_all(empty_dsn, GENERATED, ("call_logs",)):
        assert (function_owner, definer) == (expected_owner, True)
    relay_rights = (
        "SELECT has_schema_privilege(%(relay)s, 'sync', 'CREATE'),"
        " pg_has_role(%(owner)s, %(relay)s, 'MEMBER')"
    )
    assert await fetch_all(empty_dsn, relay_rights, {"relay": RELAY_ROLE, "owner": owner}) == [
        (False, may_join)
    ]
    writer = await writer_of(empty_dsn, roles, "call_logs")
    await execute(
        as_role(empty_dsn, writer),
        "INSERT INTO call_logs (caller_number, callee_number) VALUES ('handed', 'x')",
    )
    assert await fetch_value(empty_dsn, "SELECT count(*) FROM sync.events_outbox") == 1


async def test_without_serversync_relay_the_relay_runs_as_the_migrating_role(
    empty_dsn: str, roles: Roles
) -> None:
    """A migrating role that may not create roles, and is no member of serversync_relay (as
    on a managed service where nobody created it for serversync): the relay's functions stay
    SECURITY DEFINER and belong to the migrating role, with a NOTICE; producers still need no
    privilege on the schema sync."""
    owner = await roles.create("owner", empty_dsn)
    await give_database(empty_dsn, owner)
    notices: list[str] = []
    conn = await connect_as(empty_dsn, owner)
    async with conn:
        conn.add_notice_handler(lambda notice: notices.append(notice.message_primary or ""))
        await migrations.migrate(conn, ["backend"])
        await migrations.apply_examples(conn)
    assert any("may not become a member of role serversync_relay" in n for n in notices), notices
    assert any(f"the relay of call_logs runs as {owner}" in n for n in notices), notices
    for _, function_owner, definer, config, _ in await fetch_all(
        empty_dsn, GENERATED, ("call_logs",)
    ):
        assert (function_owner, definer, config) == (
            owner,
            True,
            ["search_path=pg_catalog, pg_temp"],
        )
    writer = await writer_of(empty_dsn, roles, "call_logs")
    assert await fetch_all(empty_dsn, SYNC_PRIVILEGES, {"role": writer}) == []
    conn = await connect_as(empty_dsn, writer)
    async with conn:
        await conn.execute("INSERT INTO call_logs (caller_number, callee_number) VALUES ('x', 'y')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(
                "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)"
                " VALUES ('delete', 'call_log', 'someone-else', '{}')"
            )
    assert await fetch_value(empty_dsn, "SELECT count(*) FROM sync.events_outbox") == 1


# -- the grants docs/security.md gives each role ---------------------------------------------


def documented_grants(role: str) -> list[str]:
    """The statements of the first SQL block under the heading of `role` in the section
    "Roles and grants" of docs/security.md."""
    text = SECURITY_DOC.read_text("utf-8")
    section = text.split("\n## Roles and grants\n", 1)[1].split("\n## ", 1)[0]
    heading = re.search(rf"^### .*`{re.escape(role)}`.*$", section, re.MULTILINE)
    assert heading is not None, f"no heading for {role} in {SECURITY_DOC}"
    block = re.search(r"^```sql\n(.*?)^```", section[heading.end() :], re.MULTILINE | re.DOTALL)
    assert block is not None, f"no SQL block under the heading for {role}"
    code = re.sub(r"--[^\n]*", "", block.group(1))
    return [statement.strip() for statement in code.split(";") if statement.strip()]


async def grant_as_documented(dsn: str, documented: str, role: str) -> None:
    """The documented statements for `documented`, made for `role`."""
    statements = documented_grants(documented)
    assert statements, documented
    await execute(dsn, *(re.sub(rf"\b{documented}\b", role, statement) for statement in statements))


async def cli_as(dsn: str, role: str, *args: str, frontend: str) -> CliResult:
    """`serversync ARGS...` connecting as `role`; fails unless it exits 0."""
    env = cli_env(DATABASE_URL=as_role(dsn, role), FRONTEND_BASE_URL=frontend)
    result = await finish(await start_cli(*args, env=env))
    assert result.code == 0, (args, result.stdout, result.stderr)
    assert "permission denied" not in result.stderr, (args, result.stderr)
    return result


async def test_the_documented_grants_run_a_producer_a_consumer_and_an_operator(
    backend_dsn: str, roles: Roles
) -> None:
    """Each role gets exactly the statements docs/security.md gives it (the producer's for its
    table): the producer's writes are relayed, the consumer delivers them, parks the one the
    receiver refuses and is woken by NOTIFY, and the operator runs status, offsets, dlq,
    cleanup and consumers."""
    writer = await roles.create("writer", backend_dsn)
    consumer = await roles.create("consumer", backend_dsn)
    operator = await roles.create("operator", backend_dsn)
    statements = documented_grants("app_writer")
    await execute(
        backend_dsn,
        *(
            re.sub(r"\bapp_writer\b", writer, s).replace("public.invoices", "public.call_logs")
            for s in statements
        ),
    )
    await grant_as_documented(backend_dsn, "serversync_consumer", consumer)
    await grant_as_documented(backend_dsn, "serversync_operator", operator)

    async with scripted_receiver() as receiver:
        receiver.refuse = {"bad-1"}
        settings = make_settings(
            as_role(backend_dsn, consumer), receiver.url, SYNC_POLL_INTERVAL_SEC=60
        )
        async with running_consumer(settings) as runtime:
            await wait_until(
                lambda: waiting_for_notify(backend_dsn), what="the idle consumer to wait"
            )
            await insert_callers(as_role(backend_dsn, writer), ["good-1", "bad-1", "good-2"])

            def settled() -> bool:
                return runtime.stats.delivered_events + runtime.stats.parked_events == 3

            await wait_until(settled, what="every event delivered or parked")
            assert (runtime.stats.delivered_events, runtime.stats.parked_events) == (2, 1)
            assert runtime.stats.poll_wakeups == 0
        receiver.refuse = set()

        async def no_connections() -> bool:
            conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
            async with conn:
                return not await retention.consumer_sessions(conn, "frontend-sync")

        await wait_until(no_connections, what="the consumer's connections to close")

        async def run(*args: str) -> CliResult:
            return await cli_as(backend_dsn, operator, *args, frontend=receiver.url)

        status = orjson.loads((await run("status", "--json")).stdout)
        [row] = status["consumers"]
        assert (row["consumer"], row["delivered_total"], row["dlq_pending"]) == (
            "frontend-sync",
            2,
            1,
        )
        await run("offsets", "list")
        page = orjson.loads((await run("dlq", "list", "frontend-sync", "--json")).stdout)
        [message] = page["messages"]
        await run("dlq", "show", message["id"])
        await run("dlq", "retry", message["id"])
        assert receiver.accepted_callers()[-1:] == ["bad-1"]
        await run("cleanup", "--older-than", "0s")
        assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == 0
        await run("offsets", "reset", "frontend-sync", "--to-earliest")
        await run("consumers", "remove", "frontend-sync", "--yes", "--purge-dlq")
    assert await fetch_all(backend_dsn, "SELECT consumer FROM sync.consumer_offsets") == []
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.dlq_messages") == 0


# -- code of other roles inside the relay ----------------------------------------------------

FORGE = (
    "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)"
    " VALUES ('delete', 'call_log', 'forged', '{}')"
)


async def owner_and_writer(dsn: str, roles: Roles) -> tuple[str, str]:
    """A table owner (schema shop) and a producer with a schema of its own (w), both no
    superuser; each may use the other's schema."""
    owner = await roles.create("owner", dsn)
    writer = await roles.create("writer", dsn)
    await execute(
        dsn,
        grant("CREATE SCHEMA shop AUTHORIZATION {}", owner),
        grant("CREATE SCHEMA w AUTHORIZATION {}", writer),
        grant("GRANT USAGE ON SCHEMA shop TO {}", writer),
        grant("GRANT USAGE ON SCHEMA w TO {}", owner),
    )
    return owner, writer


async def test_sync_track_refuses_a_column_type_cast_or_key_operator_of_another_role(
    backend_dsn: str, roles: Roles
) -> None:
    """to_json(r.*) calls a column type's cast to json, and the rekey check the key's `=`,
    as serversync_relay: a producer that owns the type (an enum of its own, or one inside an
    array, a domain or a composite type), the cast's function or the operator could have the
    relay write any event. sync.track refuses such a table, naming the column and the role."""
    owner, writer = await owner_and_writer(backend_dsn, roles)
    as_writer = as_role(backend_dsn, writer)
    as_owner = as_role(backend_dsn, owner)
    await execute(
        as_writer,
        "CREATE TYPE w.mood AS ENUM ('ok', 'bad')",
        "CREATE FUNCTION w.evil(w.mood) RETURNS json LANGUAGE plpgsql AS $$"
        f" BEGIN {FORGE}; RETURN to_json($1::text); END $$",
        "CREATE CAST (w.mood AS json) WITH FUNCTION w.evil(w.mood)",
        "CREATE FUNCTION w.evil_state(text) RETURNS json LANGUAGE plpgsql AS $$"
        f" BEGIN {FORGE}; RETURN to_json($1); END $$",
        "CREATE FUNCTION w.eq(text, text) RETURNS boolean LANGUAGE plpgsql AS $$"
        f" BEGIN {FORGE}; RETURN $1 OPERATOR(pg_catalog.=) $2; END $$",
        "CREATE OPERATOR w.= (LEFTARG = text, RIGHTARG = text, FUNCTION = w.eq)",
    )
    await execute(
        as_owner,
        "CREATE DOMAIN shop.mood_d AS w.mood",
        "CREATE TYPE shop.pair AS (m w.mood[], n int)",
        "CREATE TYPE shop.state AS ENUM ('new', 'old')",
        "CREATE FUNCTION shop.state_json(shop.state) RETURNS json LANGUAGE sql"
        " AS $$ SELECT w.evil_state($1::text) $$",
        # The cast is the owner's, its function calls the writer's: the function's owner
        # counts, so a cast whose function is the writer's own is refused.
        "CREATE TABLE shop.direct (id int PRIMARY KEY, m w.mood)",
        "CREATE TABLE shop.arrays (id int PRIMARY KEY, m w.mood[])",
        "CREATE TABLE shop.domains (id int PRIMARY KEY, m shop.mood_d)",
        "CREATE TABLE shop.composites (id int PRIMARY KEY, p shop.pair)",
        "CREATE TABLE shop.keyed (code text PRIMARY KEY, n int)",
        "CREATE TABLE shop.clean (id int PRIMARY KEY, s shop.state, body text, tags text[])",
    )
    await execute(
        backend_dsn,  # casting from a type needs its ownership; the writer's function: EXECUTE
        "CREATE FUNCTION shop.state_cast(shop.state) RETURNS json LANGUAGE sql"
        " AS $$ SELECT to_json($1::text) $$",
        grant("ALTER FUNCTION shop.state_cast(shop.state) OWNER TO {}", writer),
    )
    await execute(
        as_owner,
        "CREATE CAST (shop.state AS jsonb) WITH INOUT",
    )
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for table, column in [
            ("direct", "m"),
            ("arrays", "m"),
            ("domains", "m"),
            ("composites", "p"),
        ]:
            with pytest.raises(psycopg.errors.InsufficientPrivilege) as refused:
                await conn.execute(f"SELECT sync.track('shop.{table}', 'thing')")
            message = refused.value.diag.message_primary or ""
            assert f"column {column} of table shop.{table}" in message, message
            assert f"w.mood belongs to role {writer}" in message, message
            assert refused.value.diag.message_hint, table
        # The key's `=` as the caller's search_path gives it: the writer's operator.
        await conn.execute("SET search_path = w, pg_catalog, public")
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match=writer) as refused:
            await conn.execute("SELECT sync.track('shop.keyed', 'thing', 'code')")
        assert "key column code of table shop.keyed" in (refused.value.diag.message_primary or "")
        await conn.execute("RESET search_path")
        await conn.execute("SELECT sync.track('shop.keyed', 'thing', 'code')")
        # The owner's enum with a cast to json whose function is the writer's.
        await conn.execute(
            "CREATE CAST (shop.state AS json) WITH FUNCTION shop.state_cast(shop.state)"
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match=r"shop\.state_cast"):
            await conn.execute("SELECT sync.track('shop.clean', 'thing')")
        await conn.execute("DROP CAST (shop.state AS json)")
        # Only the owner's types, built-in ones and an INOUT cast: tracked, and relayed.
        await conn.execute("SELECT sync.track('shop.clean', 'thing')")
    tracked = await fetch_all(
        backend_dsn, "SELECT table_name::text FROM sync.tracked_tables ORDER BY 1"
    )
    assert ("shop.clean",) in tracked and ("shop.keyed",) in tracked
    assert not {("shop.direct",), ("shop.arrays",), ("shop.domains",), ("shop.composites",)} & set(
        tracked
    )
    await execute(
        backend_dsn,
        grant("GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA shop TO {}", writer),
    )
    await execute(
        as_writer,
        "INSERT INTO shop.direct VALUES (1, 'bad')",
        "INSERT INTO shop.keyed VALUES ('a', 1)",
        "UPDATE shop.keyed SET code = 'b'",
        "INSERT INTO shop.clean VALUES (1, 'new', 'x', '{t}')",
    )
    rows = await fetch_all(backend_dsn, EVENTS)
    assert [(op, key) for op, _, key, _ in rows] == [
        ("upsert", "a"),
        ("delete", "a"),
        ("upsert", "b"),
        ("upsert", "1"),
    ]


async def test_restrictive_policies_are_refused_and_block_key_changes_added_later(
    backend_dsn: str, roles: Roles
) -> None:
    """A RESTRICTIVE policy on a tracked table would run its owner's code as serversync_relay
    in the rekey check, and hide rows from it (the permissive sync_relay_rekey does not
    override it), so that keys swapped in one statement of a partitioned table send a delete of
    a live entity. sync.track refuses one; one added after tracking makes a key change fail,
    before the policy is read, while other writes are still relayed."""
    owner, writer = await owner_and_writer(backend_dsn, roles)
    as_owner = as_role(backend_dsn, owner)
    await execute(
        as_owner,
        "CREATE FUNCTION shop.spy() RETURNS boolean LANGUAGE plpgsql AS $$"
        f" BEGIN {FORGE}; RETURN false; END $$",
        "CREATE TABLE shop.slots (code text NOT NULL, shelf text, item text)"
        " PARTITION BY LIST (shelf)",
        "CREATE TABLE shop.slots_top PARTITION OF shop.slots FOR VALUES IN ('top')",
        "ALTER TABLE shop.slots ENABLE ROW LEVEL SECURITY",
        grant(
            "CREATE POLICY writer_rows ON shop.slots TO {} USING (true) WITH CHECK (true)", writer
        ),
        grant("GRANT SELECT, INSERT, UPDATE ON shop.slots TO {}", writer),
        "CREATE POLICY hide ON shop.slots AS RESTRICTIVE FOR SELECT TO serversync_relay"
        " USING (shop.spy())",
    )
    with pytest.raises(psycopg.errors.InsufficientPrivilege, match="RESTRICTIVE policy hide"):
        await execute(backend_dsn, "SELECT sync.track('shop.slots', 'slot', 'code')")
    await execute(as_owner, "DROP POLICY hide ON shop.slots")
    await execute(backend_dsn, "SELECT sync.track('shop.slots', 'slot', 'code')")
    await execute(
        as_owner,
        "CREATE POLICY hide ON shop.slots AS RESTRICTIVE FOR SELECT TO serversync_relay"
        " USING (shop.spy())",
    )
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        await conn.execute(
            "INSERT INTO shop.slots VALUES ('a', 'top', 'apple'), ('b', 'top', 'banana')"
        )
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="RESTRICTIVE policy"):
            await conn.execute(
                "UPDATE shop.slots SET code = CASE code WHEN 'a' THEN 'b' ELSE 'a' END"
            )
        await conn.execute("UPDATE shop.slots SET item = 'pear' WHERE code = 'a'")
    rows = [(op, key, p["item"]) for op, _, key, p in await fetch_all(backend_dsn, EVENTS)]
    assert rows == [("upsert", "a", "apple"), ("upsert", "b", "banana"), ("upsert", "a", "pear")]


async def test_regenerating_the_relays_untracks_a_table_sync_track_now_refuses_with_a_warning(
    empty_dsn: str, roles: Roles
) -> None:
    """A tracked table whose column type a producer came to own: when functions/track.sql is
    applied again (it changed), regenerating the relays still succeeds, removes that table's
    relay with a WARNING naming it (its writes are no longer relayed), and regenerates every
    other relay."""
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        await migrations.migrate(conn, ["backend"])
        await migrations.apply_examples(conn)
    owner, writer = await owner_and_writer(empty_dsn, roles)
    await execute(as_role(empty_dsn, writer), "CREATE TYPE w.mood AS ENUM ('ok', 'bad')")
    await execute(
        empty_dsn,
        grant("ALTER TYPE w.mood OWNER TO {}", owner),
    )
    await execute(
        as_role(empty_dsn, owner),
        "CREATE TABLE shop.moods (id int PRIMARY KEY, m w.mood)",
        grant("GRANT SELECT, INSERT ON shop.moods TO {}", writer),
    )
    await execute(empty_dsn, "SELECT sync.track('shop.moods', 'mood')")
    await execute(
        empty_dsn,
        grant("ALTER TYPE w.mood OWNER TO {}", writer),
        # As if the file had changed: its recorded checksum no longer matches.
        "UPDATE sync.schema_migrations SET checksum = 'changed'"
        " WHERE version = 'functions/track.sql'",
    )

    warnings: list[str] = []
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        conn.add_notice_handler(
            lambda n: warnings.append(n.message_primary or "") if n.severity == "WARNING" else None
        )
        applied = await migrations.migrate(conn, ["backend"])
    assert [m.label for m in applied] == ["backend/functions/track.sql"]
    [warning] = [w for w in warnings if "shop.moods" in w]
    assert "no longer tracked" in warning and "NOT relayed" in warning, warning
    assert writer in warning, warning
    tracked = await fetch_all(empty_dsn, "SELECT table_name::text FROM sync.tracked_tables")
    assert ("call_logs",) in tracked and ("shop.moods",) not in tracked
    oid = await fetch_value(empty_dsn, "SELECT 'shop.moods'::regclass::oid")
    assert (
        await fetch_all(empty_dsn, "SELECT proname FROM pg_proc WHERE proname ~ %s", (f"_{oid}$",))
        == []
    )
    await execute(as_role(empty_dsn, writer), "INSERT INTO shop.moods VALUES (1, 'bad')")
    await execute(
        empty_dsn, "INSERT INTO call_logs (caller_number, callee_number) VALUES ('c', 'x')"
    )
    assert [entity_type for _, entity_type, _, _ in await fetch_all(empty_dsn, EVENTS)] == [
        "call_log"
    ]


# -- sync.enqueue: serversync_producer's alone ----------------------------------------------------

PRODUCER_ROLE = "serversync_producer"
ENQUEUE = "SELECT sync.enqueue('notice', 'n-1', '{\"n\": 1}')"


async def test_only_a_member_of_serversync_producer_may_enqueue(
    backend_dsn: str, roles: Roles
) -> None:
    """sync.enqueue runs as serversync_relay with a fixed search_path; PUBLIC may not call it,
    a role given serversync_producer may (and gains no privilege on any table of sync), a role
    with USAGE on the schema but not the role may not."""
    function = await fetch_all(
        backend_dsn,
        "SELECT pg_get_userbyid(p.proowner), p.prosecdef, p.proconfig,"
        " has_function_privilege('public', p.oid, 'EXECUTE')"
        " FROM pg_proc p WHERE p.oid = 'sync.enqueue(text, text, json, text, text)'::regprocedure",
    )
    assert function == [(RELAY_ROLE, True, ["search_path=pg_catalog, pg_temp"], False)]
    producer = await roles.create("producer", backend_dsn)
    outsider = await roles.create("outsider", backend_dsn)
    await execute(
        backend_dsn,
        grant(f"GRANT {PRODUCER_ROLE} TO {{}}", producer),
        grant("GRANT USAGE ON SCHEMA sync TO {}", outsider),
    )
    assert await fetch_all(backend_dsn, SYNC_PRIVILEGES, {"role": producer}) == [
        ("schema sync: USAGE",)
    ]
    conn = await connect_as(backend_dsn, producer)
    async with conn:
        await conn.execute(ENQUEUE)
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(
                "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)"
                " VALUES ('delete', 'notice', 'n-2', '{}')"
            )
    conn = await connect_as(backend_dsn, outsider)
    async with conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege, match="function enqueue"):
            await conn.execute(ENQUEUE)
    writer = await writer_of(backend_dsn, roles, "call_logs")
    conn = await connect_as(backend_dsn, writer)
    async with conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute(ENQUEUE)
    assert await fetch_all(backend_dsn, EVENTS) == [("upsert", "notice", "n-1", {"n": 1})]


async def test_a_migrating_role_hands_sync_enqueue_to_serversync_relay(
    empty_dsn: str, roles: Roles
) -> None:
    """No superuser: the function is handed over with CREATE lent for the statement only, and
    granted to serversync_producer; a second migrate (the file changed) keeps both."""
    owner = await roles.create("owner", empty_dsn, "LOGIN CREATEROLE")
    await give_database(empty_dsn, owner)
    may_join = await may_join_relay_role(empty_dsn)
    conn = await connect_as(empty_dsn, owner)
    async with conn:
        await migrations.migrate(conn, ["backend"])
        await conn.execute(
            "UPDATE sync.schema_migrations SET checksum = 'changed'"
            " WHERE version = 'functions/enqueue.sql'"
        )
        await migrations.migrate(conn, ["backend"])
    rights = await fetch_all(
        empty_dsn,
        "SELECT pg_get_userbyid(p.proowner),"
        " has_function_privilege(%(producer)s, p.oid, 'EXECUTE'),"
        " has_schema_privilege(%(relay)s, 'sync', 'CREATE')"
        " FROM pg_proc p WHERE p.oid = 'sync.enqueue(text, text, json, text, text)'::regprocedure",
        {"producer": PRODUCER_ROLE, "relay": RELAY_ROLE},
    )
    assert rights == [(RELAY_ROLE if may_join else owner, True, False)]


async def test_the_documented_snapshot_grants_write_a_snapshot_and_without_them_one_line(
    backend_dsn: str, roles: Roles
) -> None:
    """A role with exactly the grants docs/security.md gives a snapshot writer (for the table it
    sends) runs `serversync snapshot`; one without UPDATE on the table (FOR SHARE needs it) is
    told so in one line, and nothing is written."""
    await insert_callers(backend_dsn, ["s1", "s2", "s3"])
    await execute(backend_dsn, "DELETE FROM sync.events_outbox")
    writer = await roles.create("snapshot", backend_dsn)
    statements = documented_grants("serversync_snapshot")
    await execute(
        backend_dsn,
        *(
            re.sub(r"\bserversync_snapshot\b", writer, s).replace(
                "public.registered_numbers", "public.call_logs"
            )
            for s in statements
        ),
    )
    reader = await roles.create("reader", backend_dsn)
    await execute(
        backend_dsn,
        *(
            re.sub(r"\bserversync_snapshot\b", reader, s)
            for s in statements
            if "registered_numbers" not in s
        ),
        grant("GRANT SELECT ON public.call_logs TO {}", reader),
    )

    env = cli_env(DATABASE_URL=as_role(backend_dsn, reader), FRONTEND_BASE_URL="http://127.0.0.1:9")
    refused = await finish(await start_cli("snapshot", "public.call_logs", env=env))
    assert refused.code != 0
    assert "Traceback" not in refused.stderr
    # Progress lines, then one line that says what is missing.
    [error] = [line for line in refused.stderr.splitlines() if line.startswith("serversync:")]
    assert "permission denied for table call_logs" in error
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == 0

    # Row level security that applies to the writer would hide rows from the snapshot.
    await execute(backend_dsn, "ALTER TABLE public.call_logs ENABLE ROW LEVEL SECURITY")
    hidden = await finish(
        await start_cli(
            "snapshot",
            "public.call_logs",
            env=cli_env(
                DATABASE_URL=as_role(backend_dsn, writer), FRONTEND_BASE_URL="http://127.0.0.1:9"
            ),
        )
    )
    assert hidden.code == 2, hidden
    assert "row level security" in hidden.stderr and "Traceback" not in hidden.stderr
    await execute(backend_dsn, "ALTER TABLE public.call_logs DISABLE ROW LEVEL SECURITY")

    # A role that holds the grants resumes the snapshot the refused one asked for.
    await cli_as(backend_dsn, writer, "snapshot", "public.call_logs", frontend="http://127.0.0.1:9")
    sent = await fetch_all(
        backend_dsn,
        "SELECT payload->>'caller_number' FROM sync.events_outbox"
        " WHERE snapshot_id IS NOT NULL ORDER BY seq",
    )
    assert sorted(caller for (caller,) in sent) == ["s1", "s2", "s3"]
    assert await fetch_all(backend_dsn, "SELECT id, state FROM sync.snapshots") == [(1, "done")]
