"""`serversync migrate`, run as a real subprocess: against an unmigrated database, twice,
concurrently, and with or without the example tables (a voicebot database's own tables kept)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from consumer.store import migrations
from tests.conftest import cli_env, fetch_all, fetch_value, finish, start_cli, wait_until
from tests.support.cli import assert_ok, assert_one_line_error, run_cli, run_many

CONSUMER = "frontend-sync"
# A frontend for commands that need one configured and never reach it.
FRONTEND = "http://127.0.0.1:9"


# -- migrations ----------------------------------------------------------------------------------


def expected_migrations(components: list[str]) -> list[tuple[str, str]]:
    return [(m.component, m.version) for c in components for m in migrations.available(c)]


def applied_lines(components: list[str]) -> list[str]:
    return [f"applied {m.label}" for c in components for m in migrations.available(c)]


MIGRATIONS_TABLE = (
    "SELECT component, version, name, checksum, applied_at FROM sync.schema_migrations "
    "ORDER BY component, version"
)


async def test_commands_against_an_unmigrated_database_say_to_migrate(empty_dsn: str) -> None:
    env = cli_env(DATABASE_URL=empty_dsn, FRONTEND_BASE_URL=FRONTEND)
    run, status = await run_many(["run", CONSUMER], ["status"], env=env)
    assert_one_line_error(run, 1, "DATABASE_URL lacks", "0001_baseline", "run `serversync migrate`")
    assert_one_line_error(status, 1, "DATABASE_URL lacks", "run `serversync migrate`")


async def test_migrate_twice_is_a_no_op_the_second_time(empty_dsn: str) -> None:
    env = cli_env(DATABASE_URL=empty_dsn)
    components = ["backend"]
    first = await run_cli("migrate", env=env)
    assert_ok(first)
    assert first.stdout.splitlines() == applied_lines(components)
    recorded = await fetch_all(empty_dsn, MIGRATIONS_TABLE)
    assert [(r[0], r[1]) for r in recorded] == expected_migrations(components)

    second = await run_cli("migrate", env=env)
    assert_ok(second)
    assert second.stdout == "DATABASE_URL: up to date (backend)\n"
    assert await fetch_all(empty_dsn, MIGRATIONS_TABLE) == recorded


async def test_concurrent_migrates_apply_every_migration_once(empty_dsn: str) -> None:
    env = cli_env(DATABASE_URL=empty_dsn)
    components = ["backend"]
    gate = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with gate:
        # Hold the migration lock so that both processes are surely waiting at the same point,
        # then let them race.
        await gate.execute("SELECT pg_advisory_lock(hashtext('serversync.migrate'))")
        processes = [await start_cli("migrate", env=env) for _ in range(2)]

        async def both_waiting() -> bool:
            waiting = await fetch_value(
                empty_dsn,
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                "WHERE l.locktype = 'advisory' AND NOT l.granted "
                "AND d.datname = current_database()",
            )
            return bool(waiting == 2)

        await wait_until(both_waiting, timeout=60, what="both migrate processes at the lock")
        await gate.execute("SELECT pg_advisory_unlock(hashtext('serversync.migrate'))")
        results = await asyncio.gather(*(finish(p) for p in processes))
    for result in results:
        assert_ok(result)
    outputs = sorted(r.stdout for r in results)
    assert outputs == sorted(
        [
            "\n".join(applied_lines(components)) + "\n",
            "DATABASE_URL: up to date (backend)\n",
        ]
    )
    recorded = await fetch_all(empty_dsn, MIGRATIONS_TABLE)
    assert [(r[0], r[1]) for r in recorded] == expected_migrations(components)


EXAMPLES_LINE = (
    "examples/voicebot: in place (created what was missing, left what existed as it was)"
)
EXAMPLE_TABLES = [
    ("announcements", "announcement"),
    ("call_logs", "call_log"),
    ("ivr_flows", "ivr_flow"),
    ("recordings", "recording"),
    ("registered_numbers", "registered_number"),
    ("routing_rules", "routing_rule"),
    ("schedules", "schedule"),
]
TRACKED = "SELECT table_name::text, entity_type FROM sync.tracked_tables ORDER BY 1"


async def public_schema(dsn: str) -> list[tuple[Any, ...]]:
    """Every column, index and constraint of the public schema, and the rows of the call_logs
    and recordings tables."""
    columns = await fetch_all(
        dsn,
        "SELECT table_name, column_name, data_type, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2",
    )
    indexes = await fetch_all(
        dsn, "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1"
    )
    constraints = await fetch_all(
        dsn,
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
    )
    rows = await fetch_all(
        dsn,
        "SELECT c.id::text, c.caller_number, c.agent_name, r.id::text, r.file_path, "
        "r.upload_status, r.transcript FROM call_logs c JOIN recordings r ON r.call_log_id = c.id "
        "ORDER BY 1, 4",
    )
    return [*columns, *indexes, *constraints, *rows]


async def test_migrate_installs_only_serversyncs_schema_unless_asked_for_the_examples(
    empty_dsn: str,
) -> None:
    env = cli_env(DATABASE_URL=empty_dsn)
    core = await run_cli("migrate", env=env)
    assert_ok(core)
    assert core.stdout.splitlines() == applied_lines(["backend"])
    assert await fetch_value(empty_dsn, "SELECT to_regclass('sync.events_outbox')::text") == (
        "sync.events_outbox"
    )
    assert await fetch_value(empty_dsn, "SELECT to_regclass('public.call_logs')") is None
    assert (
        await fetch_value(empty_dsn, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        == 0
    )
    assert await fetch_value(empty_dsn, "SELECT count(*) FROM sync.tracked_tables") == 0
    recorded = await fetch_all(empty_dsn, MIGRATIONS_TABLE)
    assert [(r[0], r[1]) for r in recorded] == expected_migrations(["backend"])

    # --core-only, which the docs of earlier versions name, is what migrate does anyway.
    same = await run_cli("migrate", "--core-only", env=env)
    assert_ok(same)
    assert same.stdout == "DATABASE_URL: up to date (backend)\n"
    assert await fetch_value(empty_dsn, "SELECT to_regclass('public.call_logs')") is None
    both = await run_cli("migrate", "--core-only", "--with-examples", env=env)
    assert both.code == 2, both
    assert "not allowed with argument" in both.stderr, both.stderr

    for _ in range(2):
        examples = await run_cli("migrate", "--with-examples", env=env)
        assert_ok(examples)
        assert examples.stdout.splitlines() == ["DATABASE_URL: up to date (backend)", EXAMPLES_LINE]
        assert await fetch_all(empty_dsn, TRACKED) == EXAMPLE_TABLES
    # Examples are not versioned migrations: nothing recorded.
    assert await fetch_all(empty_dsn, MIGRATIONS_TABLE) == recorded


async def test_migrate_with_examples_keeps_a_voicebot_databases_own_tables_and_rows(
    empty_dsn: str,
) -> None:
    # A real voicebot database: call_logs and recordings are there before serversync, with a
    # column of their own, an index of their own and rows.
    call_id = "7d0f6c53-6b43-4c1e-9a53-1f1d1c7e0001"
    recording_id = "7d0f6c53-6b43-4c1e-9a53-1f1d1c7e0002"
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "CREATE TABLE call_logs (id uuid PRIMARY KEY, caller_number text NOT NULL, "
            "callee_number text NOT NULL, agent_name text, "
            "updated_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(
            "CREATE TABLE recordings (id uuid PRIMARY KEY, "
            "call_log_id uuid NOT NULL REFERENCES call_logs (id), file_path text NOT NULL, "
            "upload_status text NOT NULL DEFAULT 'pending', s3_url text, transcript text, "
            "updated_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute("CREATE INDEX recordings_by_call ON recordings (call_log_id)")
        await conn.execute(
            "INSERT INTO call_logs (id, caller_number, callee_number, agent_name) "
            "VALUES (%s, '0311112222', '0501234567', 'Sato')",
            (call_id,),
        )
        await conn.execute(
            "INSERT INTO recordings (id, call_log_id, file_path, transcript) "
            "VALUES (%s, %s, %s, 'hello')",
            (recording_id, call_id, f"{call_id}/mixed.wav"),
        )
    env = cli_env(DATABASE_URL=empty_dsn)
    before = await public_schema(empty_dsn)

    core = await run_cli("migrate", env=env)
    assert_ok(core)
    assert core.stdout.splitlines() == applied_lines(["backend"])
    assert await public_schema(empty_dsn) == before
    # The owner tracks call_logs under a name of their own before asking for the examples.
    await fetch_all(empty_dsn, "SELECT sync.track('public.call_logs', 'call')")

    for _ in range(2):
        examples = await run_cli("migrate", "--with-examples", env=env)
        assert_ok(examples)
        assert examples.stdout.splitlines() == ["DATABASE_URL: up to date (backend)", EXAMPLES_LINE]
        # The tables that were there are exactly as they were, rows included; the missing ones
        # were created; call_logs keeps its entity type, the others are tracked.
        after = await public_schema(empty_dsn)
        assert [row for row in after if row[0] in ("call_logs", "recordings")] == [
            row for row in before if row[0] in ("call_logs", "recordings")
        ]
        assert [row for row in before if row not in after] == []
        assert await fetch_value(empty_dsn, "SELECT to_regclass('public.schedules')::text") == (
            "schedules"
        )
        tracked = dict(EXAMPLE_TABLES) | {"call_logs": "call"}
        assert await fetch_all(empty_dsn, TRACKED) == sorted(tracked.items())
    assert (
        await fetch_value(
            empty_dsn, "SELECT count(*) FROM pg_indexes WHERE tablename = 'recordings'"
        )
        == 2
    )

    # The relay works on the owner's tables: a change is an event.
    await fetch_all(
        empty_dsn,
        "UPDATE recordings SET transcript = 'hello again' WHERE id = %s RETURNING id",
        (recording_id,),
    )
    events = await fetch_all(
        empty_dsn, "SELECT entity_type, entity_id, payload->>'transcript' FROM sync.events_outbox"
    )
    assert events == [("recording", recording_id, "hello again")]
