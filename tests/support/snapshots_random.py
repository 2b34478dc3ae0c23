"""Randomized snapshot runs against real processes: two tracked tables (a bigint key and a text
key), producers that insert, update, delete and re-key their rows at random, snapshots written
by a separate process that is SIGKILLed at a random point and run again, and the comparison of
a receiver's live entities with the tables, row by row.

What the tests built on it assert: once producers stopped and the consumer passed the end of the
outbox, the reference receiver holds exactly the tables' rows (docs/design.md, Snapshots)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import random
import signal
import string
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import sql

from tests.conftest import fetch_all, fetch_value, wait_until
from tests.support.processes import Processes, ServersyncProcess

# The tables: `items`, keyed by a bigint, and `tags`, keyed by text of mixed case, spaces,
# punctuation and a non-ASCII letter, in an ICU collation where the server has one: its order is
# not the bytes' order, and a chunk's last key, kept as text, must be compared back in the
# column's own order.
ITEMS = "snap_items"
ITEM = "snap_item"
TAGS = "snap_tags"
TAG = "snap_tag"
TAG_COLLATION = "und-x-icu"
# Initial item ids are spaced out: ids drawn later fall between them, so a re-keyed or inserted
# row lands before, inside and after a chunk's key range.
ITEM_ID_STEP = 10
TAG_ALPHABET = string.ascii_letters + string.digits + " -_.é"

# The database's rows and the receiver's live entities, both as
# (entity type, entity id) -> the row's JSON as jsonb text (the relay sends to_json(row)).
DATABASE_ROWS = sql.SQL(
    "SELECT {item}::text, t.id::text, to_jsonb(t)::text FROM {items} t "
    "UNION ALL SELECT {tag}::text, t.code, to_jsonb(t)::text FROM {tags} t"
).format(
    item=sql.Literal(ITEM),
    items=sql.Identifier(ITEMS),
    tag=sql.Literal(TAG),
    tags=sql.Identifier(TAGS),
)
RECEIVER_ROWS = "SELECT entity_type, entity_id, payload::text FROM ingest.live_entities"

Rows = dict[tuple[str, str], str]


# -- the tables ------------------------------------------------------------------------------


@dataclass
class Keys:
    """Every key ever used in the tables, so that a key drawn for an insert or a re-key is new
    (a deleted row's key is not used again: no unique violation, no entity brought back by
    a key taken over). The producers share it; they run in one event loop, and a key is drawn
    and recorded with no await in between."""

    rng: random.Random
    item_ids: set[int] = field(default_factory=set)
    tag_codes: set[str] = field(default_factory=set)
    item_list: list[int] = field(default_factory=list)
    tag_list: list[str] = field(default_factory=list)

    def new_item_id(self) -> int:
        """An item id never used, between and above the initial ones."""
        while True:
            upper = max(self.item_list, default=0) + 3 * ITEM_ID_STEP
            candidate = self.rng.randint(1, upper)
            if candidate not in self.item_ids:
                self.item_ids.add(candidate)
                self.item_list.append(candidate)
                return candidate

    def new_tag_code(self) -> str:
        """A tag code never used: 1 to 8 characters, never blank at the start."""
        while True:
            first = self.rng.choice(string.ascii_letters + "é")
            rest = "".join(self.rng.choices(TAG_ALPHABET, k=self.rng.randint(0, 7)))
            code = first + rest
            if code not in self.tag_codes:
                self.tag_codes.add(code)
                self.tag_list.append(code)
                return code

    def some_item_id(self) -> int:
        """An item id used at some time (its row may be gone or re-keyed)."""
        return self.rng.choice(self.item_list)

    def some_tag_code(self) -> str:
        """A tag code used at some time (its row may be gone or re-keyed)."""
        return self.rng.choice(self.tag_list)


def item_values(rng: random.Random, item_id: int) -> tuple[int, str, Decimal, str]:
    """(id, label, amount, doc as JSON text) of an item row."""
    label = rng.choice(["plain", 'with "quotes"', "ünïcode ✓", "tab\tand\nnewline", ""])
    amount = Decimal(rng.randint(-(10**6), 10**6)) / 100
    doc = {
        "n": rng.randint(0, 10**9),
        "flags": rng.sample(["a", "b", "c", "d"], k=rng.randint(0, 4)),
        "nested": {"x": rng.random() < 0.5, "y": None},
    }
    return item_id, f"{label}:{rng.randint(0, 999)}", amount, json.dumps(doc)


async def create_tables(dsn: str, keys: Keys, *, items: int, tags: int) -> None:
    """Create and track the two tables (empty, so the outbox holds their whole history), then
    fill them: `items` item rows and `tags` tag rows, in a few transactions."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {} (id bigint PRIMARY KEY, label text NOT NULL, "
                "amount numeric(12, 2), doc jsonb NOT NULL)"
            ).format(sql.Identifier(ITEMS))
        )
        cur = await conn.execute(
            "SELECT EXISTS (SELECT FROM pg_collation WHERE collname = %s)", (TAG_COLLATION,)
        )
        found = await cur.fetchone()
        collation = (
            sql.SQL(" COLLATE {}").format(sql.Identifier(TAG_COLLATION))
            if found and found[0]
            else sql.SQL("")
        )
        await conn.execute(
            sql.SQL(
                "CREATE TABLE {} (code text{} PRIMARY KEY, note text, weight integer NOT NULL)"
            ).format(sql.Identifier(TAGS), collation)
        )
        await conn.execute("SELECT sync.track(%s, %s, 'id')", (ITEMS, ITEM))
        await conn.execute("SELECT sync.track(%s, %s, 'code')", (TAGS, TAG))
        item_rows = []
        for index in range(1, items + 1):
            item_id = index * ITEM_ID_STEP
            keys.item_ids.add(item_id)
            keys.item_list.append(item_id)
            item_rows.append(item_values(keys.rng, item_id))
        tag_rows = [(keys.new_tag_code(), "initial", keys.rng.randint(0, 100)) for _ in range(tags)]
        async with conn.cursor() as cur:
            for start in range(0, len(item_rows), 1000):
                await cur.executemany(
                    sql.SQL(
                        "INSERT INTO {} (id, label, amount, doc) VALUES (%s, %s, %s, %s)"
                    ).format(sql.Identifier(ITEMS)),
                    item_rows[start : start + 1000],
                )
            await cur.executemany(
                sql.SQL("INSERT INTO {} (code, note, weight) VALUES (%s, %s, %s)").format(
                    sql.Identifier(TAGS)
                ),
                tag_rows,
            )


# -- producers -------------------------------------------------------------------------------


@dataclass
class ProducerCounts:
    """What the producers did, for the test's report."""

    transactions: int = 0
    statements: int = 0
    rekeys: int = 0
    deletes: int = 0
    inserts: int = 0
    retried: int = 0


def _statement(keys: Keys, rng: random.Random, counts: ProducerCounts) -> sql.Composed:
    """One random change of one or a few rows (a missing row makes it change nothing)."""
    items, tags = sql.Identifier(ITEMS), sql.Identifier(TAGS)
    choice = rng.random()
    if choice < 0.30:
        _, label, amount, doc = item_values(rng, 0)
        return sql.SQL("UPDATE {} SET label = {}, amount = {}, doc = {} WHERE id = {}").format(
            items, label, amount, sql.Literal(doc) + sql.SQL("::jsonb"), keys.some_item_id()
        )
    if choice < 0.38:
        # Several rows in one statement: one outbox INSERT for all of them.
        low = keys.some_item_id()
        return sql.SQL(
            "UPDATE {} SET amount = coalesce(amount, 0) + 1 WHERE id BETWEEN {} AND {}"
        ).format(items, low, low + rng.randint(1, 4) * ITEM_ID_STEP)
    if choice < 0.48:
        counts.inserts += 1
        row = item_values(rng, keys.new_item_id())
        return sql.SQL("INSERT INTO {} (id, label, amount, doc) VALUES ({}, {}, {}, {})").format(
            items, row[0], row[1], row[2], sql.Literal(row[3]) + sql.SQL("::jsonb")
        )
    if choice < 0.56:
        counts.deletes += 1
        return sql.SQL("DELETE FROM {} WHERE id = {}").format(items, keys.some_item_id())
    if choice < 0.64:
        # A key change: the relay sends the old key's delete and the new key's upsert.
        counts.rekeys += 1
        return sql.SQL("UPDATE {} SET id = {} WHERE id = {}").format(
            items, keys.new_item_id(), keys.some_item_id()
        )
    if choice < 0.78:
        return sql.SQL("UPDATE {} SET note = {}, weight = weight + 1 WHERE code = {}").format(
            tags, f"note {rng.randint(0, 10**6)}", keys.some_tag_code()
        )
    if choice < 0.86:
        counts.inserts += 1
        return sql.SQL("INSERT INTO {} (code, note, weight) VALUES ({}, {}, {})").format(
            tags, keys.new_tag_code(), "new", rng.randint(0, 100)
        )
    if choice < 0.93:
        counts.deletes += 1
        return sql.SQL("DELETE FROM {} WHERE code = {}").format(tags, keys.some_tag_code())
    counts.rekeys += 1
    return sql.SQL("UPDATE {} SET code = {} WHERE code = {}").format(
        tags, keys.new_tag_code(), keys.some_tag_code()
    )


async def produce(
    dsn: str, keys: Keys, rng: random.Random, stop: asyncio.Event, counts: ProducerCounts
) -> None:
    """Transactions of 1 to 4 random changes until `stop` is set. A transaction pauses a few
    milliseconds between its statements and before its commit: a change in progress holds its
    rows' locks and its outbox rows' seqs while a snapshot chunk reads those rows."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        while not stop.is_set():
            try:
                async with conn.transaction():
                    for _ in range(rng.randint(1, 4)):
                        await conn.execute(_statement(keys, rng, counts))
                        counts.statements += 1
                        await asyncio.sleep(rng.uniform(0, 0.004))  # a producer's pace
            except (psycopg.errors.DeadlockDetected, psycopg.errors.SerializationFailure):
                # Two producers that locked rows in opposite orders: one gives up, as an
                # application would retry it.
                counts.retried += 1
                continue
            counts.transactions += 1
            await asyncio.sleep(rng.uniform(0, 0.003))  # a producer's pace


@contextlib.asynccontextmanager
async def producing(
    dsn: str, keys: Keys, rng: random.Random, *, producers: int = 3
) -> AsyncIterator[ProducerCounts]:
    """`producers` tasks writing at random while the block runs; stopped (their transactions
    ended) when it ends, and any failure of theirs raised."""
    stop = asyncio.Event()
    counts = ProducerCounts()
    tasks = [
        asyncio.create_task(produce(dsn, keys, random.Random(rng.random()), stop, counts))
        for _ in range(producers)
    ]
    try:
        yield counts
    finally:
        stop.set()
        done = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in done:
        if isinstance(outcome, BaseException):
            raise outcome


# -- snapshots in a process of their own -----------------------------------------------------


@dataclass(frozen=True)
class SnapshotPlan:
    """One snapshot as the operator asks for it: which tables (none: every tracked one), for
    which consumer (None: every one), the chunk size, the sweep, and how many SIGKILLs it
    suffers before it is let run to its end."""

    tables: tuple[str, ...]
    consumer: str | None
    chunk_size: int
    delete_missing: bool
    kills: int

    def args(self) -> list[str]:
        """`serversync snapshot ...` arguments."""
        args = ["snapshot", *self.tables, "--chunk-size", str(self.chunk_size)]
        if self.consumer is not None:
            args += ["--consumer", self.consumer]
        if self.delete_missing:
            args.append("--delete-missing")
        return args


def random_plan(
    rng: random.Random,
    consumer: str,
    *,
    tables: Sequence[Sequence[str]] = ((), (ITEMS,), (TAGS,), (ITEMS, TAGS)),
    delete_missing: bool = False,
    chunk_sizes: Sequence[int] = (7, 50, 333, 1000),
    kills: Sequence[int] = (0, 1, 1, 2, 3),
) -> SnapshotPlan:
    """A snapshot of a random scope, chunk size and number of kills."""
    return SnapshotPlan(
        tables=tuple(rng.choice(tables)),
        consumer=rng.choice([None, consumer]),
        chunk_size=rng.choice(chunk_sizes),
        delete_missing=delete_missing,
        kills=rng.choice(kills),
    )


@dataclass(frozen=True)
class SnapshotProgress:
    """The newest snapshot after a given id, as recorded."""

    id: int
    state: str
    rows_sent: int
    rows_total: int


async def newest_snapshot(dsn: str, after_id: int) -> SnapshotProgress | None:
    """The newest snapshot with an id above `after_id`, None while there is none."""
    rows = await fetch_all(
        dsn,
        "SELECT s.id, s.state, coalesce(sum(t.rows_sent), 0)::bigint, "
        "       coalesce(sum(t.rows_total), 0)::bigint "
        "FROM sync.snapshots s LEFT JOIN sync.snapshot_tables t ON t.snapshot_id = s.id "
        "WHERE s.id > %s GROUP BY s.id ORDER BY s.id DESC LIMIT 1",
        (after_id,),
    )
    if not rows:
        return None
    snapshot_id, state, sent, total = rows[0]
    return SnapshotProgress(int(snapshot_id), str(state), int(sent), int(total))


async def last_snapshot_id(dsn: str) -> int:
    """The id of the newest snapshot, 0 when there is none."""
    return int(await fetch_value(dsn, "SELECT coalesce(max(id), 0) FROM sync.snapshots"))


async def snapshot_unlocked(dsn: str, snapshot_id: int) -> bool:
    """No connection holds the lock of the snapshot's writer
    (consumer/store/snapshot_writer.py): the backend of a killed writer has ended, and a new one
    may take over."""
    held = await fetch_value(
        dsn,
        "SELECT count(*) FROM pg_locks l "
        "WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.objid = %s::bigint::oid "
        "  AND l.classid = ((hashtext('serversync.snapshot')::bigint + 4294967296) "
        "                   %% 4294967296)::oid "
        "  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        (snapshot_id,),
    )
    return int(held) == 0


@dataclass
class SnapshotRun:
    """What running one snapshot plan did."""

    snapshot_id: int
    kills: int
    starts: int
    rows_sent: int


async def wait_kill_point(
    dsn: str, after_id: int, process: ServersyncProcess, sent_before: int, fraction: float
) -> None:
    """Wait until the snapshot process sent rows in this run, and then until it reached a point
    `fraction` of the way through what was left (at least one row in), or ended."""
    target: int | None = None

    async def reached() -> bool:
        nonlocal target
        if process.returncode is not None:
            return True
        progress = await newest_snapshot(dsn, after_id)
        if progress is None or progress.rows_sent <= sent_before:
            return False
        if target is None:
            left = max(1, progress.rows_total - sent_before)
            target = sent_before + max(1, int(left * fraction))
        return progress.rows_sent >= target

    await wait_until(reached, timeout=60, interval=0.005, what=f"{process.name} to send rows")


async def run_plan(
    procs: Processes, dsn: str, plan: SnapshotPlan, rng: random.Random, *, name: str
) -> SnapshotRun:
    """Run `serversync snapshot` as `plan` says: SIGKILL it up to `plan.kills` times, each at a
    random number of rows sent (once this run sent some), and resume it by running the same
    command again, until a run is let end; fails unless the snapshot is done then, and is the
    one snapshot these runs recorded."""
    before = await last_snapshot_id(dsn)
    kills = starts = 0
    while True:
        progress = await newest_snapshot(dsn, before)
        if progress is not None and progress.state != "running":
            break  # done before the kill came (between its last chunk and its exit)
        sent_before = progress.rows_sent if progress is not None else 0
        starts += 1
        process = procs.start(f"{name}-{starts}", plan.args(), DATABASE_URL=dsn)
        if kills >= plan.kills:
            code = await process.wait_exit(90)
            assert code == 0, f"{process.name} exited with {code}:\n{process.log()}"
            break
        # At most 90% of the way: a kill drawn lands before the end.
        await wait_kill_point(dsn, before, process, sent_before, rng.uniform(0.0, 0.9))
        if process.returncode is not None:
            # It ended before the point chosen: nothing left to kill.
            assert process.returncode == 0, f"{process.name} failed:\n{process.log()}"
            break
        process.kill()
        assert await process.wait_exit(10) == -signal.SIGKILL
        kills += 1
        killed = await newest_snapshot(dsn, before)
        assert killed is not None
        await wait_until(
            functools.partial(snapshot_unlocked, dsn, killed.id),
            timeout=20,
            what=f"the killed writer of snapshot {killed.id} to let go of it",
        )
    progress = await newest_snapshot(dsn, before)
    assert progress is not None, "no snapshot was recorded"
    assert progress.state == "done", f"snapshot {progress.id} is {progress.state}"
    # Every run after the first resumed the snapshot the first began.
    recorded = await fetch_all(
        dsn, "SELECT id, state FROM sync.snapshots WHERE id > %s ORDER BY id", (before,)
    )
    assert len(recorded) == 1, f"{name}: {starts} runs recorded snapshots {recorded}"
    return SnapshotRun(progress.id, kills, starts, progress.rows_sent)


# -- comparing -------------------------------------------------------------------------------


async def database_rows(dsn: str) -> Rows:
    """The tables' rows, as the receiver should hold them."""
    return {(t, k): p for t, k, p in await fetch_all(dsn, DATABASE_ROWS)}


async def receiver_rows(dsn: str) -> Rows:
    """The receiver's live entities."""
    return {(t, k): p for t, k, p in await fetch_all(dsn, RECEIVER_ROWS)}


def differences(expected: Rows, actual: Rows, *, examples: int = 5) -> str:
    """'' when equal; else how they differ: rows missing at the receiver, entities it holds
    that no row is (deleted or moved away), and entities whose payload is not the row's."""
    missing = sorted(expected.keys() - actual.keys())
    extra = sorted(actual.keys() - expected.keys())
    stale = sorted(k for k in expected.keys() & actual.keys() if expected[k] != actual[k])
    if not (missing or extra or stale):
        return ""
    lines = [
        f"{len(expected)} rows in the database, {len(actual)} live entities at the receiver: "
        f"{len(missing)} missing, {len(extra)} extra, {len(stale)} stale"
    ]
    lines += [f"  missing {k}: {expected[k]}" for k in missing[:examples]]
    lines += [f"  extra {k}: {actual[k]}" for k in extra[:examples]]
    lines += [
        f"  stale {k}: receiver {actual[k]} != database {expected[k]}" for k in stale[:examples]
    ]
    return "\n".join(lines)


async def dead_letters(dsn: str) -> list[tuple[Any, ...]]:
    """Parked events (none is expected: every entry is one the receiver takes)."""
    return await fetch_all(
        dsn,
        "SELECT consumer, seq, op, entity_type, entity_id, error_message FROM sync.dlq_messages",
    )
