"""Reading a recording upload's multipart body: its parts, each held to the manifest, and the
audio streamed to a temporary file while its SHA-256 is computed.

A part longer than declared is refused at the first bytes beyond it; a body that stops arriving
for body_idle_timeout_sec, or has not arrived whole by the upload's deadline, is abandoned.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable
from typing import IO, TypeVar

import orjson
from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError

from consumer.receiver import recording_disk
from consumer.receiver.recording_disk import CHUNK_BYTES, INCOMING
from consumer.receiver.upload_limits import (
    MAX_ID_BYTES,
    MAX_META_BYTES,
    RecordingFiles,
    Upload,
    UploadRefused,
)
from consumer.receiver.upload_manifest import as_uuid
from consumer.wire.contract import RECORDING_UPLOAD_PARTS

AUDIO_TYPES = frozenset({"application/octet-stream", "audio/wav", "audio/x-wav", "audio/wave"})
PARTS = RECORDING_UPLOAD_PARTS
T = TypeVar("T")


async def _arriving(read: Awaitable[T], files: RecordingFiles, upload: Upload) -> T:
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
    part: BodyPartReader, files: RecordingFiles, upload: Upload, limit: int, over: UploadRefused
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


async def _stream_audio(part: BodyPartReader, files: RecordingFiles, upload: Upload) -> None:
    """Stream the audio part into a temporary file, hashing it on the way."""
    content_type = part.headers.get("Content-Type", "application/octet-stream").split(";")[0]
    if content_type.strip().lower() not in AUDIO_TYPES:
        raise UploadRefused(
            415, "INGEST_UNSUPPORTED_MEDIA_TYPE", "audio must be application/octet-stream", "audio"
        )
    manifest = upload.manifest
    limit = files.max_bytes if manifest is None else manifest.audio_size
    upload.incoming = await asyncio.to_thread(recording_disk.open_incoming, files.root)
    if upload.incoming is None:
        raise UploadRefused(
            500, "INGEST_INTERNAL_ERROR", f"{INCOMING} in the store is a symlink or missing"
        )
    handle, upload.audio_part = await asyncio.to_thread(
        recording_disk.create_part, upload.incoming, "audio-"
    )
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


async def _read_meta(part: BodyPartReader, files: RecordingFiles, upload: Upload) -> bytes:
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


async def _read_id(part: BodyPartReader, files: RecordingFiles, upload: Upload, name: str) -> None:
    over = UploadRefused(413, "INGEST_TOO_LARGE", f"part {name} is over {MAX_ID_BYTES} bytes", name)
    raw = await _read_small(part, files, upload, MAX_ID_BYTES, over)
    sent = upload.sent[name] = raw.decode("utf-8", "replace")
    upload.ids[name] = as_uuid(sent.strip(), name)
    manifest = upload.manifest
    if name == "recordingId" and manifest is None:
        # Without a manifest the recordingId is known only now.
        files.claim(upload, upload.ids[name])
    if manifest is not None:
        declared = manifest.call_log_id if name == "callLogId" else manifest.recording_id
        if sent != declared:
            raise upload.mismatch(name, "another id than the one declared")


async def read_parts(request: web.Request, files: RecordingFiles, upload: Upload) -> None:
    """Read the whole multipart body into `upload`: the ids, the meta, and the audio in its
    temporary file; UploadRefused when a part is missing, unexpected, given twice, not what
    the manifest declared, or the body is not multipart or stops arriving."""
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


async def _read_each_part(request: web.Request, files: RecordingFiles, upload: Upload) -> None:
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
