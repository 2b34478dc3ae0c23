"""SQL migrations: recorded in a table, safe to run twice and from two processes at once.

A component is a folder of sql/ (`backend`, `receiver`) holding:

* Versioned migrations, `NNNN_description.sql`, applied once each, in order. `0001_baseline`
  is the schema as first released; a later change is a new file, and an applied file may not
  change (its checksum is recorded, and a changed one is an error).
* Function files, `functions/NAME.sql`: the code that is rewritten whenever it changes (the
  relay: sync.track, which generates a trigger function per tracked table, and its helpers), one
  file per group, each statement in it idempotent (CREATE OR REPLACE). Like Flyway's repeatable
  migrations they apply after the versioned ones, in the order of their names, and again
  whenever their text changes; a file is also applied again when a file before it changed, since
  a later file builds on an earlier one (functions/track.sql ends by generating every relay again
  from what functions/relay.sql defines). Their checksums are recorded in the same table, under
  the version `functions/NAME.sql`.
* `schema.sql`: the schema as it stands after everything above, to read (tests/test_schema.py
  checks that it makes the same schema as the runner). Not applied by the runner.

The baseline does not contain the function files' bodies: "versioned migrations, then function
files" is the one path every database takes, a new one and an old one alike, so each function
has exactly one text, its file's. A versioned migration therefore cannot call what a function
file defines (on a new database it does not exist yet); one that changes what the relay depends
on also changes functions/track.sql, which regenerates every relay.

Each versioned migration and each function file is applied in a transaction of its own, under
an advisory lock held for the whole run so that concurrent runs apply everything exactly once.

Pre-release databases: nothing before the baseline was released, but development builds (the
demo among them) ran the migrations that the baseline squashed (PRERELEASE). The schema they
left is the baseline's, plus a few dead objects, so a database that recorded all of them is
adopted as being at the baseline: `prerelease.sql` drops the dead objects, the old records give
way to the baseline's, and the function files apply as on any database they never ran on. One
that recorded only some of them is refused with one line saying to recreate it.

Example schemas (sql/examples/NAME.sql: the voicebot tables of the demo and the tests) are not
migrations and nothing records them. Each creates only what is missing and leaves what exists
as it is, so it applies to a database that has such tables of its own (a real voicebot backend)
as well as to an empty one, and as often as it is asked for (`serversync migrate
--with-examples`).
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

_VERSIONED = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")
_FUNCTION_FILE = re.compile(r"^([a-z0-9_]+)\.sql$")
_LOCK_KEY = "serversync.migrate"

# Each component records itself in a table of the schema it owns.
RECORD_SCHEMA = {"backend": "sync", "receiver": "ingest"}
# The folder of sql/ that holds the example schemas.
EXAMPLES = "examples"
# The folder of a component that holds its function files.
FUNCTIONS = "functions"
# Files of a component's folder that the runner does not apply as migrations.
SCHEMA_FILE = "schema.sql"
PRERELEASE_FILE = "prerelease.sql"
# The migrations of pre-release builds, squashed into each component's 0001_baseline.
PRERELEASE = {
    "backend": (
        "0001_outbox",
        "0002_wakeup_policy",
        "0003_dead_letters",
        "0004_json_payload",
        "0005_relay_per_table",
        "0006_lean_outbox",
        "0007_statement_relay",
        "0008_cheap_wakeup_check",
        "0009_relay_per_operation",
        "0010_unattended_delivery",
        "0011_relay_any_identifier",
        "0012_relay_least_privilege",
    ),
    "receiver": ("0001_ingest", "0002_byte_order_keys"),
}
BASELINE = "0001"


class MigrationError(Exception):
    """A migration could not be applied, or the recorded history does not match the files."""


@dataclass(frozen=True)
class Migration:
    """One migration file: versioned (version "0001") or a function file (version
    "functions/NAME.sql"); `adopted` marks the adoption of a pre-release database."""

    component: str
    version: str
    name: str
    text: str
    adopted: bool = False

    @property
    def repeatable(self) -> bool:
        """A function file: applied again whenever it changes."""
        return self.version.startswith(f"{FUNCTIONS}/")

    @property
    def label(self) -> str:
        """How it is named to people: its path under sql/, without the extension."""
        if self.repeatable:
            return f"{self.component}/{self.version}"
        label = f"{self.component}/{self.version}_{self.name}"
        if self.adopted:
            old = PRERELEASE[self.component]
            label += f" (adopted: the schema of the pre-release {old[0]} .. {old[-1]})"
        return label

    @property
    def checksum(self) -> str:
        """A digest of the file: an applied migration edited afterwards, or a function file to
        apply again."""
        return hashlib.sha256(self.text.encode()).hexdigest()


def versioned(component: str) -> list[Migration]:
    """The versioned migrations of a component, in the order they apply."""
    found = []
    for path in sorted((sql_dir() / component).glob("*.sql")):
        if path.name in (SCHEMA_FILE, PRERELEASE_FILE):
            continue
        match = _VERSIONED.match(path.name)
        if not match:
            raise MigrationError(f"{path}: a migration file is named NNNN_description.sql")
        found.append(Migration(component, match.group(1), match.group(2), path.read_text("utf-8")))
    return found


def function_files(component: str) -> list[Migration]:
    """The function files of a component, in the order they apply (by name)."""
    found = []
    for path in sorted((sql_dir() / component / FUNCTIONS).glob("*.sql")):
        match = _FUNCTION_FILE.match(path.name)
        if not match:
            raise MigrationError(f"{path}: a function file is named name.sql")
        version = f"{FUNCTIONS}/{path.name}"
        found.append(Migration(component, version, match.group(1), path.read_text("utf-8")))
    return found


def available(component: str) -> list[Migration]:
    """Every migration of a component in the order they apply: versioned, then function files."""
    return versioned(component) + function_files(component)


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


async def _recorded(
    conn: psycopg.AsyncConnection[Any], component: str
) -> dict[str, tuple[str, str]]:
    """Recorded versions of a component: version -> (name, checksum); empty when none ran."""
    cur = await conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL", (f"{RECORD_SCHEMA[component]}.schema_migrations",)
    )
    row = await cur.fetchone()
    if not row or not row[0]:
        return {}
    cur = await conn.execute(
        sql.SQL("SELECT version, name, checksum FROM {} WHERE component = %s").format(
            _record_table(component)
        ),
        (component,),
    )
    return {version: (name, checksum) for version, name, checksum in await cur.fetchall()}


async def applied(conn: psycopg.AsyncConnection[Any], component: str) -> dict[str, str]:
    """Applied versions of a component with their checksums (empty when none ever ran)."""
    return {
        version: checksum for version, (_, checksum) in (await _recorded(conn, component)).items()
    }


def _prerelease(component: str, recorded: dict[str, tuple[str, str]]) -> bool:
    """Whether the records are those of a pre-release build: True when all its migrations are
    recorded (the schema is the baseline's); raises when only some are."""
    old = PRERELEASE.get(component, ())
    found = [f"{version}_{name}" for version, (name, _) in recorded.items()]
    seen = sorted(set(found) & set(old))
    if not seen:
        return False
    if len(seen) < len(old):
        raise MigrationError(
            f"this database was created by a pre-release build of serversync ({component} "
            f"migrations up to {seen[-1]}, of {old[0]} .. {old[-1]}), whose schema no release "
            "reads: recreate it, then run `serversync migrate`"
        )
    return True


def _todo(component: str, recorded: dict[str, tuple[str, str]]) -> list[Migration]:
    todo = []
    for migration in versioned(component):
        done = recorded.get(migration.version)
        if done is None:
            todo.append(migration)
        elif done[1] != migration.checksum:
            raise MigrationError(
                f"migration {migration.label} was changed after it was applied; restore the "
                "file or write a new migration"
            )
    # A function file applies again when it changed, or when one before it did.
    changed = False
    for function_file in function_files(component):
        done = recorded.get(function_file.version)
        changed = changed or done is None or done[1] != function_file.checksum
        if changed:
            todo.append(function_file)
    return todo


async def pending(conn: psycopg.AsyncConnection[Any], component: str) -> list[Migration]:
    """What `migrate` would apply to a component: versioned migrations not applied yet, then the
    function files that changed (and those after them). Raises if an applied migration was
    changed since, or the database is a pre-release one (which only `migrate` adopts)."""
    recorded = await _recorded(conn, component)
    if _prerelease(component, recorded):
        raise MigrationError(
            f"this database was created by a pre-release build of serversync ({component} "
            f"migrations {PRERELEASE[component][0]} .. {PRERELEASE[component][-1]}); "
            f"run `serversync migrate`, which adopts it as {component}/0001_baseline"
        )
    return _todo(component, recorded)


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
            recorded = await _recorded(conn, component)
            if _prerelease(component, recorded):
                done.append(await _adopt_prerelease(conn, component))
                recorded = await _recorded(conn, component)
            for migration in _todo(component, recorded):
                async with conn.transaction():
                    await _execute(conn, migration.text, f"migration {migration.label}")
                    await _record(conn, migration)
                done.append(migration)
    return done


async def _record(conn: psycopg.AsyncConnection[Any], migration: Migration) -> None:
    await conn.execute(
        sql.SQL(
            "INSERT INTO {} (component, version, name, checksum) VALUES (%s, %s, %s, %s)"
            " ON CONFLICT (component, version) DO UPDATE"
            " SET name = EXCLUDED.name, checksum = EXCLUDED.checksum, applied_at = now()"
        ).format(_record_table(migration.component)),
        (migration.component, migration.version, migration.name, migration.checksum),
    )


async def _adopt_prerelease(conn: psycopg.AsyncConnection[Any], component: str) -> Migration:
    """Record a pre-release database as being at the baseline, in one transaction: the dead
    objects it has go (prerelease.sql), its old records give way to the baseline's."""
    baseline = next(m for m in versioned(component) if m.version == BASELINE)
    dead = sql_dir() / component / PRERELEASE_FILE
    async with conn.transaction():
        if dead.is_file():
            await _execute(conn, dead.read_text("utf-8"), f"{component}/{PRERELEASE_FILE}")
        await conn.execute(
            sql.SQL(
                "DELETE FROM {} WHERE component = %s AND version || '_' || name = ANY(%s)"
            ).format(_record_table(component)),
            (component, list(PRERELEASE[component])),
        )
        await _record(conn, baseline)
    return Migration(component, baseline.version, baseline.name, baseline.text, adopted=True)


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
