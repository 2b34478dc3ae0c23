"""The reference receiver and the entries of a snapshot, over real HTTP on loopback into its real
database: the "snapshot" member, the sweep that ends a snapshot asked for with --delete-missing
(docs/wire-contract.md, Snapshots) in the generic store, its refusal by the table-mapping
receiver for a mapped type, and the consumers that carry a sweep without acting on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from consumer.sinks.recording_upload import wanted_recording
from tests.conftest import Databases, fetch_all, fetch_value, make_settings, running_consumer
from tests.support.backend import execute
from tests.support.dlq import all_dead_letters, dead_letters
from tests.support.mapped import entry as mapped_entry
from tests.support.mapped import (
    label_of,
    new_id,
    number_row,
    serve_mapped,
    with_receiver_schema,
)
from tests.support.mapped import post as post_mapped
from tests.support.recordings import (
    RECORDINGS_CONSUMER,
    SECRET,
    make_recording,
    recording_receiver,
    wait_uploaded,
)
from tests.support.waiting import wait_caught_up

INGEST = "/api/ingest/sync"
CREATED_AT = "2026-01-02T03:04:05.123456+00:00"
# Every column of the generic store, in a stable order.
EVERYTHING = (
    "SELECT entity_type, entity_id, seq, deleted, payload, source_created_at, applied_at "
    "FROM ingest.entities ORDER BY entity_type, entity_id"
)


def upsert(entity_id: str, seq: int, entity_type: str = "call_log", **extra: Any) -> dict[str, Any]:
    """An upsert entry; `extra` adds members (a "snapshot" id, say)."""
    return {
        "entityType": entity_type,
        "entityId": entity_id,
        "op": "upsert",
        "seq": seq,
        "payload": {"id": entity_id, "seq": seq},
        "createdAt": CREATED_AT,
        **extra,
    }


def delete(entity_id: str, seq: int, entity_type: str = "call_log") -> dict[str, Any]:
    """A delete entry."""
    return {**upsert(entity_id, seq, entity_type), "op": "delete"}


def sweep(
    keep_from_seq: Any, seq: int, entity_type: str = "call_log", snapshot: int = 7
) -> dict[str, Any]:
    """The sweep marker that ends snapshot `snapshot` of `entity_type`, as a node sends it."""
    return {
        "entityType": entity_type,
        "entityId": str(snapshot),
        "op": "sweep",
        "seq": seq,
        "createdAt": CREATED_AT,
        "origin": "backend",
        "snapshot": snapshot,
        "payload": {"snapshot": snapshot, "keepFromSeq": keep_from_seq},
    }


async def post(url: str, *entries: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """POST the entries to the receiver at `url`: (status, JSON answer)."""
    body = orjson.dumps({"entries": list(entries)})
    async with (
        aiohttp.ClientSession() as client,
        client.post(url + INGEST, data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        return r.status, orjson.loads(await r.read())


async def states(dsn: str) -> dict[tuple[str, str], tuple[int, bool, Any]]:
    """(entity type, id) -> (seq, deleted, payload) of every entity in the generic store."""
    rows = await fetch_all(
        dsn, "SELECT entity_type, entity_id, seq, deleted, payload FROM ingest.entities"
    )
    return {(r[0], r[1]): (r[2], r[3], r[4]) for r in rows}


def live(entity_id: str, seq: int) -> tuple[int, bool, Any]:
    """The stored state of an entity applied by upsert(entity_id, seq)."""
    return (seq, False, {"id": entity_id, "seq": seq})


# -- the generic store ---------------------------------------------------------------------------


async def test_a_sweep_tombstones_exactly_its_types_entities_last_changed_below_its_seq(
    receiver_dsn: str, receiver_url: str
) -> None:
    # A receiver restored from an old backup: it holds entities (seq < 10) that were deleted
    # since the snapshot began at seq 10, and the snapshot's entries of those still live.
    status, answer = await post(
        receiver_url,
        upsert("gone-1", 3),
        upsert("gone-2", 9),
        delete("deleted", 4),
        upsert("resent", 5),
        upsert("resent", 11, snapshot=7),  # the snapshot's entry of it
        upsert("changed-since", 12),
        upsert("other-type", 2, entity_type="recording"),
    )
    assert (status, answer["applied"]) == (200, 6), answer
    before = {row[:2]: row for row in await fetch_all(receiver_dsn, EVERYTHING)}

    status, answer = await post(receiver_url, sweep(10, 20))

    assert (status, answer) == (200, {"ok": True, "received": 1, "applied": 1, "stale": 0})
    assert await states(receiver_dsn) == {
        # Tombstoned at keepFromSeq - 1: an entry of the snapshot (seq >= 10) still wins, an
        # older one is stale.
        ("call_log", "gone-1"): (9, True, None),
        ("call_log", "gone-2"): (9, True, None),
        ("call_log", "deleted"): (4, True, None),
        ("call_log", "resent"): live("resent", 11),
        ("call_log", "changed-since"): live("changed-since", 12),
        ("recording", "other-type"): live("other-type", 2),
    }
    after = {row[:2]: row for row in await fetch_all(receiver_dsn, EVERYTHING)}
    # Only the two it tombstoned were written: the tombstone already there keeps its time, and
    # no entity was made of the sweep itself.
    changed = {key for key in after if after[key] != before[key]}
    assert changed == {("call_log", "gone-1"), ("call_log", "gone-2")}


async def test_a_replayed_sweep_changes_nothing(receiver_dsn: str, receiver_url: str) -> None:
    await post(receiver_url, upsert("a", 1), upsert("b", 2), upsert("c", 6))
    assert (await post(receiver_url, sweep(5, 8)))[1]["applied"] == 1
    after_first = await fetch_all(receiver_dsn, EVERYTHING)

    for _ in range(3):
        status, answer = await post(receiver_url, sweep(5, 8))
        assert (status, answer) == (200, {"ok": True, "received": 1, "applied": 0, "stale": 1})
    # Every column, applied_at included: nothing was rewritten.
    assert await fetch_all(receiver_dsn, EVERYTHING) == after_first


async def test_an_entry_of_the_snapshot_arriving_after_its_sweep_restores_the_entity(
    receiver_dsn: str, receiver_url: str
) -> None:
    # Two requests in flight: the snapshot's batch with "a" is answered after the sweep's.
    await post(receiver_url, upsert("a", 2), upsert("b", 3))
    await post(receiver_url, sweep(10, 30))
    assert await states(receiver_dsn) == {
        ("call_log", "a"): (9, True, None),
        ("call_log", "b"): (9, True, None),
    }

    status, answer = await post(receiver_url, upsert("a", 14, snapshot=7))
    assert (status, answer["applied"]) == (200, 1), answer
    # A change from before the snapshot began, arriving late (reordered in flight), does not
    # bring "b" back: it is older than the tombstone.
    status, answer = await post(receiver_url, upsert("b", 7))
    assert (status, answer["stale"]) == (200, 1), answer
    assert await states(receiver_dsn) == {
        ("call_log", "a"): live("a", 14),
        ("call_log", "b"): (9, True, None),
    }


@pytest.mark.parametrize("sweep_first", [False, True], ids=["sweep-last", "sweep-first"])
async def test_a_sweep_and_the_snapshots_entries_in_one_request_end_the_same_in_any_order(
    receiver_dsn: str, receiver_url: str, sweep_first: bool
) -> None:
    await post(receiver_url, upsert("kept", 2), upsert("gone", 3))
    entries = [upsert("kept", 10, snapshot=7), upsert("new", 11, snapshot=7)]
    marker = sweep(10, 12)
    body = [marker, *entries] if sweep_first else [*entries, marker]

    status, answer = await post(receiver_url, *body)

    assert (status, answer) == (200, {"ok": True, "received": 3, "applied": 3, "stale": 0})
    assert await states(receiver_dsn) == {
        ("call_log", "kept"): live("kept", 10),
        ("call_log", "new"): live("new", 11),
        ("call_log", "gone"): (9, True, None),
    }


async def test_a_sweep_with_nothing_to_tombstone_is_stale_and_makes_no_entity(
    receiver_dsn: str, receiver_url: str
) -> None:
    status, answer = await post(receiver_url, sweep(0, 5), sweep(1, 6, entity_type="recording"))
    assert (status, answer) == (200, {"ok": True, "received": 2, "applied": 0, "stale": 2})
    assert await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.entities") == 0


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"snapshot": 7}, "Field required"),
        ({"keepFromSeq": "10"}, "must be an integer"),
        ({"keepFromSeq": 10.5}, "must be an integer"),
        ({"keepFromSeq": True}, "must be an integer"),
        ({"keepFromSeq": -1}, "must be between 0 and"),
        ({"keepFromSeq": 2**63}, "must be between 0 and"),
    ],
    ids=["missing", "text", "fraction", "boolean", "negative", "beyond-bigint"],
)
async def test_a_malformed_sweep_is_422_naming_its_field_and_nothing_is_applied(
    receiver_dsn: str, receiver_url: str, payload: dict[str, Any], message: str
) -> None:
    await post(receiver_url, upsert("old", 1))
    malformed = {**sweep(10, 12), "payload": payload}

    status, answer = await post(receiver_url, upsert("new", 11), malformed)

    assert status == 422, answer
    assert answer["error"]["code"] == "INGEST_VALIDATION_ERROR"
    assert answer["error"]["field"] == "entries[1].payload.keepFromSeq", answer
    assert message in answer["error"]["message"], answer
    assert await states(receiver_dsn) == {("call_log", "old"): live("old", 1)}


async def test_the_snapshot_member_is_accepted_and_checked(
    receiver_dsn: str, receiver_url: str
) -> None:
    status, answer = await post(receiver_url, upsert("a", 4, snapshot=9))
    assert (status, answer["applied"]) == (200, 1), answer
    assert await states(receiver_dsn) == {("call_log", "a"): live("a", 4)}
    for wrong in (0, "9", None, 1.5):
        status, answer = await post(receiver_url, upsert("b", 5, snapshot=wrong))
        assert (status, answer["error"]["field"]) == (422, "entries[0].snapshot"), (wrong, answer)


async def test_a_consumer_delivers_a_sweep_and_the_receiver_tombstones_what_it_missed(
    backend_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    # The receiver holds call logs its backend deleted while it was restored from a backup.
    await post(receiver_url, upsert("deleted-meanwhile-1", 1), upsert("deleted-meanwhile-2", 2))
    # The snapshot begins: every change from now on has a seq of at least keep_from.
    await execute(backend_dsn, "SELECT setval('sync.events_outbox_seq_seq', 100)")
    keep_from = await fetch_value(backend_dsn, "SELECT nextval('sync.events_outbox_seq_seq')")
    await execute(
        backend_dsn, "INSERT INTO call_logs (caller_number, callee_number) VALUES ('1', '2')"
    )
    await execute(
        backend_dsn,
        "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload) "
        "VALUES ('sweep', 'call_log', '7', json_build_object('snapshot', 7, 'keepFromSeq', %s))",
        params=(keep_from,),
    )
    async with running_consumer(make_settings(backend_dsn, receiver_url)):
        await wait_caught_up(backend_dsn)
    found = await states(receiver_dsn)
    assert found.pop(("call_log", "deleted-meanwhile-1")) == (keep_from - 1, True, None)
    assert found.pop(("call_log", "deleted-meanwhile-2")) == (keep_from - 1, True, None)
    # The call log inserted after the snapshot began is live.
    assert [(seq >= keep_from, deleted) for seq, deleted, _ in found.values()] == [(True, False)]
    assert await all_dead_letters(backend_dsn) == 0


# -- the table-mapping receiver ------------------------------------------------------------------


@pytest.fixture
async def mapped_dsn(backend_dsn: str) -> str:
    """A receiving database for the mapped mode."""
    return await with_receiver_schema(backend_dsn)


async def test_a_sweep_of_a_mapped_type_is_422_naming_it_and_nothing_is_applied(
    mapped_dsn: str,
) -> None:
    key = new_id()
    entries = [
        mapped_entry("registered_number", key, number_row(key, "kept"), seq=11),
        mapped_entry("call_log", "c-1", {"id": "c-1"}, seq=12),
        sweep(10, 13, entity_type="registered_number"),
    ]
    async with serve_mapped(mapped_dsn) as url:
        status, answer, _ = await post_mapped(url, *entries)
        assert status == 422, answer
        assert answer["error"]["field"] == "entries[2]", answer
        assert "(createdAt, origin), not seqs" in answer["error"]["message"], answer
        assert await label_of(mapped_dsn, key) is None
        assert await fetch_value(mapped_dsn, "SELECT count(*) FROM ingest.entities") == 0

        # As the sender's bisection sends the rest: applied.
        status, answer, _ = await post_mapped(url, *entries[:2])
        assert (status, answer["applied"]) == (200, 2), answer
    assert await label_of(mapped_dsn, key) == "kept"


async def test_the_mapped_receiver_sweeps_an_unmapped_type_in_the_generic_store(
    mapped_dsn: str,
) -> None:
    key = new_id()
    async with serve_mapped(mapped_dsn) as url:
        await post_mapped(
            url,
            mapped_entry("call_log", "old", {"id": "old"}, seq=3),
            mapped_entry("call_log", "resent", {"id": "resent"}, seq=4),
        )
        status, answer, _ = await post_mapped(
            url,
            mapped_entry("call_log", "resent", {"id": "resent"}, seq=10),
            mapped_entry("registered_number", key, number_row(key, "snap"), seq=11),
            sweep(10, 12, entity_type="call_log"),
        )
        assert (status, answer["applied"]) == (200, 3), answer
    assert await label_of(mapped_dsn, key) == "snap"
    rows = await fetch_all(
        mapped_dsn, "SELECT entity_id, seq, deleted FROM ingest.entities ORDER BY entity_id"
    )
    assert rows == [("old", 9, True), ("resent", 10, False)]


async def test_a_consumer_parks_a_sweep_the_mapped_receiver_refuses_and_delivers_the_rest(
    databases: Databases, mapped_dsn: str
) -> None:
    node = databases.create("backend")
    await execute(node, "SELECT sync.set_node_name('frontend')")
    before, after = new_id(), new_id()
    insert = "INSERT INTO registered_numbers (id, phone_number, label) VALUES (%s, %s, %s)"
    await execute(node, insert, params=(before, "031", "before"))
    await execute(
        node,
        "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload, snapshot_id) "
        "VALUES ('sweep', 'registered_number', '7', "
        '\'{"snapshot": 7, "keepFromSeq": 1}\', 7)',
    )
    await execute(node, insert, params=(after, "032", "after"))
    async with serve_mapped(mapped_dsn) as url, running_consumer(make_settings(node, url)):
        await wait_caught_up(node, timeout=20)
    assert (await label_of(mapped_dsn, before), await label_of(mapped_dsn, after)) == (
        "before",
        "after",
    )
    parked = await dead_letters(node)
    assert [(p.entity_id, p.error_code) for p in parked] == [("7", "HTTP_422")]
    assert "not seqs" in parked[0].error_message
    ops = await fetch_all(node, "SELECT op, entity_type FROM sync.dlq_messages")
    assert ops == [("sweep", "registered_number")]


# -- consumers that carry recordings -------------------------------------------------------------


def test_a_sweep_of_recordings_is_no_recording_to_upload() -> None:
    marker = orjson.dumps(sweep(10, 12, entity_type="recording"))
    assert wanted_recording(marker) is None


async def test_recording_upload_passes_over_a_sweep_and_uploads_the_rest(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = tmp_path / "recordings", tmp_path / "store"
    local.mkdir()
    async with recording_receiver(receiver_dsn, store) as receiver:
        first = await make_recording(backend_dsn, local)
        await execute(
            backend_dsn,
            "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload) "
            "VALUES ('sweep', 'recording', '7', '{\"snapshot\": 7, \"keepFromSeq\": 1}')",
        )
        second = await make_recording(backend_dsn, local)
        settings = make_settings(
            backend_dsn, receiver.url, RECORDINGS_DIR=str(local), SYNC_SHARED_SECRET=SECRET
        )
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            for recording in (first, second):
                await wait_uploaded(backend_dsn, recording.recording_id)
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.failed_deliveries == 0
        assert sorted(receiver.log.ids()) == sorted([first.recording_id, second.recording_id])
    assert await all_dead_letters(backend_dsn) == 0
