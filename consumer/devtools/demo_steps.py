"""The demo's scenario: call logs written to the backend and timed to the receiver; recordings
made, shipped by recording-upload and checked end to end; every consumer caught up."""

from __future__ import annotations

import asyncio
import io
import math
import struct
import time
import uuid
import wave
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psycopg

from consumer.devtools.demo_processes import DemoCheckFailed, DemoProcesses
from consumer.store import admin

# The consumers on the backend's database, delivering to the frontend's receiver.
CONSUMERS = ("frontend-sync", "recording-upload")
# The consumer declared on the frontend's database, delivering the settings to the backend.
SETTINGS_CONSUMER = "settings-sync"
# One note each of an A major chord (A4, C#5, E5), then around again for more recordings.
TONES_HZ = (440.0, 554.37, 659.25)
SAMPLE_RATE = 8000
TONE_SECONDS = 1.0
WAV_HEADER_BYTES = 44


@dataclass(frozen=True)
class DemoRecording:
    """One recording the demo made: its ids, its tone and the exact bytes written."""

    call_id: str
    recording_id: str
    tone_hz: float
    audio: bytes

    @property
    def file_path(self) -> str:
        """recordings.file_path: mixed.wav relative to RECORDINGS_DIR."""
        return f"{self.call_id}/mixed.wav"


def say(message: str) -> None:
    """One line of the demo's story."""
    print(f"==> {message}", flush=True)


def tone_wav(tone_hz: float, seconds: float = TONE_SECONDS, rate: int = SAMPLE_RATE) -> bytes:
    """A mono 16-bit PCM WAV of a sine tone, faded in and out over 10 ms so it does not click."""
    frames = int(seconds * rate)
    fade = max(1, rate // 100)
    samples = [
        int(
            12000
            * min(1.0, i / fade, (frames - 1 - i) / fade)
            * math.sin(2 * math.pi * tone_hz * i / rate)
        )
        for i in range(frames)
    ]
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(struct.pack(f"<{frames}h", *samples))
    return buffer.getvalue()


def _write_recording(recordings_dir: Path, tone_hz: float) -> DemoRecording:
    """<callId>/mixed.wav and meta.json under RECORDINGS_DIR, as the voicebot leaves them."""
    recording = DemoRecording(str(uuid.uuid4()), str(uuid.uuid4()), tone_hz, tone_wav(tone_hz))
    folder = recordings_dir / recording.call_id
    folder.mkdir()
    (folder / "mixed.wav").write_bytes(recording.audio)
    meta = {
        "callId": recording.call_id,
        "codec": "pcm_s16le",
        "channels": 1,
        "sampleRate": SAMPLE_RATE,
        "durationSec": TONE_SECONDS,
        "toneHz": tone_hz,
    }
    (folder / "meta.json").write_bytes(orjson.dumps(meta))
    return recording


async def fetch_one(conn: psycopg.AsyncConnection[Any], sql: str, params: Any = None) -> Any:
    """The first row of one query, or None."""
    cur = await conn.execute(sql, params)
    return await cur.fetchone()


def require(condition: bool, reason: str) -> None:
    if not condition:
        raise DemoCheckFailed(reason)


@dataclass(frozen=True)
class DemoRun:
    """What the steps of a running demo share."""

    processes: DemoProcesses
    backend: psycopg.AsyncConnection[Any]
    frontend: psycopg.AsyncConnection[Any]
    http: aiohttp.ClientSession
    recordings_dir: Path


async def call_logs(run: DemoRun, calls: int) -> None:
    """Create call logs one transaction each and time their arrival at the receiver."""
    say(f"creating {calls} call logs in the backend, one transaction each")
    latencies = []
    for i in range(calls):
        started = time.monotonic()
        row = await fetch_one(
            run.backend,
            "INSERT INTO call_logs (caller_number, callee_number, status, summary) "
            "VALUES (%s, '0312345678', 'completed', %s) RETURNING id::text",
            (f"09012345{i:03d}", f"demo call {i + 1}"),
        )
        call_id = row[0]

        async def arrived(call_id: str = call_id) -> bool:
            return (
                await fetch_one(
                    run.frontend,
                    "SELECT 1 FROM ingest.live_entities "
                    "WHERE entity_type = 'call_log' AND entity_id = %s",
                    (call_id,),
                )
                is not None
            )

        await run.processes.wait_for(arrived, 10, f"call log {call_id} at the receiver")
        latency = (time.monotonic() - started) * 1000
        latencies.append(latency)
        print(f"    call_log {call_id} arrived at the receiver in {latency:6.1f} ms")
    if latencies:
        say(f"all {calls} call logs arrived (slowest {max(latencies):.1f} ms)")


async def _record_calls(run: DemoRun, count: int) -> tuple[list[DemoRecording], dict[str, float]]:
    """Write the files, then the call log and its pending recording row in one transaction."""
    say(
        f"{count} calls with a recording: a {TONE_SECONDS:g} s tone each in <callId>/mixed.wav "
        "+ meta.json, then call_logs + recordings rows (pending)"
    )
    made: list[DemoRecording] = []
    started: dict[str, float] = {}
    for i in range(count):
        recording = await asyncio.to_thread(
            _write_recording, run.recordings_dir, TONES_HZ[i % len(TONES_HZ)]
        )
        async with run.backend.transaction():
            await run.backend.execute(
                "INSERT INTO call_logs (id, caller_number, callee_number, status, summary) "
                "VALUES (%s, %s, '0312345678', 'completed', %s)",
                (
                    recording.call_id,
                    f"09087654{i:03d}",
                    f"demo call with a {recording.tone_hz:g} Hz tone",
                ),
            )
            await run.backend.execute(
                "INSERT INTO recordings (id, call_log_id, file_path, duration_sec) "
                "VALUES (%s, %s, %s, %s)",
                (
                    recording.recording_id,
                    recording.call_id,
                    recording.file_path,
                    round(TONE_SECONDS),
                ),
            )
        started[recording.recording_id] = time.monotonic()
        made.append(recording)
        print(
            f"    {recording.file_path}  {recording.tone_hz:5.1f} Hz, "
            f"{len(recording.audio)} bytes, upload_status=pending"
        )
    return made, started


async def _await_uploads(
    run: DemoRun, made: list[DemoRecording], started: dict[str, float]
) -> dict[str, float]:
    """Milliseconds from each commit until the receiver's database has the recording with its
    fileUrl and the backend's folder is gone; fails fast when recording-upload parks one."""
    ids = [recording.recording_id for recording in made]
    folders = {r.recording_id: run.recordings_dir / r.call_id for r in made}
    done: dict[str, float] = {}

    async def all_done() -> bool:
        cur = await run.frontend.execute(
            "SELECT entity_id FROM ingest.live_entities WHERE entity_type = 'recording' "
            "AND entity_id = ANY(%s) AND payload->>'s3_url' IS NOT NULL",
            (ids,),
        )
        for (recording_id,) in await cur.fetchall():
            if recording_id not in done and not folders[recording_id].exists():
                done[recording_id] = (time.monotonic() - started[recording_id]) * 1000
        if len(done) < len(ids):
            parked = await fetch_one(
                run.backend,
                "SELECT entity_id, error_code, error_message FROM sync.dlq_messages "
                "WHERE consumer = 'recording-upload' LIMIT 1",
            )
            if parked is not None:
                raise DemoCheckFailed(
                    f"recording-upload parked recording {parked[0]}: {parked[1]} {parked[2]}"
                )
        return len(done) == len(ids)

    await run.processes.wait_for(all_done, 20, "the recordings to be uploaded and delivered")
    return done


async def _check_recording(run: DemoRun, recording: DemoRecording, latency_ms: float) -> None:
    """Check one uploaded recording end to end and print what was seen."""
    rid = recording.recording_id
    # Marked uploaded at the backend, with the fileUrl the receiver answered.
    marked = await fetch_one(
        run.backend, "SELECT upload_status, s3_url FROM recordings WHERE id = %s", (rid,)
    )
    require(marked is not None, f"recording {rid}: the row is gone from the backend")
    status, file_url = marked
    require(status == "uploaded", f"recording {rid}: upload_status is {status!r} at the backend")
    require(bool(file_url), f"recording {rid}: no s3_url at the backend")
    print(f"    {recording.tone_hz:5.1f} Hz  uploaded in {latency_ms:5.1f} ms -> {file_url}")

    # Playable: the whole file back, byte for byte, a valid WAV; and a seek (Range) answered 206.
    async with run.http.get(file_url) as response:
        body = await response.read()
        require(response.status == 200, f"GET {file_url} answered {response.status}")
        content_type = response.content_type
    require(
        content_type.startswith("audio/"), f"GET {file_url} answered Content-Type {content_type}"
    )
    require(
        body == recording.audio,
        f"GET {file_url} returned {len(body)} bytes that differ from the {len(recording.audio)} "
        "written",
    )
    try:
        with wave.open(io.BytesIO(body), "rb") as wav:
            channels, rate, frames = wav.getnchannels(), wav.getframerate(), wav.getnframes()
    except (wave.Error, EOFError) as exc:
        raise DemoCheckFailed(f"GET {file_url} is not a valid WAV: {exc}") from None
    require(
        (channels, rate, frames) == (1, SAMPLE_RATE, int(TONE_SECONDS * SAMPLE_RATE)),
        f"GET {file_url}: WAV has {channels} ch, {rate} Hz, {frames} frames",
    )
    last = WAV_HEADER_BYTES - 1
    async with run.http.get(file_url, headers={"Range": f"bytes=0-{last}"}) as response:
        head = await response.read()
        require(
            response.status == 206 and head == recording.audio[:WAV_HEADER_BYTES],
            f"GET {file_url} with Range bytes=0-{last} answered {response.status} "
            f"with {len(head)} bytes, not 206 with the WAV header",
        )
    print(
        f"      playable: GET 200 {content_type}, the same {len(body)} bytes, WAV {channels} ch "
        f"{rate} Hz {frames} frames ({frames / rate:.2f} s); Range bytes=0-{last} -> 206"
    )

    # Gone from the backend's disk; the row, with its URL, at the receiver through frontend-sync.
    folder = run.recordings_dir / recording.call_id
    require(not folder.exists(), f"recording {rid}: {folder} is still on the backend's disk")
    row = await fetch_one(
        run.frontend,
        "SELECT payload->>'upload_status', payload->>'s3_url' FROM ingest.live_entities "
        "WHERE entity_type = 'recording' AND entity_id = %s",
        (rid,),
    )
    require(
        row is not None and tuple(row) == ("uploaded", file_url),
        f"recording {rid}: the receiver's database has {row!r}, not ('uploaded', {file_url!r})",
    )
    print(
        "      backend: upload_status=uploaded, s3_url=fileUrl, <callId>/ deleted; "
        "receiver db: row with that s3_url"
    )


async def check_recordings(run: DemoRun, count: int) -> None:
    """Make `count` recordings, wait for them to be shipped, and check each one."""
    made, started = await _record_calls(run, count)
    latencies = await _await_uploads(run, made, started)
    say(
        f"recording-upload shipped all {count} and frontend-sync delivered their URLs "
        f"(slowest {max(latencies.values()):.1f} ms); checking each"
    )
    for recording in made:
        await _check_recording(run, recording, latencies[recording.recording_id])
    say(
        f"all {count} recordings uploaded, playable from their fileUrl, marked uploaded at the "
        "backend and gone from its disk"
    )


async def zero_backlog(run: DemoRun) -> None:
    """Wait until every consumer of both databases has caught up (recording-upload also passes
    the updates)."""

    async def caught_up(conn: psycopg.AsyncConnection[Any], names: set[str]) -> bool:
        rows = await admin.consumer_status(conn)
        return {row["consumer"] for row in rows} >= names and all(
            row["backlog"] == 0 for row in rows
        )

    async def both() -> bool:
        return await caught_up(run.backend, set(CONSUMERS)) and await caught_up(
            run.frontend, {SETTINGS_CONSUMER}
        )

    await run.processes.wait_for(both, 10, "a zero backlog on every consumer")
