"""The wire entry: the one place an outbox event becomes an entry of the ingest API's JSON array
(docs/wire-contract.md). The outbox's batches and a dead letter's redelivery both go through it,
so a receiver sees the same bytes for an event however it is sent."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

# The trailing columns of a row that `encode_entries` reads, in this order; earlier columns
# (the batch's horizon flag and txid, for instance) are the caller's own.
ENTRY_COLUMNS = ("seq", "op", "entity_type", "entity_id", "payload", "created_at")


def encode_entries(rows: Iterable[Sequence[Any]]) -> bytes:
    """The JSON array of entries for `rows`, each ending with ENTRY_COLUMNS: seq (int), op,
    entity type and id (text), the payload's stored json text (passed through byte for byte,
    never parsed: a number wider than a double stays as written) and created_at (a datetime or
    None)."""
    return orjson.dumps(
        [
            {
                "entityType": row[-4],
                "entityId": row[-3],
                "op": row[-5],
                "seq": row[-6],
                "payload": orjson.Fragment(row[-2]),
                "createdAt": row[-1],
            }
            for row in rows
        ]
    )
