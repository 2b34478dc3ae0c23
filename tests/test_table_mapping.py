"""The reference receiver applying mapped entity types into real tables (INGEST_MAPPING_FILE),
over real HTTP on loopback into a real PostgreSQL: the voicebot's settings tables, the version
guard (createdAt, origin), the relay of applied changes with their origin, refusals that name
the entry, the receiver yielding to a local transaction, and a settings edit going from one node
to the other. The mapping's check: test_table_mapping_check.py."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from tests.conftest import (
    Databases,
    fetch_all,
    fetch_value,
    make_settings,
    running_consumer,
    wait_until,
)
from tests.support.mapped import (
    T1,
    T2,
    T3,
    entry,
    label_of,
    new_id,
    number_row,
    outbox_of,
    post,
    serve_mapped,
    track_both_ways,
    with_receiver_schema,
)


@pytest.fixture
async def mapped_dsn(backend_dsn: str) -> str:
    """A receiving database for the mapped mode."""
    return await with_receiver_schema(backend_dsn)


# Each settings table: its entity type, a payload of a new row, an update of it (some fields
# only: the others keep their values), a query of the columns the update changes, and their
# values after it.
SETTINGS: dict[str, tuple[str, dict[str, Any], dict[str, Any], str, tuple[Any, ...]]] = {
    "registered_numbers": (
        "registered_number",
        {"phone_number": "0312345678", "label": "HQ", "category": "vip"},
        {"label": "Head office"},
        "SELECT label, category FROM registered_numbers WHERE id = %s",
        ("Head office", "vip"),
    ),
    "routing_rules": (
        "routing_rule",
        {"priority": 10, "match_type": "prefix", "match_value": "03", "action": "ivr"},
        {"priority": 20, "enabled": False},
        "SELECT priority, enabled, action FROM routing_rules WHERE id = %s",
        (20, False, "ivr"),
    ),
    "ivr_flows": (
        "ivr_flow",
        {"name": "main", "definition": {"steps": [{"say": "hello"}]}},
        # A JSON number of any size stays exact in a jsonb column.
        {"definition": {"steps": [], "big": 123456789012345678901234567890}},
        "SELECT name, definition FROM ivr_flows WHERE id = %s",
        ("main", {"steps": [], "big": 123456789012345678901234567890}),
    ),
    "schedules": (
        "schedule",
        {"name": "office", "rules": [{"days": "mon-fri", "open": "09:00"}]},
        {"timezone": "UTC", "rules": []},
        "SELECT name, timezone, rules FROM schedules WHERE id = %s",
        ("office", "UTC", []),
    ),
    "announcements": (
        "announcement",
        {"name": "closed", "text": "We are closed", "audio_path": None},
        {"text": None, "audio_path": "a/closed.wav"},
        "SELECT name, text, audio_path FROM announcements WHERE id = %s",
        ("closed", None, "a/closed.wav"),
    ),
}


@pytest.mark.parametrize("table", sorted(SETTINGS))
async def test_each_settings_table_takes_an_upsert_an_update_and_a_delete(
    mapped_dsn: str, table: str
) -> None:
    entity_type, created, changed, query, expected = SETTINGS[table]
    key = new_id()
    async with serve_mapped(mapped_dsn) as url:
        status, answer, _ = await post(url, entry(entity_type, key, {"id": key, **created}))
        assert (status, answer.get("applied")) == (200, 1), answer
        assert len(await fetch_all(mapped_dsn, query, (key,))) == 1
        status, answer, _ = await post(
            url, entry(entity_type, key, {"id": key, **changed}, created_at=T2)
        )
        assert (status, answer.get("applied")) == (200, 1), answer
        assert await fetch_all(mapped_dsn, query, (key,)) == [expected]
        status, answer, _ = await post(
            url, entry(entity_type, key, {"id": key}, op="delete", created_at=T3)
        )
        assert (status, answer.get("applied")) == (200, 1), answer
    assert await fetch_all(mapped_dsn, query, (key,)) == []
    versions = await fetch_all(
        mapped_dsn,
        "SELECT version_ts, version_node, deleted FROM sync.row_versions "
        "WHERE entity_type = %s AND entity_id = %s",
        (entity_type, key),
    )
    assert [(v[0].isoformat(), v[1], v[2]) for v in versions] == [(T3, "frontend", True)]
    # Nothing of a mapped type went to the generic store.
    assert await fetch_value(mapped_dsn, "SELECT count(*) FROM ingest.entities") == 0


async def test_a_replayed_or_older_entry_changes_nothing(mapped_dsn: str) -> None:
    key = new_id()
    newer = entry("registered_number", key, number_row(key, "newer"), created_at=T2, seq=2)
    older = entry("registered_number", key, number_row(key, "older"), created_at=T1, seq=1)
    async with serve_mapped(mapped_dsn) as url:
        assert (await post(url, newer))[1]["applied"] == 1
        for late in (older, newer):  # arriving after, and arriving again
            status, answer, _ = await post(url, late)
            assert (status, answer["applied"], answer["stale"]) == (200, 0, 1), answer
        assert await label_of(mapped_dsn, key) == "newer"
        # A delete is a version too: an older upsert arriving after it does not bring the row
        # back, and an older delete does not remove a newer row.
        gone = entry("registered_number", key, {"id": key}, op="delete", created_at=T3, seq=3)
        assert (await post(url, gone))[1]["applied"] == 1
        assert (await post(url, newer, older))[1]["applied"] == 0
        assert await label_of(mapped_dsn, key) is None
        other = new_id()
        assert (
            await post(
                url,
                entry("registered_number", other, number_row(other, "kept", "1"), created_at=T2),
            )
        )[1]["applied"] == 1
        stale_delete = entry("registered_number", other, {"id": other}, op="delete", created_at=T1)
        assert (await post(url, stale_delete))[1]["applied"] == 0
        assert await label_of(mapped_dsn, other) == "kept"


@pytest.mark.parametrize("together", [False, True], ids=["apart", "in-one-request"])
@pytest.mark.parametrize("y_first", [False, True], ids=["x-first", "y-first"])
async def test_the_greater_version_wins_whatever_the_order_of_arrival(
    mapped_dsn: str, y_first: bool, together: bool
) -> None:
    # Timestamps first; on equal timestamps the node name decides, in byte order ("node-b" is
    # greater than "node-a", and "Z" would sort before "a").
    later, tie = new_id(), new_id()
    x = [
        entry(
            "registered_number", later, number_row(later, "x", "1"), origin="node-b", created_at=T1
        ),
        entry("registered_number", tie, number_row(tie, "x", "2"), origin="node-a", created_at=T2),
    ]
    y = [
        entry(
            "registered_number", later, number_row(later, "y", "1"), origin="node-a", created_at=T2
        ),
        entry("registered_number", tie, number_row(tie, "y", "2"), origin="node-b", created_at=T2),
    ]
    first, second = (y, x) if y_first else (x, y)
    async with serve_mapped(mapped_dsn) as url:
        if together:
            assert (await post(url, *first, *second))[0] == 200
        else:
            assert (await post(url, *first))[0] == 200
            assert (await post(url, *second))[0] == 200
    assert await label_of(mapped_dsn, later) == "y"
    assert await label_of(mapped_dsn, tie) == "y"
    versions = await fetch_all(
        mapped_dsn, "SELECT entity_id, version_node FROM sync.row_versions ORDER BY entity_id"
    )
    assert sorted(versions) == sorted([(later, "node-a"), (tie, "node-b")])


async def test_an_applied_change_is_relayed_with_its_origin_from_a_one_way_table(
    mapped_dsn: str,
) -> None:
    key = new_id()
    async with serve_mapped(mapped_dsn) as url:
        assert (await post(url, entry("registered_number", key, number_row(key, "a"))))[0] == 200
    # The example tracks registered_numbers one way: its relay records the origin the apply
    # set for its transaction, and a local edit afterwards has none (it was made here).
    conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
    async with conn:
        await conn.execute("UPDATE registered_numbers SET label = 'local' WHERE id = %s", (key,))
    assert [(op, origin) for op, _, origin in await outbox_of(mapped_dsn, key)] == [
        ("upsert", "frontend"),
        ("upsert", None),
    ]


async def test_an_applied_change_is_relayed_with_its_version_from_a_both_ways_table(
    mapped_dsn: str,
) -> None:
    await track_both_ways(mapped_dsn)
    key = new_id()
    async with serve_mapped(mapped_dsn) as url:
        assert (await post(url, entry("registered_number", key, number_row(key, "a"))))[0] == 200
        conn = await psycopg.AsyncConnection.connect(mapped_dsn, autocommit=True)
        async with conn:
            await conn.execute(
                "UPDATE registered_numbers SET label = 'local' WHERE id = %s", (key,)
            )
        relayed = await outbox_of(mapped_dsn, key)
        # The applied change goes on with the version it came with; the local edit follows it.
        assert [(op, origin) for op, _, origin in relayed] == [
            ("upsert", "frontend"),
            ("upsert", None),
        ]
        assert relayed[0][1].isoformat() == T1
        assert relayed[1][1] > relayed[0][1]
        local = await fetch_all(
            mapped_dsn, "SELECT version_node FROM sync.row_versions WHERE entity_id = %s", (key,)
        )
        assert local == [("backend",)]
        # An entry older than the local edit loses to it; one newer wins.
        stale = entry("registered_number", key, number_row(key, "stale"), created_at=T2)
        assert (await post(url, stale))[1]["applied"] == 0
        assert await label_of(mapped_dsn, key) == "local"
        fresh = entry(
            "registered_number",
            key,
            number_row(key, "fresh"),
            created_at="2999-01-01T00:00:00+00:00",
        )
        assert (await post(url, fresh))[1]["applied"] == 1
        assert await label_of(mapped_dsn, key) == "fresh"


async def test_unmapped_types_go_to_the_generic_store_in_the_same_transaction(
    mapped_dsn: str,
) -> None:
    key = new_id()
    call = entry("call_log", "c-1", {"id": "c-1"}, origin=None)
    async with serve_mapped(mapped_dsn) as url:
        status, answer, _ = await post(
            url, call, entry("registered_number", key, number_row(key, "a"))
        )
        assert (status, answer["applied"]) == (200, 2), answer
    assert await fetch_all(mapped_dsn, "SELECT entity_type, entity_id FROM ingest.entities") == [
        ("call_log", "c-1")
    ]
    assert await label_of(mapped_dsn, key) == "a"


async def assert_nothing_applied(dsn: str) -> None:
    """No row of the request is anywhere: tables, versions, generic store."""
    assert await fetch_value(dsn, "SELECT count(*) FROM registered_numbers") == 0
    assert await fetch_value(dsn, "SELECT count(*) FROM routing_rules") == 0
    assert await fetch_value(dsn, "SELECT count(*) FROM sync.row_versions") == 0
    assert await fetch_value(dsn, "SELECT count(*) FROM ingest.entities") == 0


@pytest.mark.parametrize(
    ("refused", "message"),
    [
        # A new row without a column that is NOT NULL and has no default.
        (("registered_number", {"label": "no number"}), "phone_number"),
        # A value that does not fit its column's type.
        (
            (
                "routing_rule",
                {"priority": "high", "match_type": "m", "match_value": "v", "action": "a"},
            ),
            "integer",
        ),
        (
            (
                "routing_rule",
                {"priority": 1e30, "match_type": "m", "match_value": "v", "action": "a"},
            ),
            "integer",
        ),
        # A key that is not the key column's type.
        (("registered_number", {"phone_number": "9"}, "not-a-uuid"), "uuid"),
    ],
    ids=["missing-required-column", "text-in-integer", "out-of-range", "bad-key"],
)
async def test_an_entry_its_table_refuses_is_422_naming_it_and_nothing_is_applied(
    mapped_dsn: str, refused: tuple[Any, ...], message: str
) -> None:
    good = new_id()
    entity_type, payload, *key = refused
    bad_key = key[0] if key else new_id()
    entries = [
        entry("call_log", "c-1", {"id": "c-1"}, origin=None),
        entry("registered_number", good, number_row(good, "fine")),
        entry(entity_type, bad_key, {"id": bad_key, **payload}),
    ]
    async with serve_mapped(mapped_dsn) as url:
        status, answer, _ = await post(url, *entries)
    assert status == 422, answer
    assert answer["error"]["field"] == "entries[2]", answer
    assert bad_key in answer["error"]["message"] and message in answer["error"]["message"]
    await assert_nothing_applied(mapped_dsn)


async def test_a_partial_payload_updates_an_existing_row_and_refuses_a_new_one(
    mapped_dsn: str,
) -> None:
    key, new = new_id(), new_id()
    async with serve_mapped(mapped_dsn) as url:
        assert (await post(url, entry("registered_number", key, number_row(key, "a"))))[0] == 200
        # Only the label: the row keeps its phone number (NOT NULL, no default) and category.
        partial = entry("registered_number", key, {"id": key, "label": "b"}, created_at=T2)
        assert (await post(url, partial))[1]["applied"] == 1
        status, answer, _ = await post(
            url, entry("registered_number", new, {"id": new, "label": "b"}, created_at=T2)
        )
    assert status == 422 and answer["error"]["field"] == "entries[0]", answer
    assert await fetch_all(
        mapped_dsn, "SELECT phone_number, label, category FROM registered_numbers"
    ) == [("0312345678", "b", "general")]


@pytest.mark.parametrize(
    ("drop", "field"), [("origin", "entries[1].origin"), ("createdAt", "entries[1].createdAt")]
)
async def test_a_mapped_entry_without_its_version_is_422(
    mapped_dsn: str, drop: str, field: str
) -> None:
    a, b = new_id(), new_id()
    second = entry("registered_number", b, number_row(b, "b", "2"))
    del second[drop]
    async with serve_mapped(mapped_dsn) as url:
        status, answer, _ = await post(
            url, entry("registered_number", a, number_row(a, "a")), second
        )
    assert (status, answer["error"]["field"]) == (422, field), answer
    await assert_nothing_applied(mapped_dsn)


@pytest.mark.parametrize("both_ways", [False, True], ids=["one-way", "both-ways"])
async def test_the_receiver_yields_to_a_local_transaction_holding_a_row(
    mapped_dsn: str, both_ways: bool
) -> None:
    if both_ways:
        await track_both_ways(mapped_dsn)
    key = new_id()
    # Newer than the first entry's version (T1, "frontend") by its node name alone; older than
    # any local edit's, which the hybrid clock puts at T1 + 1 microsecond at the earliest.
    remote = entry(
        "registered_number", key, number_row(key, "remote"), created_at=T1, origin="other-node"
    )
    async with serve_mapped(mapped_dsn) as url:
        assert (await post(url, entry("registered_number", key, number_row(key, "a"))))[0] == 200
        local = await psycopg.AsyncConnection.connect(mapped_dsn)
        async with local:
            # Holds the row (and, tracked both ways, its version row) until it commits.
            await local.execute(
                "UPDATE registered_numbers SET label = 'operator' WHERE id = %s", (key,)
            )
            started = time.monotonic()
            status, answer, headers = await post(url, remote)
            waited = time.monotonic() - started
            assert (status, answer["error"]["code"]) == (503, "INGEST_BUSY"), answer
            assert headers["Retry-After"] == "1"
            assert waited < 5, waited  # about the lock timeout (200 ms), never the local's time
            await local.commit()  # the operator's save does not fail because of serversync
        assert await label_of(mapped_dsn, key) == "operator"
        # The sender's retry then goes through. Tracked one way here, the newest incoming
        # version wins; tracked both ways, the local edit's version follows every version this
        # node had seen, and an older remote one loses to it.
        status, answer, _ = await post(url, remote)
        assert (status, answer["applied"]) == (200, 0 if both_ways else 1), answer
    assert await label_of(mapped_dsn, key) == ("operator" if both_ways else "remote")


async def test_a_settings_edit_on_one_node_reaches_the_other_nodes_table(
    databases: Databases, mapped_dsn: str
) -> None:
    # Two nodes: a frontend whose operator edits the settings, and this receiver's backend,
    # which tracks registered_numbers both ways and so relays the applied change onward.
    frontend = databases.create("backend")
    conn = await psycopg.AsyncConnection.connect(frontend, autocommit=True)
    async with conn:
        await conn.execute("SELECT sync.set_node_name('frontend')")
    await track_both_ways(mapped_dsn)
    key = new_id()
    async with serve_mapped(mapped_dsn) as url:
        settings = make_settings(frontend, url, SYNC_TARGET_NODE="backend")
        async with running_consumer(settings):
            conn = await psycopg.AsyncConnection.connect(frontend, autocommit=True)
            async with conn:
                await conn.execute(
                    "INSERT INTO registered_numbers (id, phone_number, label) "
                    "VALUES (%s, '0312345678', 'from the frontend')",
                    (key,),
                )

            async def arrived() -> bool:
                return bool(await label_of(mapped_dsn, key) == "from the frontend")

            await wait_until(arrived, what="the frontend's edit in the backend's table")
    relayed = await outbox_of(mapped_dsn, key)
    assert [(op, origin) for op, _, origin in relayed] == [("upsert", "frontend")]
