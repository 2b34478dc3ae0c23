"""The failure policy, over real PostgreSQL and real HTTP on loopback: what is retried and how
(exponential backoff up to a cap, Retry-After), what is parked and how precisely (bisection finds
the refused entries), when the consumer gives up (SYNC_MAX_ATTEMPTS), that parking commits
together with the offset and only once, request signatures, and that secrets reach neither the
logs nor the dead-letter queue.

Delays are short (SYNC_RETRY_INITIAL_SEC=0.05, SYNC_RETRY_MAX_SEC=0.4); every wait is a
wait_until with a deadline."""

from __future__ import annotations

import asyncio
import decimal
import email.utils
import itertools
import json
import logging
import math
import signal
import time
from collections import Counter
from typing import Any

import aiohttp
import orjson
import psycopg
import pytest

from consumer.app.wiring import open_pool
from consumer.core.events import Position
from consumer.devtools.devdb import free_port
from consumer.observability.telemetry import JsonFormatter, TextFormatter
from consumer.sinks.frontend_sync import FrontendSyncSink
from consumer.store import admin
from consumer.store.outbox import OutboxStore
from consumer.wire import signing
from tests.conftest import cli_env, fetch_all, fetch_value, finish, start_cli
from tests.support.backend import (
    CONSUMER,
    RETRY_INITIAL_SEC,
    RETRY_MAX_SEC,
    committed_position,
    consuming,
    execute,
    insert_calls,
    last_error,
    seqs_by_caller,
)
from tests.support.dlq import dead_letters
from tests.support.leaks import SECRET_LINES, URL_PASSWORD, leaks
from tests.support.processes import reaped
from tests.support.receivers import (
    Attempt,
    Reply,
    post_signed,
    scripted_receiver,
    serve_reference_receiver,
    url_with_password,
    wire_body,
)
from tests.support.waiting import wait_caught_up, wait_until

SECRET = "s3cret-shared-by-both-sides-0123456789"  # noqa: S105 - a test secret
WRONG_SECRET = "not-the-receivers-secret-0123456789"  # noqa: S105 - a test secret


def with_credentials(url: str) -> str:
    """The URL with a user and password in it (FRONTEND_BASE_URL may carry them: basic auth)."""
    return url_with_password(url, URL_PASSWORD)


def refuse(status: int, message: str = "refused", **headers: str) -> Reply:
    """A refusal with status `status`, its message and headers."""
    return Reply(status, {"error": {"code": f"SCRIPTED_{status}", "message": message}}, headers)


def formatted_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Every captured record as the JSON formatter writes it."""
    formatter = JsonFormatter()
    return [formatter.format(record) for record in caplog.records]


# -- idempotency: a replayed batch changes nothing -------------------------------------------------


ENTITIES = (
    "SELECT entity_type, entity_id, seq, deleted, payload, applied_at "
    "FROM ingest.entities ORDER BY entity_type, entity_id"
)


async def test_the_same_events_delivered_ten_times_change_the_receiver_once(
    backend_dsn: str, receiver_dsn: str
) -> None:
    await insert_calls(backend_dsn, 3, tag="twice")
    async with serve_reference_receiver(receiver_dsn) as (url, store):
        async with consuming(backend_dsn, url):
            await wait_caught_up(backend_dsn)
        first = await fetch_all(receiver_dsn, ENTITIES)
        assert len(first) == 3
        # The exact batch the consumer sent, sent nine more times by the consumer's own sink
        # (what a replay after a crash before the commit does), some of them concurrently.
        async with open_pool(backend_dsn, "test-read") as pool:
            batch = (await OutboxStore(pool).read_batch(Position.start(), 100)).batch
        assert batch is not None
        assert batch.count == 3
        sink = FrontendSyncSink(url, timeout_sec=5)
        await sink.start()
        try:
            for _ in range(4):
                await sink.deliver(batch)
            await asyncio.gather(*(sink.deliver(batch) for _ in range(5)))
        finally:
            await sink.close()
    assert store.applied == [3] + [0] * 9, store.applied
    assert await fetch_all(receiver_dsn, ENTITIES) == first


# -- 5xx with backoff, then success ----------------------------------------------------------------


async def test_5xx_for_a_while_backs_off_exponentially_up_to_the_cap_then_delivers(
    backend_dsn: str,
) -> None:
    """Seven 503s, then success, with SYNC_MAX_ATTEMPTS=8: nothing is parked (the attempts did
    not run out), and the gaps between attempts double from 0.05 s up to the 0.4 s cap."""
    failures = 7
    await insert_calls(backend_dsn, 5, tag="flaky")

    def script(attempt: Attempt) -> Reply | None:
        return refuse(503, "busy") if attempt.index < failures else None

    async with (
        scripted_receiver(script) as rx,
        consuming(backend_dsn, rx.url, SYNC_MAX_ATTEMPTS=8) as runtime,
    ):
        await wait_caught_up(backend_dsn, timeout=15)
    assert runtime.stats.retries == failures
    assert runtime.stats.parked_events == 0
    assert rx.statuses == [503] * failures + [200]
    seqs = list((await seqs_by_caller(backend_dsn)).values())
    assert all(a.seqs == seqs for a in rx.attempts)
    assert rx.accepted == seqs
    assert await dead_letters(backend_dsn) == []

    gaps = rx.gaps()
    bases = [min(RETRY_MAX_SEC, RETRY_INITIAL_SEC * 2**i) for i in range(failures)]
    assert bases == [0.05, 0.1, 0.2, 0.4, 0.4, 0.4, 0.4]
    slack = 0.15  # one failed request, its record_error and the next request, on a busy machine
    for gap, base in zip(gaps, bases, strict=True):
        assert base * 0.9 - 0.01 <= gap <= base * 1.1 + slack, (gaps, bases)
    # Roughly exponential while under the cap: each gap about twice the one before.
    for before, after in itertools.pairwise(gaps[:4]):
        assert after >= 1.3 * before, gaps
    # The cap holds: no gap beyond 0.4 s + 10 % jitter.
    assert max(gaps) <= RETRY_MAX_SEC * 1.1 + slack, gaps


# -- a refused event is parked at once -------------------------------------------------------------


@pytest.mark.parametrize("status", [400, 410, 413, 415, 418, 422])
async def test_a_refused_event_is_parked_at_once_with_a_masked_message(
    backend_dsn: str, status: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="serversync")
    await insert_calls(backend_dsn, 1, tag="refused")
    echo = f"no: {SECRET_LINES['bearer']} {SECRET_LINES['github']}"
    async with (
        scripted_receiver(lambda _: refuse(status, echo)) as rx,
        consuming(backend_dsn, with_credentials(rx.url)) as runtime,
    ):
        await wait_caught_up(backend_dsn)
    assert runtime.stats.parked_events == 1
    assert runtime.stats.retries == 0
    assert rx.statuses == [status]  # one attempt: no retry of a refusal
    (seq,) = (await seqs_by_caller(backend_dsn)).values()
    (parked,) = await dead_letters(backend_dsn)
    assert (parked.seq, parked.caller, parked.error_code) == (seq, "refused-1", f"HTTP_{status}")
    assert (parked.status, parked.retry_count) == ("PENDING", 0)
    assert f"answered HTTP {status}" in parked.error_message
    assert "Bearer ***" in parked.error_message
    assert "http://sync:***@127.0.0.1:" in parked.error_message
    assert leaks(parked.error_message) == [], parked.error_message
    logs = formatted_logs(caplog)
    assert any("parking seq" in line for line in logs), logs
    assert [line for line in logs if leaks(line)] == []


# -- 409 "already processed" counts as delivered ---------------------------------------------------


async def test_409_already_processed_counts_as_delivered(backend_dsn: str) -> None:
    """The receiver applied the batch but its answer was a 503; the retry carries the same
    Idempotency-Key and is answered 409: delivered, nothing parked, the offset moves."""
    await insert_calls(backend_dsn, 3, tag="dup")

    def script(attempt: Attempt) -> Reply | None:
        return refuse(503, "lost answer") if attempt.index == 0 else refuse(409, "already done")

    async with (
        scripted_receiver(script) as rx,
        consuming(backend_dsn, rx.url) as runtime,
    ):
        await wait_caught_up(backend_dsn)
    assert runtime.stats.delivered_events == 3
    assert runtime.stats.parked_events == 0
    assert rx.statuses == [503, 409]
    keys = {a.headers["Idempotency-Key"] for a in rx.attempts}
    assert len(keys) == 1, keys
    assert await dead_letters(backend_dsn) == []


# -- Retry-After -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "form"), [(429, "seconds"), (429, "http-date"), (503, "seconds")]
)
async def test_retry_after_is_waited_for(backend_dsn: str, status: int, form: str) -> None:
    """Retry-After (1 s, or an HTTP date 1-2 s ahead) far exceeds the 0.05 s backoff: the next
    attempt comes no earlier than it says."""
    await insert_calls(backend_dsn, 2, tag="later")
    not_before: dict[str, float] = {}

    def script(attempt: Attempt) -> Reply | None:
        if attempt.index > 0:
            return None
        if form == "seconds":
            not_before["monotonic"] = attempt.arrived + 1.0
            return refuse(status, "slow down", **{"Retry-After": "1"})
        target = math.floor(attempt.wall) + 2
        not_before["wall"] = target
        return refuse(
            status, "slow down", **{"Retry-After": email.utils.formatdate(target, usegmt=True)}
        )

    async with scripted_receiver(script) as rx, consuming(backend_dsn, rx.url):
        await wait_caught_up(backend_dsn)
    assert rx.statuses == [status, 200]
    first, second = rx.attempts
    tolerance = 0.02  # timer granularity
    if form == "seconds":
        assert second.arrived >= not_before["monotonic"] - tolerance, rx.gaps()
    else:
        assert second.wall >= not_before["wall"] - tolerance, (first.wall, second.wall)
    # ... and not much later either: the hint, not the hint plus the backoff cap or more.
    assert second.arrived - first.arrived < 2.0 + RETRY_MAX_SEC, rx.gaps()
    assert await dead_letters(backend_dsn) == []


# -- poison entries: bisection parks only the refused ones -----------------------------------------


@pytest.mark.parametrize(
    "poison", [[37], [3, 77], [50, 51], [1, 100]], ids=["one", "two", "adjacent", "first-last"]
)
async def test_poison_entries_in_a_batch_of_100_are_parked_alone(
    backend_dsn: str, poison: list[int]
) -> None:
    await insert_calls(backend_dsn, 100, tag="c")
    by_caller = await seqs_by_caller(backend_dsn)
    bad = {f"c-{i}" for i in poison}

    def script(attempt: Attempt) -> Reply | None:
        if bad & set(attempt.callers):
            return refuse(422, "entries: caller_number refused")
        return None

    async with (
        scripted_receiver(script) as rx,
        consuming(backend_dsn, rx.url) as runtime,
    ):
        await wait_caught_up(backend_dsn)
    assert runtime.stats.parked_events == len(poison)
    assert runtime.stats.delivered_events == 100 - len(poison)
    assert len(rx.attempts[0].seqs) == 100  # one batch of 100
    parked = await dead_letters(backend_dsn)
    assert [p.caller for p in parked] == [f"c-{i}" for i in poison]
    assert [p.seq for p in parked] == [by_caller[f"c-{i}"] for i in poison]
    assert {p.error_code for p in parked} == {"HTTP_422"}
    good = sorted(seq for caller, seq in by_caller.items() if caller not in bad)
    assert len(good) == 100 - len(poison)
    assert sorted(rx.accepted) == good  # every other entry delivered, exactly once
    # Halving finds each poison entry in at most 2 requests per level (7 levels for 100).
    assert len(rx.attempts) <= 1 + 2 * 7 * len(poison), len(rx.attempts)


# -- the receiver down: retried, parked only when the attempts run out -----------------------------


BACKLOG = (
    "SELECT count(*) FROM sync.events_outbox o JOIN sync.consumer_offsets c "
    "ON c.consumer = %s WHERE (o.txid, o.seq) > (c.last_txid, c.last_seq)"
)


async def test_receiver_down_the_backlog_grows_and_max_attempts_0_never_gives_up(
    backend_dsn: str,
) -> None:
    """Nothing listens on the receiver's port (connection refused) for well over the default 8
    attempts: with SYNC_MAX_ATTEMPTS=0 nothing is parked and the offset stays; the backlog grows;
    once the receiver is up, everything is delivered, once."""
    port = free_port()
    await insert_calls(backend_dsn, 5, tag="early")
    async with consuming(
        backend_dsn,
        with_credentials(f"http://127.0.0.1:{port}"),
        SYNC_MAX_ATTEMPTS=0,
        SYNC_RETRY_MAX_SEC=0.1,
    ) as runtime:
        await wait_until(lambda: runtime.stats.failed_deliveries >= 3, what="failed attempts")
        assert await fetch_value(backend_dsn, BACKLOG, (CONSUMER,)) == 5
        await insert_calls(backend_dsn, 7, tag="late")
        await wait_until(
            lambda: runtime.stats.failed_deliveries >= 14, timeout=15, what="14 failed attempts"
        )
        assert await fetch_value(backend_dsn, BACKLOG, (CONSUMER,)) == 12
        assert await committed_position(backend_dsn) == (0, 0)
        assert await dead_letters(backend_dsn) == []
        assert runtime.stats.parked_events == 0
        error = await last_error(backend_dsn)
        assert error is not None
        assert f"sync:***@127.0.0.1:{port}" in error
        assert leaks(error) == [], error
        async with scripted_receiver(port=port) as rx:
            await wait_caught_up(backend_dsn)
    assert await dead_letters(backend_dsn) == []
    assert sorted(rx.accepted) == sorted((await seqs_by_caller(backend_dsn)).values())
    assert len(rx.accepted) == 12  # no duplicates
    assert set(rx.statuses) == {200}


async def test_max_attempts_3_parks_the_batch_after_exactly_3_attempts_and_moves_on(
    backend_dsn: str,
) -> None:
    await insert_calls(backend_dsn, 5, tag="lost")
    state = {"down": True}
    # The 503 body echoes a secret: it must not reach last_error or the DLQ.
    echo = f"upstream {SECRET_LINES['url']} is down"

    def script(attempt: Attempt) -> Reply | None:
        return refuse(503, echo) if state["down"] else None

    async with (
        scripted_receiver(script) as rx,
        # Longer delays here: last_error is only set between attempts (the commit that parks
        # the batch clears it), and the test reads it there.
        consuming(
            backend_dsn,
            rx.url,
            SYNC_MAX_ATTEMPTS=3,
            SYNC_RETRY_INITIAL_SEC=0.3,
            SYNC_RETRY_MAX_SEC=0.6,
        ) as runtime,
    ):
        seen: list[str] = []

        async def recorded() -> bool:
            error = await last_error(backend_dsn)
            seen.extend([error] if error is not None else [])
            return bool(seen)

        await wait_until(recorded, what="the first failure to be recorded")
        error = seen[0]
        assert "HTTP 503" in error
        assert leaks(error) == [], error
        await wait_caught_up(backend_dsn)
        assert rx.statuses == [503, 503, 503]
        state["down"] = False
        await insert_calls(backend_dsn, 4, tag="next")
        await wait_caught_up(backend_dsn)
    assert runtime.stats.parked_events == 5
    by_caller = await seqs_by_caller(backend_dsn)
    lost = [by_caller[f"lost-{i}"] for i in range(1, 6)]
    later = [by_caller[f"next-{i}"] for i in range(1, 5)]
    assert rx.statuses == [503, 503, 503, 200]
    assert [a.seqs for a in rx.attempts] == [lost, lost, lost, later]
    assert rx.accepted == later
    parked = await dead_letters(backend_dsn)
    assert [p.seq for p in parked] == lost
    assert {p.error_code for p in parked} == {"HTTP_503"}
    assert all(leaks(p.error_message) == [] for p in parked), parked[0].error_message


# -- parking commits with the offset, and only once ------------------------------------------------


FAIL_PARKING = """
CREATE SEQUENCE test_parking_failures;
CREATE FUNCTION test_fail_parking() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM nextval('test_parking_failures');
    RAISE EXCEPTION 'injected: the parking insert fails' USING ERRCODE = '08006';
END $$;
CREATE TRIGGER test_fail_parking BEFORE INSERT ON sync.dlq_messages
FOR EACH ROW EXECUTE FUNCTION test_fail_parking();
"""
PARKING_FAILURES = (
    "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM test_parking_failures"
)


async def reset_to_earliest(dsn: str) -> None:
    """What `serversync offsets reset frontend-sync --to-earliest` does."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn, admin.holding_consumer_lock(conn, CONSUMER):
        plan = await admin.plan_reset(conn, CONSUMER, to_earliest=True)
        await admin.apply_reset(conn, plan)
    assert await committed_position(dsn) == (0, 0)


async def test_parking_commits_with_the_offset_and_a_replay_parks_only_once(
    backend_dsn: str,
) -> None:
    await insert_calls(backend_dsn, 10, tag="p")
    by_caller = await seqs_by_caller(backend_dsn)
    poison = by_caller["p-4"]
    good = sorted(seq for seq in by_caller.values() if seq != poison)

    def script(attempt: Attempt) -> Reply | None:
        return refuse(422, "p-4 refused") if poison in attempt.seqs else None

    async with scripted_receiver(script) as rx:
        # 1. The parking insert fails (a database error, retried): neither the DLQ row nor the
        #    offset may be written. The consumer then stops before the commit succeeds (as far
        #    as the database is concerned, a crash between delivery and commit).
        await execute(backend_dsn, FAIL_PARKING)
        async with consuming(backend_dsn, rx.url) as runtime:
            await wait_until(
                lambda: fetch_value(backend_dsn, PARKING_FAILURES),
                what="the parking insert to fail",
            )
            await wait_until(
                lambda: fetch_value(backend_dsn, f"SELECT ({PARKING_FAILURES}) >= 2"),
                what="the commit to be retried",
            )
            assert await committed_position(backend_dsn) == (0, 0)
            assert await dead_letters(backend_dsn) == []
        assert runtime.stats.parked_events == 0
        assert await committed_position(backend_dsn) == (0, 0)
        assert await dead_letters(backend_dsn) == []
        assert sorted(rx.accepted) == good

        # 2. The next consumer delivers the batch again and parks the poison entry.
        await execute(backend_dsn, "DROP TRIGGER test_fail_parking ON sync.dlq_messages")
        async with consuming(backend_dsn, rx.url) as runtime:
            await wait_caught_up(backend_dsn)
        assert runtime.stats.parked_events == 1
        first = await dead_letters(backend_dsn)
        assert [(p.seq, p.error_code) for p in first] == [(poison, "HTTP_422")]

        # 3. A replay from the earliest offset parks it again: the DLQ keeps the first one.
        await reset_to_earliest(backend_dsn)
        async with consuming(backend_dsn, rx.url) as runtime:
            await wait_caught_up(backend_dsn)
        assert runtime.stats.parked_events == 1
        assert await dead_letters(backend_dsn) == first
    assert Counter(rx.accepted) == Counter({seq: 3 for seq in good})
    assert poison not in rx.accepted


# -- request signatures ----------------------------------------------------------------------------


async def test_a_correctly_signed_request_is_applied(receiver_dsn: str) -> None:
    now = time.time()
    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=SECRET) as (url, store),
        aiohttp.ClientSession() as session,
    ):
        for name, at in [("now", now), ("290s-ago", now - 290), ("290s-ahead", now + 290)]:
            body = wire_body(name)
            status, _, answer = await post_signed(
                session, url, body, signing.sign(SECRET, body, now=at)
            )
            assert (status, answer["applied"]) == (200, 1), (name, answer)
    assert store.applied == [1, 1, 1]
    rows = await fetch_all(receiver_dsn, "SELECT entity_id FROM ingest.entities ORDER BY 1")
    assert [r[0] for r in rows] == ["290s-ago", "290s-ahead", "now"]


def _badly_signed(case: str, body: bytes) -> tuple[bytes, dict[str, str]]:
    """(body sent, headers) of one kind of bad request."""
    now = time.time()
    good = signing.sign(SECRET, body)
    ts, sig = signing.TIMESTAMP_HEADER, signing.SIGNATURE_HEADER
    if case == "no-headers":
        return body, {}
    if case == "no-signature":
        return body, {ts: good[ts]}
    if case == "no-timestamp":
        return body, {sig: good[sig]}
    if case == "wrong-secret":
        return body, signing.sign("another-secret-of-32-characters-or-more", body)
    if case == "tampered-signature":
        flipped = good[sig][:-1] + ("0" if good[sig][-1] != "0" else "1")
        return body, {ts: good[ts], sig: flipped}
    if case == "bare-hex":
        return body, {ts: good[ts], sig: good[sig].removeprefix("v1=")}
    if case == "timestamp-not-a-number":
        return body, {ts: "soon", sig: signing.signature(SECRET, "soon", body)}
    if case == "stale":
        return body, signing.sign(SECRET, body, now=now - signing.MAX_SKEW_SEC - 5)
    if case == "future":
        # Well past the limit: the signed timestamp is truncated to whole seconds, so +301 could
        # arrive as 300 s ahead and be accepted.
        return body, signing.sign(SECRET, body, now=now + signing.MAX_SKEW_SEC + 5)
    if case == "replayed-with-another-body":
        other = wire_body("forged", seq=99)
        return other, good
    raise AssertionError(case)


@pytest.mark.parametrize(
    "case",
    [
        "no-headers",
        "no-signature",
        "no-timestamp",
        "wrong-secret",
        "tampered-signature",
        "bare-hex",
        "timestamp-not-a-number",
        "stale",
        "future",
        "replayed-with-another-body",
    ],
)
async def test_a_badly_signed_request_is_refused_with_401_and_writes_nothing(
    receiver_dsn: str, case: str
) -> None:
    body, headers = _badly_signed(case, wire_body("signed"))
    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=SECRET) as (url, store),
        aiohttp.ClientSession() as session,
    ):
        status, content_type, answer = await post_signed(session, url, body, headers)
        assert (status, content_type) == (401, "application/json"), answer
        assert answer["error"]["code"] == "INGEST_UNAUTHORIZED"
        assert answer["error"]["message"]
        # The receiver's other routes need no signature.
        async with session.get(url + "/healthz") as health:
            assert health.status == 200
    assert store.applied == []
    assert await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.entities") == 0


async def test_a_consumer_with_the_shared_secret_delivers_end_to_end(
    backend_dsn: str, receiver_dsn: str
) -> None:
    await insert_calls(backend_dsn, 20, tag="signed")
    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=SECRET) as (url, store),
        consuming(backend_dsn, url, SYNC_SHARED_SECRET=SECRET) as runtime,
    ):
        await wait_caught_up(backend_dsn)
    assert runtime.stats.failed_deliveries == 0
    assert sum(store.applied) == 20
    assert await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.entities") == 20
    assert await dead_letters(backend_dsn) == []


async def test_a_wrong_secret_holds_the_offset_parks_nothing_and_delivers_once_fixed(
    backend_dsn: str, receiver_dsn: str
) -> None:
    """A wrong or rotated secret means the destination is wrong, not the data: the reference
    receiver's 401s hold the offset and are retried (never bisected, never parked), and once
    the receiver takes the consumer's secret every event arrives."""
    events = 4
    await insert_calls(backend_dsn, events, tag="badsig")
    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=SECRET) as (url, store),
        consuming(backend_dsn, url, SYNC_SHARED_SECRET=WRONG_SECRET) as runtime,
    ):
        await wait_until(
            lambda: runtime.stats.failed_deliveries >= 3, what="three refused attempts"
        )
        assert await committed_position(backend_dsn) == (0, 0)
        assert runtime.stats.failing_reason == "wrong_destination"
        assert runtime.stats.parked_events == 0
        assert store.applied == []
    assert await dead_letters(backend_dsn) == []
    # The receiver is given the consumer's secret (a rotation finished on its side).
    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=WRONG_SECRET) as (url, store),
        consuming(backend_dsn, url, SYNC_SHARED_SECRET=WRONG_SECRET) as runtime,
    ):
        await wait_caught_up(backend_dsn)
    assert runtime.stats.failing_since is None
    assert sum(store.applied) == events
    assert await dead_letters(backend_dsn) == []


# -- `serversync ingest-server` and its secret -----------------------------------------------------


async def test_ingest_server_refuses_to_start_without_a_shared_secret(receiver_dsn: str) -> None:
    port = free_port()
    env = cli_env(FRONTEND_DATABASE_URL=receiver_dsn, INGEST_PORT=str(port))
    result = await finish(await start_cli("ingest-server", env=env), timeout=30)
    code, out, err = result.code, result.stdout, result.stderr
    assert code == 1, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("serversync: SYNC_SHARED_SECRET is not set"), lines[0]
    assert "--insecure" in lines[0]
    assert out == ""


async def _healthy(
    process: asyncio.subprocess.Process, session: aiohttp.ClientSession, url: str
) -> bool:
    """GET /healthz answers 200; fails at once if the process has exited."""
    if process.returncode is not None:
        err = (await finish(process, timeout=5)).stderr
        raise AssertionError(f"ingest-server exited with {process.returncode}: {err}")
    try:
        async with session.get(url + "/healthz") as response:
            return response.status == 200
    except aiohttp.ClientConnectionError:
        return False


@pytest.mark.parametrize("mode", ["insecure", "secret"])
async def test_ingest_server_starts_serves_and_stops_on_sigterm(
    receiver_dsn: str, mode: str
) -> None:
    """--insecure: it starts without a secret and accepts unsigned requests. With
    SYNC_SHARED_SECRET: it refuses unsigned requests and accepts signed ones."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    variables = {"FRONTEND_DATABASE_URL": receiver_dsn, "INGEST_PORT": str(port)}
    args = ["ingest-server"]
    if mode == "insecure":
        args.append("--insecure")
    else:
        variables["SYNC_SHARED_SECRET"] = SECRET
    process = await start_cli(*args, env=cli_env(**variables))
    async with reaped(process), aiohttp.ClientSession() as session:
        await wait_until(
            lambda: _healthy(process, session, url), timeout=30, what="the ingest-server to start"
        )
        unsigned = wire_body("cli-unsigned")
        status, _, _ = await post_signed(session, url, unsigned, {})
        assert status == (200 if mode == "insecure" else 401)
        if mode == "secret":
            signed = wire_body("cli-signed")
            status, _, _ = await post_signed(session, url, signed, signing.sign(SECRET, signed))
            assert status == 200
        process.send_signal(signal.SIGTERM)
        stopped = await finish(process, timeout=15)
    code, err = stopped.code, stopped.stderr
    assert code == 0, err
    assert "Traceback" not in err
    rows = await fetch_all(receiver_dsn, "SELECT entity_id FROM ingest.entities")
    assert [r[0] for r in rows] == (["cli-unsigned"] if mode == "insecure" else ["cli-signed"])


# -- secrets never reach the logs or the DLQ -------------------------------------------------------


def _record(message: str, *args: object, exc: BaseException | None = None) -> logging.LogRecord:
    exc_info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logging.LogRecord(
        "serversync.test", logging.WARNING, __file__, 1, message, args, exc_info
    )


@pytest.mark.parametrize("kind", sorted(SECRET_LINES))
def test_a_log_line_with_a_secret_comes_out_masked(kind: str) -> None:
    line = SECRET_LINES[kind]
    assert leaks(line), "the fixture must hold a secret"
    try:
        raise RuntimeError(f"connecting with {line}")
    except RuntimeError as exc:
        record = _record("delivery failed: %s", line, exc=exc)
    output = JsonFormatter().format(record)
    assert "\n" not in output  # one JSON object per line
    entry = orjson.loads(output)
    assert leaks(entry["msg"]) == [], entry["msg"]
    assert leaks(entry["exc"]) == [], entry["exc"]
    assert "***" in entry["msg"] or "REDACTED" in entry["msg"], entry["msg"]
    assert entry["level"] == "warning"
    assert leaks(output) == []
    text = TextFormatter().format(record)
    assert leaks(text) == [], text


def test_a_log_line_with_every_secret_at_once_comes_out_masked() -> None:
    record = _record("\n".join(SECRET_LINES.values()))
    entry = orjson.loads(JsonFormatter().format(record))
    assert leaks(entry["msg"]) == [], entry["msg"]
    assert "svc-user:***@api.example.com" in entry["msg"]
    assert "password=***" in entry["msg"]
    assert "Bearer ***" in entry["msg"]


def test_extra_fields_of_a_log_line_are_masked() -> None:
    record = _record("connecting")
    record.dsn = SECRET_LINES["url"]
    assert leaks(JsonFormatter().format(record)) == []


# The secret part of each line, whose first characters the "cut" variants put just before the
# 300-character limit of the receiver's answer kept in the error message.
SECRET_STARTS = {
    "bearer": "Bearer ",
    "url": "svc-user:",
    "dsn": "password=",
    "api_key": "api_key=",
    "github": "ghp_",
    "aws": "AKIA",
    "anthropic": "sk-ant-",
    "private_key": "MIIE",
}
BODY_LIMIT = 300  # consumer/sinks/http.py keeps this much of an error answer


def _echo(kind: str, cut: bool) -> bytes:
    """A plain-text answer echoing one secret: whole, or with the secret straddling the limit."""
    line = " ".join(SECRET_LINES[kind].split())
    if not cut:
        return f"refused: {line}".encode()
    start = line.index(SECRET_STARTS[kind]) + len(SECRET_STARTS[kind])
    pad = BODY_LIMIT - 12 - start - 1  # 12 characters of the secret itself stay in
    return ("E" * pad + " " + line).encode()


async def test_a_receiver_answer_echoing_secrets_is_masked_in_the_dlq_and_the_logs(
    backend_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="serversync")
    kinds = sorted(SECRET_LINES)
    cases = [(kind, cut) for kind in kinds for cut in (False, True)]
    await insert_calls(backend_dsn, len(cases), tag="s")

    def script(attempt: Attempt) -> Reply:
        if len(attempt.callers) == 1:
            kind, cut = cases[int(attempt.callers[0].removeprefix("s-")) - 1]
            return Reply(422, _echo(kind, cut))
        return refuse(422, "a batch")

    async with scripted_receiver(script) as rx, consuming(backend_dsn, rx.url):
        await wait_caught_up(backend_dsn)
    assert rx.accepted == []
    parked = await dead_letters(backend_dsn)
    assert len(parked) == len(cases)
    for p in parked:
        kind, cut = cases[int(str(p.caller).removeprefix("s-")) - 1]
        assert p.error_code == "HTTP_422"
        assert leaks(p.error_message) == [], (kind, cut, p.error_message)
    logs = formatted_logs(caplog)
    assert sum("parking seq" in line for line in logs) == len(cases)
    assert [line for line in logs if leaks(line)] == []


# -- what bisection sends is what the outbox holds -------------------------------------------------


def exact(text: str | bytes) -> Any:
    """JSON parsed without rounding a number (integers exact, decimals as Decimal)."""
    return json.loads(text, parse_float=decimal.Decimal)


async def test_bisected_requests_and_parked_events_keep_payloads_exact(backend_dsn: str) -> None:
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        for i in range(1, 5):
            await conn.execute(
                "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload) "
                "VALUES ('upsert', 'ledger', %s, %s::jsonb)",
                (
                    f"n-{i}",
                    f'{{"caller_number": "n-{i}", "amount": 123456789012345678901234567890, '
                    '"rate": 0.1000000000000000000000000000001}',
                ),
            )
    rows = await fetch_all(
        backend_dsn, "SELECT payload->>'caller_number', payload::text FROM sync.events_outbox"
    )
    outbox = {caller: exact(payload) for caller, payload in rows}

    def script(attempt: Attempt) -> Reply | None:
        return refuse(422, "n-2 refused") if "n-2" in attempt.callers else None

    async with scripted_receiver(script) as rx, consuming(backend_dsn, rx.url):
        await wait_caught_up(backend_dsn)
    assert len(rx.attempts) > 1  # bisected
    delivered = {}
    for attempt in rx.attempts:
        if attempt.status == 200:
            for entry in exact(attempt.body)["entries"]:
                delivered[entry["payload"]["caller_number"]] = entry["payload"]
    assert delivered == {c: p for c, p in outbox.items() if c != "n-2"}
    parked = await fetch_all(
        backend_dsn, "SELECT payload->>'caller_number', payload::text FROM sync.dlq_messages"
    )
    assert {caller: exact(payload) for caller, payload in parked} == {"n-2": outbox["n-2"]}
