"""What a consumer does not send: entity types it was not given, and events that came from the
node it delivers to (no echo).

The filter runs on a batch as read, before the sink sees it: the sink gets only the entries to
send, and the offset still moves to the end of the read (the pipeline commits the batch as read),
so a batch whose entries are all passed over commits without a request. The read itself is the
store's gap-safe read, untouched: nothing is skipped that was not read.

An entry's origin is the wire entry's "origin" (consumer/wire/entries.py: the outbox origin, or
the node's own name when the change was made here; absent on an unnamed node), so a consumer
compares exactly what a receiver would see.
"""

from __future__ import annotations

from dataclasses import dataclass

from consumer.core.events import JSON_TEXT, Batch, json_members


@dataclass(frozen=True)
class EntryFilter:
    """The entries one consumer sends: of `entity_types` only (None: every type), and none whose
    origin is `target_node` (None: whatever their origin)."""

    entity_types: frozenset[str] | None = None
    target_node: str | None = None

    def keeps(self, entity_type: str | None, origin: str | None, snapshot: bool = False) -> bool:
        """Whether an entry of this type and origin is sent. An entry of a snapshot goes even to
        the node it came from: a node being rebuilt needs it, and one that holds its version
        ignores it, so it never loops."""
        if self.entity_types is not None and entity_type not in self.entity_types:
            return False
        return self.target_node is None or snapshot or origin != self.target_node

    def describe(self) -> str:
        """For the start-up log line."""
        parts = []
        if self.entity_types is not None:
            parts.append(f"entity types {', '.join(sorted(self.entity_types))}")
        if self.target_node is not None:
            parts.append(f"no event from node {self.target_node}")
        return "; ".join(parts) or "everything"

    def apply(self, batch: Batch) -> tuple[Batch | None, int]:
        """The batch of the entries to send (None when there are none) and how many were passed
        over. A batch kept whole is returned as it is.

        The entries are read from their JSON text (each payload skipped over, never decoded). A
        consumer that filters on the target node alone first looks for the node's name as a
        JSON string anywhere in the batch: where it is not, no entry can have it as its origin
        (a node name is written without escapes), and the batch goes as it is, unread."""
        if self.entity_types is None:
            if self.target_node is None:
                return batch, 0
            if f'"{self.target_node}"'.encode() not in batch.entries_json:
                return batch, 0
        kept: list[bytes] = []
        seqs: list[int] = []
        for raw in batch.raw_entries():
            members = json_members(raw.decode())
            if self.keeps(
                _text(members.get("entityType")),
                _text(members.get("origin")),
                "snapshot" in members,
            ):
                kept.append(raw)
                seqs.append(int(members["seq"]))
        skipped = batch.count - len(kept)
        if not skipped:
            return batch, 0
        if not kept:
            return None, skipped
        return (
            Batch(
                count=len(kept),
                # The end of the read: the entries passed over after the last kept one are
                # behind the offset once this batch commits.
                end=batch.end,
                min_seq=min(seqs),
                max_seq=max(seqs),
                entries_json=b"[" + b",".join(kept) + b"]",
            ),
            skipped,
        )


def _text(value: str | None) -> str | None:
    """A member's JSON string as text; None for a missing member or one that is no string."""
    if value is None or not value.startswith('"'):
        return None
    text = JSON_TEXT.decode(value)
    return text if isinstance(text, str) else None
