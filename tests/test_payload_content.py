"""Payloads of any content, end to end over real PostgreSQL, real HTTP on loopback and real
`serversync` processes.

A json column may hold what jsonb refuses ("\\u0000", lone surrogates): such rows are parked
byte for byte and delivery goes on. A refusal whose body holds control characters parks with a
clean error. Numbers that no 64-bit integer or double holds pass the receiver, the dead-letter
queue, its admin API and `serversync dlq` unchanged."""

from __future__ import annotations

import contextlib
import decimal
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import psycopg
import pytest

from consumer.app.wiring import consumer_runtime, open_pool, serve_ops_http
from consumer.core.events import DeadLetter, Position, json_array_elements
from consumer.observability.redact import safe_error
from consumer.sinks.recording_upload import wanted_recording
from consumer.store.dlq import DlqStore
from consumer.store.outbox import OutboxStore
from tests.conftest import (
    cli_env,
    fetch_all,
    fetch_value,
    make_settings,
    running_consumer,
    serve_receiver,
)
from tests.support.backend import committed_position, insert_calls, seqs_by_caller
from tests.support.cli import assert_ok, run_many
from tests.support.dlq import dead_letters
from tests.support.receivers import Attempt, Reply, ScriptedReceiver, scripted_receiver
from tests.support.waiting import wait_caught_up

CONSUMER = "frontend-sync"
TOKEN = "admin-token-0123456789abcdef"  # noqa: S105 - a test token
INGEST = "/api/ingest/sync"
LIST = f"/api/v1/dlq/{CONSUMER}"

# Valid json that jsonb refuses: text holds no NUL, and half a surrogate pair is no character.
# Spaced on purpose: the json type keeps the text as written, and so must every copy of it.
NUL_DOC = '{"note": "nul \\u0000 inside"}'
LONE_DOC = '{"note" : "lone \\ud800 half",  "flag":true}'
# Wider than a 64-bit integer, beyond a double's range both ways.
NUMBERS_DOC = '{"big": 123456789012345678901234567890, "huge": 1.8e308, "neg": -1e400}'
NUMBERS = {
    "big": 123456789012345678901234567890,
    "huge": decimal.Decimal("1.8e308"),
    "neg": decimal.Decimal("-1e400"),
}
# C0 and C1 control characters and lone surrogates: none may reach a stored error.
UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def exact(text: str | bytes) -> Any:
    """JSON parsed without losing a number: integers of any width, decimals as Decimal."""
    return json.loads(text, parse_float=decimal.Decimal)


# -- a receiver that takes every number and every character ----------------------------------------


@contextlib.asynccontextmanager
async def raw_receiver(*refuse_markers: bytes) -> AsyncIterator[ScriptedReceiver]:
    """A scripted receiver answering 422 to a body holding any of `refuse_markers` (matched in
    the bytes as sent), accepting the rest; `bodies` keeps each accepted body as it came.

    It reads bodies with Python's json, which takes 1.8e308 and lone surrogates: a receiver
    decoding with orjson would answer 500 for the very entries under test."""
    async with scripted_receiver() as receiver:
        receiver.refuse_markers |= set(refuse_markers)
        yield receiver


# -- a tracked table with a json column ------------------------------------------------------------


async def track_docs(dsn: str) -> None:
    """public.docs (id, doc json), tracked as entity type "doc"."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute("CREATE TABLE docs (id int PRIMARY KEY, doc json)")
        await conn.execute("SELECT sync.track('public.docs', 'doc')")


async def insert_docs(dsn: str, *docs: tuple[int, str]) -> None:
    """One transaction (one event) per (id, json text)."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        for key, doc in docs:
            await conn.execute("INSERT INTO docs VALUES (%s, %s::json)", (key, doc))


async def outbox_docs(dsn: str) -> dict[str, tuple[int, str]]:
    """entity_id -> (seq, payload text) of every doc event."""
    rows = await fetch_all(
        dsn,
        "SELECT entity_id, seq, payload::text FROM sync.events_outbox "
        "WHERE entity_type = 'doc' ORDER BY seq",
    )
    return {entity_id: (seq, text) for entity_id, seq, text in rows}


def wire_entry(entity_id: str, seq: int, payload: str) -> str:
    """One entry of an ingest request, its payload given as JSON text."""
    return (
        f'{{"entityType":"doc","entityId":"{entity_id}","op":"upsert","seq":{seq},'
        f'"payload":{payload},"createdAt":"2026-01-02T03:04:05.123456+00:00"}}'
    )


async def post_raw(url: str, body: bytes) -> tuple[int, Any]:
    """POST bytes to the ingest endpoint: the status and the JSON answer (it must be JSON)."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(url + INGEST, data=body, headers={"Content-Type": "application/json"}) as reply,
    ):
        assert reply.content_type == "application/json", await reply.text()
        return reply.status, json.loads(await reply.read())


# -- parking whatever the outbox holds -------------------------------------------------------------


async def test_rows_jsonb_refuses_are_parked_as_written_and_delivery_goes_on(
    backend_dsn: str, receiver_dsn: str
) -> None:
    await track_docs(backend_dsn)
    await insert_docs(
        backend_dsn, (1, '{"fine": 1}'), (2, NUL_DOC), (3, LONE_DOC), (4, '{"fine": 4}')
    )
    async with (
        serve_receiver(receiver_dsn) as url,
        running_consumer(make_settings(backend_dsn, url)) as runtime,
    ):
        await wait_caught_up(backend_dsn, timeout=15)
        assert runtime.stats.parked_events == 2
        # The offset moved past them: what comes later is delivered.
        await insert_docs(backend_dsn, (5, '{"later": 5}'))
        await wait_caught_up(backend_dsn, timeout=15)
    delivered = await fetch_all(
        receiver_dsn, "SELECT entity_id FROM ingest.entities WHERE entity_type = 'doc' ORDER BY 1"
    )
    assert delivered == [("1",), ("4",), ("5",)]

    outbox = await outbox_docs(backend_dsn)
    parked = await fetch_all(
        backend_dsn,
        "SELECT entity_id, seq, payload::text, id::text, error_code, error_message, status "
        "FROM sync.dlq_messages ORDER BY seq",
    )
    # Byte for byte the outbox's text, "\u0000", "\ud800" and spacing included.
    assert [(r[0], r[1], r[2]) for r in parked] == [("2", *outbox["2"]), ("3", *outbox["3"])]
    for row in parked:
        # The reference receiver refused them with a JSON 422, not a 500.
        assert (row[4], row[6]) == ("HTTP_422", "PENDING"), row
        assert "INGEST_VALIDATION_ERROR" in row[5]
        assert not UNPRINTABLE.search(row[5]), row[5]
    ids = {row[0]: row[3] for row in parked}

    # `serversync dlq` shows them and retries them: the receiver gets the stored text exactly.
    async with raw_receiver() as rx:
        env = cli_env(DATABASE_URL=backend_dsn, FRONTEND_BASE_URL=rx.url)
        shown, as_json = await run_many(
            ["dlq", "show", ids["2"]], ["dlq", "show", ids["3"], "--json"], env=env
        )
        nul, lone = await run_many(["dlq", "retry", ids["2"]], ["dlq", "retry", ids["3"]], env=env)
        for result in (shown, as_json, nul, lone):
            assert_ok(result)
        assert '"note": "nul \\u0000 inside"' in shown.stdout
        assert exact(as_json.stdout)["payload"] == exact(outbox["3"][1])
        assert nul.stdout == f"{ids['2']}: delivered; RESOLVED\n"
        assert len(rx.bodies) == 2
        for entity_id in ("2", "3"):
            (body,) = [b for b in rx.bodies if f'"entityId":"{entity_id}"'.encode() in b]
            assert f',"payload":{outbox[entity_id][1]},'.encode() in body
            assert body.count(b'"entityType"') == 1


async def test_a_refusal_holding_nul_and_newlines_parks_with_a_clean_error(
    backend_dsn: str,
) -> None:
    await insert_calls(backend_dsn, 3, tag="r")
    answer = b'{"error": "bad \x00 byte\nforged: log line\r\n\x1b[31mred\x9b"}'

    def script(attempt: Attempt) -> Reply | None:
        return Reply(422, answer) if "r-2" in attempt.callers else None

    async with (
        scripted_receiver(script) as rx,
        running_consumer(make_settings(backend_dsn, rx.url)),
    ):
        await wait_caught_up(backend_dsn, timeout=15)
    seqs = await seqs_by_caller(backend_dsn)
    assert sorted(set(rx.accepted)) == [seqs["r-1"], seqs["r-3"]]
    (parked,) = await dead_letters(backend_dsn)
    assert (parked.caller, parked.error_code, parked.status) == ("r-2", "HTTP_422", "PENDING")
    assert not UNPRINTABLE.search(parked.error_message), parked.error_message
    assert "forged: log line" in parked.error_message
    assert "[31mred" in parked.error_message
    last_error = await fetch_value(
        backend_dsn, "SELECT last_error FROM sync.consumer_offsets WHERE consumer = %s", (CONSUMER,)
    )
    assert last_error is None or not UNPRINTABLE.search(last_error)


async def test_parking_takes_any_entry_and_any_error_text(backend_dsn: str) -> None:
    payload = (
        '{"nul" : "\\u0000", "lone": "\\udc00", "big": 123456789012345678901234567890, '
        '"huge": 1.8e308, "wide": ' + "9" * 5000 + "}"
    )
    entry = wire_entry("7", 7, payload).encode()
    # What a receiver might answer, masked or not, on many lines, with a NUL and half a pair.
    message = "POST http://sync:Pa55w0rdXy@host/ answered HTTP 422: a \x00 b\nc \ud800 token=Le4k3d"
    async with open_pool(backend_dsn, "test-park", max_size=2) as pool:
        store = OutboxStore(pool)
        await store.ensure_consumer(CONSUMER)
        leadership = await store.take_leadership(CONSUMER)
        await store.commit_offset(
            CONSUMER,
            leadership.epoch,
            Position(leadership.position.txid, 7),
            0,
            parked=[DeadLetter(entry, "HTTP_422", message)],
        )
    ((seq, entity, op, created, stored, code, error, last_error),) = await fetch_all(
        backend_dsn,
        "SELECT d.seq, d.entity_type || '/' || d.entity_id, d.op, "
        "d.event_created_at = '2026-01-02T03:04:05.123456+00:00'::timestamptz, "
        "d.payload::text, d.error_code, d.error_message, c.last_error "
        "FROM sync.dlq_messages d JOIN sync.consumer_offsets c USING (consumer)",
    )
    assert (seq, entity, op, created) == (7, "doc/7", "upsert", True)
    assert stored == payload
    assert (code, error) == ("HTTP_422", safe_error(message))
    for text in (error, last_error):
        assert not UNPRINTABLE.search(text), text
        assert "Pa55w0rdXy" not in text
        assert "Le4k3d" not in text
    assert await committed_position(backend_dsn) == (leadership.position.txid, 7)

    # A failed retry stores its error cleaned as well, whoever built the text.
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        store_dlq = DlqStore.over_connection(conn)
        (message_id,) = await store_dlq.retryable_ids(CONSUMER)
        claimed = await store_dlq.claim(message_id)
        assert f',"payload":{payload},'.encode() in claimed.batch.entries_json
        failed = await store_dlq.mark_failed(message_id, "HTTP_422\x00", message)
    assert (failed.status, failed.retry_count) == ("PENDING", 1)
    assert (failed.error_code, failed.error_message) == ("HTTP_422", safe_error(message))
    assert failed.payload == payload


# -- the reference receiver ------------------------------------------------------------------------


@pytest.mark.parametrize("doc", [NUL_DOC, LONE_DOC], ids=["nul", "lone-surrogate"])
async def test_the_receiver_refuses_what_jsonb_cannot_hold_with_a_422(
    receiver_dsn: str, receiver_url: str, doc: str
) -> None:
    body = f'{{"entries":[{wire_entry("ok", 1, "{}")},{wire_entry("bad", 2, doc)}]}}'
    status, reply = await post_raw(receiver_url, body.encode())
    assert status == 422, reply
    assert reply["error"]["code"] == "INGEST_VALIDATION_ERROR"
    assert reply["error"]["message"].startswith("entries: ")
    assert await fetch_all(receiver_dsn, "SELECT * FROM ingest.entities") == []


STORED_NUMBERS = (
    "SELECT (payload->'big')::numeric = %s::numeric, (payload->'huge')::numeric = %s::numeric, "
    "(payload->'neg')::numeric = %s::numeric FROM ingest.entities WHERE entity_id = %s"
)
NUMBER_TEXTS = ("123456789012345678901234567890", "1.8e308", "-1e400")


async def test_the_receiver_stores_numbers_of_any_size_exactly(
    receiver_dsn: str, receiver_url: str
) -> None:
    body = f'{{"entries":[{wire_entry("n-1", 1, NUMBERS_DOC)}]}}'
    status, reply = await post_raw(receiver_url, body.encode())
    assert (status, reply) == (200, {"ok": True, "received": 1, "applied": 1, "stale": 0})
    assert await fetch_all(receiver_dsn, STORED_NUMBERS, (*NUMBER_TEXTS, "n-1")) == [
        (True, True, True)
    ]


@pytest.mark.parametrize(
    ("seq", "status", "stored"),
    [
        ("8444.0", 200, 8444),
        ("8.444e3", 200, 8444),
        ("8444", 200, 8444),
        ("8444.5", 422, None),
        ("true", 422, None),
        ('"8444"', 422, None),
        ("0", 422, None),
        ("9.3e18", 422, None),
    ],
)
async def test_the_receivers_seq_is_a_json_integer_however_it_is_written(
    receiver_dsn: str, receiver_url: str, seq: str, status: int, stored: int | None
) -> None:
    """A JSON Schema integer is any number with a zero fraction: 8444.0 is seq 8444, as the
    API document allows. Fractions, booleans, strings and values a bigint cannot hold are not."""
    body = '{"entries":[' + wire_entry("s-1", 1, "{}").replace('"seq":1', f'"seq":{seq}') + "]}"
    answered, _ = await post_raw(receiver_url, body.encode())
    assert answered == status
    rows = await fetch_all(receiver_dsn, "SELECT seq FROM ingest.entities")
    assert rows == ([(stored,)] if stored is not None else [])


async def test_a_consumer_delivers_numbers_of_any_size_to_the_receiver_exactly(
    backend_dsn: str, receiver_dsn: str, receiver_url: str
) -> None:
    await track_docs(backend_dsn)
    await insert_docs(backend_dsn, (1, NUMBERS_DOC))
    async with running_consumer(make_settings(backend_dsn, receiver_url)) as runtime:
        await wait_caught_up(backend_dsn, timeout=15)
        assert runtime.stats.parked_events == 0
    rows = await fetch_all(
        receiver_dsn,
        STORED_NUMBERS.replace("payload->", "payload->'doc'->"),
        (*NUMBER_TEXTS, "1"),
    )
    assert rows == [(True, True, True)]


# -- the dead-letter queue's answers ---------------------------------------------------------------


@dataclass(frozen=True)
class ParkedNumbers:
    """A parked doc event whose payload holds NUMBERS_DOC, and the receiver that refused it."""

    dsn: str
    receiver: ScriptedReceiver
    id: str
    # The payload's text as the dead-letter queue holds it, and as the outbox holds it.
    stored: str
    outbox: str


@pytest.fixture
async def parked_numbers(backend_dsn: str) -> AsyncIterator[ParkedNumbers]:
    """NUMBERS_DOC parked by a consumer whose receiver refused it; a neighbour got through."""
    await track_docs(backend_dsn)
    await insert_docs(backend_dsn, (1, NUMBERS_DOC), (2, '{"fine": 2}'))
    async with raw_receiver(b"1.8e308") as rx:
        async with running_consumer(make_settings(backend_dsn, rx.url)):
            await wait_caught_up(backend_dsn, timeout=15)
        ((message_id, stored),) = await fetch_all(
            backend_dsn, "SELECT id::text, payload::text FROM sync.dlq_messages"
        )
        outbox = (await outbox_docs(backend_dsn))["1"][1]
        yield ParkedNumbers(backend_dsn, rx, message_id, stored, outbox)


async def test_the_admin_api_answers_payloads_with_numbers_of_any_size(
    parked_numbers: ParkedNumbers,
) -> None:
    p = parked_numbers
    settings = make_settings(p.dsn, p.receiver.url, SYNC_ADMIN_TOKEN=TOKEN, SYNC_HTTP_PORT=0)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    message = f"/api/v1/dlq/messages/{p.id}"
    answers: list[tuple[int, bytes]] = []
    async with (
        consumer_runtime(settings, CONSUMER) as runtime,
        serve_ops_http(settings, runtime) as url,
        aiohttp.ClientSession(headers=headers) as http,
    ):
        for path in (LIST, message):
            async with http.get(url + path) as response:
                assert response.content_type == "application/json"
                answers.append((response.status, await response.read()))
        p.receiver.refuse_markers.clear()
        async with http.post(f"{url}{message}/retry") as response:
            retried = (response.status, json.loads(await response.read()))
    (listed_status, listed), (shown_status, shown) = answers
    assert (listed_status, shown_status) == (200, 200), answers
    # The stored text, as is, inside each answer.
    for body in (listed, shown):
        assert f'"payload":{p.stored}'.encode() in body
    (first,) = exact(listed)["messages"]
    assert first["payload"]["doc"] == NUMBERS
    assert exact(shown)["payload"]["doc"] == NUMBERS
    assert (retried[0], retried[1]["status"]) == (200, "RESOLVED"), retried
    assert f',"payload":{p.stored},'.encode() in p.receiver.bodies[-1]
    # Parked byte for byte: no number was rewritten on the way in either.
    assert p.stored == p.outbox


async def test_cli_dlq_list_and_show_print_numbers_of_any_size(
    parked_numbers: ParkedNumbers,
) -> None:
    p = parked_numbers
    env = cli_env(DATABASE_URL=p.dsn, FRONTEND_BASE_URL=p.receiver.url)
    listed, listed_json, shown, shown_json = await run_many(
        ["dlq", "list", CONSUMER],
        ["dlq", "list", CONSUMER, "--json"],
        ["dlq", "show", p.id],
        ["dlq", "show", p.id, "--json"],
        env=env,
    )
    for result in (listed, listed_json, shown, shown_json):
        assert_ok(result)
    assert p.id in listed.stdout
    (first,) = exact(listed_json.stdout)["messages"]
    assert first["payload"]["doc"] == NUMBERS
    assert exact(shown_json.stdout)["payload"]["doc"] == NUMBERS
    payload = shown.stdout.split("payload:\n", 1)[1]
    for line in (
        '"big": 123456789012345678901234567890',
        '"huge": 1.8e308',
        '"neg": -1e400',
    ):
        assert line in payload, payload
    # Laid out on lines, and the same JSON as stored.
    assert exact(payload) == exact(p.stored)


# -- nesting deeper than Python's decoder goes -----------------------------------------------------

# PostgreSQL's json takes this; Python's json module (and orjson, at 1024) recurse no deeper than
# about a thousand levels.
DEEP_DOC = '{"deep": ' + "[" * 1400 + "]" * 1400 + "}"


async def test_a_payload_nested_too_deep_to_decode_is_parked_and_delivery_goes_on(
    backend_dsn: str, receiver_dsn: str
) -> None:
    """The reference receiver refuses it with a 4xx (never a 500 that would hold the stream for
    ever), the batch is split without decoding it, the entry is parked byte for byte, and the
    rows around it are delivered."""
    await track_docs(backend_dsn)
    await insert_docs(backend_dsn, (1, '{"fine": 1}'), (2, DEEP_DOC), (3, '{"fine": 3}'))
    async with (
        serve_receiver(receiver_dsn) as url,
        running_consumer(make_settings(backend_dsn, url)) as runtime,
    ):
        await wait_caught_up(backend_dsn, timeout=15)
        assert runtime.stats.parked_events == 1
    delivered = await fetch_all(
        receiver_dsn, "SELECT entity_id FROM ingest.entities WHERE entity_type = 'doc' ORDER BY 1"
    )
    assert delivered == [("1",), ("3",)]
    outbox = await outbox_docs(backend_dsn)
    parked = await fetch_all(
        backend_dsn, "SELECT entity_id, seq, payload::text, error_code FROM sync.dlq_messages"
    )
    assert [(r[0], r[1], r[2]) for r in parked] == [("2", *outbox["2"])]
    assert parked[0][3].startswith("HTTP_4"), parked


def test_recording_upload_reads_past_events_it_cannot_decode() -> None:
    """Every event passes through recording-upload; those of other tables with a number no
    double holds or a nesting too deep to decode are not its business, and never stop it."""
    odd = [
        b'{"entityType":"doc","entityId":"1","op":"upsert","seq":1,"payload":' + p.encode() + b"}"
        for p in (NUMBERS_DOC, DEEP_DOC, LONE_DOC)
    ]
    assert [wanted_recording(entry) for entry in odd] == [None, None, None]
    pending = (
        b'{"entityType":"recording","entityId":"r-1","op":"upsert","seq":2,'
        b'"payload":{"huge":1.8e308,"upload_status":"pending"}}'
    )
    uploaded = pending.replace(b'"pending"', b'"uploaded"')
    assert wanted_recording(pending) == "r-1"
    assert wanted_recording(uploaded) is None


async def test_a_dead_letter_is_redelivered_as_the_bytes_it_was_first_sent_as(
    backend_dsn: str,
) -> None:
    """An operator's retry sends the receiver exactly the entry the stream sent: one encoder
    builds both (the payload's text, a created_at with microseconds, any identifier)."""
    await track_docs(backend_dsn)
    await insert_docs(
        backend_dsn, (1, '{"big": 123456789012345678901234567890, "s": "\\u00e9 \\""}')
    )
    async with open_pool(backend_dsn, "test-redeliver", max_size=2) as pool:
        store = OutboxStore(pool)
        await store.ensure_consumer(CONSUMER)
        leadership = await store.take_leadership(CONSUMER)
        read = await store.read_batch(leadership.position, 10)
        assert read.batch is not None
        (entry,) = json_array_elements(read.batch.entries_json)
        await store.commit_offset(
            CONSUMER,
            leadership.epoch,
            read.batch.end,
            read.batch.count,
            parked=[DeadLetter(entry, "HTTP_422", "refused")],
        )
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        store_dlq = DlqStore.over_connection(conn)
        (message_id,) = await store_dlq.retryable_ids(CONSUMER)
        claimed = await store_dlq.claim(message_id)
    assert claimed.batch.entries_json == read.batch.entries_json
