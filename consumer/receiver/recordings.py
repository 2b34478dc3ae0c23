"""The receiver's recording files: POST /api/ingest/recording-file and GET of the stored file.

An upload is streamed to a temporary file while its SHA-256 is computed, checked (the ids, the
parts, the sizes, the signature over the digests), fsynced and only then renamed into place, so
a reader never sees half a file and a failed upload leaves nothing behind. Files are named by
recordingId: uploading the same recording again replaces it with identical bytes and answers the
same fileUrl (idempotent).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from consumer import signing
from consumer.httpjson import error_response, json_response

log = logging.getLogger("serversync.receiver")

UPLOAD_PATH = "/api/ingest/recording-file"
FILES_PREFIX = "/storage/recordings"
MAX_ID_BYTES = 64
MAX_META_BYTES = 1024 * 1024
CHUNK_BYTES = 256 * 1024
# A temp file in .incoming this old belongs to no upload in progress.
STALE_PART_SEC = 3600
AUDIO_TYPES = frozenset({"application/octet-stream", "audio/wav", "audio/x-wav", "audio/wave"})
PARTS = ("callLogId", "recordingId", "audio", "meta")


class UploadRefused(Exception):
    """An upload the receiver will not keep: answered with `status` and a JSON error body."""

    def __init__(self, status: int, code: str, message: str, part: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.part = part

    def response(self) -> web.Response:
        """The JSON error answer."""
        extra = {"field": self.part} if self.part else {}
        return error_response(self.status, self.code, str(self), **extra)


@dataclass
class _Upload:
    """What has arrived so far of one multipart upload."""

    ids: dict[str, str] = field(default_factory=dict)
    # The id parts exactly as sent: what the signature covers.
    sent: dict[str, str] = field(default_factory=dict)
    audio_tmp: Path | None = None
    audio_size: int = 0
    audio_sha256: str = ""
    meta_json: bytes | None = None
    seen: set[str] = field(default_factory=set)


class RecordingFiles:
    """RECORDINGS_STORE_DIR: <callLogId>/<recordingId>.wav and <recordingId>.meta.json."""

    def __init__(self, root: Path, *, max_bytes: int, public_base_url: str | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.public_base_url = public_base_url.rstrip("/") if public_base_url else None
        # Uploads stream here first: the same filesystem as their final place, so the last
        # step is an atomic rename.
        self.incoming = root / ".incoming"

    def prepare(self) -> None:
        """Create the directories, and remove what uploads cut off by a crash left in
        .incoming (blocking; at start). Only old leftovers: another receiver sharing the store
        may be writing the young ones right now."""
        self.incoming.mkdir(parents=True, exist_ok=True)
        cutoff = time.time() - STALE_PART_SEC
        for leftover in self.incoming.glob("*.part"):
            with contextlib.suppress(FileNotFoundError):
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
                    log.info("removed %s, left by an upload cut off by a crash", leftover)

    def audio_path(self, call_log_id: str, recording_id: str) -> Path:
        """Where a recording's audio is kept."""
        return self.root / call_log_id / f"{recording_id}.wav"

    def file_url(self, request: web.Request, call_log_id: str, recording_id: str) -> str:
        """The URL the recording is served at."""
        base = self.public_base_url or f"{request.scheme}://{request.host}"
        return f"{base}{FILES_PREFIX}/{call_log_id}/{recording_id}.wav"


FILES_KEY = web.AppKey("recording_files", RecordingFiles)
SECRET_KEY = web.AppKey("recording_secret", str)


def _uuid(value: str, part: str) -> str:
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", f"{part} is not a UUID", part) from None


def _check_complete(part: BodyPartReader, name: str) -> None:
    # A part read up to the end of the body, not up to a boundary: the body was cut short.
    if not part.at_eof():
        raise UploadRefused(400, "INGEST_BAD_MULTIPART", f"the body ends inside part {name}", name)


async def _read_small(part: BodyPartReader, limit: int, name: str) -> bytes:
    data = bytearray()
    while chunk := await part.read_chunk(CHUNK_BYTES):
        data += chunk
        if len(data) > limit:
            raise UploadRefused(413, "INGEST_TOO_LARGE", f"part {name} is over {limit} bytes", name)
    _check_complete(part, name)
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
    handle, name = await asyncio.to_thread(
        tempfile.mkstemp, prefix="audio-", suffix=".part", dir=files.incoming
    )
    upload.audio_tmp = Path(name)
    digest = hashlib.sha256()
    size = 0
    with os.fdopen(handle, "wb") as out:
        while chunk := await part.read_chunk(CHUNK_BYTES):
            size += len(chunk)
            if size > files.max_bytes:
                raise UploadRefused(
                    413,
                    "INGEST_TOO_LARGE",
                    f"audio is over the limit of {files.max_bytes} bytes",
                    "audio",
                )
            digest.update(chunk)
            await asyncio.to_thread(_write_all, out, chunk)
        _check_complete(part, "audio")
        await asyncio.to_thread(out.flush)
        await asyncio.to_thread(os.fsync, out.fileno())
    upload.audio_size = size
    upload.audio_sha256 = digest.hexdigest()


async def _read_parts(request: web.Request, files: RecordingFiles, upload: _Upload) -> None:
    if request.content_type != "multipart/form-data":
        raise UploadRefused(
            415, "INGEST_UNSUPPORTED_MEDIA_TYPE", "Content-Type must be multipart/form-data"
        )
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
    while (part := await reader.next()) is not None:
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
        if name == "audio":
            await _stream_audio(part, files, upload)
        elif name == "meta":
            meta = await _read_small(part, MAX_META_BYTES, name)
            try:
                orjson.loads(meta)
            except orjson.JSONDecodeError as exc:
                raise UploadRefused(
                    422, "INGEST_VALIDATION_ERROR", f"meta is not JSON: {exc}", name
                ) from None
            upload.meta_json = meta
        else:
            raw = await _read_small(part, MAX_ID_BYTES, name)
            upload.sent[name] = raw.decode("utf-8", "replace")
            upload.ids[name] = _uuid(upload.sent[name].strip(), name)


def _keep(files: RecordingFiles, upload: _Upload, call_log_id: str, recording_id: str) -> bool:
    """Move the checked upload into place atomically (blocking); True if it is new."""
    assert upload.audio_tmp is not None and upload.meta_json is not None
    folder = files.root / call_log_id
    folder.mkdir(exist_ok=True)
    audio = files.audio_path(call_log_id, recording_id)
    created = not audio.exists()
    handle, meta_tmp = tempfile.mkstemp(prefix="meta-", suffix=".part", dir=files.incoming)
    with os.fdopen(handle, "wb") as out:
        out.write(upload.meta_json)
        out.flush()
        os.fsync(out.fileno())
    # meta first: once the audio is in place, everything about the recording is.
    os.replace(meta_tmp, folder / f"{recording_id}.meta.json")
    os.replace(upload.audio_tmp, audio)
    upload.audio_tmp = None
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return created


async def ingest_recording_file(request: web.Request) -> web.Response:
    """Keep one recording (see the module docstring); answer where it is served."""
    files = request.app[FILES_KEY]
    secret = request.app.get(SECRET_KEY)
    declared = request.content_length
    if declared is not None and declared > files.max_bytes + MAX_META_BYTES + 64 * 1024:
        return UploadRefused(
            413, "INGEST_TOO_LARGE", f"upload is over the limit of {files.max_bytes} bytes"
        ).response()
    if secret:
        # Refuse a stale or unsigned request before reading a possibly large body.
        early = signing.check_headers(
            request.headers.get(signing.TIMESTAMP_HEADER),
            request.headers.get(signing.SIGNATURE_HEADER),
        )
        if early is not None:
            return error_response(401, "INGEST_UNAUTHORIZED", early)
    upload = _Upload()
    try:
        await _read_parts(request, files, upload)
        call_log_id, recording_id = upload.ids["callLogId"], upload.ids["recordingId"]
        meta_json = upload.meta_json or b""
        if secret:
            problem = signing.verify(
                secret,
                request.headers.get(signing.TIMESTAMP_HEADER),
                request.headers.get(signing.SIGNATURE_HEADER),
                signing.recording_file_message(
                    upload.sent["callLogId"],
                    upload.sent["recordingId"],
                    upload.audio_sha256,
                    hashlib.sha256(meta_json).hexdigest(),
                ),
            )
            if problem is not None:
                log.warning("refused recording upload %s: %s", recording_id, problem)
                return error_response(401, "INGEST_UNAUTHORIZED", problem)
        created = await asyncio.to_thread(_keep, files, upload, call_log_id, recording_id)
    except UploadRefused as refused:
        log.info("refused recording upload: %s", refused)
        return refused.response()
    except ConnectionResetError:
        # The client went away mid-upload (nothing is kept): not an error of the receiver's.
        log.info("recording upload abandoned: the client disconnected")
        return error_response(400, "INGEST_BAD_MULTIPART", "the client disconnected mid-upload")
    finally:
        if upload.audio_tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                await asyncio.to_thread(upload.audio_tmp.unlink)
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


async def recording_file(request: web.Request) -> web.StreamResponse:
    """GET (and HEAD) a kept recording; Range requests are answered (206) so players can seek."""
    files = request.app[FILES_KEY]
    try:
        call_log_id = _uuid(request.match_info["call_log_id"], "callLogId")
        recording_id = _uuid(request.match_info["recording_id"], "recordingId")
    except UploadRefused:
        return error_response(404, "RECORDING_NOT_FOUND", "no such recording")
    path = files.audio_path(call_log_id, recording_id)
    if not await asyncio.to_thread(path.is_file):
        return error_response(404, "RECORDING_NOT_FOUND", "no such recording")
    return web.FileResponse(path, headers={"Content-Type": "audio/wav"})


def add_routes(app: web.Application, files: RecordingFiles, secret: str | None) -> None:
    """Mount the recording routes on the receiver's application."""
    app[FILES_KEY] = files
    if secret:
        app[SECRET_KEY] = secret
    app.router.add_post(UPLOAD_PATH, ingest_recording_file)
    app.router.add_get(FILES_PREFIX + r"/{call_log_id}/{recording_id:[^/]+}.wav", recording_file)
