"""The receiver's recording files over real HTTP on loopback: POST /api/ingest/recording-file
(validation, the signed manifest, idempotency by recordingId, atomic storage, nothing kept from a
refused or broken upload) and GET/HEAD of the stored file with Range. The upload's guards (the
manifest checked before the body, the bounds, symlinks in the store) are in
test_recording_receiver_guards.py."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from multidict import CIMultiDict
from yarl import URL

from consumer.receiver.uploads import RecordingFiles
from consumer.wire.signing import (
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
)
from tests.conftest import Databases, wait_until
from tests.support.recordings import SECRET, wav_bytes
from tests.support.uploads import (
    ANSWER_DEADLINE,
    FILES,
    NOTHING,
    UPLOAD,
    Part,
    Upload,
    UploadReceiver,
    assert_error,
    audio_offset,
    held_back,
    kept,
    multipart,
    noise,
    post,
    sha256,
    stored,
    upload,
    upload_receiver,
)

# The validating receiver's audio limit: small, so that oversized uploads are cheap to send.
LIMIT = 256 * 1024


@pytest.fixture
async def signed(receiver_dsn: str, tmp_path: Path) -> AsyncIterator[UploadReceiver]:
    """A receiver that requires signed uploads (SECRET)."""
    async with upload_receiver(receiver_dsn, tmp_path / "store", secret=SECRET) as running:
        yield running


@pytest.fixture
async def unsigned(receiver_dsn: str, tmp_path: Path) -> AsyncIterator[UploadReceiver]:
    """A receiver without a shared secret (ingest-server --insecure)."""
    async with upload_receiver(receiver_dsn, tmp_path / "store", secret=None) as running:
        yield running


# -- a good upload, and how it is served -----------------------------------------------------


async def test_a_signed_upload_is_kept_atomically_and_served_with_range(
    signed: UploadReceiver,
) -> None:
    recording = Upload(audio=wav_bytes(seconds=0.5))
    size = len(recording.audio)
    assert size > 1000
    async with aiohttp.ClientSession() as session:
        status, reply = await upload(session, signed.url, recording, headers=recording.signed())
        assert status == 200, reply
        file_url = f"{signed.url}{FILES}/{recording.where}"
        assert reply == {
            "fileUrl": file_url,
            "callLogId": recording.call_log_id,
            "recordingId": recording.recording_id,
            "size": size,
            "sha256": sha256(recording.audio),
            "created": True,
        }
        # The store holds exactly the audio and the meta beside it, nothing in .incoming.
        assert kept(signed.root) == stored(recording)
        assert (signed.root / recording.where).read_bytes() == recording.audio
        meta = signed.root / recording.call_log_id / f"{recording.recording_id}.meta.json"
        assert meta.read_bytes() == recording.meta

        async with session.get(file_url) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "audio/wav"
            assert response.headers["Accept-Ranges"] == "bytes"
            assert await response.read() == recording.audio
        async with session.get(file_url, headers={"Range": "bytes=0-99"}) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == f"bytes 0-99/{size}"
            assert response.headers["Content-Type"] == "audio/wav"
            assert await response.read() == recording.audio[:100]
        async with session.get(file_url, headers={"Range": "bytes=1000-1999"}) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == f"bytes 1000-1999/{size}"
            assert await response.read() == recording.audio[1000:2000]
        # A suffix range: the last 100 bytes (how a player reads a trailer).
        async with session.get(file_url, headers={"Range": "bytes=-100"}) as response:
            assert response.status == 206
            assert response.headers["Content-Range"] == f"bytes {size - 100}-{size - 1}/{size}"
            assert await response.read() == recording.audio[-100:]
        async with session.get(file_url, headers={"Range": f"bytes={size}-"}) as response:
            assert response.status == 416
            assert response.headers["Content-Range"] == f"bytes */{size}"
        async with session.get(file_url, headers={"Range": "bytes=0-9,20-29"}) as response:
            assert response.status == 416  # one range per request
        async with session.head(file_url) as response:
            assert response.status == 200
            assert response.headers["Content-Length"] == str(size)
            assert response.headers["Content-Type"] == "audio/wav"
            etag = response.headers["ETag"]
            assert await response.read() == b""
        async with session.get(file_url, headers={"If-None-Match": etag}) as response:
            assert response.status == 304
            assert await response.read() == b""


async def test_conditional_requests_and_if_range_answer_304_412_200_or_206(
    signed: UploadReceiver,
) -> None:
    recording = Upload(audio=wav_bytes(seconds=0.5))
    size = len(recording.audio)
    async with aiohttp.ClientSession() as client:
        status, reply = await upload(client, signed.url, recording, headers=recording.signed())
        assert status == 200, reply
        file_url = reply["fileUrl"]
        async with client.get(file_url) as response:
            etag, modified = response.headers["ETag"], response.headers["Last-Modified"]
        long_ago = "Mon, 01 Jan 2001 00:00:00 GMT"

        async def get(**headers: str) -> tuple[int, CIMultiDict[str], bytes]:
            async with client.get(file_url, headers=headers) as response:
                return response.status, response.headers.copy(), await response.read()

        for headers in (
            {"If-None-Match": etag},
            {"If-None-Match": "*"},
            {"If-Modified-Since": modified},
        ):
            status, answered, body = await get(**headers)
            assert (status, body) == (304, b""), headers
            assert answered["ETag"] == etag
        for headers in ({"If-None-Match": '"other"'}, {"If-Modified-Since": long_ago}):
            assert (await get(**headers))[0] == 200, headers
        for headers in ({"If-Match": '"other"'}, {"If-Unmodified-Since": long_ago}):
            status, answered, body = await get(**headers)
            assert (status, body, answered["Content-Length"]) == (412, b"", "0"), headers
        assert (await get(**{"If-Match": etag}))[0] == 200
        # If-Range: the range when the validator names this version, else the whole file.
        for validator, status, data in (
            (etag, 206, recording.audio[:10]),
            (modified, 206, recording.audio[:10]),
            ('"other"', 200, recording.audio),
            (long_ago, 200, recording.audio),
        ):
            answered_status, answered, body = await get(
                Range="bytes=0-9", **{"If-Range": validator}
            )
            assert (answered_status, body) == (status, data), validator
            if status == 206:
                assert answered["Content-Range"] == f"bytes 0-9/{size}"
        for malformed in ("bytes=9-0", "lines=0-9", "bytes=-"):
            status, answered, body = await get(Range=malformed)
            assert (status, answered["Content-Range"], body) == (416, f"bytes */{size}", b"")
        async with client.head(file_url, headers={"Range": "bytes=10-19"}) as response:
            assert response.status == 206
            assert response.headers["Content-Length"] == "10"
            assert await response.read() == b""
        # The upload route takes POST only.
        async with client.get(f"{signed.url}{UPLOAD}") as response:
            assert response.status == 405
            assert response.headers["Allow"] == "POST"


async def test_unknown_and_malformed_paths_are_404_and_never_leave_the_store(
    signed: UploadReceiver, tmp_path: Path
) -> None:
    recording = Upload()
    secret_bytes = b"RIFF-outside-the-store-" + noise(64)
    # Files a traversal would reach: beside the store, and in the store's own root.
    (tmp_path / "secret.wav").write_bytes(secret_bytes)
    (tmp_path / "secret.meta.json").write_bytes(secret_bytes)
    async with aiohttp.ClientSession() as session:
        status, _ = await upload(session, signed.url, recording, headers=recording.signed())
        assert status == 200
        (signed.root / "secret.wav").write_bytes(secret_bytes)
        call, rec, other = recording.call_log_id, recording.recording_id, str(uuid.uuid4())
        paths = [
            f"{FILES}/{other}/{uuid.uuid4()}.wav",  # nothing like it
            f"{FILES}/{call}/{other}.wav",  # a known call, an unknown recording
            f"{FILES}/{other}/{rec}.wav",  # a known recording under another call
            f"{FILES}/{call}/{rec}.meta.json",  # the meta is not served
            f"{FILES}/not-a-uuid/{rec}.wav",
            f"{FILES}/{call}/not-a-uuid.wav",
            f"{FILES}/../../secret.wav",
            f"{FILES}/../secret.wav",
            f"{FILES}/{call}/../secret.wav",
            f"{FILES}/{call}/..%2Fsecret.wav",
            f"{FILES}/%2E%2E/secret.wav",
            f"{FILES}/..%2F..%2F/secret.wav",
            f"{FILES}/{call}/..%2F..%2Fsecret.wav",
            f"{FILES}/{call}/%2E%2E%2F%2E%2E%2Fsecret.wav",
        ]
        for path in paths:
            # encoded=True: the path goes out as written, "..", "%2F" and all.
            for method in ("GET", "HEAD"):
                target = URL(signed.url + path, encoded=True)
                async with session.request(method, target) as response:
                    body = await response.read()
                    assert response.status == 404, (method, path, response.status)
                    assert response.content_type == "application/json", (method, path)
                    if method == "GET":
                        assert orjson.loads(body)["error"]["code"] in {
                            "RECORDING_NOT_FOUND",
                            "HTTP_404",
                        }, (path, body)
                    assert secret_bytes not in body
        # The recording itself is still served.
        async with session.get(f"{signed.url}{FILES}/{recording.where}") as response:
            assert (response.status, await response.read()) == (200, recording.audio)
        # And an unknown recording answers the receiver's own JSON 404.
        async with session.get(f"{signed.url}{FILES}/{call}/{other}.wav") as response:
            reply = orjson.loads(await response.read())
            assert (response.status, reply["error"]["code"]) == (404, "RECORDING_NOT_FOUND")


# -- idempotency by recordingId --------------------------------------------------------------


async def test_the_same_upload_twice_is_one_file_and_the_same_file_url(
    signed: UploadReceiver,
) -> None:
    recording = Upload()
    async with aiohttp.ClientSession() as session:
        first = await upload(session, signed.url, recording, headers=recording.signed())
        second = await upload(session, signed.url, recording, headers=recording.signed())
    assert first[0] == second[0] == 200, (first, second)
    assert first[1]["created"] is True
    assert second[1] == {**first[1], "created": False}
    assert kept(signed.root) == stored(recording)
    assert (signed.root / recording.where).read_bytes() == recording.audio


async def test_two_concurrent_uploads_of_one_recording_leave_one_correct_file(
    signed: UploadReceiver,
) -> None:
    # One upload of a recording is received at a time: the second, sent while the first is
    # being written, is answered 503 (tried again), and the first is kept whole.
    recording = Upload(audio=noise(3 * 1024 * 1024))
    body, content_type = await multipart(recording.parts())
    split = audio_offset(body, recording) + len(recording.audio) // 2
    release = asyncio.Event()
    async with aiohttp.ClientSession() as session:

        def send() -> asyncio.Task[tuple[int, dict[str, Any]]]:
            return asyncio.create_task(
                post(
                    session,
                    signed.url,
                    held_back(body[:split], release, body[split:]),
                    content_type=content_type,
                    headers=recording.signed(),
                )
            )

        first = send()
        try:
            await wait_until(lambda: signed.streaming() == 1, what="the first upload in flight")
            status, reply = await send()
            assert (status, reply["error"]["code"]) == (503, "INGEST_BUSY"), reply
        finally:
            release.set()
        status, reply = await first
        assert status == 200, reply
        assert reply["fileUrl"] == f"{signed.url}{FILES}/{recording.where}"
        assert (reply["size"], reply["sha256"], reply["created"]) == (
            len(recording.audio),
            sha256(recording.audio),
            True,
        )
        assert kept(signed.root) == stored(recording)
        assert (signed.root / recording.where).read_bytes() == recording.audio
        async with session.get(reply["fileUrl"]) as response:
            assert (response.status, await response.read()) == (200, recording.audio)


# -- validation: a JSON error naming what is wrong, and nothing kept -------------------------


@pytest.fixture(scope="module")
def shared_receiver_dsn(databases: Databases) -> str:
    """A receiver database for the module (made outside the event loop, like receiver_dsn)."""
    return databases.create("receiver")


@pytest.fixture(scope="module")
async def shared_receiver(
    shared_receiver_dsn: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[UploadReceiver]:
    """One unsigned receiver with a small audio limit, for the many uploads it must refuse."""
    root = tmp_path_factory.mktemp("validating") / "store"
    async with upload_receiver(shared_receiver_dsn, root, secret=None, max_bytes=LIMIT) as running:
        yield running


@pytest.fixture
async def validating(shared_receiver: UploadReceiver) -> AsyncIterator[UploadReceiver]:
    """The shared receiver, its store emptied after each test so that one failure stays one."""
    yield shared_receiver
    for path in shared_receiver.root.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    shared_receiver.incoming.mkdir()


def _without(name: str) -> Callable[[Upload], list[Part]]:
    return lambda up: [part for part in up.parts() if part[0] != name]


def _with(
    name: str, value: str | bytes, content_type: str | None = None
) -> Callable[[Upload], list[Part]]:
    def parts(up: Upload) -> list[Part]:
        return [
            (n, value, content_type or t, f) if n == name else (n, v, t, f)
            for n, v, t, f in up.parts()
        ]

    return parts


def _twice(name: str) -> Callable[[Upload], list[Part]]:
    def parts(up: Upload) -> list[Part]:
        every = up.parts()
        return every + [part for part in every if part[0] == name]

    return parts


def _extra(up: Upload) -> list[Part]:
    return [*up.parts(), ("comment", "hello", "text/plain", None)]


def _extra_file(up: Upload) -> list[Part]:
    return [*up.parts(), ("mixed.wav", up.audio, "application/octet-stream", "mixed.wav")]


BAD_PARTS = [
    pytest.param(_without("callLogId"), 422, "INGEST_VALIDATION_ERROR", "callLogId", id="no-call"),
    pytest.param(
        _without("recordingId"), 422, "INGEST_VALIDATION_ERROR", "recordingId", id="no-rec"
    ),
    pytest.param(_without("audio"), 422, "INGEST_VALIDATION_ERROR", "audio", id="no-audio"),
    pytest.param(_without("meta"), 422, "INGEST_VALIDATION_ERROR", "meta", id="no-meta"),
    pytest.param(
        _with("callLogId", "not-a-uuid"), 422, "INGEST_VALIDATION_ERROR", "callLogId", id="call-x"
    ),
    pytest.param(_with("callLogId", ""), 422, "INGEST_VALIDATION_ERROR", "callLogId", id="call-0"),
    pytest.param(
        _with("recordingId", "12345"), 422, "INGEST_VALIDATION_ERROR", "recordingId", id="rec-x"
    ),
    pytest.param(
        _with("recordingId", "../../etc/passwd"),
        422,
        "INGEST_VALIDATION_ERROR",
        "recordingId",
        id="rec-traversal",
    ),
    pytest.param(_with("audio", b""), 422, "INGEST_VALIDATION_ERROR", "audio", id="audio-empty"),
    pytest.param(
        _with("audio", b"hello", "text/plain"),
        415,
        "INGEST_UNSUPPORTED_MEDIA_TYPE",
        "audio",
        id="audio-text",
    ),
    pytest.param(_with("meta", b"{not json"), 422, "INGEST_VALIDATION_ERROR", "meta", id="meta-x"),
    pytest.param(_with("meta", b""), 422, "INGEST_VALIDATION_ERROR", "meta", id="meta-empty"),
    pytest.param(_extra, 422, "INGEST_VALIDATION_ERROR", "comment", id="extra-text"),
    pytest.param(_extra_file, 422, "INGEST_VALIDATION_ERROR", "mixed.wav", id="extra-file"),
    pytest.param(_twice("callLogId"), 422, "INGEST_VALIDATION_ERROR", "callLogId", id="call-2x"),
    pytest.param(_twice("audio"), 422, "INGEST_VALIDATION_ERROR", "audio", id="audio-2x"),
    pytest.param(_twice("meta"), 422, "INGEST_VALIDATION_ERROR", "meta", id="meta-2x"),
]


@pytest.mark.parametrize(("parts", "status", "code", "field"), BAD_PARTS)
async def test_a_bad_part_is_refused_naming_it_and_nothing_is_kept(
    validating: UploadReceiver,
    parts: Callable[[Upload], list[Part]],
    status: int,
    code: str,
    field: str,
) -> None:
    recording = Upload()
    async with aiohttp.ClientSession() as session:
        got = await upload(session, validating.url, recording, parts=parts(recording))
    assert_error(got, status, code, field)
    assert kept(validating.root) == NOTHING


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        pytest.param(
            b'{"callLogId": "x"}',
            "application/json",
            415,
            "INGEST_UNSUPPORTED_MEDIA_TYPE",
            id="json",
        ),
        pytest.param(b"RIFF....", "audio/wav", 415, "INGEST_UNSUPPORTED_MEDIA_TYPE", id="wav"),
        pytest.param(
            b"callLogId=x&recordingId=y",
            "application/x-www-form-urlencoded",
            415,
            "INGEST_UNSUPPORTED_MEDIA_TYPE",
            id="form",
        ),
        pytest.param(
            b"this is not multipart at all",
            "multipart/form-data; boundary=abcdef",
            400,
            "INGEST_BAD_MULTIPART",
            id="garbage",
        ),
        pytest.param(
            b"", "multipart/form-data; boundary=abcdef", 400, "INGEST_BAD_MULTIPART", id="empty"
        ),
        pytest.param(
            b"--abcdef\r\n", "multipart/form-data", 400, "INGEST_BAD_MULTIPART", id="no-boundary"
        ),
        pytest.param(
            b"--abcdef\r\nContent-Type: text/plain\r\n\r\nhello\r\n--abcdef--\r\n",
            "multipart/form-data; boundary=abcdef",
            400,
            "INGEST_BAD_MULTIPART",
            id="part-without-name",
        ),
    ],
)
async def test_a_body_that_is_not_a_multipart_upload_gets_a_json_error(
    validating: UploadReceiver, body: bytes, content_type: str, status: int, code: str
) -> None:
    async with aiohttp.ClientSession() as session:
        got = await post(session, validating.url, body, content_type=content_type)
    assert_error(got, status, code)
    assert kept(validating.root) == NOTHING


def _after(needle: Callable[[Upload], bytes], extra: int = 0) -> Callable[[bytes, Upload], int]:
    """A cut `extra` bytes after the end of `needle` in the body."""
    return lambda body, up: body.index(needle(up)) + len(needle(up)) + extra


@pytest.mark.parametrize(
    ("cut", "field"),
    [
        # The whole of a good callLogId, but the body ends before its boundary.
        pytest.param(_after(lambda up: up.call_log_id.encode()), "callLogId", id="after-call-id"),
        pytest.param(_after(lambda up: up.audio[:100], 50_000), "audio", id="mid-audio"),
        pytest.param(_after(lambda up: up.meta[:10]), "meta", id="mid-meta"),
        # The last part's data complete, but not the boundary that ends it.
        pytest.param(_after(lambda up: up.meta, 2), "meta", id="before-last-boundary"),
        # Every part complete, the closing boundary without its final "--".
        pytest.param(lambda body, up: len(body) - 4, None, id="unclosed"),
    ],
)
async def test_a_truncated_upload_is_400_and_nothing_is_kept(
    validating: UploadReceiver, cut: Callable[[bytes, Upload], int], field: str | None
) -> None:
    recording = Upload(audio=noise(100_000))
    body, content_type = await multipart(recording.parts())
    truncated = body[: cut(body, recording)]
    assert len(truncated) < len(body)
    async with aiohttp.ClientSession() as session:
        got = await post(session, validating.url, truncated, content_type=content_type)
    assert_error(got, 400, "INGEST_BAD_MULTIPART", field)
    assert kept(validating.root) == NOTHING


async def test_audio_up_to_the_limit_is_kept_and_one_byte_more_is_413(
    validating: UploadReceiver,
) -> None:
    at_limit = Upload(audio=noise(LIMIT, seed=1))
    over = Upload(audio=noise(LIMIT + 1, seed=2))
    async with aiohttp.ClientSession() as session:
        status, reply = await upload(session, validating.url, at_limit)
        assert (status, reply["size"]) == (200, LIMIT), reply
        # Content-Length (a little over LIMIT) does not tell: the audio is cut off as it streams.
        got = await upload(session, validating.url, over)
    assert_error(got, 413, "INGEST_TOO_LARGE", "audio")
    assert kept(validating.root) == stored(at_limit)
    assert (validating.root / at_limit.where).read_bytes() == at_limit.audio


async def test_a_declared_oversized_upload_is_413_before_the_body_is_read(
    validating: UploadReceiver,
) -> None:
    recording = Upload(audio=noise(LIMIT + 2 * 1024 * 1024))
    body, content_type = await multipart(recording.parts())
    never = asyncio.Event()  # the rest of the body never comes
    async with aiohttp.ClientSession() as session, asyncio.timeout(ANSWER_DEADLINE):
        got = await post(
            session,
            validating.url,
            held_back(body[:1024], never),
            content_type=content_type,
            headers={"Content-Length": str(len(body))},
        )
    assert_error(got, 413, "INGEST_TOO_LARGE")
    assert kept(validating.root) == NOTHING


async def test_a_chunked_upload_over_the_limit_is_cut_off_while_streaming(
    validating: UploadReceiver,
) -> None:
    recording = Upload(audio=noise(4 * LIMIT))
    body, content_type = await multipart(recording.parts())
    never = asyncio.Event()
    # No Content-Length: the receiver only learns the size by counting. The body stops (without
    # ending) well past the limit, so the answer must come from counting, not from the end.
    # (The receiver reads a chunk ahead to find the boundary, hence a margin of a chunk or so.)
    past_limit = audio_offset(body, recording) + 3 * LIMIT
    async with aiohttp.ClientSession() as session, asyncio.timeout(ANSWER_DEADLINE):
        got = await post(
            session,
            validating.url,
            held_back(body[:past_limit], never),
            content_type=content_type,
        )
    assert_error(got, 413, "INGEST_TOO_LARGE", "audio")
    assert kept(validating.root) == NOTHING


async def test_a_chunked_upload_within_the_limit_is_kept(validating: UploadReceiver) -> None:
    recording = Upload(audio=noise(LIMIT - 10))
    body, content_type = await multipart(recording.parts())
    go = asyncio.Event()
    go.set()
    async with aiohttp.ClientSession() as session:
        status, reply = await post(
            session,
            validating.url,
            held_back(body[:100], go, body[100:]),
            content_type=content_type,
        )
    assert (status, reply["created"], reply["sha256"]) == (200, True, sha256(recording.audio))
    assert (validating.root / recording.where).read_bytes() == recording.audio


# -- signatures ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(lambda up: {}, id="unsigned"),
        pytest.param(lambda up: {**up.signed(), TIMESTAMP_HEADER: ""}, id="empty-timestamp"),
        pytest.param(
            lambda up: {TIMESTAMP_HEADER: str(int(time.time()))}, id="no-signature-header"
        ),
        pytest.param(lambda up: up.signed(now=time.time() - 1000), id="stale"),
        pytest.param(lambda up: up.signed(now=time.time() + 1000), id="from-the-future"),
        pytest.param(
            lambda up: {**up.signed(), TIMESTAMP_HEADER: "yesterday"}, id="timestamp-garbage"
        ),
    ],
)
async def test_an_unsigned_or_stale_upload_is_401_before_the_body_is_read(
    signed: UploadReceiver, headers: Callable[[Upload], dict[str, str]]
) -> None:
    recording = Upload(audio=noise(1024 * 1024))
    body, content_type = await multipart(recording.parts())
    never = asyncio.Event()  # the receiver must answer from the headers alone
    async with aiohttp.ClientSession() as session, asyncio.timeout(ANSWER_DEADLINE):
        got = await post(
            session,
            signed.url,
            held_back(body[: audio_offset(body, recording) + 1000], never),
            content_type=content_type,
            headers=headers(recording),
        )
    assert_error(got, 401, "INGEST_UNAUTHORIZED")
    assert kept(signed.root) == NOTHING
    assert signed.streaming() == 0


def _other_audio(up: Upload) -> tuple[Upload, dict[str, str]]:
    # Signed for one file, sent with another of the same size.
    return replace(up, audio=noise(len(up.audio), seed=99)), up.signed()


def _other_meta(up: Upload) -> tuple[Upload, dict[str, str]]:
    return replace(up, meta=b'{"callId": "someone else"}'), up.signed()


def _other_recording(up: Upload) -> tuple[Upload, dict[str, str]]:
    return replace(up, recording_id=str(uuid.uuid4())), up.signed()


def _other_call(up: Upload) -> tuple[Upload, dict[str, str]]:
    return replace(up, call_log_id=str(uuid.uuid4())), up.signed()


def _wrong_secret(up: Upload) -> tuple[Upload, dict[str, str]]:
    return up, up.signed("another-secret-entirely-0123456789")


def _mangled(up: Upload) -> tuple[Upload, dict[str, str]]:
    headers = up.signed()
    return up, {**headers, SIGNATURE_HEADER: headers[SIGNATURE_HEADER][:-4] + "0000"}


@pytest.mark.parametrize(
    ("tamper", "field"),
    [
        # A part that is not the manifest's is named; a signature that does not match is not.
        pytest.param(_other_audio, "audio", id="other-audio"),
        pytest.param(_other_meta, "meta", id="other-meta"),
        pytest.param(_other_recording, "recordingId", id="other-recording-id"),
        pytest.param(_other_call, "callLogId", id="other-call-log-id"),
        pytest.param(_wrong_secret, None, id="wrong-secret"),
        pytest.param(_mangled, None, id="mangled-signature"),
    ],
)
async def test_a_signature_over_something_else_is_401_and_nothing_is_kept(
    signed: UploadReceiver,
    tamper: Callable[[Upload], tuple[Upload, dict[str, str]]],
    field: str | None,
) -> None:
    sent, headers = tamper(Upload(audio=noise(200_000)))
    async with aiohttp.ClientSession() as session:
        got = await upload(session, signed.url, sent, headers=headers)
    assert_error(got, 401, "INGEST_UNAUTHORIZED", field)
    assert kept(signed.root) == NOTHING


async def test_ids_are_signed_as_sent_and_kept_in_canonical_form(signed: UploadReceiver) -> None:
    canonical = Upload()
    sent = replace(
        canonical,
        call_log_id=canonical.call_log_id.upper(),
        recording_id=canonical.recording_id.upper(),
    )
    async with aiohttp.ClientSession() as session:
        status, reply = await upload(session, signed.url, sent, headers=sent.signed())
    assert status == 200, reply
    assert (reply["callLogId"], reply["recordingId"]) == (
        canonical.call_log_id,
        canonical.recording_id,
    )
    assert reply["fileUrl"] == f"{signed.url}{FILES}/{canonical.where}"
    assert kept(signed.root) == stored(canonical)


async def test_without_a_secret_unsigned_uploads_are_kept(unsigned: UploadReceiver) -> None:
    recording = Upload()
    async with aiohttp.ClientSession() as session:
        status, reply = await upload(session, unsigned.url, recording)
        assert (status, reply["created"]) == (200, True), reply
        async with session.get(reply["fileUrl"]) as response:
            assert (response.status, await response.read()) == (200, recording.audio)
    assert kept(unsigned.root) == stored(recording)


# -- a client that goes away -----------------------------------------------------------------


async def test_a_client_that_disconnects_mid_upload_leaves_nothing(signed: UploadReceiver) -> None:
    recording = Upload(audio=noise(2 * 1024 * 1024))
    body, content_type = await multipart(recording.parts())
    half = audio_offset(body, recording) + len(recording.audio) // 2
    url = URL(signed.url)
    assert url.host is not None and url.port is not None
    head = [
        f"POST {UPLOAD} HTTP/1.1",
        f"Host: {url.host}:{url.port}",
        f"Content-Type: {content_type}",
        f"Content-Length: {len(body)}",
        *(f"{name}: {value}" for name, value in recording.signed().items()),
    ]
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body[:half])
        await writer.drain()
        await wait_until(lambda: signed.streaming() == 1, what="the upload streaming to disk")
    finally:
        writer.close()
        await writer.wait_closed()
    await wait_until(lambda: kept(signed.root) == NOTHING, what="nothing left of the upload")
    assert await reader.read() == b""  # the receiver never answered a half upload
    # The receiver is fine, and the same recording can be uploaded in full.
    async with aiohttp.ClientSession() as session:
        status, reply = await upload(session, signed.url, recording, headers=recording.signed())
    assert (status, reply["created"]) == (200, True), reply
    assert kept(signed.root) == stored(recording)


def test_start_removes_only_old_leftovers_of_cut_off_uploads(tmp_path: Path) -> None:
    files = RecordingFiles(tmp_path, max_bytes=1024)
    files.prepare()
    old, young = files.incoming / "audio-old.part", files.incoming / "audio-young.part"
    old.write_bytes(b"cut off by a crash")
    young.write_bytes(b"another receiver is writing this")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    files.prepare()
    assert sorted(p.name for p in files.incoming.iterdir()) == ["audio-young.part"]
