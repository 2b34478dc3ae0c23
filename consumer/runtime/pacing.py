"""Read pacing: under steady heavy traffic, let events gather between reads.

A consumer that keeps up reads as soon as it has settled a batch. Under steady traffic that
means many small batches, and every batch costs a read, a delivery and an offset commit whatever
its size: under steady load from 8 producers it settled ~100 batches a second of ~150 events
and cost them ~20 % of their throughput on a shared server (bench/, producer cost).
Kafka's consumer (fetch.max.wait.ms) and Debezium (poll.interval.ms) wait between fetches for the
same reason. Waiting costs latency, so the wait applies only while events arrive faster than a
rate: below it, every event is read the moment it can be.
"""

from __future__ import annotations

import collections
import time


class ReadPacer:
    """Decides how long to wait before the next read after a short (caught-up) batch.

    The arrival rate is the number of events read in the last `window` seconds over `window`;
    the window spans several waits (at least 100 ms), so one burst does not start pacing and
    the batches that pacing itself makes bigger do not keep it going once traffic slows.
    """

    def __init__(self, wait: float, min_rate: float) -> None:
        if wait < 0 or min_rate < 0:
            raise ValueError("read pacing needs wait >= 0 and min_rate >= 0")
        self.wait = wait
        self.min_rate = min_rate
        self.window = max(0.1, 5 * wait)
        self._reads: collections.deque[tuple[float, int]] = collections.deque()
        self._events_in_window = 0

    def observe(self, events: int, now: float | None = None) -> None:
        """Record a read that returned `events` events."""
        if self.wait <= 0 or events <= 0:
            return
        now = time.monotonic() if now is None else now
        self._reads.append((now, events))
        self._events_in_window += events
        self._expire(now)

    def rate(self, now: float | None = None) -> float:
        """Events per second read over the last window."""
        self._expire(time.monotonic() if now is None else now)
        return self._events_in_window / self.window

    def pause(self, now: float | None = None) -> float:
        """Seconds to wait before reading again: `wait` while the rate is at or above
        `min_rate`, else 0."""
        if self.wait <= 0:
            return 0.0
        return self.wait if self.rate(now) >= self.min_rate else 0.0

    def _expire(self, now: float) -> None:
        while self._reads and self._reads[0][0] <= now - self.window:
            self._events_in_window -= self._reads.popleft()[1]
