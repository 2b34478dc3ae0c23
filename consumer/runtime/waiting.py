"""Waiting for work: the waiting flag that asks producers for a NOTIFY, and the sleep it ends.

The relay sends NOTIFY only while a consumer is marked waiting (the wake-up policy of
sql/backend/0001_baseline.sql). After an empty read the consumer first lingers briefly and reads
again; only if that read is empty too does it mark itself waiting, read once more (a commit may
have raced the mark), and sleep. A consumer under steady load therefore never marks itself
waiting and costs producers no NOTIFY at all; an idle one is woken at once. The mark is cleared
as soon as a read finds events again.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools

import psycopg

from consumer.observability import instruments
from consumer.runtime.stats import RuntimeStats
from consumer.runtime.steps import Steps
from consumer.runtime.wakeup import NotifyListener
from consumer.store.outbox import OutboxStore

WAKEUP_REASONS = ("notify", "poll", "recheck", "paced")


class WaitingFlag:
    """The consumer's waiting flag through one lead, and the linger before it is set.

    Without a listener nothing is announced: the consumer relies on its poll timer alone."""

    def __init__(
        self,
        consumer: str,
        store: OutboxStore,
        steps: Steps,
        listener: NotifyListener | None,
        *,
        linger: float,
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.steps = steps
        self.listener = listener
        self.linger = linger
        self._waiting = False
        self._lingered = False
        self._reconnects = listener.reconnects if listener is not None else 0

    @property
    def announced(self) -> bool:
        """Whether producers are told that this consumer waits (the flag is set)."""
        return self._waiting

    async def start(self) -> None:
        """At the start of a lead: a flag left set by an earlier process is cleared."""
        if self.listener is not None:
            await self._set(False)

    def resync(self) -> None:
        """Before every read: after a listener reconnect the server may have restarted and lost
        the unlogged waiting flags, so ours counts as cleared."""
        if self.listener is not None and self.listener.reconnects != self._reconnects:
            self._reconnects, self._waiting = self.listener.reconnects, False

    async def read_again(self) -> bool:
        """After an empty read with nothing in flight: whether to read once more before
        sleeping (after the linger, or after announcing that we wait), else sleep now."""
        if self.listener is None or self._waiting:
            return False
        if not self._lingered:
            self._lingered = True
            await self.steps.sleep_unless_stopped(self.linger)
            return True
        await self._set(True)
        # Read once more: a commit may have raced the announcement.
        return True

    async def found_events(self) -> None:
        """A read found events and their delivery has started: take the announcement back.

        After the delivery has started: the flag only spares producers NOTIFYs, and clearing it
        first would add a round trip to every woken event."""
        self._lingered = False
        if self._waiting:
            await self._set(False)

    async def stop(self) -> None:
        """The lead ends: a stopped consumer waits for nothing. Left set, the flag would make
        every producer transaction send a NOTIFY until the consumer came back. Best effort."""
        if self._waiting:
            with contextlib.suppress(psycopg.Error):
                await self.steps.bounded_by_stop(
                    functools.partial(self.store.set_waiting, self.consumer, False)
                )

    async def _set(self, waiting: bool) -> None:
        await self.steps.with_db_retry(
            functools.partial(self.store.set_waiting, self.consumer, waiting)
        )
        self._waiting = waiting


async def wait_for_work(
    steps: Steps, stats: RuntimeStats, wakeup: asyncio.Event, timeout: float, *, held_back: bool
) -> str:
    """Sleep until a NOTIFY (`wakeup`), a stop, a lost lead or `timeout`; why it ended: notify,
    stop, lost, or (the timer) recheck while the horizon is held back, else poll."""
    stats.sleeping = "recheck" if held_back else "wakeup"
    waiters = {
        asyncio.create_task(wakeup.wait()): "notify",
        asyncio.create_task(steps.stop_event.wait()): "stop",
        asyncio.create_task(steps.lost_event.wait()): "lost",
    }
    try:
        done, _ = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stats.sleeping = None
        for waiter in waiters:
            waiter.cancel()
    if not done:
        return "recheck" if held_back else "poll"
    return waiters[next(iter(done))]


def count_wakeup(consumer: str, stats: RuntimeStats, reason: str) -> None:
    """A wake-up (or a paced wait) in the stats and serversync_wakeups_total."""
    if reason in WAKEUP_REASONS:
        instruments.WAKEUPS.add(1, {"consumer": consumer, "reason": reason})
        stats.count_wakeup(reason)
