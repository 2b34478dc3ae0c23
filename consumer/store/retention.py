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

What a cleanup reads does not grow with the outbox. No index on created_at finds old rows (one
would cost every producer's row more than it saves a daily cleanup: sql/backend/schema.sql), so
the outbox is never counted whole:

* The old rows, and those every consumer has passed, are estimated from a sample of about
  SAMPLE_BLOCKS of the outbox's blocks (exact when the outbox has no more blocks than that).
  What each consumer still needs is counted exactly among the first EXACT_COUNT_UP_TO rows after
  its position (all of them for a consumer that keeps up) and estimated from the sample beyond.
  The report says which figures are estimates; what a run deleted is always counted.
* The deletes walk the primary key in position order, from the outbox's start up to the floor
  (the position of the consumer furthest behind). Each batch looks at a window of at most
  max(batch size, OUTBOX_WINDOW_MIN) rows after where the last one stopped and deletes the old
  ones among them, so a batch costs the same at any outbox size. The walk ends at the floor, or
  after YOUNGER_ROWS_TO_STOP rows in a row younger than the cutoff: rows are written in position
  order, so what follows is younger too, except rows of a transaction that was open across the
  cutoff, which go in a later run. Without that end, a run would read every row younger than the
  retention (most of the outbox: a daily cleanup with a 30-day retention deletes a 31st of it).

The idempotency keys of sync.enqueue go with the outbox rows of the same age: a key taken before
the cutoff is deleted, so a request repeated after the retention is an event again. Keys do not
wait for consumers: a key only stops a repeat, and the event it let through has its own row.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
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
    "EXACT_COUNT_UP_TO",
    "MAX_BATCH_SIZE",
    "MAX_RETENTION",
    "OUTBOX",
    "OUTBOX_WINDOW_MIN",
    "SAMPLE_BLOCKS",
    "YOUNGER_ROWS_TO_STOP",
    "CleanupError",
    "CleanupReport",
    "LaggingConsumer",
    "OutboxWindow",
    "ReadBounds",
    "RegisteredConsumer",
    "RemovedConsumer",
    "UnknownConsumerError",
    "cleanup",
    "consumer_sessions",
    "delete_outbox_batch",
    "delete_outbox_window",
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
# Rows after a consumer's position read to count what it still needs exactly; a consumer with
# more is estimated from the sample (the status backlog's bound: consumer.store.admin).
EXACT_COUNT_UP_TO = 10_000
# Blocks of the outbox the plan samples (16 MiB, some 40,000 rows): a few per cent of error on
# the old rows' count, read in tens of milliseconds at any outbox size.
SAMPLE_BLOCKS = 2_000
# The fewest rows a delete batch looks at: a small --batch-size still walks younger rows in
# steps of this many, not row by row.
OUTBOX_WINDOW_MIN = 1_000
# The walk ends after this many rows in a row younger than the cutoff (the module's docstring).
YOUNGER_ROWS_TO_STOP = 100_000

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
    # old_rows_needed is estimated from the plan's sample (more than EXACT_COUNT_UP_TO rows
    # follow the position), and oldest_needed_at is the oldest of those seen.
    estimated: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON shape of `cleanup --json`."""
        return {
            "consumer": self.consumer,
            "position": str(self.position),
            "last_txid": str(self.position.txid),
            "last_seq": self.position.seq,
            "updated_at": self.updated_at.isoformat(),
            "old_rows_needed": self.old_rows_needed,
            "old_rows_needed_estimated": self.estimated,
            "oldest_needed_at": (
                self.oldest_needed_at.isoformat() if self.oldest_needed_at else None
            ),
        }


@dataclass(frozen=True)
class OutboxWindow:
    """What one delete batch did: how many rows it deleted and the last one's position; how many
    rows its window held (`examined`) and the last one's position; and how many of those follow
    the last row it picked (all of them when it picked none): younger rows at the window's end."""

    deleted: int
    last_deleted: Position | None
    examined: int
    last_examined: Position | None
    younger_at_end: int


@dataclass(frozen=True)
class ReadBounds:
    """How much of the outbox a cleanup reads (the module's docstring): the defaults, or smaller
    ones that make a small outbox behave as a large one does."""

    exact_up_to: int = EXACT_COUNT_UP_TO
    sample_blocks: int = SAMPLE_BLOCKS
    younger_rows_to_stop: int = YOUNGER_ROWS_TO_STOP


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
    # The share of the outbox's blocks the plan read (100: all of them, the counts are exact),
    # and which figures are estimates: outbox_old, and the old rows the consumer furthest behind
    # still needs (outbox_kept). outbox_passed is their difference.
    outbox_sampled_percent: float = 100.0
    outbox_old_estimated: bool = False
    outbox_kept_estimated: bool = False
    # The delete walk: statements run (batches that deleted nothing included), rows looked at,
    # the slowest statement, and where it ended ("floor", "younger_rows", or "" before it ran).
    outbox_statements: int = 0
    outbox_examined: int = 0
    outbox_slowest_statement_seconds: float = 0.0
    outbox_walk_end: str = ""

    @property
    def outbox_kept(self) -> int:
        """Old rows left in place because some consumer still needs them."""
        return max(0, self.outbox_old - self.outbox_passed)

    @property
    def outbox_passed_estimated(self) -> bool:
        """Whether outbox_passed is an estimate."""
        return self.outbox_old_estimated or self.outbox_kept_estimated

    def summary(self) -> str:
        """One line for people."""
        age = f"older than {format_duration(self.older_than)}"
        if self.dry_run:
            outbox = _about(self.outbox_passed_estimated) + str(self.outbox_passed)
            dlq = self.dlq_resolved_old
            head, verb, keep = "cleanup (dry run, nothing deleted)", "would delete", "would keep"
        else:
            outbox = str(self.outbox_deleted)
            dlq = self.dlq_deleted
            head, verb, keep = "cleanup", "deleted", "kept"
        keys = self.enqueue_keys_old if self.dry_run else self.enqueue_keys_deleted
        # Said only when there are any: most databases never enqueue with a key.
        keys_text = f" and {keys} idempotency key(s)" if keys else ""
        if self.consumers == 0:
            would = "would be" if self.dry_run else "was"
            text = (
                f"{head}: no consumer is registered, so no outbox row {would} deleted "
                f"({_about(self.outbox_old_estimated)}{self.outbox_old} {age}; a consumer "
                f"registered later starts from the beginning); {verb} {dlq} resolved dead "
                f"letter(s){keys_text} {age}"
            )
            return text + self._estimate_note(self.outbox_old_estimated)
        text = (
            f"{head}: {verb} {outbox} outbox row(s) {age}"
            f"{'' if self.dry_run else f' in {self.outbox_batches} batch(es)'}"
            f" and {dlq} resolved dead letter(s){keys_text}"
        )
        shown_estimate = self.dry_run and self.outbox_passed_estimated
        if self.lagging:
            names = ", ".join(c.consumer for c in self.lagging)
            text += (
                f"; {keep} {_about(self.outbox_kept_estimated)}{self.outbox_kept} old row(s) "
                f"that {len(self.lagging)} lagging consumer(s) still need: {names}"
            )
            shown_estimate = shown_estimate or self.outbox_kept_estimated
        return text + self._estimate_note(shown_estimate)

    def _estimate_note(self, shown: bool) -> str:
        if not shown:
            return ""
        return (
            f" (about: estimated from a sample of {self.outbox_sampled_percent:.2g}% of the "
            "outbox's blocks)"
        )

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
            # Added beside "outbox" rather than in it: its shape is what scripts read.
            "outbox_estimated": {
                "old": self.outbox_old_estimated,
                "passed": self.outbox_passed_estimated,
                "kept": self.outbox_kept_estimated,
                "sampled_percent": self.outbox_sampled_percent,
            },
            "outbox_walk": {
                "statements": self.outbox_statements,
                "rows_examined": self.outbox_examined,
                "slowest_ms": round(self.outbox_slowest_statement_seconds * 1000, 2),
                "ended": self.outbox_walk_end or None,
            },
        }


def _about(estimated: bool) -> str:
    return "about " if estimated else ""


def lagging_hint(lagging: LaggingConsumer, cutoff: datetime) -> str:
    """One line saying which consumer pins old rows and how an operator lets them go."""
    return (
        f"consumer {lagging.consumer} at {lagging.position} still needs "
        f"{_about(lagging.estimated)}{lagging.old_rows_needed} outbox row(s) older than the "
        "retention (oldest "
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
    bounds: ReadBounds = ReadBounds(),
) -> CleanupReport:
    """Delete old outbox rows every consumer has passed and old resolved dead letters.

    `conn` must be in autocommit mode: every batch is its own transaction. A dry run counts
    (estimating beyond `bounds`) and deletes nothing. Progress is logged per batch; lagging
    consumers are logged as warnings and listed in the report. Raises CleanupError if another
    cleanup runs or a statement fails.
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
            await _plan(conn, report, bounds)
            return report
        locked = await (await conn.execute(query("retention_try_lock"))).fetchone()
        if not locked or not locked[0]:
            raise CleanupError("another serversync cleanup is running on this database")
        try:
            await _plan(conn, report, bounds)
            if report.consumers:
                await _delete_outbox(conn, report, bounds.younger_rows_to_stop)
            if report.outbox_deleted:
                await conn.execute(query("retention_outbox_first"))
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


async def _plan(
    conn: psycopg.AsyncConnection[Any], report: CleanupReport, bounds: ReadBounds
) -> None:
    params = {
        "cutoff": report.cutoff,
        "exact_up_to": bounds.exact_up_to,
        "sample_blocks": bounds.sample_blocks,
    }
    # One read-only transaction: no xid, so it holds back no consumer.
    async with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        # The walks' cost estimates (LIMIT exact_up_to + 1 per consumer) reach jit_above_cost
        # with a few dozen consumers: compiling would cost more than reading.
        await cur.execute("SET LOCAL jit = off")
        await cur.execute(query("retention_consumer_needs"), params)
        needs = await cur.fetchall()
        await cur.execute(query("retention_outbox_plan"), params)
        sampled = {row["consumer"]: row for row in await cur.fetchall()}
        await cur.execute(query("retention_dlq_count"), params)
        row = await cur.fetchone()
        await cur.execute(query("retention_enqueue_keys_count"), params)
        keys = await cur.fetchone()
    report.enqueue_keys_old = int(keys["count"]) if keys else 0
    report.dlq_resolved_old = int(row["count"]) if row else 0
    report.consumers = len(needs)

    # The sample's counts scale by 100 / percent; a sample of every block counts exactly.
    percent = float(next(iter(sampled.values()))["percent"])
    whole = percent >= 100.0
    scale = 100.0 / percent if percent > 0 else 0.0
    report.outbox_sampled_percent = round(min(percent, 100.0), 4)
    report.outbox_old_estimated = not whole
    old = int(next(iter(sampled.values()))["old_rows"])
    report.outbox_old = old if whole else round(old * scale)

    needed: list[LaggingConsumer] = []
    for n in needs:
        sample = sampled.get(n["consumer"])
        walked_all = int(n["walked"]) <= bounds.exact_up_to
        count = int(n["old_rows_needed"])
        oldest = n["oldest_needed_at"]
        if not walked_all and sample is not None:
            # The walk counted the first rows after the position; the sample sees beyond them.
            in_sample = int(sample["old_rows_needed"])
            count = max(count, in_sample if whole else round(in_sample * scale))
            seen = [t for t in (oldest, sample["oldest_needed_at"]) if t is not None]
            oldest = min(seen) if seen else None
        # (A consumer registered between the two queries has no sample row: its walk's count
        # is all there is.)
        estimated = not (walked_all or (whole and sample is not None))
        needed.append(
            LaggingConsumer(
                consumer=n["consumer"],
                position=Position(int(n["last_txid"]), int(n["last_seq"])),
                updated_at=n["updated_at"],
                old_rows_needed=count,
                oldest_needed_at=oldest,
                estimated=estimated,
            )
        )
    if needed:
        # The consumer furthest behind needs the most; every other old row has been passed.
        furthest = min(needed, key=lambda c: c.position)
        report.outbox_old = max(report.outbox_old, furthest.old_rows_needed)
        report.outbox_kept_estimated = furthest.estimated
        report.outbox_passed = report.outbox_old - furthest.old_rows_needed
    report.lagging = [c for c in needed if c.old_rows_needed]
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
                "old_rows_needed_estimated": lagging.estimated,
            },
        )


async def delete_outbox_window(
    conn: psycopg.AsyncConnection[Any], cutoff: datetime, after: Position, limit: int, window: int
) -> OutboxWindow:
    """Of the next `window` rows after `after` in position order that every consumer has
    passed, delete the first `limit` created before `cutoff`.

    One statement: on an autocommit connection, its own short transaction.
    """
    async with conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(
            query("retention_delete_outbox"),
            {
                "cutoff": cutoff,
                "after_txid": str(after.txid),
                "after_seq": after.seq,
                "limit": limit,
                "window": window,
            },
        )
        row = await cur.fetchone()
    assert row is not None
    deleted, examined = int(row["deleted"]), int(row["examined"])
    return OutboxWindow(
        deleted=deleted,
        last_deleted=Position(int(row["last_txid"]), int(row["last_seq"])) if deleted else None,
        examined=examined,
        last_examined=(Position(int(row["end_txid"]), int(row["end_seq"])) if examined else None),
        younger_at_end=int(row["young_tail"]),
    )


async def delete_outbox_batch(
    conn: psycopg.AsyncConnection[Any], cutoff: datetime, after: Position, limit: int
) -> tuple[int, Position | None]:
    """Delete up to `limit` rows created before `cutoff` that every consumer has passed, the
    first ones in position order after `after` among the next max(limit, OUTBOX_WINDOW_MIN)
    rows; how many went and the last one's position.

    One statement: on an autocommit connection, its own short transaction.
    """
    batch = await delete_outbox_window(conn, cutoff, after, limit, max(limit, OUTBOX_WINDOW_MIN))
    return batch.deleted, batch.last_deleted


async def _delete_outbox(
    conn: psycopg.AsyncConnection[Any], report: CleanupReport, younger_rows_to_stop: int
) -> None:
    """Walk the outbox in position order up to the floor, deleting the old rows every consumer
    has passed, a window at a time (the module's docstring says where the walk ends)."""
    limit = report.batch_size
    after = Position.start()
    # While windows hold nothing but old rows, a window is a batch; once younger rows show up
    # it widens, so that a small batch size does not walk them a few rows per statement.
    window = limit
    younger = 0
    marked = False
    while True:
        started = time.perf_counter()
        if marked:
            batch = await delete_outbox_window(conn, report.cutoff, after, limit, window)
        else:
            # The first batch that deletes rows records in its own transaction that the outbox
            # no longer holds the whole history: a consumer registered from then on starts with
            # a snapshot, never with the outbox's start alone (snapshots.py).
            async with conn.transaction():
                batch = await delete_outbox_window(conn, report.cutoff, after, limit, window)
                if batch.deleted:
                    await mark_history_incomplete(
                        conn,
                        f"cleanup deleted outbox rows older than "
                        f"{format_duration(report.older_than)} (created before "
                        f"{report.cutoff.isoformat(timespec='seconds')})",
                    )
            marked = batch.deleted > 0
        elapsed = time.perf_counter() - started
        report.outbox_statements += 1
        report.outbox_examined += batch.examined
        report.outbox_slowest_statement_seconds = max(
            report.outbox_slowest_statement_seconds, elapsed
        )
        if batch.deleted:
            report.outbox_batches += 1
            report.outbox_deleted += batch.deleted
            _log_batch(OUTBOX, report.outbox_batches, batch.deleted, report.outbox_deleted, elapsed)
        if batch.deleted == limit and batch.last_deleted is not None:
            # A full batch: old rows may follow in the window; the next one starts after it,
            # with a window of one batch again.
            after, younger, window = batch.last_deleted, 0, limit
            continue
        if batch.examined < window or batch.last_examined is None:
            report.outbox_walk_end = "floor"  # or the outbox's end, which is behind it
            return
        window = max(limit, OUTBOX_WINDOW_MIN)
        younger = batch.younger_at_end if batch.deleted else younger + batch.younger_at_end
        if younger >= younger_rows_to_stop:
            report.outbox_walk_end = "younger_rows"
            # Not tagged with the table: the per-batch progress lines are.
            log.info(
                "cleanup: the last %d outbox row(s) looked at, up to %s, are younger than the "
                "cutoff; the walk ends there (older rows behind them go in a later run)",
                younger,
                batch.last_examined,
                extra={"younger_rows": younger, "position": str(batch.last_examined)},
            )
            return
        after = batch.last_examined


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
        started = time.perf_counter()
        cur = await conn.execute(query(name), {"cutoff": report.cutoff, "limit": report.batch_size})
        row = await cur.fetchone()
        deleted = int(row[0]) if row else 0
        if not deleted:
            return total, batches
        batches += 1
        total += deleted
        _log_batch(table, batches, deleted, total, time.perf_counter() - started)
        if deleted < report.batch_size:
            return total, batches


def _log_batch(table: str, batch: int, deleted: int, total: int, seconds: float) -> None:
    log.info(
        "cleanup: %s batch %d deleted %d row(s), %d so far",
        table,
        batch,
        deleted,
        total,
        extra={
            "table": table,
            "batch": batch,
            "deleted": deleted,
            "deleted_total": total,
            "seconds": round(seconds, 4),
        },
    )
