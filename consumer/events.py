"""The shared vocabulary of the outbox: positions and batches of events.

A batch keeps its entries as one JSON array in the wire format of the ingest API, written once,
when a sink first asks for it (each payload is the outbox's own json text), so delivering a
batch costs no further Python object per event. A sink that needs single events parses it
(`Batch.entries()`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
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


class Batch:
    """Consecutive events of the outbox, as read for one consumer.

    The entries are a JSON array of entry objects (entityType, entityId, op, seq, payload,
    createdAt) in delivery order: given as text, or written by `write_entries` the first time a
    sink asks for them, so a sink that never needs the wire form (the null sink, a sink that
    looks at a few entries only) costs nothing per event for it.
    """

    __slots__ = ("_entries_json", "_write_entries", "count", "end", "max_seq", "min_seq")

    def __init__(
        self,
        *,
        count: int,
        end: Position,
        min_seq: int,
        max_seq: int,
        entries_json: bytes | None = None,
        write_entries: Callable[[], bytes] | None = None,
    ) -> None:
        if (entries_json is None) == (write_entries is None):
            raise TypeError("Batch takes either entries_json or write_entries")
        self.count = count
        # Where the consumer stands once this batch is delivered.
        self.end = end
        self.min_seq = min_seq
        self.max_seq = max_seq
        self._entries_json = entries_json
        self._write_entries = write_entries

    @property
    def entries_json(self) -> bytes:
        """The entries as one JSON array (written once, on first use)."""
        if self._entries_json is None:
            assert self._write_entries is not None
            self._entries_json = self._write_entries()
            self._write_entries = None
        return self._entries_json

    def __repr__(self) -> str:
        return f"Batch(count={self.count}, seq={self.seq_range}, end={self.end})"

    def entries(self) -> list[dict[str, Any]]:
        """The events as dicts, for sinks that act on single events."""
        entries: list[dict[str, Any]] = orjson.loads(self.entries_json)
        return entries

    @property
    def seq_range(self) -> str:
        """min..max seq, for logs."""
        return f"{self.min_seq}..{self.max_seq}"

    def raw_entries(self) -> list[bytes]:
        """Each entry's JSON exactly as the outbox gave it (no number is re-encoded)."""
        return json_array_elements(self.entries_json)

    @classmethod
    def of_raw(cls, parts: list[bytes], end: Position) -> Batch:
        """A batch of raw entries (a part of a split batch)."""
        seqs = [int(json.loads(part)["seq"]) for part in parts]
        return cls(
            count=len(parts),
            end=end,
            min_seq=min(seqs),
            max_seq=max(seqs),
            entries_json=b"[" + b",".join(parts) + b"]",
        )

    def split(self) -> tuple[Batch, Batch]:
        """Two halves, in order (for finding the entries a receiver refuses). The entries are
        cut out of the JSON text, not decoded and re-encoded, so payloads stay exact."""
        parts = self.raw_entries()
        middle = len(parts) // 2
        return Batch.of_raw(parts[:middle], self.end), Batch.of_raw(parts[middle:], self.end)


_DECODER = json.JSONDecoder()
_SPACE = re.compile(r"\s*")


def json_array_elements(array_json: bytes) -> list[bytes]:
    """The text of each element of a JSON array, byte for byte."""
    text = array_json.decode()
    index = _SPACE.match(text, 0).end()  # type: ignore[union-attr]
    if text[index : index + 1] != "[":
        raise ValueError("not a JSON array")
    parts: list[bytes] = []
    index = _SPACE.match(text, index + 1).end()  # type: ignore[union-attr]
    if text[index : index + 1] == "]":
        return parts
    while True:
        _, end = _DECODER.raw_decode(text, index)
        parts.append(text[index:end].encode())
        index = _SPACE.match(text, end).end()  # type: ignore[union-attr]
        if text[index : index + 1] == "]":
            return parts
        if text[index : index + 1] != ",":
            raise ValueError(f"malformed JSON array at {index}")
        index = _SPACE.match(text, index + 1).end()  # type: ignore[union-attr]


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

    # The entry's JSON exactly as delivered (see Batch.raw_entries).
    entry_json: bytes
    code: str
    message: str


class Sink(Protocol):
    """Where a consumer delivers its batches. A sink knows nothing about offsets."""

    name: str

    async def start(self) -> None:
        """Open what the sink needs (HTTP sessions, files)."""

    async def deliver(self, batch: Batch) -> str | None:
        """Deliver the whole batch, or raise DeliveryError. May be called again with the same
        events (at-least-once), so the far side must apply them idempotently.

        Returns None (or "success"), or "conflict_processed" when the receiver answered that it
        had processed the batch already (HTTP 409): counted apart in the metrics."""

    async def close(self) -> None:
        """Release what start() opened."""
