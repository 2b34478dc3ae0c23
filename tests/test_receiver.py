"""The reference receiver over real HTTP on loopback: idempotency, the version guard, validation
(all or nothing per request) and its generic store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import psycopg
import pytest

from consumer.store import admin
from consumer.store.db import connect
from tests.conftest import (
    Databases,
    fetch_all,
    fetch_value,
    make_settings,
    running_consumer,
    serve_receiver,
    wait_until,
)

INGEST = "/api/ingest/sync"
SNAPSHOT = (
    "SELECT entity_type, entity_id, seq, deleted, payload, source_created_at, applied_at "
    "FROM ingest.entities ORDER BY entity_type, entity_id"
)


def entry(
    entity_id: str,
    seq: Any,
    op: Any = "upsert",
    *,
    payload: Any = None,
    entity_type: Any = "call_log",
    created_at: str | None = "2026-01-02T03:04:05.123456+00:00",
) -> dict[str, Any]:
    """One wire entry; any field may be given a wrong value on purpose."""
    item: dict[str, Any] = {
        "entityType": entity_type,
        "entityId": entity_id,
        "op": op,
        "seq": seq,
        "payload": {"id": entity_id, "seq": seq} if payload is None else payload,
    }
    if created_at is not None:
        item["createdAt"] = created_at
    return item


async def post(
    session: aiohttp.ClientSession,
    url: str,
    body: Any,
    *,
    content_type: str = "application/json",
) -> tuple[int, dict[str, Any]]:
    """POST to the ingest endpoint; returns the status and the JSON body (which must be JSON)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    async with session.post(
        url + INGEST, data=data, headers={"Content-Type": content_type}
    ) as response:
        assert response.content_type == "application/json", await response.text()
        parsed: dict[str, Any] = orjson.loads(await response.read())
        return response.status, parsed


async def snapshot(receiver_dsn: str) -> list[tuple[Any, ...]]:
    """Every row of ingest.entities, every column, in a stable order."""
    return await fetch_all(receiver_dsn, SNAPSHOT)


async def stored(receiver_dsn: str, entity_id: str) -> tuple[Any, ...]:
    """(seq, deleted, payload) of one call_log entity."""
    rows = await fetch_all(
        receiver_dsn,
        "SELECT seq, deleted, payload FROM ingest.entities "
        "WHERE entity_type = 'call_log' AND entity_id = %s",
        (entity_id,),
    )
    assert len(rows) == 1, rows
    return rows[0]


# -- idempotency ---------------------------------------------------------------------------------


async def test_same_request_ten_times_changes_the_receiver_once(
    receiver_dsn: str, receiver_url: str
) -> None:
    body = {
        "entries": [
            entry("a", 1),
            entry("b", 2, payload={"id": "b", "nested": {"x": [1, 2, 3]}}),
            entry("c", 3),
            entry("c", 4, op="delete"),
        ]
    }
    async with aiohttp.ClientSession() as session:
        status, first = await post(session, receiver_url, body)
        assert (status, first) == (200, {"ok": True, "received": 4, "applied": 3, "stale": 1})
        after_first = await snapshot(receiver_dsn)
        assert [(r[1], r[2], r[3]) for r in after_first] == [
            ("a", 1, False),
            ("b", 2, False),
            ("c", 4, True),
        ]
        # Nine more deliveries of the very same request, at once (a retry storm).
        repeats = await asyncio.gather(*(post(session, receiver_url, body) for _ in range(9)))
    assert repeats == [(200, {"ok": True, "received": 4, "applied": 0, "stale": 4})] * 9
    # Every column, applied_at included: nothing was rewritten.
    assert await snapshot(receiver_dsn) == after_first


async def test_concurrent_first_deliveries_apply_each_entity_once(
    receiver_dsn: str, receiver_url: str
) -> None:
    body = {"entries": [entry(f"e{i}", 10 + i) for i in range(20)]}
    async with aiohttp.ClientSession() as session:
        answers = await asyncio.gather(*(post(session, receiver_url, body) for _ in range(10)))
    assert all(status == 200 for status, _ in answers), answers
    assert sum(reply["applied"] for _, reply in answers) == 20
    rows = await fetch_all(receiver_dsn, "SELECT entity_id, seq FROM ingest.entities ORDER BY seq")
    assert rows == [(f"e{i}", 10 + i) for i in range(20)]


async def _backend_activity(backend_dsn: str) -> None:
    """Inserts, updates, deletes and a key change, in many transactions."""
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "INSERT INTO call_logs (caller_number, callee_number) "
            "SELECT 'c' || g, 'x' FROM generate_series(1, 30) g"
        )
        for i in range(1, 31, 3):
            await conn.execute(
                "UPDATE call_logs SET status = 'done', summary = %s WHERE caller_number = %s",
                (f"summary {i}", f"c{i}"),
            )
        await conn.execute("DELETE FROM call_logs WHERE caller_number IN ('c2', 'c5', 'c8')")
        # Deleted, then inserted again under the same key: the newest state must win.
        cur = await conn.execute(
            "DELETE FROM call_logs WHERE caller_number = 'c10' RETURNING id::text"
        )
        row = await cur.fetchone()
        assert row is not None
        await conn.execute(
            "INSERT INTO call_logs (id, caller_number, callee_number, status) "
            "VALUES (%s, 'c10', 'y', 'reborn')",
            (row[0],),
        )
        await conn.execute(
            "INSERT INTO registered_numbers (id, phone_number) "
            "VALUES ('00000000-0000-0000-0000-000000000001', '0311')"
        )
        await conn.execute(
            "UPDATE registered_numbers SET id = '00000000-0000-0000-0000-000000000002'"
        )


async def test_replaying_the_whole_outbox_leaves_the_receiver_identical(
    backend_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    await _backend_activity(backend_dsn)
    total = await fetch_value(backend_dsn, "SELECT count(*) FROM sync.events_outbox")
    assert total > 40
    # Small batches: the replay crosses many requests, tombstones included.
    settings = make_settings(backend_dsn, receiver_url, SYNC_BATCH_SIZE=7)

    async def deliver_everything() -> None:
        async with running_consumer(settings) as runtime:

            async def done() -> bool:
                return bool(runtime.stats.delivered_events == total)

            await wait_until(done, what=f"{total} events delivered")

    await deliver_everything()
    first = await snapshot(receiver_dsn)
    # The receiver mirrors the backend: live call logs are exactly the backend's rows.
    backend_rows = await fetch_all(
        backend_dsn, "SELECT id::text, status, coalesce(summary, '') FROM call_logs ORDER BY 1"
    )
    live = await fetch_all(
        receiver_dsn,
        "SELECT entity_id, payload->>'status', coalesce(payload->>'summary', '') "
        "FROM ingest.live_entities WHERE entity_type = 'call_log' ORDER BY 1",
    )
    assert live == backend_rows
    assert len(live) == 27
    assert sum(1 for _, status, _ in live if status == "reborn") == 1
    numbers = await fetch_all(
        receiver_dsn,
        "SELECT entity_id, deleted FROM ingest.entities "
        "WHERE entity_type = 'registered_number' ORDER BY 1",
    )
    assert numbers == [
        ("00000000-0000-0000-0000-000000000001", True),
        ("00000000-0000-0000-0000-000000000002", False),
    ]

    conn = await connect(backend_dsn, "test-reset")
    async with conn, admin.holding_consumer_lock(conn, "frontend-sync"):
        plan = await admin.plan_reset(conn, "frontend-sync", to_earliest=True)
        assert plan.replayed == total
        await admin.apply_reset(conn, plan)

    await deliver_everything()
    # Every column, applied_at included: the replay was a no-op for the receiver.
    assert await snapshot(receiver_dsn) == first


# -- the version guard ---------------------------------------------------------------------------


async def test_an_older_or_equal_seq_is_a_no_op(receiver_dsn: str, receiver_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert (await post(session, receiver_url, {"entries": [entry("x", 10)]}))[0] == 200
        before = await snapshot(receiver_dsn)
        older = {"entries": [entry("x", 5, payload={"v": "older"})]}
        status, reply = await post(session, receiver_url, older)
        assert (status, reply["applied"], reply["stale"]) == (200, 0, 1)
        same = {"entries": [entry("x", 10, payload={"v": "same seq, other payload"})]}
        status, reply = await post(session, receiver_url, same)
        assert (status, reply["applied"], reply["stale"]) == (200, 0, 1)
        assert await snapshot(receiver_dsn) == before
        newer = {"entries": [entry("x", 11, payload={"v": "newer"})]}
        status, reply = await post(session, receiver_url, newer)
        assert (status, reply["applied"]) == (200, 1)
    assert await stored(receiver_dsn, "x") == (11, False, {"v": "newer"})


async def test_a_delete_leaves_a_tombstone_that_an_older_upsert_cannot_resurrect(
    receiver_dsn: str, receiver_url: str
) -> None:
    async with aiohttp.ClientSession() as session:
        await post(session, receiver_url, {"entries": [entry("t", 1)]})
        status, reply = await post(session, receiver_url, {"entries": [entry("t", 3, "delete")]})
        assert (status, reply["applied"]) == (200, 1)
        assert await stored(receiver_dsn, "t") == (3, True, None)
        assert await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.live_entities") == 0
        tombstone = await snapshot(receiver_dsn)

        late = {"entries": [entry("t", 2, payload={"v": "late"})]}
        status, reply = await post(session, receiver_url, late)
        assert (status, reply["applied"], reply["stale"]) == (200, 0, 1)
        assert await snapshot(receiver_dsn) == tombstone
        assert await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.live_entities") == 0

        # A genuinely newer upsert (the row was inserted again) does bring it back.
        again = {"entries": [entry("t", 4, payload={"v": "again"})]}
        status, reply = await post(session, receiver_url, again)
        assert (status, reply["applied"]) == (200, 1)
    assert await stored(receiver_dsn, "t") == (4, False, {"v": "again"})


async def test_the_same_entity_twice_in_one_batch_keeps_the_newer_entry(
    receiver_dsn: str, receiver_url: str
) -> None:
    body = {
        "entries": [
            # In order, out of order, and an upsert older than a delete in the same request.
            entry("p", 7, payload={"v": 7}),
            entry("p", 9, payload={"v": 9}),
            entry("p", 8, payload={"v": 8}),
            entry("q", 21, payload={"v": 21}),
            entry("q", 20, payload={"v": 20}),
            entry("r", 31, "delete", payload={"v": 31}),
            entry("r", 30, payload={"v": 30}),
        ]
    }
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, receiver_url, body)
    assert (status, reply) == (200, {"ok": True, "received": 7, "applied": 3, "stale": 4})
    assert await stored(receiver_dsn, "p") == (9, False, {"v": 9})
    assert await stored(receiver_dsn, "q") == (21, False, {"v": 21})
    assert await stored(receiver_dsn, "r") == (31, True, None)


async def test_one_batch_applies_only_what_is_newer_than_each_stored_entity(
    receiver_dsn: str, receiver_url: str
) -> None:
    async with aiohttp.ClientSession() as session:
        before = {
            "entries": [
                entry("x", 10, payload={"v": "x10"}),
                entry("y", 5, "delete"),
                entry("s", 3, payload={"v": "s3"}),
            ]
        }
        assert (await post(session, receiver_url, before))[1]["applied"] == 3
        # One entry per entity, in no key order, against those rows: an equal seq, an upsert
        # older than a tombstone, a newer one, the same id under another type, a new entity and
        # the delete of one never seen.
        body = {
            "entries": [
                entry("x", 10, payload={"v": "x10 again"}),
                entry("z", 1, payload={"v": "z1"}),
                entry("y", 4, payload={"v": "y4"}),
                entry("s", 1, payload={"v": "s1"}, entity_type="registered_number"),
                entry("w", 2, "delete"),
                entry("s", 4, payload={"v": "s4"}),
            ]
        }
        status, reply = await post(session, receiver_url, body)
        assert (status, reply) == (200, {"ok": True, "received": 6, "applied": 4, "stale": 2})
        after = await snapshot(receiver_dsn)
        assert [(r[0], r[1], r[2], r[3], r[4]) for r in after] == [
            ("call_log", "s", 4, False, {"v": "s4"}),
            ("call_log", "w", 2, True, None),
            ("call_log", "x", 10, False, {"v": "x10"}),
            ("call_log", "y", 5, True, None),
            ("call_log", "z", 1, False, {"v": "z1"}),
            ("registered_number", "s", 1, False, {"v": "s1"}),
        ]
        # Delivered again: every entry is stale, and nothing is rewritten (applied_at included).
        status, reply = await post(session, receiver_url, body)
        assert (status, reply) == (200, {"ok": True, "received": 6, "applied": 0, "stale": 6})
    assert await snapshot(receiver_dsn) == after


async def test_requests_in_flight_sharing_entities_in_opposite_orders_both_apply(
    receiver_dsn: str, receiver_url: str
) -> None:
    # Two batches in flight at once with the same entities, one in the other's reverse order:
    # written in their body's order, each would lock rows the other waits for (a deadlock,
    # answered 503). Each request writes its rows in key order, so the second waits instead.
    ids = [f"k{i:03d}" for i in range(300)]
    async with aiohttp.ClientSession() as session:
        for round_ in range(3):
            base = round_ * 1000
            older = {"entries": [entry(i, base + n + 1) for n, i in enumerate(ids)]}
            newer = {"entries": [entry(i, base + 500 + n) for n, i in enumerate(reversed(ids))]}
            answers = await asyncio.gather(
                post(session, receiver_url, older), post(session, receiver_url, newer)
            )
            assert [status for status, _ in answers] == [200, 200], answers
            # The newer batch applies every entry whichever commits first.
            assert answers[1][1]["applied"] == len(ids)
    rows = await fetch_all(
        receiver_dsn, "SELECT entity_id, seq FROM ingest.entities ORDER BY entity_id"
    )
    assert rows == [(i, 2000 + 500 + n) for n, i in enumerate(reversed(ids))][::-1]


# -- validation ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shared_receiver_dsn(databases: Databases) -> str:
    """A receiver database for the module (made outside the event loop, like receiver_dsn)."""
    return databases.create("receiver")


@pytest.fixture(scope="module")
async def shared_receiver(shared_receiver_dsn: str) -> AsyncIterator[tuple[str, str]]:
    """One receiver (database, URL) for the many requests that must change nothing."""
    async with serve_receiver(shared_receiver_dsn) as url:
        yield shared_receiver_dsn, url


@pytest.fixture
async def rejecting_receiver(shared_receiver: tuple[str, str]) -> AsyncIterator[tuple[str, str]]:
    """The shared receiver, emptied again after each test so that one failure stays one."""
    yield shared_receiver
    conn = await psycopg.AsyncConnection.connect(shared_receiver[0], autocommit=True)
    async with conn:
        await conn.execute("TRUNCATE ingest.entities")


def _with_bad_entry(bad: dict[str, Any]) -> dict[str, Any]:
    """Three entries: good, bad, good."""
    return {"entries": [entry("good-1", 1), bad, entry("good-2", 3)]}


def _without(field: str) -> dict[str, Any]:
    item = entry("bad", 2)
    del item[field]
    return item


BAD_ENTRIES = [
    pytest.param(entry("bad", 2, op="merge"), "entries[1].op", id="op-unknown"),
    pytest.param(entry("bad", 2, op="UPSERT"), "entries[1].op", id="op-case"),
    pytest.param(_without("op"), "entries[1].op", id="op-missing"),
    pytest.param(entry("bad", 2, entity_type=""), "entries[1].entityType", id="type-empty"),
    pytest.param(entry("bad", 2, entity_type="1abc"), "entries[1].entityType", id="type-digit"),
    pytest.param(entry("bad", 2, entity_type="a b"), "entries[1].entityType", id="type-space"),
    pytest.param(
        entry("bad", 2, entity_type="x'; drop table t"), "entries[1].entityType", id="type-sql"
    ),
    pytest.param(entry("bad", 2, entity_type=7), "entries[1].entityType", id="type-number"),
    pytest.param(entry("", 2), "entries[1].entityId", id="id-empty"),
    pytest.param(_without("entityId"), "entries[1].entityId", id="id-missing"),
    pytest.param(entry("bad", "2"), "entries[1].seq", id="seq-string"),
    pytest.param(entry("bad", 2.5), "entries[1].seq", id="seq-float"),
    pytest.param(entry("bad", None), "entries[1].seq", id="seq-null"),
    pytest.param(entry("bad", True), "entries[1].seq", id="seq-bool"),
    pytest.param(entry("bad", 0), "entries[1].seq", id="seq-zero"),
    pytest.param(entry("bad", 2**63), "entries[1].seq", id="seq-over-bigint"),
    pytest.param(entry("bad", 2, payload=[1, 2]), "entries[1].payload", id="payload-list"),
    pytest.param(entry("bad", 2, payload="{}"), "entries[1].payload", id="payload-string"),
    pytest.param(_without("payload"), "entries[1].payload", id="payload-missing"),
    pytest.param(
        entry("bad", 2, created_at="yesterday"), "entries[1].createdAt", id="created-garbage"
    ),
    pytest.param(
        {**entry("bad", 2), "createdAt": 1700000000}, "entries[1].createdAt", id="created-number"
    ),
]


@pytest.mark.parametrize(("bad", "field"), BAD_ENTRIES)
async def test_a_bad_field_is_a_422_naming_it_and_nothing_is_applied(
    rejecting_receiver: tuple[str, str], bad: dict[str, Any], field: str
) -> None:
    receiver_dsn, receiver_url = rejecting_receiver
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, receiver_url, _with_bad_entry(bad))
    assert status == 422, reply
    error = reply["error"]
    assert error["code"] == "INGEST_VALIDATION_ERROR"
    assert error["field"] == field
    assert error["message"].startswith(f"{field}: ")
    # No half-applied batch: the good entries around the bad one were not applied either.
    assert await snapshot(receiver_dsn) == []


async def test_an_entry_the_database_refuses_fails_the_whole_batch(
    rejecting_receiver: tuple[str, str],
) -> None:
    # Valid for the model, refused by PostgreSQL (jsonb holds no NUL character): still a JSON
    # 422, and the good entries of the same request are not applied either.
    receiver_dsn, receiver_url = rejecting_receiver
    body = _with_bad_entry(entry("bad", 2, payload={"note": "nul \u0000 inside"}))
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, receiver_url, body)
    assert status == 422, reply
    assert reply["error"]["code"] == "INGEST_VALIDATION_ERROR"
    assert reply["error"]["message"].startswith("entries: ")
    assert await snapshot(receiver_dsn) == []


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        pytest.param(b'{"entries": [', "application/json", 400, "INGEST_BAD_JSON", id="truncated"),
        pytest.param(b"", "application/json", 400, "INGEST_BAD_JSON", id="empty"),
        pytest.param(b"\xff\xfe", "application/json", 400, "INGEST_BAD_JSON", id="not-utf8"),
        pytest.param(
            orjson.dumps({"entries": [entry("a", 1)]}),
            "text/plain",
            415,
            "INGEST_UNSUPPORTED_MEDIA_TYPE",
            id="text-plain",
        ),
        pytest.param(
            b"entries=1",
            "application/x-www-form-urlencoded",
            415,
            "INGEST_UNSUPPORTED_MEDIA_TYPE",
            id="form",
        ),
        pytest.param(b"[]", "application/json", 422, "INGEST_VALIDATION_ERROR", id="array"),
        pytest.param(b"{}", "application/json", 422, "INGEST_VALIDATION_ERROR", id="no-entries"),
    ],
)
async def test_malformed_requests_get_a_json_error(
    rejecting_receiver: tuple[str, str], body: bytes, content_type: str, status: int, code: str
) -> None:
    receiver_dsn, receiver_url = rejecting_receiver
    async with aiohttp.ClientSession() as session:
        got, reply = await post(session, receiver_url, body, content_type=content_type)
    assert (got, reply["error"]["code"]) == (status, code), reply
    assert reply["error"]["message"]
    assert await snapshot(receiver_dsn) == []


async def test_json_with_a_charset_parameter_is_accepted(
    receiver_dsn: str, receiver_url: str
) -> None:
    async with aiohttp.ClientSession() as session:
        status, reply = await post(
            session,
            receiver_url,
            {"entries": [entry("a", 1)]},
            content_type="application/json; charset=utf-8",
        )
    assert (status, reply["applied"]) == (200, 1)


async def test_a_body_over_the_limit_is_a_413_json_error(
    receiver_dsn: str, receiver_url: str
) -> None:
    # The test receiver's limit is 1 MiB: a valid request just over it.
    filler = "x" * 4096
    body = {"entries": [entry(f"big-{i}", i + 1, payload={"f": filler}) for i in range(300)]}
    data = orjson.dumps(body)
    assert 1024 * 1024 < len(data) < 2 * 1024 * 1024
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, receiver_url, data)
    assert status == 413, reply
    assert reply["error"]["code"] == "INGEST_TOO_LARGE"
    assert "bytes" in reply["error"]["message"]
    assert await snapshot(receiver_dsn) == []


async def test_unknown_routes_and_methods_answer_json(receiver_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for method, path, status in [
            ("GET", INGEST, 405),
            ("POST", "/api/ingest/nope", 404),
        ]:
            async with session.request(method, receiver_url + path) as response:
                assert response.status == status
                assert response.content_type == "application/json"
                reply = orjson.loads(await response.read())
                assert reply["error"]["code"] == f"HTTP_{status}"


async def test_an_empty_batch_is_accepted(receiver_dsn: str, receiver_url: str) -> None:
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, receiver_url, {"entries": []})
    assert (status, reply) == (200, {"ok": True, "received": 0, "applied": 0, "stale": 0})
    assert await snapshot(receiver_dsn) == []


# -- generic store -------------------------------------------------------------------------------


async def test_an_unknown_entity_type_is_stored_as_is(receiver_dsn: str, receiver_url: str) -> None:
    payload = {"sku": "W-1", "price": {"amount": 1250, "currency": "JPY"}, "tags": ["a", "b"]}
    body = {"entries": [entry("W-1", 5, payload=payload, entity_type="brand_new.widget-v2")]}
    async with aiohttp.ClientSession() as session:
        status, reply = await post(session, receiver_url, body)
    assert (status, reply["applied"]) == (200, 1)
    rows = await fetch_all(
        receiver_dsn,
        "SELECT entity_type, entity_id, seq, payload, source_created_at::text "
        "FROM ingest.live_entities",
    )
    assert rows == [
        ("brand_new.widget-v2", "W-1", 5, payload, "2026-01-02 03:04:05.123456+00"),
    ]


async def test_a_newly_tracked_table_reaches_the_receiver_unchanged(
    backend_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute("CREATE TABLE gadgets (serial text PRIMARY KEY, spec jsonb)")
        await conn.execute("SELECT sync.track('public.gadgets', 'gadget', 'serial')")
        async with running_consumer(make_settings(backend_dsn, receiver_url)) as runtime:
            await conn.execute(
                """INSERT INTO gadgets VALUES ('G-1', '{"volts": 5}'), ('G-2', '{"volts": 12}')"""
            )
            await conn.execute("DELETE FROM gadgets WHERE serial = 'G-2'")

            async def delivered() -> bool:
                return runtime.stats.delivered_events == 3

            await wait_until(delivered, what="3 gadget events delivered")
    rows = await fetch_all(
        receiver_dsn,
        "SELECT entity_type, entity_id, deleted, payload FROM ingest.entities ORDER BY 2",
    )
    assert rows == [
        ("gadget", "G-1", False, {"serial": "G-1", "spec": {"volts": 5}}),
        ("gadget", "G-2", True, None),
    ]
