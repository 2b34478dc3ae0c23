"""Retry delays: exponential with jitter (psycopg_pool's shape), or the receiver's Retry-After."""

from __future__ import annotations

import random

# A receiver's Retry-After is waited for within these bounds: a "0" does not make a busy loop, a
# day of silence is not granted.
RETRY_AFTER_FLOOR_SEC = 0.5
RETRY_AFTER_CEILING_SEC = 3600.0


class Backoff:
    """Exponential backoff from `initial` doubling up to `maximum`, each delay jittered by
    ±`jitter` (a fraction)."""

    def __init__(self, initial: float, maximum: float, *, jitter: float = 0.1) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self.attempts = 0

    def upcoming(self) -> float:
        """The next delay before its jitter, without counting an attempt."""
        return float(min(self.maximum, self.initial * (2 ** min(self.attempts, 62))))

    def next_delay(self) -> float:
        """Record a failure and return how long to wait before the next try."""
        base = self.upcoming()
        self.attempts += 1
        delay: float = base * (1 + random.uniform(-self.jitter, self.jitter))
        return max(0.0, delay)

    def reset(self) -> None:
        """A success: start again from `initial`."""
        self.attempts = 0


def retry_delay(backoff: Backoff, retry_after: float | None) -> float:
    """How long to wait before the next attempt: the receiver's Retry-After when it gave one
    (its word, clamped to RETRY_AFTER_FLOOR_SEC .. RETRY_AFTER_CEILING_SEC, as urllib3 and the
    Google API clients take it), else the backoff's next delay. The attempt is counted either
    way. Which answers may give a Retry-After is the sink's call (sinks/http.py takes it from a
    429 or a 503 only)."""
    delay = backoff.next_delay()
    if retry_after is None:
        return delay
    return min(max(retry_after, RETRY_AFTER_FLOOR_SEC), RETRY_AFTER_CEILING_SEC)
