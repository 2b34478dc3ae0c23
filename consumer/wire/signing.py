"""Request signatures between serversync and a receiver: HMAC-SHA256 over timestamp + body.

The sender adds two headers; the receiver recomputes the signature with the shared secret and
refuses a request whose signature is missing, wrong, or whose timestamp is more than
MAX_SKEW_SEC away from its own clock (a captured request cannot be replayed later, and a
signature cannot be moved to another body).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

from consumer.wire.contract import MANIFEST_HEADER, SIGNATURE_HEADER, TIMESTAMP_HEADER

# The header names are the wire contract's (contract.py): callers of this module find them here
# too, beside what they name.
__all__ = [
    "MANIFEST_HEADER",
    "MANIFEST_VERSION",
    "MAX_SKEW_SEC",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "RecordingManifest",
    "check_headers",
    "malformed_headers",
    "manifest_headers",
    "parse_manifest",
    "recording_file_message",
    "sign",
    "signature",
    "verify",
]

MAX_SKEW_SEC = 300
_SCHEME = "v1="
# ASCII only: str.isdigit() and \d would also take other scripts' digits.
_TIMESTAMP = re.compile(r"[0-9]{1,12}", re.ASCII)
_SIGNATURE = re.compile(re.escape(_SCHEME) + r"[0-9a-f]{64}", re.ASCII)


def signature(secret: str, timestamp: str, body: bytes) -> str:
    """The signature header value of `body` sent at `timestamp` (unix seconds)."""
    digest = hmac.new(secret.encode(), timestamp.encode() + b".", hashlib.sha256)
    digest.update(body)  # not concatenated: a batch's body is hundreds of kilobytes
    return _SCHEME + digest.hexdigest()


def sign(secret: str | None, body: bytes, *, now: float | None = None) -> dict[str, str]:
    """Headers that sign `body`; none without a secret."""
    if not secret:
        return {}
    timestamp = str(int(time.time() if now is None else now))
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(secret, timestamp, body)}


def check_headers(
    timestamp: str | None, given: str | None, *, now: float | None = None
) -> str | None:
    """None if both headers are there, well-formed and the timestamp is fresh, else why not.
    Lets a receiver refuse an unsigned, malformed or stale request before it reads a large body.

    Well-formed means ASCII: the timestamp decimal digits, the signature "v1=" and 64 lower-case
    hex digits. A header value holding other characters (non-ASCII, or bytes that are not UTF-8)
    is refused here, so that nothing later compares or encodes it."""
    if not timestamp or not given:
        return f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header"
    malformed = malformed_headers(timestamp, given)
    if malformed is not None:
        return malformed
    sent_at = int(timestamp)
    current = time.time() if now is None else now
    if abs(current - sent_at) > MAX_SKEW_SEC:
        return f"stale request: signed {int(current - sent_at)}s ago (limit {MAX_SKEW_SEC}s)"
    return None


def malformed_headers(timestamp: str | None, given: str | None) -> str | None:
    """Why signature headers that are present are malformed, else None (absent is not
    malformed). A receiver without a secret checks no signature, but it still refuses a request
    whose signature headers could not be valid for any secret: such a request is broken."""
    if timestamp is not None and not _TIMESTAMP.fullmatch(timestamp):
        return f"{TIMESTAMP_HEADER} is not a unix timestamp"
    if given is not None and not _SIGNATURE.fullmatch(given):
        return f"{SIGNATURE_HEADER} is not {_SCHEME} and 64 lower-case hex digits"
    return None


def verify(
    secrets: Sequence[str],
    timestamp: str | None,
    given: str | None,
    body: bytes,
    *,
    now: float | None = None,
) -> str | None:
    """None if the request is authentic under any of `secrets`, else why not (for the 401 body).

    More than one secret is accepted while a secret is rotated: the receivers take the new one
    and the old one, the senders switch to the new one, then the old one is dropped."""
    problem = check_headers(timestamp, given, now=now)
    if problem is not None:
        return problem
    assert timestamp is not None and given is not None
    # Every secret is compared, matched or not: the time taken says nothing about which.
    matches = [hmac.compare_digest(signature(secret, timestamp, body), given) for secret in secrets]
    if not any(matches):
        return "signature does not match"
    return None


def recording_file_message(
    call_log_id: str, recording_id: str, audio_sha256: str, meta_sha256: str
) -> bytes:
    """What a recording upload's signature covers.

    A multipart upload is streamed and may be large, so it is not signed byte for byte: the
    signature covers the ids and the SHA-256 of each file part, and the receiver recomputes the
    digests from what it actually received before it keeps anything.
    """
    return "\n".join(
        ("recording-file", call_log_id, recording_id, audio_sha256, meta_sha256)
    ).encode()


# -- recording uploads: a signed manifest, checked before the body is read ----------------------

MANIFEST_VERSION = "recording-file/1"
_MANIFEST = re.compile(
    r"recording-file/1"
    r" callLogId=(?P<call_log_id>[0-9A-Za-z{}:-]{1,64})"
    r" recordingId=(?P<recording_id>[0-9A-Za-z{}:-]{1,64})"
    r" audio=(?P<audio_size>0|[1-9][0-9]{0,17}):(?P<audio_sha256>[0-9a-f]{64})"
    r" meta=(?P<meta_size>0|[1-9][0-9]{0,17}):(?P<meta_sha256>[0-9a-f]{64})",
    re.ASCII,
)


@dataclass(frozen=True)
class RecordingManifest:
    """What a recording upload will send: its ids and each file part's size and SHA-256.

    Sent as the X-Serversync-Manifest header and signed like a body (the timestamp and signature
    headers cover the header's text), so that a receiver authenticates an upload from its headers
    alone, before it reads any of the body, and then holds the streamed parts to it.
    """

    call_log_id: str
    recording_id: str
    audio_size: int
    audio_sha256: str
    meta_size: int
    meta_sha256: str

    def text(self) -> str:
        """The header's value (ASCII, one line)."""
        return (
            f"{MANIFEST_VERSION} callLogId={self.call_log_id} recordingId={self.recording_id}"
            f" audio={self.audio_size}:{self.audio_sha256} meta={self.meta_size}:{self.meta_sha256}"
        )


def parse_manifest(text: str) -> RecordingManifest:
    """The manifest an X-Serversync-Manifest header holds; ValueError when it is not one (the
    exact form RecordingManifest.text writes, nothing more, nothing less)."""
    match = _MANIFEST.fullmatch(text)
    if match is None:
        raise ValueError(
            f"{MANIFEST_HEADER} is not '{MANIFEST_VERSION} callLogId=<id> recordingId=<id> "
            "audio=<size>:<sha256> meta=<size>:<sha256>'"
        )
    return RecordingManifest(
        call_log_id=match["call_log_id"],
        recording_id=match["recording_id"],
        audio_size=int(match["audio_size"]),
        audio_sha256=match["audio_sha256"],
        meta_size=int(match["meta_size"]),
        meta_sha256=match["meta_sha256"],
    )


def manifest_headers(
    secret: str | None, manifest: RecordingManifest, *, now: float | None = None
) -> dict[str, str]:
    """The manifest header, and the headers that sign its text (none without a secret)."""
    text = manifest.text()
    return {MANIFEST_HEADER: text, **sign(secret, text.encode(), now=now)}
