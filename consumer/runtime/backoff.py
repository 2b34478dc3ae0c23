"""Retry delays: exponential with jitter and an optional give-up deadline (psycopg_pool's shape)."""

from __future__ import annotations

import random
import time


class Backoff:
    """Exponential backoff from `initial` doubling up to `maximum`, each delay jittered by
    ±`jitter` (a fraction). With `give_up_after` (seconds since the first failure) `expired`
    tells the caller to stop trying."""

    def __init__(
        self,
        initial: float,
        maximum: float,
        *,
        jitter: float = 0.1,
        give_up_after: float | None = None,
    ) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError("backoff needs 0 < initial <= maximum")
        self.initial = initial
        self.maximum = maximum
        self.jitter = jitter
        self.give_up_after = give_up_after
        self.attempts = 0
        self._first_failure: float | None = None

    def next_delay(self) -> float:
        """Record a failure and return how long to wait before the next try."""
        if self._first_failure is None:
            self._first_failure = time.monotonic()
        base = min(self.maximum, self.initial * (2 ** min(self.attempts, 62)))
        self.attempts += 1
        delay: float = base * (1 + random.uniform(-self.jitter, self.jitter))
        return max(0.0, delay)

    @property
    def expired(self) -> bool:
        """Whether the give-up deadline has passed."""
        if self.give_up_after is None or self._first_failure is None:
            return False
        return time.monotonic() - self._first_failure >= self.give_up_after

    def reset(self) -> None:
        """A success: start again from `initial`."""
        self.attempts = 0
        self._first_failure = None
