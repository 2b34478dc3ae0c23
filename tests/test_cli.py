"""The `serversync` command line, run as a real subprocess: offsets, status, configuration and
connection errors, and migrations."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest
from aiohttp import web
from psycopg import conninfo

from consumer.app import kinds, wiring
from consumer.app.cli import render
from consumer.devtools.devdb import Server, free_port
from consumer.store import admin, migrations
from tests.conftest import (
    CliResult,
    cli_env,
    fetch_all,
    fetch_value,
    finish,
    make_settings,
    running_consumer,
    serve_app,
    start_cli,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
CONSUMER = "frontend-sync"
# A frontend for commands that need one configured and never reach it.
FRONTEND = "http://127.0.0.1:9"
OFFSETS_ROW = "SELECT * FROM sync.consumer_offsets WHERE consumer = 'frontend-sync'"


# -- running the command -------------------------------------------------------------------------


async def run_cli(*args: str, env: dict[str, str], timeout: float = 60.0) -> CliResult:
    """Run `serversync ARGS...` to the end."""
    return await finish(await start_cli(*args, env=env), timeout)


async def run_many(*commands: list[str], env: dict[str, str]) -> list[CliResult]:
    """Several independent commands at once (each run is a second of imports)."""
    return list(await asyncio.gather(*(run_cli(*command, env=env) for command in commands)))


def assert_ok(result: CliResult) -> None:
    """Exit 0, no traceback."""
    assert result.code == 0, result
    assert "Traceback" not in result.stderr, result.stderr


def assert_one_line_error(result: CliResult, code: int, *fragments: str) -> str:
    """Exit `code`; stderr is one `serversync: ...` line holding every fragment; no traceback."""
    assert result.code == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("serversync: "), line
    for fragment in fragments:
        assert fragment in line, line
    assert result.stdout == ""
    return line


# -- a scripted receiver that records what it is sent -----------------------------------------


@dataclass
class Recorder:
    """The seqs of every entry received, in arrival order."""

    seqs: list[int] = field(default_factory=list)

    async def ingest(self, request: web.Request) -> web.Response:
        body = orjson.loads(await request.read())
        self.seqs.extend(int(e["seq"]) for e in body["entries"])
        return web.json_response({"ok": True})


@contextlib.asynccontextmanager
async def recording_receiver() -> AsyncIterator[tuple[str, Recorder]]:
    """A receiver on a free loopback port that accepts every batch and records its seqs."""
    recorder = Recorder()
    app = web.Application()
    app.router.add_post("/api/ingest/sync", recorder.ingest)
    async with serve_app(app) as url:
        yield url, recorder


# -- backend data --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seeded:
    """Events in the outbox, in delivery order."""

    seqs: list[int]
    created: list[datetime]


async def add_events(dsn: str, n: int, tag: str = "e", *, wait_final: bool = True) -> None:
    """`n` call logs, each inserted in its own transaction (one event each); returns once every
    event is final (no older transaction anywhere on the shared server is still open)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        for i in range(n):
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                (f"{tag}{i}",),
            )

    async def final() -> bool:
        held = await fetch_value(
            dsn,
            "SELECT count(*) FROM sync.events_outbox "
            "WHERE txid >= pg_snapshot_xmin(pg_current_snapshot())",
        )
        return bool(held == 0)

    # Resets only move over final events; other tests' open transactions must not skew counts.
    if wait_final:
        await wait_until(final, timeout=30, what="the new events to become final")


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
    async with recording_receiver() as (url, recorder):
        async with running_consumer(make_settings(dsn, url)) as runtime:

            async def done() -> bool:
                return runtime.stats.delivered_events == expected

            await wait_until(done, what=f"{expected} events delivered")
        return recorder.seqs


async def delivered_after_restart(dsn: str) -> list[int]:
    """Start the consumer, add one sentinel event, and return every seq delivered up to it.

    Delivery is in order, so the list is exactly what the consumer replays plus the sentinel.
    """
    async with recording_receiver() as (url, recorder):
        async with running_consumer(make_settings(dsn, url)) as runtime:
            await add_events(dsn, 1, tag="sentinel")
            sentinel = await fetch_value(dsn, "SELECT max(seq) FROM sync.events_outbox")

            async def committed() -> bool:
                position = runtime.stats.position
                return position is not None and position.seq == sentinel

            await wait_until(committed, what="the sentinel event delivered")
        assert recorder.seqs[-1] == sentinel
        return recorder.seqs


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
        recording_receiver() as (url, _),
        running_consumer(make_settings(backend_dsn, url)) as runtime,
    ):

        async def caught_up() -> bool:
            return runtime.stats.is_leader and runtime.stats.delivered_events == 3

        await wait_until(caught_up, what="the consumer leading and caught up")
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


def table(stdout: str) -> tuple[list[str], dict[str, list[str]]]:
    """A CLI table: its header and its rows by first column (cells split on whitespace)."""
    lines = stdout.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    return lines[0].split(), rows


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
        recording_receiver() as (url, _),
        running_consumer(make_settings(backend_dsn, url)) as runtime,
    ):

        async def caught_up() -> bool:
            return runtime.stats.is_leader and runtime.stats.delivered_events == 4

        await wait_until(caught_up, what="the consumer leading and caught up")
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


def consumer_row(**overrides: Any) -> dict[str, Any]:
    """A row as admin.consumer_status returns it: a stopped, healthy consumer."""
    row: dict[str, Any] = {
        "consumer": "audit",
        "last_txid": 812,
        "last_seq": 40,
        "updated_at": datetime(2026, 11, 27, 9, 30, 5, 123456, tzinfo=UTC),
        "running": False,
        "leader_host": None,
        "leader_pid": None,
        "lock_backend_pid": None,
        "backlog": 3,
        "backlog_estimated": False,
        "lag_seconds": 75.0,
        "delivered_total": 9,
        "dlq_pending": 1,
        "dlq_retrying": 1,
        "dlq_dead": 0,
        "failing_since": None,
        "failing_seconds": None,
        "failing_reason": None,
        "last_error": None,
    }
    return row | overrides


def test_status_offsets_and_consumers_tables_are_views_of_one_row() -> None:
    """One renderer: each command picks its columns, and a column says the same in all three."""
    failing = consumer_row(
        consumer="frontend-sync",
        running=True,
        leader_host="db1",
        leader_pid=4242,
        backlog=12_000,
        backlog_estimated=True,
        failing_since=datetime(2026, 11, 27, tzinfo=UTC),
        failing_seconds=300.0,
        failing_reason="receiver_unavailable",
        last_error="POST http://x answered\nHTTP 503:\x1b[2J  busy",
    )
    rows = [consumer_row(), failing]
    expected = {
        render.STATUS_COLUMNS: [
            ["audit", "none", "40", "3", "1.2m", "9", "2", "0", "ok", "-"],
            [
                "frontend-sync",
                "db1/4242",
                "40",
                "~12000",
                "1.2m",
                "9",
                "2",
                "0",
                "FAILING",
                "5.0m",
                # Control characters and line breaks of the error never reach the terminal.
                *["POST", "http://x", "answered", "HTTP", "503:", "[2J", "busy"],
            ],
        ],
        render.OFFSETS_COLUMNS: [
            ["audit", "40", "812/40", "3", "2026-11-27T09:30:05+00:00", "no"],
            ["frontend-sync", "40", "812/40", "~12000", "2026-11-27T09:30:05+00:00", "yes"],
        ],
        render.CONSUMERS_COLUMNS: [
            ["audit", "812/40", "none", "2026-11-27T09:30:05+00:00", "3"],
            ["frontend-sync", "812/40", "db1/4242", "2026-11-27T09:30:05+00:00", "~12000"],
        ],
    }
    for columns, cells in expected.items():
        header, by_name = table(render.consumer_table(rows, columns))
        assert header == list(columns)
        assert list(by_name.values()) == cells
        assert render.consumer_table([], columns) == render.NO_CONSUMERS
    assert "\x1b" not in render.consumer_table([failing], render.STATUS_COLUMNS)


def test_consumer_kinds_are_one_registry() -> None:
    assert wiring.CONSUMERS == tuple(kinds.KINDS) == ("frontend-sync", "recording-upload")
    assert kinds.consumer_kind("recording-upload").entity_types == frozenset({"recording"})
    assert kinds.consumer_kind("frontend-sync").entity_types is None
    settings = make_settings("dbname=unused", FRONTEND, SYNC_MAX_IN_FLIGHT=3)
    # recording-upload runs its uploads concurrently inside one batch instead.
    assert [kind.batches_in_flight(settings) for kind in kinds.KINDS.values()] == [3, 1]
    # An unknown name: a one-line start-up error for `run`, and the LookupError that the
    # dead-letter retries turn into a refusal.
    with pytest.raises(wiring.StartupError, match="unknown consumer 'nope'"):
        kinds.consumer_kind("nope")
    with pytest.raises(LookupError, match="this build runs: frontend-sync, recording-upload"):
        wiring.dlq_sinks(settings)("nope")


# -- configuration and connection errors ---------------------------------------------------------


# (command, variables to set or, with None, to remove, what the error line must say)
BAD_SETTINGS: list[tuple[list[str], dict[str, str | None], list[str]]] = [
    (["run", CONSUMER], {"SYNC_BATCH_SIZE": "abc"}, ["SYNC_BATCH_SIZE=abc", "integer"]),
    (["run", CONSUMER], {"SYNC_BATCH_SIZE": "0"}, ["SYNC_BATCH_SIZE=0", "greater than or equal"]),
    (["run", CONSUMER], {"FRONTEND_BASE_URL": "nope"}, ["FRONTEND_BASE_URL=nope", "URL"]),
    (
        ["run", CONSUMER],
        {"FRONTEND_BASE_URL": "https://sync:s3cret@example.com:99999/"},
        ["FRONTEND_BASE_URL=https://sync:***@example.com:99999/", "port"],
    ),
    (["status"], {"DATABASE_URL": None}, ["DATABASE_URL is not set"]),
    (["ingest-server"], {}, ["FRONTEND_DATABASE_URL is not set"]),
]


async def test_a_bad_setting_is_one_line_naming_the_variable_and_exit_2(backend_dsn: str) -> None:
    async def attempt(command: list[str], variables: dict[str, str | None]) -> CliResult:
        env = cli_env(DATABASE_URL=backend_dsn)
        for name, value in variables.items():
            if value is None:
                env.pop(name, None)
            else:
                env[name] = value
        # Were the setting accepted, `run` would keep running: the timeout fails the test.
        return await run_cli(*command, env=env)

    results = await asyncio.gather(*(attempt(c, v) for c, v, _ in BAD_SETTINGS))
    for (_, _, fragments), result in zip(BAD_SETTINGS, results, strict=True):
        line = assert_one_line_error(result, 2, "configuration error", *fragments)
        assert "s3cret" not in line


async def test_a_wrong_database_url_is_one_line_with_the_password_masked() -> None:
    hidden = "S3cr%t:p@ss/word"
    dsn = conninfo.make_conninfo(
        host="127.0.0.1", port=free_port(), user="app", dbname="backend", password=hidden
    )
    url = f"postgresql://app:S3cr%25t%3Ap%40ss%2Fword@127.0.0.1:{free_port()}/backend"
    # Not parseable: libpq's own message would quote the piece after the space.
    garbled = ["host=127.0.0.1 password=S3cr p@ss dbname=backend"]
    results = await asyncio.gather(
        *(
            run_cli("run", CONSUMER, env=cli_env(DATABASE_URL=u, FRONTEND_BASE_URL=FRONTEND))
            for u in (dsn, url, *garbled)
        )
    )
    unreachable, invalid = results[:2], results[2:]
    lines = [
        assert_one_line_error(
            result, 1, "cannot connect to DATABASE_URL", "password=***", "Connection refused"
        )
        for result in unreachable
    ]
    lines += [
        assert_one_line_error(
            result, 2, "configuration error: DATABASE_URL is not a valid connection string"
        )
        for result in invalid
    ]
    for line in lines:
        for secret in ("S3cr", "p@ss", "p%40ss"):
            assert secret not in line, line


async def test_a_missing_database_is_one_line_naming_it_without_the_password(
    pg_server: Server,
) -> None:
    params = conninfo.conninfo_to_dict(pg_server.dsn)
    password = str(params.get("password") or "Wr0ngButHidden")
    dsn = conninfo.make_conninfo(pg_server.dsn, dbname="ss_no_such_db", password=password)
    result = await run_cli("offsets", "list", env=cli_env(DATABASE_URL=dsn))
    line = assert_one_line_error(
        result, 1, "cannot connect to DATABASE_URL", "dbname=ss_no_such_db", "password=***"
    )
    assert password not in line


# -- migrations ----------------------------------------------------------------------------------


def expected_migrations(components: list[str]) -> list[tuple[str, str]]:
    return [(m.component, m.version) for c in components for m in migrations.available(c)]


def applied_lines(components: list[str]) -> list[str]:
    return [f"applied {m.label}" for c in components for m in migrations.available(c)]


MIGRATIONS_TABLE = (
    "SELECT component, version, name, checksum, applied_at FROM sync.schema_migrations "
    "ORDER BY component, version"
)


async def test_commands_against_an_unmigrated_database_say_to_migrate(empty_dsn: str) -> None:
    env = cli_env(DATABASE_URL=empty_dsn, FRONTEND_BASE_URL=FRONTEND)
    run, status = await run_many(["run", CONSUMER], ["status"], env=env)
    assert_one_line_error(run, 1, "DATABASE_URL lacks", "0001_baseline", "run `serversync migrate`")
    assert_one_line_error(status, 1, "DATABASE_URL lacks", "run `serversync migrate`")


async def test_migrate_twice_is_a_no_op_the_second_time(empty_dsn: str) -> None:
    env = cli_env(DATABASE_URL=empty_dsn)
    components = ["backend"]
    first = await run_cli("migrate", env=env)
    assert_ok(first)
    assert first.stdout.splitlines() == applied_lines(components)
    recorded = await fetch_all(empty_dsn, MIGRATIONS_TABLE)
    assert [(r[0], r[1]) for r in recorded] == expected_migrations(components)

    second = await run_cli("migrate", env=env)
    assert_ok(second)
    assert second.stdout == "DATABASE_URL: up to date (backend)\n"
    assert await fetch_all(empty_dsn, MIGRATIONS_TABLE) == recorded


async def test_concurrent_migrates_apply_every_migration_once(empty_dsn: str) -> None:
    env = cli_env(DATABASE_URL=empty_dsn)
    components = ["backend"]
    gate = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with gate:
        # Hold the migration lock so that both processes are surely waiting at the same point,
        # then let them race.
        await gate.execute("SELECT pg_advisory_lock(hashtext('serversync.migrate'))")
        processes = [await start_cli("migrate", env=env) for _ in range(2)]

        async def both_waiting() -> bool:
            waiting = await fetch_value(
                empty_dsn,
                "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database "
                "WHERE l.locktype = 'advisory' AND NOT l.granted "
                "AND d.datname = current_database()",
            )
            return bool(waiting == 2)

        await wait_until(both_waiting, timeout=60, what="both migrate processes at the lock")
        await gate.execute("SELECT pg_advisory_unlock(hashtext('serversync.migrate'))")
        results = await asyncio.gather(*(finish(p) for p in processes))
    for result in results:
        assert_ok(result)
    outputs = sorted(r.stdout for r in results)
    assert outputs == sorted(
        [
            "\n".join(applied_lines(components)) + "\n",
            "DATABASE_URL: up to date (backend)\n",
        ]
    )
    recorded = await fetch_all(empty_dsn, MIGRATIONS_TABLE)
    assert [(r[0], r[1]) for r in recorded] == expected_migrations(components)


EXAMPLES_LINE = (
    "examples/voicebot: in place (created what was missing, left what existed as it was)"
)
EXAMPLE_TABLES = [
    ("announcements", "announcement"),
    ("call_logs", "call_log"),
    ("ivr_flows", "ivr_flow"),
    ("recordings", "recording"),
    ("registered_numbers", "registered_number"),
    ("routing_rules", "routing_rule"),
    ("schedules", "schedule"),
]
TRACKED = "SELECT table_name::text, entity_type FROM sync.tracked_tables ORDER BY 1"


async def public_schema(dsn: str) -> list[tuple[Any, ...]]:
    """Every column, index and constraint of the public schema, and the rows of the call_logs
    and recordings tables."""
    columns = await fetch_all(
        dsn,
        "SELECT table_name, column_name, data_type, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = 'public' ORDER BY 1, 2",
    )
    indexes = await fetch_all(
        dsn, "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1"
    )
    constraints = await fetch_all(
        dsn,
        "SELECT conrelid::regclass::text, conname, pg_get_constraintdef(oid) FROM pg_constraint "
        "WHERE connamespace = 'public'::regnamespace ORDER BY 1, 2",
    )
    rows = await fetch_all(
        dsn,
        "SELECT c.id::text, c.caller_number, c.agent_name, r.id::text, r.file_path, "
        "r.upload_status, r.transcript FROM call_logs c JOIN recordings r ON r.call_log_id = c.id "
        "ORDER BY 1, 4",
    )
    return [*columns, *indexes, *constraints, *rows]


async def test_migrate_installs_only_serversyncs_schema_unless_asked_for_the_examples(
    empty_dsn: str,
) -> None:
    env = cli_env(DATABASE_URL=empty_dsn)
    core = await run_cli("migrate", env=env)
    assert_ok(core)
    assert core.stdout.splitlines() == applied_lines(["backend"])
    assert await fetch_value(empty_dsn, "SELECT to_regclass('sync.events_outbox')::text") == (
        "sync.events_outbox"
    )
    assert await fetch_value(empty_dsn, "SELECT to_regclass('public.call_logs')") is None
    assert (
        await fetch_value(empty_dsn, "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        == 0
    )
    assert await fetch_value(empty_dsn, "SELECT count(*) FROM sync.tracked_tables") == 0
    recorded = await fetch_all(empty_dsn, MIGRATIONS_TABLE)
    assert [(r[0], r[1]) for r in recorded] == expected_migrations(["backend"])

    # --core-only, which the docs of earlier versions name, is what migrate does anyway.
    same = await run_cli("migrate", "--core-only", env=env)
    assert_ok(same)
    assert same.stdout == "DATABASE_URL: up to date (backend)\n"
    assert await fetch_value(empty_dsn, "SELECT to_regclass('public.call_logs')") is None
    both = await run_cli("migrate", "--core-only", "--with-examples", env=env)
    assert both.code == 2, both
    assert "not allowed with argument" in both.stderr, both.stderr

    for _ in range(2):
        examples = await run_cli("migrate", "--with-examples", env=env)
        assert_ok(examples)
        assert examples.stdout.splitlines() == ["DATABASE_URL: up to date (backend)", EXAMPLES_LINE]
        assert await fetch_all(empty_dsn, TRACKED) == EXAMPLE_TABLES
    # Examples are not versioned migrations: nothing recorded.
    assert await fetch_all(empty_dsn, MIGRATIONS_TABLE) == recorded


async def test_migrate_with_examples_keeps_a_voicebot_databases_own_tables_and_rows(
    empty_dsn: str,
) -> None:
    # A real voicebot database: call_logs and recordings are there before serversync, with a
    # column of their own, an index of their own and rows.
    call_id = "7d0f6c53-6b43-4c1e-9a53-1f1d1c7e0001"
    recording_id = "7d0f6c53-6b43-4c1e-9a53-1f1d1c7e0002"
    conn = await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "CREATE TABLE call_logs (id uuid PRIMARY KEY, caller_number text NOT NULL, "
            "callee_number text NOT NULL, agent_name text, "
            "updated_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute(
            "CREATE TABLE recordings (id uuid PRIMARY KEY, "
            "call_log_id uuid NOT NULL REFERENCES call_logs (id), file_path text NOT NULL, "
            "upload_status text NOT NULL DEFAULT 'pending', s3_url text, transcript text, "
            "updated_at timestamptz NOT NULL DEFAULT now())"
        )
        await conn.execute("CREATE INDEX recordings_by_call ON recordings (call_log_id)")
        await conn.execute(
            "INSERT INTO call_logs (id, caller_number, callee_number, agent_name) "
            "VALUES (%s, '0311112222', '0501234567', 'Sato')",
            (call_id,),
        )
        await conn.execute(
            "INSERT INTO recordings (id, call_log_id, file_path, transcript) "
            "VALUES (%s, %s, %s, 'hello')",
            (recording_id, call_id, f"{call_id}/mixed.wav"),
        )
    env = cli_env(DATABASE_URL=empty_dsn)
    before = await public_schema(empty_dsn)

    core = await run_cli("migrate", env=env)
    assert_ok(core)
    assert core.stdout.splitlines() == applied_lines(["backend"])
    assert await public_schema(empty_dsn) == before
    # The owner tracks call_logs under a name of their own before asking for the examples.
    await fetch_all(empty_dsn, "SELECT sync.track('public.call_logs', 'call')")

    for _ in range(2):
        examples = await run_cli("migrate", "--with-examples", env=env)
        assert_ok(examples)
        assert examples.stdout.splitlines() == ["DATABASE_URL: up to date (backend)", EXAMPLES_LINE]
        # The tables that were there are exactly as they were, rows included; the missing ones
        # were created; call_logs keeps its entity type, the others are tracked.
        after = await public_schema(empty_dsn)
        assert [row for row in after if row[0] in ("call_logs", "recordings")] == [
            row for row in before if row[0] in ("call_logs", "recordings")
        ]
        assert [row for row in before if row not in after] == []
        assert await fetch_value(empty_dsn, "SELECT to_regclass('public.schedules')::text") == (
            "schedules"
        )
        tracked = dict(EXAMPLE_TABLES) | {"call_logs": "call"}
        assert await fetch_all(empty_dsn, TRACKED) == sorted(tracked.items())
    assert (
        await fetch_value(
            empty_dsn, "SELECT count(*) FROM pg_indexes WHERE tablename = 'recordings'"
        )
        == 2
    )

    # The relay works on the owner's tables: a change is an event.
    await fetch_all(
        empty_dsn,
        "UPDATE recordings SET transcript = 'hello again' WHERE id = %s RETURNING id",
        (recording_id,),
    )
    events = await fetch_all(
        empty_dsn, "SELECT entity_type, entity_id, payload->>'transcript' FROM sync.events_outbox"
    )
    assert events == [("recording", recording_id, "hello again")]
