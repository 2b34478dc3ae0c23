"""GET (and HEAD) of a kept recording: conditional requests and one Range, as aiohttp's
FileResponse would answer them, but from a file opened without following a symlink
(recording_disk.open_recording) where FileResponse opens a path."""

from __future__ import annotations

import asyncio
import logging
import os

from aiohttp import ETag, web

from consumer.receiver import recording_disk
from consumer.receiver.recording_disk import CHUNK_BYTES
from consumer.receiver.upload_limits import FILES_KEY, UploadRefused
from consumer.receiver.upload_manifest import as_uuid
from consumer.wire.httpjson import error_response

log = logging.getLogger("serversync.receiver")


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
        call_log_id = as_uuid(request.match_info["call_log_id"], "callLogId")
        recording_id = as_uuid(request.match_info["recording_id"], "recordingId")
    except UploadRefused:
        return error_response(404, "RECORDING_NOT_FOUND", "no such recording")
    opened = await asyncio.to_thread(
        recording_disk.open_recording, files.root, call_log_id, recording_id
    )
    if opened is None:
        return error_response(404, "RECORDING_NOT_FOUND", "no such recording")
    fd, found = opened
    try:
        return await _send_file(request, fd, found)
    finally:
        os.close(fd)
