"""`serversync demo`: the whole path on one machine, started for you.

Backend and receiver databases side by side on one server (DATABASE_URL's, a local one, or a
private throwaway cluster), the reference receiver and the frontend-sync and recording-upload
consumers as real processes. Call logs are written to the backend and watched arriving at the
receiver; then a few calls get a real recording (a short WAV tone and its meta.json in a temp
RECORDINGS_DIR), and each one is checked end to end: uploaded, playable from its fileUrl, marked
uploaded at the backend, gone from the backend's disk, and delivered with its URL to the
receiver's database. Exit 0 only when every check holds; otherwise one line says which failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import os
import secrets
import shutil
import signal
import struct
import sys
import tempfile
import time
import uuid
import wave
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psycopg

from consumer.devtools.devdb import NoPostgresError, free_port, fresh_database, locate_server
from consumer.store import admin
from consumer.store.db import mask_dsn

BACKEND_DB = "serversync_demo_backend"
FRONTEND_DB = "serversync_demo_frontend"
CONSUMERS = ("frontend-sync", "recording-upload")
# One note each of an A major chord (A4, C#5, E5), then around again for more recordings.
TONES_HZ = (440.0, 554.37, 659.25)
SAMPLE_RATE = 8000
TONE_SECONDS = 1.0
WAV_HEADER_BYTES = 44


class DemoCheckFailed(Exception):
    """A check of the demo did not hold; the message says which, in one line."""


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


def _say(message: str) -> None:
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


@dataclass
class _Processes:
    """The demo's serversync processes, their logs in `workdir`, and waits that stop early,
    with the reason, when one of them has exited."""

    workdir: Path
    running: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    def log(self, name: str) -> Path:
        """Where a process's output goes."""
        return self.workdir / f"{name}.log"

    async def spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        """Start `python -m consumer ARGS` with its output in its log."""
        with self.log(name).open("wb") as handle:
            self.running[name] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "consumer",
                "--log-format",
                "text",
                *args,
                env=env,
                stdout=handle,
                stderr=handle,
            )

    def check(self) -> None:
        """Fail, with the last line it logged, if a process has exited."""
        for name, process in self.running.items():
            if process.returncode is not None:
                lines = self.log(name).read_text(errors="replace").strip().splitlines()
                last = lines[-1] if lines else "no output"
                raise DemoCheckFailed(f"{name} exited with code {process.returncode}: {last}")

    async def wait_for(
        self, check: Callable[[], Awaitable[bool]], timeout: float, what: str
    ) -> None:
        """Poll `check` until it is true; fail on timeout or when a process has exited."""
        deadline = time.monotonic() + timeout
        while not await check():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await asyncio.sleep(0.005)

    async def stop(self, names: list[str]) -> None:
        """SIGTERM, and SIGKILL whatever has not stopped 10 s later."""
        chosen = [self.running[name] for name in names if name in self.running]
        for process in chosen:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in chosen:
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _one(conn: psycopg.AsyncConnection[Any], sql: str, params: Any = None) -> Any:
    cur = await conn.execute(sql, params)
    return await cur.fetchone()


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise DemoCheckFailed(reason)


@dataclass(frozen=True)
class _Run:
    """What the steps of a running demo share."""

    processes: _Processes
    backend: psycopg.AsyncConnection[Any]
    frontend: psycopg.AsyncConnection[Any]
    http: aiohttp.ClientSession
    recordings_dir: Path


async def _call_logs(run: _Run, calls: int) -> None:
    """Create call logs one transaction each and time their arrival at the receiver."""
    _say(f"creating {calls} call logs in the backend, one transaction each")
    latencies = []
    for i in range(calls):
        started = time.monotonic()
        row = await _one(
            run.backend,
            "INSERT INTO call_logs (caller_number, callee_number, status, summary) "
            "VALUES (%s, '0312345678', 'completed', %s) RETURNING id::text",
            (f"09012345{i:03d}", f"demo call {i + 1}"),
        )
        call_id = row[0]

        async def arrived(call_id: str = call_id) -> bool:
            return (
                await _one(
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
        _say(f"all {calls} call logs arrived (slowest {max(latencies):.1f} ms)")


async def _record_calls(run: _Run, count: int) -> tuple[list[DemoRecording], dict[str, float]]:
    """Write the files, then the call log and its pending recording row in one transaction."""
    _say(
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
    run: _Run, made: list[DemoRecording], started: dict[str, float]
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
            parked = await _one(
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


async def _check_recording(run: _Run, recording: DemoRecording, latency_ms: float) -> None:
    """Check one uploaded recording end to end and print what was seen."""
    rid = recording.recording_id
    # Marked uploaded at the backend, with the fileUrl the receiver answered.
    marked = await _one(
        run.backend, "SELECT upload_status, s3_url FROM recordings WHERE id = %s", (rid,)
    )
    _require(marked is not None, f"recording {rid}: the row is gone from the backend")
    status, file_url = marked
    _require(status == "uploaded", f"recording {rid}: upload_status is {status!r} at the backend")
    _require(bool(file_url), f"recording {rid}: no s3_url at the backend")
    print(f"    {recording.tone_hz:5.1f} Hz  uploaded in {latency_ms:5.1f} ms -> {file_url}")

    # Playable: the whole file back, byte for byte, a valid WAV; and a seek (Range) answered 206.
    async with run.http.get(file_url) as response:
        body = await response.read()
        _require(response.status == 200, f"GET {file_url} answered {response.status}")
        content_type = response.content_type
    _require(
        content_type.startswith("audio/"), f"GET {file_url} answered Content-Type {content_type}"
    )
    _require(
        body == recording.audio,
        f"GET {file_url} returned {len(body)} bytes that differ from the {len(recording.audio)} "
        "written",
    )
    try:
        with wave.open(io.BytesIO(body), "rb") as wav:
            channels, rate, frames = wav.getnchannels(), wav.getframerate(), wav.getnframes()
    except (wave.Error, EOFError) as exc:
        raise DemoCheckFailed(f"GET {file_url} is not a valid WAV: {exc}") from None
    _require(
        (channels, rate, frames) == (1, SAMPLE_RATE, int(TONE_SECONDS * SAMPLE_RATE)),
        f"GET {file_url}: WAV has {channels} ch, {rate} Hz, {frames} frames",
    )
    last = WAV_HEADER_BYTES - 1
    async with run.http.get(file_url, headers={"Range": f"bytes=0-{last}"}) as response:
        head = await response.read()
        _require(
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
    _require(not folder.exists(), f"recording {rid}: {folder} is still on the backend's disk")
    row = await _one(
        run.frontend,
        "SELECT payload->>'upload_status', payload->>'s3_url' FROM ingest.live_entities "
        "WHERE entity_type = 'recording' AND entity_id = %s",
        (rid,),
    )
    _require(
        row is not None and tuple(row) == ("uploaded", file_url),
        f"recording {rid}: the receiver's database has {row!r}, not ('uploaded', {file_url!r})",
    )
    print(
        "      backend: upload_status=uploaded, s3_url=fileUrl, <callId>/ deleted; "
        "receiver db: row with that s3_url"
    )


async def _recordings(run: _Run, count: int) -> None:
    """Make `count` recordings, wait for them to be shipped, and check each one."""
    made, started = await _record_calls(run, count)
    latencies = await _await_uploads(run, made, started)
    _say(
        f"recording-upload shipped all {count} and frontend-sync delivered their URLs "
        f"(slowest {max(latencies.values()):.1f} ms); checking each"
    )
    for recording in made:
        await _check_recording(run, recording, latencies[recording.recording_id])
    _say(
        f"all {count} recordings uploaded, playable from their fileUrl, marked uploaded at the "
        "backend and gone from its disk"
    )


async def _zero_backlog(run: _Run) -> None:
    """Wait until every consumer has caught up (recording-upload also passes the updates)."""

    async def caught_up() -> bool:
        rows = await admin.consumer_status(run.backend)
        return {row["consumer"] for row in rows} >= set(CONSUMERS) and all(
            row["backlog"] == 0 for row in rows
        )

    await run.processes.wait_for(caught_up, 10, "a zero backlog on every consumer")


async def run_demo(calls: int = 5, recordings: int = 3) -> int:
    """Run the demo; 0 when every call log and recording arrived and every check held."""
    try:
        server = await asyncio.to_thread(locate_server)
    except NoPostgresError as exc:
        print(f"serversync demo: {exc}", file=sys.stderr)
        return 1
    where = "a private throwaway cluster" if server.cluster else mask_dsn(server.dsn)
    _say(f"PostgreSQL: {where}")
    workdir = Path(tempfile.mkdtemp(prefix="serversync-demo-"))
    recordings_dir = workdir / "backend-recordings"
    store_dir = workdir / "frontend-recordings"
    recordings_dir.mkdir()
    processes = _Processes(workdir)
    keep_logs = False
    try:
        backend = await fresh_database(server.dsn, BACKEND_DB, ["backend"], examples=True)
        frontend = await fresh_database(server.dsn, FRONTEND_DB, ["receiver"])
        _say(f"databases {BACKEND_DB} (backend) and {FRONTEND_DB} (receiver) migrated")

        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "DATABASE_URL": backend,
            "FRONTEND_DATABASE_URL": frontend,
            "FRONTEND_BASE_URL": base_url,
            "INGEST_PORT": str(port),
            "RECORDINGS_DIR": str(recordings_dir),
            "RECORDINGS_STORE_DIR": str(store_dir),
            "SYNC_LOG_LEVEL": "INFO",
            # The consumers sign, the receiver checks: the same secret on both sides.
            "SYNC_SHARED_SECRET": secrets.token_hex(32),
        }
        await processes.spawn("ingest-server", ["ingest-server"], env)
        for consumer in CONSUMERS:
            # Each consumer process serves its own HTTP port (health, metrics).
            own = {**env, "SYNC_HTTP_PORT": str(free_port())}
            await processes.spawn(consumer, ["run", consumer], own)
        _say(
            f"started ingest-server on {base_url}, `serversync run frontend-sync` and "
            "`serversync run recording-upload`"
        )
        _say(
            f"logs, RECORDINGS_DIR and the receiver's RECORDINGS_STORE_DIR in {workdir} "
            "(removed at the end; the logs are kept if the demo fails)"
        )

        bconn = await psycopg.AsyncConnection.connect(backend, autocommit=True)
        fconn = await psycopg.AsyncConnection.connect(frontend, autocommit=True)
        async with bconn, fconn, aiohttp.ClientSession() as http:
            run = _Run(processes, bconn, fconn, http, recordings_dir)

            async def receiver_up() -> bool:
                try:
                    async with http.get(f"{base_url}/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            async def leaders_up() -> bool:
                row = await _one(
                    bconn,
                    "SELECT count(*) FROM sync.consumer_offsets "
                    "WHERE consumer = ANY(%s) AND leader_pid IS NOT NULL",
                    (list(CONSUMERS),),
                )
                return bool(row and row[0] == len(CONSUMERS))

            await processes.wait_for(receiver_up, 20, "the ingest-server")
            await processes.wait_for(leaders_up, 20, "both consumers to take the lead")
            await _call_logs(run, calls)
            if recordings > 0:
                await _recordings(run, recordings)
            await _zero_backlog(run)

        status = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "consumer", "status", env=env
        )
        await status.wait()
        _say("serversync status shows zero backlog: done")
        return 0
    except (DemoCheckFailed, TimeoutError, psycopg.Error, aiohttp.ClientError, OSError) as exc:
        keep_logs = True
        print(f"serversync demo failed: {exc} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        # The consumers first: a batch in flight then finishes against a receiver still up.
        await processes.stop(list(CONSUMERS))
        await processes.stop(["ingest-server"])
        # The recordings go in every case; the logs stay only when they explain a failure.
        if keep_logs:
            shutil.rmtree(recordings_dir, ignore_errors=True)
            shutil.rmtree(store_dir, ignore_errors=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        await asyncio.to_thread(server.close)
