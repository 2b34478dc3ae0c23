"""The backend's `recordings` rows, for the recording-upload consumer (its RecordingLedger)."""

from __future__ import annotations

import re
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer.core.events import JSON_TEXT, DeliveryError, json_members
from consumer.core.recording_ledger import PENDING, RecordingRow
from consumer.store.queries import query


class RecordingStore:
    """Reads a recording's upload state and marks it (uploaded, failed, pending again), over the
    consumer's pool.

    Database trouble surfaces as a retryable DeliveryError: the batch is tried again later, as
    for any other delivery failure.
    """

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool

    async def table_present(self) -> bool:
        """Whether the backend has a public.recordings table at all."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(query("recordings_table"))
            row = await cur.fetchone()
        return bool(row and row[0])

    async def recording(self, recording_id: str) -> RecordingRow | None:
        """The row as it is now, or None if it was deleted."""
        row = await self._run("recording_get", {"id": recording_id}, recording_id)
        if row is None:
            return None
        rid, call_log_id, file_path, upload_status, s3_url = row
        return RecordingRow(rid, call_log_id, file_path, upload_status, s3_url)

    async def mark_uploaded(self, recording_id: str, file_url: str) -> bool:
        """Mark the row uploaded at `file_url`; False if gone or already marked."""
        marked = await self._run(
            "recording_mark_uploaded", {"id": recording_id, "file_url": file_url}, recording_id
        )
        return marked is not None

    async def mark_failed(self, recording_id: str) -> bool:
        """Mark a row still pending 'failed' (its upload is parked); False if it was not
        pending."""
        marked = await self._run("recording_mark_failed", {"id": recording_id}, recording_id)
        return marked is not None

    async def mark_pending(self, recording_id: str) -> bool:
        """Mark a 'failed' row pending again (an operator retries it); False if it was not
        failed."""
        marked = await self._run("recording_mark_pending", {"id": recording_id}, recording_id)
        return marked is not None

    async def fail_parked(self, consumer: str) -> int:
        """Mark 'failed' the rows still pending whose upload `consumer` parked (a mark lost to a
        crash after the park's commit); how many. Raises psycopg.Error."""
        marked = 0
        async with self._pool.connection() as conn:
            cur = await conn.execute(query("recordings_parked"), {"consumer": consumer})
            for entity_id, payload in await cur.fetchall():
                seen = _pending_as_of(payload)
                if seen is None or not _UUID.fullmatch(entity_id):
                    continue
                changed = await conn.execute(
                    query("recording_fail_parked"), {"id": entity_id, "updated_at": seen}
                )
                marked += changed.rowcount
        return marked

    async def _run(self, name: str, params: dict[str, str], recording_id: str) -> Any:
        """Run a one-row query: its row, or for an UPDATE a truthy value when a row changed."""
        try:
            async with self._pool.connection() as conn:
                cur = await conn.execute(query(name), params)
                if cur.description is None:
                    return True if cur.rowcount else None
                return await cur.fetchone()
        except psycopg.DataError as exc:
            raise DeliveryError(
                f"recording {recording_id!r}: {exc.diag.message_primary or exc}",
                retryable=False,
                code="RECORDING_BAD_ID",
            ) from None
        except psycopg.Error as exc:
            raise DeliveryError(
                f"backend database: {type(exc).__name__}: {str(exc).strip()}",
                code="DATABASE_ERROR",
            ) from None


_UUID = re.compile(r"[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}")


def _pending_as_of(payload: str) -> str | None:
    """The updated_at of a parked recording row that said 'pending', else None."""
    try:
        row = json_members(payload)
        status = JSON_TEXT.decode(row.get("upload_status", "null"))
        updated_at = JSON_TEXT.decode(row.get("updated_at", "null"))
    except ValueError:
        return None
    return updated_at if status == PENDING and isinstance(updated_at, str) else None
