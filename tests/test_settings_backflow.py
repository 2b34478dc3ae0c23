"""The voicebot's settings flow back: edited in the frontend's database, they reach the backend's
own tables through a declared consumer (settings-sync) and the receiver's table mapping
(deploy/voicebot-mapping.toml), deletes included; the backend's edits go the other way; nothing
comes back to where it came from; and replaying the settings stream changes nothing.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from consumer.runtime.worker import ConsumerRuntime
from tests.conftest import (
    cli_env,
    fetch_all,
    make_settings,
    running_consumer,
    wait_until,
)
from tests.support.cli import assert_ok, run_cli
from tests.support.mapped import serve_mapped, with_receiver_schema
from tests.support.waiting import caught_up, wait_drained

SETTINGS_TYPES = {
    "registered_number": "registered_numbers",
    "routing_rule": "routing_rules",
    "ivr_flow": "ivr_flows",
    "schedule": "schedules",
    "announcement": "announcements",
}
# A row of each settings table, as an operator would save it (every NOT NULL column given).
NEW_ROWS: dict[str, dict[str, Any]] = {
    "registered_numbers": {"phone_number": "0312345678", "label": "office"},
    "routing_rules": {"match_type": "prefix", "match_value": "03", "action": "ivr"},
    "ivr_flows": {"name": "main", "definition": '{"steps": [{"say": "hello"}]}'},
    "schedules": {"name": "weekdays", "rules": '[{"days": "mon-fri", "from": "09:00"}]'},
    "announcements": {"name": "closed", "text": "We are closed."},
}
# One column of each table to change in an update.
UPDATES = {
    "registered_numbers": ("label", "front desk"),
    "routing_rules": ("match_value", "06"),
    "ivr_flows": ("name", "main v2"),
    "schedules": ("timezone", "UTC"),
    "announcements": ("text", "Back at nine."),
}
SETTINGS_SYNC = "settings-sync"
FRONTEND_SYNC = "frontend-sync"


@dataclass
class Voicebot:
    """The backend and the frontend databases, each a named node with the voicebot's tables."""

    backend: str
    frontend: str
    consumers_file: Path
    backend_url: str


async def _name_and_track(dsn: str, node: str) -> None:
    await with_receiver_schema(dsn)
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute("SELECT sync.set_node_name(%s)", (node,))
        for entity_type, table in SETTINGS_TYPES.items():
            await conn.execute(
                "SELECT sync.track(%s::regclass, %s, 'id', true)", (f"public.{table}", entity_type)
            )


@contextlib.asynccontextmanager
async def voicebot(
    dsns: tuple[str, str], tmp_path: Path
) -> AsyncIterator[tuple[Voicebot, ConsumerRuntime]]:
    """Both nodes with their receivers; frontend-sync runs on the backend (to the frontend)
    for the whole block, and the settings-sync runtime is yielded to be stopped and restarted."""
    backend, frontend = dsns
    await _name_and_track(backend, "backend")
    await _name_and_track(frontend, "frontend")
    consumers = tmp_path / "consumers.toml"
    async with (
        serve_mapped(backend) as backend_url,
        serve_mapped(frontend) as frontend_url,
        running_consumer(
            make_settings(backend, frontend_url, SYNC_TARGET_NODE="frontend"), FRONTEND_SYNC
        ),
    ):
        declare_settings_sync(consumers, backend_url)
        bot = Voicebot(backend, frontend, consumers, backend_url)
        async with running_settings_sync(bot) as runtime:
            yield bot, runtime


def declare_settings_sync(path: Path, backend_url: str) -> None:
    """The consumers file of the frontend: settings-sync to the backend's receiver."""
    types = ", ".join(f'"{entity_type}"' for entity_type in sorted(SETTINGS_TYPES))
    path.write_text(
        f"[consumers.{SETTINGS_SYNC}]\n"
        'sink = "json"\n'
        f'url = "{backend_url}"\n'
        f"entity_types = [{types}]\n"
        'target_node = "backend"\n'
    )


def running_settings_sync(bot: Voicebot) -> contextlib.AbstractAsyncContextManager[Any]:
    settings = make_settings(
        bot.frontend, bot.backend_url, SYNC_CONSUMERS_FILE=str(bot.consumers_file)
    )
    return running_consumer(settings, SETTINGS_SYNC)


async def drained(bot: Voicebot) -> None:
    """Until both directions are drained (tests.support.waiting.wait_drained)."""
    await wait_drained((bot.frontend, SETTINGS_SYNC), (bot.backend, FRONTEND_SYNC))


async def rows(dsn: str, table: str) -> list[Any]:
    """Every row of a settings table, whole, in key order."""
    found = await fetch_all(
        dsn,
        sql.SQL("SELECT to_jsonb(t) FROM {} AS t ORDER BY id").format(
            sql.Identifier("public", table)
        ),
    )
    return [row for (row,) in found]


async def execute(dsn: str, statement: Any, params: Any = None) -> None:
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute(statement, params)


async def insert(dsn: str, table: str, values: dict[str, Any]) -> None:
    columns = sql.SQL(", ").join(sql.Identifier(c) for c in values)
    placeholders = sql.SQL(", ").join(sql.Placeholder() for _ in values)
    await execute(
        dsn,
        sql.SQL("INSERT INTO {} ({}) VALUES ({})").format(
            sql.Identifier("public", table), columns, placeholders
        ),
        list(values.values()),
    )


async def test_each_settings_table_round_trips_with_deletes(
    node_dsns: tuple[str, str], tmp_path: Path
) -> None:
    async with voicebot(node_dsns, tmp_path) as (bot, _):
        for table, values in NEW_ROWS.items():
            key = str(uuid.uuid4())
            # The operator saves a new row in the frontend: the backend has it, whole.
            await insert(bot.frontend, table, {"id": key, **values})
            await drained(bot)
            assert await rows(bot.backend, table) == await rows(bot.frontend, table), table
            assert len(await rows(bot.backend, table)) == 1, table
            # ... changes it ...
            column, value = UPDATES[table]
            await execute(
                bot.frontend,
                sql.SQL("UPDATE {} SET {} = %s, updated_at = now() WHERE id = %s").format(
                    sql.Identifier("public", table), sql.Identifier(column)
                ),
                (value, key),
            )
            await drained(bot)
            backend_rows = await rows(bot.backend, table)
            assert backend_rows == await rows(bot.frontend, table), table
            assert backend_rows[0][column] == value, table
            # ... the backend changes it the other way ...
            await execute(
                bot.backend,
                sql.SQL("UPDATE {} SET updated_at = now() WHERE id = %s").format(
                    sql.Identifier("public", table)
                ),
                (key,),
            )
            await drained(bot)
            assert await rows(bot.frontend, table) == await rows(bot.backend, table), table
            # ... and the operator deletes it: gone on both sides.
            await execute(
                bot.frontend,
                sql.SQL("DELETE FROM {} WHERE id = %s").format(sql.Identifier("public", table)),
                (key,),
            )
            await drained(bot)
            assert await rows(bot.backend, table) == [], table
            assert await rows(bot.frontend, table) == [], table
        # Nothing came back: every outbox row of a settings table on the frontend is either the
        # operator's own edit or the backend's (none relayed back from the frontend's own).
        origins = await fetch_all(
            bot.frontend,
            "SELECT DISTINCT origin FROM sync.events_outbox WHERE entity_type = ANY(%s)",
            (list(SETTINGS_TYPES),),
        )
        assert sorted(origins, key=str) == sorted([(None,), ("backend",)], key=str)


async def test_a_replay_of_the_settings_stream_changes_nothing(
    node_dsns: tuple[str, str], tmp_path: Path
) -> None:
    async with voicebot(node_dsns, tmp_path) as (bot, runtime):
        keys = []
        for table, values in NEW_ROWS.items():
            key = str(uuid.uuid4())
            keys.append(key)
            await insert(bot.frontend, table, {"id": key, **values})
        await execute(bot.frontend, "DELETE FROM public.announcements WHERE id = %s", (keys[-1],))
        await execute(
            bot.frontend,
            "UPDATE public.registered_numbers SET label = 'changed' WHERE id = %s",
            (keys[0],),
        )
        await drained(bot)
        before = {table: await rows(bot.backend, table) for table in SETTINGS_TYPES.values()}
        versions = await fetch_all(
            bot.backend, "SELECT * FROM sync.row_versions ORDER BY entity_type, entity_id"
        )
        outbox_end = await fetch_all(bot.backend, "SELECT max(seq) FROM sync.events_outbox")
        delivered = runtime.stats.delivered_events
        assert delivered > 0

    # The operator stops settings-sync and replays it from the start of the outbox.
    env = cli_env(
        DATABASE_URL=bot.frontend,
        FRONTEND_BASE_URL=bot.backend_url,
        SYNC_CONSUMERS_FILE=str(bot.consumers_file),
    )
    assert_ok(await run_cli("offsets", "reset", SETTINGS_SYNC, "--to-earliest", env=env))
    async with serve_mapped(bot.backend) as backend_url:
        declare_settings_sync(bot.consumers_file, backend_url)
        async with running_consumer(
            make_settings(bot.frontend, backend_url, SYNC_CONSUMERS_FILE=str(bot.consumers_file)),
            SETTINGS_SYNC,
        ) as replaying:
            await wait_until(
                lambda: caught_up(bot.frontend, SETTINGS_SYNC), timeout=30, what="the replay"
            )
            assert replaying.stats.delivered_events >= delivered
    assert {table: await rows(bot.backend, table) for table in SETTINGS_TYPES.values()} == before
    assert (
        await fetch_all(
            bot.backend, "SELECT * FROM sync.row_versions ORDER BY entity_type, entity_id"
        )
        == versions
    )
    # Nothing new was relayed on the backend: every replayed entry lost to the version it had.
    assert await fetch_all(bot.backend, "SELECT max(seq) FROM sync.events_outbox") == outbox_end
