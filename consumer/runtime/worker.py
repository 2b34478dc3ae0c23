"""The consumer loop: stand by until leader, then drain, deliver, commit, wait; stop cleanly.

Modelled on procrastinate's worker: drain while batches come back full; once one comes back
short, wait for whichever comes first of a NOTIFY, the poll timer or the stop event, or, while an
older open transaction holds the read horizon back, a short re-check timer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from opentelemetry import trace

from consumer.core.events import Batch, DeadLetter, DeliveryError, Failure, Position, Sink
from consumer.observability import instruments
from consumer.observability.redact import safe_error
from consumer.runtime.backoff import Backoff
from consumer.runtime.pacing import ReadPacer
from consumer.runtime.wakeup import NotifyListener
from consumer.store.leadership import LeaderLock
from consumer.store.outbox import FencedError, OutboxStore, ReadResult

log = logging.getLogger("serversync.runtime")
# A receiver's Retry-After is waited for within these bounds: a "0" does not make a busy loop, a
# day of silence is not granted.
RETRY_AFTER_FLOOR_SEC = 0.5
RETRY_AFTER_CEILING_SEC = 3600.0
T = TypeVar("T")


class LeadershipLostError(Exception):
    """The leader lock's session is gone, or a newer leader fenced this one off."""


@dataclass
class RuntimeConfig:
    """The knobs of the loop (from SyncSettings)."""

    batch_size: int = 100
    poll_interval: float = 300.0
    recheck_interval: float = 0.1
    standby_interval: float = 1.0
    retry_initial: float = 2.0
    retry_max: float = 256.0
    shutdown_timeout: float = 5.0
    # After an empty read, look again this much later before announcing that we wait.
    linger: float = 0.005
    # Attempts while the receiver is unavailable before a batch is parked; 0 never gives up.
    max_attempts: int = 0
    # How often an operator may retry a parked event before it is DEAD.
    dlq_max_retries: int = 3
    # Batches being delivered at once while a backlog drains; offsets still move in order.
    max_in_flight: int = 1
    # While events arrive at batch_wait_min_rate per second or faster, wait this long after a
    # short batch before reading again (consumer/runtime/pacing.py); 0 never waits.
    batch_wait: float = 0.0
    batch_wait_min_rate: float = 2000.0


@dataclass
class RuntimeStats:
    """What the loop did so far: for status, metrics and tests."""

    epoch: int | None = None
    position: Position | None = None
    delivered_events: int = 0
    delivered_batches: int = 0
    failed_deliveries: int = 0
    retries: int = 0
    parked_events: int = 0
    notify_wakeups: int = 0
    poll_wakeups: int = 0
    recheck_wakeups: int = 0
    # Waits after a short batch because events arrived fast (read pacing).
    paced_waits: int = 0
    takeovers: int = 0
    last_batch_at: float | None = None
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


@dataclass
class _InFlight:
    """A batch being settled in its own task; committed in read order by the loop."""

    batch: Batch
    span: trace.Span
    started: float
    task: asyncio.Task[list[DeadLetter] | None]


class ConsumerRuntime:
    """Runs one named consumer: leadership, reading, delivery through a sink, offsets."""

    def __init__(
        self,
        consumer: str,
        *,
        store: OutboxStore,
        sink: Sink,
        lock: LeaderLock,
        listener: NotifyListener | None,
        config: RuntimeConfig,
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.sink = sink
        self.lock = lock
        self.listener = listener
        self.config = config
        self.stats = RuntimeStats()
        self.stop_event = asyncio.Event()
        self._lost = asyncio.Event()
        # The same two signals as futures, for the per-batch waits: waiting on a future that is
        # already there costs a callback, where a waiter task per wait cost a task created and
        # cancelled (several per batch). Made by run() and, the lost one, by every lead.
        self._stop_signal: asyncio.Future[None] | None = None
        self._lost_signal: asyncio.Future[None] | None = None
        self._labels = {"consumer": consumer}

    def delivery_health(self) -> dict[str, Any]:
        """Whether deliveries go through, for /readyz: {"state": "ok"}, "not_leading", or
        "delivery_failing" with the reason, for how long and the last error."""
        stats = self.stats
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

    def request_stop(self) -> None:
        """Ask the loop to finish (what SIGTERM/SIGINT do); the one way to stop it."""
        self.stop_event.set()
        _complete(self._stop_signal)

    def _stopping(self) -> asyncio.Future[None]:
        """Done once a stop is requested."""
        assert self._stop_signal is not None, "run() makes it"
        return self._stop_signal

    def _mark_lost(self) -> None:
        self._lost.set()
        _complete(self._lost_signal)

    async def run(self) -> None:
        """Run until request_stop(): stand by, lead, and stand by again after losing the lead."""
        self._stop_signal = asyncio.get_running_loop().create_future()
        if self.stop_event.is_set():
            _complete(self._stop_signal)
        instruments.LEADER.set(0, self._labels)
        for failure in Failure:
            # Every reason exported from the start (at 0), so rates and alerts see the first one.
            instruments.DELIVERY_FAILURES.add(0, {"consumer": self.consumer, "reason": failure})
        await self._with_db_retry(lambda: self.store.ensure_consumer(self.consumer))
        await self.sink.start()
        try:
            while not self.stop_event.is_set():
                if not await self._wait_for_leadership():
                    break
                try:
                    await self._lead()
                except LeadershipLostError as exc:
                    log.warning("consumer %s lost leadership: %s", self.consumer, exc)
                except psycopg.OperationalError:
                    if not self.stop_event.is_set():
                        raise
                    log.info("consumer %s: database unreachable while stopping", self.consumer)
                finally:
                    # Lead lost or given up: competing again (or stopping) from here on. A
                    # failing streak was this lead's: the next leader reports its own.
                    self.stats.recover()
                    self.stats.state = "standby"
                    instruments.LEADER.set(0, self._labels)
                    await self._teardown("releasing the leader lock", self.lock.release)
        finally:
            self.stats.state = "stopped"
            await self._teardown("closing the sink", self.sink.close)
            if self.listener is not None:
                await self._teardown("stopping the listener", self.listener.stop)
            await self._teardown("releasing the leader lock", self.lock.release)

    async def _teardown(self, what: str, step: Callable[[], Awaitable[None]]) -> None:
        """A clean-up step that may not hold up an exit: at most the shutdown timeout."""
        try:
            await asyncio.wait_for(step(), timeout=self.config.shutdown_timeout)
        except TimeoutError:
            log.warning(
                "consumer %s: %s took over %.1fs; going on",
                self.consumer,
                what,
                self.config.shutdown_timeout,
            )

    # -- leadership ---------------------------------------------------------------------------

    async def _wait_for_leadership(self) -> bool:
        announced = False
        backoff = Backoff(0.2, 5.0)
        while not self.stop_event.is_set():
            try:
                if await self.lock.try_acquire():
                    return True
                self.stats.state = "standby"
                backoff.reset()
                delay = self.config.standby_interval
                if not announced:
                    log.info("consumer %s: another process leads; standing by", self.consumer)
                    announced = True
            except psycopg.Error as exc:
                self.stats.state = "database_unreachable"
                delay = backoff.next_delay()
                log.warning(
                    "consumer %s: database unreachable (%s); retrying in %.1fs",
                    self.consumer,
                    _one_line(exc),
                    delay,
                )
            await self._sleep_unless_stopped(delay)
        return False

    async def _lead(self) -> None:
        self._lost.clear()
        self._lost_signal = asyncio.get_running_loop().create_future()
        leadership = await self._with_db_retry(lambda: self.store.take_leadership(self.consumer))
        epoch, position = leadership.epoch, leadership.position
        self.stats.epoch, self.stats.position = epoch, position
        self.stats.state = "leader"
        instruments.LEADER.set(1, self._labels)
        self.stats.takeovers += 1
        log.info("consumer %s: leading (epoch %d) from position %s", self.consumer, epoch, position)
        if self.listener is not None:
            await self.listener.start()
        watchdog = asyncio.create_task(self._watch_lock(), name=f"watch:{self.consumer}")
        try:
            await self._drain_loop(epoch, position)
            with contextlib.suppress(psycopg.Error):
                await self._bounded_by_stop(
                    lambda: self.store.release_leadership(self.consumer, epoch)
                )
            log.info("consumer %s: stopped at position %s", self.consumer, self.stats.position)
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watchdog
            if self.listener is not None:
                await self.listener.stop()

    async def _watch_lock(self) -> None:
        """Notice a lost lock session within about one standby interval."""
        while True:
            await asyncio.sleep(self.config.standby_interval)
            try:
                await asyncio.wait_for(
                    self.lock.check(), timeout=max(2.0, self.config.standby_interval)
                )
            except (psycopg.Error, TimeoutError) as exc:
                log.warning(
                    "consumer %s: leader lock session lost (%s)", self.consumer, _one_line(exc)
                )
                self._mark_lost()
                return

    # -- the loop -----------------------------------------------------------------------------

    async def _drain_loop(self, epoch: int, position: Position) -> None:
        """Read, deliver, commit; when reads come back empty, announce that we wait, then sleep.

        While a backlog drains, the next batch is read while earlier ones are delivered
        (pipelining), and up to `max_in_flight` batches are delivered at once; their offsets are
        committed strictly in order, so the stored position never passes an unsettled batch.
        A short batch ends the read-ahead: everything in flight is settled before reading again.
        While events arrive fast, the loop then waits `batch_wait` before that read, so that
        they gather into fewer, bigger batches (ReadPacer).

        The relay sends NOTIFY only while a consumer is marked waiting (sql/backend/0002). After
        an empty read we first linger briefly and read again; only if that read is empty too do
        we mark ourselves waiting, read once more (a commit may have raced the mark), and sleep.
        A consumer under steady load therefore never marks itself waiting and costs producers
        no NOTIFY at all; an idle one is woken at once. The mark is cleared as soon as a read
        finds events again.
        """
        limit = self.config.batch_size
        window = max(1, self.config.max_in_flight)
        listening = self.listener is not None
        wakeup = self.listener.event if self.listener is not None else asyncio.Event()
        reconnects = self.listener.reconnects if self.listener is not None else 0
        waiting = False
        if listening:
            await self._with_db_retry(
                functools.partial(self.store.set_waiting, self.consumer, False)
            )
        lingered = False
        pacer = ReadPacer(self.config.batch_wait, self.config.batch_wait_min_rate)
        prefetch: asyncio.Task[ReadResult] | None = None
        in_flight: collections.deque[_InFlight] = collections.deque()
        try:
            while not self.stop_event.is_set():
                self._raise_if_lost()
                if self.listener is not None and self.listener.reconnects != reconnects:
                    # The server may have restarted and lost the unlogged waiting flags.
                    reconnects, waiting = self.listener.reconnects, False
                result = await self._next_read(prefetch, position, limit, wakeup)
                prefetch = None
                batch = result.batch
                if batch is None:
                    if in_flight:
                        # A read-ahead found nothing new: settle what is out, then look again.
                        if not await self._finish_all(in_flight, epoch):
                            return
                        continue
                    if listening and not waiting:
                        if not lingered:
                            lingered = True
                            await self._sleep_unless_stopped(self.config.linger)
                            continue
                        await self._with_db_retry(
                            functools.partial(self.store.set_waiting, self.consumer, True)
                        )
                        waiting = True
                        continue  # read once more: a commit may have raced the announcement
                    timeout = (
                        self.config.recheck_interval
                        if result.held_back
                        else self.config.poll_interval
                    )
                    reason = await self._wait_for_work(wakeup, timeout, held_back=result.held_back)
                    self._count_wakeup(reason)
                    continue
                lingered = False
                pacer.observe(batch.count)
                in_flight.append(self._start_delivery(batch, epoch))
                if waiting:
                    # After the delivery has started: the flag only spares producers NOTIFYs,
                    # and clearing it first would add a round trip to every woken event.
                    await self._with_db_retry(
                        functools.partial(self.store.set_waiting, self.consumer, False)
                    )
                    waiting = False
                position = batch.end
                if batch.count == limit:
                    prefetch = asyncio.create_task(self.store.read_batch(position, limit))
                    while len(in_flight) >= window:
                        if not await self._finish(in_flight.popleft(), epoch):
                            return
                elif not await self._finish_all(in_flight, epoch):
                    return
                elif pause := pacer.pause():
                    await self._paced_wait(pause)
            # Stopping: the batches still out had the same grace as the one just settled
            # (_deliver_once); commit those that were answered, so they are not sent again.
            await self._finish_all(in_flight, epoch)
        finally:
            if prefetch is not None:
                prefetch.cancel()
                with contextlib.suppress(asyncio.CancelledError, psycopg.Error):
                    await prefetch
            await self._abandon(in_flight)
            if waiting:
                # A stopped consumer waits for nothing: left set, the flag would make every
                # producer transaction send a NOTIFY until the consumer came back.
                with contextlib.suppress(psycopg.Error):
                    await self._bounded_by_stop(
                        functools.partial(self.store.set_waiting, self.consumer, False)
                    )

    async def _next_read(
        self,
        prefetch: asyncio.Task[ReadResult] | None,
        position: Position,
        limit: int,
        wakeup: asyncio.Event,
    ) -> ReadResult:
        """The prefetched read when there is one, else a fresh read (with database retries)."""
        if prefetch is not None:
            # A failed read-ahead is read again below, with the retries of a fresh read.
            with contextlib.suppress(psycopg.Error):
                return await prefetch
        # A NOTIFY that arrives from here on must wake the next wait.
        wakeup.clear()
        return await self._with_db_retry(
            functools.partial(self.store.read_batch, position, limit), batch=True
        )

    def _start_delivery(self, batch: Batch, epoch: int) -> _InFlight:
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

        async def settle() -> list[DeadLetter] | None:
            with trace.use_span(span, end_on_exit=False, record_exception=False):
                return await self._settle(batch, epoch)

        task = asyncio.create_task(settle(), name=f"deliver:{self.consumer}:{batch.seq_range}")
        return _InFlight(batch, span, time.monotonic(), task)

    async def _finish_all(self, in_flight: collections.deque[_InFlight], epoch: int) -> bool:
        """Settle and commit everything in flight, oldest first; False if stopped first."""
        while in_flight:
            if not await self._finish(in_flight.popleft(), epoch):
                return False
        return True

    async def _finish(self, delivery: _InFlight, epoch: int) -> bool:
        """Wait for the oldest batch in flight to settle, then commit it (parking what could not
        be delivered). False if stopped before the batch was settled: it is delivered again
        later, and so is everything after it."""
        batch, span = delivery.batch, delivery.span
        try:
            with trace.use_span(span, end_on_exit=False):
                parked = await delivery.task
                if parked is None:
                    span.set_attribute("serversync.outcome", "abandoned")
                    return False
                await self._commit(batch, epoch, parked)
                self._report(delivery, parked)
        finally:
            span.end()
        return True

    def _report(self, delivery: _InFlight, parked: list[DeadLetter]) -> None:
        """Span outcome, metrics and the one log line of a committed batch."""
        batch = delivery.batch
        duration = time.monotonic() - delivery.started
        outcome = "parked" if parked else "delivered"
        delivery.span.set_attribute("serversync.outcome", outcome)
        instruments.BATCH_SIZE.record(batch.count, self._labels)
        instruments.BATCH_DURATION.record(duration, self._labels)
        log.info(
            "consumer %s: %s %d events seq %s in %.1f ms (%d parked)",
            self.consumer,
            outcome,
            batch.count - len(parked),
            batch.seq_range,
            duration * 1000,
            len(parked),
            extra={
                "consumer": self.consumer,
                "seq_range": batch.seq_range,
                "events": batch.count,
                "parked": len(parked),
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
                delivery.span.set_attribute("serversync.outcome", "abandoned")
                delivery.span.end()
            in_flight.clear()

    async def _settle(self, batch: Batch, epoch: int) -> list[DeadLetter] | None:
        """Deliver `batch`; the entries to park, or None if a stop came first.

        Only a refusal of the content parks events: a refused batch is split in halves until the
        refused entries are found, so one poison entry never parks its neighbours. Everything
        else (the receiver unavailable, a wrong destination, an error of the consumer's own)
        holds the offset and is tried again with backoff, or after the receiver's Retry-After,
        for as long as it lasts; SYNC_MAX_ATTEMPTS > 0 opts into parking a batch the receiver
        stayed unavailable for.
        """
        backoff = Backoff(self.config.retry_initial, self.config.retry_max)
        while True:
            self._raise_if_lost()
            try:
                outcome = await self._deliver_once(batch)
                if outcome is None:
                    return None
                self._count_events(batch.count, outcome)
                instruments.DELIVERY_ATTEMPTS.record(backoff.attempts + 1, self._labels)
                return []
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
                # A sink's bug or an odd value it did not expect: one batch must not crash the
                # process into a restart loop that reads the same batch again. Say it loudly,
                # with the traceback once per streak, and try again.
                log.error(
                    "consumer %s: delivering seq %s raised %s",
                    self.consumer,
                    batch.seq_range,
                    type(exc).__name__,
                    exc_info=self.stats.failing_reason != Failure.INTERNAL,
                )
                error = DeliveryError(
                    safe_error(f"{type(exc).__name__}: {exc}"),
                    failure=Failure.INTERNAL,
                    code="INTERNAL_ERROR",
                )
            self.stats.failed_deliveries += 1
            failure = error.failure
            instruments.DELIVERY_FAILURES.add(
                1, {"consumer": self.consumer, "reason": failure.value}
            )
            trace.get_current_span().add_event(
                "delivery failed",
                {"serversync.error_code": error.code, "serversync.failure": failure.value},
            )
            if failure.parks:
                try:
                    return await self._park_refused(batch, epoch, error, backoff.attempts + 1)
                except ValueError as exc:
                    # Entries the consumer cannot cut apart: held and retried, never skipped.
                    log.error("consumer %s: cannot split seq %s", self.consumer, batch.seq_range)
                    error = DeliveryError(
                        safe_error(f"cannot split the batch to find the refused entries: {exc}"),
                        failure=Failure.INTERNAL,
                        code="INTERNAL_ERROR",
                    )
                    failure = error.failure
            attempts = backoff.attempts + 1
            if (
                failure is Failure.UNAVAILABLE
                and self.config.max_attempts
                and attempts >= self.config.max_attempts
            ):
                instruments.DELIVERY_ATTEMPTS.record(attempts, self._labels)
                log.warning(
                    "consumer %s: giving up on seq %s after %d attempts "
                    "(SYNC_MAX_ATTEMPTS); parking: %s",
                    self.consumer,
                    batch.seq_range,
                    attempts,
                    error,
                )
                return [DeadLetter(raw, error.code, str(error)) for raw in batch.raw_entries()]
            delay = retry_delay(backoff, error.retry_after)
            self.stats.retries += 1
            self._count_events(batch.count, "retry")
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
            await self._report_failure(str(error), failure)
            if not await self._wait_before_retry(delay):
                return None

    async def _wait_before_retry(self, delay: float) -> bool:
        """Sleep `delay` seconds before the next attempt; False if a stop came first. A lead
        lost meanwhile raises at once: a Retry-After of an hour must not leave a process that
        no longer leads reporting itself the leader."""
        lost = self._lost_signal
        assert lost is not None, "deliveries run only while leading"
        await asyncio.wait(
            {self._stopping(), lost}, timeout=delay, return_when=asyncio.FIRST_COMPLETED
        )
        self._raise_if_lost()
        return not self.stop_event.is_set()

    async def _park_refused(
        self, batch: Batch, epoch: int, error: DeliveryError, attempts: int
    ) -> list[DeadLetter] | None:
        """The receiver refused `batch`: park it if it is one event, else settle each half (so
        one poison entry never parks its neighbours). None if a stop came first."""
        if batch.count == 1:
            instruments.DELIVERY_ATTEMPTS.record(attempts, self._labels)
            log.warning("consumer %s: parking seq %s: %s", self.consumer, batch.seq_range, error)
            return [DeadLetter(batch.raw_entries()[0], error.code, str(error))]
        parked: list[DeadLetter] = []
        for half in batch.split():
            settled = await self._settle(half, epoch)
            if settled is None:
                return None
            parked += settled
        return parked

    def _count_events(self, count: int, outcome: str) -> None:
        instruments.EVENTS.add(count, {"consumer": self.consumer, "outcome": outcome})

    async def _deliver_once(self, batch: Batch) -> str | None:
        """One delivery attempt that a stop request lets finish within the shutdown timeout.

        The outcome (success, or conflict_processed when the receiver had it already), or None
        if the batch was abandoned on shutdown.
        """
        task = asyncio.create_task(self.sink.deliver(batch))
        lost = self._lost_signal
        assert lost is not None, "deliveries run only while leading"
        try:
            waits: set[asyncio.Future[Any]] = {task, self._stopping(), lost}
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
                        "consumer %s: abandoned batch seq %s on shutdown",
                        self.consumer,
                        batch.seq_range,
                    )
                    return None
            return task.result() or "success"
        finally:
            if not task.done():
                task.cancel()

    async def _commit(self, batch: Batch, epoch: int, parked: list[DeadLetter]) -> None:
        delivered = batch.count - len(parked)
        try:
            await self._with_db_retry(
                functools.partial(
                    self.store.commit_offset,
                    self.consumer,
                    epoch,
                    batch.end,
                    delivered,
                    parked=parked,
                    max_retries=self.config.dlq_max_retries,
                ),
                batch=True,
            )
        except FencedError as exc:
            raise LeadershipLostError(str(exc)) from exc
        self.stats.position = batch.end
        if self.stats.failing_since is not None:
            log.info(
                "consumer %s: delivering again after %.0fs of failures (%s)",
                self.consumer,
                time.time() - self.stats.failing_since,
                self.stats.failing_reason,
            )
            self.stats.recover()
        self.stats.delivered_events += delivered
        self.stats.parked_events += len(parked)
        if parked:
            self._count_events(len(parked), "dead")
        self.stats.delivered_batches += 1
        self.stats.last_batch_at = time.time()

    async def _wait_for_work(
        self, wakeup: asyncio.Event, timeout: float, *, held_back: bool
    ) -> str:
        self.stats.sleeping = "recheck" if held_back else "wakeup"
        waiters = {
            asyncio.create_task(wakeup.wait()): "notify",
            asyncio.create_task(self.stop_event.wait()): "stop",
            asyncio.create_task(self._lost.wait()): "lost",
        }
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self.stats.sleeping = None
            for waiter in waiters:
                waiter.cancel()
        if not done:
            return "recheck" if held_back else "poll"
        return waiters[next(iter(done))]

    async def _paced_wait(self, seconds: float) -> None:
        """Let events gather for the next read (everything read so far is committed)."""
        self._count_wakeup("paced")
        self.stats.sleeping = "paced"
        try:
            await self._sleep_unless_stopped(seconds)
        finally:
            self.stats.sleeping = None

    def _count_wakeup(self, reason: str) -> None:
        if reason in ("notify", "poll", "recheck", "paced"):
            instruments.WAKEUPS.add(1, {"consumer": self.consumer, "reason": reason})
        if reason == "notify":
            self.stats.notify_wakeups += 1
        elif reason == "poll":
            self.stats.poll_wakeups += 1
        elif reason == "recheck":
            self.stats.recheck_wakeups += 1
        elif reason == "paced":
            self.stats.paced_waits += 1

    # -- helpers ------------------------------------------------------------------------------

    def _raise_if_lost(self) -> None:
        if self._lost.is_set():
            raise LeadershipLostError("leader lock session lost")

    async def _with_db_retry(self, op: Callable[[], Awaitable[T]], *, batch: bool = False) -> T:
        """Run a database step, riding out connection loss and server restarts with backoff.

        A `batch` step (reading a batch, committing one) also rides out any other error the
        database answers: a value it refuses must not crash the process into a restart loop
        that meets the same batch again. The step is retried with backoff, loudly (the log,
        and `serversync status` through the failing streak), until it passes or an operator
        steps in.
        """
        backoff = Backoff(0.2, 10.0)
        refused = False
        while True:
            try:
                result = await self._bounded_by_stop(op)
            except psycopg.OperationalError as exc:
                if self.stop_event.is_set():
                    raise
                self._raise_if_lost()
                delay = backoff.next_delay()
                log.warning(
                    "consumer %s: database error (%s); retrying in %.1fs",
                    self.consumer,
                    _one_line(exc),
                    delay,
                )
            except psycopg.Error as exc:
                if not batch:
                    raise
                if self.stop_event.is_set():
                    # Stopping: the step is abandoned like any other on shutdown.
                    raise psycopg.OperationalError("database step abandoned on shutdown") from exc
                self._raise_if_lost()
                delay = max(backoff.next_delay(), self.config.retry_initial)
                error = safe_error(f"{type(exc).__name__}: {_one_line(exc)}")
                log.error(
                    "consumer %s: the database refused a step at position %s: %s; "
                    "retrying in %.1fs",
                    self.consumer,
                    self.stats.position,
                    error,
                    delay,
                    exc_info=self.stats.failing_reason != Failure.INTERNAL,
                )
                self.stats.fail(Failure.INTERNAL, error)
                instruments.DELIVERY_FAILURES.add(
                    1, {"consumer": self.consumer, "reason": Failure.INTERNAL.value}
                )
                refused = True
                await self._report_failure(error, Failure.INTERNAL)
            else:
                if refused and self.stats.failing_reason is Failure.INTERNAL:
                    # The step the database refused went through: that streak is over (a
                    # commit ends it anyway; an idle consumer's read must too).
                    self.stats.recover()
                    await self._report_failure(None, None)
                return result
            await self._sleep_unless_stopped(delay)

    async def _report_failure(self, error: str | None, failure: Failure | None) -> None:
        """Keep a failing streak (or its end: None) where `serversync status`, the gauges and
        the alert read it; best effort, as the database may be what fails."""
        epoch = self.stats.epoch
        if epoch is None:
            return
        with contextlib.suppress(psycopg.Error):
            if failure is None or error is None:
                step = functools.partial(self.store.clear_failure, self.consumer, epoch)
            else:
                step = functools.partial(
                    self.store.record_failure, self.consumer, epoch, error, failure.value
                )
            await self._bounded_by_stop(step)

    async def _bounded_by_stop(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run one database step; once a stop is requested, give it at most the shutdown timeout.

        While the database is down the pool waits up to its own timeout (30 s) for a connection;
        a SIGTERM must not wait that long (systemd's TimeoutStopSec is 30 s too).
        """
        task = asyncio.ensure_future(op())
        try:
            waits: set[asyncio.Future[Any]] = {task, self._stopping()}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=self.config.shutdown_timeout)
            if not task.done():
                raise psycopg.OperationalError("database step abandoned on shutdown")
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    async def _sleep_unless_stopped(self, delay: float) -> bool:
        """Sleep `delay` seconds; False if a stop came first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_event.wait(), timeout=delay)
            return False
        return True


def retry_delay(backoff: Backoff, retry_after: float | None) -> float:
    """How long to wait before the next attempt: the receiver's Retry-After when it gave one
    (its word, clamped to RETRY_AFTER_FLOOR_SEC .. RETRY_AFTER_CEILING_SEC, as urllib3 and the
    Google API clients take it), else the backoff's next delay."""
    delay = backoff.next_delay()
    if retry_after is None:
        return delay
    return min(max(retry_after, RETRY_AFTER_FLOOR_SEC), RETRY_AFTER_CEILING_SEC)


def _complete(signal: asyncio.Future[None] | None) -> None:
    if signal is not None and not signal.done():
        signal.set_result(None)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
