"""The gauges that need the database (backlog, lag, DLQ, outbox), refreshed in the background.

A Prometheus scrape must not wait on PostgreSQL, and the exporter's callbacks cannot await, so a
task reads them every SYNC_METRICS_INTERVAL_SEC and the gauges hold the last values read.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer.core.events import Failure
from consumer.observability import instruments
from consumer.store import admin

log = logging.getLogger("serversync.gauges")

DLQ_STATUSES = ("pending", "retrying", "resolved", "dead")
# The failures that hold the offset (a refusal of content parks instead); every reason is set,
# to 0 when it is not the current one, so a streak that changed reason leaves no stale series.
FAILING_REASONS = tuple(f.value for f in Failure if not f.parks)


async def refresh_once(pool: AsyncConnectionPool[Any], consumer: str) -> None:
    """Read the consumer's backlog, lag, failing streak and DLQ counts and the outbox's size
    and age once."""
    async with pool.connection() as conn:
        rows = await admin.consumer_status(conn, consumer)
        outbox = await admin.outbox_stats(conn)
    labels = {"consumer": consumer}
    if rows:
        row = rows[0]
        instruments.BACKLOG.set(row["backlog"], labels)
        instruments.LAG.set(row["lag_seconds"] or 0.0, labels)
        failing_reason = row["failing_reason"]
        for reason in FAILING_REASONS:
            seconds = row["failing_seconds"] if reason == failing_reason else None
            instruments.DELIVERY_FAILING.set(
                seconds or 0.0, {"consumer": consumer, "reason": reason}
            )
        for status in DLQ_STATUSES:
            instruments.DLQ_MESSAGES.set(
                row[f"dlq_{status}"], {"consumer": consumer, "status": status}
            )
    instruments.OUTBOX_ROWS.set(outbox["outbox_rows"])
    instruments.OUTBOX_OLDEST_AGE.set(outbox["oldest_age_seconds"] or 0.0)


async def refresh_forever(pool: AsyncConnectionPool[Any], consumer: str, interval: float) -> None:
    """refresh_once every `interval` seconds until cancelled; database trouble is logged once
    per outage and the gauges keep their last values."""
    failing = False
    while True:
        try:
            await asyncio.wait_for(refresh_once(pool, consumer), timeout=max(interval, 5.0))
            if failing:
                log.info("gauges of %s: database reachable again", consumer)
            failing = False
        except (psycopg.Error, TimeoutError) as exc:
            if not failing:
                log.warning("gauges of %s: cannot read the database: %s", consumer, exc)
            failing = True
        await asyncio.sleep(interval)  # the refresh period, not a synchronisation
