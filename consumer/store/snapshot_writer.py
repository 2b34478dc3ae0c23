"""Writing a snapshot (consumer/store/snapshots.py has what one is): begin it once every
transaction that could still write an outbox row below its begin seq has ended, send each
table in key order a chunk per short transaction (functions/snapshot.sql), end it; recorded at
every step, so that running it again resumes it where it stood."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

import psycopg

from consumer.core.errors import first_line
from consumer.store.queries import query
from consumer.store.snapshots import (
    CHUNK_SIZE,
    SnapshotBusyError,
    SnapshotError,
    SnapshotState,
    snapshot_state,
)

__all__ = ["CHUNK_LOCK_TIMEOUT", "run_snapshot"]

# How long a chunk waits for a row lock held by a producer's transaction before it gives up and
# is tried again (a producer's edit always wins that wait).
CHUNK_LOCK_TIMEOUT = "200ms"
# Waits between tries of a chunk that met a lock, and between checks of the older transactions
# a snapshot waits for before it begins.
RETRY_INITIAL = 0.05
RETRY_MAX = 2.0


@contextlib.asynccontextmanager
async def _writing(conn: psycopg.AsyncConnection[Any], snapshot_id: int) -> AsyncIterator[None]:
    cur = await conn.execute(query("snapshot_try_lock"), {"id": snapshot_id})
    row = await cur.fetchone()
    if not (row and row[0]):
        raise SnapshotBusyError(f"snapshot {snapshot_id} is being written by another process")
    try:
        yield
    finally:
        if not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(query("snapshot_unlock"), {"id": snapshot_id})


async def _pause(seconds: float, stop: asyncio.Event | None) -> bool:
    """Wait `seconds`, or less when `stop` is set; True if stopped."""
    if seconds <= 0:
        return stop is not None and stop.is_set()
    if stop is None:
        await asyncio.sleep(seconds)
        return False
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
    return stop.is_set()


class _Pacing:
    """How long to wait after a chunk so that the rows written since the start stay at or under
    `max_rate` a second (None: no wait)."""

    def __init__(self, max_rate: float | None) -> None:
        if max_rate is not None and max_rate <= 0:
            raise SnapshotError("the rate limit is a number of rows a second above 0")
        self.max_rate = max_rate
        self.started = time.monotonic()
        self.rows = 0

    def after(self, rows: int) -> float:
        """The pause after a chunk of `rows` rows."""
        self.rows += rows
        if self.max_rate is None:
            return 0.0
        return max(0.0, self.started + self.rows / self.max_rate - time.monotonic())


async def _begin(
    conn: psycopg.AsyncConnection[Any],
    shot: SnapshotState,
    progress: Callable[[SnapshotState], None] | None,
    stop: asyncio.Event | None,
) -> SnapshotState | None:
    """Take the begin seq, wait for every transaction that could still write below it, then
    record it. None if stopped first (nothing recorded: the next run takes another)."""
    cur = await conn.execute(query("snapshot_next_seq"))
    row = await cur.fetchone()
    assert row is not None
    begin_seq = int(row[0])
    cur = await conn.execute(query("snapshot_xmax"))
    row = await cur.fetchone()
    assert row is not None
    xmax = row[0]
    delay = RETRY_INITIAL
    while True:
        cur = await conn.execute(query("snapshot_ready"), {"xmax": xmax})
        row = await cur.fetchone()
        if row and row[0]:
            break
        if progress is not None:
            progress(shot)
        if await _pause(delay, stop):
            return None
        delay = min(delay * 2, RETRY_MAX)
    await conn.execute(query("snapshot_begin"), {"id": shot.id, "seq": begin_seq})
    return replace(shot, begin_seq=begin_seq)


async def run_snapshot(
    conn: psycopg.AsyncConnection[Any],
    snapshot_id: int,
    *,
    chunk_size: int = CHUNK_SIZE,
    progress: Callable[[SnapshotState], None] | None = None,
    stop: asyncio.Event | None = None,
    lock_timeout: str = CHUNK_LOCK_TIMEOUT,
    max_rate: float | None = None,
) -> SnapshotState:
    """Write snapshot `snapshot_id` from where it stands to its end, and return its state:
    done, or still running when `stop` was set first (run it again to resume), or cancelled.

    `conn` is an autocommit connection of its own: it holds the snapshot's lock while it writes
    (SnapshotBusyError when another process holds it). `progress` is called after each chunk.
    A chunk that meets a row lock held longer than `lock_timeout`, or a deadlock, is tried again
    after a pause, for as long as that lasts. `max_rate` (rows a second) paces the chunks: a
    snapshot's WAL (each row's lock and its outbox row) competes with producers' commits for the
    disk, and an operator may trade the snapshot's speed for theirs."""
    if chunk_size < 1:
        raise SnapshotError("the chunk size is at least 1")
    shot = await snapshot_state(conn, snapshot_id)
    if shot.state != "running":
        return shot
    async with _writing(conn, snapshot_id):
        shot = await snapshot_state(conn, snapshot_id)  # as it stands now that it is ours
        if shot.state != "running":
            return shot
        if shot.begin_seq is None:
            begun = await _begin(conn, shot, progress, stop)
            if begun is None:
                return shot
            shot = begun
        tables = list(shot.tables)
        pacing = _Pacing(max_rate)
        for index in range(len(tables)):
            delay = RETRY_INITIAL
            while not tables[index].done:
                table = tables[index]
                if stop is not None and stop.is_set():
                    return replace(shot, tables=tuple(tables))
                try:
                    async with conn.transaction():
                        cur = await conn.execute(
                            query("snapshot_chunk"),
                            {
                                "id": snapshot_id,
                                "position": table.position,
                                "chunk_size": chunk_size,
                                "lock_timeout": lock_timeout,
                            },
                        )
                        row = await cur.fetchone()
                except (
                    psycopg.errors.LockNotAvailable,
                    psycopg.errors.DeadlockDetected,
                    psycopg.errors.SerializationFailure,
                ):
                    if await _pause(delay, stop):
                        return replace(shot, tables=tuple(tables))
                    delay = min(delay * 2, RETRY_MAX)
                    continue
                except psycopg.errors.ObjectNotInPrerequisiteState:
                    return await snapshot_state(conn, snapshot_id)  # cancelled meanwhile
                except psycopg.errors.CheckViolation as exc:
                    # A row with an empty key, there before the table was tracked: the relay
                    # refuses it too. The operator fixes the row and runs the snapshot again.
                    raise SnapshotError(f"snapshot {snapshot_id}: {first_line(exc)}") from exc
                delay = RETRY_INITIAL
                assert row is not None
                tables[index] = replace(table, rows_sent=table.rows_sent + int(row[0]), done=row[1])
                if progress is not None:
                    progress(replace(shot, tables=tuple(tables)))
                if await _pause(pacing.after(int(row[0])), stop):
                    return replace(shot, tables=tuple(tables))
        # Not running any more: cancelled meanwhile.
        with contextlib.suppress(psycopg.errors.ObjectNotInPrerequisiteState):
            await conn.execute(query("snapshot_finish"), {"id": snapshot_id})
        done = await snapshot_state(conn, snapshot_id)
        if progress is not None:
            progress(done)
        return done
