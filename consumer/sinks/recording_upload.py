"""recording-upload: ship each pending call recording to the frontend, then free the disk.

For every `recording` event whose row still says upload_status='pending', in this order:
1. POST the files as multipart to $FRONTEND_BASE_URL/api/ingest/recording-file (streamed from
   disk) and check that the receiver kept exactly these bytes (its answer names their SHA-256);
2. mark the row uploaded with the answered fileUrl (the change flows on through frontend-sync);
3. delete the recording's local files: its audio, and meta.json with the <callId>/ folder once
   no other recording of the call is left in it.
Only then does the runtime move the offset. A crash between any two steps is repaired by doing
the batch again: the receiver is idempotent by recordingId, a row already marked is not uploaded
again, and files already gone are not an error.

A recording the consumer parks in the dead-letter queue is marked 'failed' once the park is
committed (consumer/app/recording_kind.py); the sink that redelivers it for an operator
(for_dead_letters) makes it 'pending' while it is tried, then 'uploaded', or 'failed' again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from consumer.core import failpoints
from consumer.core.events import JSON_TEXT, Batch, DeliveryError, Failure, Outcome, json_members
from consumer.core.recording_ledger import FAILED, PENDING, UPLOADED, RecordingLedger, RecordingRow
from consumer.sinks.http import HttpSink, answer_of, client_span
from consumer.sinks.recording_files import (
    FilesState,
    LocalRecording,
    PreparedUpload,
    RecordingsDir,
    open_regular,
)
from consumer.wire.contract import IDEMPOTENCY_KEY_HEADER, RECORDING_UPLOAD_PATH
from consumer.wire.signing import RecordingManifest, manifest_headers

log = logging.getLogger("serversync.recording_upload")

RECORDING_ENTITY = "recording"
# An upload may take SYNC_TIMEOUT_SEC plus the time to send the file at this rate (bytes/s):
# a 100 MB file is not cut off by a 30 s timeout meant for small requests, and a stalled upload
# still ends.
MIN_UPLOAD_RATE = 1024 * 1024
# How long a refusal by the receiver is remembered for the runtime's narrowing (see _Refusal).
REFUSAL_MEMORY_SEC = 600.0


def wanted_recording(entry_json: bytes) -> str | None:
    """The recording id of an outbox entry that may need an upload (a recording written as
    pending), else None: a delete, and the sweep that ends a snapshot of recordings
    (docs/wire-contract.md, Snapshots), are nothing to upload (a batch of nothing else is
    delivered as it is).

    Read from the entry's text without decoding the payloads of other events: any row of any
    table passes through this consumer, and a number no double holds or a nesting thousands
    deep (both valid in PostgreSQL's json) must not stop the recordings behind it."""
    entry = json_members(entry_json.decode())
    if JSON_TEXT.decode(entry.get("entityType", "null")) != RECORDING_ENTITY:
        return None
    if JSON_TEXT.decode(entry.get("op", "null")) != "upsert":
        return None
    payload = entry.get("payload", "null")
    if not payload.startswith("{"):
        return None
    status = json_members(payload).get("upload_status", "null")
    if not status.startswith('"') or JSON_TEXT.decode(status) != PENDING:
        return None
    recording_id: str = JSON_TEXT.decode(entry["entityId"])
    return recording_id


@dataclass(frozen=True)
class _Refusal:
    """The receiver refused these files (a 4xx such as 413) in a batch of several events: the
    runtime now splits the batch in halves and delivers each again until the refused event
    stands alone, to park just it. Each narrower try answers this refusal instead of sending the
    file again (a 1 GB file refused once must not cross the network once per halving); the
    one-event try at the end answers it one last time and forgets it. Only while the files are
    unchanged and for a while. A refusal in a one-event batch is never remembered: an operator's
    retry from the dead-letter queue is always really tried (the receiver's limit may have been
    raised meanwhile)."""

    files: FilesState
    error: DeliveryError
    at: float


class RecordingUploadSink(HttpSink):
    """Uploads the recordings of a batch, a bounded number at a time."""

    name = "recording-upload"

    def __init__(
        self,
        base_url: str,
        *,
        ledger: RecordingLedger,
        recordings: RecordingsDir,
        timeout_sec: float,
        shared_secret: str | None = None,
        concurrency: int = 4,
        for_dead_letters: bool = False,
    ) -> None:
        super().__init__(timeout_sec)
        self.url = base_url.rstrip("/") + RECORDING_UPLOAD_PATH
        self.ledger = ledger
        self.recordings = recordings
        # This sink delivers the events an operator retries from the dead-letter queue (`dlq
        # retry`, retry-all, the admin API): a 'failed' row, parked, is uploaded too.
        self.for_dead_letters = for_dead_letters
        self._secret = shared_secret
        self._slots = asyncio.Semaphore(concurrency)
        self._refusals: dict[str, _Refusal] = {}

    async def deliver(self, batch: Batch) -> Outcome:
        """Handle every pending recording of the batch; the batch is done when all are.

        Recordings are uploaded concurrently, but the call returns only when each one is done,
        so the offset never passes an event whose recording is still in flight. A refused
        recording is raised first (the runtime then narrows the batch down and parks just it);
        otherwise the first retryable failure is raised and the batch is tried again later.
        A batch without a recording to upload is delivered as it is: nothing of it is due here.
        """
        wanted = (wanted_recording(raw) for raw in batch.raw_entries())
        ids = list(dict.fromkeys(rid for rid in wanted if rid is not None))
        if not ids:
            return Outcome.DELIVERED
        alone = batch.count == 1
        outcomes = await asyncio.gather(
            *(self._handle(rid, alone) for rid in ids), return_exceptions=True
        )
        failures = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        for failure in failures:
            if not isinstance(failure, DeliveryError):
                raise failure
        refused = [f for f in failures if isinstance(f, DeliveryError) and not f.retryable]
        if refused:
            raise refused[0]
        if failures:
            raise failures[0]
        return Outcome.DELIVERED

    async def _handle(self, recording_id: str, alone: bool) -> None:
        async with self._slots:
            row = await self.ledger.recording(recording_id)
            if row is None:
                log.info("recording %s: row deleted; nothing to upload", recording_id)
                return
            if row.upload_status == UPLOADED:
                await self._remove_leftover(row)
                return
            if row.upload_status == FAILED and self.for_dead_letters:
                # An operator retries the parked upload: pending again while it is tried.
                await self.ledger.mark_pending(recording_id)
                row = dataclasses.replace(row, upload_status=PENDING)
            if row.upload_status != PENDING:
                log.info("recording %s: status %s; skipped", recording_id, row.upload_status)
                return
            try:
                await self._ship(row, alone)
            except DeliveryError as exc:
                if not exc.retryable and await self._settled_meanwhile(recording_id):
                    return
                if self.for_dead_letters:
                    await self._mark_failed_again(recording_id)
                raise

    async def _ship(self, row: RecordingRow, alone: bool) -> None:
        """Upload a pending recording, mark it uploaded, delete its local files."""
        recording_id = row.id
        local = self.recordings.locate(row.file_path)
        state = await asyncio.to_thread(local.state)
        refused = self._recall_refusal(recording_id, state, alone)
        if refused is not None:
            raise refused
        prepared = await asyncio.to_thread(self.recordings.prepare, local)
        try:
            file_url = await self._upload(row, local, prepared)
        except DeliveryError as exc:
            if not exc.retryable and not alone and state is not None:
                self._remember_refusal(recording_id, state, exc)
            raise
        failpoints.reach("recording-upload.after-upload")
        await self.ledger.mark_uploaded(recording_id, file_url)
        failpoints.reach("recording-upload.after-mark")
        await self._remove(local, recording_id)
        log.info(
            "recording %s: uploaded %d bytes to %s; local files deleted",
            recording_id,
            prepared.audio_size,
            file_url,
            extra={"recording_id": recording_id, "file_url": file_url},
        )

    async def _settled_meanwhile(self, recording_id: str) -> bool:
        """Whether the row stopped being pending while its upload was refused: another uploader
        of it (an operator's retry beside the running consumer, or the consumer beside a retry)
        uploaded it, and deleted its files, or an operator's retry that failed marked it. Not a
        refusal of this event, then: nothing to park."""
        try:
            row = await self.ledger.recording(recording_id)
        except DeliveryError:
            return False
        if row is not None and row.upload_status == PENDING:
            return False
        status = "deleted" if row is None else row.upload_status
        log.info("recording %s: %s meanwhile by someone else; not parked", recording_id, status)
        return True

    async def _mark_failed_again(self, recording_id: str) -> None:
        """An operator's retry failed: the message is back in the dead-letter queue, and the row
        says so again."""
        try:
            await self.ledger.mark_failed(recording_id)
        except DeliveryError as exc:
            log.warning(
                "recording %s: retry failed, and marking the row failed again failed too: %s",
                recording_id,
                exc,
            )

    def _remember_refusal(self, recording_id: str, state: FilesState, error: DeliveryError) -> None:
        now = time.monotonic()
        self._refusals = {
            rid: r for rid, r in self._refusals.items() if now - r.at < REFUSAL_MEMORY_SEC
        }
        self._refusals[recording_id] = _Refusal(state, error, now)

    def _recall_refusal(
        self, recording_id: str, state: FilesState | None, alone: bool
    ) -> DeliveryError | None:
        """The receiver's refusal of these very files during this narrowing, if there was one
        (see _Refusal); a one-event batch consumes it."""
        refusal = self._refusals.pop(recording_id, None)
        if (
            refusal is None
            or refusal.files != state
            or time.monotonic() - refusal.at >= REFUSAL_MEMORY_SEC
        ):
            return None
        if not alone:
            self._refusals[recording_id] = refusal
        log.info("recording %s: refused by the receiver a moment ago; not sent again", recording_id)
        error = refusal.error
        return DeliveryError(str(error), retryable=False, code=error.code)

    async def _remove_leftover(self, row: RecordingRow) -> None:
        """A row already uploaded: its files may outlive a crash between marking and deleting."""
        try:
            local = self.recordings.locate(row.file_path)
        except DeliveryError as exc:
            # Uploaded, but its path is not one we may touch: leave it, say so, do not park.
            log.warning("recording %s: uploaded; local copy left alone: %s", row.id, exc)
            return
        if await self._remove(local, row.id):
            log.info("recording %s: already uploaded; deleted the files left behind", row.id)

    async def _remove(self, local: LocalRecording, recording_id: str) -> bool:
        try:
            return await asyncio.to_thread(self.recordings.remove, local)
        except OSError as exc:
            raise DeliveryError(
                f"recording {recording_id}: uploaded and marked, but deleting {local.folder} "
                f"failed: {exc.strerror or exc}",
                code="RECORDING_DELETE_FAILED",
            ) from None

    async def _upload(
        self, row: RecordingRow, local: LocalRecording, prepared: PreparedUpload
    ) -> str:
        """POST the recording; the fileUrl the receiver keeps it at.

        The manifest header declares the ids and each file's size and SHA-256, and the signature
        covers it: the receiver authenticates the upload before it reads any of the body, then
        holds the parts to it. A file changed since `prepared` is refused: with a secret as
        unauthentic (401, the offset held and the upload tried again, with a new manifest)."""
        manifest = RecordingManifest(
            call_log_id=row.call_log_id,
            recording_id=row.id,
            audio_size=prepared.audio_size,
            audio_sha256=prepared.audio_sha256,
            meta_size=len(prepared.meta_json),
            meta_sha256=prepared.meta_sha256,
        )
        headers = {
            IDEMPOTENCY_KEY_HEADER: f"{self.name}:{row.id}",
            **manifest_headers(self._secret, manifest),
        }
        timeout = aiohttp.ClientTimeout(total=self._timeout + prepared.audio_size / MIN_UPLOAD_RATE)
        try:
            audio = await asyncio.to_thread(open_regular, local.audio)
        except OSError as exc:
            raise DeliveryError(
                f"cannot read {local.audio}: {exc.strerror or exc}",
                retryable=False,
                code="RECORDING_FILE_UNREADABLE",
            ) from None
        try:
            form = aiohttp.FormData()
            form.add_field("callLogId", row.call_log_id, content_type="text/plain")
            form.add_field("recordingId", row.id, content_type="text/plain")
            # aiohttp streams a file object in 64 KiB reads from a thread: never all in memory.
            form.add_field(
                "audio", audio, filename=local.audio.name, content_type="application/octet-stream"
            )
            form.add_field(
                "meta", prepared.meta_json, filename="meta.json", content_type="application/json"
            )
            with client_span("POST", self.url, headers):
                async with self.post(
                    self.url, data=form, headers=headers, timeout=timeout
                ) as response:
                    answer = await answer_of(response, f"POST {self.url}", has_file_url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DeliveryError(
                f"POST {self.url} failed: {type(exc).__name__}: {exc}", code="NETWORK_ERROR"
            ) from exc
        finally:
            audio.close()
        return self._confirmed_url(answer.body, prepared)

    def _confirmed_url(self, answer: dict[str, Any], prepared: PreparedUpload) -> str:
        """The fileUrl of an answer that confirms the receiver holds exactly our bytes."""
        if not has_file_url(answer):
            # A 409 ("had it already") that does not say where: the local copy stays.
            raise DeliveryError(
                f"POST {self.url} answered without a fileUrl",
                failure=Failure.WRONG_DESTINATION,
                code="BAD_RESPONSE",
            )
        file_url: str = answer["fileUrl"]
        # The contract only promises fileUrl; a receiver that also names what it stored (ours
        # does) must name our bytes, or the local copy is not deleted on its word.
        for field, sent in (("sha256", prepared.audio_sha256), ("size", prepared.audio_size)):
            if field in answer and answer[field] != sent:
                raise DeliveryError(
                    f"POST {self.url} stored a file with {field} {answer[field]!r}, "
                    f"not the {sent!r} sent",
                    code="UPLOAD_UNCONFIRMED",
                )
        return file_url


def has_file_url(answer: dict[str, Any]) -> bool:
    """The receiver's answer to an upload names where it keeps the file (an http(s) URL)."""
    file_url = answer.get("fileUrl")
    return isinstance(file_url, str) and file_url.startswith(("http://", "https://"))
