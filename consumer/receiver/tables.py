"""Applying entries of mapped entity types into their tables (INGEST_MAPPING_FILE).

Inside the request's one transaction, per distinct origin of its mapped entries, one statement:

1. the entries (the request body, one jsonb parameter: parsed once, numbers kept exactly),
   the newest of each entity, by version (createdAt, origin);
2. sync.row_versions upserted where the incoming version is greater than the stored one: the
   winners, decided under the version row's lock;
3. per mapped table, the winners written: INSERT .. ON CONFLICT (key) DO UPDATE of the mapped
   columns the payload has (one part per set of fields present, so that a field absent from the
   payload takes the column's default on insert and keeps the row's value on update), and a
   DELETE of the winning deletes. The payload is typed by jsonb_to_record with each column's
   own type, which takes JSON numbers of any size, strings, booleans, nulls, objects and arrays
   (json, jsonb and array columns) and timestamps as the column's input reads them.

Each version it writes is marked with its transaction (`applied_xact`: a both-ways relay then
records the applied version instead of a local one) and whose changes (`serversync.origin`,
which every relay's outbox row records), and gives up on any row lock after
APPLY_LOCK_TIMEOUT: an operator's edit in progress always wins the wait, and the sender retries.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import sql

from consumer.receiver.mapping import MappedTable, TableMapping

__all__ = ["APPLY_LOCK_TIMEOUT", "EntryRefused", "Plan", "TableWriter", "WriteRefused"]

# Below PostgreSQL's deadlock_timeout (1 s): the receiver's apply is always the transaction that
# gives up when it meets a local edit, never the operator's.
APPLY_LOCK_TIMEOUT = "200ms"
# Entries tried one by one to find the one PostgreSQL refuses; a larger request is refused as a
# whole, and the sender's bisection finds it.
PROBE_LIMIT = 100
# Statement texts kept, by the shape of a request (which tables, which sets of fields).
_CACHE_SIZE = 256

# A part of a statement: the upserts of one table with one set of fields, or its deletes (None).
GroupKey = tuple[str, frozenset[str] | None]


class EntryRefused(Exception):
    """An entry the receiver refuses (422): `field` names it, as entries[N] or entries[N].x."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class WriteRefused(Exception):
    """PostgreSQL refused the mapped entries' data (a value that does not fit its column, a
    missing required column, a constraint): the transaction is lost, and TableWriter.culprit
    finds the entry in a new one."""

    def __init__(self, error: psycopg.Error) -> None:
        super().__init__(str(error))
        self.error = error


@dataclass
class Plan:
    """The mapped entries of one request, ready to write."""

    # origin -> [(1-based index in the body's entries, part)], in request order.
    by_origin: dict[str, list[tuple[int, GroupKey]]] = field(default_factory=dict)
    # How many are for the generic store (not mapped).
    unmapped: int = 0


_INCOMING = sql.SQL("""WITH incoming AS (
    SELECT DISTINCT ON (e."entityType", e."entityId")
           e."entityType" AS entity_type, e."entityId" AS entity_id, e.op, g.part,
           e."createdAt" AS version_ts, e.origin AS version_node, e.payload
      FROM ROWS FROM (jsonb_to_recordset(%(body)s -> 'entries') AS (
               "entityType" text COLLATE "C", "entityId" text COLLATE "C", op text, seq numeric,
               "createdAt" timestamptz, origin text COLLATE "C", payload jsonb))
           WITH ORDINALITY AS e
           JOIN unnest(%(indexes)s::int8[], %(parts)s::int4[]) AS g(n, part)
             ON g.n = e.ordinality
     ORDER BY e."entityType", e."entityId", e."createdAt" DESC, e.origin DESC, e.seq DESC
), versions AS (
    INSERT INTO sync.row_versions AS v
        (entity_type, entity_id, version_ts, version_node, deleted, applied_xact)
    SELECT entity_type, entity_id, version_ts, version_node, op = 'delete',
           pg_current_xact_id()
      FROM incoming
    ON CONFLICT (entity_type, entity_id) DO UPDATE
    SET version_ts = EXCLUDED.version_ts,
        version_node = EXCLUDED.version_node,
        deleted = EXCLUDED.deleted,
        applied_xact = EXCLUDED.applied_xact
    WHERE v.version_ts < EXCLUDED.version_ts
       OR (v.version_ts = EXCLUDED.version_ts
           AND v.version_node COLLATE "C" < EXCLUDED.version_node COLLATE "C")
    RETURNING v.entity_type, v.entity_id
), winners AS (
    SELECT i.* FROM incoming i JOIN versions USING (entity_type, entity_id)
)""")

# The upserts of one part. {existing} is empty when the payloads hold every required column;
# else it is _EXISTING, and _UPDATE writes the rows that exist: PostgreSQL checks NOT NULL on the
# row proposed for insertion before it looks for a conflict, so a partial payload of an existing
# row must not be proposed, and one of a new row is refused as it should be.
_UPSERT = sql.SQL("""
, {part} AS (
    INSERT INTO {table} AS t ({columns}){overriding}
    SELECT CAST(w.entity_id AS {key_type}){values}
      FROM winners w{typed}
     WHERE w.part = {number}{existing}
    ON CONFLICT ({key}) DO {conflict}
    RETURNING 1
)""")
_EXISTING = sql.SQL("""
       AND NOT EXISTS (SELECT FROM {table} AS o WHERE o.{key} = CAST(w.entity_id AS {key_type}))""")
_UPDATE = sql.SQL("""
, {part} AS (
    UPDATE {table} AS t SET {sets}
      FROM winners w{typed}
     WHERE w.part = {number} AND t.{key} = CAST(w.entity_id AS {key_type})
    RETURNING 1
)""")

_DELETE = sql.SQL("""
, {part} AS (
    DELETE FROM {table} AS t USING winners w
     WHERE w.part = {number} AND t.{key} = CAST(w.entity_id AS {key_type})
    RETURNING 1
)""")

_COUNT = sql.SQL("\nSELECT count(*) FROM winners")

_BEGIN = (
    "SELECT set_config('lock_timeout', %(lock_timeout)s, true), "
    "set_config('serversync.origin', %(origin)s, true)"
)
_ORIGIN = "SELECT set_config('serversync.origin', %(origin)s, true)"


def _ident(*names: str) -> sql.Identifier:
    """A name for a statement run with parameters: psycopg reads every % of such a statement's
    text as a placeholder's, quoted identifiers included, and %% as a %. So a column named
    "Sel%ect" is written "Sel%%ect" here, and reaches PostgreSQL as "Sel%ect"."""
    return sql.Identifier(*(name.replace("%", "%%") for name in names))


def _upsert(table: MappedTable, fields: frozenset[str], number: int) -> sql.Composed:
    columns = [c for c in table.columns if c.field in fields]
    typed: sql.Composable = sql.SQL("")
    if columns:
        typed = sql.SQL(" CROSS JOIN LATERAL jsonb_to_record(w.payload) AS r({})").format(
            sql.SQL(", ").join(
                sql.SQL("{} {}").format(_ident(c.field), _ident(c.type_schema, c.type_name))
                for c in columns
            )
        )
    # An identity column GENERATED ALWAYS takes a value on insert (OVERRIDING SYSTEM VALUE) but
    # may not be updated to one: on update it keeps its own.
    updated = [c for c in columns if not c.identity_always]
    identity = table.key.identity_always or any(c.identity_always for c in columns)
    names = {
        "table": _ident(table.schema, table.name),
        "key": _ident(table.key.name),
        "key_type": _ident(table.key.type_schema, table.key.type_name),
        "number": sql.Literal(number),
        "typed": typed,
    }
    # Without a column to update an existing row is left as it is (its version still moves).
    conflict: sql.Composable = sql.SQL("NOTHING")
    if updated:
        conflict = sql.SQL("UPDATE SET {}").format(
            sql.SQL(", ").join(
                sql.SQL("{0} = EXCLUDED.{0}").format(_ident(c.name)) for c in updated
            )
        )
    partial = any(c.required and c.field not in fields for c in table.columns)
    statement: sql.Composable = sql.SQL("")
    if partial and updated:
        statement = _UPDATE.format(
            part=_ident(f"part_{number}_update"),
            sets=sql.SQL(", ").join(
                sql.SQL("{} = r.{}").format(_ident(c.name), _ident(c.field)) for c in updated
            ),
            **names,
        )
    return statement + _UPSERT.format(
        part=_ident(f"part_{number}"),
        columns=sql.SQL(", ").join(map(_ident, [table.key.name, *(c.name for c in columns)])),
        overriding=sql.SQL(" OVERRIDING SYSTEM VALUE" if identity else ""),
        values=sql.SQL("").join(sql.SQL(", r.{}").format(_ident(c.field)) for c in columns),
        existing=_EXISTING.format(**names) if partial else sql.SQL(""),
        conflict=conflict,
        **names,
    )


def _delete(table: MappedTable, number: int) -> sql.Composed:
    return _DELETE.format(
        part=_ident(f"part_{number}"),
        table=_ident(table.schema, table.name),
        number=sql.Literal(number),
        key=_ident(table.key.name),
        key_type=_ident(table.key.type_schema, table.key.type_name),
    )


class TableWriter:
    """Writes the mapped entity types of requests into their tables."""

    def __init__(self, mapping: TableMapping, *, lock_timeout: str = APPLY_LOCK_TIMEOUT) -> None:
        self.mapping = mapping
        self.lock_timeout = lock_timeout
        self._statements: dict[tuple[GroupKey, ...], sql.Composed] = {}
        # The mapped entity types (the generic store takes every other).
        self.entity_types = sorted(mapping.tables)

    def plan(self, entries: Sequence[Mapping[str, Any]]) -> Plan:
        """Which statement part takes each mapped entry. EntryRefused for a mapped entry without
        an origin or a createdAt (its version). A delete of a type whose mapping ignores deletes
        is in no part: it changes nothing, and counts as not applied."""
        plan = Plan()
        tables = self.mapping.tables
        for index, entry in enumerate(entries):
            table = tables.get(entry["entityType"])
            if table is None:
                plan.unmapped += 1
                continue
            if entry["op"] == "delete" and not table.deletes:
                continue
            origin = entry.get("origin")
            if not origin:  # its form is checked with the request's (models.NODE_PATTERN)
                raise EntryRefused(
                    f"entries[{index}].origin",
                    f"a node name is required for entity type {entry['entityType']!r}, which "
                    "this receiver applies into a table (the origin is half its version)",
                )
            if not entry.get("createdAt"):
                raise EntryRefused(
                    f"entries[{index}].createdAt",
                    f"required for entity type {entry['entityType']!r}, which this receiver "
                    "applies into a table (the createdAt is half its version)",
                )
            if entry["op"] == "delete":
                part: GroupKey = (table.entity_type, None)
            else:
                part = (table.entity_type, table.fields.intersection(entry["payload"]))
            plan.by_origin.setdefault(origin, []).append((index + 1, part))
        return plan

    def _statement(self, shape: tuple[GroupKey, ...]) -> sql.Composed:
        statement = self._statements.get(shape)
        if statement is None:
            parts: list[sql.Composable] = [_INCOMING]
            for number, (entity_type, fields) in enumerate(shape, 1):
                table = self.mapping.tables[entity_type]
                parts.append(
                    _delete(table, number) if fields is None else _upsert(table, fields, number)
                )
            parts.append(_COUNT)
            statement = sql.Composed(parts)
            if len(self._statements) >= _CACHE_SIZE:
                self._statements.clear()  # shapes of past requests; rebuilt when seen again
            self._statements[shape] = statement
        return statement

    async def _run(
        self,
        conn: psycopg.AsyncConnection[Any],
        body: Any,
        items: Sequence[tuple[int, GroupKey]],
    ) -> int:
        shape = tuple(dict.fromkeys(part for _, part in items))
        numbers = {part: number for number, part in enumerate(shape, 1)}
        cur = await conn.execute(
            self._statement(shape),
            {
                "body": body,
                "indexes": [index for index, _ in items],
                "parts": [numbers[part] for _, part in items],
            },
            prepare=True,
            binary=True,
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def _begin(self, conn: psycopg.AsyncConnection[Any], origin: str) -> None:
        await conn.execute(
            _BEGIN, {"lock_timeout": self.lock_timeout, "origin": origin}, prepare=True
        )

    async def write(self, conn: psycopg.AsyncConnection[Any], body: Any, plan: Plan) -> int:
        """Write `plan`'s entries, in the caller's transaction on `conn`; `body` is the request
        body as a jsonb parameter. Returns how many entries won (were applied). WriteRefused
        when PostgreSQL refuses their data; a lock not granted within the lock timeout, a
        deadlock, a serialization failure or a foreign key to a row not there yet propagate
        (the request is to be retried)."""
        applied = 0
        for number, (origin, items) in enumerate(plan.by_origin.items()):
            if number == 0:
                await self._begin(conn, origin)
            else:
                await conn.execute(_ORIGIN, {"origin": origin}, prepare=True)
            try:
                applied += await self._run(conn, body, items)
            except psycopg.errors.ForeignKeyViolation:
                # A row it refers to has not arrived yet (in a batch still in flight, or of an
                # entity type applied later): passing trouble, the request is retried.
                raise
            except (psycopg.DataError, psycopg.IntegrityError) as exc:
                raise WriteRefused(exc) from exc
        return applied

    async def culprit(
        self, conn: psycopg.AsyncConnection[Any], body: Any, plan: Plan
    ) -> int | None:
        """The 0-based index of the first entry PostgreSQL refuses when `plan`'s entries are
        written one by one in request order (each after those before it), or None when none
        of the first PROBE_LIMIT is refused alone, or when a lock is not granted. Nothing is
        kept: the whole trial is rolled back. Call it on a connection outside a transaction."""
        ordered = sorted(
            (index, origin, part)
            for origin, items in plan.by_origin.items()
            for index, part in items
        )
        async with conn.transaction(force_rollback=True):
            await self._begin(conn, ordered[0][1] if ordered else "")
            for index, origin, part in ordered[:PROBE_LIMIT]:
                try:
                    async with conn.transaction():
                        await conn.execute(_ORIGIN, {"origin": origin}, prepare=True)
                        await self._run(conn, body, [(index, part)])
                except psycopg.errors.ForeignKeyViolation:
                    continue  # refers to a row not written yet, not refused for its content
                except (psycopg.DataError, psycopg.IntegrityError):
                    return index - 1
                except psycopg.OperationalError:
                    return None
        return None
