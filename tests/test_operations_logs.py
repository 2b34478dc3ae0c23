"""Operations, the logs and traces: checked on real `serversync` processes against real
PostgreSQL over real HTTP on loopback: the JSON logs (fields, trace ids, masked secrets, levels),
the text log format, trace propagation to the receiver over OTLP and spans without secrets.
Metrics, readiness and `serversync status` are in tests/test_operations.py."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from consumer.devtools.devdb import free_port
from tests.conftest import (
    wait_until,
)
from tests.support.backend import CONSUMER, insert_callers, insert_calls
from tests.support.operations import (
    OPS_ENV,
    attribute,
    json_lines,
    otlp_collector,
)
from tests.support.processes import Processes
from tests.support.receivers import INGEST_PATH, scripted_receiver
from tests.support.waiting import wait_caught_up

# What a receiver that is down for a moment answers (with 503).
DOWN = {"error": {"code": "DOWN", "message": "try later"}}
HEX32 = re.compile(r"^[0-9a-f]{32}$")
HEX16 = re.compile(r"^[0-9a-f]{16}$")


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Starts serversync processes; kills whatever still runs at the end and prints the logs."""
    with Processes(tmp_path, OPS_ENV) as launched:
        yield launched


# -- logs ----------------------------------------------------------------------------------------

URL_PASSWORD = "s3cretpw"  # noqa: S105 - a test value
BEARER = "abcdefSECRET123"
API_KEY = "sk-SECRET"
LEAKY_BODY = (
    '{"error": {"code": "UPSTREAM", "message": "upstream refused: '
    f'Authorization: Bearer {BEARER} with api_key={API_KEY}"}}}}'
).encode()


async def test_json_logs_carry_batch_fields_and_trace_ids_and_mask_secrets(
    backend_dsn: str, procs: Processes
) -> None:
    async with scripted_receiver() as receiver:
        receiver.fail_status, receiver.fail_body = 500, LEAKY_BODY
        receiver.fail_remaining = 1000  # until told otherwise
        process = procs.consumer(
            backend_dsn,
            receiver.with_password(URL_PASSWORD, "user"),
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
    assert receiver.statuses == [500] * len(failures) + [200]
    # Lines outside any batch carry no trace id.
    started = [e for e in entries if "health, readiness and metrics on" in e["msg"]]
    assert len(started) == 1 and "trace_id" not in started[0], started


async def test_log_level_warning_hides_the_batch_lines(backend_dsn: str, procs: Processes) -> None:
    async with scripted_receiver() as receiver:
        receiver.fail_status, receiver.fail_body = 503, DOWN
        receiver.fail_remaining = 1  # one 503: a warning that must still be logged
        process = procs.consumer(
            backend_dsn, receiver.url, log_format=None, SYNC_LOG_LEVEL="WARNING"
        )
        await insert_callers(backend_dsn, ["a", "b", "c"])
        await wait_caught_up(backend_dsn)
        process.terminate()
        assert await process.wait_exit(10) == 0
        entries = json_lines(process.log())

    assert receiver.statuses == [503, 200]
    assert [e["level"] for e in entries] == ["warning"], entries
    assert entries[0]["msg"].startswith(
        "consumer frontend-sync: delivery of seq 1..3 failed (attempt 1): "
    ), entries


async def test_text_log_format_gives_human_lines(backend_dsn: str, procs: Processes) -> None:
    async with scripted_receiver() as receiver:
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
    async with otlp_collector() as collector, scripted_receiver() as receiver:
        receiver.fail_status, receiver.fail_body = 500, LEAKY_BODY
        receiver.fail_remaining = 1
        process = procs.consumer(
            backend_dsn,
            receiver.with_password(URL_PASSWORD, "user"),
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

    assert receiver.statuses == [500, 200]
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
