"""The mapping of entity types to tables (INGEST_MAPPING_FILE): its TOML form, and its check
against the receiving database's catalog at start.

    [entities.registered_number]
    table = "public.registered_numbers"   # as PostgreSQL reads a table name (to_regclass)
    key = "id"                            # the key column; it takes the entry's entityId
    columns = { }                         # payload field -> column; empty: every column by name
    deletes = true                        # a delete entry removes the row (false: ignored)

Names from the file are only ever passed to PostgreSQL as parameters (to find the table and
its columns) and, once found, written into SQL through psycopg.sql.Identifier from the
catalog's own spelling: a field or column may be any legal name.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import psycopg

from consumer.receiver.models import ENTITY_TYPE_PATTERN

__all__ = [
    "Column",
    "EntityMapping",
    "MappedTable",
    "MappingError",
    "TableMapping",
    "read_mapping",
    "resolve",
]

_ENTITY_TYPE = re.compile(ENTITY_TYPE_PATTERN)
_KEYS = frozenset({"table", "key", "columns", "deletes"})
# PostgreSQL's longest identifier (NAMEDATALEN - 1): every column's name, so every field of a
# payload that a relay wrote.
MAX_NAME_BYTES = 63


class MappingError(Exception):
    """The mapping file is wrong, or does not fit the database: one line saying what to fix."""


@dataclass(frozen=True)
class EntityMapping:
    """One `[entities.NAME]` table of the file, as written."""

    entity_type: str
    table: str
    key: str = "id"
    # payload field -> column; empty: every column under its own name.
    columns: Mapping[str, str] = field(default_factory=dict)
    deletes: bool = True


@dataclass(frozen=True)
class Column:
    """A column of a mapped table, with what writing it needs."""

    field: str  # the payload field it takes its value from
    name: str
    type_schema: str
    type_name: str  # pg_type.typname: `_int4` for int4[], usable as "schema"."typname"
    required: bool  # NOT NULL without a default: a new row needs a value
    identity_always: bool  # GENERATED ALWAYS AS IDENTITY: written with OVERRIDING SYSTEM VALUE


@dataclass(frozen=True)
class MappedTable:
    """An entity type resolved against the catalog: where and how its entries are written."""

    entity_type: str
    schema: str
    name: str
    key: Column
    columns: tuple[Column, ...]  # the mapped columns but the key, in the table's order
    deletes: bool

    @cached_property
    def fields(self) -> frozenset[str]:
        """The payload fields this table takes (worked out once: read for every entry)."""
        return frozenset(c.field for c in self.columns)

    @property
    def label(self) -> str:
        """The table as messages name it."""
        return f"{self.schema}.{self.name}"


@dataclass(frozen=True)
class TableMapping:
    """Every mapped entity type, by name."""

    tables: Mapping[str, MappedTable]

    def __contains__(self, entity_type: object) -> bool:
        return entity_type in self.tables


def _entity(entity_type: str, spec: object) -> EntityMapping:
    where = f"entities.{entity_type}"
    if not _ENTITY_TYPE.match(entity_type):
        raise MappingError(f"{where}: not an entity type (pattern {ENTITY_TYPE_PATTERN})")
    if not isinstance(spec, dict):
        raise MappingError(f"{where}: must be a table ([entities.{entity_type}])")
    unknown = sorted(set(spec) - _KEYS)
    if unknown:
        raise MappingError(
            f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})"
        )
    table = spec.get("table")
    if not isinstance(table, str) or not table.strip():
        raise MappingError(f'{where}: `table` is required, a table name such as "public.name"')
    key = spec.get("key", "id")
    if not isinstance(key, str) or not key:
        raise MappingError(f"{where}: `key` must be a column name")
    columns = spec.get("columns", {})
    if not isinstance(columns, dict) or not all(
        isinstance(f, str) and f and isinstance(c, str) and c for f, c in columns.items()
    ):
        raise MappingError(f"{where}: `columns` must map payload fields to column names")
    for name in columns:
        # A field is named in the statement as a column of jsonb_to_record: PostgreSQL would
        # cut a longer name to 63 bytes (and then match no field), and a name holds no U+0000.
        if len(name.encode()) > MAX_NAME_BYTES or "\0" in name:
            raise MappingError(f"{where}: field {name!r} is not a name PostgreSQL can hold")
    deletes = spec.get("deletes", True)
    if not isinstance(deletes, bool):
        raise MappingError(f"{where}: `deletes` must be true or false")
    return EntityMapping(entity_type, table, key, dict(columns), deletes)


def read_mapping(path: Path) -> list[EntityMapping]:
    """The entity mappings of the TOML file at `path`; MappingError (one line, without the
    file's name, which the caller gives) when it cannot be read or is not in the mapping's
    form."""
    try:
        with path.open("rb") as f:
            document = tomllib.load(f)
    except OSError as exc:
        raise MappingError(f"cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise MappingError(f"not TOML: {' '.join(str(exc).split())}") from None
    unknown = sorted(set(document) - {"entities"})
    if unknown:
        raise MappingError(f"unknown table {unknown[0]!r} (only [entities.NAME])")
    entities = document.get("entities")
    if not isinstance(entities, dict) or not entities:
        raise MappingError("maps no entity type (add [entities.NAME] tables)")
    return [_entity(name, spec) for name, spec in entities.items()]


# The table named by the file, as PostgreSQL resolves it (search_path, quoting and all).
_TABLE = """
SELECT c.oid, n.nspname, c.relname, c.relkind,
       -- A list of privileges is true when ANY of them is held: each is checked alone.
       has_table_privilege(c.oid, 'SELECT') AND has_table_privilege(c.oid, 'INSERT')
           AND has_table_privilege(c.oid, 'UPDATE') AS can_upsert,
       has_table_privilege(c.oid, 'DELETE') AS can_delete
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE c.oid = to_regclass(%s)
"""
_COLUMNS = """
SELECT a.attname, a.attnotnull AND NOT a.atthasdef AND a.attidentity = '' AS required,
       a.attidentity = 'a' AS identity_always, a.attgenerated <> '' AS generated,
       tn.nspname, t.typname
  FROM pg_attribute a
       JOIN pg_type t ON t.oid = a.atttypid
       JOIN pg_namespace tn ON tn.oid = t.typnamespace
 WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
 ORDER BY a.attnum
"""
# ON CONFLICT (key) needs a unique index on exactly that column, immediate and whole.
_KEY_IS_UNIQUE = """
SELECT EXISTS (
    SELECT 1 FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid
                                                AND a.attnum = i.indkey[0]
     WHERE i.indrelid = %s AND a.attname = %s AND i.indisunique AND i.indimmediate
       AND i.indnkeyatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL)
"""
# How the table is tracked both ways here, if it is (sync.tracked_tables).
_TRACKED_BOTH_WAYS = """
SELECT entity_type, key_column FROM sync.tracked_tables WHERE table_name = %s::oid AND both_ways
"""
_VERSIONS = """
SELECT to_regclass('sync.row_versions') IS NOT NULL
       AND has_table_privilege('sync.row_versions', 'SELECT')
       AND has_table_privilege('sync.row_versions', 'INSERT')
       AND has_table_privilege('sync.row_versions', 'UPDATE')
"""


async def _resolve_one(conn: psycopg.AsyncConnection[Any], spec: EntityMapping) -> MappedTable:
    where = f"entities.{spec.entity_type}"
    try:
        cur = await conn.execute(_TABLE, (spec.table,))
        found = await cur.fetchone()
    except psycopg.Error as exc:
        reason = exc.diag.message_primary or str(exc)
        raise MappingError(f"{where}: table {spec.table!r} is not a table name: {reason}") from None
    if found is None:
        raise MappingError(f"{where}: table {spec.table!r} does not exist")
    oid, schema, name, relkind, can_upsert, can_delete = found
    label = f"{schema}.{name}"
    if relkind not in ("r", "p"):
        raise MappingError(f"{where}: {label} is not a table")
    if not can_upsert or (spec.deletes and not can_delete):
        needed = "SELECT, INSERT, UPDATE" + (", DELETE" if spec.deletes else "")
        raise MappingError(f"{where}: the receiver's role lacks {needed} on {label}")
    cur = await conn.execute(_TRACKED_BOTH_WAYS, (oid,))
    for tracked_type, tracked_key in await cur.fetchall():
        # A both-ways relay reads the version the receiver wrote under (its entity type, its
        # key): under other names it would take every applied change for a local edit and send
        # it back with a new version, for ever.
        if (tracked_type, tracked_key) != (spec.entity_type, spec.key):
            raise MappingError(
                f"{where}: {label} is tracked both ways as entity type {tracked_type!r} keyed "
                f"by {tracked_key!r}; map it as that type with that key"
            )
    cur = await conn.execute(_COLUMNS, (oid,))
    catalog = {row[0]: row for row in await cur.fetchall()}
    if spec.key not in catalog:
        raise MappingError(f"{where}: {label} has no key column {spec.key!r}")
    cur = await conn.execute(_KEY_IS_UNIQUE, (oid, spec.key))
    unique = await cur.fetchone()
    if not unique or not unique[0]:
        raise MappingError(
            f"{where}: key column {spec.key!r} of {label} is not its primary key or unique "
            "(an immediate unique index on that column alone)"
        )

    def column(field_name: str, column_name: str) -> Column:
        _, required, identity_always, _, type_schema, type_name = catalog[column_name]
        return Column(field_name, column_name, type_schema, type_name, required, identity_always)

    if spec.columns:
        pairs = list(spec.columns.items())
    else:
        # Generated columns are computed by the table, never written.
        pairs = [(n, n) for n, row in catalog.items() if not row[3] and n != spec.key]
    taken: dict[str, str] = {}
    columns: list[Column] = []
    for field_name, column_name in pairs:
        if column_name not in catalog:
            raise MappingError(f"{where}: {label} has no column {column_name!r}")
        if catalog[column_name][3]:
            raise MappingError(f"{where}: column {column_name!r} of {label} is generated")
        if column_name in taken:
            raise MappingError(
                f"{where}: fields {taken[column_name]!r} and {field_name!r} both map to "
                f"column {column_name!r}"
            )
        taken[column_name] = field_name
        if column_name != spec.key:  # the key always takes the entry's entityId
            columns.append(column(field_name, column_name))
    unmapped = [n for n, row in catalog.items() if row[1] and n not in taken and n != spec.key]
    if unmapped:
        raise MappingError(
            f"{where}: column {unmapped[0]!r} of {label} is NOT NULL without a default and not "
            "mapped: no new row could be written"
        )
    order = list(catalog)
    columns.sort(key=lambda c: order.index(c.name))
    return MappedTable(
        spec.entity_type, schema, name, column("", spec.key), tuple(columns), spec.deletes
    )


async def resolve(conn: psycopg.AsyncConnection[Any], specs: list[EntityMapping]) -> TableMapping:
    """`specs` checked against the catalog of the database `conn` is on: each table exists and
    may be written, its key column is unique, every mapped column exists and is writable, and
    serversync's schema (sync.row_versions, the version guard) is there. MappingError (one
    line) names the first thing that is wrong."""
    cur = await conn.execute(_VERSIONS)
    present = await cur.fetchone()
    if not present or not present[0]:
        raise MappingError(
            "mapping entity types into tables needs serversync's schema in the receiving "
            "database (sync.row_versions is missing or not writable): run `serversync migrate` "
            "on it"
        )
    tables: dict[str, MappedTable] = {}
    targets: dict[str, str] = {}
    for spec in specs:
        table = await _resolve_one(conn, spec)
        if table.label in targets:
            raise MappingError(
                f"entities.{spec.entity_type}: {table.label} is mapped already "
                f"(entities.{targets[table.label]})"
            )
        targets[table.label] = spec.entity_type
        tables[spec.entity_type] = table
    return TableMapping(tables)
