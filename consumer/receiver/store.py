"""Applying entries to the receiver's database: one transaction per request, version-guarded.

Without a mapping every entry goes to the generic store, ingest.entities, in one statement.
With one (INGEST_MAPPING_FILE), the entries of mapped entity types go into their tables
(tables.py) and the others to ingest.entities, in the same transaction: all or nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from consumer.receiver.tables import EntryRefused, Plan, TableWriter, WriteRefused

# The whole request body goes to PostgreSQL as one jsonb parameter; DISTINCT ON keeps the newest
# entry of each entity in the batch (ON CONFLICT cannot touch one row twice in a statement), and
# the WHERE of the upsert is the version guard: an entry not newer than the stored state is a
# no-op, and a delete leaves a tombstone that a late, older upsert cannot overwrite. Keys are
# sorted and compared in byte order, as the table's key columns are
# (sql/receiver/0001_baseline.sql). seq is read as numeric and cast: 8444.0 is the integer 8444
# (validated as such before).
_APPLY = """
WITH incoming AS (
    SELECT DISTINCT ON (e."entityType", e."entityId")
           e."entityType" AS entity_type, e."entityId" AS entity_id, e.op,
           e.seq::bigint AS seq, e.payload, e."createdAt" AS created_at
    FROM jsonb_to_recordset(%(body)s -> 'entries') AS e(
        "entityType" text COLLATE "C", "entityId" text COLLATE "C", op text, seq numeric,
        payload jsonb, "createdAt" timestamptz){unmapped}
    ORDER BY e."entityType", e."entityId", e.seq DESC
), applied AS (
    INSERT INTO ingest.entities AS t
        (entity_type, entity_id, seq, deleted, payload, source_created_at, applied_at)
    SELECT entity_type, entity_id, seq, op = 'delete',
           CASE WHEN op = 'delete' THEN NULL ELSE payload END, created_at, now()
    FROM incoming
    ON CONFLICT (entity_type, entity_id) DO UPDATE
    SET seq = EXCLUDED.seq,
        deleted = EXCLUDED.deleted,
        payload = EXCLUDED.payload,
        source_created_at = EXCLUDED.source_created_at,
        applied_at = EXCLUDED.applied_at
    WHERE t.seq < EXCLUDED.seq
    RETURNING 1
)
SELECT count(*) FROM applied
"""
APPLY_ENTRIES = _APPLY.format(unmapped="")
# With a mapping: the entries of the types it does not map.
APPLY_UNMAPPED = _APPLY.format(
    unmapped="""
    WHERE e."entityType" <> ALL (%(mapped)s::text[])"""
)


class EntityStore:
    """The receiver's side of the database."""

    def __init__(self, pool: AsyncConnectionPool[Any], tables: TableWriter | None = None) -> None:
        self._pool = pool
        self._tables = tables

    async def apply(self, body: bytes, entries: Sequence[Mapping[str, Any]] = ()) -> int:
        """Apply a validated request body (`entries`: its entries, as validated) in one
        transaction; returns how many entities changed. With a mapping: EntryRefused naming
        the entry when a mapped entry lacks its version or PostgreSQL refuses its data."""
        if self._tables is not None:
            return await self._apply_mapped(body, entries, self._tables)
        async with self._pool.connection() as conn:
            # The body is already JSON text: its bytes go out as a binary jsonb parameter, with
            # no decoding here and no text encoding check in the server before it parses them.
            cur = await conn.execute(
                APPLY_ENTRIES, {"body": Jsonb(body, dumps=bytes)}, prepare=True, binary=True
            )
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def _apply_mapped(
        self, body: bytes, entries: Sequence[Mapping[str, Any]], tables: TableWriter
    ) -> int:
        plan = tables.plan(entries)
        param = Jsonb(body, dumps=bytes)
        async with self._pool.connection() as conn:
            try:
                if conn.autocommit and not plan.unmapped and len(plan.by_origin) <= 1:
                    # One statement: on an autocommit connection, a transaction of its own,
                    # without a BEGIN and a COMMIT to wait for.
                    applied = await tables.write(conn, param, plan) if plan.by_origin else 0
                else:
                    applied = await self._apply_both(conn, param, plan, tables)
            except WriteRefused as refused:
                # Named when one entry alone is refused; the trial is a courtesy, and the
                # refusal stands without it.
                reason = _reason(refused.error)
                try:
                    index = await tables.culprit(conn, param, plan)
                except psycopg.Error:
                    index = None
                if index is None:
                    raise EntryRefused("entries", reason) from None
                refused_entry = entries[index]
                raise EntryRefused(
                    f"entries[{index}]",
                    f"{refused_entry['entityType']} {refused_entry['entityId']!r}: {reason}",
                ) from None
        return applied

    async def _apply_both(
        self, conn: psycopg.AsyncConnection[Any], param: Jsonb, plan: Plan, tables: TableWriter
    ) -> int:
        """The statements of a request in one transaction: its unmapped entries', then one per
        origin of its mapped entries."""
        async with conn.transaction():
            applied = 0
            if plan.unmapped:
                # Before the mapped part sets its lock timeout: the generic store keeps its
                # behaviour whether or not a mapping is given.
                cur = await conn.execute(
                    APPLY_UNMAPPED,
                    {"body": param, "mapped": tables.entity_types},
                    prepare=True,
                    binary=True,
                )
                row = await cur.fetchone()
                applied += int(row[0]) if row else 0
            if plan.by_origin:
                applied += await tables.write(conn, param, plan)
        return applied

    async def ping(self) -> None:
        """Raise if the database cannot be reached."""
        async with self._pool.connection() as conn:
            await conn.execute("SELECT 1")


def _reason(error: psycopg.Error) -> str:
    reason = error.diag.message_primary or str(error)
    if error.diag.message_detail:
        reason += f" ({error.diag.message_detail})"
    return reason
