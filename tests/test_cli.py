"""The `serversync` command line, run as a real subprocess: the consumer tables its commands
print, the registry of consumer kinds, and configuration and connection errors. Offsets and
status are in tests/test_cli_offsets.py, migrations in tests/test_cli_migrate.py."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from psycopg import conninfo

from consumer.app import kinds, wiring
from consumer.app.cli import render
from consumer.devtools.devdb import Server, free_port
from tests.conftest import CliResult, cli_env, make_settings
from tests.support.cli import assert_one_line_error, run_cli, table

CONSUMER = "frontend-sync"
# A frontend for commands that need one configured and never reach it.
FRONTEND = "http://127.0.0.1:9"


# -- the consumer tables -------------------------------------------------------------------------


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
