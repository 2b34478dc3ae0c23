"""The pipeline of one lead: read, deliver, commit, in order; wait when there is nothing to read.

While a backlog drains, the next batch is read while earlier ones are delivered (read-ahead),
and up to `max_in_flight` batches are delivered at once; their offsets are committed strictly in
order, so the stored position never passes an unsettled batch. A short batch ends the read-ahead:
everything in flight is settled before reading again, and that read goes out together with the
last offset commit. While events arrive fast, the loop instead waits `batch_wait` before that
read, so that they gather into fewer, bigger batches (ReadPacer). When reads come back empty,
the waiting flag (consumer/runtime/waiting.py) asks for a NOTIFY; while committed events wait
behind an older open transaction, the loop re-reads soon instead.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from opentelemetry import trace

from consumer.core.events import Batch, Outcome, Position
from consumer.observability import instruments
from consumer.runtime.backoff import Backoff
from consumer.runtime.config import RuntimeConfig
from consumer.runtime.pacing import ReadPacer
from consumer.runtime.settle import Settled, Settler
from consumer.runtime.stats import RuntimeStats
from consumer.runtime.steps import LeadershipLostError, Steps
from consumer.runtime.waiting import WaitingFlag, count_wakeup, wait_for_work
from consumer.runtime.wakeup import NotifyListener
from consumer.store.outbox import FencedError, OutboxStore, ReadResult

log = logging.getLogger("serversync.runtime")

# The first re-check after a read found committed events held back behind an older open
# transaction: most such transactions are a producer's or an application's single statement and
# end within a few milliseconds. Later re-checks double up to SYNC_RECHECK_INTERVAL_MS, so a
# long transaction costs a handful of reads, not one per millisecond.
FIRST_RECHECK_SEC = 0.001
# Re-checks this soon are made without lingering or announcing a wait first: events are known
# to be ready within milliseconds, and asking producers for NOTIFYs for so short a wait would
# cost them more than it could bring. Longer waits go through the waiting flag as any other.
QUIET_RECHECK_SEC = 0.008


@dataclass
class _InFlight:
    """A batch being settled in its own task; committed in read order by the loop."""

    batch: Batch
    span: trace.Span
    started: float
    task: asyncio.Task[Settled | None]


class Pipeline:
    """Drains the outbox for one lead (one epoch) until a stop or a lost lead."""

    def __init__(
        self,
        consumer: str,
        epoch: int,
        *,
        store: OutboxStore,
        settler: Settler,
        listener: NotifyListener | None,
        config: RuntimeConfig,
        stats: RuntimeStats,
        steps: Steps,
        local_node: str | None = None,
    ) -> None:
        self.consumer = consumer
        self.epoch = epoch
        self.store = store
        # Every read names the consumer (a snapshot's rows for another one are passed over) and
        # the node, the origin of changes made here; an unnamed node's reads take the store's
        # default (no origin).
        self._read_options: dict[str, str] = {"consumer": consumer}
        if local_node:
            self._read_options["local_node"] = local_node
        self.settler = settler
        self.config = config
        self.stats = stats
        self.steps = steps
        self.waiting = WaitingFlag(consumer, store, steps, listener, linger=config.linger)
        # Without a listener nothing sets it: the loop wakes on its timers alone.
        self.wakeup = listener.event if listener is not None else asyncio.Event()
        self._recheck = Backoff(
            min(FIRST_RECHECK_SEC, config.recheck_interval), config.recheck_interval, jitter=0
        )
        self._labels = {"consumer": consumer}

    async def drain(self, position: Position) -> None:
        """Read, deliver, commit from `position` on; when reads come back empty, wait."""
        limit = self.config.batch_size
        window = max(1, self.config.max_in_flight)
        await self.waiting.start()
        pacer = ReadPacer(self.config.batch_wait, self.config.batch_wait_min_rate)
        prefetch: asyncio.Task[ReadResult] | None = None
        in_flight: collections.deque[_InFlight] = collections.deque()
        try:
            while not self.steps.stop_event.is_set():
                self.steps.raise_if_lost()
                self.waiting.resync()
                result = await self._next_read(prefetch, position, limit)
                prefetch = None
                if not result.held_back:
                    self._recheck.reset()
                batch = result.batch
                if batch is None:
                    if in_flight:
                        # A read-ahead found nothing new: settle what is out, then look again.
                        if not await self._finish_all(in_flight):
                            return
                    elif (
                        result.held_back and self._recheck.upcoming() <= QUIET_RECHECK_SEC
                    ) or not await self.waiting.read_again():
                        await self._sleep(result)
                    continue
                pacer.observe(batch.count)
                in_flight.append(self._start_delivery(batch))
                await self.waiting.found_events()
                position = batch.end
                if result.full and self.config.read_ahead:
                    prefetch = asyncio.create_task(self._read(position, limit))
                    while len(in_flight) >= window:
                        if not await self._finish(in_flight.popleft()):
                            return
                elif pause := pacer.pause():
                    if not await self._finish_all(in_flight):
                        return
                    await self._paced_wait(pause)
                else:

                    def read_next(after: Position = position) -> None:
                        # The next read goes out with the last offset commit, not after it:
                        # it needs only the batch's end, and an event that arrived meanwhile
                        # is a round trip sooner at the receiver.
                        nonlocal prefetch
                        self.wakeup.clear()
                        prefetch = asyncio.create_task(self._read(after, limit))

                    ahead = read_next if self.config.read_ahead else None
                    if not await self._finish_all(in_flight, before_last_commit=ahead):
                        return
            # Stopping: the batches still out had the same grace as the one just settled
            # (Settler._deliver_once); commit those that were answered, so they are not sent
            # again.
            await self._finish_all(in_flight)
        finally:
            if prefetch is not None:
                prefetch.cancel()
                with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                    await prefetch
            await self._abandon(in_flight)
            await self.waiting.stop()

    async def _next_read(
        self, prefetch: asyncio.Task[ReadResult] | None, position: Position, limit: int
    ) -> ReadResult:
        """The prefetched read when there is one, else a fresh read (with database retries)."""
        if prefetch is not None:
            # A failed read-ahead is read again below, with the retries of a fresh read.
            with contextlib.suppress(psycopg.Error):
                return await prefetch
        # A NOTIFY that arrives from here on must wake the next wait.
        self.wakeup.clear()
        return await self.steps.with_db_retry(
            functools.partial(self._read, position, limit), batch=True
        )

    async def _read(self, position: Position, limit: int) -> ReadResult:
        return await self.store.read_batch(
            position, limit, announced=self.waiting.announced, **self._read_options
        )

    async def _sleep(self, read: ReadResult) -> None:
        """Nothing to read: sleep until a NOTIFY, the poll timer or the re-check timer: soon at
        first, backing off to the re-check interval, while committed events wait behind an older
        open transaction; the re-check interval while transactions merely run (one may have
        written an outbox row before the wait was announced, and its commit sends no NOTIFY)."""
        if read.held_back:
            timeout = self._recheck.next_delay()
        elif read.running:
            timeout = self.config.recheck_interval
        else:
            timeout = self.config.poll_interval
        reason = await wait_for_work(
            self.steps, self.stats, self.wakeup, timeout, held_back=read.held_back or read.running
        )
        count_wakeup(self.consumer, self.stats, reason)

    async def _paced_wait(self, seconds: float) -> None:
        """Let events gather for the next read (everything read so far is committed)."""
        count_wakeup(self.consumer, self.stats, "paced")
        self.stats.sleeping = "paced"
        try:
            await self.steps.sleep_unless_stopped(seconds)
        finally:
            self.stats.sleeping = None

    def _start_delivery(self, batch: Batch) -> _InFlight:
        """Start settling `batch` in a task of its own, inside the batch's span."""
        span = instruments.tracer.start_span(
            f"{self.consumer} deliver batch",
            attributes={
                "serversync.consumer": self.consumer,
                "serversync.batch.count": batch.count,
                "serversync.batch.min_seq": batch.min_seq,
                "serversync.batch.max_seq": batch.max_seq,
            },
        )

        async def settle() -> Settled | None:
            with trace.use_span(span, end_on_exit=False, record_exception=False):
                return await self.settler.settle_read(batch)

        task = asyncio.create_task(settle(), name=f"deliver:{self.consumer}:{batch.seq_range}")
        return _InFlight(batch, span, time.monotonic(), task)

    async def _finish_all(
        self,
        in_flight: collections.deque[_InFlight],
        *,
        before_last_commit: Callable[[], None] | None = None,
    ) -> bool:
        """Settle and commit everything in flight, oldest first; False if stopped first.
        `before_last_commit` runs once the last batch has settled, just before its commit."""
        while in_flight:
            delivery = in_flight.popleft()
            last = before_last_commit if not in_flight else None
            if not await self._finish(delivery, before_commit=last):
                return False
        return True

    async def _finish(
        self, delivery: _InFlight, *, before_commit: Callable[[], None] | None = None
    ) -> bool:
        """Wait for the oldest batch in flight to settle, then commit it (parking what could not
        be delivered). False if stopped before the batch was settled: it is delivered again
        later, and so is everything after it."""
        span = delivery.span
        try:
            with trace.use_span(span, end_on_exit=False):
                settled = await delivery.task
                if settled is None:
                    span.set_attribute("serversync.outcome", Outcome.ABANDONED.value)
                    return False
                if before_commit is not None:
                    before_commit()
                await self._commit(delivery.batch, settled)
                self._report(delivery, settled)
        finally:
            span.end()
        return True

    async def _commit(self, batch: Batch, settled: Settled) -> None:
        """Move the offset past `batch`, parking its refused entries in the same transaction
        (the entries passed over move behind the offset with the rest)."""
        parked = settled.parked
        delivered = batch.count - len(parked) - settled.skipped
        try:
            await self.steps.with_db_retry(
                functools.partial(
                    self.store.commit_offset,
                    self.consumer,
                    self.epoch,
                    batch.end,
                    delivered,
                    parked=parked,
                    max_retries=self.config.dlq_max_retries,
                ),
                batch=True,
            )
        except FencedError as exc:
            raise LeadershipLostError(str(exc)) from exc
        stats = self.stats
        stats.position = batch.end
        if stats.failing_since is not None:
            log.info(
                "consumer %s: delivering again after %.0fs of failures (%s)",
                self.consumer,
                time.time() - stats.failing_since,
                stats.failing_reason,
            )
            stats.recover()
        stats.delivered_events += delivered
        stats.parked_events += len(parked)
        stats.skipped_events += settled.skipped
        if parked:
            self.settler.count_events(len(parked), Outcome.PARKED)
        if settled.skipped:
            self.settler.count_events(settled.skipped, Outcome.SKIPPED)
        stats.delivered_batches += 1

    def _report(self, delivery: _InFlight, settled: Settled) -> None:
        """Span outcome, metrics and the one log line of a committed batch."""
        batch = delivery.batch
        parked = len(settled.parked)
        skipped = settled.skipped
        duration = time.monotonic() - delivery.started
        outcome = settled.outcome.value
        delivery.span.set_attribute("serversync.outcome", outcome)
        instruments.BATCH_SIZE.record(batch.count, self._labels)
        instruments.BATCH_DURATION.record(duration, self._labels)
        # "(N parked)" as ever; the events passed over are named only where there are some.
        passed_over = f", {skipped} skipped" if skipped else ""
        log.info(
            "consumer %s: %s %d events seq %s in %.1f ms (%d parked%s)",
            self.consumer,
            outcome,
            skipped if settled.outcome is Outcome.SKIPPED else batch.count - parked - skipped,
            batch.seq_range,
            duration * 1000,
            parked,
            passed_over,
            extra={
                "consumer": self.consumer,
                "seq_range": batch.seq_range,
                "events": batch.count,
                "parked": parked,
                "skipped": skipped,
                "outcome": outcome,
                "duration_ms": round(duration * 1000, 3),
            },
        )

    async def _abandon(self, in_flight: collections.deque[_InFlight]) -> None:
        """Cancel deliveries that will not be committed (stop, lost lead, error)."""
        for delivery in in_flight:
            delivery.task.cancel()
        try:
            # return_exceptions: the deliveries' own ends (cancelled, failed) are not ours to
            # raise; a cancellation of this task still propagates.
            await asyncio.gather(*(d.task for d in in_flight), return_exceptions=True)
        finally:
            for delivery in in_flight:
                delivery.span.set_attribute("serversync.outcome", Outcome.ABANDONED.value)
                delivery.span.end()
            in_flight.clear()
