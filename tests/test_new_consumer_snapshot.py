"""A new consumer starts whole: registered when the outbox no longer holds the whole history, it
starts at the outbox's end with a snapshot of the tables it carries, for it alone, written by its
leader beside the live stream and resumed by the next leader after a kill; `--from-now` and
`--from-earliest` start without one. Real PostgreSQL, real consumer processes, the real cleanup
command, the reference receiver or a scripted one over HTTP on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import random
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import conninfo, sql

from consumer.app.settings import SyncSettings, load
from consumer.store.snapshots import mark_history_incomplete
from tests.conftest import cli_env, fetch_all, fetch_value, wait_until
from tests.support.backend import CONSUMER, execute, insert_calls, offset
from tests.support.cli import assert_ok, run_cli
from tests.support.processes import Processes, ServersyncProcess
from tests.support.receivers import scripted_receiver
from tests.support.waiting import wait_caught_up

# What a receiver must hold of a call log (the columns no session setting writes differently).
CALL_COLUMNS = ("id", "caller_number", "callee_number", "status", "summary", "duration_sec")
DECLARED = "audit-sync"
# A consumer that passed every row before cleanup ran (cleanup deletes only rows every consumer
# has passed).
ARCHIVE = "archive-sync"


# -- the backend ---------------------------------------------------------------------------------


async def clean_up_history(dsn: str) -> None:
    """Every outbox row so far made older than the retention and passed by a consumer that ran
    before (ARCHIVE), then `serversync cleanup`: the outbox no longer holds the whole history."""
    await execute(dsn, "UPDATE sync.events_outbox SET created_at = now() - interval '40 days'")
    await execute(
        dsn,
        "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq) "
        "SELECT %s, o.txid, o.seq FROM sync.events_outbox o "
        "ORDER BY o.txid DESC, o.seq DESC LIMIT 1 "
        "ON CONFLICT (consumer) DO UPDATE "
        "SET last_txid = EXCLUDED.last_txid, last_seq = EXCLUDED.last_seq",
        params=(ARCHIVE,),
    )
    assert_ok(await run_cli("cleanup", env=cli_env(DATABASE_URL=dsn)))
    assert await fetch_value(dsn, "SELECT count(*) FROM sync.events_outbox") == 0
    assert await fetch_value(dsn, "SELECT complete FROM sync.outbox_history") is False


async def calls_in_table(dsn: str) -> dict[str, dict[str, Any]]:
    """call_logs as they stand, by id."""
    rows = await fetch_all(dsn, "SELECT to_jsonb(c) FROM call_logs c")
    return {row[0]["id"]: {k: row[0][k] for k in CALL_COLUMNS} for row in rows}


async def calls_at_receiver(receiver_dsn: str) -> dict[str, dict[str, Any]]:
    """The live call logs the reference receiver holds, by id."""
    rows = await fetch_all(
        receiver_dsn,
        "SELECT entity_id, payload FROM ingest.entities "
        "WHERE entity_type = 'call_log' AND NOT deleted",
    )
    return {eid: {k: payload[k] for k in CALL_COLUMNS} for eid, payload in rows}


async def snapshots(dsn: str) -> list[dict[str, Any]]:
    """Every snapshot with its progress, oldest first."""
    rows = await fetch_all(
        dsn,
        "SELECT s.id, s.consumer, s.requested_by, s.state, "
        "coalesce(sum(t.rows_sent), 0)::bigint, coalesce(sum(t.rows_total), 0)::bigint, "
        "array_agg(t.entity_type ORDER BY t.position) "
        "FROM sync.snapshots s LEFT JOIN sync.snapshot_tables t ON t.snapshot_id = s.id "
        "GROUP BY s.id ORDER BY s.id",
    )
    keys = ("id", "consumer", "requested_by", "state", "rows_sent", "rows_total", "types")
    return [dict(zip(keys, row, strict=True)) for row in rows]


async def snapshot_done(dsn: str) -> bool:
    shots = await snapshots(dsn)
    return bool(shots) and all(s["state"] == "done" for s in shots)


@contextlib.asynccontextmanager
async def editing_calls(dsn: str) -> AsyncIterator[list[int]]:
    """Producers editing call_logs until the block ends: updates, deletes and inserts, each its
    own transaction. Yields a one-item list: how many edits committed so far."""
    count = [0]
    stop = asyncio.Event()

    async def edit() -> None:
        rng = random.Random(7)
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            while not stop.is_set():
                pick = rng.random()
                if pick < 0.7:
                    await conn.execute(
                        "UPDATE call_logs SET summary = %s, status = 'done' "
                        "WHERE id = (SELECT id FROM call_logs ORDER BY random() LIMIT 1)",
                        (f"edit {count[0]}",),
                    )
                elif pick < 0.85:
                    await conn.execute(
                        "DELETE FROM call_logs "
                        "WHERE id = (SELECT id FROM call_logs ORDER BY random() LIMIT 1)"
                    )
                else:
                    await conn.execute(
                        "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                        (f"live-{count[0]}",),
                    )
                count[0] += 1
                await asyncio.sleep(0.002)  # a producer's pace, not a synchronisation

    task = asyncio.create_task(edit())
    try:
        yield count
    finally:
        stop.set()
        await task


# -- the consumer ----------------------------------------------------------------------------------


def declared_file(tmp_path: Path, url: str, types: tuple[str, ...]) -> Path:
    path = tmp_path / "consumers.toml"
    listed = ", ".join(f'"{t}"' for t in types)
    path.write_text(
        f'[consumers.{DECLARED}]\nsink = "json"\nurl = "{url}"\nentity_types = [{listed}]\n'
    )
    return path


async def registered(dsn: str, consumer: str) -> bool:
    return await offset(dsn, consumer) is not None


async def wait_snapshot_done(dsn: str, process: ServersyncProcess, timeout: float = 60) -> None:
    async def done() -> bool:
        process.assert_alive()
        return await snapshot_done(dsn)

    await wait_until(done, timeout=timeout, what="the snapshot to be done")


# -- the tests -------------------------------------------------------------------------------------


async def test_a_new_consumer_after_cleanup_starts_whole_with_edits_during_its_snapshot(
    backend_dsn: str, receiver_dsn: str, receiver_url: str, tmp_path: Path
) -> None:
    await insert_calls(backend_dsn, 3000, tag="before", transactions=3)
    await execute(
        backend_dsn,
        "UPDATE call_logs SET status = 'old' WHERE caller_number LIKE 'before-1%'",
        "DELETE FROM call_logs WHERE caller_number LIKE 'before-2%'",
        "INSERT INTO registered_numbers (phone_number, label) VALUES ('+811', 'one')",
    )
    await clean_up_history(backend_dsn)

    with Processes(tmp_path) as processes:
        async with editing_calls(backend_dsn) as edits:
            consumer = processes.consumer(backend_dsn, receiver_url)
            await consumer.wait_log("starts with snapshot", timeout=30)
            edits_at_start = edits[0]
            await wait_snapshot_done(backend_dsn, consumer)
            edits_during = edits[0] - edits_at_start
        # Producers edited the table while its snapshot was written.
        assert edits_during > 0
        await wait_caught_up(backend_dsn, CONSUMER, timeout=60)

        (shot,) = await snapshots(backend_dsn)
        assert (shot["consumer"], shot["requested_by"], shot["state"]) == (
            CONSUMER,
            "new consumer",
            "done",
        )
        # frontend-sync carries every type: every tracked table is in it.
        assert "call_log" in shot["types"] and "registered_number" in shot["types"]
        # Row by row, the receiver holds what the table holds now.
        table = await calls_in_table(backend_dsn)
        assert await calls_at_receiver(receiver_dsn) == table
        assert len(table) > 1800  # 3000 inserted, 1111 deleted, then the edits
        label = await fetch_value(
            receiver_dsn,
            "SELECT payload->>'label' FROM ingest.entities "
            "WHERE entity_type = 'registered_number' AND NOT deleted",
        )
        assert label == "one"
        assert "snapshot" in consumer.log() and "done" in consumer.log()
        # A restart finds it registered: no second snapshot.
        await consumer.stop()
        again = processes.consumer(backend_dsn, receiver_url, "consumer-again")
        await again.wait_log("leading", timeout=30)
        assert len(await snapshots(backend_dsn)) == 1


async def test_from_now_delivers_only_changes_after_registration(
    backend_dsn: str, tmp_path: Path
) -> None:
    await insert_calls(backend_dsn, 50, tag="old")
    await clean_up_history(backend_dsn)
    await insert_calls(backend_dsn, 20, tag="kept")  # in the outbox, before registration
    async with scripted_receiver() as receiver:
        with Processes(tmp_path) as processes:
            consumer = processes.start(
                "consumer",
                ["run", CONSUMER, "--from-now"],
                DATABASE_URL=backend_dsn,
                FRONTEND_BASE_URL=receiver.url,
            )
            await consumer.wait_log("leading", timeout=30)
            await insert_calls(backend_dsn, 10, tag="new")
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            callers = sorted(e["payload"]["caller_number"] for e in receiver.accepted_entries)
            assert callers == sorted(f"new-{i}" for i in range(1, 11))
            assert not any("snapshot" in e for e in receiver.accepted_entries)
            assert await snapshots(backend_dsn) == []


async def test_from_earliest_starts_at_the_outbox_start_with_no_snapshot(
    backend_dsn: str, tmp_path: Path
) -> None:
    await insert_calls(backend_dsn, 50, tag="old")
    await clean_up_history(backend_dsn)
    await insert_calls(backend_dsn, 20, tag="kept")
    async with scripted_receiver() as receiver:
        with Processes(tmp_path) as processes:
            consumer = processes.start(
                "consumer",
                ["run", CONSUMER, "--from-earliest"],
                DATABASE_URL=backend_dsn,
                FRONTEND_BASE_URL=receiver.url,
            )
            await wait_until(lambda: registered(backend_dsn, CONSUMER), timeout=30)
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            consumer.assert_alive()
            # What is left of the history, and nothing of a snapshot.
            callers = sorted(e["payload"]["caller_number"] for e in receiver.accepted_entries)
            assert callers == sorted(f"kept-{i}" for i in range(1, 21))
            assert await snapshots(backend_dsn) == []


async def test_with_the_whole_history_a_new_consumer_reads_it_and_takes_no_snapshot(
    backend_dsn: str, tmp_path: Path
) -> None:
    await insert_calls(backend_dsn, 30, tag="all")
    assert await fetch_value(backend_dsn, "SELECT complete FROM sync.outbox_history") is True
    async with scripted_receiver() as receiver:
        with Processes(tmp_path) as processes:
            consumer = processes.consumer(backend_dsn, receiver.url)
            await consumer.wait_log("registered at the start of the outbox", timeout=30)
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            assert len(receiver.accepted_entries) == 30
            assert await snapshots(backend_dsn) == []


async def test_a_start_option_is_ignored_for_a_registered_consumer(
    backend_dsn: str, tmp_path: Path
) -> None:
    await insert_calls(backend_dsn, 5, tag="first")
    async with scripted_receiver() as receiver:
        with Processes(tmp_path) as processes:
            first = processes.consumer(backend_dsn, receiver.url)
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            await first.stop()
            await insert_calls(backend_dsn, 5, tag="second")
            await mark_outbox_history_incomplete(backend_dsn)
            again = processes.start(
                "again",
                ["run", CONSUMER, "--from-now"],
                DATABASE_URL=backend_dsn,
                FRONTEND_BASE_URL=receiver.url,
            )
            await again.wait_log("is registered already", timeout=30)
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            # It went on from its offset: the second five were delivered, no snapshot taken.
            callers = {e["payload"]["caller_number"] for e in receiver.accepted_entries}
            assert {f"second-{i}" for i in range(1, 6)} <= callers
            assert await snapshots(backend_dsn) == []


async def mark_outbox_history_incomplete(dsn: str) -> None:
    """The outbox no longer holds the whole history (recorded as cleanup records it)."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await mark_history_incomplete(conn, "test: rows deleted")


async def test_a_leader_killed_mid_snapshot_is_resumed_by_the_next_one(
    backend_dsn: str, receiver_dsn: str, receiver_url: str, tmp_path: Path
) -> None:
    # Rows written without the relay (as a table that held rows before it was tracked): a
    # snapshot big enough to be caught half-way.
    await execute(
        backend_dsn,
        "SET session_replication_role = replica",
        "INSERT INTO call_logs (caller_number, callee_number) "
        "SELECT 'big-' || g, 'x' FROM generate_series(1, 50000) g",
    )
    await mark_outbox_history_incomplete(backend_dsn)
    with Processes(tmp_path) as processes:
        first = processes.consumer(backend_dsn, receiver_url, "first", SYNC_BATCH_SIZE="1000")

        async def partly_sent() -> bool:
            first.assert_alive()
            shots = await snapshots(backend_dsn)
            return bool(shots) and shots[0]["rows_sent"] > 0

        await wait_until(partly_sent, timeout=60, what="the snapshot to send some rows")
        first.kill()
        await first.wait_exit()
        (killed,) = await snapshots(backend_dsn)
        assert killed["state"] == "running"
        assert 0 < killed["rows_sent"] < killed["rows_total"]

        second = processes.consumer(backend_dsn, receiver_url, "second", SYNC_BATCH_SIZE="1000")
        await second.wait_log(f"resuming snapshot {killed['id']}", timeout=30)
        await wait_snapshot_done(backend_dsn, second, timeout=120)
        (resumed,) = await snapshots(backend_dsn)
        assert resumed["id"] == killed["id"]
        assert resumed["rows_sent"] >= resumed["rows_total"] == 50000
        await wait_caught_up(backend_dsn, CONSUMER, timeout=120)
        assert await calls_at_receiver(receiver_dsn) == await calls_in_table(backend_dsn)


async def test_another_consumer_never_sees_a_new_consumers_snapshot(
    backend_dsn: str, tmp_path: Path
) -> None:
    async with scripted_receiver() as old_receiver, scripted_receiver() as new_receiver:
        path = declared_file(tmp_path, new_receiver.url, ("registered_number",))
        env = {"DATABASE_URL": backend_dsn, "SYNC_CONSUMERS_FILE": str(path)}
        with Processes(tmp_path) as processes:
            old = processes.consumer(backend_dsn, old_receiver.url, **env)
            await wait_until(lambda: registered(backend_dsn, CONSUMER), timeout=30)
            await insert_calls(backend_dsn, 20, tag="c")
            await execute(
                backend_dsn,
                "INSERT INTO registered_numbers (phone_number, label) "
                "SELECT '+81' || g, 'n' || g FROM generate_series(1, 40) g",
            )
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            await mark_outbox_history_incomplete(backend_dsn)
            delivered_before = len(old_receiver.accepted_entries)

            new = processes.start(DECLARED, ["run", DECLARED], **env)
            await wait_snapshot_done(backend_dsn, new)
            await wait_caught_up(backend_dsn, DECLARED, timeout=30)
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            old.assert_alive()

            (shot,) = await snapshots(backend_dsn)
            # Its tables only: the types it carries.
            assert (shot["consumer"], shot["types"]) == (DECLARED, ["registered_number"])
            snapped = [e for e in new_receiver.accepted_entries if e.get("snapshot") == shot["id"]]
            assert sorted(e["payload"]["label"] for e in snapped) == sorted(
                f"n{g}" for g in range(1, 41)
            )
            assert {e["entityType"] for e in new_receiver.accepted_entries} == {"registered_number"}
            # The other consumer passed over every row of it.
            assert len(old_receiver.accepted_entries) == delivered_before
            assert not any("snapshot" in e for e in old_receiver.accepted_entries)


@pytest.mark.parametrize("value", ["auto", "NOW", "earliest"])
def test_sync_start_takes_the_three_choices(value: str) -> None:
    settings = load(SyncSettings, DATABASE_URL="postgresql://x@y/z", SYNC_START=value)
    assert settings.start_from == value.lower()


@contextlib.asynccontextmanager
async def consumer_role(dsn: str) -> AsyncIterator[str]:
    """A login role with a consumer's grants and those to ask for a snapshot, but none on the
    tracked tables (it cannot write the snapshot); yields its DSN. Dropped at the end."""
    role = f"ss_consumer_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    grants = [
        sql.SQL("CREATE ROLE {} LOGIN").format(ident),
        sql.SQL("GRANT USAGE ON SCHEMA sync TO {}").format(ident),
        sql.SQL(
            "GRANT SELECT ON sync.schema_migrations, sync.events_outbox, sync.outbox_history, "
            "sync.tracked_tables TO {}"
        ).format(ident),
        sql.SQL(
            "GRANT SELECT, INSERT, UPDATE ON sync.consumer_offsets, sync.consumer_waits, "
            "sync.snapshots, sync.snapshot_tables TO {}"
        ).format(ident),
        sql.SQL(
            "GRANT USAGE ON SEQUENCE sync.snapshots_id_seq TO {0}; "
            "GRANT UPDATE ON SEQUENCE sync.waiting_consumers TO {0}; "
            "GRANT SELECT, INSERT ON sync.dlq_messages TO {0}"
        ).format(ident),
    ]
    await execute(dsn, *grants)
    try:
        yield conninfo.make_conninfo(dsn, user=role)
    finally:
        await execute(
            dsn,
            sql.SQL("DROP OWNED BY {}").format(ident),
            sql.SQL("DROP ROLE {}").format(ident),
        )


async def test_a_snapshot_its_role_cannot_write_leaves_the_live_stream_running(
    backend_dsn: str, tmp_path: Path
) -> None:
    await insert_calls(backend_dsn, 30, tag="before")
    await mark_outbox_history_incomplete(backend_dsn)
    async with consumer_role(backend_dsn) as role_dsn, scripted_receiver() as receiver:
        with Processes(tmp_path) as processes:
            consumer = processes.consumer(role_dsn, receiver.url)
            line = await consumer.wait_log(
                f"run `serversync snapshot --consumer {CONSUMER}` as the tables' owner", timeout=30
            )
            assert line
            error = await fetch_value(
                backend_dsn,
                "SELECT last_error FROM sync.consumer_offsets WHERE consumer = %s",
                (CONSUMER,),
            )
            assert "permission denied" in error and "serversync snapshot" in error
            # Live changes go through all the same.
            await insert_calls(backend_dsn, 5, tag="live")
            await wait_caught_up(backend_dsn, CONSUMER, timeout=30)
            callers = sorted(e["payload"]["caller_number"] for e in receiver.accepted_entries)
            assert callers == sorted(f"live-{i}" for i in range(1, 6))
            (shot,) = await snapshots(backend_dsn)
            assert (shot["state"], shot["rows_sent"]) == ("running", 0)
            consumer.assert_alive()
