"""recording-upload end to end: real WAV files on disk, the real receiver (on loopback, in this
process or as `serversync ingest-server`), real PostgreSQL, and `serversync run recording-upload`
as a real subprocess where crashes and memory are concerned."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from consumer.app.settings import SyncSettings
from consumer.app.wiring import dlq_sinks, open_pool
from consumer.core.events import Position
from consumer.ops.deadletters import DeadLetters
from consumer.receiver.app import Handler
from consumer.receiver.uploads import UPLOAD_PATH, RecordingFiles
from consumer.sinks.recording_files import RecordingsDir
from consumer.store.dlq import DlqStore
from tests.conftest import (
    cli_env,
    fetch_all,
    finish,
    make_settings,
    running_consumer,
    serve_receiver,
    start_cli,
)
from tests.support.backend import execute, offset
from tests.support.cli import assert_one_line_error
from tests.support.dlq import Parked, all_dead_letters, parked_by_entity
from tests.support.processes import ServersyncProcess
from tests.support.recordings import (
    RECORDINGS_CONSUMER,
    SECRET,
    Recording,
    RecordingProcesses,
    add_recording,
    event_position,
    incoming_leftovers,
    make_recording,
    recording_receiver,
    recording_row,
    stored_files,
    upload_statuses,
    wait_uploaded,
    wav_bytes,
    write_large_wav,
)
from tests.support.uploads import Upload, audio_offset, held_back, multipart, post
from tests.support.waiting import wait_caught_up, wait_until

AFTER_UPLOAD = "recording-upload.after-upload=kill"
AFTER_MARK = "recording-upload.after-mark=kill"
MIB = 1024 * 1024


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[RecordingProcesses]:
    """Starts processes; kills whatever still runs at the end and prints the logs."""
    with RecordingProcesses(tmp_path) as started:
        yield started


def dirs(tmp_path: Path) -> tuple[Path, Path]:
    """RECORDINGS_DIR (the backend's, created) and RECORDINGS_STORE_DIR (the receiver's)."""
    local, store = tmp_path / "recordings", tmp_path / "store"
    local.mkdir()
    return local, store


def snapshot(*roots: Path) -> dict[Path, bytes | str]:
    """Every file and symlink under `roots`: a file's bytes, a symlink's target."""
    found: dict[Path, bytes | str] = {}
    for root in roots:
        for path in [root, *root.rglob("*")]:
            if path.is_symlink():
                found[path] = str(path.readlink())
            elif path.is_file():
                found[path] = path.read_bytes()
    return found


def sha256_of(path: Path) -> str:
    """A file's SHA-256, read in chunks."""
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def upload_settings(dsn: str, receiver_url: str, local: Path, **overrides: Any) -> SyncSettings:
    """Settings of an in-process recording-upload consumer: RECORDINGS_DIR `local`, signed."""
    return make_settings(
        dsn, receiver_url, RECORDINGS_DIR=str(local), SYNC_SHARED_SECRET=SECRET, **overrides
    )


async def parked(dsn: str) -> dict[str, Parked]:
    """recording-upload's dead letters by recording id."""
    return await parked_by_entity(dsn, RECORDINGS_CONSUMER)


def without(before: dict[Path, bytes | str], folder: Path) -> dict[Path, bytes | str]:
    """A snapshot without what lies in `folder`."""
    return {path: data for path, data in before.items() if not path.is_relative_to(folder)}


def assert_kept_once(store: Path, recording: Recording) -> None:
    """The receiver holds exactly one copy of the recording: its audio (these bytes) and meta,
    and no temporary file."""
    rid = recording.recording_id
    assert stored_files(store, rid) == [
        store / recording.call_id / f"{rid}.meta.json",
        store / recording.call_id / f"{rid}.wav",
    ]
    assert (store / recording.call_id / f"{rid}.wav").read_bytes() == recording.audio
    assert incoming_leftovers(store) == []


async def assert_parked(
    dsn: str, dead: dict[str, Parked], rid: str, code: str, fragment: str
) -> None:
    """The recording's event is parked with `code` and a message holding `fragment`; its row
    says so: 'failed'."""
    assert dead[rid].error_code == code, dead[rid]
    assert fragment in dead[rid].error_message, dead[rid]
    assert await recording_row(dsn, rid) == ("failed", None)


# -- the normal flow -----------------------------------------------------------------------------


async def test_recordings_are_uploaded_marked_and_deleted_locally(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        made = [await make_recording(backend_dsn, local) for _ in range(3)]
        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            for recording in made:
                await wait_uploaded(backend_dsn, recording.recording_id)
            await wait_until(lambda: not any(r.folder.exists() for r in made), timeout=10)
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.failed_deliveries == 0
        for recording in made:
            assert receiver.log.count(recording.recording_id) == 1
            assert_kept_once(store, recording)
        async with aiohttp.ClientSession() as session:
            for recording in made:
                _, file_url = await recording_row(backend_dsn, recording.recording_id)
                assert file_url is not None
                assert receiver.log.file_urls(recording.recording_id) == [file_url]
                async with session.get(file_url) as response:
                    assert response.status == 200
                    assert response.headers["Content-Type"] == "audio/wav"
                    assert await response.read() == recording.audio
                async with session.get(file_url, headers={"Range": "bytes=10-19"}) as response:
                    assert response.status == 206
                    assert await response.read() == recording.audio[10:20]
    assert await parked(backend_dsn) == {}


async def test_each_recording_of_a_call_deletes_only_its_own_files(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    # The recordings table allows several recordings per call, all in the call's folder and
    # sharing its meta.json. Uploading one deletes its audio only; meta.json and the folder go
    # with the last recording; a file that no recording names is never deleted.
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        # Call A: its second recording is on disk when the first is uploaded; its row comes
        # later.
        a_first = await make_recording(backend_dsn, local)
        (a_first.folder / "second.wav").write_bytes(wav_bytes(tone_hz=660))
        # Call B: two recordings delivered together (uploaded at the same time).
        b_first = await make_recording(backend_dsn, local)
        (b_first.folder / "second.wav").write_bytes(wav_bytes(tone_hz=770))
        b_second = await add_recording(backend_dsn, b_first, "second.wav")
        # Call C: one recording, and a file of the backend's that no recording names.
        c_only = await make_recording(backend_dsn, local)
        (c_only.folder / "notes.txt").write_bytes(b"not a recording")

        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            for recording in (a_first, b_first, b_second, c_only):
                await wait_uploaded(backend_dsn, recording.recording_id)
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert sorted(p.name for p in a_first.folder.iterdir()) == ["meta.json", "second.wav"]
            a_second = await add_recording(backend_dsn, a_first, "second.wav")
            await wait_uploaded(backend_dsn, a_second.recording_id)
            await wait_until(lambda: not a_first.folder.exists(), what="call A's folder deleted")
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.failed_deliveries == 0

        made = (a_first, a_second, b_first, b_second, c_only)
        for recording in made:
            assert receiver.log.count(recording.recording_id) == 1
            assert_kept_once(store, recording)
        assert a_first.audio != a_second.audio
    assert await parked(backend_dsn) == {}
    assert not b_first.folder.exists()
    assert sorted(p.name for p in c_only.folder.iterdir()) == ["meta.json", "notes.txt"]


# -- crashes -------------------------------------------------------------------------------------


async def killed_at(
    procs: RecordingProcesses, dsn: str, receiver_url: str, local: Path, failpoint: str
) -> Recording:
    """A recording, and a consumer process killed at `failpoint` while handling it: the offset
    has not passed the recording's event."""
    recording = await make_recording(dsn, local)
    first = procs.upload_consumer(
        dsn, receiver_url, local, "first", SERVERSYNC_FAILPOINTS=failpoint
    )
    assert await first.wait_exit(20) == -signal.SIGKILL
    position = await offset(dsn, RECORDINGS_CONSUMER)
    assert position is None or position < await event_position(dsn, recording.recording_id)
    return recording


async def restarted(
    procs: RecordingProcesses, dsn: str, receiver_url: str, local: Path, recording: Recording
) -> ServersyncProcess:
    """A second consumer process, once it deleted the recording's folder and its offset stands
    at the end of the outbox."""
    second = procs.upload_consumer(dsn, receiver_url, local, "second")
    await wait_until(lambda: not recording.folder.exists(), timeout=20, what="the folder deleted")
    await wait_caught_up(dsn, RECORDINGS_CONSUMER)
    return second


async def assert_settled(
    dsn: str, store: Path, recording: Recording, process: ServersyncProcess
) -> None:
    """The receiver kept the recording once, nothing is parked, and `process` stops cleanly."""
    assert_kept_once(store, recording)
    assert await all_dead_letters(dsn) == 0
    assert await process.stop() == 0


async def test_sigkill_between_upload_and_mark_ends_with_one_copy_marked_and_deleted(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path, procs: RecordingProcesses
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        recording = await killed_at(procs, backend_dsn, receiver.url, local, AFTER_UPLOAD)
        rid = recording.recording_id

        # Killed with the answer in hand: the receiver has the file, the backend does not know.
        assert receiver.log.statuses(rid) == [200]
        [first_url] = receiver.log.file_urls(rid)
        assert first_url is not None
        assert_kept_once(store, recording)
        assert await recording_row(backend_dsn, rid) == ("pending", None)
        assert (recording.folder / "mixed.wav").read_bytes() == recording.audio
        assert (recording.folder / "meta.json").is_file()

        second = await restarted(procs, backend_dsn, receiver.url, local, recording)
        assert await wait_uploaded(backend_dsn, rid) == first_url
        # The row was still pending, so the file went again; the receiver kept it once.
        assert receiver.log.statuses(rid) == [200, 200]
        assert receiver.log.file_urls(rid) == [first_url, first_url]
        await assert_settled(backend_dsn, store, recording, second)


async def test_sigkill_between_mark_and_delete_deletes_on_restart_without_uploading_again(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path, procs: RecordingProcesses
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        recording = await killed_at(procs, backend_dsn, receiver.url, local, AFTER_MARK)
        rid = recording.recording_id

        status, file_url = await recording_row(backend_dsn, rid)
        assert status == "uploaded"
        assert receiver.log.file_urls(rid) == [file_url]
        assert (recording.folder / "mixed.wav").read_bytes() == recording.audio

        second = await restarted(procs, backend_dsn, receiver.url, local, recording)
        await second.wait_log("already uploaded; deleted the files left behind")
        assert receiver.log.count(rid) == 1, "uploaded again although the row said uploaded"
        assert await recording_row(backend_dsn, rid) == ("uploaded", file_url)
        await assert_settled(backend_dsn, store, recording, second)


async def test_replay_from_earliest_over_uploaded_rows_and_gone_folders_changes_nothing(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        made = [await make_recording(backend_dsn, local) for _ in range(3)]
        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER):
            urls = [await wait_uploaded(backend_dsn, r.recording_id) for r in made]
            await wait_until(lambda: not any(r.folder.exists() for r in made))
            end = await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
        assert len(receiver.log.uploads) == 3

        env = cli_env(DATABASE_URL=backend_dsn)
        reset = await finish(
            await start_cli("offsets", "reset", RECORDINGS_CONSUMER, "--to-earliest", env=env)
        )
        assert reset.code == 0, reset
        assert "will be replayed" in reset.stdout, reset.stdout
        assert await offset(backend_dsn, RECORDINGS_CONSUMER) == Position.start()

        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            assert await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER) == end
            assert runtime.stats.failed_deliveries == 0
            assert runtime.stats.parked_events == 0
            replayed = len(await fetch_all(backend_dsn, "SELECT seq FROM sync.events_outbox"))
            assert runtime.stats.delivered_events == replayed
        assert len(receiver.log.uploads) == 3, "a replay uploaded again"
        for recording, url in zip(made, urls, strict=True):
            assert await recording_row(backend_dsn, recording.recording_id) == ("uploaded", url)
            assert_kept_once(store, recording)
    assert await all_dead_letters(backend_dsn) == 0


# -- bad input -----------------------------------------------------------------------------------


async def test_paths_leaving_recordings_dir_are_parked_and_nothing_outside_is_touched(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    outside = tmp_path / "outside"
    (outside / "linked").mkdir(parents=True)
    for folder in (outside, outside / "linked"):
        (folder / "mixed.wav").write_bytes(wav_bytes(tone_hz=220))
        (folder / "meta.json").write_bytes(b'{"outside": true}')
    (outside / "secret.wav").write_bytes(wav_bytes(tone_hz=330))
    (outside / "secret.json").write_bytes(b'{"secret": "do not send"}')
    # A mixed.wav right in RECORDINGS_DIR: deleting "its folder" would delete them all.
    (local / "mixed.wav").write_bytes(wav_bytes(tone_hz=550))
    (local / "meta.json").write_bytes(b"{}")

    linked_folder = str(uuid.uuid4())
    (local / linked_folder).symlink_to(outside / "linked", target_is_directory=True)
    linked_file = str(uuid.uuid4())
    (local / linked_file).mkdir()
    (local / linked_file / "mixed.wav").symlink_to(outside / "secret.wav")
    (local / linked_file / "meta.json").write_bytes(b"{}")
    linked_meta = str(uuid.uuid4())
    (local / linked_meta).mkdir()
    (local / linked_meta / "mixed.wav").write_bytes(wav_bytes())
    (local / linked_meta / "meta.json").symlink_to(outside / "secret.json")
    absolute_inside = str(uuid.uuid4())
    before = snapshot(outside, local)

    async with recording_receiver(receiver_dsn, store) as receiver:
        refused: dict[str, tuple[Recording, str]] = {}
        good: list[Recording] = []

        async def bad(
            fragment: str, *, file_path: str | None = None, call_id: str | None = None
        ) -> None:
            made = await make_recording(
                backend_dsn, local, write_files=False, file_path=file_path, call_id=call_id
            )
            refused[made.recording_id] = (made, fragment)

        # Good and bad interleaved, all in one batch.
        good.append(await make_recording(backend_dsn, local))
        await bad("resolves outside RECORDINGS_DIR", file_path="../outside/mixed.wav")
        await bad("resolves outside RECORDINGS_DIR", file_path=str(outside / "mixed.wav"))
        good.append(
            await make_recording(
                backend_dsn,
                local,
                call_id=absolute_inside,
                file_path=str(local / absolute_inside / "mixed.wav"),
            )
        )
        await bad("passes through a symlink", call_id=linked_folder)
        await bad("mixed.wav is a symlink pointing outside RECORDINGS_DIR", call_id=linked_file)
        await bad("meta.json is a symlink pointing outside RECORDINGS_DIR", call_id=linked_meta)
        await bad("is not inside a <callId>/ folder", file_path="mixed.wav")
        good.append(await make_recording(backend_dsn, local))

        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.parked_events == len(refused)
            assert runtime.stats.retries == 0

        dead = await parked(backend_dsn)
        assert set(dead) == set(refused)
        for rid, (_, fragment) in refused.items():
            await assert_parked(backend_dsn, dead, rid, "RECORDING_PATH_REFUSED", fragment)
            assert dead[rid].status == "PENDING"
            assert stored_files(store, rid) == []
        # Nothing from outside reached the receiver; the neighbours did.
        assert receiver.log.ids() == {r.recording_id for r in good}
        for recording in good:
            assert (await recording_row(backend_dsn, recording.recording_id))[0] == "uploaded"
            assert not recording.folder.exists()
            assert_kept_once(store, recording)
    # Everything outside, the symlinks and the stray files in RECORDINGS_DIR are as they were.
    assert snapshot(outside, local) == before
    assert (local / linked_folder).is_symlink()


async def test_missing_files_and_bad_meta_are_parked_and_kept(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        no_folder = await make_recording(backend_dsn, local, write_files=False)
        bad_meta = await make_recording(backend_dsn, local, meta=b'{"callId": not json')
        good = await make_recording(backend_dsn, local)
        no_meta = await make_recording(backend_dsn, local)
        (no_meta.folder / "meta.json").unlink()
        no_audio = await make_recording(backend_dsn, local)
        (no_audio.folder / "mixed.wav").unlink()
        # Not regular files: a FIFO would block a plain open() for ever, waiting for a writer.
        fifo_audio = await make_recording(backend_dsn, local)
        (fifo_audio.folder / "mixed.wav").unlink()
        os.mkfifo(fifo_audio.folder / "mixed.wav")
        fifo_meta = await make_recording(backend_dsn, local)
        (fifo_meta.folder / "meta.json").unlink()
        os.mkfifo(fifo_meta.folder / "meta.json")
        dir_audio = await make_recording(backend_dsn, local)
        (dir_audio.folder / "mixed.wav").unlink()
        (dir_audio.folder / "mixed.wav").mkdir()
        before = snapshot(local)
        not_regular = ("RECORDING_FILE_UNREADABLE", "is not a regular file")
        expected = {
            no_folder.recording_id: ("RECORDING_FILE_MISSING", "mixed.wav does not exist"),
            no_audio.recording_id: ("RECORDING_FILE_MISSING", "mixed.wav does not exist"),
            bad_meta.recording_id: ("RECORDING_META_INVALID", "meta.json is not JSON"),
            no_meta.recording_id: ("RECORDING_META_MISSING", "meta.json does not exist"),
            fifo_audio.recording_id: not_regular,
            fifo_meta.recording_id: not_regular,
            dir_audio.recording_id: not_regular,
        }

        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.parked_events == len(expected)

        dead = await parked(backend_dsn)
        assert {rid: (d.error_code, d.error_message) for rid, d in dead.items()}.keys() == set(
            expected
        )
        for rid, (code, fragment) in expected.items():
            await assert_parked(backend_dsn, dead, rid, code, fragment)
        assert receiver.log.ids() == {good.recording_id}
        assert (await recording_row(backend_dsn, good.recording_id))[0] == "uploaded"
    # Nothing of the parked recordings was deleted; only the good one's folder is gone.
    assert snapshot(local) == without(before, good.folder)
    assert not good.folder.exists()
    assert (fifo_audio.folder / "mixed.wav").is_fifo()
    assert (fifo_meta.folder / "meta.json").is_fifo()
    assert (dir_audio.folder / "mixed.wav").is_dir()


async def test_a_file_over_the_receivers_limit_is_parked_not_retried(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    limit = 256 * 1024
    async with recording_receiver(receiver_dsn, store, max_bytes=limit) as receiver:
        # 1 MiB: refused while streaming; 3 MiB: refused by its Content-Length before reading.
        oversized = [
            await make_recording(backend_dsn, local, audio_size=size) for size in (MIB, 3 * MIB)
        ]
        good = await make_recording(backend_dsn, local)
        before = snapshot(local)

        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            # A refusal is not passing trouble: never retried with backoff.
            assert runtime.stats.retries == 0
            assert runtime.stats.parked_events == 2

        dead = await parked(backend_dsn)
        assert set(dead) == {r.recording_id for r in oversized}
        for recording in oversized:
            rid = recording.recording_id
            await assert_parked(
                backend_dsn, dead, rid, "HTTP_413", "over the limit of 262144 bytes"
            )
            # Sent once: the narrower tries answer the receiver's refusal without sending it.
            assert receiver.log.statuses(rid) == [413]
            assert stored_files(store, rid) == []
        assert receiver.log.statuses(good.recording_id) == [200]
        assert incoming_leftovers(store) == []
    assert snapshot(local) == without(before, good.folder)


# -- a large file --------------------------------------------------------------------------------


async def test_a_100_mb_recording_is_streamed_with_flat_memory(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path, procs: RecordingProcesses
) -> None:
    local, store = dirs(tmp_path)
    url, ingest = await procs.ingest_server(receiver_dsn, store)
    consumer = procs.upload_consumer(backend_dsn, url, local, "consumer")
    # Warm up: one small upload runs every code path once, then the peak so far is the baseline.
    small = await make_recording(backend_dsn, local)
    await wait_uploaded(backend_dsn, small.recording_id, timeout=20)
    await wait_until(lambda: not small.folder.exists(), what="the small folder deleted")
    consumer_idle = consumer.memory_kib("VmHWM")
    ingest_idle = ingest.memory_kib("VmHWM")

    size = 100 * 1000 * 1000
    # The same bytes beside it, to compare with (the consumer deletes the source once it is safe).
    write_large_wav(tmp_path / "expected.wav", size)
    source_sha256 = sha256_of(tmp_path / "expected.wav")
    big = await make_recording(backend_dsn, local, audio_size=size, meta={"durationSec": 3125})

    file_url = await wait_uploaded(backend_dsn, big.recording_id, timeout=120)
    await wait_until(lambda: not big.folder.exists(), what="the big folder deleted")
    consumer.assert_alive()
    consumer_peak = consumer.memory_kib("VmHWM")
    ingest_peak = ingest.memory_kib("VmHWM")
    assert consumer_peak - consumer_idle < 40 * 1024, (consumer_idle, consumer_peak)
    assert ingest_peak - ingest_idle < 40 * 1024, (ingest_idle, ingest_peak)

    kept = store / big.call_id / f"{big.recording_id}.wav"
    assert file_url.endswith(f"/storage/recordings/{big.call_id}/{big.recording_id}.wav")
    assert kept.stat().st_size == size
    assert sha256_of(kept) == source_sha256
    async with aiohttp.ClientSession() as session:
        last = {"Range": f"bytes={size - 16}-"}
        async with session.get(file_url, headers=last) as response:
            assert response.status == 206
            assert await response.read() == b"\0" * 16
    assert await consumer.stop() == 0
    assert await all_dead_letters(backend_dsn) == 0


# -- concurrency ---------------------------------------------------------------------------------


async def test_uploads_run_two_at_a_time_and_the_offset_waits_for_the_slowest(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        made = [await make_recording(backend_dsn, local) for _ in range(6)]
        receiver.log.hold_all = True
        settings = upload_settings(backend_dsn, receiver.url, local, SYNC_UPLOAD_CONCURRENCY=2)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_until(lambda: len(receiver.log.waiting) >= 2, what="two uploads held")
            assert len(receiver.log.waiting) == 2
            assert receiver.log.max_in_flight == 2
            # Hold the first one for good; the others pass, one at a time beside it.
            slow = receiver.log.waiting[0]
            await receiver.log.hold_only(slow)
            others = [r for r in made if r.recording_id != slow]
            for recording in others:
                await wait_uploaded(backend_dsn, recording.recording_id)
            await wait_until(lambda: not any(r.folder.exists() for r in others))
            assert receiver.log.waiting == [slow]
            assert receiver.log.max_in_flight == 2
            # Everything else is done, but the offset has not passed the held upload's event.
            position = await offset(backend_dsn, RECORDINGS_CONSUMER)
            assert position == Position.start()
            assert position < await event_position(backend_dsn, slow)
            assert await recording_row(backend_dsn, slow) == ("pending", None)
            assert runtime.stats.delivered_events == 0

            await receiver.log.release(slow)
            await wait_uploaded(backend_dsn, slow)
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.failed_deliveries == 0
        assert receiver.log.max_in_flight == 2
        assert len(receiver.log.uploads) == len(made)
        assert not any(r.folder.exists() for r in made)
    assert await all_dead_letters(backend_dsn) == 0


# -- what is not for this consumer -------------------------------------------------------------


async def test_deleted_rows_settled_rows_and_other_events_are_skipped(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        deleted = await make_recording(backend_dsn, local)
        await execute(
            backend_dsn, "DELETE FROM recordings WHERE id = %s", params=(deleted.recording_id,)
        )
        uploaded = await make_recording(backend_dsn, local, upload_status="uploaded")
        failed = await make_recording(backend_dsn, local, upload_status="failed")
        failed_later = await make_recording(backend_dsn, local)
        await execute(
            backend_dsn,
            "UPDATE recordings SET upload_status = 'failed' WHERE id = %s",
            params=(failed_later.recording_id,),
        )
        await execute(
            backend_dsn,
            "INSERT INTO registered_numbers (phone_number, label) VALUES ('0312345678', 'x')",
        )
        await execute(backend_dsn, "UPDATE call_logs SET callee_number = '0000'")
        before = snapshot(local)

        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.failed_deliveries == 0
            assert runtime.stats.parked_events == 0
        assert receiver.log.uploads == []
        assert await all_dead_letters(backend_dsn) == 0
        for recording, status in (
            (uploaded, "uploaded"),
            (failed, "failed"),
            (failed_later, "failed"),
        ):
            assert await recording_row(backend_dsn, recording.recording_id) == (status, None)
    # Not this consumer's to delete.
    assert snapshot(local) == before


# -- the dead-letter queue -----------------------------------------------------------------------


async def test_a_parked_missing_file_is_retried_from_the_cli_once_it_is_in_place(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        recording = await make_recording(backend_dsn, local, write_files=False)
        rid = recording.recording_id
        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER):
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
        message = (await parked(backend_dsn))[rid]
        assert message.error_code == "RECORDING_FILE_MISSING"
        assert await recording_row(backend_dsn, rid) == ("failed", None)

        recording.folder.mkdir()
        (recording.folder / "mixed.wav").write_bytes(recording.audio)
        (recording.folder / "meta.json").write_bytes(b'{"late": true}')
        env = cli_env(
            DATABASE_URL=backend_dsn,
            FRONTEND_BASE_URL=receiver.url,
            RECORDINGS_DIR=str(local),
            SYNC_SHARED_SECRET=SECRET,
        )
        result = await finish(await start_cli("dlq", "retry", message.id, env=env))
        assert result.code == 0, result
        assert result.stdout.strip() == f"{message.id}: delivered; RESOLVED", result
        assert "Traceback" not in result.stderr, result.stderr

        status, file_url = await recording_row(backend_dsn, rid)
        assert status == "uploaded"
        assert receiver.log.file_urls(rid) == [file_url]
        assert not recording.folder.exists()
        assert_kept_once(store, recording)
        assert (await parked(backend_dsn))[rid].status == "RESOLVED"
        assert await upload_statuses(backend_dsn, rid) == [
            "pending",
            "failed",
            "pending",
            "uploaded",
        ]


async def test_an_operator_retry_makes_a_parked_recording_pending_then_failed_or_uploaded(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        recording = await make_recording(backend_dsn, local, write_files=False)
        rid = recording.recording_id
        settings = upload_settings(backend_dsn, receiver.url, local)
        async with running_consumer(settings, RECORDINGS_CONSUMER):
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
        message = (await parked(backend_dsn))[rid]
        assert await recording_row(backend_dsn, rid) == ("failed", None)

        async with open_pool(backend_dsn, "test-dlq", max_size=2) as pool:
            # The admin API's service: the consumer's own sinks, for dead letters.
            service = DeadLetters(DlqStore.over_pool(pool), dlq_sinks(settings, pool=pool))
            try:
                # Retried while the files are still missing: pending while it is tried, then
                # failed again, the message back in the queue.
                again = await service.retry_all(RECORDINGS_CONSUMER)
                assert (again.retried, again.succeeded, again.failed) == (1, 0, 1), again
                assert await recording_row(backend_dsn, rid) == ("failed", None)
                assert (await parked(backend_dsn))[rid].status == "PENDING"
                assert receiver.log.uploads == []

                # Retried once the files are there, with the consumer running beside the retry
                # (as it does for the admin API): the row says pending while the upload is on
                # its way, then uploaded.
                recording.folder.mkdir()
                (recording.folder / "mixed.wav").write_bytes(recording.audio)
                (recording.folder / "meta.json").write_bytes(b'{"late": true}')
                await receiver.log.hold_only(rid)
                async with running_consumer(settings, RECORDINGS_CONSUMER):
                    retry = asyncio.create_task(service.retry(message.id))
                    await wait_until(lambda: rid in receiver.log.waiting, what="the retry held")
                    assert await recording_row(backend_dsn, rid) == ("pending", None)
                    await receiver.log.release(rid)
                    result = await retry
                    assert result.delivered, result
                    assert result.message.status == "RESOLVED"
                    await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            finally:
                await service.close()

        status, file_url = await recording_row(backend_dsn, rid)
        assert status == "uploaded"
        assert file_url in receiver.log.file_urls(rid)
        assert_kept_once(store, recording)
        assert not recording.folder.exists()
    # The consumer saw the retry's 'pending' too; it parked nothing more.
    assert list(await parked(backend_dsn)) == [rid]
    assert await upload_statuses(backend_dsn, rid) == [
        "pending",
        "failed",
        "pending",
        "failed",
        "pending",
        "uploaded",
    ]


async def test_a_row_mark_lost_after_the_park_is_made_when_the_lead_is_taken(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path, procs: RecordingProcesses
) -> None:
    # The row is marked failed once the park is committed; a crash in between leaves it
    # pending, and the next leader marks it. Not a row the backend wrote since: that is a new
    # request, uploaded through its own event.
    local, store = dirs(tmp_path)
    async with recording_receiver(receiver_dsn, store) as receiver:
        lost = await make_recording(backend_dsn, local, write_files=False)
        asked_again = await make_recording(backend_dsn, local, write_files=False)
        first = procs.upload_consumer(
            backend_dsn,
            receiver.url,
            local,
            "first",
            SERVERSYNC_FAILPOINTS="recording-upload.after-park=kill",
        )
        assert await first.wait_exit(20) == -signal.SIGKILL
        assert set(await parked(backend_dsn)) == {
            lost.recording_id,
            asked_again.recording_id,
        }
        for recording in (lost, asked_again):
            assert await recording_row(backend_dsn, recording.recording_id) == ("pending", None)

        # The backend writes the files and asks again for one of them.
        for recording in (lost, asked_again):
            recording.folder.mkdir()
            (recording.folder / "mixed.wav").write_bytes(recording.audio)
            (recording.folder / "meta.json").write_bytes(b"{}")
        await execute(
            backend_dsn,
            "UPDATE recordings SET upload_status = 'pending', updated_at = now() WHERE id = %s",
            params=(asked_again.recording_id,),
        )

        second = procs.upload_consumer(backend_dsn, receiver.url, local, "second")
        await second.wait_log("1 parked recording(s) marked failed")
        await wait_uploaded(backend_dsn, asked_again.recording_id)
        await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
        assert await second.stop() == 0
        assert await recording_row(backend_dsn, lost.recording_id) == ("failed", None)
        assert receiver.log.ids() == {asked_again.recording_id}
        assert lost.folder.exists()


# -- startup -------------------------------------------------------------------------------------


async def test_run_refuses_to_start_without_a_usable_recordings_dir(
    backend_dsn: str, tmp_path: Path
) -> None:
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    for where in (tmp_path / "nowhere", a_file):
        env = cli_env(
            DATABASE_URL=backend_dsn,
            FRONTEND_BASE_URL="http://127.0.0.1:9",
            RECORDINGS_DIR=str(where),
        )
        result = await finish(await start_cli("run", RECORDINGS_CONSUMER, env=env), timeout=30)
        # A configuration error: exit 2, one line naming the variable.
        line = assert_one_line_error(result, 2, "RECORDINGS_DIR", str(where), "not a directory")
        assert line.startswith("serversync: configuration error: "), line
    assert RecordingsDir(tmp_path).check() is None


async def test_a_vanished_recordings_dir_is_retried_not_parked(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    # An unmounted or removed RECORDINGS_DIR is the host's trouble, not the recordings': every
    # recording would otherwise be parked as missing.
    local, store = dirs(tmp_path)
    away = tmp_path / "unmounted"
    async with recording_receiver(receiver_dsn, store) as receiver:
        settings = upload_settings(backend_dsn, receiver.url, local, SYNC_MAX_ATTEMPTS=0)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_until(lambda: runtime.stats.is_leader, what="the consumer leading")
            local.rename(away)
            recording = await make_recording(backend_dsn, local, write_files=False)
            (away / recording.call_id).mkdir()
            (away / recording.call_id / "mixed.wav").write_bytes(recording.audio or wav_bytes())
            (away / recording.call_id / "meta.json").write_bytes(b"{}")
            await wait_until(lambda: runtime.stats.retries >= 2, what="retries while it is gone")
            assert await parked(backend_dsn) == {}
            away.rename(local)
            await wait_uploaded(backend_dsn, recording.recording_id)
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
        assert receiver.log.count(recording.recording_id) == 1
    assert await parked(backend_dsn) == {}


async def test_a_receiver_in_trouble_is_retried_and_nothing_is_deleted_on_its_word(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    # The receiver answers 503, then 200 with garbage, then 200 naming other bytes, then works.
    # Only the last answer confirms the upload: until then the row stays pending, the local
    # copy stays on disk, and nothing is parked (passing trouble is retried).
    local, store = dirs(tmp_path)
    answers = [
        web.json_response({"error": {"code": "BUSY"}}, status=503),
        web.Response(body=b"<html>proxy error</html>", content_type="text/html"),
        web.json_response({"fileUrl": "http://x/y.wav", "sha256": "0" * 64, "size": 1}),
    ]
    seen: list[str] = []

    @web.middleware
    async def troubled(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path != UPLOAD_PATH:
            return await handler(request)
        if not answers:
            seen.append("ok")
            return await handler(request)
        seen.append("trouble")
        await request.read()
        return answers.pop(0)

    async with serve_receiver(
        receiver_dsn,
        recordings=RecordingFiles(store, max_bytes=MIB),
        shared_secret=SECRET,
        middlewares=[troubled],
        shutdown_timeout=1.0,
    ) as url:
        recording = await make_recording(backend_dsn, local)
        settings = upload_settings(backend_dsn, url, local, SYNC_RETRY_INITIAL_SEC=0.2)
        async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
            await wait_until(lambda: len(seen) == 3, what="three troubled answers")
            # Each trouble is seen before the next attempt: the local copy and the row are
            # untouched in between (the backoff leaves time to look).
            assert recording.folder.exists()
            assert await recording_row(backend_dsn, recording.recording_id) == ("pending", None)
            status = await wait_uploaded(backend_dsn, recording.recording_id)
            await wait_until(lambda: not recording.folder.exists(), what="the folder deleted")
            await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
            assert runtime.stats.retries == 3
    assert seen == ["trouble", "trouble", "trouble", "ok"]
    assert status.startswith(url)
    assert_kept_once(store, recording)
    dead = await parked(backend_dsn)
    assert dead == {}


async def test_a_receiver_busy_or_short_of_disk_space_is_retried_and_nothing_is_parked(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    # The receiver's own bounds: 503 while its upload slots are taken, 507 while its disk is
    # short. Both are passing trouble: tried again after the receiver's Retry-After, the row
    # pending and the local copy kept meanwhile, nothing parked.
    local, store = dirs(tmp_path)
    async with recording_receiver(
        receiver_dsn,
        store,
        max_concurrent_uploads=1,
        busy_retry_after_sec=1,
        full_retry_after_sec=1,
    ) as receiver:
        # Another upload takes the only slot, its body held halfway.
        other = Upload(audio=os.urandom(MIB))
        body, content_type = await multipart(other.parts())
        half = audio_offset(body, other) + MIB // 2
        release = asyncio.Event()
        async with aiohttp.ClientSession() as client:
            occupant = asyncio.create_task(
                post(
                    client,
                    receiver.url,
                    held_back(body[:half], release, body[half:]),
                    content_type=content_type,
                    headers=other.signed(),
                )
            )
            try:
                await wait_until(lambda: receiver.files.uploading == 1, what="the slot taken")
                recording = await make_recording(backend_dsn, local)
                rid = recording.recording_id
                settings = upload_settings(backend_dsn, receiver.url, local)
                async with running_consumer(settings, RECORDINGS_CONSUMER) as runtime:
                    await wait_until(
                        lambda: (
                            receiver.log.statuses(rid)[:1] == [503] and runtime.stats.retries >= 1
                        ),
                        what="the upload answered 503 and retried",
                    )
                    assert await recording_row(backend_dsn, rid) == ("pending", None)
                    # The disk runs short, then the slot is given back.
                    receiver.files.min_free_bytes = 2**62
                    release.set()
                    status, reply = await occupant
                    assert status == 200, reply
                    await wait_until(
                        lambda: 507 in receiver.log.statuses(rid), what="the upload answered 507"
                    )
                    assert await recording_row(backend_dsn, rid) == ("pending", None)
                    assert (recording.folder / "mixed.wav").read_bytes() == recording.audio
                    assert await parked(backend_dsn) == {}
                    receiver.files.min_free_bytes = 0
                    await wait_uploaded(backend_dsn, rid)
                    await wait_caught_up(backend_dsn, RECORDINGS_CONSUMER)
                    assert runtime.stats.parked_events == 0
            finally:
                release.set()
                await asyncio.gather(occupant, return_exceptions=True)
        answered = receiver.log.statuses(rid)
        shape = [s for n, s in enumerate(answered) if n == 0 or answered[n - 1] != s]
        assert shape == [503, 507, 200], answered
        assert_kept_once(store, recording)
    assert await parked(backend_dsn) == {}
