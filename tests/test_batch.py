"""A batch's wire form: the entries a sink sends, written once and only when a sink asks."""

from __future__ import annotations

import json

import orjson
import pytest

from consumer.app.wiring import open_pool
from consumer.core.events import Batch, Position, json_members
from consumer.store.outbox import OutboxStore
from tests.conftest import fetch_all
from tests.support.backend import insert_calls


async def test_a_read_batch_carries_the_outbox_rows_in_the_wire_format(backend_dsn: str) -> None:
    await insert_calls(backend_dsn, 3, tag="w")
    async with open_pool(backend_dsn, "test-batch") as pool:
        result = await OutboxStore(pool).read_batch(Position.start(), 10)
    batch = result.batch
    assert batch is not None
    rows = await fetch_all(
        backend_dsn,
        "SELECT seq, entity_id, payload::text, created_at FROM sync.events_outbox"
        " ORDER BY txid, seq",
    )
    assert (batch.count, batch.min_seq, batch.max_seq) == (3, rows[0][0], rows[-1][0])
    entries = batch.entries()
    assert [(e["seq"], e["entityId"], e["entityType"], e["op"]) for e in entries] == [
        (seq, entity_id, "call_log", "upsert") for seq, entity_id, _, _ in rows
    ]
    assert [e["payload"] for e in entries] == [orjson.loads(row[2]) for row in rows]
    assert [e["createdAt"] for e in entries] == [
        orjson.dumps(row[3]).decode().strip('"') for row in rows
    ]
    # The payload is the relay's own json text, byte for byte (no number is re-encoded).
    for raw, row in zip(batch.raw_entries(), rows, strict=True):
        assert b'"payload":' + row[2].encode() in raw


def test_the_entries_are_written_once_and_only_when_asked_for() -> None:
    writes: list[int] = []

    def write() -> bytes:
        writes.append(1)
        return b'[{"seq":1,"op":"upsert"},{"seq":2,"op":"delete"}]'

    batch = Batch(count=2, end=Position(7, 2), min_seq=1, max_seq=2, write_entries=write)
    assert writes == []  # a sink that never looks costs nothing (the null sink)
    assert batch.entries_json == batch.entries_json
    first, second = batch.split()
    assert [e["seq"] for e in first.entries() + second.entries()] == [1, 2]
    assert writes == [1]
    with pytest.raises(TypeError, match="either"):
        Batch(count=0, end=Position.start(), min_seq=0, max_seq=0)


async def test_each_entry_on_its_own_is_the_array_s_element_with_its_row_s_key(
    backend_dsn: str,
) -> None:
    """A sink that sends entries one by one (JetStream) takes them with their keys as the rows
    held them: the same bytes as the array's elements, whatever the payload, the names, the
    origin or the snapshot."""
    rows = [
        ("upsert", "call_log", "plain", '{"n": 1}', None, None),
        (
            "delete",
            "タイプ.*>",
            'id with "quotes", \\ and \u2028',
            '{"big": 123456789012345678901234567890}',
            "elsewhere",
            None,
        ),
        ("upsert", "thing", "", '{"s": "\\u0000 \\ud800", "deep": [[[[{}]]]]}', None, 42),
    ]
    for op, entity_type, entity_id, payload, origin, snapshot_id in rows:
        await fetch_all(
            backend_dsn,
            "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload, origin,"
            " snapshot_id) VALUES (%s, %s, %s, %s::json, %s, %s) RETURNING seq",
            (op, entity_type, entity_id, payload, origin, snapshot_id),
        )
    async with open_pool(backend_dsn, "test-batch") as pool:
        store = OutboxStore(pool)
        keyed_read = (await store.read_batch(Position.start(), 10, local_node="here")).batch
        whole_read = (await store.read_batch(Position.start(), 10, local_node="here")).batch
    assert keyed_read is not None and whole_read is not None
    keyed = keyed_read.keyed_entries()
    assert keyed is not None
    # Taken before the array is written: the entries come from the keyed form.
    assert keyed_read.raw_entries() == [raw for _, raw in keyed]
    assert b"[" + b",".join(raw for _, raw in keyed) + b"]" == whole_read.entries_json
    assert whole_read.raw_entries() == [raw for _, raw in keyed]
    for key, raw in keyed:
        # What a payload may hold that orjson refuses (a lone surrogate): read as text.
        members = {name: json.loads(text) for name, text in json_members(raw.decode()).items()}
        assert key == (members["seq"], members["op"], members["entityType"], members["entityId"])
    assert [key[1:] for key, _ in keyed] == [row[:3] for row in rows]
    # A batch cut from raw parts has no keys: a sink reads them from the entries.
    assert Batch.of_raw(whole_read.raw_entries(), whole_read.end).keyed_entries() is None
