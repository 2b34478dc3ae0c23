"""Real recordings on disk for the recording-upload tests: WAV files, rows, and a receiver."""

from __future__ import annotations

import contextlib
import io
import math
import struct
import uuid
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import psycopg

from consumer.receiver.recordings import RecordingFiles
from tests.conftest import serve_receiver

SECRET = "recording-test-secret-0123456789"  # noqa: S105 (test-only)


def wav_bytes(seconds: float = 0.2, rate: int = 8000, tone_hz: float = 440.0) -> bytes:
    """A short mono 16-bit PCM WAV: a sine tone."""
    frames = int(seconds * rate)
    samples = b"".join(
        struct.pack("<h", int(12000 * math.sin(2 * math.pi * tone_hz * i / rate)))
        for i in range(frames)
    )
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples)
    return buffer.getvalue()


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
) -> Recording:
    """A call with a recording: files under recordings_dir/<callId>/ and the rows (pending)."""
    call_id, recording_id = str(uuid.uuid4()), str(uuid.uuid4())
    folder = recordings_dir / call_id
    data = wav_bytes() if audio is None else audio
    if write_files:
        folder.mkdir(parents=True)
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
            "INSERT INTO recordings (id, call_log_id, file_path) VALUES (%s, %s, %s)",
            (recording_id, call_id, file_path or f"{call_id}/mixed.wav"),
        )
    return Recording(call_id, recording_id, folder, data)


async def recording_row(dsn: str, recording_id: str) -> tuple[str, str | None]:
    """(upload_status, s3_url) of a recording."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        cur = await conn.execute(
            "SELECT upload_status, s3_url FROM recordings WHERE id = %s", (recording_id,)
        )
        row = await cur.fetchone()
    assert row is not None
    return row[0], row[1]


@contextlib.asynccontextmanager
async def recording_receiver(
    receiver_dsn: str, store_dir: Path, *, max_bytes: int = 64 * 1024 * 1024
) -> AsyncIterator[str]:
    """The reference receiver, signed, keeping recordings in store_dir."""
    files = RecordingFiles(store_dir, max_bytes=max_bytes)
    async with serve_receiver(receiver_dsn, recordings=files, shared_secret=SECRET) as url:
        yield url
