"""Puts a consumer process together: its pool, outbox store, sink, the entries it does not send
and runtime from its kind (kinds.py: built in, or declared in SYNC_CONSUMERS_FILE), and the HTTP
port beside it (health, readiness, metrics, the DLQ admin API).

The receiver's process is ingest_server.py; what both need first is startup.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import psycopg
from aiohttp import web
from psycopg_pool import AsyncConnectionPool

from consumer.app.kinds import KINDS, consumer_kind
from consumer.app.settings import ConfigError, SyncSettings, runtime_config
from consumer.app.startup import (
    StartupError,
    check_database,
    connect_or_explain,
    install_stop_handlers,
    open_pool,
)
from consumer.core.errors import first_line
from consumer.core.events import Sink
from consumer.observability.telemetry import Telemetry
from consumer.ops import gauges
from consumer.ops.deadletters import DeadLetters, SinkFactory
from consumer.ops.port import PING_TIMEOUT_SEC, Health, MetricsEndpoint, build_ops_app
from consumer.runtime.snapshotting import NewConsumerSnapshots, StartPolicy
from consumer.runtime.wakeup import NotifyListener
from consumer.runtime.worker import ConsumerRuntime
from consumer.sinks.null import NullSink
from consumer.store.db import connect_kwargs
from consumer.store.dlq import DlqStore
from consumer.store.leadership import LeaderLock
from consumer.store.outbox import OutboxStore

# Callers (the command line, tests) take the start-up pieces from here with the rest.
__all__ = [
    "CONSUMERS",
    "SINKS",
    "StartupError",
    "check_database",
    "connect_or_explain",
    "consumer_runtime",
    "dlq_sinks",
    "make_sink",
    "open_pool",
    "run_consumer",
    "serve_ops_http",
]

log = logging.getLogger("serversync")

# The built-in consumers; SYNC_CONSUMERS_FILE may declare more.
CONSUMERS = tuple(KINDS)
# "null" accepts every batch without sending it (benchmarks), whatever the consumer's kind.
SINKS = ("default", "null")


def make_sink(
    consumer: str,
    settings: SyncSettings,
    sink: str = "default",
    *,
    pool: AsyncConnectionPool[Any] | None = None,
    for_dead_letters: bool = False,
) -> Sink:
    """The sink a consumer delivers to (`pool`: the backend database, for sinks that update
    it; `for_dead_letters`: the sink redelivers events an operator retries from the dead-letter
    queue)."""
    kind = consumer_kind(consumer, settings)
    if sink == "null":
        return NullSink()
    build = kind.dead_letter_sink if for_dead_letters else kind.sink
    return build(settings, pool)


@contextlib.asynccontextmanager
async def consumer_runtime(
    settings: SyncSettings, consumer: str, sink: str = "default"
) -> AsyncIterator[ConsumerRuntime]:
    """A ready-to-run consumer (the caller runs it and asks it to stop)."""
    kind = consumer_kind(consumer, settings)
    delivers = sink != "null"
    # `--sink null` measures a plain consumer: it passes nothing over either.
    entry_filter = kind.entry_filter(settings) if delivers else None
    dsn = settings.database_url
    async with contextlib.AsyncExitStack() as stack:
        # Offset commits do not wait for the WAL flush: one lost in a server crash only sends its
        # batch again (at-least-once, as after any crash), and a busy consumer's flushes no
        # longer queue with its producers' commits (bench/producer.py). Taking the lead still
        # commits durably (OutboxStore.take_leadership), and so does the recording ledger.
        pool = await stack.enter_async_context(
            open_pool(dsn, f"run:{consumer}", synchronous_commit=False)
        )
        ledger_pool = None
        if delivers and kind.ledger_pool_size is not None:
            ledger_pool = await stack.enter_async_context(
                open_pool(dsn, f"run:{consumer}:ledger", max_size=kind.ledger_pool_size(settings))
            )
        store = kind.outbox_store(pool, ledger_pool) if delivers else OutboxStore(pool)
        if entry_filter is not None and entry_filter.target_node is not None:
            await _check_target_node(consumer, store, entry_filter.target_node)
        yield ConsumerRuntime(
            consumer,
            store=store,
            sink=make_sink(consumer, settings, sink, pool=ledger_pool),
            lock=LeaderLock(dsn, consumer),
            listener=NotifyListener(dsn, consumer) if settings.listen else None,
            # A kind whose sink runs its own concurrency inside a batch takes one at a time.
            config=dataclasses.replace(
                runtime_config(settings), max_in_flight=kind.batches_in_flight(settings)
            ),
            entry_filter=entry_filter,
            start=StartPolicy(settings.start_from, kind.entity_types if delivers else None),
            snapshots=NewConsumerSnapshots(
                consumer,
                dsn,
                retry_initial=settings.retry_initial_sec,
                retry_max=settings.retry_max_sec,
            ),
        )


async def _check_target_node(consumer: str, store: OutboxStore, target: str) -> None:
    """A consumer whose target node is its own database's node would pass over every change
    made here (their wire origin is this node's name): refused at start. The node name is read
    once, here."""
    try:
        own = await store.node_name()
    except psycopg.Error as exc:
        raise StartupError(
            f"consumer {consumer}: cannot read this database's node name: {first_line(exc)}"
        ) from None
    if own == target:
        raise ConfigError(
            f"consumer {consumer}: its target node {target!r} is this database's own node name "
            "(sync.node_name()): it would send none of the changes made here; name the node it "
            "delivers to"
        )


async def run_consumer(
    settings: SyncSettings,
    consumer: str,
    sink: str = "default",
    *,
    telemetry: Telemetry | None = None,
) -> None:
    """`serversync run CONSUMER`: until SIGTERM/SIGINT."""
    kind = consumer_kind(consumer, settings)
    if sink != "null":
        # Before anything else: a consumer that would deliver to no configured receiver, or
        # sign with a secret that is missing or weak, does not start (exit 2, one line).
        kind.check_settings(settings)
    await check_database(settings.database_url, ["backend"], "DATABASE_URL")
    if sink != "null" and kind.check is not None:
        await kind.check(settings)
    async with (
        consumer_runtime(settings, consumer, sink) as runtime,
        serve_ops_http(settings, runtime, sink=sink, telemetry=telemetry),
    ):
        install_stop_handlers(runtime.request_stop)
        log.info(
            "consumer %s starting (batch %d, poll %ss, sink %s, sends %s)",
            consumer,
            settings.batch_size,
            settings.poll_interval_sec,
            runtime.sink.name,
            runtime.entry_filter.describe() if runtime.entry_filter else "everything",
        )
        await runtime.run()
    log.info("consumer %s stopped", consumer)


def dlq_sinks(
    settings: SyncSettings, sink: str = "default", *, pool: AsyncConnectionPool[Any] | None = None
) -> SinkFactory:
    """Makes the sink of a parked event's consumer, for retries from the dead-letter queue (a
    LookupError, which DeadLetters expects, for a consumer this build does not run)."""

    def make(consumer: str) -> Sink:
        return make_sink(consumer, settings, sink, pool=pool, for_dead_letters=True)

    return make


@contextlib.asynccontextmanager
async def serve_ops_http(
    settings: SyncSettings,
    runtime: ConsumerRuntime,
    *,
    sink: str = "default",
    telemetry: Telemetry | None = None,
) -> AsyncIterator[str]:
    """The process's HTTP port while the block runs: /healthz, /readyz, /metrics (with
    `telemetry`), and the DLQ admin API when SYNC_ADMIN_TOKEN is set (an unauthenticated way to
    replay events must not appear by default). Also keeps the database gauges fresh. Yields the
    base URL."""
    token = settings.admin_token
    # A pool of its own: probes, gauges and operator requests never wait behind the delivery
    # loop's connections, and a stuck delivery never makes the process look dead.
    async with open_pool(settings.database_url, "ops", max_size=2) as pool:
        service = (
            DeadLetters(DlqStore.over_pool(pool), dlq_sinks(settings, sink, pool=pool))
            if token
            else None
        )

        async def ping() -> None:
            # A connection of its own, not one from the pool: while the server is down the pool
            # only times out, and a new connection says why (refused, auth, shutting down).
            async with await psycopg.AsyncConnection.connect(
                settings.database_url,
                autocommit=True,
                connect_timeout=max(1, int(PING_TIMEOUT_SEC) - 1),
                **connect_kwargs("readyz"),
            ) as conn:
                await conn.execute("SELECT 1")

        app = build_ops_app(
            Health(runtime.consumer, lambda: runtime.stats.state, ping, runtime.delivery_health),
            metrics_endpoint=MetricsEndpoint(telemetry.render_prometheus) if telemetry else None,
            dead_letters=service,
            token=token,
        )
        runner = web.AppRunner(
            app,
            access_log=None,
            handle_signals=False,
            # A retry-all in flight must not hold the process's stop for aiohttp's default 60 s.
            shutdown_timeout=settings.shutdown_timeout_sec,
        )
        await runner.setup()
        refresher = asyncio.create_task(
            gauges.refresh_forever(pool, runtime.consumer, settings.metrics_interval_sec)
        )
        try:
            site = web.TCPSite(runner, settings.http_host, settings.http_port)
            try:
                await site.start()
            except OSError as exc:
                raise StartupError(
                    f"cannot listen on {settings.http_host}:{settings.http_port} "
                    f"(SYNC_HTTP_HOST/SYNC_HTTP_PORT): {exc.strerror or exc}"
                ) from None
            host, port = runner.addresses[0][:2]
            url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
            log.info(
                "consumer %s: health, readiness and metrics on %s%s",
                runtime.consumer,
                url,
                " (and the DLQ admin API)"
                if token
                else "; DLQ admin API off (no SYNC_ADMIN_TOKEN)",
                extra={"http_url": url},
            )
            yield url
        finally:
            refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresher
            await runner.cleanup()
            if service is not None:
                await service.close()
