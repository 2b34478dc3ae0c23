"""The parts of the recording-upload consumer kind: its sinks, its start-up check, and the outbox
store that marks the recordings it parks. The built-in recording-upload uploads to
FRONTEND_BASE_URL; a declared consumer of sink "recording-upload" to its own url
(`sinks_to`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from consumer.app.settings import ConfigError, SyncSettings
from consumer.app.startup import StartupError, open_pool
from consumer.core import failpoints
from consumer.core.events import DeadLetter, DeliveryError, Sink
from consumer.sinks.recording_files import RecordingsDir
from consumer.sinks.recording_upload import RecordingUploadSink, wanted_recording
from consumer.store.outbox import Leadership, OutboxStore
from consumer.store.recording_rows import RecordingStore

log = logging.getLogger("serversync")

NAME = "recording-upload"

# settings -> where uploads go: the receiver's base URL, and the secret requests are signed with.
Destination = Callable[[SyncSettings], tuple[str, str | None]]
# settings, the ledger pool -> a new sink.
Builder = Callable[[SyncSettings, AsyncConnectionPool[Any] | None], Sink]


def frontend(settings: SyncSettings) -> tuple[str, str | None]:
    """The built-in consumers' destination: FRONTEND_BASE_URL, signed with SYNC_SHARED_SECRET."""
    return settings.frontend_url, settings.signing_secret


def _ledger(pool: AsyncConnectionPool[Any] | None) -> RecordingStore:
    if pool is None:
        raise StartupError(f"{NAME} needs a connection pool to the backend database")
    return RecordingStore(pool)


def _sink(
    settings: SyncSettings,
    pool: AsyncConnectionPool[Any] | None,
    destination: Destination,
    *,
    for_dead_letters: bool,
) -> Sink:
    url, secret = destination(settings)
    return RecordingUploadSink(
        url,
        ledger=_ledger(pool),
        recordings=RecordingsDir(settings.recordings_dir),
        timeout_sec=settings.timeout_sec,
        shared_secret=secret,
        concurrency=settings.upload_concurrency,
        for_dead_letters=for_dead_letters,
    )


def sinks_to(destination: Destination) -> tuple[Builder, Builder]:
    """The delivery sink and the dead-letter sink of a recording-upload consumer that uploads
    to `destination`."""

    def delivery(settings: SyncSettings, pool: AsyncConnectionPool[Any] | None) -> Sink:
        return _sink(settings, pool, destination, for_dead_letters=False)

    def dead_letters(settings: SyncSettings, pool: AsyncConnectionPool[Any] | None) -> Sink:
        return _sink(settings, pool, destination, for_dead_letters=True)

    return delivery, dead_letters


def delivery_sink(settings: SyncSettings, pool: AsyncConnectionPool[Any] | None) -> Sink:
    """The sink the running consumer uploads through (`pool`: the backend database, whose
    recordings rows it reads and marks)."""
    return _sink(settings, pool, frontend, for_dead_letters=False)


def dead_letter_sink(settings: SyncSettings, pool: AsyncConnectionPool[Any] | None) -> Sink:
    """The sink that redelivers a parked recording for an operator: it makes the row 'pending'
    while it is tried, then 'uploaded', or 'failed' again."""
    return _sink(settings, pool, frontend, for_dead_letters=True)


def ledger_pool_size(settings: SyncSettings) -> int:
    """One connection per upload that may run at once."""
    return settings.upload_concurrency


async def check(settings: SyncSettings) -> None:
    """Fail at start, not on the first recording, when recording-upload cannot work here."""
    problem = RecordingsDir(settings.recordings_dir).check()
    if problem is not None:
        raise ConfigError(f"{problem} (set RECORDINGS_DIR to the backend's recordings folder)")
    async with open_pool(settings.database_url, "check", max_size=1) as pool:
        if not await RecordingStore(pool).table_present():
            raise StartupError(
                "DATABASE_URL has no public.recordings table: a recording upload needs one (the "
                "backend's own, or the example: `serversync migrate --with-examples`)"
            )


def outbox_store(
    pool: AsyncConnectionPool[Any], ledger_pool: AsyncConnectionPool[Any] | None
) -> OutboxStore:
    """The outbox store of a recording-upload consumer that delivers (not to the null sink)."""
    return RecordingParksOutbox(pool, _ledger(ledger_pool))


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
        """Take the lead, then mark failed the pending rows whose upload is parked."""
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
        """Commit, then mark failed the rows of the recordings this commit parked."""
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
