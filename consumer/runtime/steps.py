"""How every step of the consumer loop meets a stop request, a lost lead and a database that
comes and goes. The lifecycle, the pipeline and the settling of batches share one Steps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import psycopg

from consumer.core.errors import first_line
from consumer.core.events import Failure
from consumer.observability import instruments
from consumer.observability.redact import safe_error
from consumer.runtime.backoff import Backoff
from consumer.runtime.config import RuntimeConfig
from consumer.runtime.stats import RuntimeStats
from consumer.store.outbox import OutboxStore

log = logging.getLogger("serversync.runtime")
T = TypeVar("T")


class LeadershipLostError(Exception):
    """The leader lock's session is gone, or a newer leader fenced this one off."""


class Steps:
    """The stop and lost-lead signals, and the database steps that ride out errors."""

    def __init__(
        self, consumer: str, store: OutboxStore, stats: RuntimeStats, config: RuntimeConfig
    ) -> None:
        self.consumer = consumer
        self.store = store
        self.stats = stats
        self.config = config
        self.stop_event = asyncio.Event()
        self.lost_event = asyncio.Event()
        # The same two signals as futures, for the per-batch waits: waiting on a future that is
        # already there costs a callback, where a waiter task per wait cost a task created and
        # cancelled (several per batch). Made by start() and, the lost one, by every lead.
        self._stop_signal: asyncio.Future[None] | None = None
        self._lost_signal: asyncio.Future[None] | None = None

    # -- the signals ---------------------------------------------------------------------------

    def start(self) -> None:
        """Called by the running loop before anything waits on a signal."""
        self._stop_signal = asyncio.get_running_loop().create_future()
        if self.stop_event.is_set():
            _complete(self._stop_signal)

    def request_stop(self) -> None:
        """Ask every step to finish."""
        self.stop_event.set()
        _complete(self._stop_signal)

    def begin_lead(self) -> None:
        """A new lead: nothing of it is lost yet."""
        self.lost_event.clear()
        self._lost_signal = asyncio.get_running_loop().create_future()

    def mark_lost(self) -> None:
        """The lead is lost (the lock session is gone)."""
        self.lost_event.set()
        _complete(self._lost_signal)

    @property
    def stopping(self) -> asyncio.Future[None]:
        """Done once a stop is requested."""
        assert self._stop_signal is not None, "start() makes it"
        return self._stop_signal

    @property
    def lost(self) -> asyncio.Future[None]:
        """Done once the current lead is lost."""
        assert self._lost_signal is not None, "deliveries run only while leading"
        return self._lost_signal

    def raise_if_lost(self) -> None:
        """LeadershipLostError once the lead is lost."""
        if self.lost_event.is_set():
            raise LeadershipLostError("leader lock session lost")

    async def sleep_unless_stopped(self, delay: float) -> bool:
        """Sleep `delay` seconds; False if a stop came first."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.stop_event.wait(), timeout=delay)
            return False
        return True

    async def sleep_while_leading(self, delay: float) -> bool:
        """Sleep `delay` seconds; False if a stop came first. A lead lost meanwhile raises at
        once: a Retry-After of an hour must not leave a process that no longer leads reporting
        itself the leader."""
        await asyncio.wait(
            {self.stopping, self.lost}, timeout=delay, return_when=asyncio.FIRST_COMPLETED
        )
        self.raise_if_lost()
        return not self.stop_event.is_set()

    # -- database steps -------------------------------------------------------------------------

    async def bounded_by_stop(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run one database step; once a stop is requested, give it at most the shutdown timeout.

        While the database is down the pool waits up to its own timeout (30 s) for a connection;
        a SIGTERM must not wait that long (systemd's TimeoutStopSec is 30 s too).
        """
        task = asyncio.ensure_future(op())
        try:
            waits: set[asyncio.Future[Any]] = {task, self.stopping}
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait({task}, timeout=self.config.shutdown_timeout)
            if not task.done():
                raise psycopg.OperationalError("database step abandoned on shutdown")
            return task.result()
        finally:
            if not task.done():
                task.cancel()

    async def with_db_retry(self, op: Callable[[], Awaitable[T]], *, batch: bool = False) -> T:
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
                result = await self.bounded_by_stop(op)
            except psycopg.OperationalError as exc:
                if self.stop_event.is_set():
                    raise
                self.raise_if_lost()
                delay = backoff.next_delay()
                log.warning(
                    "consumer %s: database error (%s); retrying in %.1fs",
                    self.consumer,
                    first_line(exc),
                    delay,
                )
            except psycopg.Error as exc:
                if not batch:
                    raise
                if self.stop_event.is_set():
                    # Stopping: the step is abandoned like any other on shutdown.
                    raise psycopg.OperationalError("database step abandoned on shutdown") from exc
                self.raise_if_lost()
                delay = max(backoff.next_delay(), self.config.retry_initial)
                await self._refused(exc, delay)
                refused = True
            else:
                if refused and self.stats.failing_reason is Failure.INTERNAL:
                    # The step the database refused went through: that streak is over (a
                    # commit ends it anyway; an idle consumer's read must too).
                    self.stats.recover()
                    await self.report_failure(None, None)
                return result
            await self.sleep_unless_stopped(delay)

    async def _refused(self, exc: psycopg.Error, delay: float) -> None:
        """The database refused a batch step: say so loudly and keep the failing streak."""
        error = safe_error(f"{type(exc).__name__}: {first_line(exc)}")
        log.error(
            "consumer %s: the database refused a step at position %s: %s; retrying in %.1fs",
            self.consumer,
            self.stats.position,
            error,
            delay,
            # The traceback once per streak.
            exc_info=self.stats.failing_reason != Failure.INTERNAL,
        )
        self.stats.fail(Failure.INTERNAL, error)
        instruments.DELIVERY_FAILURES.add(
            1, {"consumer": self.consumer, "reason": Failure.INTERNAL.value}
        )
        await self.report_failure(error, Failure.INTERNAL)

    async def report_failure(self, error: str | None, failure: Failure | None) -> None:
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
            await self.bounded_by_stop(step)


def _complete(signal: asyncio.Future[None] | None) -> None:
    if signal is not None and not signal.done():
        signal.set_result(None)
