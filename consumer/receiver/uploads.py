"""The receiver's recording files: POST /api/ingest/recording-file and GET of the stored file.

An upload is authenticated from its headers alone, before any of its body is read: with a shared
secret it carries a manifest (signing.RecordingManifest: the ids, and each file part's size and
SHA-256) signed like a body. Then it takes one of a few upload slots and a reservation of the
store's disk for the sizes it declared, unless another upload of its recordingId is being received
(a captured signed request replayed meanwhile is answered 503, never received twice); its whole
body must arrive within a deadline set by its declared size. Its audio is streamed to a temporary
file while its SHA-256 is computed, each part held to the manifest (a part longer than declared
is refused at the first bytes beyond it), fsynced and only then renamed into place, so a reader
never sees half a file and a refused, broken, stalled or abandoned upload leaves nothing behind.
Files are named by recordingId: uploading the same recording again replaces it with identical
bytes and answers the same fileUrl (idempotent).

Nothing below RECORDINGS_STORE_DIR is reached through a symlink, to write or to serve: every
folder and file under it is opened without following one (O_NOFOLLOW), relative to the open
folder above it (dir_fd), as the consumer does with RECORDINGS_DIR (sinks/local_recordings.py).
The store directory itself may be a symlink: that is the operator's choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import logging
import os
import stat
import time
import uuid
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import IO, TypeVar

import orjson
from aiohttp import BodyPartReader, ETag, HttpVersion11, web
from aiohttp.http_exceptions import HttpProcessingError

from consumer.receiver.guards import content_encoding_refusal
from consumer.wire import signing
from consumer.wire.httpjson import error_response, json_response
from consumer.wire.signing import MANIFEST_HEADER, RecordingManifest

log = logging.getLogger("serversync.receiver")

UPLOAD_PATH = "/api/ingest/recording-file"
FILES_PREFIX = "/storage/recordings"
MAX_ID_BYTES = 64
MAX_META_BYTES = 1024 * 1024
CHUNK_BYTES = 256 * 1024
# What a multipart body holds besides its parts' bytes: boundaries and part headers.
FRAMING_BYTES = 64 * 1024
INCOMING = ".incoming"
# A temp file in .incoming this old belongs to no upload in progress.
STALE_PART_SEC = 3600
AUDIO_TYPES = frozenset({"application/octet-stream", "audio/wav", "audio/x-wav", "audio/wave"})
PARTS = ("callLogId", "recordingId", "audio", "meta")
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
# A folder below the store, opened without following a symlink.
_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NOFOLLOW_FOLDER = _FOLDER | os.O_NOFOLLOW
# A file or folder that is not there, or not what it must be (a symlink: ELOOP; a symlink or a
# file where a folder must be: ENOTDIR).
_NOT_THERE = frozenset({errno.ENOENT, errno.ELOOP, errno.ENOTDIR})
T = TypeVar("T")


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
            response.headers["Retry-After"] = str(self.retry_after)
        return response


@dataclass
class _Upload:
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
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.audio_part, dir_fd=self.incoming)
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
        # Uploads stream here first: the same filesystem as their final place, so the last
        # step is an atomic rename.
        self.incoming = root / INCOMING
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
        self.root.mkdir(parents=True, exist_ok=True)
        root = self.open_root()
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(INCOMING, dir_fd=root)
            incoming = _open_folder(INCOMING, root)
        finally:
            os.close(root)
        if incoming is None:
            raise NotADirectoryError(
                errno.ENOTDIR, f"{self.incoming} is a symlink or not a folder; it is not followed"
            )
        try:
            cutoff = time.time() - STALE_PART_SEC
            for name in os.listdir(incoming):
                if not name.endswith(".part"):
                    continue
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(name, dir_fd=incoming, follow_symlinks=False).st_mtime < cutoff:
                        os.unlink(name, dir_fd=incoming)
                        log.info("removed %s, left by an upload cut off by a crash", name)
        finally:
            os.close(incoming)

    def open_root(self) -> int:
        """The store directory, open (blocking; following a symlink only here)."""
        return os.open(self.root, _FOLDER)

    def file_url(self, request: web.Request, call_log_id: str, recording_id: str) -> str:
        """The URL the recording is served at."""
        base = self.public_base_url or f"{request.scheme}://{request.host}"
        return f"{base}{FILES_PREFIX}/{call_log_id}/{recording_id}.wav"

    def free_bytes(self) -> int:
        """Bytes free for this user on the store's filesystem (blocking)."""
        found = os.statvfs(self.root)
        return found.f_bavail * found.f_frsize

    def claim(self, upload: _Upload, recording_id: str) -> None:
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

    async def admit(self, upload: _Upload, needed: int, recording_id: str | None = None) -> None:
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

    def wrote(self, upload: _Upload, count: int) -> None:
        """`count` bytes of the upload are on disk now: no longer reserved, the disk's free space
        says them."""
        done = min(count, upload.reserved)
        upload.reserved -= done
        self.reserved_bytes -= done

    def release(self, upload: _Upload) -> None:
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


def _open_folder(name: str, parent: int) -> int | None:
    """A folder of an open folder, opened without following a symlink (blocking); None when it
    is not there, or is a symlink or a file."""
    try:
        return os.open(name, _NOFOLLOW_FOLDER, dir_fd=parent)
    except OSError as exc:
        if exc.errno in _NOT_THERE:
            return None
        raise


def _create_part(incoming: int, prefix: str) -> tuple[int, str]:
    """A new temporary file in .incoming, open for writing (blocking): its descriptor and name.
    Never an existing file or a symlink (O_EXCL)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        name = f"{prefix}{token_hex(8)}.part"
        with contextlib.suppress(FileExistsError):
            return os.open(name, flags, 0o600, dir_fd=incoming), name


def _uuid(value: str, part: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", f"{part} is not a UUID", part) from None


# -- before the body: from the headers alone ----------------------------------------------------


def _authenticated_manifest(
    request: web.Request, files: RecordingFiles, secrets: Sequence[str]
) -> RecordingManifest | None:
    """The upload's manifest, checked from the headers alone: signed with one of `secrets`
    (required then), or given unsigned (optional without a secret); None when none is given
    to a receiver without a secret. Refuses a manifest the receiver would not take whatever
    the body: empty or oversized parts, ids that are not UUIDs."""
    text = request.headers.get(MANIFEST_HEADER)
    if not secrets:
        malformed = signing.malformed_headers(
            request.headers.get(signing.TIMESTAMP_HEADER),
            request.headers.get(signing.SIGNATURE_HEADER),
        )
        if malformed is not None:
            raise UploadRefused(401, "INGEST_UNAUTHORIZED", malformed)
    if secrets:
        timestamp = request.headers.get(signing.TIMESTAMP_HEADER)
        given = request.headers.get(signing.SIGNATURE_HEADER)
        problem = signing.check_headers(timestamp, given)
        if problem is None and text is None:
            problem = f"missing {MANIFEST_HEADER} header (the signature covers it)"
        if problem is None:
            assert text is not None
            problem = signing.verify(secrets, timestamp, given, text.encode("utf-8", "replace"))
        if problem is not None:
            raise UploadRefused(401, "INGEST_UNAUTHORIZED", problem)
    if text is None:
        return None
    try:
        manifest = signing.parse_manifest(text)
    except ValueError as exc:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", str(exc), MANIFEST_HEADER) from None
    _uuid(manifest.call_log_id, "callLogId")
    _uuid(manifest.recording_id, "recordingId")
    if manifest.audio_size == 0:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", "audio is empty", "audio")
    if manifest.audio_size > files.max_bytes:
        raise UploadRefused(
            413,
            "INGEST_TOO_LARGE",
            f"audio of {manifest.audio_size} bytes is over the limit of {files.max_bytes} bytes",
            "audio",
        )
    if manifest.meta_size == 0:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", "meta is empty, not JSON", "meta")
    if manifest.meta_size > MAX_META_BYTES:
        raise UploadRefused(413, "INGEST_TOO_LARGE", f"meta is over {MAX_META_BYTES} bytes", "meta")
    return manifest


def _needed(request: web.Request, files: RecordingFiles, manifest: RecordingManifest | None) -> int:
    """The bytes of the store's disk an upload may take: what its manifest declares, else its
    Content-Length, else the most an upload may hold."""
    if manifest is not None:
        return manifest.audio_size + manifest.meta_size
    if request.content_length is not None:
        return request.content_length
    return files.max_bytes + MAX_META_BYTES


# -- the body --------------------------------------------------------------------------------------


async def _arriving(read: Awaitable[T], files: RecordingFiles, upload: _Upload) -> T:
    """`read`, unless no more of the body arrives for body_idle_timeout_sec, or the upload's
    deadline passes first: then the upload is abandoned."""
    idle_sec = files.body_idle_timeout_sec
    now = asyncio.get_running_loop().time()
    deadline = upload.deadline
    overall = deadline is not None and deadline - now < idle_sec
    if overall:
        assert deadline is not None
        if deadline <= now:
            _close(read)
            raise upload.overdue(files.min_upload_bytes_per_sec)
    try:
        async with asyncio.timeout_at(deadline) if overall else asyncio.timeout(idle_sec):
            return await read
    except TimeoutError:
        if overall:
            raise upload.overdue(files.min_upload_bytes_per_sec) from None
        raise UploadRefused(
            408,
            "INGEST_BODY_TIMEOUT",
            f"no more of the body arrived for {idle_sec:g} s; the upload is abandoned",
            upload.reading,
        ) from None


def _close(read: Awaitable[object]) -> None:
    """Close a coroutine that will not be awaited (no "never awaited" warning)."""
    close = getattr(read, "close", None)
    if close is not None:
        close()


def _check_complete(part: BodyPartReader, name: str) -> None:
    # A part read up to the end of the body, not up to a boundary: the body was cut short.
    if not part.at_eof():
        raise UploadRefused(400, "INGEST_BAD_MULTIPART", f"the body ends inside part {name}", name)


async def _read_small(
    part: BodyPartReader, files: RecordingFiles, upload: _Upload, limit: int, over: UploadRefused
) -> bytes:
    """A small part, whole; `over` when it goes past `limit` bytes."""
    data = bytearray()
    while chunk := await _arriving(part.read_chunk(CHUNK_BYTES), files, upload):
        data += chunk
        if len(data) > limit:
            raise over
    _check_complete(part, part.name or "")
    return bytes(data)


def _write_all(file: IO[bytes], chunk: bytes) -> None:
    file.write(chunk)


async def _stream_audio(part: BodyPartReader, files: RecordingFiles, upload: _Upload) -> None:
    """Stream the audio part into a temporary file, hashing it on the way."""
    content_type = part.headers.get("Content-Type", "application/octet-stream").split(";")[0]
    if content_type.strip().lower() not in AUDIO_TYPES:
        raise UploadRefused(
            415, "INGEST_UNSUPPORTED_MEDIA_TYPE", "audio must be application/octet-stream", "audio"
        )
    manifest = upload.manifest
    limit = files.max_bytes if manifest is None else manifest.audio_size
    root = await asyncio.to_thread(files.open_root)
    try:
        upload.incoming = await asyncio.to_thread(_open_folder, INCOMING, root)
    finally:
        os.close(root)
    if upload.incoming is None:
        raise UploadRefused(
            500, "INGEST_INTERNAL_ERROR", f"{INCOMING} in the store is a symlink or missing"
        )
    handle, upload.audio_part = await asyncio.to_thread(_create_part, upload.incoming, "audio-")
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(handle, "wb") as out:
        while chunk := await _arriving(part.read_chunk(CHUNK_BYTES), files, upload):
            size += len(chunk)
            if size > limit:
                if manifest is not None:
                    raise upload.mismatch("audio", f"longer than the {limit} bytes declared")
                raise UploadRefused(
                    413, "INGEST_TOO_LARGE", f"audio is over the limit of {limit} bytes", "audio"
                )
            digest.update(chunk)
            await asyncio.to_thread(_write_all, out, chunk)
            files.wrote(upload, len(chunk))
        _check_complete(part, "audio")
        await asyncio.to_thread(out.flush)
        await asyncio.to_thread(os.fsync, out.fileno())
    upload.audio_size = size
    upload.audio_sha256 = digest.hexdigest()
    if manifest is not None:
        if size != manifest.audio_size:
            raise upload.mismatch("audio", f"{size} bytes, not the {manifest.audio_size} declared")
        if upload.audio_sha256 != manifest.audio_sha256:
            raise upload.mismatch("audio", "its SHA-256 is not the one declared")
    elif size == 0:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", "audio is empty", "audio")


async def _read_meta(part: BodyPartReader, files: RecordingFiles, upload: _Upload) -> bytes:
    manifest = upload.manifest
    if manifest is None:
        over = UploadRefused(
            413, "INGEST_TOO_LARGE", f"meta is over {MAX_META_BYTES} bytes", "meta"
        )
        meta = await _read_small(part, files, upload, MAX_META_BYTES, over)
    else:
        declared = manifest.meta_size
        over = upload.mismatch("meta", f"longer than the {declared} bytes declared")
        meta = await _read_small(part, files, upload, declared, over)
        if len(meta) != declared:
            raise upload.mismatch("meta", f"{len(meta)} bytes, not the {declared} declared")
        if hashlib.sha256(meta).hexdigest() != manifest.meta_sha256:
            raise upload.mismatch("meta", "its SHA-256 is not the one declared")
    try:
        orjson.loads(meta)
    except orjson.JSONDecodeError as exc:
        raise UploadRefused(
            422, "INGEST_VALIDATION_ERROR", f"meta is not JSON: {exc}", "meta"
        ) from None
    return meta


async def _read_id(part: BodyPartReader, files: RecordingFiles, upload: _Upload, name: str) -> None:
    over = UploadRefused(413, "INGEST_TOO_LARGE", f"part {name} is over {MAX_ID_BYTES} bytes", name)
    raw = await _read_small(part, files, upload, MAX_ID_BYTES, over)
    sent = upload.sent[name] = raw.decode("utf-8", "replace")
    upload.ids[name] = _uuid(sent.strip(), name)
    manifest = upload.manifest
    if name == "recordingId" and manifest is None:
        # Without a manifest the recordingId is known only now.
        files.claim(upload, upload.ids[name])
    if manifest is not None:
        declared = manifest.call_log_id if name == "callLogId" else manifest.recording_id
        if sent != declared:
            raise upload.mismatch(name, "another id than the one declared")


async def _read_parts(request: web.Request, files: RecordingFiles, upload: _Upload) -> None:
    if request.content_type != "multipart/form-data":
        raise UploadRefused(
            415, "INGEST_UNSUPPORTED_MEDIA_TYPE", "Content-Type must be multipart/form-data"
        )
    files.bodies_read += 1
    try:
        await _read_each_part(request, files, upload)
    except (AssertionError, ValueError, HttpProcessingError) as exc:
        # aiohttp's multipart reader refuses a body without a boundary, with no starting or
        # closing boundary, or with a broken part, this way (not as UploadRefused).
        raise UploadRefused(
            400, "INGEST_BAD_MULTIPART", f"malformed multipart body: {exc}"
        ) from None
    missing = [name for name in PARTS if name not in upload.seen]
    if missing:
        raise UploadRefused(
            422, "INGEST_VALIDATION_ERROR", f"missing part {missing[0]}", missing[0]
        )


async def _read_each_part(request: web.Request, files: RecordingFiles, upload: _Upload) -> None:
    reader = await request.multipart()
    seen = upload.seen
    while True:
        upload.reading = None
        part = await _arriving(reader.next(), files, upload)
        if part is None:
            break
        if not isinstance(part, BodyPartReader):
            raise UploadRefused(400, "INGEST_BAD_MULTIPART", "nested multipart is not accepted")
        name = part.name
        if not name:
            # Not a form-data part; a body cut right after a boundary also ends up here.
            raise UploadRefused(
                400,
                "INGEST_BAD_MULTIPART",
                "a part without a Content-Disposition name, or no closing boundary",
            )
        if name not in PARTS:
            raise UploadRefused(422, "INGEST_VALIDATION_ERROR", f"unexpected part {name!r}", name)
        if name in seen:
            raise UploadRefused(422, "INGEST_VALIDATION_ERROR", f"part {name} given twice", name)
        seen.add(name)
        upload.reading = name
        if name == "audio":
            await _stream_audio(part, files, upload)
        elif name == "meta":
            upload.meta_json = await _read_meta(part, files, upload)
        else:
            await _read_id(part, files, upload, name)


# -- keeping it ------------------------------------------------------------------------------------


def _is_file(name: str, folder: int) -> bool:
    """Whether a regular file (not a symlink) of that name is in the open folder (blocking)."""
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _call_folder(files: RecordingFiles, call_log_id: str) -> int:
    """The call's folder in the store, created if need be and open (blocking); refused when it
    is a symlink or a file."""
    root = files.open_root()
    try:
        with contextlib.suppress(FileExistsError):
            os.mkdir(call_log_id, dir_fd=root)
        folder = _open_folder(call_log_id, root)
    finally:
        os.close(root)
    if folder is None:
        log.error("the store's folder %s is a symlink or not a folder; not followed", call_log_id)
        raise UploadRefused(
            500,
            "INGEST_INTERNAL_ERROR",
            f"the store's folder for call {call_log_id} is a symlink or not a folder; "
            "nothing was kept",
        )
    return folder


def _keep(files: RecordingFiles, upload: _Upload, call_log_id: str, recording_id: str) -> bool:
    """Move the checked upload into place atomically (blocking); True if it is new. A symlink in
    the way is replaced, never written through (rename does not follow one)."""
    assert upload.incoming is not None and upload.audio_part is not None
    assert upload.meta_json is not None
    incoming = upload.incoming
    folder = _call_folder(files, call_log_id)
    try:
        audio, meta = f"{recording_id}.wav", f"{recording_id}.meta.json"
        created = not _is_file(audio, folder)
        handle, meta_part = _create_part(incoming, "meta-")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(upload.meta_json)
                out.flush()
                os.fsync(out.fileno())
            # meta first: once the audio is in place, everything about the recording is.
            os.replace(meta_part, meta, src_dir_fd=incoming, dst_dir_fd=folder)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(meta_part, dir_fd=incoming)
            raise
        os.replace(upload.audio_part, audio, src_dir_fd=incoming, dst_dir_fd=folder)
        upload.audio_part = None
        os.fsync(folder)
    finally:
        os.close(folder)
    return created


def _body_refusal(request: web.Request, files: RecordingFiles) -> web.Response | None:
    """The answer to a body the receiver will not read whatever it holds: compressed, or
    declared larger than any upload it takes."""
    encoded = content_encoding_refusal(request)
    if encoded is not None:
        return encoded
    declared = request.content_length
    if declared is not None and declared > files.max_bytes + MAX_META_BYTES + FRAMING_BYTES:
        return UploadRefused(
            413, "INGEST_TOO_LARGE", f"upload is over the limit of {files.max_bytes} bytes"
        ).response()
    return None


async def _expect_upload(request: web.Request) -> web.StreamResponse | None:
    """The answer to `Expect: 100-continue`: the refusal when the headers alone refuse the
    upload (the client then never sends the body), else 100 Continue (aiohttp's own answer
    would invite every body before any header is looked at)."""
    files = request.app[FILES_KEY]
    secrets = request.app.get(SECRET_KEY, ())
    refused = _body_refusal(request, files)
    if refused is None:
        try:
            _authenticated_manifest(request, files, secrets)
        except UploadRefused as refusal:
            refused = refusal.response()
    if refused is not None:
        return refused
    if request.headers.get("Expect", "").lower() != "100-continue":
        return error_response(
            417, "HTTP_417", "the only expectation accepted is Expect: 100-continue"
        )
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # What follows is the answer itself: aiohttp counts its bytes from here.
        request.writer.output_size = 0
    return None


async def ingest_recording_file(request: web.Request) -> web.Response:
    """Keep one recording (see the module docstring); answer where it is served."""
    files = request.app[FILES_KEY]
    secrets = request.app.get(SECRET_KEY, ())
    refused = _body_refusal(request, files)
    if refused is not None:
        return refused
    upload = _Upload(signed=bool(secrets))
    try:
        # Nothing of the body is read before the upload is authenticated and admitted.
        manifest = upload.manifest = _authenticated_manifest(request, files, secrets)
        recording = None if manifest is None else _uuid(manifest.recording_id, "recordingId")
        await files.admit(upload, _needed(request, files, manifest), recording)
        await _read_parts(request, files, upload)
        call_log_id, recording_id = upload.ids["callLogId"], upload.ids["recordingId"]
        created = await asyncio.to_thread(_keep, files, upload, call_log_id, recording_id)
    except UploadRefused as refusal:
        level = logging.WARNING if refusal.status == 401 else logging.INFO
        log.log(level, "refused recording upload: %s %s", refusal.status, refusal)
        return refusal.response()
    except ConnectionResetError:
        # The client went away mid-upload (nothing is kept): not an error of the receiver's.
        log.info("recording upload abandoned: the client disconnected")
        return error_response(400, "INGEST_BAD_MULTIPART", "the client disconnected mid-upload")
    finally:
        files.release(upload)
        await asyncio.to_thread(upload.discard)
    log.info(
        "kept recording %s of call %s (%d bytes, %s)",
        recording_id,
        call_log_id,
        upload.audio_size,
        "new" if created else "same recording again",
    )
    return json_response(
        {
            "fileUrl": files.file_url(request, call_log_id, recording_id),
            "callLogId": call_log_id,
            "recordingId": recording_id,
            "size": upload.audio_size,
            "sha256": upload.audio_sha256,
            "created": created,
        }
    )


# -- serving it ------------------------------------------------------------------------------------


def _open_recording(
    files: RecordingFiles, call_log_id: str, recording_id: str
) -> tuple[int, os.stat_result] | None:
    """A kept recording's audio, open for reading, and its stat (blocking); None when there is
    none: no such file, or a symlink (the folder or the file), or not a regular file."""
    try:
        root = files.open_root()
    except FileNotFoundError:
        return None
    try:
        folder = _open_folder(call_log_id, root)
    finally:
        os.close(root)
    if folder is None:
        return None
    try:
        # O_NONBLOCK: a FIFO planted there is opened at once (and refused below), not waited on.
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(f"{recording_id}.wav", flags, dir_fd=folder)
    except OSError as exc:
        if exc.errno in _NOT_THERE:
            return None
        raise
    finally:
        os.close(folder)
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        os.close(fd)
        return None
    return fd, found


def _etag_matches(etag: str, given: tuple[ETag, ...], *, weak: bool) -> bool:
    return any(tag.value in ("*", etag) and (weak or not tag.is_weak) for tag in given)


def _range_applies(request: web.Request, etag: str, mtime: float) -> bool:
    """Whether the Range header is to be honoured: If-Range, when given, must name this version
    of the file (its strong ETag, or a date not before its last change)."""
    if_range = request.headers.get("If-Range")
    if if_range is None:
        return True
    if if_range.startswith('"'):
        return if_range == f'"{etag}"'
    when = request.if_range
    return when is not None and mtime <= when.timestamp()


def _answer_of(request: web.Request, etag: str, size: int, mtime: float) -> tuple[int, int, int]:
    """(status, first byte, byte count) of a GET or HEAD of a file of `size` bytes: 200, 206,
    304, 412 or 416 (RFC 9110: preconditions, then conditional GET, then Range)."""
    if_match = request.if_match
    if if_match is not None and not _etag_matches(etag, if_match, weak=False):
        return 412, 0, 0
    since = request.if_unmodified_since
    if if_match is None and since is not None and mtime > since.timestamp():
        return 412, 0, 0
    if_none_match = request.if_none_match
    if if_none_match is not None and _etag_matches(etag, if_none_match, weak=True):
        return 304, 0, 0
    since = request.if_modified_since
    if if_none_match is None and since is not None and mtime <= since.timestamp():
        return 304, 0, 0
    if "Range" not in request.headers or not _range_applies(request, etag, mtime):
        return 200, 0, size
    try:
        wanted = request.http_range  # one range; several, or a malformed one: ValueError
    except ValueError:
        return 416, 0, 0
    start: int = wanted.start
    if start < 0:  # bytes=-N: the last N bytes
        start = max(size + start, 0)
        end = size
    else:
        end = size if wanted.stop is None else min(wanted.stop, size)
    if start >= size:
        return 416, 0, 0
    return 206, start, end - start


async def _send_file(request: web.Request, fd: int, found: os.stat_result) -> web.StreamResponse:
    """Answer a GET or HEAD with the open file: conditional requests and one Range, as
    aiohttp's FileResponse would (which opens a path, following symlinks)."""
    size, mtime = found.st_size, found.st_mtime
    etag = f"{found.st_mtime_ns:x}-{size:x}"
    status, start, count = _answer_of(request, etag, size, mtime)
    response = web.StreamResponse(status=status)
    if status in (412, 416):
        if status == 416:
            response.headers["Content-Range"] = f"bytes */{size}"
        response.content_length = 0
        await response.prepare(request)
        return response
    response.etag = etag
    response.last_modified = mtime
    response.headers["Accept-Ranges"] = "bytes"
    if status == 304:
        await response.prepare(request)
        return response
    response.content_type = "audio/wav"
    response.content_length = count
    if status == 206:
        response.headers["Content-Range"] = f"bytes {start}-{start + count - 1}/{size}"
    await response.prepare(request)
    if request.method == "HEAD":
        return response
    offset, end = start, start + count
    try:
        while offset < end:
            chunk = await asyncio.to_thread(os.pread, fd, min(CHUNK_BYTES, end - offset), offset)
            if not chunk:  # the file was cut short meanwhile
                break
            await response.write(chunk)
            offset += len(chunk)
        await response.write_eof()
    except ConnectionResetError:
        log.debug("the client went away while %s was sent", request.path)
    return response


async def recording_file(request: web.Request) -> web.StreamResponse:
    """GET (and HEAD) a kept recording; Range requests are answered (206) so players can seek."""
    files = request.app[FILES_KEY]
    try:
        call_log_id = _uuid(request.match_info["call_log_id"], "callLogId")
        recording_id = _uuid(request.match_info["recording_id"], "recordingId")
    except UploadRefused:
        return error_response(404, "RECORDING_NOT_FOUND", "no such recording")
    opened = await asyncio.to_thread(_open_recording, files, call_log_id, recording_id)
    if opened is None:
        return error_response(404, "RECORDING_NOT_FOUND", "no such recording")
    fd, found = opened
    try:
        return await _send_file(request, fd, found)
    finally:
        os.close(fd)


def add_routes(app: web.Application, files: RecordingFiles, secrets: Sequence[str]) -> None:
    """Mount the recording routes on the receiver's application (`secrets`: those accepted;
    none: unsigned uploads are taken)."""
    app[FILES_KEY] = files
    if secrets:
        app[SECRET_KEY] = tuple(secrets)
    app.router.add_post(UPLOAD_PATH, ingest_recording_file, expect_handler=_expect_upload)
    app.router.add_get(FILES_PREFIX + r"/{call_log_id}/{recording_id:[^/]+}.wav", recording_file)
