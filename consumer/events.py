"""The shared vocabulary of the outbox: positions and batches of events.

A batch keeps its entries as one JSON array, built by PostgreSQL in the wire format of the ingest
API, so delivering a batch costs no Python object per event. A sink that needs single events
parses it (`Batch.entries()`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

import orjson


@dataclass(frozen=True, order=True)
class Position:
    """A place in the outbox: everything up to and including (txid, seq) is behind it.

    The outbox is ordered by the writing transaction's id, then seq; see sql/queries.sql.
    """

    txid: int
    seq: int

    @classmethod
    def start(cls) -> Position:
        """Before the first event."""
        return cls(0, 0)

    def __str__(self) -> str:
        return f"{self.txid}/{self.seq}"


@dataclass(frozen=True)
class Batch:
    """Consecutive events of the outbox, as read for one consumer."""

    count: int
    # Where the consumer stands once this batch is delivered.
    end: Position
    min_seq: int
    max_seq: int
    oldest_created_at: datetime | None
    # The events as a JSON array of entry objects (entityType, entityId, op, seq, payload,
    # createdAt), in delivery order.
    entries_json: bytes

    def entries(self) -> list[dict[str, Any]]:
        """The events as dicts, for sinks that act on single events."""
        entries: list[dict[str, Any]] = orjson.loads(self.entries_json)
        return entries

    @property
    def seq_range(self) -> str:
        """min..max seq, for logs."""
        return f"{self.min_seq}..{self.max_seq}"


class DeliveryError(Exception):
    """A sink could not deliver a batch; the offset stays and the batch is tried again."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        # A hint from the receiver (Retry-After), in seconds.
        self.retry_after = retry_after


class Sink(Protocol):
    """Where a consumer delivers its batches. A sink knows nothing about offsets."""

    name: str

    async def start(self) -> None:
        """Open what the sink needs (HTTP sessions, files)."""

    async def deliver(self, batch: Batch) -> None:
        """Deliver the whole batch, or raise DeliveryError. May be called again with the same
        events (at-least-once), so the far side must apply them idempotently."""

    async def close(self) -> None:
        """Release what start() opened."""
