"""The reference receiver's process: `serversync ingest-server`."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import psycopg
from aiohttp import web

from consumer.app.settings import ConfigError, ReceiverSettings
from consumer.app.startup import (
    StartupError,
    connect_or_explain,
    install_stop_handlers,
    open_pool,
)
from consumer.receiver.app import BodyReads, build_app
from consumer.receiver.mapping import MappingError, read_mapping, resolve
from consumer.receiver.store import EntityStore
from consumer.receiver.tables import TableWriter
from consumer.receiver.uploads import RecordingFiles
from consumer.store import migrations

log = logging.getLogger("serversync")


def _recording_files(settings: ReceiverSettings) -> RecordingFiles:
    return RecordingFiles(
        settings.recordings_store_dir,
        max_bytes=settings.max_recording_bytes,
        public_base_url=str(settings.public_base_url) if settings.public_base_url else None,
        max_concurrent_uploads=settings.max_concurrent_uploads,
        body_idle_timeout_sec=settings.body_idle_timeout_sec,
        min_upload_bytes_per_sec=settings.min_upload_bytes_per_sec,
        min_free_bytes=settings.min_free_bytes,
    )


async def table_writer(conn: psycopg.AsyncConnection[Any], path: Path) -> TableWriter:
    """The writer of the mapping file at `path`, checked against the database of `conn`;
    ConfigError (one line, exit 2) naming the file and what is wrong."""
    try:
        return TableWriter(await resolve(conn, read_mapping(path)))
    except MappingError as exc:
        raise ConfigError(f"INGEST_MAPPING_FILE {path}: {exc}") from None


async def run_ingest_server(settings: ReceiverSettings, *, insecure: bool = False) -> None:
    """`serversync ingest-server`: migrate the receiver's database, then serve until signalled."""
    if not settings.shared_secrets and not insecure:
        raise StartupError(
            "SYNC_SHARED_SECRET is not set: the receiver would accept writes from anyone who can "
            "reach its port; set it (the consumers need the same value) or pass --insecure for a "
            "local demo"
        )
    dsn = settings.frontend_database_url
    tables = None
    async with await connect_or_explain(dsn, "ingest-migrate", "FRONTEND_DATABASE_URL") as conn:
        await migrations.migrate(conn, ["receiver"])
        if settings.mapping_file is not None:
            tables = await table_writer(conn, settings.mapping_file)
    recordings = _recording_files(settings)
    try:
        await asyncio.to_thread(recordings.prepare)
    except OSError as exc:
        raise StartupError(
            f"cannot use RECORDINGS_STORE_DIR {settings.recordings_store_dir}: "
            f"{exc.strerror or exc}"
        ) from None
    async with open_pool(dsn, "ingest", max_size=8) as pool:
        app = build_app(
            EntityStore(pool, tables),
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
        if tables is not None:
            log.info(
                "applying entity types %s into their tables (INGEST_MAPPING_FILE %s)",
                ", ".join(tables.entity_types),
                settings.mapping_file,
            )
        stop = asyncio.Event()
        install_stop_handlers(stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
    log.info("ingest-server stopped")
