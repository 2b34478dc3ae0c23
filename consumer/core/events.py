"""The shared vocabulary of the outbox: positions and batches of events.

A batch keeps its entries as one JSON array in the wire format of the ingest API, written once,
when a sink first asks for it (each payload is the outbox's own json text), so delivering a
batch costs no further Python object per event. A sink that needs single events parses it
(`Batch.entries()`).
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

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


class EntryKey(NamedTuple):
    """What names an entry, as its row held it: a sink that routes each entry by these need
    not decode the entry's JSON to find them."""

    seq: int
    op: str
    entity_type: str
    entity_id: str


class Batch:
    """Consecutive events of the outbox, as read for one consumer.

    The entries are a JSON array of entry objects (entityType, entityId, op, seq, payload,
    createdAt) in delivery order: given as text, or written by `write_entries` the first time a
    sink asks for them, so a sink that never needs the wire form (the null sink, a sink that
    looks at a few entries only) costs nothing per event for it. A batch read from the outbox
    can also write each entry on its own with its key (`write_keyed`), for sinks that send
    entries one by one: cutting them out of the array costs five times as much.
    """

    __slots__ = (
        "_entries_json",
        "_keyed",
        "_write_entries",
        "_write_keyed",
        "count",
        "end",
        "max_seq",
        "min_seq",
    )

    def __init__(
        self,
        *,
        count: int,
        end: Position,
        min_seq: int,
        max_seq: int,
        entries_json: bytes | None = None,
        write_entries: Callable[[], bytes] | None = None,
        write_keyed: Callable[[], list[tuple[EntryKey, bytes]]] | None = None,
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
        # Each entry's JSON, exactly as an element of entries_json, with its key.
        self._keyed: list[tuple[EntryKey, bytes]] | None = None
        self._write_keyed = write_keyed

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
        if self._entries_json is None and (
            self._keyed is not None or self._write_keyed is not None
        ):
            keyed = self.keyed_entries()
            assert keyed is not None
            return [raw for _, raw in keyed]
        return json_array_elements(self.entries_json)

    def keyed_entries(self) -> list[tuple[EntryKey, bytes]] | None:
        """Each entry's JSON (as raw_entries gives it) with its key, written once, on first
        use; None for a batch that was not read from the outbox (a part of a split batch, a
        dead letter's redelivery): its entries say their keys only in their JSON."""
        if self._keyed is None and self._write_keyed is not None:
            self._keyed = self._write_keyed()
            self._write_keyed = None
        return self._keyed

    @classmethod
    def of_raw(cls, parts: list[bytes], end: Position) -> Batch:
        """A batch of raw entries (a part of a split batch)."""
        seqs = [int(json_members(part.decode())["seq"]) for part in parts]
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


# Reads a JSON string or scalar without converting numbers: a number of any size (a 5000-digit
# integer exceeds Python's int conversion limit) passes through as written, and so do what
# PostgreSQL's json functions refuse to take apart ("\u0000", lone surrogates).
JSON_TEXT = json.JSONDecoder(parse_int=str, parse_float=str, parse_constant=str)
_SPACE = re.compile(r"[ \t\n\r]*")
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_SCALAR = re.compile(r'[^ \t\n\r,:\[\]{}"]+')
# Inside a value: strings (skipped whole, whatever brackets they hold) and brackets.
_NESTING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)


def _skip_space(text: str, index: int) -> int:
    return _SPACE.match(text, index).end()  # type: ignore[union-attr]


def json_value_end(text: str, start: int) -> int:
    """Where the JSON value starting at `start` of valid JSON text ends.

    Found by counting brackets outside strings, not by decoding: no nesting depth (PostgreSQL's
    json takes thousands of levels, Python's decoder recurses) and no number stops it."""
    first = text[start : start + 1]
    if first == '"' or first not in ("[", "{"):
        match = (_STRING if first == '"' else _SCALAR).match(text, start)
        if match is None:
            raise ValueError(f"malformed JSON at {start}")
        return match.end()
    depth = 0
    for match in _NESTING.finditer(text, start):
        token = match.group()
        if token[0] == '"':
            continue
        depth += 1 if token in ("[", "{") else -1
        if depth == 0:
            return match.end()
    raise ValueError(f"unterminated JSON value at {start}")


def json_array_elements(array_json: bytes) -> list[bytes]:
    """The text of each element of a JSON array, byte for byte."""
    text = array_json.decode()
    try:
        # Each element's end found by Python's C decoder (JSON_TEXT: no number converted),
        # several times faster than counting brackets in Python.
        return _elements(text, lambda at: JSON_TEXT.raw_decode(text, at)[1])
    except (ValueError, RecursionError):
        # Nesting deeper than Python's decoder recurses, or text it refuses: brackets counted,
        # at any depth, never decoding.
        return _elements(text, lambda at: json_value_end(text, at))


def _elements(text: str, value_end: Callable[[int], int]) -> list[bytes]:
    """The elements of the JSON array `text`, each ending where `value_end(its start)` says."""
    index = _skip_space(text, 0)
    if text[index : index + 1] != "[":
        raise ValueError("not a JSON array")
    parts: list[bytes] = []
    index = _skip_space(text, index + 1)
    if text[index : index + 1] == "]":
        return parts
    while True:
        end = value_end(index)
        parts.append(text[index:end].encode())
        index = _skip_space(text, end)
        if text[index : index + 1] == "]":
            return parts
        if text[index : index + 1] != ",":
            raise ValueError(f"malformed JSON array at {index}")
        index = _skip_space(text, index + 1)


def json_members(object_json: str) -> dict[str, str]:
    """The text of each member's value of a JSON object, by name, exactly as written (the
    values are cut out of the text, never decoded; see json_value_end)."""
    index = _skip_space(object_json, 0)
    if object_json[index : index + 1] != "{":
        raise ValueError("not a JSON object")
    members: dict[str, str] = {}
    index = _skip_space(object_json, index + 1)
    if object_json[index : index + 1] == "}":
        return members
    while True:
        name, index = JSON_TEXT.raw_decode(object_json, index)
        if not isinstance(name, str):
            raise ValueError(f"malformed JSON object at {index}")
        index = _skip_space(object_json, index)
        if object_json[index : index + 1] != ":":
            raise ValueError(f"malformed JSON object at {index}")
        start = _skip_space(object_json, index + 1)
        index = json_value_end(object_json, start)
        members[name] = object_json[start:index]
        index = _skip_space(object_json, index)
        if object_json[index : index + 1] == "}":
            return members
        if object_json[index : index + 1] != ",":
            raise ValueError(f"malformed JSON object at {index}")
        index = _skip_space(object_json, index + 1)


class Failure(enum.StrEnum):
    """Why a delivery failed, and so what the runtime does about it.

    An ordered stream never skips ahead of events it could still deliver: only a refusal of the
    content itself parks events. Trouble that passes, and a destination that is wrong, hold the
    offset and are retried with backoff for as long as they last.
    """

    # Network errors, timeouts, 5xx, 408, 425, 429: the receiver is down or busy.
    UNAVAILABLE = "receiver_unavailable"
    # 401, 403, 404, 405, any 3xx, or a 2xx that is not the receiver's answer: a wrong or
    # rotated secret, a skewed clock, a route the frontend does not serve, a proxy's page.
    WRONG_DESTINATION = "wrong_destination"
    # 400, 413, 415, 422 and the other 4xx: the receiver refuses these events.
    REFUSED = "content_refused"
    # The consumer itself failed on the batch (an error it did not expect).
    INTERNAL = "internal_error"

    @property
    def parks(self) -> bool:
        """Whether events that fail this way are parked (else the offset is held)."""
        return self is Failure.REFUSED


class Outcome(enum.StrEnum):
    """What became of a batch's events: one word per meaning, the same in the sink interface,
    the metrics (serversync_events_total{outcome}), the log lines and the spans.

    Failure says why an attempt failed; Outcome says what happened to the events.
    """

    # The receiver took the events.
    DELIVERED = "delivered"
    # The receiver answered that it had processed them already (HTTP 409): as good as
    # delivered, and counted apart.
    ALREADY_PROCESSED = "already_processed"
    # An attempt failed in a way that passes (see Failure): the offset is held and the same
    # events are sent again.
    RETRIED = "retried"
    # Moved to the dead-letter queue: the receiver refused the content, or SYNC_MAX_ATTEMPTS
    # ran out. The offset moves past them.
    PARKED = "parked"
    # A stop or a lost lead came before the batch was settled: nothing is committed, and the
    # events are sent again by whoever leads next.
    ABANDONED = "abandoned"
    # Not for this consumer: an entity type it does not send, or an event that came from the
    # node it delivers to (no echo). Never sent; the offset moves past them.
    SKIPPED = "skipped"


class DeliveryError(Exception):
    """A sink could not deliver a batch; `failure` says why (see Failure).

    `retryable=False` is shorthand for a refusal of the content (Failure.REFUSED).
    """

    def __init__(
        self,
        message: str,
        *,
        failure: Failure | None = None,
        retryable: bool = True,
        code: str = "DELIVERY_FAILED",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        if failure is None:
            failure = Failure.UNAVAILABLE if retryable else Failure.REFUSED
        self.failure = failure
        # A short machine-readable reason, stored with a parked event (e.g. HTTP_422).
        self.code = code
        # The receiver's own word on when to try again (Retry-After), in seconds.
        self.retry_after = retry_after

    @property
    def retryable(self) -> bool:
        """Whether the same events are tried again (everything but a refusal of content)."""
        return not self.failure.parks


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

    async def deliver(self, batch: Batch) -> Outcome:
        """Deliver the whole batch, or raise DeliveryError. May be called again with the same
        events (at-least-once), so the far side must apply them idempotently.

        Returns Outcome.DELIVERED, or Outcome.ALREADY_PROCESSED when the receiver answered that
        it had processed the batch already (HTTP 409)."""

    async def close(self) -> None:
        """Release what start() opened."""
