"""The dead-letter queue's rows (sync.dlq_messages): list, inspect, claim for retry, settle, delete.

Events land here through OutboxStore.commit_offset (query park_entries); this module is what an
operator does with them afterwards. Statuses move PENDING -> RETRYING (a claim) ->
RESOLVED (delivered) or back to PENDING with the new error, or DEAD once every retry is used.
"""

from __future__ import annotations

import contextlib
import enum
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import psycopg
from psycopg.rows import class_row
from psycopg.types.string import TextBinaryLoader, TextLoader
from psycopg_pool import AsyncConnectionPool

from consumer.core.events import JSON_TEXT, Batch, DeadLetter, Position, json_members
from consumer.observability.redact import safe_error
from consumer.store.queries import query
from consumer.wire.entries import encode_entries

MAX_PAGE_SIZE = 100
DEFAULT_PAGE_SIZE = 20
# OFFSET is a bigint; a page number past this is a typo, not a request.
MAX_PAGE = 1_000_000_000
# Error messages are kept whole enough to diagnose, small enough to list.
MAX_ERROR_CHARS = 2000
# Error codes are short names (HTTP_422, NETWORK_ERROR); anything longer is not one.
MAX_CODE_CHARS = 100


class DlqStatus(enum.StrEnum):
    """Where a parked event stands. DEAD means every operator retry was used, not "parked"."""

    PENDING = "PENDING"
    RETRYING = "RETRYING"
    RESOLVED = "RESOLVED"
    DEAD = "DEAD"


TERMINAL = frozenset({DlqStatus.RESOLVED, DlqStatus.DEAD})


class DlqError(Exception):
    """A dead-letter operation cannot be carried out; the message says why, in one line."""


class DlqNotFoundError(DlqError):
    """No message with that id."""


class DlqValidationError(DlqError):
    """A malformed argument: an id that is no uuid, a page out of range, an unknown status."""


class DlqConflictError(DlqError):
    """The message's state forbids the operation (retrying a RESOLVED or DEAD message)."""


@dataclass(frozen=True)
class DlqMessage:
    """One parked event (a row of sync.dlq_messages; field names are its columns)."""

    id: uuid.UUID
    # The consumer that parked it (the admin API also names it original_topic, the word
    # dead-letter tools such as Kafka Connect use for where a message came from).
    consumer: str
    seq: int
    entity_type: str
    entity_id: str
    op: str
    # The payload's JSON text as parked (the outbox's own text; the queries read payload::text).
    # Never decoded here: a number too wide for a 64-bit integer or a double stays as written.
    payload: str
    event_created_at: datetime | None
    error_code: str
    error_message: str
    retry_count: int
    max_retries: int
    status: str
    created_at: datetime
    updated_at: datetime
    last_retry_at: datetime | None
    # The origin the event was delivered with (the node where its change was first made; this
    # node's name for a change made here once the node is named); None when it had none.
    origin: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of the admin API and `dlq ... --json`: one message with its delivery
        state, plus the event's own fields. The payload is embedded as its stored JSON text."""
        return {
            "id": str(self.id),
            "consumer": self.consumer,
            "original_topic": self.consumer,
            "seq": self.seq,
            "entity_type": self.entity_type,
            "entity_id": self.entity_id,
            "op": self.op,
            "payload": orjson.Fragment(self.payload),
            "event_created_at": _iso(self.event_created_at),
            "error_code": self.error_code,
            "error_message": self.error_message,
            "retry_count": self.retry_count,
            "max_retries": self.max_retries,
            "status": self.status,
            "created_at": _iso(self.created_at),
            "updated_at": _iso(self.updated_at),
            "last_retry_at": _iso(self.last_retry_at),
            "origin": self.origin,
        }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


@dataclass(frozen=True)
class ClaimedMessage:
    """A message claimed for a retry, and its event as a one-entry batch to deliver."""

    message: DlqMessage
    batch: Batch


@dataclass(frozen=True)
class DlqPage:
    """One page of a consumer's messages and how many match in all."""

    messages: list[DlqMessage]
    total_count: int
    page: int
    page_size: int

    @property
    def has_next(self) -> bool:
        """Whether a later page holds more messages."""
        return self.page * self.page_size < self.total_count

    def to_dict(self) -> dict[str, Any]:
        """The page as the admin API and `dlq list --json` show it."""
        return {
            "messages": [m.to_dict() for m in self.messages],
            "pagination": {
                "total_count": self.total_count,
                "page": self.page,
                "page_size": self.page_size,
                "has_next": self.has_next,
            },
        }


def park_parameters(parked: Sequence[DeadLetter]) -> dict[str, list[Any]]:
    """The columns of query park_entries, one array each, from the entries as delivered.

    Each payload goes in as the entry's own JSON text, whatever it holds; error codes and
    messages are cleaned (secrets masked, one line, no NUL, control character or lone surrogate:
    a text column refuses a NUL, and a surrogate cannot be encoded)."""
    columns: dict[str, list[Any]] = {
        "seqs": [],
        "entity_types": [],
        "entity_ids": [],
        "ops": [],
        "payloads": [],
        "created_ats": [],
        "codes": [],
        "messages": [],
        "origins": [],
    }
    for letter in parked:
        entry = json_members(letter.entry_json.decode())
        columns["seqs"].append(int(JSON_TEXT.decode(entry["seq"])))
        columns["entity_types"].append(JSON_TEXT.decode(entry["entityType"]))
        columns["entity_ids"].append(JSON_TEXT.decode(entry["entityId"]))
        columns["ops"].append(JSON_TEXT.decode(entry["op"]))
        columns["payloads"].append(entry["payload"])
        columns["created_ats"].append(JSON_TEXT.decode(entry.get("createdAt", "null")))
        columns["codes"].append(safe_error(letter.code)[:MAX_CODE_CHARS])
        columns["messages"].append(safe_error(letter.message)[:MAX_ERROR_CHARS])
        columns["origins"].append(JSON_TEXT.decode(entry.get("origin", "null")))
    return columns


def parse_id(value: str) -> uuid.UUID:
    """A message id from user input, or DlqValidationError."""
    try:
        return uuid.UUID(value.strip())
    except ValueError:
        raise DlqValidationError(f"not a message id (a uuid): {value[:80]!r}") from None


def parse_status(value: str | None) -> DlqStatus | None:
    """A status filter from user input (any case), or DlqValidationError."""
    if value is None or value == "":
        return None
    try:
        return DlqStatus(value.strip().upper())
    except ValueError:
        known = ", ".join(s.value for s in DlqStatus)
        raise DlqValidationError(f"unknown status {value[:40]!r} (known: {known})") from None


def check_page(page: int, page_size: int) -> None:
    """Raise DlqValidationError unless 1 <= page <= MAX_PAGE and 1 <= page_size <= 100."""
    if not 1 <= page <= MAX_PAGE:
        raise DlqValidationError(f"page must be between 1 and {MAX_PAGE}, not {page}")
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise DlqValidationError(
            f"page_size must be between 1 and {MAX_PAGE_SIZE}, not {page_size}"
        )


ConnectionSource = Callable[[], AbstractAsyncContextManager[psycopg.AsyncConnection[Any]]]


class DlqStore:
    """The dead-letter queue's statements, over autocommit connections from `connections`."""

    def __init__(self, connections: ConnectionSource) -> None:
        self._connection = connections

    @classmethod
    def over_pool(cls, pool: AsyncConnectionPool[Any]) -> DlqStore:
        """A store borrowing connections from a pool (a consumer process's admin API)."""
        return cls(pool.connection)

    @classmethod
    def over_connection(cls, conn: psycopg.AsyncConnection[Any]) -> DlqStore:
        """A store on one autocommit connection (a CLI command: one statement at a time)."""

        @contextlib.asynccontextmanager
        async def borrow() -> AsyncIterator[psycopg.AsyncConnection[Any]]:
            yield conn

        return cls(borrow)

    async def list_messages(
        self,
        consumer: str,
        *,
        status: DlqStatus | None = None,
        page: int = 1,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> DlqPage:
        """A page of the consumer's messages, newest first, optionally of one status."""
        check_page(page, page_size)
        params = {
            "consumer": consumer,
            "status": status.value if status else None,
            "limit": page_size,
            "offset": (page - 1) * page_size,
        }
        async with self._connection() as conn:
            row = await (await conn.execute(query("dlq_count"), params)).fetchone()
            total = int(row[0]) if row else 0
            async with _message_cursor(conn) as cur:
                await cur.execute(query("dlq_list"), params)
                messages = await cur.fetchall()
        return DlqPage(messages, total, page, page_size)

    async def get(self, message_id: uuid.UUID) -> DlqMessage:
        """One message, or DlqNotFoundError."""
        async with self._connection() as conn:
            found = await self._fetch(conn, message_id)
        if found is None:
            raise DlqNotFoundError(f"no dead letter with id {message_id}")
        return found

    async def claim(
        self, message_id: uuid.UUID, *, local_node: str | None = None
    ) -> ClaimedMessage:
        """Mark the message RETRYING, count the retry and stamp last_retry_at; with the event to
        deliver, in the wire format exactly as stored.

        The entry keeps the origin it was parked with; one parked without an origin takes this
        node's name, `local_node` or else read from the database (as read_batch's entries do).

        DlqNotFoundError for an unknown id; DlqConflictError for a RESOLVED or DEAD message, or
        one whose retries are used up (max_retries 0 parks events that may not be retried).
        """
        async with self._connection() as conn, conn.transaction():
            row = await (await conn.execute(query("dlq_lock"), {"id": message_id})).fetchone()
            if row is None:
                raise DlqNotFoundError(f"no dead letter with id {message_id}")
            status, retry_count, max_retries = row
            if status in TERMINAL:
                raise DlqConflictError(
                    f"dead letter {message_id} is {status}; only PENDING or RETRYING messages "
                    "can be retried"
                )
            if retry_count >= max_retries:
                raise DlqConflictError(
                    f"dead letter {message_id} has used all {max_retries} of its retries"
                )
            claimed = await self._one(conn, "dlq_claim", {"id": message_id})
            # The row is locked: it cannot have gone.
            assert claimed is not None
            if claimed.origin is None and local_node is None:
                row = await (await conn.execute("SELECT sync.node_name()")).fetchone()
                local_node = row[0] if row else None
        entry = (
            claimed.seq,
            claimed.op,
            claimed.entity_type,
            claimed.entity_id,
            claimed.payload,
            claimed.event_created_at,
            claimed.origin,
            # A dead letter keeps no snapshot id: retried, it goes without the "snapshot" member
            # (its op, a sweep's included, as it was).
            None,
        )
        batch = Batch(
            count=1,
            # Where a consumer would stand after it: irrelevant, retries move no offset.
            end=Position.start(),
            min_seq=claimed.seq,
            max_seq=claimed.seq,
            entries_json=encode_entries([entry], local_node=local_node),
        )
        return ClaimedMessage(claimed, batch)

    async def mark_resolved(self, message_id: uuid.UUID) -> DlqMessage:
        """RESOLVED: the event reached the receiver (DlqNotFoundError if deleted meanwhile)."""
        async with self._connection() as conn:
            resolved = await self._one(conn, "dlq_resolve", {"id": message_id})
        if resolved is None:
            raise DlqNotFoundError(f"dead letter {message_id} was deleted while being retried")
        return resolved

    async def mark_failed(self, message_id: uuid.UUID, code: str, message: str) -> DlqMessage:
        """Back to PENDING with the new error, or DEAD once retry_count reaches max_retries.

        `code` and `message` are cleaned here too (whatever the caller did): nothing unmasked, no
        control character and no lone surrogate may reach the table. A message that a concurrent
        retry settled meanwhile is left as it is and returned; DlqNotFoundError if it was
        deleted.
        """
        params = {
            "id": message_id,
            "code": safe_error(code)[:MAX_CODE_CHARS],
            "message": safe_error(message)[:MAX_ERROR_CHARS],
        }
        async with self._connection() as conn:
            failed = await self._one(conn, "dlq_fail", params)
            if failed is None:
                failed = await self._fetch(conn, message_id)
        if failed is None:
            raise DlqNotFoundError(f"dead letter {message_id} was deleted while being retried")
        return failed

    async def delete(self, message_id: uuid.UUID) -> None:
        """Remove the message for good, or DlqNotFoundError."""
        async with self._connection() as conn:
            cur = await conn.execute(query("dlq_delete"), {"id": message_id})
            gone = await cur.fetchone()
        if gone is None:
            raise DlqNotFoundError(f"no dead letter with id {message_id}")

    async def retryable_ids(
        self, consumer: str, *, after: uuid.UUID | None = None, limit: int = MAX_PAGE_SIZE
    ) -> list[uuid.UUID]:
        """Ids of the consumer's PENDING/RETRYING messages with retries left, in id order,
        after `after` (keyset paging for retry-all)."""
        async with self._connection() as conn:
            cur = await conn.execute(
                query("dlq_retryable_ids"), {"consumer": consumer, "after": after, "limit": limit}
            )
            return [row[0] for row in await cur.fetchall()]

    async def _fetch(
        self, conn: psycopg.AsyncConnection[Any], message_id: uuid.UUID
    ) -> DlqMessage | None:
        return await self._one(conn, "dlq_get", {"id": message_id})

    @staticmethod
    async def _one(
        conn: psycopg.AsyncConnection[Any], name: str, params: dict[str, Any]
    ) -> DlqMessage | None:
        async with _message_cursor(conn) as cur:
            await cur.execute(query(name), params)
            return await cur.fetchone()


def _message_cursor(conn: psycopg.AsyncConnection[Any]) -> psycopg.AsyncCursor[DlqMessage]:
    """A cursor that reads whole sync.dlq_messages rows into DlqMessage, the json payload as its
    text: passed on byte for byte, never decoded (a number too wide for a 64-bit integer or a
    double stays as written)."""
    cur = conn.cursor(row_factory=class_row(DlqMessage))
    cur.adapters.register_loader("json", TextLoader)
    cur.adapters.register_loader("json", TextBinaryLoader)
    return cur
