"""Consumers an operator declares in SYNC_CONSUMERS_FILE: run, delivered, parked, retried and
shown like the built-in ones, sending only their entity types, signed with their own secret that
no log line or status output shows; and a declaration that is wrong stops the command with one
line and exit 2. Real PostgreSQL, real processes, real HTTP on loopback."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
import pytest

from consumer.app import declared, kinds
from consumer.app.settings import ConfigError
from consumer.runtime.filtering import EntryFilter
from consumer.sinks.frontend_sync import FrontendSyncSink
from consumer.wire.contract import SIGNATURE_HEADER, TIMESTAMP_HEADER
from consumer.wire.signing import verify
from tests.conftest import cli_env, fetch_value, make_settings
from tests.support.backend import execute
from tests.support.cli import assert_ok, assert_one_line_error, run_cli, run_many
from tests.support.dlq import dead_letters
from tests.support.operations import wait_metric
from tests.support.processes import Processes
from tests.support.receivers import scripted_receiver
from tests.support.waiting import wait_caught_up

NAME = "settings-sync"
SECRET = "s3cr3t-" + "0123456789abcdef" * 3
SECRET_ENV = "SETTINGS_SYNC_SECRET"  # noqa: S105 - the name of a variable
TYPES = ("registered_number", "routing_rule")


def consumers_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "consumers.toml"
    path.write_text(text)
    return path


def settings_sync(url: str | None, **lines: str) -> str:
    """The declaration of settings-sync (without a url: None); `lines` add or replace keys
    (TOML values; an empty one leaves the key out)."""
    keys = {
        "sink": '"json"',
        "url": f'"{url}"' if url is not None else "",
        "secret_env": f'"{SECRET_ENV}"',
        "entity_types": orjson.dumps(list(TYPES)).decode(),
        **lines,
    }
    body = "".join(f"{key} = {value}\n" for key, value in keys.items() if value)
    return f"[consumers.{NAME}]\n{body}"


async def write_settings(dsn: str) -> None:
    """Changes of three entity types, settings-sync's two among them, one of them refused by
    the receiver (its label holds POISON)."""
    await execute(
        dsn,
        "INSERT INTO call_logs (caller_number, callee_number) VALUES ('c1', 'x'), ('c2', 'x')",
        "INSERT INTO registered_numbers (phone_number, label) VALUES ('+811', 'one')",
        "INSERT INTO routing_rules (match_type, match_value, action) "
        "VALUES ('prefix', '03', 'ivr')",
        "INSERT INTO registered_numbers (phone_number, label) VALUES ('+812', 'POISON')",
        "INSERT INTO call_logs (caller_number, callee_number) VALUES ('c3', 'x')",
        "INSERT INTO registered_numbers (phone_number, label) VALUES ('+813', 'three')",
    )


def signed_with_secret(headers: dict[str, str], body: bytes) -> bool:
    return (
        verify([SECRET], headers.get(TIMESTAMP_HEADER), headers.get(SIGNATURE_HEADER), body) is None
    )


async def test_a_declared_consumer_runs_delivers_its_types_parks_and_retries(
    backend_dsn: str, tmp_path: Path
) -> None:
    async with scripted_receiver() as receiver, aiohttp.ClientSession() as http:
        receiver.refuse_markers = {b"POISON"}
        path = consumers_file(tmp_path, settings_sync(receiver.url))
        env = {"DATABASE_URL": backend_dsn, "SYNC_CONSUMERS_FILE": str(path)}
        await write_settings(backend_dsn)
        with Processes(tmp_path) as processes:
            # No FRONTEND_BASE_URL: a declared consumer delivers to its own url.
            consumer = processes.start(NAME, ["run", NAME], **env, **{SECRET_ENV: SECRET})
            ops = await consumer.ops_url()
            await wait_caught_up(backend_dsn, NAME, timeout=30)
            # Three call_logs passed over; four settings changes, one of them parked.
            await wait_metric(
                http, ops, "serversync_events_total", 3, consumer=NAME, outcome="skipped"
            )
            await wait_metric(
                http, ops, "serversync_events_total", 1, consumer=NAME, outcome="parked"
            )

            types = {e["entityType"] for e in receiver.accepted_entries}
            assert types == set(TYPES)
            labels = sorted(
                str(e["payload"].get("label")) for e in receiver.accepted_entries if e["payload"]
            )
            assert labels == ["None", "one", "three"]
            for attempt in receiver.attempts:
                assert attempt.key.startswith(f"{NAME}:")
                assert signed_with_secret(attempt.headers, attempt.body)
            (parked,) = await dead_letters(backend_dsn, NAME)
            assert parked.status == "PENDING"

            status, status_json, dlq_list = await run_many(
                ["status"],
                ["status", "--consumer", NAME, "--json"],
                ["dlq", "list", NAME],
                env=cli_env(**env, **{SECRET_ENV: SECRET}),
            )
            assert_ok(status)
            assert NAME in status.stdout
            assert_ok(status_json)
            (row,) = orjson.loads(status_json.stdout)["consumers"]
            assert (row["consumer"], row["dlq_pending"], row["delivered_total"]) == (NAME, 1, 3)
            assert row["backlog"] == 0
            assert row["leader_pid"] == consumer.pid
            assert SECRET not in status.stdout + status_json.stdout
            assert_ok(dlq_list)
            assert parked.id in dlq_list.stdout

            # A retry without the consumer's secret at hand: one line, exit 2, no retry used.
            missing = await run_cli("dlq", "retry", parked.id, env=cli_env(**env))
            assert_one_line_error(missing, 2, f"consumer {NAME}: {SECRET_ENV} is not set")
            assert (await dead_letters(backend_dsn, NAME))[0].retry_count == 0

            # The receiver takes it now: the retry goes through the declared sink, signed.
            receiver.refuse_markers = set()
            retried = await run_cli(
                "dlq", "retry", parked.id, env=cli_env(**env, **{SECRET_ENV: SECRET})
            )
            assert_ok(retried)
            assert "delivered; RESOLVED" in retried.stdout
            last = receiver.attempts[-1]
            assert [e["payload"]["label"] for e in last.entries] == ["POISON"]
            assert last.key.startswith(f"{NAME}:")
            assert signed_with_secret(last.headers, last.body)

            assert await consumer.stop() == 0
        log = consumer.log()
        assert SECRET not in log
        assert f"consumer {NAME} starting" in log
        assert "sends entity types registered_number, routing_rule" in log
    assert (
        await fetch_value(
            backend_dsn,
            "SELECT delivered_total FROM sync.consumer_offsets WHERE consumer = %s",
            (NAME,),
        )
        == 3
    )


# (what the file holds or None for the declaration of settings-sync, its secret, what the one
# line says)
BAD_DECLARATIONS: list[tuple[str, str | None, list[str]]] = [
    (
        settings_sync("http://127.0.0.1:9", colour='"red"'),
        SECRET,
        [f"consumers.{NAME}: unknown key 'colour'"],
    ),
    (
        '[consumers.Settings]\nurl = "http://127.0.0.1:9"\n',
        SECRET,
        ["consumer name 'Settings' does not match"],
    ),
    (
        '[consumers.frontend-sync]\nurl = "http://127.0.0.1:9"\n',
        SECRET,
        ["consumer 'frontend-sync' is built in"],
    ),
    (settings_sync(None), SECRET, ['url is required for sink "json"']),
    (settings_sync("not a url"), SECRET, [f"consumers.{NAME}.url"]),
    (settings_sync("http://127.0.0.1:9"), "short", [SECRET_ENV, "shorter than 32 characters"]),
    (settings_sync("http://127.0.0.1:9"), "CHANGE_ME_TO_A_LONG_RANDOM_SECRET", ["placeholder"]),
    (settings_sync("http://127.0.0.1:9"), f"{SECRET},tiny", ["secret 2 of 2 is shorter"]),
    (settings_sync("http://127.0.0.1:9"), None, [f"{SECRET_ENV} is not set"]),
    (
        settings_sync("http://127.0.0.1:9", target_node='"Backend"'),
        SECRET,
        [f"consumers.{NAME}.target_node"],
    ),
    (settings_sync("http://127.0.0.1:9", entity_types="[]"), SECRET, ["entity_types"]),
    (
        settings_sync("http://127.0.0.1:9", secret_file='"/nowhere"'),  # noqa: S106 - a path
        SECRET,
        ["give secret_env or secret_file, not both"],
    ),
    ('[consumer.settings-sync]\nurl = "x"\n', SECRET, ["unknown key 'consumer'"]),
    ("[consumers.settings-sync\n", SECRET, ["not valid TOML"]),
]


async def test_a_wrong_declaration_is_one_line_and_exit_2(tmp_path: Path) -> None:
    # Each case is a file of its own; the command never reaches the database.
    runs = []
    for number, (text, secret, _) in enumerate(BAD_DECLARATIONS):
        path = tmp_path / f"consumers-{number}.toml"
        path.write_text(text)
        variables = {"DATABASE_URL": "dbname=unused", "SYNC_CONSUMERS_FILE": str(path)}
        if secret is not None:
            variables[SECRET_ENV] = secret
        runs.append(run_cli("run", NAME, env=cli_env(**variables)))
    runs.append(
        run_cli(
            "run",
            NAME,
            env=cli_env(DATABASE_URL="dbname=unused", SYNC_CONSUMERS_FILE=str(tmp_path / "none")),
        )
    )
    *results, missing = await asyncio.gather(*runs)
    for (_, secret, fragments), result in zip(BAD_DECLARATIONS, results, strict=True):
        line = assert_one_line_error(result, 2, "configuration error", *fragments)
        if secret is not None:
            assert secret not in line.replace("shorter", "")
    assert_one_line_error(missing, 2, "SYNC_CONSUMERS_FILE", "cannot read it")


async def test_an_unknown_consumer_is_one_line_and_exit_2(tmp_path: Path) -> None:
    path = consumers_file(tmp_path, settings_sync("http://127.0.0.1:9"))
    result = await run_cli(
        "run", "nope", env=cli_env(DATABASE_URL="dbname=unused", SYNC_CONSUMERS_FILE=str(path))
    )
    assert_one_line_error(
        result,
        2,
        "unknown consumer 'nope'",
        "this build runs: frontend-sync, recording-upload",
        f"SYNC_CONSUMERS_FILE declares: {NAME}",
    )


# -- the declarations in-process -----------------------------------------------------------------


def test_declared_kinds_are_built_from_their_declaration(tmp_path: Path) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(f"  {SECRET},{'9' * 40}\n")
    path = consumers_file(
        tmp_path,
        settings_sync("http://backend:8080/", secret_env="", secret_file=f'"{secret_file}"')
        + '\n[consumers.audit]\nurl = "http://audit:9000"\ntarget_node = "backend"\n'
        + '\n[consumers.quiet]\nsink = "null"\n',
    )
    settings = make_settings(
        "dbname=unused",
        "http://frontend:1",
        SYNC_CONSUMERS_FILE=str(path),
        SYNC_SHARED_SECRET="f" * 40,
        SYNC_TARGET_NODE="backend",
    )
    kind = kinds.consumer_kind(NAME, settings)
    assert kind.entity_types == kind.sends_only == frozenset(TYPES)
    sink = kind.sink(settings, None)
    assert isinstance(sink, FrontendSyncSink)
    assert (sink.url, sink.name) == ("http://backend:8080/api/ingest/sync", NAME)
    # The first secret of the file signs, as the first of SYNC_SHARED_SECRET does.
    assert sink._secret == SECRET
    assert kind.entry_filter(settings) == EntryFilter(frozenset(TYPES), None)
    assert SECRET not in repr(declared.load(path))

    audit = kinds.consumer_kind("audit", settings)
    audit_sink = audit.sink(settings, None)
    assert isinstance(audit_sink, FrontendSyncSink)
    # Neither secret_env nor secret_file: SYNC_SHARED_SECRET, as for the built-ins.
    assert audit_sink._secret == "f" * 40
    assert audit.entry_filter(settings) == EntryFilter(None, "backend")
    assert kinds.consumer_kind("quiet", settings).sink(settings, None).name == "null"
    # A built-in consumer takes SYNC_TARGET_NODE.
    assert kinds.consumer_kind("frontend-sync", settings).entry_filter(settings) == (
        EntryFilter(None, "backend")
    )
    with pytest.raises(kinds.UnknownKindError, match="declares: settings-sync, audit, quiet"):
        kinds.consumer_kind("nope", settings)

    secret_file.write_text("short\n")
    with pytest.raises(ConfigError, match=r"secret_file .* is shorter than 32") as caught:
        kind.check_settings(settings)
    assert "short" not in str(caught.value).replace("shorter", "")
