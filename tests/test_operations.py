"""Operations: what a sysadmin watches, checked on real `serversync` processes against
real PostgreSQL over real HTTP on loopback: the Prometheus metrics at /metrics during a run, the
leader gauge on takeover, the dead-letter gauge and the outcome counters, /readyz when the
database goes away, the JSON logs (fields, trace ids, masked secrets, levels), trace propagation
to the receiver over OTLP, and `serversync status --watch`.

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
from consumer.devtools.devdb import PrivateCluster, free_port
from consumer.ops.deadletters import DeadLetters
from consumer.store.dlq import DlqStore
from tests.conftest import (
    Databases,
    cli_env,
    make_settings,
    running_consumer,
    start_cli,
    wait_until,
    waiting_for_notify,
)
from tests.helpers_operations import (
    OPS_ENV,
    attribute,
    get_json,
    json_lines,
    otlp_collector,
    outcome_receiver,
    scrape,
    wait_metric,
    wait_ready,
)
from tests.helpers_processes import (
    CONSUMER,
    INGEST_PATH,
    Processes,
    insert_callers,
    insert_calls,
    offsets_row,
    outbox_end,
    serve_fault_receiver,
)
from tests.test_deploy import EXPORTED_METRICS

HISTOGRAMS = (
    "serversync_batch_size_events",
    "serversync_batch_duration_seconds",
    "serversync_delivery_attempts",
)
STANDING_BY = "another process leads; standing by"
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Starts serversync processes; kills whatever still runs at the end and prints the logs."""
    with Processes(tmp_path, OPS_ENV) as launched:
        yield launched


async def wait_outbox_end(dsn: str) -> tuple[int, int]:
    """The position of the last event of the outbox (once there is one)."""
    found: list[tuple[int, int]] = []

    async def present() -> bool:
        end = await outbox_end(dsn)
        found[:] = [end] if end is not None else []
        return end is not None

    await wait_until(present, what="an event in the outbox")
    return found[0]


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
    async with serve_fault_receiver() as receiver:
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
    async with serve_fault_receiver() as receiver:
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
    async with outcome_receiver() as receiver:
        receiver.refuse = {"refused"}
        receiver.conflict = {"conflicting"}
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

    assert receiver.answers == [422, 409, 503, 200]
    assert receiver.accepted == ["retried"]
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


@pytest.fixture
def private_backend_dsn(private_databases: Databases) -> str:
    """A fresh backend database on the private cluster (which tests may stop)."""
    return private_databases.create("backend")


@pytest.mark.private_cluster
async def test_readyz_follows_the_database_and_healthz_does_not(
    private_cluster: PrivateCluster,
    private_backend_dsn: str,
    procs: Processes,
    http: aiohttp.ClientSession,
) -> None:
    dsn = private_backend_dsn
    async with serve_fault_receiver() as receiver:
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


# -- logs ----------------------------------------------------------------------------------------

URL_PASSWORD = "s3cretpw"  # noqa: S105 - a test value
BEARER = "abcdefSECRET123"
API_KEY = "sk-SECRET"
LEAKY_BODY = (
    '{"error": {"code": "UPSTREAM", "message": "upstream refused: '
    f'Authorization: Bearer {BEARER} with api_key={API_KEY}"}}}}'
)


async def test_json_logs_carry_batch_fields_and_trace_ids_and_mask_secrets(
    backend_dsn: str, procs: Processes
) -> None:
    async with outcome_receiver() as receiver:
        receiver.fail_status, receiver.fail_body = 500, LEAKY_BODY
        receiver.fail_remaining = 1000  # until told otherwise
        process = procs.consumer(
            backend_dsn,
            receiver.with_password("user", URL_PASSWORD),
            log_format=None,  # the default: JSON
            SYNC_MAX_ATTEMPTS="0",  # never park: the receiver recovers when the test says so
        )
        await process.ops_url()
        await insert_callers(backend_dsn, ["a", "b", "c"])
        await process.wait_log("failed (attempt 2)")
        receiver.fail_remaining = 0
        await process.wait_log('"outcome":"delivered"')
        process.terminate()
        assert await process.wait_exit(10) == 0
        output = process.log()

    for secret in (URL_PASSWORD, BEARER, API_KEY):
        assert secret not in output, f"{secret!r} leaked into the logs"
    entries = json_lines(output)
    for entry in entries:
        assert {"ts", "level", "logger", "msg"} <= set(entry), entry

    batches = [e for e in entries if "seq_range" in e]
    assert len(batches) == 1, batches
    batch = batches[0]
    assert batch["level"] == "info" and batch["logger"] == "serversync.runtime", batch
    assert (batch["consumer"], batch["seq_range"], batch["outcome"]) == (
        CONSUMER,
        "1..3",
        "delivered",
    )
    assert (batch["events"], batch["parked"]) == (3, 0)
    assert isinstance(batch["duration_ms"], float) and batch["duration_ms"] > 0, batch
    assert HEX32.match(batch["trace_id"]) and HEX16.match(batch["span_id"]), batch
    assert batch["msg"].startswith("consumer frontend-sync: delivered 3 events seq 1..3 in ")

    failures = [e for e in entries if "failed (attempt" in e["msg"]]
    assert len(failures) >= 2, failures
    masked_url = receiver.url.replace("http://", "http://user:***@") + INGEST_PATH
    for failure in failures:
        assert failure["level"] == "warning", failure
        assert f"POST {masked_url} answered HTTP 500" in failure["msg"], failure
        assert "Bearer ***" in failure["msg"] and "api_key=***" in failure["msg"], failure
        # Retries happen inside the batch's span: the same trace as the batch's line.
        assert failure["trace_id"] == batch["trace_id"], failure
    assert receiver.answers == [500] * len(failures) + [200]
    # Lines outside any batch carry no trace id.
    started = [e for e in entries if "health, readiness and metrics on" in e["msg"]]
    assert len(started) == 1 and "trace_id" not in started[0], started


async def test_log_level_warning_hides_the_batch_lines(backend_dsn: str, procs: Processes) -> None:
    async with outcome_receiver() as receiver:
        receiver.fail_remaining = 1  # one 503: a warning that must still be logged
        process = procs.consumer(
            backend_dsn, receiver.url, log_format=None, SYNC_LOG_LEVEL="WARNING"
        )
        await insert_callers(backend_dsn, ["a", "b", "c"])
        end = await wait_outbox_end(backend_dsn)

        async def committed() -> bool:
            return (await offsets_row(backend_dsn)).get("position") == end

        await wait_until(committed, interval=0.05, what="the offset past the 3 events")
        process.terminate()
        assert await process.wait_exit(10) == 0
        entries = json_lines(process.log())

    assert receiver.answers == [503, 200]
    assert [e["level"] for e in entries] == ["warning"], entries
    assert entries[0]["msg"].startswith(
        "consumer frontend-sync: delivery of seq 1..3 failed (attempt 1): "
    ), entries


async def test_text_log_format_gives_human_lines(backend_dsn: str, procs: Processes) -> None:
    async with serve_fault_receiver() as receiver:
        process = procs.consumer(backend_dsn, receiver.url, log_format="text")
        await process.ops_url()
        await insert_calls(backend_dsn, 3)
        line = await process.wait_log(
            re.compile(r"^.*delivered 3 events seq 1\.\.3 .*$", re.MULTILINE)
        )
        process.terminate()
        assert await process.wait_exit(10) == 0
        output = process.log()

    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO    serversync\.runtime: consumer "
        r"frontend-sync: delivered 3 events seq 1\.\.3 in \d+\.\d ms \(0 parked\) "
        r"trace=[0-9a-f]{32}",
        line,
    ), line
    lines = output.splitlines()
    assert lines, output
    for text in lines:
        assert not text.lstrip().startswith("{"), text
    assert any(" INFO    serversync: consumer frontend-sync starting " in t for t in lines), lines


# -- traces and metrics over OTLP ----------------------------------------------------------------

OTLP_ENV = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500"}
SPAN_KIND_SERVER, SPAN_KIND_CLIENT = 2, 3


async def test_a_batch_and_the_receivers_work_on_it_share_one_trace_over_otlp(
    backend_dsn: str, receiver_dsn: str, procs: Processes, tmp_path: Path
) -> None:
    async with otlp_collector() as collector:
        otlp = {"OTEL_EXPORTER_OTLP_ENDPOINT": collector.url, **OTLP_ENV}
        port = free_port()
        ingest = procs.start(
            "ingest-server",
            ["ingest-server", "--insecure"],
            FRONTEND_DATABASE_URL=receiver_dsn,
            INGEST_PORT=str(port),
            RECORDINGS_STORE_DIR=str(tmp_path / "recordings"),
            **otlp,
        )
        await ingest.wait_log("ingest-server listening on")
        consumer = procs.consumer(backend_dsn, f"http://127.0.0.1:{port}", **otlp)
        await consumer.ops_url()
        await insert_calls(backend_dsn, 3)

        def exported() -> bool:
            batch = collector.named("frontend-sync deliver batch", "serversync-frontend-sync")
            served = collector.named(f"POST {INGEST_PATH}", "serversync-ingest")
            return bool(batch and served and "serversync.events" in metric_names())

        def metric_names() -> set[str]:
            return collector.metrics.get("serversync-frontend-sync", set())

        await wait_until(
            exported, timeout=10, what="the batch's spans and metrics at the collector"
        )

    [batch] = collector.named("frontend-sync deliver batch")
    assert batch.service == "serversync-frontend-sync"
    assert batch.parent_id == "", "a batch's span is the root of its trace"
    assert batch.attribute("serversync.consumer") == CONSUMER
    assert batch.attribute("serversync.batch.count") == 3
    assert batch.attribute("serversync.batch.min_seq") == 1
    assert batch.attribute("serversync.batch.max_seq") == 3
    assert batch.attribute("serversync.outcome") == "delivered"

    clients = [s for s in collector.spans if s.parent_id == batch.span_id]
    assert len(clients) == 1, [(s.service, s.span.name) for s in clients]
    [client] = clients
    assert client.service == "serversync-frontend-sync"
    assert client.span.kind == SPAN_KIND_CLIENT
    assert client.span.name == f"POST {INGEST_PATH}"
    assert client.trace_id == batch.trace_id
    assert client.attribute("http.request.method") == "POST"
    assert client.attribute("http.response.status_code") == 200

    [server] = collector.named(f"POST {INGEST_PATH}", "serversync-ingest")
    assert server.span.kind == SPAN_KIND_SERVER
    assert server.trace_id == batch.trace_id, "the receiver's span is in another trace"
    assert server.parent_id == client.span_id
    assert server.attribute("http.response.status_code") == 200
    assert server.attribute("url.path") == INGEST_PATH

    assert {s.service for s in collector.spans} == {"serversync-frontend-sync", "serversync-ingest"}
    assert "serversync.events" in collector.metrics["serversync-frontend-sync"]
    assert "serversync.batch.duration" in collector.metrics["serversync-frontend-sync"]


async def test_exported_spans_carry_no_secrets(backend_dsn: str, procs: Processes) -> None:
    async with otlp_collector() as collector, outcome_receiver() as receiver:
        receiver.fail_status, receiver.fail_body = 500, LEAKY_BODY
        receiver.fail_remaining = 1
        process = procs.consumer(
            backend_dsn,
            receiver.with_password("user", URL_PASSWORD),
            OTEL_EXPORTER_OTLP_ENDPOINT=collector.url,
            **OTLP_ENV,
        )
        await process.ops_url()
        await insert_callers(backend_dsn, ["a", "b"])
        await wait_until(
            lambda: len(collector.named("frontend-sync deliver batch")) == 1,
            timeout=10,
            what="the batch's span at the collector",
        )

    assert receiver.answers == [500, 200]
    clients = [s for s in collector.spans if s.span.kind == SPAN_KIND_CLIENT]
    assert len(clients) == 2, clients
    for collected in collector.spans:
        exported = collected.span.SerializeToString()
        for secret in (URL_PASSWORD, BEARER, API_KEY):
            assert secret.encode() not in exported, f"{secret!r} in {collected.span}"
    # Masked, not dropped: the failed call still says where it went and what came back.
    masked_url = receiver.url.replace("http://", "http://user:***@") + INGEST_PATH
    assert [c.attribute("url.full") for c in clients] == [masked_url, masked_url]
    failed = min(clients, key=lambda c: c.span.start_time_unix_nano)
    assert failed.attribute("http.response.status_code") == 500
    [exception] = [e for e in failed.span.events if e.name == "exception"]
    message = attribute(exception.attributes, "exception.message")
    assert message.startswith(f"POST {masked_url} answered HTTP 500: "), message
    assert "Bearer ***" in message and "api_key=***" in message, message
    assert masked_url in failed.span.status.message, failed.span.status


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
    async with outcome_receiver() as receiver:
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
