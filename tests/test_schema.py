"""The schema a newcomer reads, sql/COMPONENT/schema.sql, is the schema `serversync migrate`
makes (versioned migrations, then the function files), as pg_dump --schema-only shows them; a
function file is applied again exactly once after its text changes (and the files after it with
it); and a second `serversync migrate` changes nothing."""

from __future__ import annotations

import asyncio
import re
import shutil
import subprocess
from pathlib import Path

import psycopg
import pytest

from consumer.devtools.devdb import bindir_candidates
from consumer.store import migrations
from consumer.store.queries import sql_dir
from tests.conftest import Databases, cli_env, fetch_all
from tests.support.backend import execute
from tests.support.cli import assert_ok, run_cli

# The runner's bookkeeping: schema.sql does not make it.
BOOKKEEPING = {"backend": "sync.schema_migrations", "receiver": "ingest.schema_migrations"}


def _client_programs(server_version_num: int) -> tuple[Path, Path]:
    """pg_dump and psql of the server's major version (pg_dump refuses a newer server, and an
    older server's dump differs in form), or skip the test saying why."""
    major = server_version_num // 10000
    # Where the private clusters' binaries come from (the machine's, then the embedded wheel's),
    # then the usual places.
    folders = [*bindir_candidates(), Path(f"/usr/lib/postgresql/{major}/bin")]
    on_path = shutil.which("pg_dump")
    if on_path is not None:
        folders.append(Path(on_path).resolve().parent)
    for folder in folders:
        pg_dump, psql = folder / "pg_dump", folder / "psql"
        if pg_dump.is_file() and psql.is_file() and _major(pg_dump) == major:
            return pg_dump, psql
    pytest.skip(f"no pg_dump and psql of PostgreSQL {major} (the server's) on this machine")


def _major(program: Path) -> int | None:
    out = subprocess.run([program, "--version"], capture_output=True, text=True, check=False)
    found = re.search(r"\) (\d+)", out.stdout)
    return int(found.group(1)) if found else None


async def _programs(dsn: str) -> tuple[Path, Path]:
    rows = await fetch_all(dsn, "SELECT current_setting('server_version_num')::int")
    return await asyncio.to_thread(_client_programs, rows[0][0])


async def _run(*command: str | Path) -> str:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, (command, err.decode())
    return out.decode()


async def _schema(pg_dump: Path, dsn: str, component: str) -> str:
    """The dump of a database's schema, less what differs between any two dumps of one schema:
    pg_dump's per-dump \\restrict key, and the runner's bookkeeping table."""
    dump = await _run(pg_dump, "--schema-only", f"--exclude-table={BOOKKEEPING[component]}", dsn)
    return "".join(
        line
        for line in dump.splitlines(keepends=True)
        if not line.startswith(("\\restrict", "\\unrestrict"))
    )


@pytest.mark.parametrize("component", ["backend", "receiver"])
async def test_schema_sql_makes_the_schema_the_migrations_make(
    databases: Databases, component: str
) -> None:
    migrated, loaded = databases.create_empty(), databases.create_empty()
    pg_dump, psql = await _programs(migrated)
    async with await psycopg.AsyncConnection.connect(migrated, autocommit=True) as conn:
        await migrations.migrate(conn, [component])
    schema_file = sql_dir() / component / "schema.sql"
    await _run(psql, "--quiet", "-v", "ON_ERROR_STOP=1", "-f", schema_file, loaded)

    from_migrations = await _schema(pg_dump, migrated, component)
    from_schema_sql = await _schema(pg_dump, loaded, component)
    assert "CREATE TABLE" in from_migrations
    assert from_schema_sql == from_migrations, (
        f"sql/{component}/schema.sql and the migrations make different schemas: a migration "
        "changed the schema and schema.sql was not changed with it (or the other way round)"
    )


async def _migrate(dsn: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return [m.label for m in await migrations.migrate(conn, ["backend"])]


async def _pending(dsn: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        return [m.label for m in await migrations.pending(conn, "backend")]


async def test_a_changed_function_file_is_applied_again_once_with_the_files_after_it(
    empty_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    copy = tmp_path / "sql"
    shutil.copytree(sql_dir(), copy)
    monkeypatch.setattr(migrations, "sql_dir", lambda: copy)
    functions = copy / "backend" / migrations.FUNCTIONS
    dsn = empty_dsn
    assert await _migrate(dsn) == [
        "backend/0001_baseline",
        "backend/0002_both_directions",
        "backend/0003_snapshots",
        "backend/functions/enqueue.sql",
        "backend/functions/horizon.sql",
        "backend/functions/relay.sql",
        "backend/functions/snapshot.sql",
        "backend/functions/track.sql",
    ]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await migrations.apply_examples(conn)
    assert await _pending(dsn) == []

    # sync.track writes its relays differently: every tracked table's relay is generated again.
    track = functions / "track.sql"
    track.write_text(track.read_text().replace("Generated by sync.track", "Made by sync.track"))
    assert await _pending(dsn) == ["backend/functions/track.sql"]
    assert await _migrate(dsn) == ["backend/functions/track.sql"]
    assert await _migrate(dsn) == []
    relays = await fetch_all(
        dsn,
        "SELECT p.prosrc ~ 'Made by sync.track'"
        " FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid"
        " WHERE t.tgrelid = 'call_logs'::regclass AND NOT t.tgisinternal",
    )
    assert relays and all(made for (made,) in relays), relays

    # A file that another builds on: both apply again, in order.
    relay = functions / "relay.sql"
    relay.write_text(relay.read_text() + "\n-- changed\n")
    assert await _migrate(dsn) == [
        "backend/functions/relay.sql",
        "backend/functions/snapshot.sql",
        "backend/functions/track.sql",
    ]
    assert await _migrate(dsn) == []

    await execute(dsn, "INSERT INTO call_logs (caller_number, callee_number) VALUES ('a', 'b')")
    outbox = await fetch_all(dsn, "SELECT op, entity_type FROM sync.events_outbox")
    assert outbox == [("upsert", "call_log")]


async def test_serversync_migrate_twice_changes_nothing_the_second_time(empty_dsn: str) -> None:
    pg_dump, _ = await _programs(empty_dsn)
    env = cli_env(DATABASE_URL=empty_dsn)
    first = await run_cli("migrate", "--with-examples", env=env)
    assert_ok(first)
    assert "applied backend/functions/track.sql" in first.stdout.splitlines()
    schema = await _schema(pg_dump, empty_dsn, "backend")
    records = await fetch_all(empty_dsn, "SELECT * FROM sync.schema_migrations ORDER BY version")

    second = await run_cli("migrate", "--with-examples", env=env)
    assert_ok(second)
    assert second.stdout.splitlines()[0] == "DATABASE_URL: up to date (backend)"
    assert await _schema(pg_dump, empty_dsn, "backend") == schema
    assert (
        await fetch_all(empty_dsn, "SELECT * FROM sync.schema_migrations ORDER BY version")
        == records
    )
