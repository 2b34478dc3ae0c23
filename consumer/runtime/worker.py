"""The consumer process's lifecycle: stand by until leader, lead, watch the lock, stop cleanly.

Modelled on procrastinate's worker, with each policy in a small class of its own, as
psycopg_pool keeps them: the pipeline of one lead (consumer/runtime/pipeline.py), settling a
batch (settle.py), the waiting flag (waiting.py), the stop and lost-lead signals with the
database steps that ride out errors (steps.py), and the stats (stats.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg

from consumer.core.errors import first_line
from consumer.core.events import Failure, Sink
from consumer.observability import instruments
from consumer.runtime.backoff import Backoff
from consumer.runtime.config import RuntimeConfig
from consumer.runtime.filtering import EntryFilter
from consumer.runtime.pipeline import Pipeline
from consumer.runtime.settle import Settler
from consumer.runtime.snapshotting import NewConsumerSnapshots, StartPolicy, announce_registration
from consumer.runtime.stats import RuntimeStats, delivery_health
from consumer.runtime.steps import LeadershipLostError, Steps
from consumer.runtime.wakeup import NotifyListener
from consumer.store.leadership import LeaderLock
from consumer.store.outbox import OutboxStore

# RuntimeConfig is named here too: callers that build a runtime import both from one place.
__all__ = ["ConsumerRuntime", "LeadershipLostError", "RuntimeConfig"]

log = logging.getLogger("serversync.runtime")


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
        entry_filter: EntryFilter | None = None,
        start: StartPolicy | None = None,
        snapshots: NewConsumerSnapshots | None = None,
    ) -> None:
        self.consumer = consumer
        # Where it starts if it registers now, and who writes the snapshot it may start with
        # (runtime/snapshotting.py); None: at the outbox's start, no snapshot.
        self.start = start or StartPolicy()
        self.snapshots = snapshots
        self.store = store
        # The entries it does not send (None: it sends every one).
        self.entry_filter = entry_filter
        # This database's node name, read once at start (run): the origin its reads give the
        # entries of changes made here. None while the node is unnamed.
        self.local_node: str | None = None
        # Read at the start of every lead: a sink replaced before then delivers that lead.
        self.sink = sink
        self.lock = lock
        self.listener = listener
        self.config = config
        self.stats = RuntimeStats()
        self._steps = Steps(consumer, store, self.stats, config)
        self._labels = {"consumer": consumer}

    def delivery_health(self) -> dict[str, Any]:
        """Whether deliveries go through, for /readyz: {"state": "ok"}, "not_leading", or
        "delivery_failing" with the reason, for how long and the last error."""
        return delivery_health(self.stats)

    def request_stop(self) -> None:
        """Ask the loop to finish (what SIGTERM/SIGINT do); the one way to stop it."""
        self._steps.request_stop()

    async def run(self) -> None:
        """Run until request_stop(): stand by, lead, and stand by again after losing the lead."""
        steps = self._steps
        steps.start()
        instruments.LEADER.set(0, self._labels)
        for failure in Failure:
            # Every reason exported from the start (at 0), so rates and alerts see the first one.
            instruments.DELIVERY_FAILURES.add(0, {"consumer": self.consumer, "reason": failure})
        registration = await steps.with_db_retry(
            lambda: self.store.ensure_consumer(
                self.consumer, start=self.start.start, entity_types=self.start.entity_types
            )
        )
        announce_registration(self.consumer, self.start, registration)
        self.local_node = await steps.with_db_retry(self.store.node_name)
        await self.sink.start()
        try:
            while not steps.stop_event.is_set():
                if not await self._wait_for_leadership():
                    break
                try:
                    await self._lead()
                except LeadershipLostError as exc:
                    log.warning("consumer %s lost leadership: %s", self.consumer, exc)
                except psycopg.OperationalError:
                    if not steps.stop_event.is_set():
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

    async def _wait_for_leadership(self) -> bool:
        """Try the leader lock until it is ours (True) or a stop comes (False)."""
        announced = False
        backoff = Backoff(0.2, 5.0)
        while not self._steps.stop_event.is_set():
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
                    first_line(exc),
                    delay,
                )
            await self._steps.sleep_unless_stopped(delay)
        return False

    async def _lead(self) -> None:
        """Take an epoch and drain the outbox under it until a stop or a lost lead."""
        steps = self._steps
        steps.begin_lead()
        leadership = await steps.with_db_retry(lambda: self.store.take_leadership(self.consumer))
        epoch, position = leadership.epoch, leadership.position
        self.stats.epoch, self.stats.position = epoch, position
        self.stats.state = "leader"
        instruments.LEADER.set(1, self._labels)
        self.stats.takeovers += 1
        log.info("consumer %s: leading (epoch %d) from position %s", self.consumer, epoch, position)
        if self.listener is not None:
            await self.listener.start()
        watchdog = asyncio.create_task(self._watch_lock(), name=f"watch:{self.consumer}")
        # A new consumer's snapshot is written beside the live stream, for this lead only.
        snapshots = self.snapshots.start(epoch, steps.stop_event) if self.snapshots else None
        try:
            settler = Settler(
                self.consumer,
                self.sink,
                config=self.config,
                stats=self.stats,
                steps=steps,
                entry_filter=self.entry_filter,
            )
            pipeline = Pipeline(
                self.consumer,
                epoch,
                store=self.store,
                settler=settler,
                listener=self.listener,
                config=self.config,
                stats=self.stats,
                steps=steps,
                local_node=self.local_node,
            )
            await pipeline.drain(position)
            with contextlib.suppress(psycopg.Error):
                await steps.bounded_by_stop(
                    lambda: self.store.release_leadership(self.consumer, epoch)
                )
            log.info("consumer %s: stopped at position %s", self.consumer, self.stats.position)
        finally:
            if snapshots is not None:
                await snapshots.finish(self.config.shutdown_timeout)
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
                    "consumer %s: leader lock session lost (%s)", self.consumer, first_line(exc)
                )
                self._steps.mark_lost()
                return
