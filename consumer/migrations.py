"""Versioned SQL migrations: recorded in a table, safe to run twice and from two processes at once.

A component is a folder of sql/ (`backend`, `voicebot`, `receiver`) whose files are named
`NNNN_description.sql` and applied in order, each in its own transaction, under an advisory lock
held for the whole run so that concurrent runs apply every migration exactly once.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from consumer.queries import sql_dir

_FILE = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_LOCK_KEY = "serversync.migrate"

# Each component records itself in a table of the schema it owns.
RECORD_SCHEMA = {"backend": "sync", "voicebot": "sync", "receiver": "ingest"}


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
    await conn.execute("SELECT pg_advisory_lock(hashtext(%s))", (_LOCK_KEY,))
    try:
        for component in components:
            await _ensure_record_table(conn, component)
            for migration in await pending(conn, component):
                async with conn.transaction():
                    try:
                        await conn.execute(migration.text.encode())
                    except psycopg.Error as exc:
                        raise MigrationError(
                            f"migration {component}/{migration.version}_{migration.name} failed: "
                            f"{exc.diag.message_primary or exc}"
                        ) from exc
                    await conn.execute(
                        sql.SQL(
                            "INSERT INTO {} (component, version, name, checksum)"
                            " VALUES (%s, %s, %s, %s)"
                        ).format(_record_table(component)),
                        (component, migration.version, migration.name, migration.checksum),
                    )
                done.append(migration)
    finally:
        await conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (_LOCK_KEY,))
    return done
