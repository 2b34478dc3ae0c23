"""Retention: delete what no consumer needs any more, and deregister consumers that no longer run.

`cleanup` deletes outbox rows older than the retention that every registered consumer has passed,
and resolved dead letters older than the retention. It never deletes a row some consumer has not
passed: a consumer that far behind keeps its rows and is reported, and an operator resets it
(`offsets reset`) or deregisters it (`remove_consumer`). With no consumer registered at all no
outbox row goes: a consumer registered later starts from the beginning of the outbox.

Deletes run in small batches, each its own short transaction on an autocommit connection. A
DELETE takes the same table lock as a producer's INSERT (ROW EXCLUSIVE, which does not conflict
with itself) and locks only old rows no producer touches, so producers never wait for it. Short
transactions matter for consumers too: a deleting transaction holds an xid, and while it is open
every consumer's read horizon waits behind it (docs/design.md, the gap-safety proof).

Deleting outbox rows ends the outbox's whole history: the first batch that deletes any records
so (sync.outbox_history, in the batch's transaction), and a consumer registered after that starts
with a snapshot of the tables it carries rather than with an outbox that lacks their old changes.

Parked events do not pin outbox rows: sync.dlq_messages keeps its own copy of each entry.

The idempotency keys of sync.enqueue go with the outbox rows of the same age: a key taken before
the cutoff is deleted, so a request repeated after the retention is an event again. Keys do not
wait for consumers: a key only stops a repeat, and the event it let through has its own row.
"""

from __future__ import annotations

import contextlib
import logging
import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import psycopg
from psycopg.rows import dict_row

from consumer.core.errors import first_line
from consumer.core.events import Position
from consumer.store.admin import AdminError, UnknownConsumerError
from consumer.store.queries import query
from consumer.store.registration import (
    RegisteredConsumer,
    RemovedConsumer,
    consumer_sessions,
    find_consumer,
    leader_lock_prefix,
    remove_consumer,
)
from consumer.store.snapshots import mark_history_incomplete

# Deregistering a consumer (registration.py) is the other half of `serversync cleanup`'s advice:
# its callers (the command line, tests) find it here too.
__all__ = [
    "DEAD_LETTERS",
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_RETENTION",
    "ENQUEUE_KEYS",
    "MAX_BATCH_SIZE",
    "MAX_RETENTION",
    "OUTBOX",
    "CleanupError",
    "CleanupReport",
    "LaggingConsumer",
    "RegisteredConsumer",
    "RemovedConsumer",
    "UnknownConsumerError",
    "cleanup",
    "consumer_sessions",
    "delete_outbox_batch",
    "find_consumer",
    "format_duration",
    "lagging_hint",
    "leader_lock_prefix",
    "parse_duration",
    "remove_consumer",
]

log = logging.getLogger("serversync.retention")

DEFAULT_RETENTION = "30d"
DEFAULT_BATCH_SIZE = 5000
# A bigger batch holds its row locks and its xid (the consumers' read horizon) for longer.
MAX_BATCH_SIZE = 100_000
# Far enough for any retention; beyond it now() - interval leaves timestamptz's range.
MAX_RETENTION = timedelta(days=36_500)

OUTBOX = "sync.events_outbox"
DEAD_LETTERS = "sync.dlq_messages"
ENQUEUE_KEYS = "sync.enqueue_keys"

_DURATION = re.compile(r"^\s*(\d{1,12})\s*([smhd]?)\s*$")
_UNIT_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


class CleanupError(AdminError):
    """A cleanup stopped part-way (what was deleted until then stays deleted)."""


def parse_duration(text: str) -> timedelta:
    """`30d`, `12h`, `90m`, `45s` or plain seconds as a timedelta; ValueError otherwise."""
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"not a duration: {text!r} (e.g. 30d, 12h, 90m, 45s, or seconds)")
    value = timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if value > MAX_RETENTION:
        raise ValueError(f"{text!r} is longer than {MAX_RETENTION.days} days")
    return value


def format_duration(value: timedelta) -> str:
    """The shortest of `Nd`, `Nh`, `Nm`, `Ns` that states `value` exactly."""
    seconds = int(value.total_seconds())
    for unit in ("d", "h", "m"):
        if seconds and seconds % _UNIT_SECONDS[unit] == 0:
            return f"{seconds // _UNIT_SECONDS[unit]}{unit}"
    return f"{seconds}s"


@dataclass(frozen=True)
class LaggingConsumer:
    """A consumer that has not passed some rows older than the retention: they are kept."""

    consumer: str
    position: Position
    updated_at: datetime
    old_rows_needed: int
    oldest_needed_at: datetime | None

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `cleanup --json`."""
        return {
            "consumer": self.consumer,
            "position": str(self.position),
            "last_txid": str(self.position.txid),
            "last_seq": self.position.seq,
            "updated_at": self.updated_at.isoformat(),
            "old_rows_needed": self.old_rows_needed,
            "oldest_needed_at": (
                self.oldest_needed_at.isoformat() if self.oldest_needed_at else None
            ),
        }


@dataclass
class CleanupReport:
    """What a cleanup deleted (or, in a dry run, would delete) and what it kept, and why."""

    older_than: timedelta
    cutoff: datetime
    dry_run: bool
    batch_size: int
    consumers: int = 0
    # Outbox rows created before the cutoff, when the run started.
    outbox_old: int = 0
    # Of those, the ones every consumer had passed: what the run deletes (or would).
    outbox_passed: int = 0
    outbox_deleted: int = 0
    outbox_batches: int = 0
    dlq_resolved_old: int = 0
    dlq_deleted: int = 0
    dlq_batches: int = 0
    # Idempotency keys of sync.enqueue taken before the cutoff, and how many went.
    enqueue_keys_old: int = 0
    enqueue_keys_deleted: int = 0
    enqueue_keys_batches: int = 0
    lagging: list[LaggingConsumer] = field(default_factory=list)

    @property
    def outbox_kept(self) -> int:
        """Old rows left in place because some consumer still needs them."""
        return max(0, self.outbox_old - self.outbox_passed)

    def summary(self) -> str:
        """One line for people."""
        age = f"older than {format_duration(self.older_than)}"
        if self.dry_run:
            outbox, dlq = self.outbox_passed, self.dlq_resolved_old
            head, verb, keep = "cleanup (dry run, nothing deleted)", "would delete", "would keep"
        else:
            outbox, dlq = self.outbox_deleted, self.dlq_deleted
            head, verb, keep = "cleanup", "deleted", "kept"
        keys = self.enqueue_keys_old if self.dry_run else self.enqueue_keys_deleted
        # Said only when there are any: most databases never enqueue with a key.
        keys_text = f" and {keys} idempotency key(s)" if keys else ""
        if self.consumers == 0:
            would = "would be" if self.dry_run else "was"
            return (
                f"{head}: no consumer is registered, so no outbox row {would} deleted "
                f"({self.outbox_old} {age}; a consumer registered later starts from the "
                f"beginning); {verb} {dlq} resolved dead letter(s){keys_text} {age}"
            )
        text = (
            f"{head}: {verb} {outbox} outbox row(s) {age}"
            f"{'' if self.dry_run else f' in {self.outbox_batches} batch(es)'}"
            f" and {dlq} resolved dead letter(s){keys_text}"
        )
        if self.lagging:
            names = ", ".join(c.consumer for c in self.lagging)
            text += (
                f"; {keep} {self.outbox_kept} old row(s) that {len(self.lagging)} lagging "
                f"consumer(s) still need: {names}"
            )
        return text

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `cleanup --json`."""
        return {
            "dry_run": self.dry_run,
            "older_than_seconds": int(self.older_than.total_seconds()),
            "cutoff": self.cutoff.isoformat(),
            "batch_size": self.batch_size,
            "consumers": self.consumers,
            "outbox": {
                "old": self.outbox_old,
                "passed": self.outbox_passed,
                "deleted": self.outbox_deleted,
                "batches": self.outbox_batches,
                "kept": self.outbox_kept,
            },
            "dead_letters": {
                "resolved_old": self.dlq_resolved_old,
                "deleted": self.dlq_deleted,
                "batches": self.dlq_batches,
            },
            "enqueue_keys": {
                "old": self.enqueue_keys_old,
                "deleted": self.enqueue_keys_deleted,
                "batches": self.enqueue_keys_batches,
            },
            "lagging": [c.to_dict() for c in self.lagging],
        }


def lagging_hint(lagging: LaggingConsumer, cutoff: datetime) -> str:
    """One line saying which consumer pins old rows and how an operator lets them go."""
    return (
        f"consumer {lagging.consumer} at {lagging.position} still needs "
        f"{lagging.old_rows_needed} outbox row(s) older than the retention (oldest "
        f"{lagging.oldest_needed_at.isoformat() if lagging.oldest_needed_at else '?'}); "
        "they are kept. If it should skip them: `serversync offsets reset "
        f"{lagging.consumer} --to-datetime {cutoff.isoformat()}`; if it no longer runs: "
        f"`serversync consumers remove {lagging.consumer}`"
    )


async def cleanup(
    conn: psycopg.AsyncConnection[Any],
    *,
    older_than: timedelta,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
) -> CleanupReport:
    """Delete old outbox rows every consumer has passed and old resolved dead letters.

    `conn` must be in autocommit mode: every batch is its own transaction. A dry run counts and
    deletes nothing. Progress is logged per batch; lagging consumers are logged as warnings and
    listed in the report. Raises CleanupError if another cleanup runs or a statement fails.
    """
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}, not {batch_size}")
    report: CleanupReport | None = None
    try:
        row = await (
            await conn.execute(query("retention_cutoff"), {"older_than": older_than})
        ).fetchone()
        assert row is not None
        report = CleanupReport(older_than, row[0], dry_run, batch_size)
        if dry_run:
            await _plan(conn, report)
            return report
        locked = await (await conn.execute(query("retention_try_lock"))).fetchone()
        if not locked or not locked[0]:
            raise CleanupError("another serversync cleanup is running on this database")
        try:
            await _plan(conn, report)
            if report.consumers:
                await _delete_outbox(conn, report)
            await _delete_dead_letters(conn, report)
            await _delete_enqueue_keys(conn, report)
        finally:
            # A broken connection has released the lock with its session already.
            with contextlib.suppress(psycopg.Error):
                await conn.execute(query("retention_unlock"))
    except psycopg.Error as exc:
        done = (
            f" after deleting {report.outbox_deleted} outbox row(s) and {report.dlq_deleted} "
            "dead letter(s)"
            if report is not None and not dry_run
            else ""
        )
        raise CleanupError(f"cleanup failed{done}: {first_line(exc)}") from exc
    return report


async def _plan(conn: psycopg.AsyncConnection[Any], report: CleanupReport) -> None:
    params = {"cutoff": report.cutoff}
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(query("retention_consumer_needs"), params)
        needs = await cur.fetchall()
        await cur.execute(query("retention_outbox_plan"), params)
        plan = await cur.fetchone()
    assert plan is not None
    row = await (await conn.execute(query("retention_dlq_count"), params)).fetchone()
    keys = await (await conn.execute(query("retention_enqueue_keys_count"), params)).fetchone()
    report.enqueue_keys_old = int(keys[0]) if keys else 0
    report.consumers = len(needs)
    report.outbox_old = int(plan["old_rows"])
    report.outbox_passed = int(plan["passed_rows"])
    report.dlq_resolved_old = int(row[0]) if row else 0
    report.lagging = [
        LaggingConsumer(
            consumer=n["consumer"],
            position=Position(int(n["last_txid"]), int(n["last_seq"])),
            updated_at=n["updated_at"],
            old_rows_needed=int(n["old_rows_needed"]),
            oldest_needed_at=n["oldest_needed_at"],
        )
        for n in needs
        if n["old_rows_needed"]
    ]
    if not needs:
        log.warning(
            "cleanup: no consumer is registered; no outbox row is deleted (a consumer registered "
            "later starts from the beginning of the outbox)",
            extra={"old_rows": report.outbox_old},
        )
    for lagging in report.lagging:
        log.warning(
            "cleanup: %s",
            lagging_hint(lagging, report.cutoff),
            extra={
                "consumer": lagging.consumer,
                "position": str(lagging.position),
                "old_rows_needed": lagging.old_rows_needed,
            },
        )


async def delete_outbox_batch(
    conn: psycopg.AsyncConnection[Any], cutoff: datetime, after: Position, limit: int
) -> tuple[int, Position | None]:
    """Delete up to `limit` rows created before `cutoff` that every consumer has passed, the
    first ones in position order after `after`; how many went and the last one's position.

    One statement: on an autocommit connection, its own short transaction.
    """
    cur = await conn.execute(
        query("retention_delete_outbox"),
        {"cutoff": cutoff, "after_txid": str(after.txid), "after_seq": after.seq, "limit": limit},
    )
    row = await cur.fetchone()
    assert row is not None
    deleted, last_txid, last_seq = row
    last = Position(int(last_txid), int(last_seq)) if deleted else None
    return int(deleted), last


async def _delete_outbox(conn: psycopg.AsyncConnection[Any], report: CleanupReport) -> None:
    after = Position.start()
    marked = False
    while True:
        if marked:
            deleted, last = await delete_outbox_batch(conn, report.cutoff, after, report.batch_size)
        else:
            # The first batch that deletes rows records in its own transaction that the outbox
            # no longer holds the whole history: a consumer registered from then on starts with
            # a snapshot, never with the outbox's start alone (snapshots.py).
            async with conn.transaction():
                deleted, last = await delete_outbox_batch(
                    conn, report.cutoff, after, report.batch_size
                )
                if deleted:
                    await mark_history_incomplete(
                        conn,
                        f"cleanup deleted outbox rows older than "
                        f"{format_duration(report.older_than)} (created before "
                        f"{report.cutoff.isoformat(timespec='seconds')})",
                    )
            marked = deleted > 0
        if not deleted:
            return
        report.outbox_batches += 1
        report.outbox_deleted += deleted
        _log_batch(OUTBOX, report.outbox_batches, deleted, report.outbox_deleted)
        # A short batch found every candidate there was: one more would only find nothing.
        if deleted < report.batch_size or last is None:
            return
        after = last


async def _delete_dead_letters(conn: psycopg.AsyncConnection[Any], report: CleanupReport) -> None:
    deleted, batches = await _delete_in_batches(conn, report, "retention_delete_dlq", DEAD_LETTERS)
    report.dlq_deleted, report.dlq_batches = deleted, batches


async def _delete_enqueue_keys(conn: psycopg.AsyncConnection[Any], report: CleanupReport) -> None:
    deleted, batches = await _delete_in_batches(
        conn, report, "retention_delete_enqueue_keys", ENQUEUE_KEYS
    )
    report.enqueue_keys_deleted, report.enqueue_keys_batches = deleted, batches


async def _delete_in_batches(
    conn: psycopg.AsyncConnection[Any], report: CleanupReport, name: str, table: str
) -> tuple[int, int]:
    """Run the batch delete `name` until a batch comes back short; the rows deleted and the
    batches that deleted any."""
    total = batches = 0
    while True:
        cur = await conn.execute(query(name), {"cutoff": report.cutoff, "limit": report.batch_size})
        row = await cur.fetchone()
        deleted = int(row[0]) if row else 0
        if not deleted:
            return total, batches
        batches += 1
        total += deleted
        _log_batch(table, batches, deleted, total)
        if deleted < report.batch_size:
            return total, batches


def _log_batch(table: str, batch: int, deleted: int, total: int) -> None:
    log.info(
        "cleanup: %s batch %d deleted %d row(s), %d so far",
        table,
        batch,
        deleted,
        total,
        extra={"table": table, "batch": batch, "deleted": deleted, "deleted_total": total},
    )
