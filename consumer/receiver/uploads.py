"""The receiver's recording files: POST /api/ingest/recording-file and GET of the stored file.

An upload is authenticated from its headers alone, before any of its body is read: with a shared
secret it carries a manifest (signing.RecordingManifest: the ids, and each file part's size and
SHA-256) signed like a body (upload_manifest.py). Then it takes one of a few upload slots and a
reservation of the store's disk for the sizes it declared, unless another upload of its
recordingId is being received (a captured signed request replayed meanwhile is answered 503,
never received twice); its whole body must arrive within a deadline set by its declared size
(upload_limits.py). Its audio is streamed to a temporary file while its SHA-256 is computed,
each part held to the manifest (a part longer than declared is refused at the first bytes beyond
it) (upload_body.py), fsynced and only then renamed into place, so a reader never sees half a
file and a refused, broken, stalled or abandoned upload leaves nothing behind. Files are named
by recordingId: uploading the same recording again replaces it with identical bytes and answers
the same fileUrl (idempotent).

Nothing below RECORDINGS_STORE_DIR is reached through a symlink, to write or to serve
(recording_disk.py); a kept file is served with Range requests (recording_serving.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence

from aiohttp import web

from consumer.receiver import recording_disk
from consumer.receiver.guards import answer_expectation, content_encoding_refusal
from consumer.receiver.recording_disk import CHUNK_BYTES
from consumer.receiver.recording_serving import recording_file
from consumer.receiver.upload_body import read_parts
from consumer.receiver.upload_limits import (
    FILES_KEY,
    MIN_UPLOAD_BYTES_PER_SEC,
    SECRET_KEY,
    RecordingFiles,
    Upload,
    UploadRefused,
    body_too_large,
    needed_bytes,
)
from consumer.receiver.upload_manifest import as_uuid, authenticated_manifest
from consumer.wire.contract import RECORDING_FILES_PREFIX, RECORDING_UPLOAD_PATH
from consumer.wire.httpjson import error_response, json_response

# What the receiver's application, its process and the tests take from here.
__all__ = [
    "CHUNK_BYTES",
    "FILES_PREFIX",
    "MIN_UPLOAD_BYTES_PER_SEC",
    "UPLOAD_PATH",
    "RecordingFiles",
    "UploadRefused",
    "add_routes",
    "ingest_recording_file",
    "recording_file",
]

log = logging.getLogger("serversync.receiver")

UPLOAD_PATH = RECORDING_UPLOAD_PATH
FILES_PREFIX = RECORDING_FILES_PREFIX


def _keep(files: RecordingFiles, upload: Upload, call_log_id: str, recording_id: str) -> bool:
    """Move the checked upload into place atomically (blocking); True if it is new. A symlink in
    the way is replaced, never written through (rename does not follow one)."""
    assert upload.incoming is not None and upload.audio_part is not None
    assert upload.meta_json is not None
    folder = recording_disk.open_call_folder(files.root, call_log_id)
    if folder is None:
        log.error("the store's folder %s is a symlink or not a folder; not followed", call_log_id)
        raise UploadRefused(
            500,
            "INGEST_INTERNAL_ERROR",
            f"the store's folder for call {call_log_id} is a symlink or not a folder; "
            "nothing was kept",
        )
    try:
        created = recording_disk.move_into_place(
            upload.incoming, upload.audio_part, upload.meta_json, folder, recording_id
        )
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
    return body_too_large(request, files)


async def _expect_upload(request: web.Request) -> web.StreamResponse | None:
    """The answer to `Expect: 100-continue`: the refusal when the headers alone refuse the
    upload (the client then never sends the body), else 100 Continue (aiohttp's own answer
    would invite every body before any header is looked at)."""
    files = request.app[FILES_KEY]
    secrets = request.app.get(SECRET_KEY, ())
    refused = _body_refusal(request, files)
    if refused is None:
        try:
            authenticated_manifest(request, files, secrets)
        except UploadRefused as refusal:
            refused = refusal.response()
    if refused is not None:
        return refused
    return await answer_expectation(request)


async def ingest_recording_file(request: web.Request) -> web.Response:
    """Keep one recording (see the module docstring); answer where it is served."""
    files = request.app[FILES_KEY]
    secrets = request.app.get(SECRET_KEY, ())
    refused = _body_refusal(request, files)
    if refused is not None:
        return refused
    upload = Upload(signed=bool(secrets))
    try:
        # Nothing of the body is read before the upload is authenticated and admitted.
        manifest = upload.manifest = authenticated_manifest(request, files, secrets)
        recording = None if manifest is None else as_uuid(manifest.recording_id, "recordingId")
        await files.admit(upload, needed_bytes(request, files, manifest), recording)
        await read_parts(request, files, upload)
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


def add_routes(app: web.Application, files: RecordingFiles, secrets: Sequence[str]) -> None:
    """Mount the recording routes on the receiver's application (`secrets`: those accepted;
    none: unsigned uploads are taken)."""
    app[FILES_KEY] = files
    if secrets:
        app[SECRET_KEY] = tuple(secrets)
    app.router.add_post(UPLOAD_PATH, ingest_recording_file, expect_handler=_expect_upload)
    app.router.add_get(FILES_PREFIX + r"/{call_log_id}/{recording_id:[^/]+}.wav", recording_file)
