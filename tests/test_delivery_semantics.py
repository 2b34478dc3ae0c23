"""What each answer of a receiver does to an ordered stream, over real PostgreSQL and real HTTP on
loopback: passing trouble and a wrong destination hold the offset and are retried for as long as
they last (nothing parked, nothing skipped), redirects are never followed, Retry-After is the
receiver's word, and an error of the consumer's own on one batch never crashes the process.

The end-to-end fault drill runs `serversync run` as a real process through an outage, a wrong
secret and a redirect, and checks what an operator sees meanwhile (/readyz, `serversync status`,
/metrics)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from consumer.core.events import Batch, Failure, Outcome
from consumer.devtools.devdb import free_port
from consumer.runtime.backoff import (
    RETRY_AFTER_CEILING_SEC,
    RETRY_AFTER_FLOOR_SEC,
    Backoff,
    retry_delay,
)
from consumer.sinks.http import failure_of
from tests.conftest import (
    cli_env,
    fetch_all,
    fetch_value,
    finish,
    make_settings,
    running_consumer,
    start_cli,
)
from tests.support.backend import committed_position, consuming, execute, insert_calls
from tests.support.dlq import dead_letters
from tests.support.processes import Processes
from tests.support.receivers import (
    INGEST_PATH,
    Attempt,
    Reply,
    Script,
    scripted_receiver,
    serve_reference_receiver,
)
from tests.support.waiting import caught_up, wait_until

SECRET = "the-secret-both-sides-share-0123"  # noqa: S105 - a test secret
OTHER_SECRET = "a-secret-the-consumer-does-not-hold"  # noqa: S105 - a test secret
# Retries faster than the other tests': an outage here lasts 30 attempts. SYNC_MAX_ATTEMPTS is
# left at its default (never give up).
FAST_RETRIES = {"SYNC_RETRY_INITIAL_SEC": 0.02, "SYNC_RETRY_MAX_SEC": 0.1}


# -- the classification, as a pure policy ---------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "failure"),
    [
        (200, None),
        (204, None),
        (409, None),
        (500, Failure.UNAVAILABLE),
        (502, Failure.UNAVAILABLE),
        (503, Failure.UNAVAILABLE),
        (408, Failure.UNAVAILABLE),
        (425, Failure.UNAVAILABLE),
        (429, Failure.UNAVAILABLE),
        (301, Failure.WRONG_DESTINATION),
        (302, Failure.WRONG_DESTINATION),
        (307, Failure.WRONG_DESTINATION),
        (308, Failure.WRONG_DESTINATION),
        (401, Failure.WRONG_DESTINATION),
        (403, Failure.WRONG_DESTINATION),
        (404, Failure.WRONG_DESTINATION),
        (405, Failure.WRONG_DESTINATION),
        (400, Failure.REFUSED),
        (410, Failure.REFUSED),
        (413, Failure.REFUSED),
        (415, Failure.REFUSED),
        (422, Failure.REFUSED),
        (451, Failure.REFUSED),
    ],
)
def test_each_status_means_one_kind_of_failure(status: int, failure: Failure | None) -> None:
    assert failure_of(status) == failure
    # Only a refusal of the content parks events.
    assert (failure is not None and failure.parks) == (failure is Failure.REFUSED)


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [(1.0, 1.0), (0.0, RETRY_AFTER_FLOOR_SEC), (86400.0, RETRY_AFTER_CEILING_SEC), (30.0, 30.0)],
)
def test_retry_after_replaces_the_backoff_within_its_bounds(
    retry_after: float, expected: float
) -> None:
    backoff = Backoff(200.0, 400.0)
    assert retry_delay(backoff, retry_after) == expected
    # Without one, the backoff decides (its second delay here: 400 s, +-10 %).
    assert 360 <= retry_delay(backoff, None) <= 440


# -- in-process consumers against scripted receivers ----------------------------------------------


def answers(status: int, count: int, **headers: str) -> Script:
    """A script: the first `count` requests get `status`, the rest are accepted."""

    def script(attempt: Attempt) -> Reply | None:
        if attempt.index < count:
            return Reply(status, {"error": {"code": f"SCRIPTED_{status}"}}, headers)
        return None

    return script


async def test_an_outage_longer_than_the_old_attempt_limit_parks_nothing(backend_dsn: str) -> None:
    """30 failed attempts in a row (at the default 2 s .. 256 s backoff, over an hour of
    outage): with the default SYNC_MAX_ATTEMPTS the batch is retried whole every time, the
    offset never moves meanwhile, and it is delivered once the receiver is back."""
    await insert_calls(backend_dsn, 5, tag="outage")
    async with (
        scripted_receiver(answers(503, 30)) as rx,
        consuming(backend_dsn, rx.url, **FAST_RETRIES) as runtime,
    ):
        await wait_until(lambda: len(rx.attempts) >= 10, what="ten attempts")
        assert await committed_position(backend_dsn) == (0, 0)
        health = runtime.delivery_health()
        assert health["state"] == "delivery_failing"
        assert health["reason"] == "receiver_unavailable"
        assert "HTTP 503" in health["last_error"]
        row = (
            await fetch_all(
                backend_dsn,
                "SELECT failing_since IS NOT NULL, failing_reason FROM sync.consumer_offsets",
            )
        )[0]
        assert row == (True, "receiver_unavailable")
        await wait_until(lambda: caught_up(backend_dsn), what="delivery after the outage")
        assert runtime.delivery_health() == {"state": "ok"}
    assert len(rx.attempts) == 31
    assert all(a.seqs == rx.attempts[0].seqs for a in rx.attempts), "the batch was split"
    assert await dead_letters(backend_dsn) == []
    assert await fetch_value(
        backend_dsn,
        "SELECT failing_since IS NULL AND last_error IS NULL FROM sync.consumer_offsets",
    )


@pytest.mark.parametrize("status", [401, 403, 404, 405, 301, 302, 307, 308])
async def test_a_wrong_destination_holds_the_offset_and_is_never_bisected(
    backend_dsn: str, status: int
) -> None:
    """Answers that say the destination is wrong (a secret, a clock, a route, a moved URL)
    hold the whole batch: no split, nothing parked, retried until the receiver is right."""
    await insert_calls(backend_dsn, 6, tag="wrongdest")
    location = {"Location": "/somewhere-else"} if status < 400 else {}
    async with (
        scripted_receiver(answers(status, 5, **location)) as rx,
        consuming(backend_dsn, rx.url, **FAST_RETRIES) as runtime,
    ):
        await wait_until(lambda: len(rx.attempts) >= 3, what="three attempts")
        assert runtime.delivery_health()["reason"] == "wrong_destination"
        assert await committed_position(backend_dsn) == (0, 0)
        await wait_until(lambda: caught_up(backend_dsn), what="delivery once it is right")
    assert rx.statuses == [status] * 5 + [200]
    assert all(len(a.seqs) == 6 for a in rx.attempts), "the batch was split"
    assert runtime.stats.parked_events == 0
    assert await dead_letters(backend_dsn) == []


@pytest.mark.parametrize(
    "body",
    [b"<html><body>Welcome</body></html>", b"", b"[1, 2]", b'{"ok": false}', b"{" * 70_000],
    ids=["html", "empty", "array", "not-ok", "huge"],
)
async def test_a_2xx_that_is_not_the_receivers_answer_delivers_nothing(
    backend_dsn: str, body: bytes
) -> None:
    """A proxy's or a login page's 200 is not the receiver saying it applied the batch."""
    await insert_calls(backend_dsn, 3, tag="page")

    def script(attempt: Attempt) -> Reply | None:
        return Reply(200, body) if attempt.index < 2 else None

    async with (
        scripted_receiver(script) as rx,
        consuming(backend_dsn, rx.url, **FAST_RETRIES) as runtime,
    ):
        await wait_until(lambda: len(rx.attempts) >= 2, what="two attempts")
        assert runtime.stats.delivered_events == 0
        await wait_until(lambda: caught_up(backend_dsn), what="delivery to the real receiver")
    assert runtime.stats.failed_deliveries == 2
    assert runtime.stats.parked_events == 0
    assert await dead_letters(backend_dsn) == []


async def test_a_redirect_is_not_followed_and_delivers_nothing(
    backend_dsn: str, receiver_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A 301 to a page that answers 200: aiohttp would follow it as a GET, and the consumer
    logged the batch delivered while nothing arrived. Now nothing goes to the redirect's target
    (neither the events nor the signature), and the offset stays."""
    caplog.set_level("INFO", logger="serversync")
    await insert_calls(backend_dsn, 4, tag="moved")
    moved = Reply(301, b"", {"Location": "/welcome"})
    async with (
        scripted_receiver(lambda _: moved) as rx,
        consuming(backend_dsn, rx.url, SYNC_SHARED_SECRET=SECRET, **FAST_RETRIES) as runtime,
    ):
        await wait_until(lambda: runtime.stats.failed_deliveries >= 3, what="three attempts")
        assert runtime.delivery_health()["reason"] == "wrong_destination"
    assert rx.pages == []
    assert set(rx.statuses) == {301}
    assert runtime.stats.delivered_events == 0
    assert await committed_position(backend_dsn) == (0, 0)
    assert await dead_letters(backend_dsn) == []
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "delivered 4 events" not in logged
    assert "answered HTTP 301 to /welcome" in logged


async def test_retry_after_is_taken_instead_of_a_longer_backoff(backend_dsn: str) -> None:
    """A receiver that says "1 s" is tried again after 1 s, not after the backoff's 5 s."""
    await insert_calls(backend_dsn, 1, tag="busy")
    async with scripted_receiver(answers(429, 1, **{"Retry-After": "1"})) as rx:
        settings = make_settings(
            backend_dsn, rx.url, SYNC_RETRY_INITIAL_SEC=5, SYNC_RETRY_MAX_SEC=10
        )
        async with running_consumer(settings):
            await wait_until(lambda: caught_up(backend_dsn), timeout=10, what="the retry")
    first, second = rx.attempts
    assert 0.95 <= second.arrived - first.arrived < 3.0, rx.gaps()


# -- an error of the consumer's own ---------------------------------------------------------------


class FlakySink:
    """Wraps a sink; its first `failures` deliveries raise an error no sink is meant to raise."""

    def __init__(self, inner: Any, failures: int) -> None:
        self.inner = inner
        self.name = inner.name
        self.failures = failures

    async def start(self) -> None:
        await self.inner.start()

    async def close(self) -> None:
        await self.inner.close()

    async def deliver(self, batch: Batch) -> Outcome:
        if self.failures > 0:
            self.failures -= 1
            raise KeyError("a value the sink did not expect\n\x00")
        result: Outcome = await self.inner.deliver(batch)
        return result


async def test_an_unexpected_error_on_one_batch_is_retried_not_a_crash(
    backend_dsn: str, receiver_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    settings = make_settings(backend_dsn, receiver_url)
    async with running_consumer(settings) as runtime:
        runtime.sink = FlakySink(runtime.sink, failures=3)
        # Written after the sink is in place: the consumer is woken by this commit.
        await insert_calls(backend_dsn, 3, tag="flaky")
        await wait_until(lambda: caught_up(backend_dsn), what="delivery after the errors")
    assert runtime.stats.failed_deliveries == 3
    assert runtime.stats.parked_events == 0
    assert await dead_letters(backend_dsn) == []
    errors = [r for r in caplog.records if r.levelname == "ERROR" and "KeyError" in r.getMessage()]
    # Loud: every failure is logged, the traceback once per streak.
    assert len(errors) == 3
    assert sum(1 for r in errors if r.exc_info) == 1


async def test_a_database_refusing_the_commit_is_retried_not_a_crash(
    backend_dsn: str, receiver_url: str
) -> None:
    """An offset commit the database refuses (here a trigger raising) does not end the
    process: the step is retried with backoff until the database takes it."""
    await execute(
        backend_dsn,
        """
        CREATE TABLE public.refuse_commits (refuse boolean NOT NULL);
        INSERT INTO public.refuse_commits VALUES (true);
        CREATE FUNCTION public.refuse_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF NEW.last_seq <> OLD.last_seq AND (SELECT refuse FROM public.refuse_commits) THEN
                RAISE EXCEPTION 'refused by a test trigger';
            END IF;
            RETURN NEW;
        END $$;
        CREATE TRIGGER refuse_commit BEFORE UPDATE ON sync.consumer_offsets
        FOR EACH ROW EXECUTE FUNCTION public.refuse_commit();
        """,
    )
    await insert_calls(backend_dsn, 2, tag="refusedcommit")
    async with running_consumer(make_settings(backend_dsn, receiver_url)) as runtime:
        await wait_until(
            lambda: runtime.stats.failing_reason == Failure.INTERNAL, what="a refused commit"
        )
        assert await committed_position(backend_dsn) == (0, 0)
        assert "refused by a test trigger" in (runtime.stats.last_error or "")
        await execute(backend_dsn, "UPDATE public.refuse_commits SET refuse = false")
        await wait_until(lambda: caught_up(backend_dsn), what="the commit once allowed")
        assert runtime.stats.failing_since is None


# -- settings -------------------------------------------------------------------------------------


@pytest.mark.parametrize("consumer", ["frontend-sync", "recording-upload"])
async def test_a_consumer_without_frontend_base_url_refuses_to_start(
    backend_dsn: str, consumer: str
) -> None:
    env = cli_env(DATABASE_URL=backend_dsn)
    env.pop("FRONTEND_BASE_URL", None)
    result = await finish(await start_cli("run", consumer, env=env))
    assert result.code == 2, result
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "FRONTEND_BASE_URL is not set" in result.stderr


# -- the fault drill: a real process through an outage, a wrong secret and a redirect -------------


class Front:
    """The frontend's answers once something listens at its address again, played phase by
    phase: "503", "wrong_secret" (a reference receiver holding another secret), "redirect" (a
    301 to a page that answers 200), "right" (the reference receiver with the consumer's
    secret). Requests are passed to the receivers verbatim."""

    def __init__(self, wrong: str, right: str, session: aiohttp.ClientSession) -> None:
        self.phase = "503"
        self.receivers = {"wrong_secret": wrong, "right": right}
        self.session = session

    async def answer(self, attempt: Attempt) -> Reply:
        """The scripted receiver's script."""
        if self.phase == "503":
            return Reply(503, {"error": {"code": "MAINTENANCE"}})
        if self.phase == "redirect":
            return Reply(301, b"", {"Location": "/moved"})
        hop_by_hop = {"host", "content-length", "connection", "transfer-encoding"}
        headers = {k: v for k, v in attempt.headers.items() if k.lower() not in hop_by_hop}
        async with self.session.post(
            self.receivers[self.phase] + INGEST_PATH, data=attempt.body, headers=headers
        ) as answer:
            return Reply(answer.status, await answer.read())


async def get_json(url: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status, await response.json()


async def status_json(dsn: str) -> dict[str, Any]:
    result = await finish(await start_cli("status", "--json", env=cli_env(DATABASE_URL=dsn)))
    assert result.code == 0, result
    consumers: list[dict[str, Any]] = orjson.loads(result.stdout)["consumers"]
    return consumers[0]


async def test_fault_drill_outage_wrong_secret_and_redirect_lose_and_park_nothing(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    """A receiver through an outage (nothing listening, then 503s: more attempts than ten
    minutes of the default backoff makes), a wrong secret that is then fixed, and a redirect,
    while producers keep writing. Meanwhile the process stays up, /readyz says
    delivery_failing with the reason, `serversync status` and /metrics say it too. At the end:
    zero events parked, zero lost, every entity at its latest version, the offset at the end."""
    port = free_port()
    entity_versions = 0

    async def produce(tag: str) -> None:
        nonlocal entity_versions
        entity_versions += 1
        await insert_calls(backend_dsn, 10, tag=f"{tag}")

    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=OTHER_SECRET) as (wrong_url, _),
        serve_reference_receiver(receiver_dsn, shared_secret=SECRET) as (right_url, right),
        aiohttp.ClientSession() as session,
    ):
        front = Front(wrong_url, right_url, session)
        with Processes(tmp_path) as procs:
            consumer = procs.consumer(
                backend_dsn,
                f"http://127.0.0.1:{port}",
                SYNC_SHARED_SECRET=SECRET,
                SYNC_RETRY_INITIAL_SEC="0.02",
                SYNC_RETRY_MAX_SEC="0.1",
                SYNC_METRICS_INTERVAL_SEC="0.2",
            )
            ops = await consumer.ops_url()
            # The outage: nothing listens at the frontend's address.
            await produce("down")
            await consumer.wait_log("failed (attempt 12)", timeout=30)
            code, ready = await get_json(ops + "/readyz")
            assert code == 200, ready
            assert ready["delivery"]["state"] == "delivery_failing", ready
            assert ready["delivery"]["reason"] == "receiver_unavailable", ready
            # The frontend is up again but answers 503 for a while.
            async with scripted_receiver(front.answer, port=port) as rx:
                await produce("maintenance")
                await wait_until(lambda: rx.statuses.count(503) >= 12, what="twelve 503s")
                # A wrong secret: the receiver holds another one.
                front.phase = "wrong_secret"
                await produce("wrongsecret")
                await wait_until(lambda: rx.statuses.count(401) >= 5, what="five 401s")
                code, ready = await get_json(ops + "/readyz")
                assert (code, ready["delivery"]["reason"]) == (200, "wrong_destination"), ready
                row = await status_json(backend_dsn)
                assert row["failing_reason"] == "wrong_destination", row
                assert "HTTP 401" in row["last_error"], row
                text = await finish(
                    await start_cli("status", env=cli_env(DATABASE_URL=backend_dsn))
                )
                assert "FAILING" in text.stdout, text
                assert "frontend-sync: delivery failing for" in text.stdout, text
                assert "(wrong_destination)" in text.stdout, text
                assert "SYNC_SHARED_SECRET differs" in text.stdout, text

                async def metric_says_failing() -> bool:
                    async with session.get(ops + "/metrics") as response:
                        text = await response.text()
                    pattern = (
                        r"serversync_delivery_failing_seconds\{[^}]*"
                        r'reason="wrong_destination"[^}]*\} ([0-9.e+]+)'
                    )
                    found = re.search(pattern, text)
                    return found is not None and float(found.group(1)) > 0

                await wait_until(metric_says_failing, what="the failing metric")
                # A redirect: the frontend moved.
                front.phase = "redirect"
                await produce("redirect")
                await wait_until(lambda: rx.statuses.count(301) >= 5, what="five 301s")
                assert await committed_position(backend_dsn) == (0, 0)
                # Right again: the receiver takes the consumer's secret.
                front.phase = "right"
                await produce("right")
                await wait_until(lambda: caught_up(backend_dsn), timeout=30, what="catching up")
                code, ready = await get_json(ops + "/readyz")
                assert ready["delivery"] == {"state": "ok"}, ready
                consumer.assert_alive()
    assert rx.pages == []
    assert await dead_letters(backend_dsn) == []
    outbox = await fetch_all(
        backend_dsn, "SELECT entity_type, entity_id, max(seq) FROM sync.events_outbox GROUP BY 1, 2"
    )
    received = await fetch_all(
        receiver_dsn, "SELECT entity_type, entity_id, seq FROM ingest.entities"
    )
    assert sorted(received) == sorted(outbox)
    assert len(outbox) == 10 * entity_versions
    assert sum(right.applied) == len(outbox)
    row = await status_json(backend_dsn)
    assert row["failing_since"] is None and row["last_error"] is None, row


# -- what the review of these semantics found ------------------------------------------------------


async def test_a_lead_lost_while_waiting_out_a_retry_after_is_noticed_at_once(
    backend_dsn: str,
) -> None:
    """A receiver that says "come back in an hour": if the lock session dies meanwhile, the
    process stops calling itself the leader within the lock check, not an hour later."""
    await insert_calls(backend_dsn, 1, tag="hour")
    async with (
        scripted_receiver(answers(503, 1, **{"Retry-After": "3600"})) as rx,
        consuming(backend_dsn, rx.url, **FAST_RETRIES) as runtime,
    ):
        await wait_until(lambda: len(rx.attempts) == 1, what="the first attempt")
        await wait_until(lambda: runtime.stats.failing_since is not None, what="the streak")
        await execute(
            backend_dsn,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name LIKE 'serversync:leader:frontend-sync:%'",
        )
        await wait_until(
            lambda: runtime.stats.state != "leader" or runtime.stats.takeovers > 1,
            timeout=10,
            what="the lost lead to be noticed",
        )
        # Whoever leads now reports its own streak, not the one of the lead that was lost.
        assert runtime.delivery_health()["state"] in ("not_leading", "ok"), runtime.stats


async def test_a_read_the_database_refused_once_leaves_no_failing_streak_behind(
    backend_dsn: str, receiver_url: str
) -> None:
    """An idle consumer whose read the database refused (here: the outbox renamed away for a
    moment) reports the streak while it lasts and clears it once the read goes through, in
    /readyz and in the database, although no offset commit follows."""
    async with running_consumer(make_settings(backend_dsn, receiver_url)) as runtime:
        await wait_until(lambda: runtime.stats.sleeping == "wakeup", what="the consumer idle")
        await execute(backend_dsn, "ALTER TABLE sync.events_outbox RENAME TO events_outbox_away")
        try:
            runtime.listener.event.set()  # type: ignore[union-attr]
            await wait_until(
                lambda: runtime.stats.failing_reason == Failure.INTERNAL, what="a refused read"
            )
            assert (
                await fetch_value(backend_dsn, "SELECT failing_reason FROM sync.consumer_offsets")
                == "internal_error"
            )
        finally:
            await execute(
                backend_dsn, "ALTER TABLE sync.events_outbox_away RENAME TO events_outbox"
            )
        await wait_until(lambda: runtime.stats.failing_since is None, what="the streak to end")
        assert runtime.delivery_health() == {"state": "ok"}
        assert await fetch_value(
            backend_dsn, "SELECT failing_since IS NULL FROM sync.consumer_offsets"
        )
        await insert_calls(backend_dsn, 2, tag="afterwards")
        await wait_until(lambda: caught_up(backend_dsn), what="delivery afterwards")


@pytest.mark.parametrize("header", ["²", "Fri, 31 Dec 9999 23:59:59 GMT", "soon"])
async def test_an_odd_retry_after_on_a_refusal_still_parks_the_refused_event(
    backend_dsn: str, header: str
) -> None:
    """Retry-After counts only on 429 and 503; on a refusal, whatever it says (a digit that is
    not ASCII, a date far away, junk) neither holds the stream nor crashes the consumer."""
    await insert_calls(backend_dsn, 2, tag="odd")

    def script(attempt: Attempt) -> Reply | None:
        if "odd-1" in attempt.callers:
            return Reply(422, {"error": {"code": "NO"}}, {"Retry-After": header})
        return None

    async with (
        scripted_receiver(script) as rx,
        consuming(backend_dsn, rx.url, **FAST_RETRIES) as runtime,
    ):
        await wait_until(lambda: caught_up(backend_dsn), what="the stream past the refusal")
    assert runtime.stats.parked_events == 1
    assert [p.caller for p in await dead_letters(backend_dsn)] == ["odd-1"]
