"""Request signatures between serversync and a receiver: HMAC-SHA256 over timestamp + body.

The sender adds two headers; the receiver recomputes the signature with the shared secret and
refuses a request whose signature is missing, wrong, or whose timestamp is more than
MAX_SKEW_SEC away from its own clock (a captured request cannot be replayed later, and a
signature cannot be moved to another body).
"""

from __future__ import annotations

import hashlib
import hmac
import time

TIMESTAMP_HEADER = "X-Serversync-Timestamp"
SIGNATURE_HEADER = "X-Serversync-Signature"
MAX_SKEW_SEC = 300
_SCHEME = "v1="


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
    """None if both headers are there and the timestamp is fresh, else why not. Lets a receiver
    refuse an unsigned or stale request before it reads a large body."""
    if not timestamp or not given:
        return f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header"
    try:
        sent_at = int(timestamp)
    except ValueError:
        return f"{TIMESTAMP_HEADER} is not a unix timestamp"
    current = time.time() if now is None else now
    if abs(current - sent_at) > MAX_SKEW_SEC:
        return f"stale request: signed {int(current - sent_at)}s ago (limit {MAX_SKEW_SEC}s)"
    return None


def verify(
    secret: str, timestamp: str | None, given: str | None, body: bytes, *, now: float | None = None
) -> str | None:
    """None if the request is authentic, else why not (for the 401 body)."""
    problem = check_headers(timestamp, given, now=now)
    if problem is not None:
        return problem
    assert timestamp is not None and given is not None
    if not hmac.compare_digest(signature(secret, timestamp, body), given):
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
