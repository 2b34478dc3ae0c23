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

    @classmethod
    def of(cls, entries: list[dict[str, Any]], end: Position) -> Batch:
        """A batch made of entry dicts (a part of a split batch, or a dead letter's event)."""
        seqs = [int(entry["seq"]) for entry in entries]
        return cls(
            count=len(entries),
            end=end,
            min_seq=min(seqs),
            max_seq=max(seqs),
            oldest_created_at=None,
            entries_json=orjson.dumps(entries),
        )

    def split(self) -> tuple[Batch, Batch]:
        """Two halves, in order (for finding the entries a receiver refuses)."""
        entries = self.entries()
        middle = len(entries) // 2
        return Batch.of(entries[:middle], self.end), Batch.of(entries[middle:], self.end)

    @property
    def seq_range(self) -> str:
        """min..max seq, for logs."""
        return f"{self.min_seq}..{self.max_seq}"


class DeliveryError(Exception):
    """A sink could not deliver a batch.

    Retryable (network error, timeout, 5xx, 429): the offset stays and the batch is tried again
    with backoff. Not retryable (the receiver refused the content: 400, 401, 403, 404, 413,
    422): the runtime splits the batch to find the entries at fault and parks only those.
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool = True,
        code: str = "DELIVERY_FAILED",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        # A short machine-readable reason, stored with a parked event (e.g. HTTP_422).
        self.code = code
        # A hint from the receiver (Retry-After), in seconds.
        self.retry_after = retry_after


@dataclass(frozen=True)
class DeadLetter:
    """An event the consumer gives up on, with why."""

    entry: dict[str, Any]
    code: str
    message: str


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
