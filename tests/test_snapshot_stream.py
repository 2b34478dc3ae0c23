"""A snapshot as consumers see it: its entries carry the snapshot's id, go even to the node a
row's version came from (no echo filter), carry a both-ways row's stored version, and a snapshot
for one consumer is passed over by every other, whose offset still moves past it. Real
PostgreSQL, real HTTP on loopback, the real consumer runtime."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import psycopg

from consumer.store import snapshot_writer, snapshots
from tests.conftest import fetch_all, make_settings, running_consumer
from tests.support.backend import CONSUMER, execute, insert_callers, outbox_end
from tests.support.receivers import scripted_receiver
from tests.support.waiting import wait_caught_up, wait_until

HERE = "frontend"
TARGET = "backend"
ENTITY_TYPE = "setting"
# The version the target node gave the row it made.
TARGET_VERSION = datetime(2030, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)


async def _snapshot(dsn: str, *tables: str, consumer: str | None = None) -> int:
    """Ask for and write a snapshot of `tables`; its id."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        planned = await snapshots.plan_tables(conn, tables)
        snapshot_id = await snapshots.create_snapshot(conn, planned, consumer=consumer)
        done = await snapshot_writer.run_snapshot(conn, snapshot_id, chunk_size=3)
    assert done.state == "done"
    return snapshot_id


async def _settings_from_both_nodes(dsn: str) -> None:
    """`settings`, tracked both ways on node HERE: row 1 edited here, row 2 applied from TARGET
    as a receiver applies it (version written first, in the apply's transaction, with its
    origin)."""
    await execute(
        dsn,
        "CREATE TABLE settings (id int PRIMARY KEY, value text)",
        f"SELECT sync.set_node_name('{HERE}')",
        f"SELECT sync.track('settings', '{ENTITY_TYPE}', 'id', both_ways => true)",
        "INSERT INTO settings VALUES (1, 'made here')",
    )
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn, conn.transaction():
        await conn.execute("SELECT set_config('serversync.origin', %s, true)", (TARGET,))
        await conn.execute(
            "INSERT INTO sync.row_versions"
            " (entity_type, entity_id, version_ts, version_node, deleted, applied_xact)"
            " VALUES (%s, '2', %s, %s, false, pg_current_xact_id())",
            (ENTITY_TYPE, TARGET_VERSION, TARGET),
        )
        await conn.execute("INSERT INTO settings VALUES (2, 'made there')")


def _of_snapshot(entries: list[dict[str, Any]], snapshot_id: int) -> dict[str, dict[str, Any]]:
    return {e["entityId"]: e for e in entries if e.get("snapshot") == snapshot_id}


async def test_snapshot_entries_reach_the_node_a_version_came_from_with_that_version(
    backend_dsn: str,
) -> None:
    await _settings_from_both_nodes(backend_dsn)
    async with scripted_receiver() as receiver:
        settings = make_settings(backend_dsn, receiver.url, SYNC_TARGET_NODE=TARGET)
        async with running_consumer(settings) as runtime:
            await wait_caught_up(backend_dsn)
            # The change applied from TARGET is an echo for this consumer: not sent.
            assert [e["entityId"] for e in receiver.accepted_entries] == ["1"]
            snapshot_id = await _snapshot(backend_dsn, "settings")
            await wait_caught_up(backend_dsn)
        assert runtime.stats.skipped_events == 1

    sent = _of_snapshot(receiver.accepted_entries, snapshot_id)
    # Both rows, the one whose version came from TARGET included: a node being rebuilt needs
    # it, and one that holds it ignores an equal version.
    assert sorted(sent) == ["1", "2"]
    assert sent["2"]["payload"] == {"id": 2, "value": "made there"}
    assert sent["2"]["op"] == "upsert"
    # The row's stored version, not a new one: a snapshot never wins over a newer edit.
    assert (sent["2"]["origin"], sent["2"]["createdAt"]) == (
        TARGET,
        TARGET_VERSION.isoformat(),
    )
    [(local_version,)] = await fetch_all(
        backend_dsn,
        "SELECT version_ts FROM sync.row_versions WHERE entity_type = %s AND entity_id = '1'",
        (ENTITY_TYPE,),
    )
    assert sent["1"]["origin"] == HERE
    assert datetime.fromisoformat(sent["1"]["createdAt"]) == local_version


async def test_a_snapshot_for_another_consumer_is_passed_over_and_the_offset_moves_past_it(
    backend_dsn: str,
) -> None:
    await insert_callers(backend_dsn, [f"before-{i}" for i in range(20)])
    async with scripted_receiver() as receiver:
        # Batches of 4: the snapshot's 20 rows fill whole reads with nothing to send.
        settings = make_settings(backend_dsn, receiver.url, SYNC_BATCH_SIZE=4)
        async with running_consumer(settings) as runtime:
            await wait_caught_up(backend_dsn)
            delivered = runtime.stats.delivered_events
            requests = len(receiver.attempts)
            await _snapshot(backend_dsn, "call_logs", consumer="audit")
            end = await wait_caught_up(backend_dsn)
            assert (end.txid, end.seq) == await outbox_end(backend_dsn)
            # Nothing of it was sent, and no request was made for it.
            assert runtime.stats.delivered_events == delivered
            assert len(receiver.attempts) == requests
            await insert_callers(backend_dsn, ["after"])

            async def arrived() -> bool:
                return any(
                    e["payload"].get("caller_number") == "after" for e in receiver.accepted_entries
                )

            await wait_until(arrived, what="the change written after the snapshot")
    assert not [e for e in receiver.accepted_entries if "snapshot" in e]
    targeted = await fetch_all(
        backend_dsn,
        "SELECT count(*) FROM sync.events_outbox WHERE target_consumer = 'audit'",
    )
    assert targeted == [(20,)]
    assert CONSUMER == "frontend-sync"
