"""What the consumer loop did so far, and whether its deliveries go through (for /readyz)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from consumer.core.events import Failure, Position


@dataclass
class RuntimeStats:
    """What the loop did so far: for status, metrics and tests."""

    # The epoch of the current (or last) lead; failures are recorded under it.
    epoch: int | None = None
    position: Position | None = None
    delivered_events: int = 0
    delivered_batches: int = 0
    failed_deliveries: int = 0
    retries: int = 0
    parked_events: int = 0
    # Events not for this consumer (another entity type, or from its target node): never sent,
    # passed by the offset.
    skipped_events: int = 0
    notify_wakeups: int = 0
    poll_wakeups: int = 0
    recheck_wakeups: int = 0
    # Waits after a short batch because events arrived fast (read pacing).
    paced_waits: int = 0
    takeovers: int = 0
    # While the loop sleeps: "wakeup" (nothing to read; a NOTIFY or the poll timer ends it),
    # "recheck" (an older open transaction holds the horizon back) or "paced" (events arrive
    # fast and gather for the next read); None while it works.
    sleeping: str | None = None
    # starting, standby (another process leads; the database answers), leader,
    # database_unreachable, stopped: what /readyz reports.
    state: str = "starting"

    # While deliveries keep failing (the offset held): since when (wall clock), why, and the
    # last error; cleared by the next offset commit.
    failing_since: float | None = None
    failing_reason: Failure | None = None
    last_error: str | None = None

    @property
    def is_leader(self) -> bool:
        """This process leads its consumer right now."""
        return self.state == "leader"

    def fail(self, failure: Failure, error: str) -> float:
        """A delivery failed and will be tried again; since when deliveries fail."""
        if self.failing_since is None:
            self.failing_since = time.time()
        self.failing_reason, self.last_error = failure, error
        return self.failing_since

    def recover(self) -> None:
        """An offset commit: deliveries go through again."""
        self.failing_since = self.failing_reason = self.last_error = None

    def count_wakeup(self, reason: str) -> None:
        """The loop woke for `reason`: notify, poll, recheck or paced."""
        if reason == "notify":
            self.notify_wakeups += 1
        elif reason == "poll":
            self.poll_wakeups += 1
        elif reason == "recheck":
            self.recheck_wakeups += 1
        elif reason == "paced":
            self.paced_waits += 1


def delivery_health(stats: RuntimeStats) -> dict[str, Any]:
    """Whether deliveries go through, for /readyz: {"state": "ok"}, "not_leading", or
    "delivery_failing" with the reason, for how long and the last error."""
    if not stats.is_leader:
        return {"state": "not_leading"}
    if stats.failing_since is not None and stats.failing_reason is not None:
        return {
            "state": "delivery_failing",
            "reason": stats.failing_reason.value,
            "failing_seconds": round(time.time() - stats.failing_since, 3),
            "last_error": stats.last_error,
        }
    return {"state": "ok"}
