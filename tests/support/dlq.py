"""The dead-letter queue as the tests read it: one Parked record per row of sync.dlq_messages."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from tests.conftest import fetch_all
from tests.support.backend import CONSUMER


@dataclass(frozen=True)
class Parked:
    """One parked event (a row of sync.dlq_messages)."""

    id: str
    seq: int
    entity_id: str
    # payload.caller_number of a call_logs event (None for other entities).
    caller: str | None
    status: str
    retry_count: int
    last_retry_at: datetime | None
    error_code: str
    error_message: str
    created_at: datetime


async def dead_letters(dsn: str, consumer: str = CONSUMER) -> list[Parked]:
    """Every event the consumer parked, by seq."""
    rows = await fetch_all(
        dsn,
        "SELECT id::text, seq, entity_id, payload->>'caller_number', status, retry_count, "
        "last_retry_at, error_code, error_message, created_at "
        "FROM sync.dlq_messages WHERE consumer = %s ORDER BY seq",
        (consumer,),
    )
    return [Parked(*row) for row in rows]


async def parked_by_caller(dsn: str, consumer: str = CONSUMER) -> dict[str, Parked]:
    """The consumer's parked call_logs events by caller number."""
    return {p.caller: p for p in await dead_letters(dsn, consumer) if p.caller is not None}


async def parked_by_entity(dsn: str, consumer: str = CONSUMER) -> dict[str, Parked]:
    """The consumer's parked events by entity id (a recording's id for recording-upload)."""
    return {p.entity_id: p for p in await dead_letters(dsn, consumer)}


async def all_dead_letters(dsn: str) -> int:
    """How many dead letters there are, of every consumer."""
    rows = await fetch_all(dsn, "SELECT count(*) FROM sync.dlq_messages")
    return int(rows[0][0])
