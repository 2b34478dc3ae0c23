"""Applying entries to the receiver's database: one transaction per request, version-guarded.

Without a mapping every entry goes to the generic store, ingest.entities, in one statement (and
one more per sweep entry, in the same transaction). With one (INGEST_MAPPING_FILE), the entries
of mapped entity types go into their tables (tables.py) and the others to ingest.entities, in
the same transaction: all or nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from consumer.receiver.models import Sweep, sweeps_of
from consumer.receiver.tables import EntryRefused, Plan, TableWriter, WriteRefused

log = logging.getLogger("serversync.receiver")

# The whole request body goes to PostgreSQL as one jsonb parameter, and one INSERT applies its
# upserts and deletes. DISTINCT ON keeps the newest entry of each entity in the batch (ON
# CONFLICT cannot touch one row twice in a statement), and the WHERE of the upsert is the version
# guard: an entry not newer than the stored state is a no-op, and a delete leaves a tombstone that
# a late, older upsert cannot overwrite. The INSERT's row count is how many entries changed an
# entity (a guarded no-op is not counted). Sweep entries are not entities: SWEEP applies them.
#
# The sort also makes every request write its rows in one order, so two requests in flight that
# share entities queue for them rather than deadlock. It sorts by the id first: a batch is mostly
# one entity type, and a first key equal in every row made each comparison go on to the second;
# ids differ in their first bytes, which the sort's abbreviated keys compare as integers. Keys
# compare byte by byte (COLLATE "C"), as the table's key columns do
# (sql/receiver/0001_baseline.sql).
#
# The entries are read with jsonb_array_elements and ->, not jsonb_to_recordset (which turned
# seq into numeric text and back). seq is cast from the jsonb number: 8444.0 is the integer 8444
# (validated as such before). Counted with callgrind per 1,000 distinct entities, against the
# recordset sorted by type then id and counted through RETURNING: 10 % fewer instructions, two
# thirds of them the sort's.
_APPLY = """
INSERT INTO ingest.entities AS t
    (entity_type, entity_id, seq, deleted, payload, source_created_at, applied_at)
SELECT entity_type, entity_id, seq, op = 'delete',
       CASE WHEN op = 'delete' THEN NULL ELSE payload END, created_at, now()
  FROM (SELECT DISTINCT ON (entity_id, entity_type)
               (e ->> 'entityType') COLLATE "C" AS entity_type,
               (e ->> 'entityId') COLLATE "C" AS entity_id, e ->> 'op' AS op,
               (e -> 'seq')::bigint AS seq, e -> 'payload' AS payload,
               (e ->> 'createdAt')::timestamptz AS created_at
          FROM jsonb_array_elements(%(body)s -> 'entries') AS e
         WHERE e ->> 'op' <> 'sweep'{unmapped}
         ORDER BY entity_id, entity_type, seq DESC) AS incoming
ON CONFLICT (entity_type, entity_id) DO UPDATE
SET seq = EXCLUDED.seq,
    deleted = EXCLUDED.deleted,
    payload = EXCLUDED.payload,
    source_created_at = EXCLUDED.source_created_at,
    applied_at = EXCLUDED.applied_at
WHERE t.seq < EXCLUDED.seq
"""
APPLY_ENTRIES = _APPLY.format(unmapped="")
# With a mapping: the entries of the types it does not map.
APPLY_UNMAPPED = _APPLY.format(
    unmapped="""
           AND e ->> 'entityType' <> ALL (%(mapped)s::text[])"""
)

# A sweep (docs/wire-contract.md, Snapshots): an entity of the type last changed below
# keepFromSeq is gone, unless an entry of it with a greater seq is still on its way (the snapshot
# sent every entity live when it began with a seq of at least keepFromSeq, and a change since has
# one too). So it is tombstoned as a delete would, at seq keepFromSeq - 1: such an entry (the
# snapshot's own, in a batch still in flight) still wins when it arrives, a change from before
# the snapshot began that arrives late (reordered in flight) no longer brings the entity back
# for a while, and a replayed sweep finds nothing left to change.
SWEEP = """
WITH swept AS (
    UPDATE ingest.entities
       SET deleted = true, payload = NULL, seq = %(keep_from_seq)s::bigint - 1,
           applied_at = now()
     WHERE entity_type = %(entity_type)s AND NOT deleted AND seq < %(keep_from_seq)s::bigint
    RETURNING 1
)
SELECT count(*) FROM swept
"""


class EntityStore:
    """The receiver's side of the database."""

    def __init__(self, pool: AsyncConnectionPool[Any], tables: TableWriter | None = None) -> None:
        self._pool = pool
        self._tables = tables

    @property
    def reads_entries(self) -> bool:
        """Whether `apply` reads the validated entries (a mapping plans from them), rather
        than only the body and its sweeps."""
        return self._tables is not None

    async def apply(self, body: bytes, entries: Sequence[Mapping[str, Any]] = ()) -> int:
        """Apply a validated request body (`entries`: its entries, as validated; without a
        mapping, its sweeps are enough) in one transaction; returns how many entries changed
        something (a sweep counts once, when it tombstoned any entity). With a mapping:
        EntryRefused naming the entry when a mapped entry lacks its version, is a sweep, or
        PostgreSQL refuses its data."""
        if self._tables is not None:
            return await self._apply_mapped(body, entries, self._tables)
        sweeps = sweeps_of(entries)
        # The body is already JSON text: its bytes go out as a binary jsonb parameter, with no
        # decoding here and no text encoding check in the server before it parses them.
        param = Jsonb(body, dumps=bytes)
        async with self._pool.connection() as conn:
            if not sweeps:
                # One statement: on an autocommit connection, a transaction of its own.
                return await _apply_entries(conn, APPLY_ENTRIES, {"body": param})
            async with conn.transaction():
                applied = 0
                if len(sweeps) < len(entries):
                    applied = await _apply_entries(conn, APPLY_ENTRIES, {"body": param})
                return applied + await _sweep(conn, sweeps)

    async def _apply_mapped(
        self, body: bytes, entries: Sequence[Mapping[str, Any]], tables: TableWriter
    ) -> int:
        plan = tables.plan(entries)
        param = Jsonb(body, dumps=bytes)
        async with self._pool.connection() as conn:
            try:
                if (
                    conn.autocommit
                    and not plan.unmapped
                    and not plan.sweeps
                    and len(plan.by_origin) <= 1
                ):
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
        """The statements of a request in one transaction: its unmapped entries', its sweeps
        (of unmapped types), then one per origin of its mapped entries."""
        async with conn.transaction():
            applied = 0
            # Before the mapped part sets its lock timeout: the generic store keeps its
            # behaviour whether or not a mapping is given.
            if plan.unmapped:
                applied += await _apply_entries(
                    conn, APPLY_UNMAPPED, {"body": param, "mapped": tables.entity_types}
                )
            if plan.sweeps:
                applied += await _sweep(conn, plan.sweeps)
            if plan.by_origin:
                applied += await tables.write(conn, param, plan)
        return applied

    async def ping(self) -> None:
        """Raise if the database cannot be reached."""
        async with self._pool.connection() as conn:
            await conn.execute("SELECT 1")


async def _apply_entries(
    conn: psycopg.AsyncConnection[Any], statement: str, params: dict[str, Any]
) -> int:
    """The upserts and deletes of a request into ingest.entities; how many changed an entity."""
    cur = await conn.execute(statement, params, prepare=True, binary=True)
    return max(cur.rowcount, 0)


async def _sweep(conn: psycopg.AsyncConnection[Any], sweeps: Sequence[Sweep]) -> int:
    """Apply `sweeps` to ingest.entities, after the request's upserts and deletes (in its
    transaction); how many of them tombstoned anything.

    After, rather than in the request's order: the end state is the same. A sweep never touches
    an entity whose seq is keepFromSeq or more, and every entry of the snapshot it ends has such
    a seq (as has any change made since it began), so applying those first changes nothing the
    sweep does. An entry below keepFromSeq placed after the sweep (which the sender never does:
    a sweep follows its snapshot in seq order) is a change from before the snapshot began, stale
    against the tombstone's seq."""
    applied = 0
    for sweep in sweeps:
        cur = await conn.execute(
            SWEEP,
            {"entity_type": sweep.entity_type, "keep_from_seq": sweep.keep_from_seq},
            prepare=True,
        )
        row = await cur.fetchone()
        swept = int(row[0]) if row else 0
        log.info(
            "sweep of %s below seq %d (entries[%d]): %d entities tombstoned",
            sweep.entity_type,
            sweep.keep_from_seq,
            sweep.index,
            swept,
        )
        if swept:
            applied += 1
    return applied


def _reason(error: psycopg.Error) -> str:
    reason = error.diag.message_primary or str(error)
    if error.diag.message_detail:
        reason += f" ({error.diag.message_detail})"
    return reason
