"""The `serversync` command line, run as a real subprocess, on a consumer's offset: `offsets
reset` (each way to name the target, refused while the consumer runs), `offsets list` and
`status` (backlog, lag, leader, the open transaction holding the horizon)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson
import psycopg
import pytest
from psycopg import conninfo

from consumer.store import admin
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
from tests.support.cli import assert_ok, assert_one_line_error, run_cli, run_many, table
from tests.support.receivers import scripted_receiver
from tests.support.waiting import wait_delivered_events

CONSUMER = "frontend-sync"
OFFSETS_ROW = "SELECT * FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'"


# -- backend data --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seeded:
    """Events in the outbox, in delivery order."""

    seqs: list[int]
    created: list[datetime]


async def seed(dsn: str, n: int = 10) -> Seeded:
    """`n` events; their seqs and creation times in delivery order."""
    await add_events(dsn, n)
    rows = await fetch_all(dsn, "SELECT seq, created_at FROM sync.events_outbox ORDER BY txid, seq")
    seeded = Seeded([r[0] for r in rows], [r[1] for r in rows])
    assert seeded.seqs == sorted(seeded.seqs)
    assert all(a < b for a, b in zip(seeded.created, seeded.created[1:], strict=False))
    return seeded


async def register(dsn: str, consumer: str = CONSUMER) -> None:
    """A consumer at the start of the outbox, as a first `serversync run` leaves it."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute("INSERT INTO sync.consumer_offsets (consumer) VALUES (%s)", (consumer,))


async def deliver_all(dsn: str, expected: int) -> list[int]:
    """Run the consumer until `expected` events are delivered; the seqs it sent."""
    async with scripted_receiver() as receiver:
        async with running_consumer(make_settings(dsn, receiver.url)) as runtime:
            await wait_delivered_events(runtime, expected)
        return receiver.accepted


async def delivered_after_restart(dsn: str) -> list[int]:
    """Start the consumer, add one sentinel event, and return every seq delivered up to it.

    Delivery is in order, so the list is exactly what the consumer replays plus the sentinel.
    """
    async with scripted_receiver() as receiver:
        async with running_consumer(make_settings(dsn, receiver.url)) as runtime:
            await add_events(dsn, 1, tag="sentinel")
            sentinel = await fetch_value(dsn, "SELECT max(seq) FROM sync.events_outbox")

            async def committed() -> bool:
                position = runtime.stats.position
                return position is not None and position.seq == sentinel

            await wait_until(committed, what="the sentinel event delivered")
        assert receiver.accepted[-1] == sentinel
        return receiver.accepted


async def offsets_row(dsn: str) -> tuple[Any, ...]:
    rows = await fetch_all(dsn, OFFSETS_ROW)
    assert len(rows) == 1
    return rows[0]


async def position_text(dsn: str) -> str:
    """The consumer's stored position as the CLI prints it: txid/seq."""
    return str(
        await fetch_value(
            dsn,
            "SELECT last_txid::text || '/' || last_seq FROM sync.consumer_offsets "
            "WHERE consumer = 'frontend-sync'",
        )
    )


# -- offsets reset -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResetCase:
    """A reset: where the consumer stands first, the options, and what it then delivers."""

    caught_up: bool  # True: everything delivered first; False: registered, nothing delivered
    args: Callable[[Seeded], list[str]]
    redelivered: Callable[[Seeded], list[int]]
    effect: str
    dry_run_first: bool = False  # also check that --dry-run promises this and changes nothing


RESET_CASES = [
    pytest.param(
        ResetCase(
            True,
            lambda s: ["--to-earliest"],
            lambda s: s.seqs,
            "10 event(s) will be replayed",
            dry_run_first=True,
        ),
        id="to-earliest",
    ),
    pytest.param(
        ResetCase(False, lambda s: ["--to-latest"], lambda s: [], "10 event(s) will be skipped"),
        id="to-latest",
    ),
    pytest.param(
        ResetCase(
            True,
            lambda s: ["--to-seq", str(s.seqs[3])],
            lambda s: s.seqs[4:],
            "6 event(s) will be replayed",
        ),
        id="to-seq",
    ),
    pytest.param(
        ResetCase(
            True,
            lambda s: ["--to-datetime", s.created[5].isoformat()],
            lambda s: s.seqs[5:],
            "5 event(s) will be replayed",
            dry_run_first=True,
        ),
        id="to-datetime",
    ),
    pytest.param(
        ResetCase(
            True,
            lambda s: ["--shift-by", "-3"],
            lambda s: s.seqs[7:],
            "3 event(s) will be replayed",
        ),
        id="shift-back",
    ),
    pytest.param(
        ResetCase(
            False,
            lambda s: ["--shift-by", "4"],
            lambda s: s.seqs[4:],
            "4 event(s) will be skipped",
            dry_run_first=True,
        ),
        id="shift-forward",
    ),
]


@pytest.mark.parametrize("case", RESET_CASES)
async def test_reset_moves_the_offset_and_the_consumer_redelivers_exactly_that(
    backend_dsn: str, case: ResetCase
) -> None:
    seeded = await seed(backend_dsn)
    if case.caught_up:
        assert await deliver_all(backend_dsn, 10) == seeded.seqs
    else:
        await register(backend_dsn)
    env = cli_env(DATABASE_URL=backend_dsn)
    args = ["offsets", "reset", CONSUMER, *case.args(seeded)]
    before = await offsets_row(backend_dsn)
    current = await position_text(backend_dsn)

    if case.dry_run_first:
        dry = await run_cli(*args, "--dry-run", env=env)
        assert_ok(dry)
        assert re.fullmatch(
            rf"{CONSUMER}: would move from {current} to \d+/\d+; "
            rf"{re.escape(case.effect)} \(dry run, nothing changed\)\n",
            dry.stdout,
        ), dry.stdout
        assert await offsets_row(backend_dsn) == before

    done = await run_cli(*args, env=env)
    assert_ok(done)
    target = await position_text(backend_dsn)
    assert done.stdout == f"{CONSUMER}: moved from {current} to {target}; {case.effect}\n"
    if case.dry_run_first:
        # The dry run promised the very same move.
        assert dry.stdout.startswith(done.stdout.strip().replace("moved", "would move", 1))
    assert await offsets_row(backend_dsn) != before

    sent = await delivered_after_restart(backend_dsn)
    assert sent[:-1] == case.redelivered(seeded)


async def test_reset_is_refused_while_the_consumer_runs(backend_dsn: str) -> None:
    await seed(backend_dsn, 3)
    env = cli_env(DATABASE_URL=backend_dsn)
    async with (
        scripted_receiver() as receiver,
        running_consumer(make_settings(backend_dsn, receiver.url)) as runtime,
    ):
        await wait_delivered_events(runtime, 3, what="the consumer caught up")
        assert runtime.stats.is_leader
        before = await offsets_row(backend_dsn)
        refused = await run_cli("offsets", "reset", CONSUMER, "--to-earliest", env=env)
        assert_one_line_error(
            refused,
            1,
            f"consumer {CONSUMER} is running",
            f"pid {os.getpid()} on {socket.gethostname()}",
            "stop it first",
        )
        assert await offsets_row(backend_dsn) == before
    # Stopped: the same command goes through.
    result = await run_cli("offsets", "reset", CONSUMER, "--to-earliest", env=env)
    assert_ok(result)
    assert "3 event(s) will be replayed" in result.stdout


async def test_reset_of_an_unknown_consumer_names_the_known_ones(backend_dsn: str) -> None:
    await register(backend_dsn)
    env = cli_env(DATABASE_URL=backend_dsn)
    result = await run_cli("offsets", "reset", "no-such", "--to-earliest", env=env)
    assert_one_line_error(result, 2, "no consumer named 'no-such'", f"known: {CONSUMER}")


async def test_reset_rejects_a_datetime_without_offset(backend_dsn: str) -> None:
    await seed(backend_dsn, 2)
    await register(backend_dsn)
    before = await offsets_row(backend_dsn)
    cases = {
        "2026-01-01T00:00:00": "needs a UTC offset",
        "yesterday": "not an ISO 8601 date-time",
    }
    results = await run_many(
        *(["offsets", "reset", CONSUMER, "--to-datetime", value] for value in cases),
        env=cli_env(DATABASE_URL=backend_dsn),
    )
    for (value, message), result in zip(cases.items(), results, strict=True):
        assert result.code == 2, result
        assert "Traceback" not in result.stderr
        # argparse: the usage line, then one error line naming the option and the value.
        error = result.stderr.strip().splitlines()[-1]
        assert "--to-datetime" in error
        assert repr(value) in error
        assert message in error
    assert await offsets_row(backend_dsn) == before


# -- offsets list and status ---------------------------------------------------------------------


async def test_offsets_list_as_table_and_json(backend_dsn: str) -> None:
    await register(backend_dsn, "audit")
    await seed(backend_dsn, 5)
    await deliver_all(backend_dsn, 5)
    await add_events(backend_dsn, 2, tag="late")
    position = await position_text(backend_dsn)
    env = cli_env(DATABASE_URL=backend_dsn)

    listed, as_json = await run_many(["offsets", "list"], ["offsets", "list", "--json"], env=env)
    assert_ok(listed)
    header, rows = table(listed.stdout)
    assert header == ["CONSUMER", "LAST_SEQ", "POSITION", "BACKLOG", "UPDATED_AT", "RUNNING"]
    assert list(rows) == ["audit", CONSUMER]
    audit, sync = rows["audit"], rows[CONSUMER]
    assert (audit[1], audit[2], audit[3], audit[5]) == ("0", "0/0", "7", "no")
    assert (sync[1], sync[2], sync[3], sync[5]) == (position.split("/")[1], position, "2", "no")

    assert_ok(as_json)
    data = orjson.loads(as_json.stdout)
    assert [r["consumer"] for r in data] == ["audit", CONSUMER]
    assert data[1]["backlog"] == 2
    assert data[1]["delivered_total"] == 5
    assert f"{data[1]['last_txid']}/{data[1]['last_seq']}" == position
    assert data[0]["backlog"] == 7
    assert all(r["running"] is False for r in data)


async def test_status_shows_backlog_lag_and_leader(backend_dsn: str) -> None:
    await seed(backend_dsn, 4)
    env = cli_env(DATABASE_URL=backend_dsn)
    async with (
        scripted_receiver() as receiver,
        running_consumer(make_settings(backend_dsn, receiver.url)) as runtime,
    ):
        await wait_delivered_events(runtime, 4, what="the consumer caught up")
        assert runtime.stats.is_leader
        running, text = await run_many(["status", "--json"], ["status"], env=env)
    assert_ok(running)
    (row,) = orjson.loads(running.stdout)["consumers"]
    assert row["consumer"] == CONSUMER
    assert row["running"] is True
    assert (row["leader_host"], row["leader_pid"]) == (socket.gethostname(), os.getpid())
    assert (row["backlog"], row["lag_seconds"], row["delivered_total"]) == (0, None, 4)

    assert_ok(text)
    header, rows = table(text.stdout)
    assert header == [
        "CONSUMER",
        "LEADER",
        "LAST_SEQ",
        "BACKLOG",
        "LAG",
        "DELIVERED",
        "DLQ_PENDING",
        "DLQ_DEAD",
        "DELIVERY",
        "LAST_ERROR",
    ]
    last_seq = (await position_text(backend_dsn)).split("/")[1]
    assert rows[CONSUMER][1:4] == [f"{socket.gethostname()}/{os.getpid()}", last_seq, "0"]
    assert rows[CONSUMER][6:9] == ["0", "0", "ok"]
    assert (row["dlq_pending"], row["dlq_dead"]) == (0, 0)

    # Stopped, with three events waiting.
    await add_events(backend_dsn, 3, tag="later")
    stopped, unknown = await run_many(
        ["status", "--json", "--consumer", CONSUMER], ["status", "--consumer", "nope"], env=env
    )
    assert_ok(stopped)
    (row,) = orjson.loads(stopped.stdout)["consumers"]
    assert row["running"] is False
    assert row["leader_pid"] is None
    assert row["backlog"] == 3
    assert 0 < row["lag_seconds"] < 60
    assert_one_line_error(unknown, 2, "no consumer named 'nope'")


async def test_a_backlog_too_large_to_count_each_time_is_estimated_from_seqs(
    backend_dsn: str,
) -> None:
    """Beyond admin.EXACT_BACKLOG_UP_TO events the backlog is estimated from seq numbers, so the
    gauges (which read it every few seconds while a backlog drains) cost the same at any size;
    the estimate counts the seqs of rolled-back transactions, and says that it is one."""
    half = admin.EXACT_BACKLOG_UP_TO // 2 + 25
    await register(backend_dsn)
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        insert = (
            "INSERT INTO call_logs (caller_number, callee_number)"
            " SELECT %s || g, 'x' FROM generate_series(1, %s) g"
        )
        await conn.execute(insert, ("first-", half))
        with contextlib.suppress(RuntimeError):
            async with conn.transaction():
                await conn.execute(insert, ("rolled-back-", 7))
                raise RuntimeError("roll back")
        await conn.execute(insert, ("second-", half))
    await add_events(backend_dsn, 0)  # wait until every event is final
    events = 2 * half

    env = cli_env(DATABASE_URL=backend_dsn)
    as_json, text = await run_many(["status", "--json"], ["status"], env=env)
    assert_ok(as_json)
    (row,) = orjson.loads(as_json.stdout)["consumers"]
    assert (row["backlog"], row["backlog_estimated"]) == (events + 7, True)
    assert 0 < row["lag_seconds"] < 60
    assert_ok(text)
    _, rows = table(text.stdout)
    assert rows[CONSUMER][3] == f"~{events + 7}"

    # Counted, it is exact: the rolled-back transaction left no event.
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        (counted,) = await admin.consumer_status(conn, CONSUMER, exact_up_to=events)
    assert (counted["backlog"], counted["backlog_estimated"]) == (events, False)


async def test_status_names_the_open_transaction_holding_the_horizon(backend_dsn: str) -> None:
    await register(backend_dsn)
    env = cli_env(DATABASE_URL=backend_dsn)
    holder = await psycopg.AsyncConnection.connect(backend_dsn, application_name="ss-test-holder")
    async with holder:
        # An open transaction that holds an xid; everything committed after it waits behind it.
        await holder.execute("SELECT pg_current_xact_id()")
        holder_pid = holder.info.backend_pid
        await add_events(backend_dsn, 1, tag="held", wait_final=False)
        outputs: list[CliResult] = []

        async def holder_listed() -> bool:
            # Status lists the oldest open transactions of the whole server: while other tests
            # hold older ones, the holder may not be among them yet.
            outputs[:] = await run_many(["status"], ["status", "--json"], env=env)
            for result in outputs:
                assert_ok(result)
            blockers = orjson.loads(outputs[1].stdout)["horizon"]["blockers"]
            return f"\n{holder_pid} " in outputs[0].stdout and any(
                b["pid"] == holder_pid for b in blockers
            )

        await wait_until(holder_listed, timeout=60, what="status listing the holder")
        await holder.rollback()

    text, as_json = outputs
    assert "1 committed event(s) are held back" in text.stdout
    lines = text.stdout.splitlines()
    header, rows = table("\n".join(lines[[line.split()[:1] for line in lines].index(["PID"]) :]))
    assert header[:6] == ["PID", "DATABASE", "USER", "APPLICATION", "STATE", "XACT_AGE"]
    line = " ".join(rows[str(holder_pid)])
    assert "ss-test-holder idle in transaction" in line
    assert str(conninfo.conninfo_to_dict(backend_dsn)["dbname"]) in line
    assert re.search(r"idle in transaction \d+\.\d[smh]", line), line

    horizon = orjson.loads(as_json.stdout)["horizon"]
    assert horizon["held_back_events"] == 1
    assert horizon["oldest_held_back_seconds"] >= 0
    (mine,) = [b for b in horizon["blockers"] if b["pid"] == holder_pid]
    assert mine["state"] == "idle in transaction"
    assert mine["application_name"] == "ss-test-holder"
    assert mine["xact_age_seconds"] > 0
