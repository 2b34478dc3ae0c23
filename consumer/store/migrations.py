"""Versioned SQL migrations: recorded in a table, safe to run twice and from two processes at once.

A component is a folder of sql/ (`backend`, `receiver`) whose files are named
`NNNN_description.sql` and applied in order, each in its own transaction, under an advisory lock
held for the whole run so that concurrent runs apply every migration exactly once.

Example schemas (sql/examples/NAME.sql: the voicebot tables of the demo and the tests) are not
versioned migrations and nothing records them. Each creates only what is missing and leaves what
exists as it is, so it applies to a database that has such tables of its own (a real voicebot
backend) as well as to an empty one, and as often as it is asked for (`serversync migrate
--with-examples`). The voicebot tables were the versioned component `voicebot`
(0001_voicebot_tables) before they became the example `voicebot`: a database that recorded that
migration keeps the record, which nothing reads any more.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from consumer.store.queries import sql_dir

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_LOCK_KEY = "serversync.migrate"

# Each component records itself in a table of the schema it owns.
RECORD_SCHEMA = {"backend": "sync", "receiver": "ingest"}
# The folder of sql/ that holds the example schemas.
EXAMPLES = "examples"


class MigrationError(Exception):
    """A migration could not be applied, or the recorded history does not match the files."""


@dataclass(frozen=True)
class Migration:
    """One migration file."""

    component: str
    version: str
    name: str
    text: str

    @property
    def checksum(self) -> str:
        """A digest of the file, to notice an applied migration that was edited afterwards."""
        return hashlib.sha256(self.text.encode()).hexdigest()


def available(component: str) -> list[Migration]:
    """The migrations of a component, in the order they apply."""
    folder: Path = sql_dir() / component
    found = []
    for path in sorted(folder.glob("*.sql")):
        match = _FILE.match(path.name)
        if not match:
            raise MigrationError(f"{path}: a migration file is named NNNN_description.sql")
        found.append(Migration(component, match.group(1), match.group(2), path.read_text("utf-8")))
    return found


@dataclass(frozen=True)
class Example:
    """One example schema: idempotent SQL, applied on request."""

    name: str
    text: str


def examples() -> list[Example]:
    """The example schemas, in the order they apply."""
    folder: Path = sql_dir() / EXAMPLES
    return [Example(path.stem, path.read_text("utf-8")) for path in sorted(folder.glob("*.sql"))]


def _record_table(component: str) -> sql.Composed:
    return sql.SQL("{}.schema_migrations").format(sql.Identifier(RECORD_SCHEMA[component]))


async def _ensure_record_table(conn: psycopg.AsyncConnection[Any], component: str) -> None:
    schema = sql.Identifier(RECORD_SCHEMA[component])
    await conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(schema))
    await conn.execute(
        sql.SQL(
            "CREATE TABLE IF NOT EXISTS {} ("
            " component text NOT NULL, version text NOT NULL, name text NOT NULL,"
            " checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(),"
            " PRIMARY KEY (component, version))"
        ).format(_record_table(component))
    )


async def applied(conn: psycopg.AsyncConnection[Any], component: str) -> dict[str, str]:
    """Applied versions of a component with their checksums (empty when none ever ran)."""
    cur = await conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{RECORD_SCHEMA[component]}.schema_migrations",)
    )
    row = await cur.fetchone()
    if not row or not row[0]:
        return {}
    cur = await conn.execute(
        sql.SQL("SELECT version, checksum FROM {} WHERE component = %s").format(
            _record_table(component)
        ),
        (component,),
    )
    return {version: checksum for version, checksum in await cur.fetchall()}


async def pending(conn: psycopg.AsyncConnection[Any], component: str) -> list[Migration]:
    """Migrations of a component not yet applied; raises if an applied one was changed since."""
    done = await applied(conn, component)
    todo = []
    for migration in available(component):
        checksum = done.get(migration.version)
        if checksum is None:
            todo.append(migration)
        elif checksum != migration.checksum:
            raise MigrationError(
                f"migration {component}/{migration.version}_{migration.name} was changed after it "
                "was applied; restore the file or write a new migration"
            )
    return todo


async def migrate(conn: psycopg.AsyncConnection[Any], components: list[str]) -> list[Migration]:
    """Apply what is pending of each component, in order; returns what was applied.

    `conn` must be in autocommit mode: each migration gets its own transaction.
    """
    if not conn.autocommit:
        raise MigrationError("migrate() needs an autocommit connection")
    done: list[Migration] = []
    async with _migration_lock(conn):
        for component in components:
            await _ensure_record_table(conn, component)
            for migration in await pending(conn, component):
                async with conn.transaction():
                    await _execute(
                        conn,
                        migration.text,
                        f"migration {component}/{migration.version}_{migration.name}",
                    )
                    await conn.execute(
                        sql.SQL(
                            "INSERT INTO {} (component, version, name, checksum)"
                            " VALUES (%s, %s, %s, %s)"
                        ).format(_record_table(component)),
                        (component, migration.version, migration.name, migration.checksum),
                    )
                done.append(migration)
    return done


async def apply_examples(conn: psycopg.AsyncConnection[Any]) -> list[Example]:
    """Apply every example schema, each in its own transaction, under the migrations' lock;
    returns them (each applies every time: what it finds in place, it leaves alone).

    They track their tables with sync.track: serversync's own schema (`backend`) must be there.
    `conn` must be in autocommit mode.
    """
    if not conn.autocommit:
        raise MigrationError("apply_examples() needs an autocommit connection")
    done: list[Example] = []
    async with _migration_lock(conn):
        for example in examples():
            async with conn.transaction():
                await _execute(conn, example.text, f"example schema {EXAMPLES}/{example.name}")
            done.append(example)
    return done


async def _execute(conn: psycopg.AsyncConnection[Any], text: str, what: str) -> None:
    """Run a SQL file's text; a failure is one MigrationError line naming the file."""
    try:
        await conn.execute(text.encode())
    except psycopg.Error as exc:
        raise MigrationError(f"{what} failed: {exc.diag.message_primary or exc}") from exc


@contextlib.asynccontextmanager
async def _migration_lock(conn: psycopg.AsyncConnection[Any]) -> AsyncIterator[None]:
    """The advisory lock that makes concurrent runs wait for each other."""
    await conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (_LOCK_KEY,))
    try:
        yield
    finally:
        await conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (_LOCK_KEY,))
