"""Operations: what a sysadmin watches, checked on real `serversync` processes against
real PostgreSQL over real HTTP on loopback: the Prometheus metrics at /metrics during a run, the
leader gauge on takeover, the dead-letter gauge and the outcome counters, /readyz when the
database goes away, and `serversync status --watch`. The logs and the traces over OTLP are in
tests/test_operations_logs.py.

Gauges are refreshed every 0.2 s (SYNC_METRICS_INTERVAL_SEC); every wait is a wait_until with a
deadline."""

from __future__ import annotations

import asyncio
import re
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from consumer.app.wiring import dlq_sinks, open_pool
from consumer.devtools.devdb import PrivateCluster
from consumer.ops.deadletters import DeadLetters
from consumer.store.dlq import DlqStore
from tests.conftest import (
    cli_env,
    make_settings,
    running_consumer,
    start_cli,
    wait_until,
    waiting_for_notify,
)
from tests.support.backend import CONSUMER, insert_callers, insert_calls, offsets_row
from tests.support.metrics import EXPORTED_METRICS
from tests.support.operations import (
    OPS_ENV,
    get_json,
    scrape,
    wait_metric,
    wait_ready,
)
from tests.support.processes import Processes
from tests.support.receivers import scripted_receiver

HISTOGRAMS = (
    "serversync_batch_size_events",
    "serversync_batch_duration_seconds",
    "serversync_delivery_attempts",
)
STANDING_BY = "another process leads; standing by"
# What a receiver that is down for a moment answers (with 503).
DOWN = {"error": {"code": "DOWN", "message": "try later"}}


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Starts serversync processes; kills whatever still runs at the end and prints the logs."""
    with Processes(tmp_path, OPS_ENV) as launched:
        yield launched


def ready_body(role: str) -> dict[str, Any]:
    """What /readyz answers for a ready frontend-sync consumer in `role` (leader, standby)
    whose deliveries go through."""
    delivery = {"state": "ok" if role == "leader" else "not_leading"}
    return {
        "status": "ready",
        "consumer": CONSUMER,
        "role": role,
        "database": "ok",
        "delivery": delivery,
    }


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client with a deadline on every request."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


# -- /metrics during a run -----------------------------------------------------------------------


async def test_metrics_follow_a_run_from_backlog_to_caught_up(
    backend_dsn: str, procs: Processes, http: aiohttp.ClientSession
) -> None:
    events, batch_size = 40, 10
    async with scripted_receiver() as receiver:
        # One batch in flight: while the first is held, nothing at all is delivered.
        process = procs.consumer(
            backend_dsn, receiver.url, SYNC_BATCH_SIZE=str(batch_size), SYNC_MAX_IN_FLIGHT="1"
        )
        ops = await process.ops_url()
        await wait_metric(http, ops, "serversync_leader", 1, consumer=CONSUMER)
        # Idle, so that the inserts below wake it (and the wake-up is counted).
        await wait_until(
            lambda: waiting_for_notify(backend_dsn), what="the consumer to wait for a NOTIFY"
        )

        # The first batch is held at the receiver: nothing is delivered yet.
        receiver.hold_next(1)
        await insert_calls(backend_dsn, events)
        await wait_until(lambda: receiver.held == 1, what="the first batch at the receiver")
        held = await wait_metric(http, ops, "serversync_backlog_events", events, consumer=CONSUMER)
        lag = held.value("serversync_lag_seconds", consumer=CONSUMER)
        assert lag is not None and 0 < lag < 60, lag
        assert held.by_label("serversync_events_total", "outcome") == {}

        receiver.release()
        await wait_metric(http, ops, "serversync_backlog_events", 0, consumer=CONSUMER)
        await wait_metric(
            http, ops, "serversync_events_total", events, consumer=CONSUMER, outcome="delivered"
        )
        done = await wait_metric(http, ops, "serversync_outbox_rows", events)

    types = {name: done.types.get(name.removesuffix("_total")) for name in EXPORTED_METRICS}
    for name in EXPORTED_METRICS:
        if name in HISTOGRAMS:
            assert types[name] == "histogram", (name, types[name])
            for suffix in ("_bucket", "_sum", "_count"):
                assert name + suffix in done.names, f"{name}{suffix} not exported"
        else:
            assert types[name] == ("counter" if name.endswith("_total") else "gauge"), name
            assert name in done.names, f"{name} not exported"

    assert done.value("serversync_lag_seconds", consumer=CONSUMER) == 0.0
    assert done.value("serversync_leader", consumer=CONSUMER) == 1
    # Every event once, in batches of 10, each at the first attempt.
    assert done.by_label("serversync_events_total", "outcome") == {"delivered": events}
    batches = events // batch_size
    assert done.value("serversync_batch_size_events_count", consumer=CONSUMER) == batches
    assert done.value("serversync_batch_size_events_sum", consumer=CONSUMER) == events
    assert done.value("serversync_batch_size_events_bucket", consumer=CONSUMER, le="5") == 0
    assert done.value("serversync_batch_size_events_bucket", consumer=CONSUMER, le="10") == batches
    assert done.value("serversync_batch_duration_seconds_count", consumer=CONSUMER) == batches
    duration = done.value("serversync_batch_duration_seconds_sum", consumer=CONSUMER)
    assert duration is not None and 0 < duration < 30, duration
    assert done.value("serversync_delivery_attempts_count", consumer=CONSUMER) == batches
    assert done.value("serversync_delivery_attempts_sum", consumer=CONSUMER) == batches
    # Idle with a 30 s poll: woken by the commit's NOTIFY (or a re-check while another
    # session's transaction held the read horizon back), never by the poll timer.
    wakeups = done.by_label("serversync_wakeups_total", "reason", consumer=CONSUMER)
    assert set(wakeups) <= {"notify", "recheck"}, wakeups
    assert sum(wakeups.values()) >= 1, wakeups
    assert done.by_label("serversync_dlq_messages", "status", consumer=CONSUMER) == {
        "pending": 0,
        "retrying": 0,
        "resolved": 0,
        "dead": 0,
    }
    oldest = done.value("serversync_outbox_oldest_age_seconds")
    assert oldest is not None and 0 < oldest < 60, oldest
    assert receiver.delivered == set(range(1, events + 1))


# -- the leader gauge ----------------------------------------------------------------------------


async def test_leader_gauge_and_readiness_flip_on_takeover(
    backend_dsn: str, procs: Processes, http: aiohttp.ClientSession
) -> None:
    async with scripted_receiver() as receiver:
        first = procs.consumer(backend_dsn, receiver.url, name="first")
        first_ops = await first.ops_url()
        await wait_metric(http, first_ops, "serversync_leader", 1, consumer=CONSUMER)
        second = procs.consumer(backend_dsn, receiver.url, name="second")
        second_ops = await second.ops_url()
        await second.wait_log(STANDING_BY)

        standby = await wait_ready(http, second_ops, "standby")
        assert standby == ready_body("standby")
        assert (await scrape(http, second_ops)).value("serversync_leader", consumer=CONSUMER) == 0
        assert (await wait_ready(http, first_ops, "leader"))["status"] == "ready"
        assert (await scrape(http, first_ops)).value("serversync_leader", consumer=CONSUMER) == 1

        first.kill()
        assert await first.wait_exit(5) == -signal.SIGKILL
        await wait_metric(http, second_ops, "serversync_leader", 1, consumer=CONSUMER)
        leader = await wait_ready(http, second_ops, "leader")
        assert leader == ready_body("leader")
        assert (await offsets_row(backend_dsn))["leader_pid"] == second.pid

        # The new leader does the work, and counts it.
        await insert_calls(backend_dsn, 5)
        await wait_metric(
            http, second_ops, "serversync_events_total", 5, consumer=CONSUMER, outcome="delivered"
        )
        assert receiver.delivered == {1, 2, 3, 4, 5}


# -- dead letters and outcomes -------------------------------------------------------------------


async def test_dlq_gauge_and_every_outcome_counted(
    backend_dsn: str, procs: Processes, http: aiohttp.ClientSession
) -> None:
    async with scripted_receiver() as receiver:
        receiver.refuse = {"refused"}
        receiver.conflict = {"conflicting"}
        receiver.fail_status, receiver.fail_body = 503, DOWN
        process = procs.consumer(backend_dsn, receiver.url)
        ops = await process.ops_url()
        await wait_metric(http, ops, "serversync_leader", 1, consumer=CONSUMER)
        before = await wait_metric(
            http, ops, "serversync_dlq_messages", 0, consumer=CONSUMER, status="pending"
        )
        assert before.by_label("serversync_events_total", "outcome") == {}

        # 422: parked at once.
        await insert_callers(backend_dsn, ["refused"])
        await wait_metric(
            http, ops, "serversync_dlq_messages", 1, consumer=CONSUMER, status="pending"
        )
        await wait_metric(
            http, ops, "serversync_events_total", 1, consumer=CONSUMER, outcome="parked"
        )
        # 409: the receiver had it already.
        await insert_callers(backend_dsn, ["conflicting"])
        await wait_metric(
            http,
            ops,
            "serversync_events_total",
            1,
            consumer=CONSUMER,
            outcome="already_processed",
        )
        # 503, then 200: one retry, then delivered.
        receiver.fail_remaining = 1
        await insert_callers(backend_dsn, ["retried"])
        await wait_metric(
            http, ops, "serversync_events_total", 1, consumer=CONSUMER, outcome="delivered"
        )
        done = await wait_metric(http, ops, "serversync_backlog_events", 0, consumer=CONSUMER)

    assert receiver.statuses == [422, 409, 503, 200]
    assert receiver.accepted_callers() == ["retried"]
    assert done.by_label("serversync_events_total", "outcome", consumer=CONSUMER) == {
        "parked": 1,
        "already_processed": 1,
        "retried": 1,
        "delivered": 1,
    }
    assert done.by_label("serversync_dlq_messages", "status", consumer=CONSUMER) == {
        "pending": 1,
        "retrying": 0,
        "resolved": 0,
        "dead": 0,
    }
    # Three batches: one attempt each for the parked and the conflicting one, two for the last.
    assert done.value("serversync_delivery_attempts_count", consumer=CONSUMER) == 3
    assert done.value("serversync_delivery_attempts_sum", consumer=CONSUMER) == 4
    assert done.value("serversync_delivery_attempts_bucket", consumer=CONSUMER, le="1") == 2
    # A batch that was parked is still a settled batch.
    assert done.value("serversync_batch_size_events_count", consumer=CONSUMER) == 3


# -- /readyz when the database goes away (private cluster only) ----------------------------------


@pytest.mark.private_cluster
async def test_readyz_follows_the_database_and_healthz_does_not(
    private_cluster: PrivateCluster,
    private_backend_dsn: str,
    procs: Processes,
    http: aiohttp.ClientSession,
) -> None:
    dsn = private_backend_dsn
    async with scripted_receiver() as receiver:
        process = procs.consumer(dsn, receiver.url)
        ops = await process.ops_url()
        assert await wait_ready(http, ops, "leader") == ready_body("leader")
        await wait_metric(http, ops, "serversync_backlog_events", 0, consumer=CONSUMER)
        await asyncio.to_thread(private_cluster.stop, "fast")
        try:
            answers: list[tuple[int, dict[str, object]]] = []

            async def unready() -> bool:
                answers[:] = [await get_json(http, ops + "/readyz")]
                return answers[0][0] == 503

            await wait_until(unready, timeout=10, interval=0.05, what="/readyz 503")
            status, body = answers[0]
            assert body["status"] == "unavailable" and body["consumer"] == CONSUMER, body
            assert isinstance(body["database"], str) and body["database"] not in ("", "ok"), body
            # Alive all the same, and its metrics are there without a database round trip.
            assert await get_json(http, ops + "/healthz") == (
                200,
                {"status": "ok", "consumer": CONSUMER},
            )
            started = time.monotonic()
            during = await scrape(http, ops)
            assert time.monotonic() - started < 1.5, "a scrape waited on the database"
            assert during.value("serversync_backlog_events", consumer=CONSUMER) == 0
            # Once the consumer notices too, readiness says so.

            async def consumer_noticed() -> bool:
                answers[:] = [await get_json(http, ops + "/readyz")]
                return answers[0][1]["role"] == "database_unreachable"

            await wait_until(
                consumer_noticed, timeout=12, interval=0.05, what="role database_unreachable"
            )
            status, body = answers[0]
            assert status == 503, answers
            assert body["status"] == "unavailable", body
            assert body["database"] not in ("", "ok"), body
        finally:
            await asyncio.to_thread(private_cluster.start)
        assert await wait_ready(http, ops, "leader", timeout=15) == ready_body("leader")
        # And it delivers again.
        await insert_calls(dsn, 3)
        await wait_until(lambda: receiver.delivered == {1, 2, 3}, what="3 events delivered")


# -- serversync status ---------------------------------------------------------------------------

STATUS_HEADER = "serversync status at "


def parse_table(lines: list[str]) -> list[dict[str, str]]:
    """The rows of a `status` table, by column name (columns start where their headers do)."""
    assert lines and lines[0].startswith("CONSUMER "), lines
    starts = [(m.group(0), m.start()) for m in re.finditer(r"\S+", lines[0])]
    rows = []
    for line in lines[1:]:
        if not line.strip():
            break
        row = {}
        for i, (name, start) in enumerate(starts):
            end = starts[i + 1][1] if i + 1 < len(starts) else None
            row[name] = line[start:end].strip()
        rows.append(row)
    return rows


class WatchOutput:
    """Reads `status --watch` output as it comes: one table per refresh."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.stream = stream
        self.tables: list[list[dict[str, str]]] = []

    async def next_table(self, deadline: float) -> list[dict[str, str]]:
        """The next refreshed table; fails when the deadline (monotonic) passes first."""
        current: list[str] | None = None
        while True:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"no refreshed table in time (got {len(self.tables)})"
            try:
                raw = await asyncio.wait_for(self.stream.readline(), timeout=remaining)
            except TimeoutError:
                raise AssertionError(f"no refreshed table in time (got {self.tables})") from None
            assert raw, f"stdout closed after {len(self.tables)} table(s)"
            line = raw.decode().rstrip("\n")
            if line.startswith(STATUS_HEADER):
                assert line.endswith("(every 0.2s; Ctrl-C stops)"), line
                current = []
            elif current is not None and not line:
                self.tables.append(parse_table(current))
                return self.tables[-1]
            elif current is not None:
                current.append(line)


async def park_two_pending_and_one_dead(dsn: str) -> None:
    """Park three events of frontend-sync (two others delivered); retry one parked event until it
    is DEAD (one retry allowed)."""
    async with scripted_receiver() as receiver:
        receiver.refuse = {"bad-1", "bad-2", "bad-3"}
        settings = make_settings(dsn, receiver.url, SYNC_DLQ_MAX_RETRIES=1)
        await insert_callers(dsn, ["good-1", "bad-1", "good-2", "bad-2", "bad-3"])
        async with running_consumer(settings) as runtime:

            def settled() -> bool:
                return runtime.stats.delivered_events + runtime.stats.parked_events == 5

            await wait_until(settled, what="every event delivered or parked")
            assert (runtime.stats.delivered_events, runtime.stats.parked_events) == (2, 3)
        async with open_pool(dsn, "test-dlq", max_size=2) as pool:
            service = DeadLetters(DlqStore.over_pool(pool), dlq_sinks(settings))
            try:
                page = await service.list_messages(CONSUMER)
                assert page.total_count == 3
                result = await service.retry(str(page.messages[0].id))
            finally:
                await service.close()
        assert not result.delivered and result.message.status == "DEAD", result


async def test_status_watch_refreshes_and_counts_dead_letters(backend_dsn: str) -> None:
    await park_two_pending_and_one_dead(backend_dsn)
    env = cli_env(DATABASE_URL=backend_dsn)

    once = await start_cli("status", env=env)
    out, err = await asyncio.wait_for(once.communicate(), timeout=30)
    assert once.returncode == 0, (out, err)
    [row] = parse_table(out.decode().splitlines())
    assert (row["CONSUMER"], row["LEADER"], row["LAST_SEQ"], row["BACKLOG"]) == (
        CONSUMER,
        "none",
        "5",
        "0",
    ), row
    assert (row["DLQ_PENDING"], row["DLQ_DEAD"], row["DELIVERED"]) == ("2", "1", "2"), row
    assert row["LAST_ERROR"].startswith("parked 3 event(s): POST http://127.0.0.1:"), row

    watch = await start_cli("status", "--watch", "--interval", "0.2", env=env)
    try:
        assert watch.stdout is not None and watch.stderr is not None
        output = WatchOutput(watch.stdout)
        deadline = time.monotonic() + 10
        first = await output.next_table(deadline)
        assert [(r["BACKLOG"], r["DLQ_PENDING"], r["DLQ_DEAD"]) for r in first] == [("0", "2", "1")]
        # A new event, and no consumer running: a later refresh shows it waiting.
        await insert_calls(backend_dsn, 1)
        while (await output.next_table(deadline))[0]["BACKLOG"] != "1":
            pass
        assert len(output.tables) >= 2
        watch.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(watch.communicate(), timeout=10)
    finally:
        if watch.returncode is None:
            watch.kill()
            await watch.wait()
    assert watch.returncode == 0, (rest, err)
    assert "Traceback" not in err.decode(), err.decode()
    assert "KeyboardInterrupt" not in err.decode(), err.decode()
