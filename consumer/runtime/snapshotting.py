"""A new consumer starts whole: where it registers, and the snapshot its leader writes.

A consumer registered when the outbox no longer held the whole history starts at the outbox's
current end with a snapshot of the tables it carries, for it alone (consumer/store/
new_consumers.py asks for both in one transaction). Its leader writes that snapshot in a task of
its own while the pipeline delivers live changes: the two need no order between them, because a
receiver's version guard keeps the newest of any interleaving (docs/design.md, Snapshots).

The task writes on a connection of its own (autocommit, outside the pool): it holds the
snapshot's advisory lock for the whole run. A lead that ends (a stop, a lost lock, a kill) stops
it after its chunk in progress; the next leader resumes the snapshot from its last chunk. An
error (a table its role may not read, the database gone) never touches the live stream: it is
logged with what to do, kept where `serversync status` shows it, and the snapshot tried again
with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg

from consumer.core.errors import first_line
from consumer.observability.redact import safe_error
from consumer.runtime.backoff import Backoff
from consumer.store.db import connect
from consumer.store.new_consumers import REQUESTED_BY, Registration, StartFrom, record_error
from consumer.store.snapshot_writer import run_snapshot
from consumer.store.snapshots import (
    CHUNK_SIZE,
    SnapshotBusyError,
    SnapshotError,
    SnapshotState,
    unfinished,
)

__all__ = ["NewConsumerSnapshots", "SnapshotTask", "StartPolicy", "announce_registration"]

log = logging.getLogger("serversync.runtime")

# A progress line at least every this many seconds, and at every tenth of the rows.
PROGRESS_INTERVAL_SEC = 5.0


@dataclass(frozen=True)
class StartPolicy:
    """Where this consumer starts if it is registered for the first time (new_consumers.py),
    and the entity types whose tables its snapshot sends (None: every tracked table)."""

    start: StartFrom = "earliest"
    entity_types: frozenset[str] | None = None


def announce_registration(consumer: str, policy: StartPolicy, registration: Registration) -> None:
    """The log line of a registration: where a new consumer starts and why, or that the start
    option does not apply to a consumer registered already."""
    if not registration.registered:
        if policy.start != "auto":
            log.info(
                "consumer %s is registered already: it goes on from its offset (the start "
                "option %r applies only to its first start; `serversync offsets reset` moves it)",
                consumer,
                policy.start,
            )
        return
    where = registration.position
    if registration.snapshot_id is not None:
        log.info(
            "consumer %s registered at the end of the outbox (%s): the outbox no longer holds "
            "the whole history, so it starts with snapshot %d of the tables it carries, written "
            "by its leader beside the live stream",
            consumer,
            where,
            registration.snapshot_id,
        )
    elif policy.start == "auto" and registration.history_complete is False:
        log.warning(
            "consumer %s registered at the end of the outbox (%s) with no snapshot: none of "
            "the tables it carries is tracked",
            consumer,
            where,
        )
    elif policy.start == "now":
        log.info("consumer %s registered at the end of the outbox (%s), as asked", consumer, where)
    else:
        log.info("consumer %s registered at the start of the outbox", consumer)


class NewConsumerSnapshots:
    """Writes the snapshots asked for this consumer as a new one, while it leads."""

    def __init__(
        self,
        consumer: str,
        dsn: str,
        *,
        retry_initial: float,
        retry_max: float,
        chunk_size: int = CHUNK_SIZE,
        progress_interval: float = PROGRESS_INTERVAL_SEC,
    ) -> None:
        self.consumer = consumer
        self.dsn = dsn
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.chunk_size = chunk_size
        self.progress_interval = progress_interval

    def start(self, epoch: int, stopping: asyncio.Event) -> SnapshotTask:
        """The task of one lead (epoch `epoch`): it ends with the lead (SnapshotTask.finish), when
        `stopping` is set, or once no snapshot is left to write."""
        return SnapshotTask(self, epoch, stopping)


class SnapshotTask:
    """One lead's snapshot writing, running from its creation."""

    def __init__(self, owner: NewConsumerSnapshots, epoch: int, stopping: asyncio.Event) -> None:
        self._owner = owner
        self._epoch = epoch
        self._consumer = owner.consumer
        self._stop = asyncio.Event()
        self._stopping = stopping
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._task = asyncio.create_task(self._run(), name=f"snapshot:{owner.consumer}")

    async def finish(self, timeout: float) -> None:
        """Stop after the chunk in progress (cancelled after `timeout` seconds) and wait."""
        self._stop.set()
        done, _ = await asyncio.wait({self._task}, timeout=timeout)
        if not done:
            log.warning(
                "consumer %s: the snapshot did not stop within %.1fs; abandoning it (the next "
                "leader resumes it)",
                self._consumer,
                timeout,
            )
            self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._close()

    async def _run(self) -> None:
        follower = asyncio.create_task(self._follow_stop())
        try:
            await self._write_all()
        except Exception:
            # Nothing of the snapshot may end the live stream: the next lead tries again.
            log.exception("consumer %s: the snapshot task failed", self._consumer)
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await self._close()

    async def _follow_stop(self) -> None:
        await self._stopping.wait()
        self._stop.set()

    async def _write_all(self) -> None:
        """Write every unfinished new-consumer snapshot of this consumer, newest first, until
        none is left or a stop comes; errors are retried with backoff."""
        owner = self._owner
        backoff = Backoff(owner.retry_initial, owner.retry_max)
        busy_said = False
        while not self._stop.is_set():
            try:
                conn = await self._connection()
                try:
                    shot = await unfinished(
                        conn, consumer=self._consumer, requested_by=REQUESTED_BY
                    )
                except psycopg.errors.InsufficientPrivilege as exc:
                    # A role granted before snapshots existed: it asked for none at its
                    # registration either (that needs the same table), so this is said once.
                    log.warning(
                        "consumer %s: cannot look for a snapshot to write (%s); grant its role "
                        "what docs/security.md lists for a consumer",
                        self._consumer,
                        first_line(exc),
                    )
                    return
                if shot is None:
                    return
                self._announce(shot)
                progress = _Progress(self._consumer, owner.progress_interval)
                state = await run_snapshot(
                    conn,
                    shot.id,
                    chunk_size=owner.chunk_size,
                    progress=progress,
                    stop=self._stop,
                )
                if state.state == "running":
                    log.info(
                        "consumer %s: stopped writing %s; the next leader resumes it",
                        self._consumer,
                        state.describe(),
                    )
                    return
                log.info("consumer %s: %s", self._consumer, state.describe())
                backoff.reset()
                busy_said = False
                continue
            except SnapshotBusyError as exc:
                # An operator's `serversync snapshot`, or a former leader still ending its chunk.
                delay = backoff.next_delay()
                if not busy_said:
                    log.info("consumer %s: %s; trying again", self._consumer, exc)
                    busy_said = True
            except psycopg.errors.InsufficientPrivilege as exc:
                delay = backoff.next_delay()
                error = (
                    f"snapshot for new consumer {self._consumer} cannot be written: "
                    f"{first_line(exc)}; grant its role what docs/security.md lists for a "
                    "snapshot writer (SELECT and UPDATE on the tables it sends, INSERT on "
                    "sync.events_outbox), or run `serversync snapshot --consumer "
                    f"{self._consumer}` as the tables' owner, which resumes it"
                )
                log.error("consumer %s: %s; retrying in %.1fs", self._consumer, error, delay)
                await self._record(error)
            except psycopg.OperationalError as exc:
                delay = backoff.next_delay()
                log.warning(
                    "consumer %s: snapshot: database error (%s); retrying in %.1fs",
                    self._consumer,
                    first_line(exc),
                    delay,
                )
                await self._close()
            except (psycopg.Error, SnapshotError) as exc:
                delay = backoff.next_delay()
                error = safe_error(
                    f"snapshot for new consumer {self._consumer} failed: "
                    f"{type(exc).__name__}: {first_line(exc)}"
                )
                log.error("consumer %s: %s; retrying in %.1fs", self._consumer, error, delay)
                await self._record(error)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), delay)

    def _announce(self, shot: SnapshotState) -> None:
        verb = "writing" if shot.begin_seq is None and shot.rows_sent == 0 else "resuming"
        log.info("consumer %s: %s %s", self._consumer, verb, shot.describe())

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = await connect(self._owner.dsn, f"snapshot:{self._consumer}")
        return self._conn

    async def _record(self, error: str) -> None:
        """Best effort: the connection may be what failed."""
        if self._conn is None or self._conn.closed:
            return
        with contextlib.suppress(psycopg.Error):
            await record_error(self._conn, self._consumer, self._epoch, error)

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()


class _Progress:
    """A progress line at every tenth of the rows, and at least every `interval` seconds."""

    def __init__(self, consumer: str, interval: float) -> None:
        self._consumer = consumer
        self._interval = interval
        self._last_at = time.monotonic()
        self._last_tenth = 0

    def __call__(self, shot: SnapshotState) -> None:
        total = max(shot.rows_total, shot.rows_sent)
        tenth = 10 * shot.rows_sent // total if total else 0
        now = time.monotonic()
        if shot.state != "running":
            return  # the end has a line of its own
        if tenth > self._last_tenth or now - self._last_at >= self._interval:
            self._last_tenth = max(tenth, self._last_tenth)
            self._last_at = now
            log.info(
                "consumer %s: %s",
                self._consumer,
                shot.describe(),
                extra={
                    "snapshot": shot.id,
                    "rows_sent": shot.rows_sent,
                    "rows_total": shot.rows_total,
                },
            )
