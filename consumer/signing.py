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
    digest = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return _SCHEME + digest.hexdigest()


def sign(secret: str | None, body: bytes, *, now: float | None = None) -> dict[str, str]:
    """Headers that sign `body`; none without a secret."""
    if not secret:
        return {}
    timestamp = str(int(time.time() if now is None else now))
    return {TIMESTAMP_HEADER: timestamp, SIGNATURE_HEADER: signature(secret, timestamp, body)}


def verify(
    secret: str, timestamp: str | None, given: str | None, body: bytes, *, now: float | None = None
) -> str | None:
    """None if the request is authentic, else why not (for the 401 body)."""
    if not timestamp or not given:
        return f"missing {TIMESTAMP_HEADER} or {SIGNATURE_HEADER} header"
    try:
        sent_at = int(timestamp)
    except ValueError:
        return f"{TIMESTAMP_HEADER} is not a unix timestamp"
    current = time.time() if now is None else now
    if abs(current - sent_at) > MAX_SKEW_SEC:
        return f"stale request: signed {int(current - sent_at)}s ago (limit {MAX_SKEW_SEC}s)"
    if not hmac.compare_digest(signature(secret, timestamp, body), given):
        return "signature does not match"
    return None
