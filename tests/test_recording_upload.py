"""recording-upload end to end: real WAV files on disk, the real receiver, real PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from tests.conftest import make_settings, running_consumer, wait_until
from tests.helpers_recordings import SECRET, make_recording, recording_receiver, recording_row


async def test_recordings_are_uploaded_marked_and_deleted_locally(
    backend_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    local, store = tmp_path / "recordings", tmp_path / "store"
    local.mkdir()
    async with recording_receiver(receiver_dsn, store) as url:
        made = [await make_recording(backend_dsn, local) for _ in range(3)]
        settings = make_settings(
            backend_dsn, url, RECORDINGS_DIR=str(local), SYNC_SHARED_SECRET=SECRET
        )
        async with running_consumer(settings, "recording-upload"):
            for recording in made:

                async def uploaded(rid: str = recording.recording_id) -> bool:
                    return (await recording_row(backend_dsn, rid))[0] == "uploaded"

                await wait_until(uploaded, timeout=10)
            await wait_until(lambda: not any(r.folder.exists() for r in made), timeout=10)
        async with aiohttp.ClientSession() as session:
            for recording in made:
                _, file_url = await recording_row(backend_dsn, recording.recording_id)
                assert file_url is not None
                async with session.get(file_url) as response:
                    assert response.status == 200
                    assert response.headers["Content-Type"] == "audio/wav"
                    assert await response.read() == recording.audio
                async with session.get(file_url, headers={"Range": "bytes=10-19"}) as response:
                    assert response.status == 206
                    assert await response.read() == recording.audio[10:20]
