"""A recording upload's manifest, checked from the headers alone, before any of the body is read.

With a shared secret an upload carries a manifest (signing.RecordingManifest: the ids, and each
file part's size and SHA-256) signed like a body; the parts that follow are then held to it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from aiohttp import web

from consumer.receiver.upload_limits import MAX_META_BYTES, RecordingFiles, UploadRefused
from consumer.wire import signing
from consumer.wire.contract import MANIFEST_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER
from consumer.wire.signing import RecordingManifest


def as_uuid(value: str, part: str) -> str:
    """`value` as a UUID's canonical text; a 422 refusal naming `part` when it is not one."""
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise UploadRefused(422, "INGEST_VALIDATION_ERROR", f"{part} is not a UUID", part) from None


def authenticated_manifest(
    request: web.Request, files: RecordingFiles, secrets: Sequence[str]
) -> RecordingManifest | None:
    """The upload's manifest, checked from the headers alone: signed with one of `secrets`
    (required then), or given unsigned (optional without a secret); None when none is given
    to a receiver without a secret. Refuses a manifest the receiver would not take whatever
    the body: empty or oversized parts, ids that are not UUIDs."""
    text = request.headers.get(MANIFEST_HEADER)
    timestamp = request.headers.get(TIMESTAMP_HEADER)
    given = request.headers.get(SIGNATURE_HEADER)
    if not secrets:
        malformed = signing.malformed_headers(timestamp, given)
        if malformed is not None:
            raise UploadRefused(401, "INGEST_UNAUTHORIZED", malformed)
    if secrets:
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
    as_uuid(manifest.call_log_id, "callLogId")
    as_uuid(manifest.recording_id, "recordingId")
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
