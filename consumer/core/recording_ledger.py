"""The recording-upload vocabulary shared by its sink and its store: a backend `recordings` row,
and the ledger port through which the sink reads and marks it (the sink never sees SQL)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# recordings.upload_status values (sql/examples/voicebot.sql). A recording whose upload the
# consumer parked in the dead-letter queue is 'failed'; an operator's retry makes it 'pending'
# again while it is tried.
PENDING = "pending"
UPLOADED = "uploaded"
FAILED = "failed"


@dataclass(frozen=True)
class RecordingRow:
    """A row of the backend's `recordings` table, as it is now."""

    id: str
    call_log_id: str
    # mixed.wav relative to $RECORDINGS_DIR (<callId>/mixed.wav), or absolute inside it.
    file_path: str
    upload_status: str
    s3_url: str | None


class RecordingLedger(Protocol):
    """Where the recording-upload consumer reads and records upload state."""

    async def recording(self, recording_id: str) -> RecordingRow | None:
        """The row as it is now, or None if it was deleted."""

    async def mark_uploaded(self, recording_id: str, file_url: str) -> bool:
        """Set upload_status='uploaded' and s3_url; False if the row is gone or was already
        marked (a replay), True if this call marked it."""

    async def mark_failed(self, recording_id: str) -> bool:
        """Set upload_status='failed' on a row still 'pending'; True if this call changed it."""

    async def mark_pending(self, recording_id: str) -> bool:
        """Set upload_status='pending' on a row 'failed'; True if this call changed it."""
