"""serversync's metrics and tracer, through the OpenTelemetry API only.

The parts that do the work record here; what happens to the numbers (Prometheus scraping, OTLP)
is decided once per process by telemetry.setup_telemetry. Until then, and in tests that never
set it up, the API's no-op provider makes every call here nearly free.

Prometheus names (the exporter adds _total to counters and the unit to the rest):
serversync_events_total{consumer,outcome}, serversync_batch_size_events,
serversync_batch_duration_seconds, serversync_delivery_attempts, serversync_wakeups_total
{consumer,reason}, serversync_leader{consumer}, serversync_backlog_events{consumer},
serversync_lag_seconds{consumer}, serversync_dlq_messages{consumer,status},
serversync_outbox_rows, serversync_outbox_oldest_age_seconds,
serversync_delivery_failures_total{consumer,reason},
serversync_delivery_failing_seconds{consumer,reason}.
"""

from __future__ import annotations

from opentelemetry import metrics, trace

_meter = metrics.get_meter("serversync")
tracer = trace.get_tracer("serversync")

# Labelled with an Outcome (consumer/core/events.py): delivered, already_processed (HTTP 409),
# retried (counted once per failed attempt), parked, skipped (not for this consumer: another
# entity type, or from its target node; never sent, passed by the offset).
EVENTS = _meter.create_counter(
    "serversync.events",
    description="Events handled, by outcome: delivered, already_processed, retried, parked, "
    "skipped",
    unit="{event}",
)
BATCH_SIZE = _meter.create_histogram(
    "serversync.batch.size.events",
    description="Events per delivered batch",
    explicit_bucket_boundaries_advisory=[1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 5000],
)
BATCH_DURATION = _meter.create_histogram(
    "serversync.batch.duration",
    description="Time to deliver a batch and move the offset, retries included",
    unit="s",
    explicit_bucket_boundaries_advisory=[
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        30,
        60,
        300,
    ],
)
DELIVERY_ATTEMPTS = _meter.create_histogram(
    "serversync.delivery.attempts",
    description="Attempts a batch took until it was delivered or parked",
    explicit_bucket_boundaries_advisory=[1, 2, 3, 4, 5, 6, 8, 10, 20],
)
DELIVERY_FAILURES = _meter.create_counter(
    "serversync.delivery.failures",
    description="Failed delivery attempts, by reason: receiver_unavailable, wrong_destination, "
    "content_refused, internal_error",
)
DELIVERY_FAILING = _meter.create_gauge(
    "serversync.delivery.failing",
    description="How long the consumer's deliveries have been failing with its offset held "
    "(0 while they go through), by reason",
    unit="s",
)
WAKEUPS = _meter.create_counter(
    "serversync.wakeups",
    description="Why the consumer's loop slept: notify, poll, recheck, or paced (fast traffic)",
)
LEADER = _meter.create_gauge(
    "serversync.leader", description="1 while this process leads its consumer, else 0"
)
BACKLOG = _meter.create_gauge(
    "serversync.backlog.events",
    description="Events in the outbox the consumer has not passed (estimated beyond 10,000)",
)
LAG = _meter.create_gauge(
    "serversync.lag", description="Age of the oldest event the consumer has not passed", unit="s"
)
DLQ_MESSAGES = _meter.create_gauge(
    "serversync.dlq.messages", description="Dead-letter messages of the consumer, by status"
)
OUTBOX_ROWS = _meter.create_gauge(
    "serversync.outbox.rows", description="Rows in sync.events_outbox (PostgreSQL's estimate)"
)
OUTBOX_OLDEST_AGE = _meter.create_gauge(
    "serversync.outbox.oldest.age", description="Age of the oldest outbox row", unit="s"
)
