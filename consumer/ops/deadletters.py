"""Operator actions on the dead-letter queue: retry one parked event, retry all of a consumer's,
list, show and delete them (used by `serversync dlq ...` and the admin API).

A retry claims the message (RETRYING, one more retry counted), delivers the stored event alone
through the consumer's own sink, and settles it: RESOLVED when delivered (a 409 "already
processed" answer counts, as it does for the runtime), else back to PENDING with the new error,
or DEAD once every retry is used. Only the store is touched, never the consumer's offset: the
consumer moved past the event when it parked it.

Nothing here logs: the command line prints the outcome, the admin API logs it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from consumer.core.events import DeliveryError, Sink
from consumer.observability.redact import safe_error
from consumer.store.dlq import (
    DEFAULT_PAGE_SIZE,
    MAX_PAGE_SIZE,
    DlqConflictError,
    DlqMessage,
    DlqNotFoundError,
    DlqPage,
    DlqStore,
    parse_id,
    parse_status,
)

# consumer name -> a new, not yet started sink of that consumer; LookupError for an unknown name.
SinkFactory = Callable[[str], Sink]

log = logging.getLogger("serversync.deadletters")


@dataclass(frozen=True)
class RetryResult:
    """What one retry did: the message as it now stands, and the delivery error if any."""

    message: DlqMessage
    delivered: bool
    # Masked, on one line (safe_error); None when delivered.
    error: str | None = None
    # The failure was passing trouble (network, 5xx, 429), not a refusal of the content.
    retryable: bool = False

    def describe(self) -> str:
        """One line for people: what happened and where the message stands."""
        m = self.message
        if self.delivered:
            return f"delivered; {m.status}"
        used = f"{m.retry_count} of {m.max_retries} retries used"
        return f"delivery failed: {self.error}; now {m.status} ({used})"


@dataclass(frozen=True)
class RetryAllResult:
    """What a retry-all did."""

    retried: int
    succeeded: int
    failed: int
    # Why the run stopped before the end (the receiver is unreachable or overloaded), if it did.
    stopped_early: str | None = None

    def describe(self) -> str:
        """One line for people."""
        text = f"retried {self.retried}: {self.succeeded} succeeded, {self.failed} failed"
        if self.stopped_early:
            text += f"; stopped early, the rest were left as they were: {self.stopped_early}"
        return text


class DeadLetters:
    """The dead-letter operations over a store, delivering through each consumer's sink."""

    def __init__(self, store: DlqStore, sinks: SinkFactory) -> None:
        self._store = store
        self._factory = sinks
        self._sinks: dict[str, Sink] = {}
        # Two requests retrying one consumer's messages must not start two sinks.
        self._sinks_lock = asyncio.Lock()

    async def close(self) -> None:
        """Close every sink that a retry started."""
        sinks, self._sinks = list(self._sinks.values()), {}
        for sink in sinks:
            await sink.close()

    async def list_messages(
        self,
        consumer: str,
        *,
        status: str | None = None,
        page: int = 1,
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> DlqPage:
        """A page of the consumer's messages, newest first (DlqValidationError for a bad status
        or page)."""
        return await self._store.list_messages(
            consumer, status=parse_status(status), page=page, page_size=page_size
        )

    async def get(self, message_id: str) -> DlqMessage:
        """One message by id (DlqValidationError, DlqNotFoundError)."""
        return await self._store.get(parse_id(message_id))

    async def delete(self, message_id: str) -> None:
        """Remove one message for good (DlqValidationError, DlqNotFoundError)."""
        await self._store.delete(parse_id(message_id))

    async def retry(self, message_id: str) -> RetryResult:
        """Deliver one parked event again (DlqValidationError, DlqNotFoundError, and
        DlqConflictError for a RESOLVED or DEAD message)."""
        found = await self._store.get(parse_id(message_id))
        # The sink first: a message of a consumer this build does not know must not use a retry.
        sink = await self._sink(found.consumer)
        return await self._retry(found.id, sink)

    async def retry_all(self, consumer: str) -> RetryAllResult:
        """Retry every PENDING/RETRYING message of the consumer that has retries left, in pages of
        100, each at most once.

        Stops at the first failure that is passing trouble (the receiver unreachable, 5xx, 429):
        the remaining messages would fail the same way and each would use up a retry for nothing.
        """
        ids = await self._store.retryable_ids(consumer, limit=1)
        if not ids:
            return RetryAllResult(0, 0, 0)
        sink = await self._sink(consumer)
        retried = succeeded = failed = 0
        after: uuid.UUID | None = None
        while True:
            ids = await self._store.retryable_ids(consumer, after=after, limit=MAX_PAGE_SIZE)
            for message_id in ids:
                try:
                    result = await self._retry(message_id, sink)
                except (DlqConflictError, DlqNotFoundError):
                    continue  # settled or deleted by someone else meanwhile: not ours to count
                retried += 1
                if result.delivered:
                    succeeded += 1
                    continue
                failed += 1
                if result.retryable:
                    return RetryAllResult(retried, succeeded, failed, result.error)
            if len(ids) < MAX_PAGE_SIZE:
                break
            after = ids[-1]
        return RetryAllResult(retried, succeeded, failed)

    async def _retry(self, message_id: uuid.UUID, sink: Sink) -> RetryResult:
        claimed = await self._store.claim(message_id)
        try:
            await sink.deliver(claimed.batch)
        except DeliveryError as exc:
            error = safe_error(str(exc))
            failed = await self._store.mark_failed(message_id, exc.code, error)
            return RetryResult(failed, delivered=False, error=error, retryable=exc.retryable)
        except Exception as exc:
            # A sink's own failure on this event: the message goes back to PENDING with it, and
            # the operator gets an answer, not a 500 with the message left RETRYING.
            log.exception("retry of dead letter %s failed", message_id)
            error = safe_error(f"{type(exc).__name__}: {exc}")
            failed = await self._store.mark_failed(message_id, "INTERNAL_ERROR", error)
            return RetryResult(failed, delivered=False, error=error, retryable=True)
        resolved = await self._store.mark_resolved(message_id)
        return RetryResult(resolved, delivered=True)

    async def _sink(self, consumer: str) -> Sink:
        async with self._sinks_lock:
            sink = self._sinks.get(consumer)
            if sink is None:
                try:
                    sink = self._factory(consumer)
                except LookupError as exc:
                    raise DlqConflictError(
                        f"cannot retry messages of consumer {consumer!r}: {exc}"
                    ) from None
                await sink.start()
                self._sinks[consumer] = sink
            return sink
