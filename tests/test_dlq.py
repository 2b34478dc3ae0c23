"""The dead-letter queue's operations: events parked by a real consumer that met a
scripted receiver refusing some of them, then listed, shown, retried and deleted through the admin
API (real HTTP on loopback), the `serversync dlq` command (real subprocesses) and a real
`serversync run` process."""

from __future__ import annotations

import contextlib
import socket
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psycopg
import pytest

from consumer.app.settings import SyncSettings
from consumer.app.wiring import consumer_runtime, serve_ops_http
from consumer.devtools.devdb import free_port
from tests.conftest import CliResult, cli_env, fetch_all, make_settings, running_consumer
from tests.support.backend import CONSUMER, insert_callers
from tests.support.cli import assert_ok, assert_one_line_error, run_cli, run_many
from tests.support.dlq import parked_by_caller
from tests.support.processes import Processes
from tests.support.receivers import ScriptedReceiver, scripted_receiver
from tests.support.waiting import wait_until

TOKEN = "admin-token-0123456789abcdef"  # noqa: S105 - a test token
MAX_RETRIES = 2
# What the scripted receiver puts in its refusals: it must never be stored unmasked.
LEAKED = "Le4kedT0kenValue"
# A password in FRONTEND_BASE_URL: it appears in every delivery error ("POST <url> ...").
URL_PASSWORD = "UrlPa55w0rdQq"  # noqa: S105 - a test value


@contextlib.asynccontextmanager
async def leaky_receiver() -> AsyncIterator[ScriptedReceiver]:
    """A scripted receiver whose refusals (422, naming the refused caller number and the answer's
    number) also echo a token."""
    async with scripted_receiver() as receiver:
        receiver.refusal_detail = f"token={LEAKED}"
        yield receiver


# -- parking events ------------------------------------------------------------------------------


async def park(
    dsn: str, receiver: ScriptedReceiver, settings: SyncSettings, good: int, bad: int
) -> tuple[list[str], list[str]]:
    """Run a consumer over `good` + `bad` new events (interleaved) until every one is either
    delivered or parked; the bad ones are refused by `receiver`. Their caller numbers."""
    goods = [f"good-{i:03d}" for i in range(good)]
    bads = [f"bad-{i:03d}" for i in range(bad)]
    receiver.refuse |= set(bads)
    mixed = [c for pair in zip(bads, goods, strict=False) for c in pair]
    mixed += bads[len(goods) :] + goods[len(bads) :]
    await insert_callers(dsn, mixed)
    async with running_consumer(settings) as runtime:

        def settled() -> bool:
            s = runtime.stats
            return s.delivered_events + s.parked_events == good + bad

        await wait_until(settled, timeout=20, what="every event delivered or parked")
        assert runtime.stats.parked_events == bad
    return goods, bads


# -- the admin API in this process ---------------------------------------------------------------


@dataclass
class Api:
    """A backend database, a scripted receiver, and the admin API serving that database."""

    dsn: str
    receiver: ScriptedReceiver
    settings: SyncSettings
    url: str
    http: aiohttp.ClientSession

    async def call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, Any] | None = None,
        token: str | None = TOKEN,
        authorization: str | None = None,
    ) -> tuple[int, Any]:
        """One request; the status and the parsed JSON body (every answer must be JSON)."""
        headers = {}
        if authorization is not None:
            headers["Authorization"] = authorization
        elif token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with self.http.request(
            method, self.url + path, params=params, headers=headers
        ) as response:
            assert response.content_type == "application/json", await response.text()
            return response.status, orjson.loads(await response.read())

    async def park(self, good: int, bad: int) -> tuple[list[str], list[str]]:
        """See park()."""
        return await park(self.dsn, self.receiver, self.settings, good, bad)


@pytest.fixture
async def api(backend_dsn: str) -> AsyncIterator[Api]:
    """The admin API on a free loopback port, as `serversync run` serves it."""
    async with leaky_receiver() as receiver:
        settings = make_settings(
            backend_dsn,
            receiver.with_password(URL_PASSWORD),
            SYNC_ADMIN_TOKEN=TOKEN,
            SYNC_HTTP_PORT=0,
            SYNC_DLQ_MAX_RETRIES=MAX_RETRIES,
        )
        async with (
            consumer_runtime(settings, CONSUMER) as runtime,
            serve_ops_http(settings, runtime) as url,
            aiohttp.ClientSession() as http,
        ):
            assert url.startswith("http://127.0.0.1:")
            yield Api(backend_dsn, receiver, settings, url, http)


def assert_error(answer: tuple[int, Any], status: int, code: str, *fragments: str) -> None:
    """An error answer: the status, {"error": {"code", "message"}} with every fragment."""
    got_status, body = answer
    assert got_status == status, body
    assert set(body) == {"error"}, body
    assert body["error"]["code"] == code, body
    for fragment in fragments:
        assert fragment in body["error"]["message"], body


LIST = f"/api/v1/dlq/{CONSUMER}"


def message_path(message_id: str, action: str = "") -> str:
    """/api/v1/dlq/messages/{id}[/action]."""
    return f"/api/v1/dlq/messages/{message_id}" + (f"/{action}" if action else "")


# -- the admin API -------------------------------------------------------------------------------


async def test_list_paginates_newest_first_and_filters_by_status(api: Api) -> None:
    goods, bads = await api.park(good=5, bad=25)
    # Only the refused events were parked; their neighbours got through.
    assert sorted(api.receiver.accepted_callers()) == goods
    rows = await parked_by_caller(api.dsn)
    assert sorted(rows) == bads
    newest_first = sorted((r.seq for r in rows.values()), reverse=True)

    pages = [await api.call("GET", LIST, params={"page": p, "page_size": 10}) for p in (1, 2, 3)]
    seqs: list[int] = []
    for number, (status, body) in enumerate(pages, start=1):
        assert status == 200, body
        assert body["pagination"] == {
            "total_count": 25,
            "page": number,
            "page_size": 10,
            "has_next": number < 3,
        }
        seqs += [m["seq"] for m in body["messages"]]
    assert seqs == newest_first
    assert [len(body["messages"]) for _, body in pages] == [10, 10, 5]

    first = pages[0][1]["messages"][0]
    bad = first["payload"]["caller_number"]
    assert first["id"] == rows[bad].id
    assert (first["consumer"], first["original_topic"]) == (CONSUMER, CONSUMER)
    assert (first["entity_type"], first["op"], first["status"]) == ("call_log", "upsert", "PENDING")
    assert (first["retry_count"], first["max_retries"], first["last_retry_at"]) == (0, 2, None)
    assert first["error_code"] == "HTTP_422"
    assert f"refused {bad}" in first["error_message"]
    assert "token=***" in first["error_message"]
    assert LEAKED not in str(first)
    assert URL_PASSWORD not in str(first)
    for stamp in ("created_at", "updated_at", "event_created_at"):
        datetime.fromisoformat(first[stamp])

    status, beyond = await api.call("GET", LIST, params={"page": 4, "page_size": 10})
    assert status == 200
    assert beyond == {
        "messages": [],
        "pagination": {"total_count": 25, "page": 4, "page_size": 10, "has_next": False},
    }
    # Parked by one commit, they share created_at; one parked later (e.g. after an offset reset)
    # comes first even with the lowest seq.
    oldest_seq = newest_first[-1]
    conn = await psycopg.AsyncConnection.connect(api.dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "UPDATE sync.dlq_messages SET created_at = created_at + interval '1 minute' "
            "WHERE seq = %s",
            (oldest_seq,),
        )
    status, default = await api.call("GET", LIST)
    assert status == 200
    assert default["pagination"] == {
        "total_count": 25,
        "page": 1,
        "page_size": 20,
        "has_next": True,
    }
    assert [m["seq"] for m in default["messages"]] == [oldest_seq, *newest_first[:19]]
    status, other = await api.call("GET", "/api/v1/dlq/some-other-consumer")
    assert (status, other["pagination"]["total_count"], other["messages"]) == (200, 0, [])

    # One message resolved, one dead: the filter sees each status apart (in any case).
    api.receiver.refuse.discard(bads[3])
    status, body = await api.call("POST", message_path(rows[bads[3]].id, "retry"))
    assert (status, body["status"]) == (200, "RESOLVED"), body
    for _ in range(MAX_RETRIES):
        status, body = await api.call("POST", message_path(rows[bads[7]].id, "retry"))
        assert status == 200, body
    assert body["status"] == "DEAD"
    expected = {"RESOLVED": [bads[3]], "dead": [bads[7]], "Pending": None, "RETRYING": []}
    for wanted, callers in expected.items():
        status, body = await api.call("GET", LIST, params={"status": wanted, "page_size": 100})
        assert status == 200, body
        got = [m["payload"]["caller_number"] for m in body["messages"]]
        assert {m["status"] for m in body["messages"]} <= {wanted.upper()}
        if callers is None:
            assert sorted(got) == sorted(set(bads) - {bads[3], bads[7]})
        else:
            assert got == callers
        assert body["pagination"]["total_count"] == len(got)


async def test_retry_delivers_the_stored_event_and_resolves_it(api: Api) -> None:
    _, bads = await api.park(good=2, bad=3)
    rows = await parked_by_caller(api.dsn)
    target = rows[bads[1]]
    status, before = await api.call("GET", message_path(target.id))
    assert status == 200
    assert before["id"] == target.id
    assert before["seq"] == target.seq

    api.receiver.refuse.discard(bads[1])
    accepted_before = len(api.receiver.accepted_entries)
    status, body = await api.call("POST", message_path(target.id, "retry"))
    assert status == 200, body
    assert body["id"] == target.id
    assert body["status"] == "RESOLVED"
    assert "delivered" in body["message"]

    # The very event of the outbox reached the receiver, alone.
    (arrived,) = api.receiver.accepted_entries[accepted_before:]
    (outbox,) = await fetch_all(
        api.dsn,
        "SELECT entity_type, entity_id, op, seq, payload, created_at FROM sync.events_outbox "
        "WHERE seq = %s",
        (target.seq,),
    )
    assert (arrived["entityType"], arrived["entityId"], arrived["op"], arrived["seq"]) == outbox[:4]
    assert arrived["payload"] == outbox[4]
    assert datetime.fromisoformat(arrived["createdAt"]) == outbox[5]

    after = (await parked_by_caller(api.dsn))[bads[1]]
    assert (after.status, after.retry_count) == ("RESOLVED", 1)
    assert after.last_retry_at is not None
    status, shown = await api.call("GET", message_path(target.id))
    assert (shown["status"], shown["retry_count"]) == ("RESOLVED", 1)
    assert shown["last_retry_at"] is not None
    assert datetime.fromisoformat(shown["updated_at"]) > datetime.fromisoformat(
        before["updated_at"]
    )
    # The others were left alone.
    assert {c: r.status for c, r in (await parked_by_caller(api.dsn)).items()} == {
        bads[0]: "PENDING",
        bads[1]: "RESOLVED",
        bads[2]: "PENDING",
    }

    # A RESOLVED message cannot be retried: 409, and nothing is sent.
    answered = api.receiver.seen
    assert_error(
        await api.call("POST", message_path(target.id, "retry")),
        409,
        "SYS_DLQ_CONFLICT",
        "RESOLVED",
    )
    assert api.receiver.seen == answered
    assert (await parked_by_caller(api.dsn))[bads[1]].retry_count == 1

    # A receiver that says it already has the event (409): that is delivered too.
    api.receiver.refuse.discard(bads[2])
    api.receiver.conflict.add(bads[2])
    status, body = await api.call("POST", message_path(rows[bads[2]].id, "retry"))
    assert (status, body["status"]) == (200, "RESOLVED"), body


async def test_a_retry_sends_the_stored_event_exactly(api: Api) -> None:
    _, bads = await api.park(good=0, bad=1)
    target = (await parked_by_caller(api.dsn))[bads[0]]
    # Numbers no double keeps exactly or holds at all, text that needs escaping, and
    # spacing of its own: the payload is json, kept as written.
    extra = '"big": 123456789012345678901234567890, "long": 0.10000000000000000000000001, '
    extra += '"huge" :  1.8e308, "text": "caf\u00e9 \\"quoted\\" \\n"}'
    conn = await psycopg.AsyncConnection.connect(api.dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "UPDATE sync.dlq_messages SET payload = (left(payload::text, -1) || ', ' || %s)::json "
            "WHERE id = %s",
            (extra, target.id),
        )
    ((stored,),) = await fetch_all(
        api.dsn, "SELECT payload::text FROM sync.dlq_messages WHERE id = %s", (target.id,)
    )
    api.receiver.refuse.clear()
    status, body = await api.call("POST", message_path(target.id, "retry"))
    assert (status, body["status"]) == (200, "RESOLVED"), body
    (sent,) = api.receiver.bodies
    assert f',"payload":{stored},'.encode() in sent
    assert b'"big": 123456789012345678901234567890' in sent
    assert b'"long": 0.10000000000000000000000001' in sent
    assert b'"huge" :  1.8e308' in sent


async def test_a_failing_retry_counts_then_the_message_is_dead(api: Api) -> None:
    _, bads = await api.park(good=0, bad=2)
    target = (await parked_by_caller(api.dsn))[bads[0]]

    status, body = await api.call("POST", message_path(target.id, "retry"))
    assert (status, body["status"]) == (200, "PENDING"), body
    assert "1 of 2 retries used" in body["message"]
    assert "HTTP 422" in body["message"]
    once = (await parked_by_caller(api.dsn))[bads[0]]
    assert (once.status, once.retry_count, once.error_code) == ("PENDING", 1, "HTTP_422")
    assert once.last_retry_at is not None
    # The error is the retry's own (the receiver numbers its answers), masked.
    assert once.error_message != target.error_message
    assert f"refused {bads[0]}" in once.error_message
    assert "token=***" in once.error_message
    assert LEAKED not in once.error_message
    # The sink masks the receiver's answer; the URL, with its password, is masked by the retry.
    assert "POST http://sync:***@127.0.0.1:" in once.error_message
    assert URL_PASSWORD not in once.error_message
    assert URL_PASSWORD not in body["message"]

    status, body = await api.call("POST", message_path(target.id, "retry"))
    assert (status, body["status"]) == (200, "DEAD"), body
    dead = (await parked_by_caller(api.dsn))[bads[0]]
    assert (dead.status, dead.retry_count) == ("DEAD", MAX_RETRIES)
    assert dead.last_retry_at is not None
    assert once.last_retry_at is not None
    assert dead.last_retry_at > once.last_retry_at

    # DEAD is final, even once the receiver would take it.
    api.receiver.refuse.clear()
    assert_error(
        await api.call("POST", message_path(target.id, "retry")), 409, "SYS_DLQ_CONFLICT", "DEAD"
    )
    assert (await parked_by_caller(api.dsn))[bads[0]].retry_count == MAX_RETRIES
    assert api.receiver.accepted_entries == []
    # The other message never moved.
    other = (await parked_by_caller(api.dsn))[bads[1]]
    assert (other.status, other.retry_count) == ("PENDING", 0)


async def test_delete_and_every_error_code(api: Api) -> None:
    _, bads = await api.park(good=1, bad=2)
    rows = await parked_by_caller(api.dsn)
    victim = rows[bads[0]].id
    unknown = str(uuid.uuid4())

    for method, action in (("GET", ""), ("POST", "retry"), ("DELETE", "")):
        assert_error(
            await api.call(method, message_path("not-a-uuid", action)),
            400,
            "SYS_DLQ_VALIDATION_ERROR",
            "not-a-uuid",
        )
        assert_error(
            await api.call(method, message_path(unknown, action)), 404, "SYS_DLQ_NOT_FOUND", unknown
        )
    for params, fragment in [
        ({"page": "0"}, "page must be between 1"),
        ({"page": "-3"}, "page must be between 1"),
        ({"page": "abc"}, "page must be an integer"),
        ({"page_size": "0"}, "page_size must be between 1 and 100"),
        ({"page_size": "101"}, "page_size must be between 1 and 100"),
        ({"status": "LOST"}, "unknown status 'LOST'"),
    ]:
        assert_error(
            await api.call("GET", LIST, params=params), 400, "SYS_DLQ_VALIDATION_ERROR", fragment
        )
    assert_error(await api.call("GET", "/api/v1/nothing/here/at/all"), 404, "SYS_DLQ_NOT_FOUND")

    status, body = await api.call("DELETE", message_path(victim))
    assert (status, body) == (200, {"success": True, "message": f"dead letter {victim} deleted"})
    assert sorted(await parked_by_caller(api.dsn)) == [bads[1]]
    assert_error(await api.call("GET", message_path(victim)), 404, "SYS_DLQ_NOT_FOUND")
    assert_error(await api.call("DELETE", message_path(victim)), 404, "SYS_DLQ_NOT_FOUND")
    assert_error(await api.call("POST", message_path(victim, "retry")), 404, "SYS_DLQ_NOT_FOUND")

    # The database failing under a request: 500 with the seed's code, no details leaked.
    conn = await psycopg.AsyncConnection.connect(api.dsn, autocommit=True)
    async with conn:
        await conn.execute("ALTER TABLE sync.dlq_messages RENAME TO dlq_messages_gone")
    status, body = await api.call("GET", LIST)
    assert_error((status, body), 500, "SYS_DLQ_INTERNAL_ERROR", "internal error")
    assert "dlq_messages" not in str(body)


async def test_retry_all_reports_counts_pages_past_100_and_retries_each_once(api: Api) -> None:
    _, bads = await api.park(good=3, bad=130)
    rows = await parked_by_caller(api.dsn)
    # Before: one resolved, one dead (retried to the end), both skipped by retry-all.
    api.receiver.refuse.discard(bads[0])
    assert (await api.call("POST", message_path(rows[bads[0]].id, "retry")))[1][
        "status"
    ] == "RESOLVED"
    for _ in range(MAX_RETRIES):
        await api.call("POST", message_path(rows[bads[1]].id, "retry"))
    # From now on, three stay refused; the other 125 get through.
    still_refused = set(bads[2:5])
    api.receiver.refuse = set(still_refused) | {bads[1]}
    accepted_before = len(api.receiver.accepted_entries)
    answered_before = api.receiver.seen

    status, body = await api.call("POST", f"{LIST}/retry-all")
    assert status == 200, body
    assert {k: body[k] for k in ("retried", "succeeded", "failed")} == {
        "retried": 128,
        "succeeded": 125,
        "failed": 3,
    }
    assert "retried 128: 125 succeeded, 3 failed" in body["message"]
    # Each message once, in single-event requests; a failed one was not picked up again.
    assert api.receiver.seen - answered_before == 128
    arrived = api.receiver.accepted_callers()[accepted_before:]
    assert sorted(arrived) == sorted(set(bads[2:]) - still_refused)
    after = await parked_by_caller(api.dsn)
    assert {c for c, r in after.items() if r.status == "RESOLVED"} == set(bads) - still_refused - {
        bads[1]
    }
    assert {(c, r.status, r.retry_count) for c, r in after.items() if c in still_refused} == {
        (c, "PENDING", 1) for c in still_refused
    }
    assert (after[bads[1]].status, after[bads[1]].retry_count) == ("DEAD", MAX_RETRIES)

    status, again = await api.call("POST", f"{LIST}/retry-all")
    assert (status, again["retried"], again["succeeded"], again["failed"]) == (200, 3, 0, 3)
    assert {(await parked_by_caller(api.dsn))[c].status for c in still_refused} == {"DEAD"}
    status, nothing = await api.call("POST", f"{LIST}/retry-all")
    assert (status, nothing["retried"], nothing["succeeded"], nothing["failed"]) == (200, 0, 0, 0)
    status, other = await api.call("POST", "/api/v1/dlq/no-such-consumer/retry-all")
    assert (status, other["retried"]) == (200, 0)


async def test_retry_all_stops_at_a_receiver_outage_without_burning_retries(api: Api) -> None:
    _, bads = await api.park(good=0, bad=4)
    api.receiver.unavailable = True
    status, body = await api.call("POST", f"{LIST}/retry-all")
    assert status == 200, body
    assert (body["retried"], body["succeeded"], body["failed"]) == (1, 0, 1)
    assert "stopped early" in body["message"]
    assert "HTTP 503" in body["message"]
    rows = await parked_by_caller(api.dsn)
    assert sorted(r.retry_count for r in rows.values()) == [0, 0, 0, 1]
    assert {r.status for r in rows.values()} == {"PENDING"}
    failed = next(r for r in rows.values() if r.retry_count == 1)
    assert failed.error_code == "HTTP_503"

    api.receiver.unavailable = False
    api.receiver.refuse.clear()
    status, body = await api.call("POST", f"{LIST}/retry-all")
    assert (status, body["retried"], body["succeeded"], body["failed"]) == (200, 4, 4, 0)
    assert sorted(api.receiver.accepted_callers()) == bads


async def test_every_dlq_route_wants_the_bearer_token(api: Api) -> None:
    _, bads = await api.park(good=0, bad=1)
    message_id = (await parked_by_caller(api.dsn))[bads[0]].id
    api.receiver.refuse.clear()
    answered = api.receiver.seen
    routes = [
        ("GET", LIST),
        ("POST", f"{LIST}/retry-all"),
        ("GET", message_path(message_id)),
        ("POST", message_path(message_id, "retry")),
        ("DELETE", message_path(message_id)),
        ("GET", message_path("not-a-uuid")),
        ("GET", "/api/v1/unknown"),
    ]
    wrong: list[dict[str, Any]] = [
        {"token": None},
        {"token": "admin-token-0123456789abcdeX"},
        {"token": TOKEN[:-1]},
        {"token": TOKEN + "0"},
        {"authorization": f"Basic {TOKEN}"},
        {"authorization": TOKEN},
        {"authorization": "Bearer"},
    ]
    for method, path in routes:
        for credentials in wrong:
            status, body = await api.call(method, path, **credentials)
            assert (status, body["error"]["code"]) == (401, "SYS_DLQ_UNAUTHORIZED"), (
                method,
                path,
                credentials,
            )
            assert TOKEN not in str(body)
    # Nothing was retried or deleted by the refused requests.
    assert api.receiver.seen == answered
    row = (await parked_by_caller(api.dsn))[bads[0]]
    assert (row.status, row.retry_count) == ("PENDING", 0)
    # The scheme is case-insensitive, as HTTP wants; the health check needs no token.
    status, _ = await api.call("GET", LIST, authorization=f"bearer {TOKEN}")
    assert status == 200
    assert await api.call("GET", "/healthz", token=None) == (
        200,
        {"status": "ok", "consumer": CONSUMER},
    )


# -- `serversync run` serves the admin API -------------------------------------------------------


async def http_get(url: str, token: str | None = TOKEN) -> tuple[int, Any]:
    """One GET on a fresh session: status and JSON body."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as response:
        return response.status, orjson.loads(await response.read())


def two_free_ports() -> tuple[int, int]:
    """Two distinct loopback ports that nothing listens on right now."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        return int(a.getsockname()[1]), int(b.getsockname()[1])


def refuses_connections(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


async def test_a_consumer_process_serves_the_admin_api_only_with_a_token(
    backend_dsn: str, tmp_path: Path
) -> None:
    with_token, without = two_free_ports()
    async with leaky_receiver() as receiver:
        receiver.refuse = {"bad-0"}
        with Processes(tmp_path) as procs:
            served = procs.consumer(
                backend_dsn,
                receiver.url,
                "with-token",
                SYNC_ADMIN_TOKEN=TOKEN,
                SYNC_HTTP_PORT=str(with_token),
            )
            off = procs.consumer(backend_dsn, receiver.url, "without", SYNC_HTTP_PORT=str(without))
            # Generous deadlines: two interpreters start at once on a possibly busy machine.
            await served.wait_log(
                f"readiness and metrics on http://127.0.0.1:{with_token} (and the DLQ admin API)",
                timeout=30,
            )
            await off.wait_log(
                f"http://127.0.0.1:{without}; DLQ admin API off (no SYNC_ADMIN_TOKEN)", timeout=30
            )
            # Without a token the port serves health and metrics, but no way to replay events.
            health = (200, {"status": "ok", "consumer": CONSUMER})
            assert await http_get(f"http://127.0.0.1:{without}/healthz", token=None) == health
            assert (await http_get(f"http://127.0.0.1:{without}{LIST}"))[0] == 404

            base = f"http://127.0.0.1:{with_token}"
            assert await http_get(f"{base}/healthz", token=None) == health
            assert (await http_get(f"{base}{LIST}", token=None))[0] == 401
            await insert_callers(backend_dsn, ["good-0", "bad-0", "good-1"])

            async def parked() -> bool:
                status, body = await http_get(f"{base}{LIST}")
                assert status == 200, body
                return bool(body["pagination"]["total_count"] == 1)

            await wait_until(parked, timeout=20, what="the refused event parked")
            (message,) = (await http_get(f"{base}{LIST}"))[1]["messages"]
            assert message["payload"]["caller_number"] == "bad-0"

            # The process retries through its own sink, to FRONTEND_BASE_URL.
            receiver.refuse.clear()
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    f"{base}{message_path(message['id'], 'retry')}",
                    headers={"Authorization": f"Bearer {TOKEN}"},
                ) as response,
            ):
                assert response.status == 200
                assert (await response.json())["status"] == "RESOLVED"
            assert sorted(receiver.accepted_callers()) == ["bad-0", "good-0", "good-1"]

            served.terminate()
            assert await served.wait_exit(timeout=30) == 0
            assert refuses_connections(with_token)
            assert "consumer frontend-sync stopped" in served.log()
            off.terminate()
            assert await off.wait_exit(timeout=30) == 0


async def test_a_taken_admin_port_is_a_one_line_startup_error(backend_dsn: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = cli_env(
            DATABASE_URL=backend_dsn,
            FRONTEND_BASE_URL="http://127.0.0.1:9",
            SYNC_ADMIN_TOKEN=TOKEN,
            SYNC_HTTP_PORT=str(port),
        )
        # Were the port not in use, `run` would keep running: the timeout fails the test.
        result = await run_cli("run", CONSUMER, env=env, timeout=30)
    line = assert_one_line_error(result, 1, "cannot listen on", f"127.0.0.1:{port}")
    assert TOKEN not in line


# -- the command line ----------------------------------------------------------------------------


def table_rows(stdout: str) -> list[list[str]]:
    """The data rows of a CLI table (cells split on whitespace), up to the first blank line."""
    lines = stdout.strip().split("\n\n")[0].splitlines()
    return [line.split() for line in lines[1:]]


async def test_cli_dlq_list_show_retry_and_delete(backend_dsn: str) -> None:
    async with leaky_receiver() as receiver:
        settings = make_settings(backend_dsn, receiver.url, SYNC_DLQ_MAX_RETRIES=MAX_RETRIES)
        _, bads = await park(backend_dsn, receiver, settings, good=2, bad=3)
        rows = await parked_by_caller(backend_dsn)
        env = cli_env(
            DATABASE_URL=backend_dsn,
            FRONTEND_BASE_URL=receiver.with_password(URL_PASSWORD),
            SYNC_DLQ_MAX_RETRIES=str(MAX_RETRIES),
        )
        a, b, c = (rows[x] for x in bads)
        unknown = str(uuid.uuid4())
        (
            listed,
            as_json,
            page_two,
            past_end,
            shown,
            bad_id,
            missing,
            bad_status,
            nobody,
        ) = await run_many(
            ["dlq", "list", CONSUMER],
            ["dlq", "list", CONSUMER, "--json"],
            ["dlq", "list", CONSUMER, "--page", "2", "--page-size", "2"],
            ["dlq", "list", CONSUMER, "--page", "9", "--page-size", "2"],
            ["dlq", "show", b.id],
            ["dlq", "retry", "1234"],
            ["dlq", "show", unknown],
            ["dlq", "list", CONSUMER, "--status", "gone"],
            ["dlq", "list", "nobody"],
            env=env,
        )
        assert_ok(listed)
        header = listed.stdout.splitlines()[0].split()
        assert header == ["ID", "SEQ", "ENTITY", "OP", "STATUS", "RETRIES", "PARKED_AT", "ERROR"]
        newest_first = sorted([a, b, c], key=lambda r: r.seq, reverse=True)
        assert [r[:2] for r in table_rows(listed.stdout)] == [
            [r.id, str(r.seq)] for r in newest_first
        ]
        for cells in table_rows(listed.stdout):
            assert cells[3:6] == ["upsert", "PENDING", "0/2"]
            assert cells[2].startswith("call_log/")
            assert cells[7] == "HTTP_422"
        assert listed.stdout.rstrip().endswith("page 1 of 1, 3 dead letter(s)")

        assert_ok(as_json)
        data = orjson.loads(as_json.stdout)
        assert [m["id"] for m in data["messages"]] == [r.id for r in newest_first]
        assert data["pagination"] == {
            "total_count": 3,
            "page": 1,
            "page_size": 20,
            "has_next": False,
        }

        assert_ok(page_two)
        assert [r[0] for r in table_rows(page_two.stdout)] == [newest_first[2].id]
        assert "page 2 of 2, 3 dead letter(s)" in page_two.stdout
        assert_ok(past_end)
        assert past_end.stdout == "page 9 is past the end: 3 dead letter(s), 2 page(s) of 2\n"

        assert_ok(shown)
        assert f"id:            {b.id}\n" in shown.stdout
        assert "status:        PENDING\n" in shown.stdout
        assert "retries:       0 of 2\n" in shown.stdout
        assert f"seq:           {b.seq}\n" in shown.stdout
        assert "error code:    HTTP_422\n" in shown.stdout
        assert f'"caller_number": "{bads[1]}"' in shown.stdout
        assert LEAKED not in shown.stdout

        assert_one_line_error(bad_id, 1, "not a message id (a uuid): '1234'")
        assert_one_line_error(missing, 1, f"no dead letter with id {unknown}")
        assert_one_line_error(bad_status, 1, "unknown status 'gone'")
        assert_ok(nobody)
        assert nobody.stdout == "no dead letters for nobody\n"

        # Retry: refused again (exit 1, one line, the message stays), then delivered.
        failed = await run_cli("dlq", "retry", a.id, env=env)
        assert_one_line_error(failed, 1, a.id, "delivery failed", "now PENDING", "1 of 2 retries")
        assert "POST http://sync:***@127.0.0.1:" in failed.stderr
        assert LEAKED not in failed.stderr
        assert URL_PASSWORD not in failed.stderr
        stored = (await parked_by_caller(backend_dsn))[bads[0]].error_message
        assert "sync:***@" in stored
        assert URL_PASSWORD not in stored
        receiver.refuse.discard(bads[0])
        delivered = await run_cli("dlq", "retry", a.id, env=env)
        assert_ok(delivered)
        assert delivered.stdout == f"{a.id}: delivered; RESOLVED\n"
        assert receiver.accepted_callers()[-1] == bads[0]
        after = (await parked_by_caller(backend_dsn))[bads[0]]
        assert (after.status, after.retry_count) == ("RESOLVED", 2)

        again, deleted, filtered = await run_many(
            ["dlq", "retry", a.id],
            ["dlq", "delete", c.id],
            ["dlq", "list", CONSUMER, "--status", "resolved"],
            env=env,
        )
        assert_one_line_error(again, 1, "RESOLVED", "only PENDING or RETRYING")
        assert_ok(deleted)
        assert deleted.stdout == f"deleted dead letter {c.id}\n"
        assert sorted(await parked_by_caller(backend_dsn)) == bads[:2]
        assert_ok(filtered)
        assert [r[0] for r in table_rows(filtered.stdout)] == [a.id]
        assert "1 dead letter(s) with status RESOLVED" in filtered.stdout
        gone = await run_cli("dlq", "delete", c.id, env=env)
        assert_one_line_error(gone, 1, f"no dead letter with id {c.id}")


async def test_cli_dlq_retry_all_reports_counts_and_exit_code(backend_dsn: str) -> None:
    async with leaky_receiver() as receiver:
        settings = make_settings(backend_dsn, receiver.url, SYNC_DLQ_MAX_RETRIES=MAX_RETRIES)
        _, bads = await park(backend_dsn, receiver, settings, good=1, bad=5)
        env = cli_env(DATABASE_URL=backend_dsn, FRONTEND_BASE_URL=receiver.url)
        receiver.refuse = {bads[0]}
        partly: CliResult = await run_cli("dlq", "retry-all", CONSUMER, env=env)
        assert partly.code == 1, partly
        assert partly.stdout == f"{CONSUMER}: retried 5: 4 succeeded, 1 failed\n"
        assert "Traceback" not in partly.stderr
        assert sorted(receiver.accepted_callers()) == sorted(["good-000", *bads[1:]])

        receiver.refuse.clear()
        rest = await run_cli("dlq", "retry-all", CONSUMER, env=env)
        assert_ok(rest)
        assert rest.stdout == f"{CONSUMER}: retried 1: 1 succeeded, 0 failed\n"
        nothing = await run_cli("dlq", "retry-all", CONSUMER, env=env)
        assert_ok(nothing)
        assert nothing.stdout == f"{CONSUMER}: retried 0: 0 succeeded, 0 failed\n"
        statuses = {r.status for r in (await parked_by_caller(backend_dsn)).values()}
        assert statuses == {"RESOLVED"}


async def test_cli_dlq_retry_of_an_unreachable_receiver_is_one_line(backend_dsn: str) -> None:
    async with leaky_receiver() as receiver:
        settings = make_settings(backend_dsn, receiver.url, SYNC_DLQ_MAX_RETRIES=MAX_RETRIES)
        _, bads = await park(backend_dsn, receiver, settings, good=0, bad=1)
    message_id = (await parked_by_caller(backend_dsn))[bads[0]].id
    dead_url = f"http://127.0.0.1:{free_port()}"
    env = cli_env(DATABASE_URL=backend_dsn, FRONTEND_BASE_URL=dead_url)
    result = await run_cli("dlq", "retry", message_id, env=env)
    assert_one_line_error(result, 1, "delivery failed", f"POST {dead_url}", "now PENDING")
    row = (await parked_by_caller(backend_dsn))[bads[0]]
    assert (row.status, row.retry_count, row.error_code) == ("PENDING", 1, "NETWORK_ERROR")
