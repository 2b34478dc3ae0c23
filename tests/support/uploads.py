"""Recording uploads sent by hand, as the recording-upload consumer sends them: one Upload (its
ids and two files), its multipart body, signed manifest headers, and a body held back halfway;
and the reference receiver keeping them (UploadReceiver), what its store holds and its errors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from consumer.receiver.uploads import RecordingFiles
from consumer.wire.signing import RecordingManifest, manifest_headers
from tests.conftest import serve_receiver
from tests.support.recordings import SECRET, wav_bytes

UPLOAD = "/api/ingest/recording-file"
FILES = "/storage/recordings"
# A deadline for answers that must come without the rest of the body (never reached when the
# receiver behaves; a receiver waiting for the body would hang the test until then).
ANSWER_DEADLINE = 10.0

# (name, value, content type, filename): one multipart part. Text parts are str.
Part = tuple[str, str | bytes, str, str | None]


def sha256(data: bytes) -> str:
    """The SHA-256 of `data`, in hex."""
    return hashlib.sha256(data).hexdigest()


def noise(size: int, seed: int = 7) -> bytes:
    """`size` reproducible pseudo-random bytes: a file where any misplaced byte shows."""
    return random.Random(seed).randbytes(size)


@dataclass(frozen=True)
class Upload:
    """One recording upload: its ids and the two files."""

    call_log_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    recording_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    audio: bytes = field(default_factory=wav_bytes)
    meta: bytes = b'{"callId": "c", "codec": "pcm_s16le", "durationSec": 0.2}'

    def parts(self) -> list[Part]:
        """The four parts, as the recording-upload consumer sends them."""
        return [
            ("callLogId", self.call_log_id, "text/plain", None),
            ("recordingId", self.recording_id, "text/plain", None),
            ("audio", self.audio, "application/octet-stream", "mixed.wav"),
            ("meta", self.meta, "application/json", "meta.json"),
        ]

    def manifest(self, *, audio: bytes | None = None) -> RecordingManifest:
        """What the sender declares: the ids, and each file's size and SHA-256 (the audio's of
        `audio` if given)."""
        declared = self.audio if audio is None else audio
        return RecordingManifest(
            self.call_log_id,
            self.recording_id,
            len(declared),
            sha256(declared),
            len(self.meta),
            sha256(self.meta),
        )

    def signed(
        self, secret: str = SECRET, *, audio: bytes | None = None, now: float | None = None
    ) -> dict[str, str]:
        """The manifest header (of `audio` if given) and the signature headers over it."""
        return manifest_headers(secret, self.manifest(audio=audio), now=now)

    @property
    def where(self) -> str:
        """The audio's path in the store, relative to it."""
        return f"{self.call_log_id}/{self.recording_id}.wav"


async def multipart(parts: list[Part]) -> tuple[bytes, str]:
    """A real multipart/form-data body built by aiohttp, and its Content-Type (with boundary)."""
    form = aiohttp.FormData(default_to_multipart=True)
    for name, value, content_type, filename in parts:
        # Bytes as a file object: what aiohttp expects for a file (large bytes make it warn).
        data = io.BytesIO(value) if isinstance(value, bytes) else value
        form.add_field(name, data, content_type=content_type, filename=filename)
    writer = form()
    assert isinstance(writer, aiohttp.MultipartWriter)
    return await writer.as_bytes(), writer.content_type


def audio_offset(body: bytes, upload: Upload) -> int:
    """Where the audio's bytes start in a multipart body."""
    offset = body.index(upload.audio)
    assert offset > 0
    return offset


async def held_back(head: bytes, release: asyncio.Event, rest: bytes = b"") -> AsyncIterator[bytes]:
    """A body sent as `head`, then (only once `release` is set) `rest`: aiohttp sends an async
    generator chunked, unless a Content-Length header is given."""
    yield head
    await release.wait()
    for start in range(0, len(rest), 64 * 1024):
        yield rest[start : start + 64 * 1024]


async def post(
    session: aiohttp.ClientSession,
    url: str,
    data: Any,
    *,
    content_type: str,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    """POST an upload; the status and the JSON body (which must be JSON)."""
    async with session.post(
        url + UPLOAD, data=data, headers={"Content-Type": content_type, **(headers or {})}
    ) as response:
        assert response.content_type == "application/json", await response.text()
        reply: dict[str, Any] = orjson.loads(await response.read())
        return response.status, reply


async def upload(
    session: aiohttp.ClientSession,
    url: str,
    recording: Upload,
    *,
    headers: dict[str, str] | None = None,
    parts: list[Part] | None = None,
) -> tuple[int, dict[str, Any]]:
    """POST one recording as a multipart body with a Content-Length."""
    body, content_type = await multipart(recording.parts() if parts is None else parts)
    # A BytesIO of known size: sent with a Content-Length.
    return await post(session, url, io.BytesIO(body), content_type=content_type, headers=headers)


# -- the receiver's store ----------------------------------------------------------------------


def kept(root: Path) -> list[str]:
    """Everything under the store (files and folders, .incoming's contents too), sorted."""
    return sorted(path.relative_to(root).as_posix() for path in root.rglob("*"))


NOTHING = [".incoming"]


def stored(recording: Upload) -> list[str]:
    """What the store holds after keeping exactly `recording`."""
    folder = recording.call_log_id
    return sorted(
        [
            ".incoming",
            folder,
            f"{folder}/{recording.recording_id}.meta.json",
            f"{folder}/{recording.recording_id}.wav",
        ]
    )


def assert_error(
    got: tuple[int, dict[str, Any]], status: int, code: str, field: str | None = None
) -> None:
    """A JSON error answer {"error": {"code", "message", "field"?}} with these values."""
    got_status, reply = got
    assert got_status == status, reply
    assert list(reply) == ["error"], reply
    error = reply["error"]
    assert error["code"] == code, reply
    assert isinstance(error["message"], str) and error["message"], reply
    if field is None:
        assert "field" not in error, reply
    else:
        assert error["field"] == field, reply


@dataclass(frozen=True)
class UploadReceiver:
    """The reference receiver keeping recordings, without an upload log in front of it (see
    tests.support.recordings.RecordingReceiver for one): its base URL and its store directory."""

    url: str
    root: Path
    files: RecordingFiles

    @property
    def incoming(self) -> Path:
        """Where uploads stream to before they are renamed into place."""
        return self.root / ".incoming"

    def streaming(self) -> int:
        """How many uploads are being written to .incoming right now."""
        return len(list(self.incoming.glob("audio-*.part")))


@contextlib.asynccontextmanager
async def upload_receiver(
    receiver_dsn: str,
    root: Path,
    *,
    secret: str | None,
    max_bytes: int = 64 * 1024 * 1024,
    **options: Any,
) -> AsyncIterator[UploadReceiver]:
    """The reference receiver keeping recordings in `root` (signed when `secret` is given);
    `options` go to RecordingFiles (its bounds)."""
    files = RecordingFiles(root, max_bytes=max_bytes, **options)
    async with serve_receiver(receiver_dsn, recordings=files, shared_secret=secret) as url:
        yield UploadReceiver(url, root, files)
