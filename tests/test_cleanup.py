"""Retention: `serversync cleanup` deletes only old outbox rows every consumer has passed (and old
resolved dead letters), in short batches that never block producers; `serversync consumers`
lists and deregisters consumers. Real PostgreSQL, the CLI as a real subprocess, a real consumer
delivering to the reference receiver."""

from __future__ import annotations

import asyncio
import os
import random
import socket
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any

import orjson
import psycopg
import pytest

from consumer.core.events import Position
from consumer.store import retention
from consumer.store.db import application_name
from consumer.store.retention import CleanupReport, parse_duration
from tests.conftest import (
    CliResult,
    cli_env,
    fetch_all,
    fetch_value,
    make_settings,
    running_consumer,
    wait_until,
)
from tests.support.backend import add_events
from tests.support.cli import assert_ok, assert_one_line_error
from tests.support.cli import run_cli as run_cli_with
from tests.support.waiting import wait_caught_up, wait_delivered_events

CONSUMER = "frontend-sync"
RETENTION = timedelta(days=30)
OLD = "40 days"  # well past the retention
YOUNG = "1 day"
# Positions in delivery order. ORDER BY o.txid: a bare `txid` would name the text column.
ROWS = "SELECT o.txid::text, o.seq FROM sync.events_outbox o ORDER BY o.txid, o.seq"


# -- running the command -------------------------------------------------------------------------


async def run_cli(dsn: str, *args: str, timeout: float = 60.0) -> CliResult:
    """`serversync ARGS...` against `dsn`, to the end."""
    return await run_cli_with(*args, env=cli_env(DATABASE_URL=dsn), timeout=timeout)


def batch_logs(result: CliResult, table: str) -> list[dict[str, Any]]:
    """The per-batch progress lines of one table."""
    return [line for line in result.logs() if line.get("table") == table]


# -- backend data --------------------------------------------------------------------------------


# A position past every row any test writes. Not a "large" real txid: a shared server's
# transaction counter passes any such number in time (this one passed 10**7 here).
PAST_EVERYTHING = Position(2**62, 0)


async def add_rows(dsn: str, n: int, *, age: str = "0 days", txid: int | None = None) -> None:
    """`n` outbox rows in one statement, created `age` ago, of the given (or this) transaction."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "INSERT INTO sync.events_outbox "
            "(txid, op, entity_type, entity_id, payload, created_at) "
            "SELECT coalesce(%(txid)s::xid8, pg_current_xact_id()), 'upsert', 'thing', g::text, "
            "'{}', now() - %(age)s::interval FROM generate_series(1, %(n)s) g",
            {"txid": None if txid is None else str(txid), "age": age, "n": n},
        )


async def positions(dsn: str) -> list[Position]:
    """Every outbox row's position, in delivery order."""
    return [Position(int(t), int(s)) for t, s in await fetch_all(dsn, ROWS)]


async def make_old(dsn: str, rows: list[Position]) -> None:
    """Backdate these rows past the retention."""
    await fetch_all(
        dsn,
        "UPDATE sync.events_outbox SET created_at = now() - %s::interval "
        "WHERE seq = ANY(%s) RETURNING seq",
        (OLD, [p.seq for p in rows]),
    )


async def place(dsn: str, consumer: str, at: Position) -> None:
    """Register `consumer` (or move it) at position `at`."""
    await fetch_all(
        dsn,
        "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq) "
        "VALUES (%s, %s::xid8, %s) ON CONFLICT (consumer) DO UPDATE "
        "SET last_txid = EXCLUDED.last_txid, last_seq = EXCLUDED.last_seq RETURNING consumer",
        (consumer, str(at.txid), at.seq),
    )


async def add_dead_letter(
    dsn: str, consumer: str, seq: int, status: str, *, updated: str = YOUNG
) -> None:
    """A parked event with `status`, last changed `updated` ago (an INSERT sets updated_at as
    given: the trigger that stamps it fires on UPDATE only)."""
    await fetch_all(
        dsn,
        "INSERT INTO sync.dlq_messages (consumer, seq, entity_type, entity_id, op, payload, "
        "error_code, error_message, status, created_at, updated_at) "
        "VALUES (%(consumer)s, %(seq)s, 'thing', %(seq)s::text, 'upsert', '{}', 'HTTP_422', "
        "'refused', %(status)s, now() - %(updated)s::interval - interval '1 day', "
        "now() - %(updated)s::interval) RETURNING id",
        {"consumer": consumer, "seq": seq, "status": status, "updated": updated},
    )


def no_sessions(dsn: str, consumer: str = CONSUMER) -> Callable[[], Awaitable[bool]]:
    """A condition: no process of `consumer` has a session open."""

    async def check() -> bool:
        conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        async with conn:
            return not await retention.consumer_sessions(conn, consumer)

    return check


async def run_cleanup(dsn: str, **options: Any) -> CleanupReport:
    """The cleanup in this process, on its own autocommit connection."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        return await retention.cleanup(conn, older_than=RETENTION, **options)


# -- what goes and what stays --------------------------------------------------------------------


async def test_cleanup_deletes_only_old_rows_every_consumer_has_passed(backend_dsn: str) -> None:
    await add_events(backend_dsn, 30, "c", wait_final=False)
    rows = await positions(backend_dsn)
    await make_old(backend_dsn, rows[:20])
    # audit has passed the first 10 events, billing all of them.
    await place(backend_dsn, "audit", rows[9])
    await place(backend_dsn, "billing", rows[-1])

    result = await run_cli(backend_dsn, "cleanup")
    assert_ok(result)
    assert await positions(backend_dsn) == rows[10:]
    assert result.stdout == (
        "cleanup: deleted 10 outbox row(s) older than 30d in 1 batch(es) and 0 resolved dead "
        "letter(s); kept 10 old row(s) that 1 lagging consumer(s) still need: audit\n"
    )
    # The lagging consumer is reported with its position, what it pins, and the way out.
    (warning,) = [line for line in result.logs() if line["level"] == "warning"]
    assert (warning["consumer"], warning["position"]) == ("audit", str(rows[9]))
    assert warning["old_rows_needed"] == 10
    for hint in ("serversync offsets reset audit", "serversync consumers remove audit"):
        assert hint in warning["msg"]

    # Nothing else is old and passed: a second run deletes nothing.
    again = await run_cli(backend_dsn, "cleanup", "--json")
    assert_ok(again)
    report = orjson.loads(again.stdout)
    assert report["outbox"] == {"old": 10, "passed": 0, "deleted": 0, "batches": 0, "kept": 10}
    assert [c["consumer"] for c in report["lagging"]] == ["audit"]
    assert await positions(backend_dsn) == rows[10:]


async def test_a_lagging_consumer_keeps_its_rows_until_it_has_caught_up(
    backend_dsn: str, receiver_url: str
) -> None:
    await add_events(backend_dsn, 8, "c")
    rows = await positions(backend_dsn)
    await make_old(backend_dsn, rows)
    await place(backend_dsn, CONSUMER, Position.start())  # registered, nothing delivered yet
    await place(backend_dsn, "audit", rows[-1])

    first = await run_cli(backend_dsn, "cleanup")
    assert_ok(first)  # a lagging consumer is reported, no failure
    assert "deleted 0 outbox row(s)" in first.stdout
    assert f"kept 8 old row(s) that 1 lagging consumer(s) still need: {CONSUMER}" in first.stdout
    (warning,) = [line for line in first.logs() if line["level"] == "warning"]
    assert (warning["consumer"], warning["old_rows_needed"]) == (CONSUMER, 8)
    assert await positions(backend_dsn) == rows

    # The consumer catches up through the real receiver.
    async with running_consumer(make_settings(backend_dsn, receiver_url)):
        assert await wait_caught_up(backend_dsn, timeout=30) == rows[-1]

    second = await run_cli(backend_dsn, "cleanup")
    assert_ok(second)
    assert second.stdout == (
        "cleanup: deleted 8 outbox row(s) older than 30d in 1 batch(es) and 0 resolved dead "
        "letter(s)\n"
    )
    assert not [line for line in second.logs() if line["level"] == "warning"]
    assert await positions(backend_dsn) == []


# Transaction ids on both sides of digit boundaries: compared as text, '10000' < '9999'.
SYNTHETIC_TXIDS = [3, 9, 10, 11, 99, 100, 101, 999, 1000, 1001, 9999, 10000, 10001, 99999, 100000]


async def test_cleanup_never_deletes_an_event_an_unfinished_consumer_needs(
    backend_dsn: str,
) -> None:
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    names = ["alpha", "beta", "gamma"]
    for rnd in range(20):
        # New rows of several transactions, a few per transaction, old or young at random (so
        # age and position order disagree).
        for txid in rng.sample(SYNTHETIC_TXIDS, k=6):
            await add_rows(backend_dsn, rng.randint(1, 3), age=rng.choice([OLD, YOUNG]), txid=txid)
        old = {
            Position(int(t), int(s)): bool(o)
            for t, s, o in await fetch_all(
                backend_dsn,
                "SELECT txid::text, seq, created_at < now() - interval '30 days' "
                "FROM sync.events_outbox",
            )
        }
        candidates = [
            Position.start(),
            *old,
            *(Position(t, 0) for t in SYNTHETIC_TXIDS),  # before every row of that transaction
            *(Position(t, 2**62) for t in SYNTHETIC_TXIDS),  # after every row of it
            PAST_EVERYTHING,
        ]
        placed = {name: rng.choice(candidates) for name in names}
        for name, at in placed.items():
            await place(backend_dsn, name, at)

        report = await run_cleanup(backend_dsn, batch_size=rng.randint(1, 5))

        context = f"seed {seed}, round {rnd}, consumers at {placed}"
        floor = min(placed.values())
        gone = {p for p, is_old in old.items() if is_old and p <= floor}
        left = set(await positions(backend_dsn))
        assert left == set(old) - gone, context
        # The point of it all: every row some consumer has not passed is still there.
        for name, at in placed.items():
            needed = {p for p in old if p > at}
            assert needed <= left, f"{context}: rows {sorted(needed - left)} {name} needs are gone"
        assert report.outbox_deleted == report.outbox_passed == len(gone), context
        needs = {
            name: sum(1 for p, is_old in old.items() if is_old and p > at)
            for name, at in placed.items()
        }
        assert {c.consumer: c.old_rows_needed for c in report.lagging} == {
            name: n for name, n in needs.items() if n
        }, context
        assert all(c.position == placed[c.consumer] for c in report.lagging), context


async def test_with_no_consumer_registered_no_outbox_row_goes(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 5, age=OLD)
    await add_dead_letter(backend_dsn, "gone-consumer", 1, "RESOLVED", updated=OLD)
    before = await positions(backend_dsn)

    result = await run_cli(backend_dsn, "cleanup")
    assert_ok(result)
    assert result.stdout == (
        "cleanup: no consumer is registered, so no outbox row was deleted (5 older than 30d; a "
        "consumer registered later starts from the beginning); deleted 1 resolved dead letter(s) "
        "older than 30d\n"
    )
    assert any("no consumer is registered" in line["msg"] for line in result.logs())
    assert await positions(backend_dsn) == before


async def test_dry_run_counts_what_would_go_and_deletes_nothing(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 12, age=OLD)
    await add_rows(backend_dsn, 3, age=YOUNG)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[6])  # passed 7 of the 12 old rows
    await place(backend_dsn, "billing", rows[-1])
    for seq in (1, 2):
        await add_dead_letter(backend_dsn, "audit", seq, "RESOLVED", updated=OLD)
    await add_dead_letter(backend_dsn, "audit", 3, "PENDING", updated=OLD)

    dry = await run_cli(backend_dsn, "cleanup", "--dry-run")
    dry_json = await run_cli(backend_dsn, "cleanup", "--dry-run", "--json")
    for result in (dry, dry_json):
        assert_ok(result)
        assert not batch_logs(result, retention.OUTBOX)
    assert dry.stdout == (
        "cleanup (dry run, nothing deleted): would delete 7 outbox row(s) older than 30d and 2 "
        "resolved dead letter(s); would keep 5 old row(s) that 1 lagging consumer(s) still "
        "need: audit\n"
    )
    planned = orjson.loads(dry_json.stdout)
    assert planned["dry_run"] is True
    assert planned["outbox"] == {"old": 12, "passed": 7, "deleted": 0, "batches": 0, "kept": 5}
    assert planned["dead_letters"] == {"resolved_old": 2, "deleted": 0, "batches": 0}
    assert await positions(backend_dsn) == rows
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.dlq_messages") == 3

    done = await run_cli(backend_dsn, "cleanup", "--json")
    assert_ok(done)
    report = orjson.loads(done.stdout)
    # The same counts as promised.
    assert report["outbox"]["deleted"] == planned["outbox"]["passed"] == 7
    assert report["dead_letters"]["deleted"] == planned["dead_letters"]["resolved_old"] == 2
    assert await positions(backend_dsn) == rows[7:]


async def test_1050_rows_in_batches_of_100_take_11_batches(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 1050, age=OLD)
    await add_rows(backend_dsn, 20, age=YOUNG)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[-1])

    result = await run_cli(backend_dsn, "cleanup", "--batch-size", "100", "--json")
    assert_ok(result)
    progress = batch_logs(result, retention.OUTBOX)
    assert [line["batch"] for line in progress] == list(range(1, 12))
    assert [line["deleted"] for line in progress] == [100] * 10 + [50]
    assert [line["deleted_total"] for line in progress] == [*range(100, 1001, 100), 1050]
    assert all(line["level"] == "info" for line in progress)
    assert orjson.loads(result.stdout)["outbox"]["batches"] == 11
    assert await positions(backend_dsn) == rows[1050:]


async def test_resolved_dead_letters_older_than_the_retention_go_the_others_stay(
    backend_dsn: str,
) -> None:
    await place(backend_dsn, CONSUMER, Position.start())
    cases = [
        ("RESOLVED", OLD, False),
        ("RESOLVED", OLD, False),
        ("RESOLVED", OLD, False),
        ("RESOLVED", YOUNG, True),  # resolved recently, though parked long ago
        ("PENDING", OLD, True),
        ("RETRYING", OLD, True),
        ("DEAD", OLD, True),
    ]
    for seq, (status, updated, _) in enumerate(cases, start=1):
        await add_dead_letter(backend_dsn, CONSUMER, seq, status, updated=updated)

    report = await run_cleanup(backend_dsn, batch_size=2)
    assert (report.dlq_resolved_old, report.dlq_deleted, report.dlq_batches) == (3, 3, 2)
    left = await fetch_all(backend_dsn, "SELECT seq FROM sync.dlq_messages ORDER BY seq")
    assert [r[0] for r in left] == [seq for seq, c in enumerate(cases, start=1) if c[2]]


# -- producers are never blocked -----------------------------------------------------------------


async def test_a_producer_inserts_while_a_cleanup_batch_is_open(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 500, age=OLD)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[-1])
    cleaner = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    producer = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with cleaner, producer:
        # Were the producer made to wait for a lock, it would fail after this long.
        await producer.execute("SET lock_timeout = '1s'")
        cur = await cleaner.execute("SELECT now() - interval '30 days'")
        row = await cur.fetchone()
        assert row is not None
        cutoff = row[0]
        async with cleaner.transaction():
            # One batch, held open here for as long as the producer needs: what a cleanup
            # batch locks, it locks until this commits.
            deleted, last = await retention.delete_outbox_batch(
                cleaner, cutoff, Position.start(), 200
            )
            assert (deleted, last) == (200, rows[199])
            modes = await fetch_all(
                backend_dsn,
                "SELECT mode FROM pg_locks WHERE pid = %s "
                "AND relation = 'sync.events_outbox'::regclass",
                (cleaner.info.backend_pid,),
            )
            # Reading takes ACCESS SHARE, deleting ROW EXCLUSIVE: neither conflicts with the ROW
            # EXCLUSIVE an INSERT takes.
            assert {m[0] for m in modes} == {"AccessShareLock", "RowExclusiveLock"}
            # Producers go on: through the relay, and straight into the outbox.
            await producer.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES ('p', 'x')"
            )
            await producer.execute(
                "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload) "
                "VALUES ('upsert', 'thing', 'p', '{}')"
            )
            assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox") == (
                500 + 2
            )
    # The batch committed; the producer's rows (young) are there.
    left = await positions(backend_dsn)
    assert left[:300] == rows[200:]
    assert len(left) == 302


async def test_producers_keep_inserting_during_a_whole_cleanup(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 2000, age=OLD)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[-1])
    producer = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with producer:
        await producer.execute("SET lock_timeout = '1s'")
        cleanup = asyncio.create_task(run_cleanup(backend_dsn, batch_size=10))
        inserted = 0
        # Insert for as long as the cleanup runs: each INSERT overlaps some batch's statement.
        while not cleanup.done():
            await producer.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                (f"during-{inserted}",),
            )
            inserted += 1
        report = await cleanup
    assert (report.outbox_deleted, report.outbox_batches) == (2000, 200)
    assert inserted > 0
    assert len(await positions(backend_dsn)) == inserted


# -- durations -----------------------------------------------------------------------------------


def test_durations() -> None:
    assert parse_duration("30d") == timedelta(days=30)
    assert parse_duration("12h") == timedelta(hours=12)
    assert parse_duration("90m") == timedelta(minutes=90)
    assert parse_duration("45s") == timedelta(seconds=45)
    assert parse_duration("3600") == timedelta(hours=1)
    assert parse_duration(" 7d ") == timedelta(days=7)
    assert parse_duration("0") == timedelta(0)
    for bad in ("", "d", "3x", "-5d", "1.5h", "30 days", "999999d"):
        with pytest.raises(ValueError, match=repr(bad)):
            parse_duration(bad)
    assert retention.format_duration(timedelta(days=30)) == "30d"
    assert retention.format_duration(timedelta(minutes=90)) == "90m"
    assert retention.format_duration(timedelta(seconds=61)) == "61s"


async def test_a_bad_option_is_an_error_naming_it_and_exit_2(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 3, age=OLD)
    await place(backend_dsn, "audit", PAST_EVERYTHING)
    cases = [
        (["--older-than", "3x"], "--older-than", "not a duration: '3x'"),
        (["--older-than=-5d"], "--older-than", "not a duration: '-5d'"),
        (["--batch-size", "0"], "--batch-size", "'0' is not a number of rows"),
        (["--batch-size", "many"], "--batch-size", "'many' is not a number of rows"),
    ]
    results = await asyncio.gather(
        *(run_cli(backend_dsn, "cleanup", *args) for args, _, _ in cases)
    )
    for (_, option, message), result in zip(cases, results, strict=True):
        assert result.code == 2, result
        assert "Traceback" not in result.stderr
        # argparse: the usage, then one error line naming the option and the value.
        error = result.stderr.strip().splitlines()[-1]
        assert f"argument {option}: {message}" in error, error
    assert len(await positions(backend_dsn)) == 3


# -- consumers list and remove -------------------------------------------------------------------


async def test_consumers_remove_refuses_while_the_consumer_runs_and_works_once_stopped(
    backend_dsn: str, receiver_url: str
) -> None:
    await add_events(backend_dsn, 3, "c")
    await add_dead_letter(backend_dsn, CONSUMER, 1, "PENDING")
    await add_dead_letter(backend_dsn, CONSUMER, 2, "DEAD")
    async with running_consumer(make_settings(backend_dsn, receiver_url)) as runtime:
        await wait_delivered_events(runtime, 3, timeout=30, what="the consumer caught up")
        assert runtime.stats.is_leader
        refused, listed = await asyncio.gather(
            run_cli(backend_dsn, "consumers", "remove", CONSUMER, "--yes"),
            run_cli(backend_dsn, "consumers", "list", "--json"),
        )
        assert_one_line_error(
            refused,
            1,
            f"consumer {CONSUMER} is running",
            f"pid {os.getpid()} on {socket.gethostname()}",
            "stop it first",
        )
        assert_ok(listed)
        (row,) = orjson.loads(listed.stdout)
        assert (row["consumer"], row["running"], row["leader_pid"]) == (CONSUMER, True, os.getpid())
    assert (
        await fetch_value(
            backend_dsn,
            "SELECT count(*) FROM sync.consumer_offsets WHERE consumer = %s",
            (CONSUMER,),
        )
        == 1
    )

    # Stopped: the table shows it without a leader, and without --yes nothing happens.
    listed_text, unconfirmed, unknown = await asyncio.gather(
        run_cli(backend_dsn, "consumers", "list"),
        run_cli(backend_dsn, "consumers", "remove", CONSUMER),
        run_cli(backend_dsn, "consumers", "remove", "no-such", "--yes"),
    )
    assert_ok(listed_text)
    header, line = listed_text.stdout.splitlines()
    assert header.split() == ["CONSUMER", "POSITION", "LEADER", "UPDATED_AT", "BACKLOG"]
    last = (await positions(backend_dsn))[-1]
    assert line.split()[:3] == [CONSUMER, str(last), "none"]
    assert_one_line_error(unconfirmed, 2, f"removing consumer {CONSUMER}", "confirm with --yes")
    assert_one_line_error(unknown, 2, "no consumer named 'no-such'", f"known: {CONSUMER}")

    # A stopped consumer's sessions end a moment after it closed them.
    await wait_until(no_sessions(backend_dsn), what="the consumer's sessions to end")
    removed = await run_cli(backend_dsn, "consumers", "remove", CONSUMER, "--yes")
    assert_ok(removed)
    assert removed.stdout == (
        f"removed consumer {CONSUMER} (was at {last}); kept its 2 dead letter(s) "
        "(--purge-dlq deletes them)\n"
    )
    assert await fetch_all(backend_dsn, "SELECT consumer FROM sync.consumer_offsets") == []
    # Its waiting flag is gone too: producers would otherwise NOTIFY for it for ever.
    assert await fetch_all(backend_dsn, "SELECT consumer FROM sync.consumer_waits") == []
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.dlq_messages") == 2

    # Removed, it no longer pins anything: with no consumer left, cleanup says so.
    empty = await run_cli(backend_dsn, "consumers", "list")
    assert_ok(empty)
    assert "no consumers registered yet" in empty.stdout


async def test_consumers_remove_purges_the_dead_letters_when_asked(backend_dsn: str) -> None:
    await place(backend_dsn, "audit", Position.start())
    await place(backend_dsn, "billing", Position.start())
    await add_dead_letter(backend_dsn, "audit", 1, "PENDING")
    await add_dead_letter(backend_dsn, "audit", 2, "RESOLVED")
    await add_dead_letter(backend_dsn, "billing", 1, "PENDING")

    result = await run_cli(backend_dsn, "consumers", "remove", "audit", "--yes", "--purge-dlq")
    assert_ok(result)
    assert result.stdout == "removed consumer audit (was at 0/0); deleted its 2 dead letter(s)\n"
    assert await fetch_all(backend_dsn, "SELECT consumer FROM sync.consumer_offsets") == [
        ("billing",)
    ]
    assert await fetch_all(backend_dsn, "SELECT consumer FROM sync.dlq_messages") == [("billing",)]


async def test_consumers_remove_refuses_while_a_standby_waits(
    backend_dsn: str, receiver_url: str
) -> None:
    await place(backend_dsn, CONSUMER, Position.start())
    settings = make_settings(backend_dsn, receiver_url)
    # A real leader and a real standby: both hold a leader-lock session named after the consumer.
    async with running_consumer(settings) as first, running_consumer(settings) as second:

        async def leader_and_standby() -> bool:
            conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
            async with conn:
                sessions = await retention.consumer_sessions(conn, CONSUMER)
            return len(sessions) == 2 and first.stats.is_leader != second.stats.is_leader

        await wait_until(leader_and_standby, timeout=30, what="a leader and a standby")
    await wait_until(no_sessions(backend_dsn), what="the consumers' sessions to end")

    # A standby alone, as it stands while the lock is free for a moment (its leader just
    # stopped): a session of the consumer's processes, holding no lock.
    standby = await psycopg.AsyncConnection.connect(
        backend_dsn, autocommit=True, application_name=application_name(f"leader:{CONSUMER}")
    )
    async with standby:
        refused = await run_cli(backend_dsn, "consumers", "remove", CONSUMER, "--yes")
        assert_one_line_error(
            refused,
            1,
            f"consumer {CONSUMER} has a standby process running",
            f"backend {standby.info.backend_pid}",
            "stop it first",
        )
    assert await fetch_value(backend_dsn, "SELECT count(*) FROM sync.consumer_offsets") == 1
    await wait_until(no_sessions(backend_dsn), what="the standby's session to end")
    result = await run_cli(backend_dsn, "consumers", "remove", CONSUMER, "--yes")
    assert_ok(result)


async def test_a_second_cleanup_at_the_same_time_is_refused(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 4, age=OLD)
    await place(backend_dsn, "audit", PAST_EVERYTHING)
    running = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with running:
        # What a running cleanup holds for as long as it runs.
        await running.execute("SELECT pg_advisory_lock(hashtext('serversync.cleanup'))")
        refused, dry = await asyncio.gather(
            run_cli(backend_dsn, "cleanup"), run_cli(backend_dsn, "cleanup", "--dry-run")
        )
        assert_one_line_error(refused, 1, "another serversync cleanup is running")
        # A dry run changes nothing and needs no turn.
        assert_ok(dry)
        assert "would delete 4 outbox row(s)" in dry.stdout
    assert len(await positions(backend_dsn)) == 4
    assert_ok(await run_cli(backend_dsn, "cleanup"))
    assert await positions(backend_dsn) == []
