"""What a consumer does not send: events whose origin is the node it delivers to (no echo), and
entity types it was not given. Never sent, yet passed by the offset; other consumers still get
them. Real PostgreSQL, real HTTP on loopback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import psycopg
import pytest

from consumer.app.settings import ConfigError
from consumer.app.wiring import consumer_runtime
from consumer.core.events import Batch, Position
from consumer.runtime.filtering import EntryFilter
from tests.conftest import fetch_value, make_settings, running_consumer
from tests.support.backend import CONSUMER, execute, insert_callers, outbox_end
from tests.support.dlq import parked_by_caller
from tests.support.receivers import scripted_receiver
from tests.support.waiting import wait_caught_up

# The node the consumer under test delivers to, and the name of its own database.
TARGET = "backend"
HERE = "frontend"
# A declared consumer without a target node: it sends everything.
AUDIT = "audit"


async def insert_from(dsn: str, node: str, callers: list[str]) -> None:
    """call_logs rows written as a receiver's apply writes them: in one transaction that says
    whose changes it applies (serversync.origin), so the relay records that origin."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn, conn.transaction():
        await conn.execute("SELECT set_config('serversync.origin', %s, true)", (node,))
        await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) "
            "SELECT c, 'x' FROM unnest(%s::text[]) WITH ORDINALITY AS u(c, n) ORDER BY n",
            (callers,),
        )


async def insert_mixed(dsn: str, rows: list[tuple[str, str | None]]) -> None:
    """(caller, origin) rows in ONE transaction (one batch), each with its own origin (None: a
    change made here)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn, conn.transaction():
        for caller, origin in rows:
            await conn.execute("SELECT set_config('serversync.origin', %s, true)", (origin or "",))
            await conn.execute(
                "INSERT INTO call_logs (caller_number, callee_number) VALUES (%s, 'x')",
                (caller,),
            )


def audit_file(tmp_path: Path, url: str) -> Path:
    """A consumers file declaring AUDIT: every entity type, no target node."""
    path = tmp_path / "consumers.toml"
    path.write_text(f'[consumers.{AUDIT}]\nsink = "json"\nurl = "{url}"\n')
    return path


def callers_of(entries: list[dict[str, Any]]) -> list[str]:
    """The caller numbers of accepted entries in outbox order (batches in flight together may
    be answered in any order)."""
    return [str(e["payload"]["caller_number"]) for e in sorted(entries, key=lambda e: e["seq"])]


async def test_events_from_the_target_node_are_passed_over_and_other_consumers_get_them(
    backend_dsn: str, tmp_path: Path
) -> None:
    await execute(backend_dsn, f"SELECT sync.set_node_name('{HERE}')")
    async with scripted_receiver() as frontend, scripted_receiver() as audit:
        settings = make_settings(
            backend_dsn,
            frontend.url,
            SYNC_TARGET_NODE=TARGET,
            SYNC_CONSUMERS_FILE=str(audit_file(tmp_path, audit.url)),
            # Small batches, several in flight: the offset moves in order past passed-over
            # entries whatever batch they fall in.
            SYNC_BATCH_SIZE=2,
            SYNC_MAX_IN_FLIGHT=3,
        )
        await insert_callers(backend_dsn, ["l1", "l2"])
        await insert_from(backend_dsn, TARGET, ["b1"])
        await insert_mixed(
            backend_dsn, [("l3", None), ("b2", TARGET), ("b3", TARGET), ("l4", None)]
        )
        # A change that came from a third node is no echo for this consumer: it is sent.
        await insert_from(backend_dsn, "branch", ["x1"])
        async with (
            running_consumer(settings) as runtime,
            running_consumer(settings, AUDIT) as audit_runtime,
        ):
            end = await wait_caught_up(backend_dsn)
            assert await wait_caught_up(backend_dsn, AUDIT) == end
        assert end == Position(*(await outbox_end(backend_dsn) or (0, 0)))

        # frontend-sync sent the changes made here and the third node's, never the target's.
        assert callers_of(frontend.accepted_entries) == ["l1", "l2", "l3", "l4", "x1"]
        origins = {e["origin"] for e in frontend.accepted_entries}
        assert origins == {HERE, "branch"}
        assert runtime.stats.skipped_events == 3
        assert runtime.stats.delivered_events == 5
        assert runtime.stats.parked_events == 0
        delivered_total = await fetch_value(
            backend_dsn,
            "SELECT delivered_total FROM sync.consumer_offsets WHERE consumer = %s",
            (CONSUMER,),
        )
        assert delivered_total == 5

        # The consumer without a target node got every event, with its origin.
        assert callers_of(audit.accepted_entries) == [
            "l1",
            "l2",
            "b1",
            "l3",
            "b2",
            "b3",
            "l4",
            "x1",
        ]
        by_caller = {str(e["payload"]["caller_number"]): e for e in audit.accepted_entries}
        assert by_caller["b1"]["origin"] == TARGET
        assert by_caller["l1"]["origin"] == HERE
        assert audit_runtime.stats.skipped_events == 0
        # Each consumer's own Idempotency-Key namespace.
        assert all(a.key.startswith(f"{AUDIT}:") for a in audit.attempts)
        assert all(a.key.startswith(f"{CONSUMER}:") for a in frontend.attempts)


async def test_a_backlog_all_from_the_target_node_moves_the_offset_without_a_request(
    backend_dsn: str,
) -> None:
    async with scripted_receiver() as frontend:
        for n in range(4):
            await insert_from(backend_dsn, TARGET, [f"b{n}a", f"b{n}b"])
        settings = make_settings(
            backend_dsn, frontend.url, SYNC_TARGET_NODE=TARGET, SYNC_BATCH_SIZE=3
        )
        async with running_consumer(settings) as runtime:
            await wait_caught_up(backend_dsn)
            assert runtime.stats.skipped_events == 8
            assert runtime.stats.delivered_events == 0
            # Then an event made here: the next request holds it alone.
            await insert_callers(backend_dsn, ["here"])
            await wait_caught_up(backend_dsn)
        assert frontend.seen == 1, frontend.statuses
        assert callers_of(frontend.accepted_entries) == ["here"]
        assert runtime.stats.delivered_events == 1
    assert (
        await fetch_value(
            backend_dsn,
            "SELECT delivered_total FROM sync.consumer_offsets WHERE consumer = %s",
            (CONSUMER,),
        )
        == 1
    )


async def test_a_target_node_that_is_this_databases_own_name_is_refused(
    backend_dsn: str,
) -> None:
    await execute(backend_dsn, f"SELECT sync.set_node_name('{TARGET}')")
    settings = make_settings(backend_dsn, "http://127.0.0.1:9", SYNC_TARGET_NODE=TARGET)
    with pytest.raises(ConfigError, match="its target node 'backend' is this database's own"):
        async with consumer_runtime(settings, CONSUMER):
            pass
    # `--sink null` passes nothing over, so it does not ask.
    async with consumer_runtime(settings, CONSUMER, "null") as runtime:
        assert runtime.entry_filter is None


# -- the filter on its own -----------------------------------------------------------------------


def batch_of(*entries: dict[str, Any]) -> Batch:
    """A batch of these entries, as the outbox store would write them."""
    seqs = [int(e["seq"]) for e in entries]
    return Batch(
        count=len(entries),
        end=Position(99, max(seqs)),
        min_seq=min(seqs),
        max_seq=max(seqs),
        entries_json=orjson.dumps(list(entries)),
    )


def entry(seq: int, entity_type: str = "call_log", origin: str | None = None) -> dict[str, Any]:
    e: dict[str, Any] = {
        "entityType": entity_type,
        "entityId": str(seq),
        "op": "upsert",
        "seq": seq,
        # A payload that names the target node and holds the keys an entry has: only the
        # entry's own members count.
        "payload": {"origin": TARGET, "entityType": "x", "deep": [[{"n": TARGET}]]},
    }
    if origin is not None:
        e["origin"] = origin
    return e


def test_the_filter_keeps_a_batch_whole_when_nothing_is_passed_over() -> None:
    batch = batch_of(entry(1), entry(2, origin=HERE))
    assert EntryFilter(target_node=TARGET).apply(batch) == (batch, 0)
    assert EntryFilter().apply(batch) == (batch, 0)
    # Without the node's name anywhere in the batch, it is not even read.
    plain = Batch(count=1, end=Position(1, 1), min_seq=1, max_seq=1, entries_json=b"[not json")
    assert EntryFilter(target_node=TARGET).apply(plain) == (plain, 0)


def test_the_filter_cuts_out_what_it_passes_over() -> None:
    batch = batch_of(
        entry(3, origin=TARGET),
        entry(4, "routing_rule"),
        entry(5, "call_log", origin=HERE),
        entry(6, "routing_rule", origin=TARGET),
        entry(7, "schedule"),
    )
    sent, skipped = EntryFilter(frozenset({"routing_rule", "schedule"}), TARGET).apply(batch)
    assert skipped == 3
    assert sent is not None
    assert [e["seq"] for e in sent.entries()] == [4, 7]
    assert (sent.count, sent.min_seq, sent.max_seq, sent.end) == (2, 4, 7, batch.end)
    # The kept entries go byte for byte as read.
    assert sent.raw_entries() == [batch.raw_entries()[1], batch.raw_entries()[4]]

    only_types, skipped = EntryFilter(frozenset({"announcement"})).apply(batch)
    assert (only_types, skipped) == (None, 5)
    assert EntryFilter(target_node=TARGET).apply(batch_of(entry(8, origin=TARGET))) == (None, 1)
    assert EntryFilter(frozenset({"call_log"}), TARGET).describe() == (
        "entity types call_log; no event from node backend"
    )


async def test_a_refused_entry_beside_passed_over_ones_is_parked_alone(backend_dsn: str) -> None:
    """One batch: entries from the target node (passed over), changes made here, and one the
    receiver refuses. The refused one alone is parked, the others delivered, the passed-over
    ones neither, and the offset passes them all."""
    await execute(backend_dsn, f"SELECT sync.set_node_name('{HERE}')")
    async with scripted_receiver() as frontend:
        frontend.refuse_markers = {b'"l-refused"'}
        settings = make_settings(backend_dsn, frontend.url, SYNC_TARGET_NODE=TARGET)
        await insert_mixed(
            backend_dsn,
            [("b1", TARGET), ("l1", None), ("l-refused", None), ("b2", TARGET), ("l2", None)],
        )
        async with running_consumer(settings) as runtime:
            end = await wait_caught_up(backend_dsn)
        assert end == Position(*(await outbox_end(backend_dsn) or (0, 0)))
        assert callers_of(frontend.accepted_entries) == ["l1", "l2"]
        assert set(await parked_by_caller(backend_dsn)) == {"l-refused"}
        stats = runtime.stats
        assert (stats.delivered_events, stats.skipped_events, stats.parked_events) == (2, 2, 1)
        # No request ever carried an entry from the target node.
        assert all(b'"origin":"backend"' not in a.body for a in frontend.attempts)
