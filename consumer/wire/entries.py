"""The wire entry: the one place an outbox event becomes an entry of the ingest API's JSON array
(docs/wire-contract.md). The outbox's batches and a dead letter's redelivery both go through it,
so a receiver sees the same bytes for an event however it is sent."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import orjson

from consumer.core.events import EntryKey

# The trailing columns of a row that `encode_entries` reads, in this order; earlier columns
# (the batch's horizon flag and txid, for instance) are the caller's own.
ENTRY_COLUMNS = (
    "seq", "op", "entity_type", "entity_id", "payload", "created_at", "origin", "snapshot_id"
)  # fmt: skip


def encode_entries(rows: Iterable[Sequence[Any]], *, local_node: str | None = None) -> bytes:
    """The JSON array of entries for `rows`, each ending with ENTRY_COLUMNS: seq (int), op,
    entity type and id (text), the payload's stored json text (passed through byte for byte,
    never parsed: a number wider than a double stays as written), created_at (a datetime or
    None), origin (the node where the change was first made; None for a change made here) and
    snapshot_id (the snapshot the row belongs to; None for a change).

    An entry's "origin" is its origin, or `local_node` (this node's name) for a change made
    here; it is left out when both are None, as every entry was before nodes had names. An
    entry of a snapshot carries "snapshot", its id; a change has none."""
    return orjson.dumps([_entry(row, local_node) for row in rows])


def encode_keyed_entries(
    rows: Iterable[Sequence[Any]], *, local_node: str | None = None
) -> list[tuple[EntryKey, bytes]]:
    """Each row's entry on its own, byte for byte the element encode_entries writes for it,
    with its key (seq, op, entity type and id)."""
    return [
        (EntryKey(row[-8], row[-7], row[-6], row[-5]), orjson.dumps(_entry(row, local_node)))
        for row in rows
    ]


def _entry(row: Sequence[Any], local_node: str | None) -> dict[str, Any]:
    entry = {
        "entityType": row[-6],
        "entityId": row[-5],
        "op": row[-7],
        "seq": row[-8],
        "payload": orjson.Fragment(row[-4]),
        "createdAt": row[-3],
    }
    origin = row[-2] if row[-2] is not None else local_node
    if origin is not None:
        entry["origin"] = origin
    if row[-1] is not None:
        entry["snapshot"] = row[-1]
    return entry
