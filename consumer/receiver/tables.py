"""Applying entries of mapped entity types into their tables (INGEST_MAPPING_FILE).

Inside the request's one transaction, per distinct origin of its mapped entries, one statement
(which sets the lock timeout and `serversync.origin` itself, before it reads a row):

1. the entries (the request body, one jsonb parameter: parsed once, numbers kept exactly),
   the newest of each entity, by version (createdAt, origin);
2. sync.row_versions upserted where the incoming version is greater than the stored one: the
   winners, decided under the version row's lock;
3. per mapped table, the winners written: INSERT .. ON CONFLICT (key) DO UPDATE of the mapped
   columns the payload has (one part per set of fields present, so that a field absent from the
   payload takes the column's default on insert and keeps the row's value on update), and a
   DELETE of the winning deletes. The payload is typed by jsonb_to_record with each column's
   own type, which takes JSON numbers of any size, strings, booleans, nulls, objects and arrays
   (json, jsonb and array columns) and timestamps as the column's input reads them (columns of
   plain scalar types by `->>` and a cast, which reads them alike and costs less).

A request whose mapped entries all fall in one part under one origin, with no other entry (a
batch of one table's changes), reads the whole body, without numbering its entries into parts.

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

from consumer.receiver.mapping import Column, MappedTable, TableMapping
from consumer.receiver.models import Sweep

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


def _sweep_refused(entity_type: str) -> str:
    """Why a sweep of a mapped type is refused (the sender parks it, for an operator to see)."""
    return (
        f"a sweep of entity type {entity_type!r}, which this receiver applies into a table: "
        "mapped tables keep versions as (createdAt, origin), not seqs, so a sweep cannot tell "
        "what the snapshot did not mention; delete such rows by hand, or keep the type in the "
        "generic store"
    )


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
    # How many upserts and deletes are for the generic store (not mapped).
    unmapped: int = 0
    # The sweeps, all of unmapped types: the generic store applies them.
    sweeps: list[Sweep] = field(default_factory=list)
    # Every entry of the body falls in one part, under one origin (a batch of one table's
    # changes): its statement reads them all, without numbering them into parts.
    whole: bool = False


# The request's settings, set by its statement itself rather than by one more before it: they
# take effect before the first row is read, so before any row lock is asked for. The newest entry
# of each entity, in key order: rows are locked in the same order by every request.
_SETTINGS = """WITH settings AS MATERIALIZED (
    SELECT set_config('lock_timeout', %(lock_timeout)s, true),
           set_config('serversync.origin', %(origin)s, true)
), incoming AS (
    SELECT DISTINCT ON ({key})
           e."entityType" AS entity_type, e."entityId" AS entity_id, e.op, {part} AS part,
           e."createdAt" AS version_ts, e.origin AS version_node, e.payload
      FROM settings, ROWS FROM (jsonb_to_recordset(%(body)s -> 'entries') AS (
               "entityType" text COLLATE "C", "entityId" text COLLATE "C", op text, seq numeric,
               "createdAt" timestamptz, origin text COLLATE "C", payload jsonb)){entries}
     ORDER BY {key}, e."createdAt" DESC, e.origin DESC, e.seq DESC
)"""
# The entries of a request in several parts (or with entries of no part): each numbered by its
# index in the body.
_PARTS = _SETTINGS.format(
    key='e."entityType", e."entityId"',
    part="g.part",
    entries="""
           WITH ORDINALITY AS e
           JOIN unnest(%(indexes)s::int8[], %(parts)s::int4[]) AS g(n, part)
             ON g.n = e.ordinality""",
)
# Every entry of the body in the one part, so of one entity type: sorted by the id alone, whose
# abbreviated keys decide most comparisons (a type shared by all would decide none).
_WHOLE = _SETTINGS.format(key='e."entityId"', part="1", entries=" AS e")
_GUARD = """, versions AS (
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
)"""
_INCOMING = {whole: sql.SQL(text + _GUARD) for whole, text in ((False, _PARTS), (True, _WHOLE))}

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

# One version row won per winner: counted from them, `winners` is read by the parts alone (and by
# one part, inlined into it rather than stored).
_COUNT = sql.SQL("\nSELECT count(*) FROM versions")


def _ident(*names: str) -> sql.Identifier:
    """A name for a statement run with parameters: psycopg reads every % of such a statement's
    text as a placeholder's, quoted identifiers included, and %% as a %. So a column named
    "Sel%ect" is written "Sel%%ect" here, and reaches PostgreSQL as "Sel%ect"."""
    return sql.Identifier(*(name.replace("%", "%%") for name in names))


# Types whose value jsonb_to_record reads by passing the field's text (a string's content, else
# its JSON text) to the type's input function, which is what a cast of `->>` does (no cast from
# text but that input, or a binary one): such a column is read so, without typing the payload
# as a record per row (measured: ~0.4 ms less per 1,000 entries of four such columns). Arrays,
# json, jsonb, composites and domains are read as jsonb_to_record reads them.
_READ_AS_TEXT = frozenset({
    "bool", "date", "float4", "float8", "int2", "int4", "int8", "interval", "numeric", "text",
    "time", "timestamp", "timestamptz", "timetz", "uuid", "varchar",
})  # fmt: skip


def _as_text(column: Column) -> bool:
    return column.type_schema == "pg_catalog" and column.type_name in _READ_AS_TEXT


def _value(column: Column) -> sql.Composable:
    """The column's value from an entry's payload (`w`), typed as the column."""
    if _as_text(column):
        # A literal, % doubled as in _ident.
        return sql.SQL("CAST(w.payload ->> {} AS {})").format(
            sql.Literal(column.field.replace("%", "%%")),
            _ident(column.type_schema, column.type_name),
        )
    return sql.SQL("r.{}").format(_ident(column.field))


def _upsert(table: MappedTable, fields: frozenset[str], number: int) -> sql.Composed:
    columns = [c for c in table.columns if c.field in fields]
    typed: sql.Composable = sql.SQL("")
    as_record = [c for c in columns if not _as_text(c)]
    if as_record:
        typed = sql.SQL(" CROSS JOIN LATERAL jsonb_to_record(w.payload) AS r({})").format(
            sql.SQL(", ").join(
                sql.SQL("{} {}").format(_ident(c.field), _ident(c.type_schema, c.type_name))
                for c in as_record
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
                sql.SQL("{} = {}").format(_ident(c.name), _value(c)) for c in updated
            ),
            **names,
        )
    return statement + _UPSERT.format(
        part=_ident(f"part_{number}"),
        columns=sql.SQL(", ").join(map(_ident, [table.key.name, *(c.name for c in columns)])),
        overriding=sql.SQL(" OVERRIDING SYSTEM VALUE" if identity else ""),
        values=sql.SQL("").join(sql.SQL(", {}").format(_value(c)) for c in columns),
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
        # Statement texts by (whole, shape), as bytes: composing one escapes every name again.
        self._statements: dict[tuple[bool, tuple[GroupKey, ...]], bytes] = {}
        # The mapped entity types (the generic store takes every other).
        self.entity_types = sorted(mapping.tables)

    def plan(self, entries: Sequence[Mapping[str, Any]]) -> Plan:
        """Which statement part takes each mapped entry. EntryRefused for a mapped entry without
        an origin or a createdAt (its version), and for a sweep of a mapped type. A delete of a
        type whose mapping ignores deletes is in no part: it changes nothing, and counts as not
        applied."""
        plan = Plan()
        by_origin = plan.by_origin
        tables = self.mapping.tables
        # Entries come in runs of one type and one set of payload fields: the part is worked out
        # again only when either changes, and then compared rather than rebuilt.
        entity_type = None
        table: MappedTable | None = None
        keys: Any = None
        upsert: GroupKey = ("", None)
        first: GroupKey | None = None
        whole = True
        for index, entry in enumerate(entries):
            if entry["entityType"] != entity_type:
                entity_type = entry["entityType"]
                table = tables.get(entity_type)
                keys = None
            op = entry["op"]
            if op == "sweep":
                if table is not None:
                    raise EntryRefused(f"entries[{index}]", _sweep_refused(entry["entityType"]))
                plan.sweeps.append(Sweep.of(index, entry))
                continue
            if table is None:
                plan.unmapped += 1
                continue
            if op == "delete":
                if not table.deletes:
                    whole = False
                    continue
                part: GroupKey = (table.entity_type, None)
            else:
                payload = entry["payload"]
                if keys is None or payload.keys() != keys:
                    keys = payload.keys()
                    upsert = (table.entity_type, table.fields.intersection(keys))
                part = upsert
            origin = entry.get("origin")
            if not origin:  # its form is checked with the request's (models.NODE_PATTERN)
                raise EntryRefused(
                    f"entries[{index}].origin",
                    f"a node name is required for entity type {entity_type!r}, which "
                    "this receiver applies into a table (the origin is half its version)",
                )
            if not entry.get("createdAt"):
                raise EntryRefused(
                    f"entries[{index}].createdAt",
                    f"required for entity type {entity_type!r}, which this receiver "
                    "applies into a table (the createdAt is half its version)",
                )
            by_origin.setdefault(origin, []).append((index + 1, part))
            if first is None:
                first = part
            elif part is not first and part != first:
                whole = False
        plan.whole = whole and not plan.unmapped and not plan.sweeps and len(by_origin) == 1
        return plan

    def _statement(
        self, conn: psycopg.AsyncConnection[Any], whole: bool, shape: tuple[GroupKey, ...]
    ) -> bytes:
        statement = self._statements.get((whole, shape))
        if statement is None:
            parts: list[sql.Composable] = [_INCOMING[whole]]
            for number, (entity_type, fields) in enumerate(shape, 1):
                table = self.mapping.tables[entity_type]
                parts.append(
                    _delete(table, number) if fields is None else _upsert(table, fields, number)
                )
            parts.append(_COUNT)
            statement = sql.Composed(parts).as_bytes(conn)
            if len(self._statements) >= _CACHE_SIZE:
                self._statements.clear()  # shapes of past requests; rebuilt when seen again
            self._statements[whole, shape] = statement
        return statement

    async def _run(
        self,
        conn: psycopg.AsyncConnection[Any],
        body: Any,
        origin: str,
        items: Sequence[tuple[int, GroupKey]],
        whole: bool = False,
    ) -> int:
        params = {"body": body, "lock_timeout": self.lock_timeout, "origin": origin}
        if whole:
            shape: tuple[GroupKey, ...] = (items[0][1],)
        else:
            shape = tuple(dict.fromkeys(part for _, part in items))
            numbers = {part: number for number, part in enumerate(shape, 1)}
            params["indexes"] = [index for index, _ in items]
            params["parts"] = [numbers[part] for _, part in items]
        cur = await conn.execute(
            self._statement(conn, whole, shape), params, prepare=True, binary=True
        )
        row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def write(self, conn: psycopg.AsyncConnection[Any], body: Any, plan: Plan) -> int:
        """Write `plan`'s entries on `conn`: one statement per origin, in the caller's
        transaction when there are several (one alone is a transaction of its own). `body` is
        the request body as a jsonb parameter. Returns how many entries won (were applied).
        WriteRefused when PostgreSQL refuses their data; a lock not granted within the lock
        timeout, a deadlock, a serialization failure or a foreign key to a row not there yet
        propagate (the request is to be retried)."""
        applied = 0
        for origin, items in plan.by_origin.items():
            try:
                applied += await self._run(conn, body, origin, items, plan.whole)
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
            for index, origin, part in ordered[:PROBE_LIMIT]:
                try:
                    async with conn.transaction():
                        await self._run(conn, body, origin, [(index, part)])
                except psycopg.errors.ForeignKeyViolation:
                    continue  # refers to a row not written yet, not refused for its content
                except (psycopg.DataError, psycopg.IntegrityError):
                    return index - 1
                except psycopg.OperationalError:
                    return None
        return None
