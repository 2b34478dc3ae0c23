"""Puts the parts together: a consumer process, the receiver, and the checks both need first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import psycopg
from aiohttp import web
from psycopg import conninfo
from psycopg_pool import AsyncConnectionPool

from consumer.app.settings import ConfigError, ReceiverSettings, SyncSettings
from consumer.core import failpoints
from consumer.core.events import DeadLetter, DeliveryError, Sink
from consumer.observability.telemetry import Telemetry
from consumer.ops import gauges
from consumer.ops.deadletters import DeadLetters, SinkFactory
from consumer.ops.port import PING_TIMEOUT_SEC, Health, MetricsEndpoint, build_ops_app
from consumer.receiver.app import BodyReads, build_app
from consumer.receiver.store import EntityStore
from consumer.receiver.uploads import RecordingFiles
from consumer.runtime.wakeup import NotifyListener
from consumer.runtime.worker import ConsumerRuntime, RuntimeConfig
from consumer.sinks.frontend_sync import FrontendSyncSink
from consumer.sinks.null import NullSink
from consumer.sinks.recording_files import RecordingsDir
from consumer.sinks.recording_upload import RecordingUploadSink, wanted_recording
from consumer.store import migrations
from consumer.store.db import connect, connect_kwargs, mask_dsn
from consumer.store.dlq import DlqStore
from consumer.store.leadership import LeaderLock
from consumer.store.outbox import Leadership, OutboxStore
from consumer.store.recording_rows import RecordingStore

log = logging.getLogger("serversync")

CONSUMERS = ("frontend-sync", "recording-upload")
SINKS = ("default", "null")


class StartupError(Exception):
    """The process cannot start: the message says what to fix, in one line."""


async def connect_or_explain(dsn: str, role: str, what: str) -> psycopg.AsyncConnection[Any]:
    """An autocommit connection, or a StartupError naming the variable and the masked DSN."""
    try:
        conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        # libpq's parse errors quote the offending piece of the string: it may be the password.
        raise ConfigError(
            f"{what} is not a valid connection string (key=value pairs, or a postgresql:// URL "
            "with special characters percent-encoded)"
        ) from None
    try:
        return await connect(dsn, role)
    except psycopg.Error as exc:
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else type(exc).__name__
        raise StartupError(f"cannot connect to {what} ({mask_dsn(dsn)}): {first}") from None


async def check_database(dsn: str, components: list[str], what: str) -> None:
    """Fail with a clear message if the database is unreachable or lacks migrations."""
    async with await connect_or_explain(dsn, "check", what) as conn:
        for component in components:
            try:
                todo = await migrations.pending(conn, component)
            except migrations.MigrationError as exc:
                raise StartupError(str(exc)) from None
            if todo:
                raise StartupError(
                    f"{what} lacks {len(todo)} {component} migration(s) "
                    f"(first: {todo[0].version}_{todo[0].name}); run `serversync migrate`"
                )


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
    if sink == "null":
        return NullSink()
    if consumer == "frontend-sync":
        return FrontendSyncSink(
            settings.frontend_url,
            timeout_sec=settings.timeout_sec,
            shared_secret=settings.signing_secret,
        )
    if consumer == "recording-upload":
        if pool is None:
            raise StartupError("recording-upload needs a connection pool to the backend database")
        return RecordingUploadSink(
            settings.frontend_url,
            ledger=RecordingStore(pool),
            recordings=RecordingsDir(settings.recordings_dir),
            timeout_sec=settings.timeout_sec,
            shared_secret=settings.signing_secret,
            concurrency=settings.upload_concurrency,
            for_dead_letters=for_dead_letters,
        )
    raise StartupError(f"unknown consumer {consumer!r} (known: {', '.join(CONSUMERS)})")


class RecordingParksOutbox(OutboxStore):
    """recording-upload's outbox store: once a commit that parked recordings is done, their rows
    are marked 'failed', and on taking the lead every row still pending whose upload is parked
    (a mark lost to a crash after the commit) is marked too.

    After the commit, never before it: a mark made first outlives a commit that then fails (a
    crash, a lost lead); the batch is delivered again, the sink skips a row that says 'failed',
    and the event passes without being parked, out of an operator's reach. Made after it, a
    lost mark is only late. A mark that fails is logged, never raised: the commit is done, and
    doing it again would count its events twice. The marks commit durably, which makes the
    park written before them durable too (one WAL).
    """

    def __init__(self, pool: AsyncConnectionPool[Any], ledger: RecordingStore) -> None:
        super().__init__(pool)
        self._ledger = ledger

    async def take_leadership(self, consumer: str) -> Leadership:
        leadership = await super().take_leadership(consumer)
        try:
            marked = await self._ledger.fail_parked(consumer)
        except psycopg.Error as exc:
            log.warning("%s: could not mark parked recordings failed: %s", consumer, exc)
        else:
            if marked:
                log.info("%s: %d parked recording(s) marked failed", consumer, marked)
        return leadership

    async def commit_offset(self, *args: Any, **kwargs: Any) -> None:
        await super().commit_offset(*args, **kwargs)
        parked: Sequence[DeadLetter] = kwargs.get("parked", ())
        if parked:
            failpoints.reach("recording-upload.after-park")
        for dead in parked:
            recording_id = wanted_recording(dead.entry_json)
            if recording_id is None:
                continue
            try:
                marked = await self._ledger.mark_failed(recording_id)
            except DeliveryError as exc:
                log.warning(
                    "recording %s: upload parked, but the row could not be marked failed "
                    "(it is when a consumer next takes the lead): %s",
                    recording_id,
                    exc,
                )
            else:
                if marked:
                    log.info("recording %s: upload parked; row marked failed", recording_id)


def runtime_config(settings: SyncSettings, consumer: str = "frontend-sync") -> RuntimeConfig:
    """The loop's knobs from the settings."""
    return RuntimeConfig(
        batch_size=settings.batch_size,
        poll_interval=settings.poll_interval_sec,
        recheck_interval=settings.recheck_interval_ms / 1000,
        standby_interval=settings.standby_interval_sec,
        retry_initial=settings.retry_initial_sec,
        retry_max=settings.retry_max_sec,
        shutdown_timeout=settings.shutdown_timeout_sec,
        linger=settings.linger_ms / 1000,
        batch_wait=settings.batch_wait_ms / 1000,
        batch_wait_min_rate=settings.batch_wait_min_rate,
        max_attempts=settings.max_attempts,
        dlq_max_retries=settings.dlq_max_retries,
        # recording-upload runs SYNC_UPLOAD_CONCURRENCY uploads inside one batch instead.
        max_in_flight=1 if consumer == "recording-upload" else settings.max_in_flight,
    )


@contextlib.asynccontextmanager
async def open_pool(
    dsn: str, role: str, *, max_size: int = 4, synchronous_commit: bool = True
) -> AsyncIterator[AsyncConnectionPool[Any]]:
    """A psycopg pool for the hot path.

    No check on checkout: it would cost a round trip per query. A connection broken by a server
    restart fails its next query, the pool drops it, and the caller's retry gets a new one.
    """
    pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
        dsn,
        min_size=1,
        max_size=max_size,
        kwargs={
            "autocommit": True,
            **connect_kwargs(role, synchronous_commit=synchronous_commit),
        },
        open=False,
        reconnect_timeout=0,
        timeout=30,
    )
    await pool.open(wait=False)
    try:
        yield pool
    finally:
        await pool.close()


@contextlib.asynccontextmanager
async def consumer_runtime(
    settings: SyncSettings, consumer: str, sink: str = "default"
) -> AsyncIterator[ConsumerRuntime]:
    """A ready-to-run consumer (the caller runs it and asks it to stop)."""
    if consumer not in CONSUMERS:
        raise StartupError(f"unknown consumer {consumer!r} (known: {', '.join(CONSUMERS)})")
    dsn = settings.database_url
    async with contextlib.AsyncExitStack() as stack:
        # Offset commits do not wait for the WAL flush: one lost in a server crash only sends its
        # batch again (at-least-once, as after any crash), and a busy consumer's flushes no
        # longer queue with its producers' commits (bench/producer.py). Taking the lead still
        # commits durably (OutboxStore.take_leadership), and so does the recording ledger.
        pool = await stack.enter_async_context(
            open_pool(dsn, f"run:{consumer}", synchronous_commit=False)
        )
        sink_pool = None
        store = OutboxStore(pool)
        if consumer == "recording-upload" and sink != "null":
            sink_pool = await stack.enter_async_context(
                open_pool(dsn, f"run:{consumer}:ledger", max_size=settings.upload_concurrency)
            )
            store = RecordingParksOutbox(pool, RecordingStore(sink_pool))
        yield ConsumerRuntime(
            consumer,
            store=store,
            sink=make_sink(consumer, settings, sink, pool=sink_pool),
            lock=LeaderLock(dsn, consumer),
            listener=NotifyListener(dsn, consumer) if settings.listen else None,
            config=runtime_config(settings, consumer),
        )


def _install_stop_handlers(stop: Callable[[], object]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)


async def run_consumer(
    settings: SyncSettings,
    consumer: str,
    sink: str = "default",
    *,
    telemetry: Telemetry | None = None,
) -> None:
    """`serversync run CONSUMER`: until SIGTERM/SIGINT."""
    if sink != "null":
        # Before anything else: a consumer that would deliver to no configured frontend does
        # not start (exit 2, one line).
        _ = settings.frontend_url
    await check_database(settings.database_url, ["backend"], "DATABASE_URL")
    if consumer == "recording-upload" and sink != "null":
        await check_recording_upload(settings)
    async with (
        consumer_runtime(settings, consumer, sink) as runtime,
        serve_ops_http(settings, runtime, sink=sink, telemetry=telemetry),
    ):
        _install_stop_handlers(runtime.request_stop)
        log.info(
            "consumer %s starting (batch %d, poll %ss, sink %s)",
            consumer,
            settings.batch_size,
            settings.poll_interval_sec,
            runtime.sink.name,
        )
        await runtime.run()
    log.info("consumer %s stopped", consumer)


async def check_recording_upload(settings: SyncSettings) -> None:
    """Fail at start, not on the first recording, when recording-upload cannot work here."""
    problem = RecordingsDir(settings.recordings_dir).check()
    if problem is not None:
        raise ConfigError(f"{problem} (set RECORDINGS_DIR to the backend's recordings folder)")
    async with open_pool(settings.database_url, "check", max_size=1) as pool:
        if not await RecordingStore(pool).table_present():
            raise StartupError(
                "DATABASE_URL has no public.recordings table: recording-upload needs one (the "
                "backend's own, or the example: `serversync migrate --with-examples`)"
            )


def dlq_sinks(
    settings: SyncSettings, sink: str = "default", *, pool: AsyncConnectionPool[Any] | None = None
) -> SinkFactory:
    """Makes the sink of a parked event's consumer, for retries from the dead-letter queue."""

    def make(consumer: str) -> Sink:
        if consumer not in CONSUMERS:
            raise LookupError(f"no such consumer in this build (known: {', '.join(CONSUMERS)})")
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


async def run_ingest_server(settings: ReceiverSettings, *, insecure: bool = False) -> None:
    """`serversync ingest-server`: migrate the receiver's database, then serve until signalled."""
    if not settings.shared_secrets and not insecure:
        raise StartupError(
            "SYNC_SHARED_SECRET is not set: the receiver would accept writes from anyone who can "
            "reach its port; set it (the consumers need the same value) or pass --insecure for a "
            "local demo"
        )
    dsn = settings.frontend_database_url
    async with await connect_or_explain(dsn, "ingest-migrate", "FRONTEND_DATABASE_URL") as conn:
        await migrations.migrate(conn, ["receiver"])
    recordings = RecordingFiles(
        settings.recordings_store_dir,
        max_bytes=settings.max_recording_bytes,
        public_base_url=str(settings.public_base_url) if settings.public_base_url else None,
        max_concurrent_uploads=settings.max_concurrent_uploads,
        body_idle_timeout_sec=settings.body_idle_timeout_sec,
        min_upload_bytes_per_sec=settings.min_upload_bytes_per_sec,
        min_free_bytes=settings.min_free_bytes,
    )
    try:
        await asyncio.to_thread(recordings.prepare)
    except OSError as exc:
        raise StartupError(
            f"cannot use RECORDINGS_STORE_DIR {settings.recordings_store_dir}: "
            f"{exc.strerror or exc}"
        ) from None
    async with open_pool(dsn, "ingest", max_size=8) as pool:
        app = build_app(
            EntityStore(pool),
            max_body_bytes=settings.max_body_bytes,
            shared_secret=settings.shared_secrets,
            recordings=recordings,
            body_reads=BodyReads(
                max_concurrent=settings.max_concurrent_bodies,
                idle_timeout=settings.body_idle_timeout_sec,
                min_rate=settings.min_upload_bytes_per_sec,
            ),
        )
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        host, port = runner.addresses[0][:2]
        accepted = len(settings.shared_secrets)
        log.info(
            "ingest-server listening on http://%s:%d (%s)",
            host,
            port,
            f"requests signed with any of {accepted} secret(s)"
            if accepted
            else "unsigned requests accepted: --insecure",
        )
        stop = asyncio.Event()
        _install_stop_handlers(stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    log.info("ingest-server stopped")
