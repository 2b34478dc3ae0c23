"""The metrics a consumer exports."""

from __future__ import annotations

# The metrics every consumer process exports on GET /metrics (Prometheus names, as written by the
# OpenTelemetry Prometheus exporter). The dashboard and the alert rules may name only these (and a
# histogram's _bucket/_sum/_count series); a test scraping a live consumer can check them too.
EXPORTED_METRICS: tuple[str, ...] = (
    "serversync_backlog_events",  # gauge {consumer}: events not yet delivered
    "serversync_lag_seconds",  # gauge {consumer}: age of the oldest undelivered event
    "serversync_events_total",  # counter {consumer, outcome}: success|retry|dead|conflict_processed
    "serversync_batch_size_events",  # histogram {consumer}
    "serversync_batch_duration_seconds",  # histogram {consumer}
    "serversync_delivery_attempts",  # histogram {consumer}
    "serversync_leader",  # gauge {consumer}: 1 on the leading process, 0 on standbys
    "serversync_wakeups_total",  # counter {consumer, reason}: notify|poll|recheck
    "serversync_dlq_messages",  # gauge {consumer, status}: pending|retrying|resolved|dead
    "serversync_outbox_rows",  # gauge
    "serversync_outbox_oldest_age_seconds",  # gauge
    # counter {consumer, reason}: receiver_unavailable|wrong_destination|content_refused|
    # internal_error
    "serversync_delivery_failures_total",
    # gauge {consumer, reason}: how long deliveries have failed with the offset held (0: not)
    "serversync_delivery_failing_seconds",
)
