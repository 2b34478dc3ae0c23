"""The null sink: accepts every batch. For measuring the runtime alone."""

from __future__ import annotations

from consumer.core.events import Batch, Outcome


class NullSink:
    """Accepts every batch and counts what it saw."""

    name = "null"

    def __init__(self) -> None:
        self.events = 0
        self.batches = 0

    async def start(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Nothing to close."""

    async def deliver(self, batch: Batch) -> Outcome:
        """Accept the batch."""
        self.events += batch.count
        self.batches += 1
        return Outcome.DELIVERED
