"""Settling a batch: pass over the entries the consumer does not send (filtering.py), deliver the
rest through the sink until they are delivered or their refused events are parked. Retries with
backoff (or after the receiver's Retry-After), bisection to find the events a receiver refuses,
and parking."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import Any

from opentelemetry import trace

from consumer.core.events import Batch, DeadLetter, DeliveryError, Failure, Outcome, Sink
from consumer.observability import instruments
from consumer.observability.redact import safe_error
from consumer.runtime.backoff import Backoff, retry_delay
from consumer.runtime.config import RuntimeConfig
from consumer.runtime.filtering import EntryFilter
from consumer.runtime.stats import RuntimeStats
from consumer.runtime.steps import LeadershipLostError, Steps

log = logging.getLogger("serversync.runtime")


@dataclass(frozen=True)
class Settled:
    """What became of a batch: the entries to park with the offset commit, the one word for the
    batch (PARKED if any entry is parked, ALREADY_PROCESSED if the receiver had all of it
    already, SKIPPED if none of it was for this consumer, else DELIVERED), and how many of its
    events were passed over without being sent."""

    parked: list[DeadLetter]
    outcome: Outcome
    skipped: int = 0

    @classmethod
    def both(cls, first: Settled, second: Settled) -> Settled:
        """The two halves of a split batch, settled, as one."""
        if first.outcome == second.outcome:
            outcome = first.outcome
        elif Outcome.PARKED in (first.outcome, second.outcome):
            outcome = Outcome.PARKED
        else:
            outcome = Outcome.DELIVERED
        return cls(first.parked + second.parked, outcome, first.skipped + second.skipped)


class Settler:
    """Settles the batches of one lead through its sink."""

    def __init__(
        self,
        consumer: str,
        sink: Sink,
        *,
        config: RuntimeConfig,
        stats: RuntimeStats,
        steps: Steps,
        entry_filter: EntryFilter | None = None,
    ) -> None:
        self.consumer = consumer
        self.sink = sink
        self.config = config
        self.stats = stats
        self.steps = steps
        # None: every entry is sent.
        self.entry_filter = entry_filter
        self._labels = {"consumer": consumer}

    async def settle_read(self, batch: Batch) -> Settled | None:
        """Settle a batch as read from the outbox: the entries this consumer does not send are
        passed over (counted SKIPPED when the batch commits), the rest settled by `settle`; a
        batch with nothing to send settles at once, without a request. None if a stop came
        first."""
        if batch.count == 0:
            # Only rows of a snapshot for another consumer: read, to move past them.
            return Settled([], Outcome.SKIPPED, 0)
        if self.entry_filter is None:
            return await self.settle(batch)
        backoff = Backoff(self.config.retry_initial, self.config.retry_max)
        while True:
            self.steps.raise_if_lost()
            try:
                sent, skipped = self.entry_filter.apply(batch)
                break
            except ValueError as exc:
                # Entries the consumer cannot read: held and retried, never skipped.
                log.error("consumer %s: cannot read seq %s", self.consumer, batch.seq_range)
                error = DeliveryError(
                    safe_error(f"cannot read the entries to choose those to send: {exc}"),
                    failure=Failure.INTERNAL,
                    code="INTERNAL_ERROR",
                )
            self._note_failure(error)
            delay = retry_delay(backoff, None)
            await self._retry_later(batch, error, backoff.attempts, delay)
            if not await self.steps.sleep_while_leading(delay):
                return None
        if sent is None:
            return Settled([], Outcome.SKIPPED, skipped)
        settled = await self.settle(sent)
        return replace(settled, skipped=skipped) if settled is not None else None

    async def settle(self, batch: Batch) -> Settled | None:
        """Deliver `batch`; what became of it, or None if a stop came first.

        Only a refusal of the content parks events: a refused batch is split in halves until the
        refused entries are found, so one poison entry never parks its neighbours. Everything
        else (the receiver unavailable, a wrong destination, an error of the consumer's own)
        holds the offset and is tried again with backoff, or after the receiver's Retry-After,
        for as long as it lasts; SYNC_MAX_ATTEMPTS > 0 opts into parking a batch the receiver
        stayed unavailable for.
        """
        backoff = Backoff(self.config.retry_initial, self.config.retry_max)
        while True:
            self.steps.raise_if_lost()
            try:
                outcome = await self._deliver_once(batch)
                if outcome is None:
                    return None
                self.count_events(batch.count, outcome)
                instruments.DELIVERY_ATTEMPTS.record(backoff.attempts + 1, self._labels)
                return Settled([], outcome)
            except DeliveryError as exc:
                error = DeliveryError(
                    safe_error(str(exc)),
                    failure=exc.failure,
                    code=exc.code,
                    retry_after=exc.retry_after,
                )
            except (LeadershipLostError, asyncio.CancelledError):
                raise
            except Exception as exc:
                error = self._unexpected(batch, exc)
            attempts = backoff.attempts + 1
            self._note_failure(error)
            if error.failure.parks:
                try:
                    return await self._park_refused(batch, error, attempts)
                except ValueError as exc:
                    # Entries the consumer cannot cut apart: held and retried, never skipped.
                    log.error("consumer %s: cannot split seq %s", self.consumer, batch.seq_range)
                    error = DeliveryError(
                        safe_error(f"cannot split the batch to find the refused entries: {exc}"),
                        failure=Failure.INTERNAL,
                        code="INTERNAL_ERROR",
                    )
            if self._gives_up(error.failure, attempts):
                instruments.DELIVERY_ATTEMPTS.record(attempts, self._labels)
                log.warning(
                    "consumer %s: giving up on seq %s after %d attempts "
                    "(SYNC_MAX_ATTEMPTS); parking: %s",
                    self.consumer,
                    batch.seq_range,
                    attempts,
                    error,
                )
                parked = [DeadLetter(raw, error.code, str(error)) for raw in batch.raw_entries()]
                return Settled(parked, Outcome.PARKED)
            delay = retry_delay(backoff, error.retry_after)
            await self._retry_later(batch, error, attempts, delay)
            if not await self.steps.sleep_while_leading(delay):
                return None

    def count_events(self, count: int, outcome: Outcome) -> None:
        """Count `count` events under `outcome` (serversync_events_total)."""
        instruments.EVENTS.add(count, {"consumer": self.consumer, "outcome": outcome.value})

    def _unexpected(self, batch: Batch, exc: Exception) -> DeliveryError:
        """A sink's bug or an odd value it did not expect: one batch must not crash the process
        into a restart loop that reads the same batch again. Said loudly, with the traceback
        once per streak, and tried again as an internal error."""
        log.error(
            "consumer %s: delivering seq %s raised %s",
            self.consumer,
            batch.seq_range,
            type(exc).__name__,
            exc_info=self.stats.failing_reason != Failure.INTERNAL,
        )
        return DeliveryError(
            safe_error(f"{type(exc).__name__}: {exc}"),
            failure=Failure.INTERNAL,
            code="INTERNAL_ERROR",
        )

    def _note_failure(self, error: DeliveryError) -> None:
        """A failed attempt, whatever follows: counted, and an event on the batch's span."""
        self.stats.failed_deliveries += 1
        failure = error.failure
        instruments.DELIVERY_FAILURES.add(1, {"consumer": self.consumer, "reason": failure.value})
        trace.get_current_span().add_event(
            "delivery failed",
            {"serversync.error_code": error.code, "serversync.failure": failure.value},
        )

    def _gives_up(self, failure: Failure, attempts: int) -> bool:
        """SYNC_MAX_ATTEMPTS > 0 parks a batch the receiver stayed unavailable for."""
        return (
            failure is Failure.UNAVAILABLE
            and self.config.max_attempts > 0
            and attempts >= self.config.max_attempts
        )

    async def _retry_later(
        self, batch: Batch, error: DeliveryError, attempts: int, delay: float
    ) -> None:
        """A failure that passes: counted as RETRIED, logged, kept as the failing streak."""
        failure = error.failure
        self.stats.retries += 1
        self.count_events(batch.count, Outcome.RETRIED)
        since = self.stats.fail(failure, str(error))
        log.warning(
            "consumer %s: delivery of seq %s failed (attempt %d): %s; retrying in %.1fs "
            "(%s for %.0fs)",
            self.consumer,
            batch.seq_range,
            attempts,
            error,
            delay,
            failure.value,
            time.time() - since,
            extra={"consumer": self.consumer, "reason": failure.value},
        )
        await self.steps.report_failure(str(error), failure)

    async def _park_refused(
        self, batch: Batch, error: DeliveryError, attempts: int
    ) -> Settled | None:
        """The receiver refused `batch`: park it if it is one event, else settle each half (so
        one poison entry never parks its neighbours). None if a stop came first."""
        if batch.count == 1:
            instruments.DELIVERY_ATTEMPTS.record(attempts, self._labels)
            log.warning("consumer %s: parking seq %s: %s", self.consumer, batch.seq_range, error)
            parked = [DeadLetter(batch.raw_entries()[0], error.code, str(error))]
            return Settled(parked, Outcome.PARKED)
        first_half, second_half = batch.split()
        first = await self.settle(first_half)
        if first is None:
            return None
        second = await self.settle(second_half)
        if second is None:
            return None
        return Settled.both(first, second)

    async def _deliver_once(self, batch: Batch) -> Outcome | None:
        """One delivery attempt that a stop request lets finish within the shutdown timeout.

        The sink's outcome (delivered, or already processed), or None if the batch was
        abandoned on shutdown.
        """
        task = asyncio.create_task(self.sink.deliver(batch))
        lost = self.steps.lost
        try:
            waits: set[asyncio.Future[Any]] = {task, self.steps.stopping, lost}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not task.done() and lost.done():
                task.cancel()
                raise LeadershipLostError("leader lock session lost during delivery")
            if not task.done():
                # Stopping: give the batch in flight a moment to finish, else abandon it; an
                # abandoned batch is delivered again by the next leader.
                done, _ = await asyncio.wait({task}, timeout=self.config.shutdown_timeout)
                if not done:
                    task.cancel()
                    log.info(
                        "consumer %s: %s batch seq %s on shutdown",
                        self.consumer,
                        Outcome.ABANDONED.value,
                        batch.seq_range,
                    )
                    return None
            return task.result()
        finally:
            if not task.done():
                task.cancel()
