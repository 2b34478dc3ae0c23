"""Applying entries to the receiver's database: one statement per request, version-guarded."""

from __future__ import annotations

from typing import Any

from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

# The whole request body goes to PostgreSQL as one jsonb parameter; DISTINCT ON keeps the newest
# entry of each entity in the batch (ON CONFLICT cannot touch one row twice in a statement), and
# the WHERE of the upsert is the version guard: an entry not newer than the stored state is a
# no-op, and a delete leaves a tombstone that a late, older upsert cannot overwrite. Keys are
# sorted and compared in byte order, as the table's key columns are
# (sql/receiver/0001_baseline.sql). seq is read as numeric and cast: 8444.0 is the integer 8444
# (validated as such before).
APPLY_ENTRIES = """
WITH incoming AS (
    SELECT DISTINCT ON (e."entityType", e."entityId")
           e."entityType" AS entity_type, e."entityId" AS entity_id, e.op,
           e.seq::bigint AS seq, e.payload, e."createdAt" AS created_at
    FROM jsonb_to_recordset(%(body)s -> 'entries') AS e(
        "entityType" text COLLATE "C", "entityId" text COLLATE "C", op text, seq numeric,
        payload jsonb, "createdAt" timestamptz)
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


class EntityStore:
    """The receiver's side of the database."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool

    async def apply(self, body: bytes) -> int:
        """Apply a validated request body in one transaction; returns how many entities changed."""
        async with self._pool.connection() as conn:
            # The body is already JSON text: its bytes go out as a binary jsonb parameter, with
            # no decoding here and no text encoding check in the server before it parses them.
            cur = await conn.execute(
                APPLY_ENTRIES, {"body": Jsonb(body, dumps=bytes)}, prepare=True, binary=True
            )
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def ping(self) -> None:
        """Raise if the database cannot be reached."""
        async with self._pool.connection() as conn:
            await conn.execute("SELECT 1")
