"""Real recordings on disk for the recording-upload tests: WAV files, rows, the real receiver
(in this process, with a middleware that counts and can hold uploads, or as a subprocess), and
`serversync run recording-upload` as a real subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psycopg
from aiohttp import web
from aiohttp.typedefs import Middleware

from consumer.core.events import Position
from consumer.devtools.demo import tone_wav
from consumer.devtools.devdb import free_port
from consumer.receiver.app import Handler
from consumer.receiver.uploads import UPLOAD_PATH, RecordingFiles
from tests.conftest import fetch_all, serve_receiver, wait_until
from tests.support.backend import execute
from tests.support.processes import Processes, ServersyncProcess, process_env

SECRET = "recording-test-secret-0123456789"  # noqa: S105 (test-only)
RECORDINGS_CONSUMER = "recording-upload"


def wav_bytes(seconds: float = 0.2, rate: int = 8000, tone_hz: float = 440.0) -> bytes:
    """A short mono 16-bit PCM WAV: a sine tone (the demo's)."""
    return tone_wav(tone_hz, seconds, rate)


def write_large_wav(path: Path, size: int) -> None:
    """A WAV of `size` bytes: a real header, then silence, written as a sparse file (nothing of
    it is ever held in memory)."""
    frames = (size - 44) // 2
    header = wav_bytes(seconds=0)
    assert len(header) == 44
    # The header names the data size: patch RIFF and data chunk lengths.
    header = header[:4] + struct.pack("<I", 36 + frames * 2) + header[8:40]
    header += struct.pack("<I", frames * 2)
    with path.open("wb") as out:
        out.write(header)
        out.truncate(size)


@dataclass(frozen=True)
class Recording:
    """One recording made by `make_recording`: its ids, folder and audio bytes."""

    call_id: str
    recording_id: str
    folder: Path
    audio: bytes


async def make_recording(
    dsn: str,
    recordings_dir: Path,
    *,
    audio: bytes | None = None,
    meta: Any = None,
    file_path: str | None = None,
    write_files: bool = True,
    call_id: str | None = None,
    upload_status: str = "pending",
    audio_size: int | None = None,
) -> Recording:
    """A call with a recording: files under recordings_dir/<callId>/ first, then the rows (one
    transaction: two events, the call_log's and the recording's). With `audio_size`, mixed.wav
    is a sparse WAV of that size (its bytes are not kept in the Recording)."""
    call_id = call_id or str(uuid.uuid4())
    recording_id = str(uuid.uuid4())
    folder = recordings_dir / call_id
    data = b"" if audio_size is not None else wav_bytes() if audio is None else audio
    if write_files:
        folder.mkdir(parents=True)
        if audio_size is not None:
            write_large_wav(folder / "mixed.wav", audio_size)
        else:
            (folder / "mixed.wav").write_bytes(data)
        meta_value = {"callId": call_id, "codec": "pcm_s16le"} if meta is None else meta
        meta_text = meta_value if isinstance(meta_value, bytes) else orjson.dumps(meta_value)
        (folder / "meta.json").write_bytes(meta_text)
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn, conn.transaction():
        await conn.execute(
            "INSERT INTO call_logs (id, caller_number, callee_number) VALUES (%s, '0311112222', "
            "'0501234567')",
            (call_id,),
        )
        await conn.execute(
            "INSERT INTO recordings (id, call_log_id, file_path, upload_status) "
            "VALUES (%s, %s, %s, %s)",
            (recording_id, call_id, file_path or f"{call_id}/mixed.wav", upload_status),
        )
    return Recording(call_id, recording_id, folder, data)


async def add_recording(dsn: str, recording: Recording, name: str) -> Recording:
    """The row of another recording of `recording`'s call, whose audio `name` is in the same
    <callId>/ folder already (it shares the folder's meta.json): one event."""
    data = (recording.folder / name).read_bytes()
    recording_id = str(uuid.uuid4())
    await execute(
        dsn,
        "INSERT INTO recordings (id, call_log_id, file_path) VALUES (%s, %s, %s)",
        params=(recording_id, recording.call_id, f"{recording.call_id}/{name}"),
    )
    return Recording(recording.call_id, recording_id, recording.folder, data)


async def upload_statuses(dsn: str, recording_id: str) -> list[str]:
    """upload_status in each event about the recording, in outbox order: every state its row
    went through."""
    rows = await fetch_all(
        dsn,
        "SELECT o.payload->>'upload_status' FROM sync.events_outbox o "
        "WHERE o.entity_type = 'recording' AND o.entity_id = %s ORDER BY o.txid, o.seq",
        (recording_id,),
    )
    return [row[0] for row in rows]


async def recording_row(dsn: str, recording_id: str) -> tuple[str, str | None]:
    """(upload_status, s3_url) of a recording."""
    rows = await fetch_all(
        dsn, "SELECT upload_status, s3_url FROM recordings WHERE id = %s", (recording_id,)
    )
    assert rows, f"no recordings row {recording_id}"
    return rows[0][0], rows[0][1]


async def wait_uploaded(dsn: str, recording_id: str, timeout: float = 10.0) -> str:
    """Wait until the row is marked uploaded; its s3_url."""

    async def uploaded() -> bool:
        return (await recording_row(dsn, recording_id))[0] == "uploaded"

    await wait_until(uploaded, timeout=timeout, what=f"recording {recording_id} marked uploaded")
    url = (await recording_row(dsn, recording_id))[1]
    assert url is not None
    return url


async def event_position(dsn: str, recording_id: str) -> Position:
    """Where the first event about the recording stands in the outbox."""
    rows = await fetch_all(
        dsn,
        "SELECT o.txid::text, o.seq FROM sync.events_outbox o "
        "WHERE o.entity_type = 'recording' AND o.entity_id = %s ORDER BY o.txid, o.seq LIMIT 1",
        (recording_id,),
    )
    assert rows, f"no event for recording {recording_id}"
    return Position(int(rows[0][0]), rows[0][1])


# -- the receiver's side -----------------------------------------------------------------------


def stored_files(store: Path, recording_id: str) -> list[Path]:
    """Every file the receiver keeps for a recording (its audio and meta)."""
    return sorted(p for p in store.rglob(f"{recording_id}*") if ".incoming" not in p.parts)


def incoming_leftovers(store: Path) -> list[Path]:
    """Temporary upload files left in the receiver's .incoming/."""
    incoming = store / ".incoming"
    return sorted(incoming.iterdir()) if incoming.exists() else []


@dataclass
class SeenUpload:
    """One POST /api/ingest/recording-file as the receiver saw it."""

    recording_id: str
    status: int | None = None
    file_url: str | None = None


@dataclass
class UploadLog:
    """Counts the uploads reaching the real receiver app (a middleware in front of it), and can
    hold them (by recording id, or all of them) until released."""

    uploads: list[SeenUpload] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    hold_all: bool = False
    hold_ids: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    # Recording ids of the requests being held right now.
    waiting: list[str] = field(default_factory=list)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    def count(self, recording_id: str) -> int:
        """How many uploads of this recording arrived."""
        return sum(1 for u in self.uploads if u.recording_id == recording_id)

    def ids(self) -> set[str]:
        """The recording ids of every upload that arrived."""
        return {u.recording_id for u in self.uploads}

    def file_urls(self, recording_id: str) -> list[str | None]:
        """The fileUrl answered to each upload of this recording (None for a refusal)."""
        return [u.file_url for u in self.uploads if u.recording_id == recording_id]

    def statuses(self, recording_id: str) -> list[int | None]:
        """The HTTP status answered to each upload of this recording."""
        return [u.status for u in self.uploads if u.recording_id == recording_id]

    def _held(self, recording_id: str) -> bool:
        if recording_id in self.released:
            return False
        return self.hold_all or recording_id in self.hold_ids

    async def hold_only(self, *recording_ids: str) -> None:
        """Hold these uploads (if not released yet) and let every other one through."""
        async with self._changed:
            self.hold_all = False
            self.hold_ids = set(recording_ids)
            self._changed.notify_all()

    async def release(self, *recording_ids: str) -> None:
        """Let these held uploads (every one when none is named) through; hold no new ones of
        them."""
        async with self._changed:
            if recording_ids:
                self.released.update(recording_ids)
            else:
                self.hold_all = False
                self.hold_ids.clear()
            self._changed.notify_all()

    def middleware(self) -> Middleware:
        """The aiohttp middleware to put in front of the receiver's handlers."""

        @web.middleware
        async def count_uploads(request: web.Request, handler: Handler) -> web.StreamResponse:
            if request.method != "POST" or request.path != UPLOAD_PATH:
                return await handler(request)
            key = request.headers.get("Idempotency-Key", "")
            upload = SeenUpload(key.partition(":")[2])
            self.uploads.append(upload)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self._held(upload.recording_id):
                    self.waiting.append(upload.recording_id)
                    try:
                        async with self._changed:
                            await self._changed.wait_for(
                                lambda: not self._held(upload.recording_id)
                            )
                    finally:
                        self.waiting.remove(upload.recording_id)
                response = await handler(request)
                upload.status = response.status
                if response.status == 200 and isinstance(response, web.Response):
                    assert isinstance(response.body, bytes)
                    upload.file_url = orjson.loads(response.body)["fileUrl"]
                return response
            finally:
                self.in_flight -= 1

        return count_uploads


@dataclass
class RecordingReceiver:
    """The real receiver on loopback, keeping recordings in `store`."""

    url: str
    store: Path
    log: UploadLog
    files: RecordingFiles


@contextlib.asynccontextmanager
async def recording_receiver(
    receiver_dsn: str, store_dir: Path, *, max_bytes: int = 64 * 1024 * 1024, **options: Any
) -> AsyncIterator[RecordingReceiver]:
    """The reference receiver app (signed, keeping recordings in store_dir) with an UploadLog
    in front of it, on a free loopback port; `options` go to RecordingFiles (its bounds)."""
    log = UploadLog()
    files = RecordingFiles(store_dir, max_bytes=max_bytes, **options)
    async with serve_receiver(
        receiver_dsn,
        recordings=files,
        shared_secret=SECRET,
        middlewares=[log.middleware()],
        shutdown_timeout=1.0,
    ) as url:
        try:
            yield RecordingReceiver(url, store_dir, log, files)
        finally:
            # Held uploads must end before the server can shut down.
            await log.release()


# -- processes ---------------------------------------------------------------------------------


class RecordingProcesses(Processes):
    """Processes (FAST_ENV timers) that also start recording-upload consumers and the
    receiver as `serversync ingest-server`, all signed with SECRET."""

    def upload_consumer(
        self, dsn: str, frontend_url: str, recordings_dir: Path, name: str, **extra: str
    ) -> ServersyncProcess:
        """`serversync --log-format text run recording-upload`; `extra` adds or overrides
        variables."""
        return self.consumer(
            dsn,
            frontend_url,
            name,
            consumer=RECORDINGS_CONSUMER,
            **{"RECORDINGS_DIR": str(recordings_dir), "SYNC_SHARED_SECRET": SECRET, **extra},
        )

    async def ingest_server(
        self, receiver_dsn: str, store: Path, name: str = "ingest-server", **extra: str
    ) -> tuple[str, ServersyncProcess]:
        """`serversync --log-format text ingest-server` on a free loopback port (without the
        consumers' FAST_ENV), once it answers: its base URL and the process."""
        port = free_port()
        env = process_env(
            **{
                "FRONTEND_DATABASE_URL": receiver_dsn,
                "INGEST_HOST": "127.0.0.1",
                "INGEST_PORT": str(port),
                "RECORDINGS_STORE_DIR": str(store),
                "SYNC_SHARED_SECRET": SECRET,
                **extra,
            }
        )
        process = self.launch(name, ["--log-format", "text", "ingest-server"], env)
        url = f"http://127.0.0.1:{port}"

        async def healthy() -> bool:
            process.assert_alive()
            with contextlib.suppress(aiohttp.ClientError):
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(url + "/healthz") as response,
                ):
                    return response.status == 200
            return False

        await wait_until(healthy, timeout=20, interval=0.05, what=f"{name} to answer")
        return url, process
