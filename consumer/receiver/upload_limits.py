"""The bounds on recording uploads, and the state of one upload against them.

An upload takes one of a few upload slots and a reservation of the store's disk for the sizes it
declared, unless another upload of its recordingId is being received (a captured signed request
replayed meanwhile is answered 503, never received twice); its whole body must arrive within a
deadline set by its declared size. RecordingFiles holds the store and these bounds; Upload is
what has arrived so far of one upload; UploadRefused is the answer to one the receiver will not
keep.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import hdrs, web

from consumer.receiver import recording_disk
from consumer.wire.contract import RECORDING_FILES_PREFIX
from consumer.wire.httpjson import error_response
from consumer.wire.signing import RecordingManifest

MAX_ID_BYTES = 64
MAX_META_BYTES = 1024 * 1024
# What a multipart body holds besides its parts' bytes: boundaries and part headers.
FRAMING_BYTES = 64 * 1024
# The bounds' defaults (ReceiverSettings: INGEST_MAX_CONCURRENT_UPLOADS,
# INGEST_BODY_IDLE_TIMEOUT_SEC, INGEST_MIN_UPLOAD_BYTES_PER_SEC, INGEST_MIN_FREE_BYTES).
MAX_CONCURRENT_UPLOADS = 4
BODY_IDLE_TIMEOUT_SEC = 30.0
# An upload of N bytes must have arrived whole within BODY_IDLE_TIMEOUT_SEC + N / this rate: a
# body that trickles in (a few bytes now and then, never idle for long) cannot hold a slot for
# days. At most the consumer's own MIN_UPLOAD_RATE (sinks/recording_upload.py), which sets its
# own deadline the same way.
MIN_UPLOAD_BYTES_PER_SEC = 64 * 1024
MIN_FREE_BYTES = 1024 * 1024 * 1024
# Retry-After of a 503 (every upload slot taken: one is free once an upload ends) and of a 507
# (the disk is short: someone has to make room).
BUSY_RETRY_AFTER_SEC = 5
FULL_RETRY_AFTER_SEC = 60


class UploadRefused(Exception):
    """An upload the receiver will not keep: answered with `status` and a JSON error body."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        part: str | None = None,
        *,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.part = part
        self.retry_after = retry_after

    def response(self) -> web.Response:
        """The JSON error answer (with Retry-After when the refusal is for a while only)."""
        extra = {"field": self.part} if self.part else {}
        response = error_response(self.status, self.code, str(self), **extra)
        if self.retry_after is not None:
            response.headers[hdrs.RETRY_AFTER] = str(self.retry_after)
        return response


@dataclass
class Upload:
    """What has arrived so far of one multipart upload."""

    # What the sender declared; required with a secret, optional without.
    manifest: RecordingManifest | None = None
    # Parts that are not what the manifest says are refused as unauthentic (401) when it was
    # signed, as invalid (422) when it was not.
    signed: bool = False
    ids: dict[str, str] = field(default_factory=dict)
    # The id parts exactly as sent: what the manifest names.
    sent: dict[str, str] = field(default_factory=dict)
    # .incoming, open, and the audio's temporary file in it.
    incoming: int | None = None
    audio_part: str | None = None
    audio_size: int = 0
    audio_sha256: str = ""
    meta_json: bytes | None = None
    seen: set[str] = field(default_factory=set)
    # The part being read (named in a refusal when the body stops arriving).
    reading: str | None = None
    # Holds an upload slot; bytes of the store's disk still reserved for it.
    admitted: bool = False
    reserved: int = 0
    # The recordingId it is the one upload of (RecordingFiles.receiving), once claimed.
    claimed: str | None = None
    # The loop time by which the whole body must have arrived, and the seconds that gives it.
    deadline: float | None = None
    allowed_sec: float = 0.0
    needed: int = 0

    def overdue(self, rate: int) -> UploadRefused:
        """The refusal of an upload whose body did not arrive whole by its deadline."""
        return UploadRefused(
            408,
            "INGEST_BODY_TIMEOUT",
            f"the body did not arrive within {self.allowed_sec:g} s, the time given to an upload "
            f"of {self.needed} bytes (at least {rate} bytes/s); the upload is abandoned",
            self.reading,
        )

    def mismatch(self, part: str, what: str) -> UploadRefused:
        """The refusal of a part that is not what the manifest declared."""
        if self.signed:
            return UploadRefused(
                401,
                "INGEST_UNAUTHORIZED",
                f"{part} is not what the signed manifest says: {what}",
                part,
            )
        return UploadRefused(
            422, "INGEST_VALIDATION_ERROR", f"{part} is not what the manifest says: {what}", part
        )

    def discard(self) -> None:
        """Delete the audio's temporary file if it is still there, close .incoming (blocking)."""
        if self.incoming is None:
            return
        try:
            if self.audio_part is not None:
                recording_disk.remove_part(self.incoming, self.audio_part)
                self.audio_part = None
        finally:
            os.close(self.incoming)
            self.incoming = None


class RecordingFiles:
    """RECORDINGS_STORE_DIR: <callLogId>/<recordingId>.wav and <recordingId>.meta.json, and the
    bounds on the uploads streaming into it."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        public_base_url: str | None = None,
        max_concurrent_uploads: int = MAX_CONCURRENT_UPLOADS,
        body_idle_timeout_sec: float = BODY_IDLE_TIMEOUT_SEC,
        min_upload_bytes_per_sec: int = MIN_UPLOAD_BYTES_PER_SEC,
        min_free_bytes: int = MIN_FREE_BYTES,
        busy_retry_after_sec: int = BUSY_RETRY_AFTER_SEC,
        full_retry_after_sec: int = FULL_RETRY_AFTER_SEC,
    ) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.public_base_url = public_base_url.rstrip("/") if public_base_url else None
        # Uploads stream here first (recording_disk.INCOMING).
        self.incoming = root / recording_disk.INCOMING
        self.max_concurrent_uploads = max_concurrent_uploads
        self.body_idle_timeout_sec = body_idle_timeout_sec
        self.min_upload_bytes_per_sec = min_upload_bytes_per_sec
        self.min_free_bytes = min_free_bytes
        self.busy_retry_after_sec = busy_retry_after_sec
        self.full_retry_after_sec = full_retry_after_sec
        # Uploads holding a slot, and the bytes they declared and have not written yet.
        self.uploading = 0
        self.reserved_bytes = 0
        # The recordingIds being received: one upload of each at a time.
        self.receiving: set[str] = set()
        # Uploads whose body the receiver began to read (those refused from their headers
        # alone are not counted).
        self.bodies_read = 0

    def prepare(self) -> None:
        """Create the directories, and remove what uploads cut off by a crash left in
        .incoming (blocking; at start). Only old leftovers: another receiver sharing the store
        may be writing the young ones right now. OSError if .incoming is a symlink or not a
        folder."""
        recording_disk.prepare(self.root)

    def open_root(self) -> int:
        """The store directory, open (blocking; following a symlink only here)."""
        return recording_disk.open_root(self.root)

    def file_url(self, request: web.Request, call_log_id: str, recording_id: str) -> str:
        """The URL the recording is served at."""
        base = self.public_base_url or f"{request.scheme}://{request.host}"
        return f"{base}{RECORDING_FILES_PREFIX}/{call_log_id}/{recording_id}.wav"

    def free_bytes(self) -> int:
        """Bytes free for this user on the store's filesystem (blocking)."""
        return recording_disk.free_bytes(self.root)

    def claim(self, upload: Upload, recording_id: str) -> None:
        """Make the upload the one of `recording_id` being received, or refuse it with 503 (and
        Retry-After: the consumer tries it again) when another upload of it is: a request
        replayed meanwhile, or a retry while the first attempt is still arriving. Not 409, which
        a consumer takes for "already kept"."""
        if recording_id in self.receiving:
            raise UploadRefused(
                503,
                "INGEST_BUSY",
                f"recording {recording_id} is being uploaded already; try again once that "
                "upload ends",
                "recordingId",
                retry_after=self.busy_retry_after_sec,
            )
        self.receiving.add(recording_id)
        upload.claimed = recording_id

    async def admit(self, upload: Upload, needed: int, recording_id: str | None = None) -> None:
        """Give the upload a slot and reserve `needed` bytes of the store's disk for it, or
        refuse it: 503 when every slot is taken or `recording_id` is being received already, 507
        when keeping it (and what the uploads in flight declared) would leave less than
        min_free_bytes free. Its body must then arrive within body_idle_timeout_sec and `needed`
        bytes at min_upload_bytes_per_sec."""
        if recording_id is not None and recording_id in self.receiving:
            self.claim(upload, recording_id)  # refused
        if self.uploading >= self.max_concurrent_uploads:
            raise UploadRefused(
                503,
                "INGEST_BUSY",
                f"{self.uploading} recording uploads in progress, the most taken at once; "
                "try again later",
                retry_after=self.busy_retry_after_sec,
            )
        self.uploading += 1
        upload.admitted = True
        if recording_id is not None:
            self.claim(upload, recording_id)
        upload.needed = needed
        upload.allowed_sec = self.body_idle_timeout_sec + needed / self.min_upload_bytes_per_sec
        upload.deadline = asyncio.get_running_loop().time() + upload.allowed_sec
        free = await asyncio.to_thread(self.free_bytes)
        left = free - self.reserved_bytes - needed
        if left < self.min_free_bytes:
            raise UploadRefused(
                507,
                "INGEST_INSUFFICIENT_STORAGE",
                f"keeping {needed} bytes would leave {max(left, 0)} bytes free on the store's "
                f"disk, under the {self.min_free_bytes} kept free; try again later",
                retry_after=self.full_retry_after_sec,
            )
        self.reserved_bytes += needed
        upload.reserved = needed

    def wrote(self, upload: Upload, count: int) -> None:
        """`count` bytes of the upload are on disk now: no longer reserved, the disk's free space
        says them."""
        done = min(count, upload.reserved)
        upload.reserved -= done
        self.reserved_bytes -= done

    def release(self, upload: Upload) -> None:
        """The upload ended: its slot and what is left of its reservation are free again."""
        if upload.admitted:
            upload.admitted = False
            self.uploading -= 1
        if upload.claimed is not None:
            self.receiving.discard(upload.claimed)
            upload.claimed = None
        self.reserved_bytes -= upload.reserved
        upload.reserved = 0


FILES_KEY = web.AppKey("recording_files", RecordingFiles)
SECRET_KEY = web.AppKey("recording_secrets", tuple[str, ...])


def needed_bytes(
    request: web.Request, files: RecordingFiles, manifest: RecordingManifest | None
) -> int:
    """The bytes of the store's disk an upload may take: what its manifest declares, else its
    Content-Length, else the most an upload may hold."""
    if manifest is not None:
        return manifest.audio_size + manifest.meta_size
    if request.content_length is not None:
        return request.content_length
    return files.max_bytes + MAX_META_BYTES


def body_too_large(request: web.Request, files: RecordingFiles) -> web.Response | None:
    """The 413 answer to a body declared larger than any upload the receiver takes."""
    declared = request.content_length
    if declared is not None and declared > files.max_bytes + MAX_META_BYTES + FRAMING_BYTES:
        return UploadRefused(
            413, "INGEST_TOO_LARGE", f"upload is over the limit of {files.max_bytes} bytes"
        ).response()
    return None
