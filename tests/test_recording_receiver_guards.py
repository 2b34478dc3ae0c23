"""The recording upload's guards over real HTTP on loopback: the signed manifest checked from the
headers before any of the body is read, and the streamed parts held to it; the bounds on uploads
at once, on a body that stops arriving and on the store's free space; symlinks planted in the
store, neither written through nor served."""

from __future__ import annotations

import asyncio
import gzip
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import annotated_types
import orjson
import pytest
from multidict import CIMultiDict
from yarl import URL

from consumer.app.settings import ReceiverSettings
from consumer.receiver.uploads import CHUNK_BYTES, MIN_UPLOAD_BYTES_PER_SEC, RecordingFiles
from consumer.sinks.recording_upload import MIN_UPLOAD_RATE
from consumer.wire.signing import (
    MANIFEST_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    manifest_headers,
    recording_file_message,
    sign,
    signature,
)
from tests.conftest import wait_until
from tests.support.recordings import SECRET
from tests.support.uploads import (
    ANSWER_DEADLINE,
    FILES,
    NOTHING,
    UPLOAD,
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

MIB = 1024 * 1024
# The small audio limit of the receiver that refuses manifests over it.
LIMIT = 256 * 1024


@pytest.fixture
async def signed(receiver_dsn: str, tmp_path: Path) -> AsyncIterator[UploadReceiver]:
    """A receiver that requires signed uploads (SECRET), audio up to LIMIT."""
    async with upload_receiver(
        receiver_dsn, tmp_path / "store", secret=SECRET, max_bytes=LIMIT
    ) as up:
        yield up


@pytest.fixture
async def unsigned(receiver_dsn: str, tmp_path: Path) -> AsyncIterator[UploadReceiver]:
    """A receiver without a shared secret (ingest-server --insecure), audio up to LIMIT."""
    async with upload_receiver(
        receiver_dsn, tmp_path / "store", secret=None, max_bytes=LIMIT
    ) as up:
        yield up


async def answer(
    client: aiohttp.ClientSession, url: str, data: Any, content_type: str, headers: dict[str, str]
) -> tuple[int, dict[str, Any], CIMultiDict[str]]:
    """POST an upload; the status, the JSON body and the answer's headers."""
    async with client.post(
        url + UPLOAD, data=data, headers={"Content-Type": content_type, **headers}
    ) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, orjson.loads(await response.read()), response.headers.copy()


async def stopped_after(
    receiver_: UploadReceiver, recording: Upload, headers: dict[str, str], cut: int
) -> tuple[int, dict[str, Any]]:
    """POST `recording` whose body stops after `cut` bytes and never goes on: the answer must
    come from what was sent so far (within ANSWER_DEADLINE)."""
    body, content_type = await multipart(recording.parts())
    never = asyncio.Event()
    async with aiohttp.ClientSession() as client, asyncio.timeout(ANSWER_DEADLINE):
        return await post(
            client,
            receiver_.url,
            held_back(body[:cut], never),
            content_type=content_type,
            headers=headers,
        )


async def head_only(receiver_: UploadReceiver, recording: Upload, headers: dict[str, str]) -> Any:
    """POST `recording` with its headers and no more of the body than the first 1000 bytes of
    its audio: an answer that needs no body."""
    body, _ = await multipart(recording.parts())
    return await stopped_after(receiver_, recording, headers, audio_offset(body, recording) + 1000)


# -- authenticated from the headers, before the body ------------------------------------------


def _wrong_secret(up: Upload) -> dict[str, str]:
    return up.signed("another-secret-entirely-0123456789")


def _mangled(up: Upload) -> dict[str, str]:
    headers = up.signed()
    return {**headers, SIGNATURE_HEADER: headers[SIGNATURE_HEADER][:-4] + "0000"}


def _manifest_changed_after_signing(up: Upload) -> dict[str, str]:
    bigger = replace(up.manifest(), audio_size=len(up.audio) + 1)
    return {**up.signed(), MANIFEST_HEADER: bigger.text()}


def _signature_of_another_upload(up: Upload) -> dict[str, str]:
    other = Upload(call_log_id=up.call_log_id)
    return {**other.signed(), MANIFEST_HEADER: up.manifest().text()}


def _manifest_unsigned(up: Upload) -> dict[str, str]:
    return {MANIFEST_HEADER: up.manifest().text()}


def _digests_signed_without_a_manifest(up: Upload) -> dict[str, str]:
    # What a sender before the manifest signed: the ids and digests, known only after the body.
    message = recording_file_message(
        up.call_log_id, up.recording_id, sha256(up.audio), sha256(up.meta)
    )
    return sign(SECRET, message)


def _timestamp_with_a_sign(up: Upload) -> dict[str, str]:
    headers = up.signed()
    timestamp = "+" + headers[TIMESTAMP_HEADER]
    return {
        **headers,
        TIMESTAMP_HEADER: timestamp,
        SIGNATURE_HEADER: signature(SECRET, timestamp, headers[MANIFEST_HEADER].encode()),
    }


@pytest.mark.parametrize(
    "forge",
    [
        pytest.param(_wrong_secret, id="wrong-secret"),
        pytest.param(_mangled, id="mangled-signature"),
        pytest.param(_manifest_changed_after_signing, id="manifest-changed-after-signing"),
        pytest.param(_signature_of_another_upload, id="signature-of-another-upload"),
        pytest.param(_manifest_unsigned, id="manifest-unsigned"),
        pytest.param(_digests_signed_without_a_manifest, id="no-manifest"),
        pytest.param(_timestamp_with_a_sign, id="timestamp-with-a-sign"),
    ],
)
async def test_a_forged_upload_is_401_before_its_body_is_read(
    signed: UploadReceiver, forge: Callable[[Upload], dict[str, str]]
) -> None:
    recording = Upload(audio=noise(200_000))
    got = await head_only(signed, recording, forge(recording))
    assert_error(got, 401, "INGEST_UNAUTHORIZED")
    assert signed.files.bodies_read == 0  # refused from the headers: the body never read
    assert kept(signed.root) == NOTHING


def _empty_audio(up: Upload) -> dict[str, str]:
    return up.signed(audio=b"")


def _audio_over_the_limit(up: Upload) -> dict[str, str]:
    return up.signed(audio=bytes(LIMIT + 1))


def _meta_over_a_mib(up: Upload) -> dict[str, str]:
    return manifest_headers(SECRET, replace(up.manifest(), meta_size=MIB + 1))


def _empty_meta(up: Upload) -> dict[str, str]:
    return manifest_headers(SECRET, replace(up.manifest(), meta_size=0, meta_sha256=sha256(b"")))


def _call_not_a_uuid(up: Upload) -> dict[str, str]:
    return manifest_headers(SECRET, replace(up.manifest(), call_log_id="not-a-uuid"))


def _malformed(up: Upload) -> dict[str, str]:
    text = up.manifest().text().replace(" meta=", " comment=hello meta=")
    return {MANIFEST_HEADER: text, **sign(SECRET, text.encode())}


@pytest.mark.parametrize(
    ("declare", "status", "code", "field"),
    [
        pytest.param(_empty_audio, 422, "INGEST_VALIDATION_ERROR", "audio", id="audio-empty"),
        pytest.param(_audio_over_the_limit, 413, "INGEST_TOO_LARGE", "audio", id="audio-large"),
        pytest.param(_meta_over_a_mib, 413, "INGEST_TOO_LARGE", "meta", id="meta-large"),
        pytest.param(_empty_meta, 422, "INGEST_VALIDATION_ERROR", "meta", id="meta-empty"),
        pytest.param(
            _call_not_a_uuid, 422, "INGEST_VALIDATION_ERROR", "callLogId", id="call-not-uuid"
        ),
        pytest.param(_malformed, 422, "INGEST_VALIDATION_ERROR", MANIFEST_HEADER, id="malformed"),
    ],
)
async def test_a_signed_manifest_the_receiver_cannot_take_is_refused_before_the_body(
    signed: UploadReceiver,
    declare: Callable[[Upload], dict[str, str]],
    status: int,
    code: str,
    field: str,
) -> None:
    recording = Upload()
    got = await head_only(signed, recording, declare(recording))
    assert_error(got, status, code, field)
    assert signed.files.bodies_read == 0  # refused from the headers: the body never read
    assert kept(signed.root) == NOTHING


async def test_audio_longer_than_its_manifest_is_refused_at_the_first_bytes_beyond(
    signed: UploadReceiver,
) -> None:
    declared = noise(100_000)
    recording = Upload(audio=declared + noise(4 * CHUNK_BYTES, 8))
    body, _ = await multipart(recording.parts())
    # The body stops (without ending) a few chunks past the declared size: the answer must come
    # from counting. (The receiver reads a chunk ahead to find the boundary, hence the margin.)
    cut = audio_offset(body, recording) + len(declared) + 3 * CHUNK_BYTES
    got = await stopped_after(signed, recording, recording.signed(audio=declared), cut)
    assert_error(got, 401, "INGEST_UNAUTHORIZED", "audio")
    assert kept(signed.root) == NOTHING


def _shorter_audio(up: Upload) -> tuple[Upload, dict[str, str]]:
    return replace(up, audio=up.audio[:-1]), up.signed()


def _longer_meta(up: Upload) -> tuple[Upload, dict[str, str]]:
    return replace(up, meta=up.meta + b" "), up.signed()


def _other_meta_same_size(up: Upload) -> tuple[Upload, dict[str, str]]:
    return replace(up, meta=up.meta.replace(b'"c"', b'"d"')), up.signed()


@pytest.mark.parametrize(
    ("tamper", "field"),
    [
        pytest.param(_shorter_audio, "audio", id="audio-shorter"),
        pytest.param(_longer_meta, "meta", id="meta-longer"),
        pytest.param(_other_meta_same_size, "meta", id="meta-other-bytes"),
    ],
)
async def test_parts_that_are_not_the_manifests_are_401_naming_the_part(
    signed: UploadReceiver, tamper: Callable[[Upload], tuple[Upload, dict[str, str]]], field: str
) -> None:
    sent, headers = tamper(Upload(audio=noise(100_000)))
    async with aiohttp.ClientSession() as client:
        got = await upload(client, signed.url, sent, headers=headers)
    assert_error(got, 401, "INGEST_UNAUTHORIZED", field)
    assert kept(signed.root) == NOTHING


async def test_an_unsigned_receiver_needs_no_manifest_but_holds_the_parts_to_one_sent(
    unsigned: UploadReceiver,
) -> None:
    plain, declared, wrong = Upload(), Upload(), Upload(audio=noise(1000))
    async with aiohttp.ClientSession() as client:
        status, reply = await upload(client, unsigned.url, plain)
        assert (status, reply["created"]) == (200, True), reply
        headers = manifest_headers(None, declared.manifest())
        assert list(headers) == [MANIFEST_HEADER]
        status, reply = await upload(client, unsigned.url, declared, headers=headers)
        assert (status, reply["created"]) == (200, True), reply
        mismatch = manifest_headers(None, wrong.manifest(audio=noise(1000, 3)))
        got = await upload(client, unsigned.url, wrong, headers=mismatch)
        assert_error(got, 422, "INGEST_VALIDATION_ERROR", "audio")
    # Declared over the limit: refused before the body.
    too_big = manifest_headers(None, Upload().manifest(audio=bytes(LIMIT + 1)))
    assert_error(await head_only(unsigned, Upload(), too_big), 413, "INGEST_TOO_LARGE", "audio")
    assert kept(unsigned.root) == sorted({*stored(plain), *stored(declared)})


async def test_a_compressed_upload_is_415_before_its_body_is_read(signed: UploadReceiver) -> None:
    recording = Upload(audio=noise(200_000))
    body, content_type = await multipart(recording.parts())
    never = asyncio.Event()
    headers = {**recording.signed(), "Content-Encoding": "gzip"}
    async with aiohttp.ClientSession() as client, asyncio.timeout(ANSWER_DEADLINE):
        got = await post(
            client,
            signed.url,
            held_back(gzip.compress(body)[:4096], never),
            content_type=content_type,
            headers=headers,
        )
    assert_error(got, 415, "INGEST_UNSUPPORTED_ENCODING")
    assert signed.files.bodies_read == 0  # refused from the headers: the body never read
    assert kept(signed.root) == NOTHING
    # "identity" is no encoding at all.
    async with aiohttp.ClientSession() as client:
        identity = {**recording.signed(), "Content-Encoding": "identity"}
        status, reply = await upload(client, signed.url, recording, headers=identity)
    assert status == 200, reply
    assert kept(signed.root) == stored(recording)


async def test_expect_100_continue_is_answered_with_the_refusal_instead(
    signed: UploadReceiver,
) -> None:
    recording = Upload()
    body, content_type = await multipart(recording.parts())
    url = URL(signed.url)
    assert url.host is not None and url.port is not None

    async def status_lines(headers: dict[str, str]) -> list[bytes]:
        """The status lines answered to headers that expect 100-continue; after a 100, the
        body is sent and the final answer's status line follows."""
        reader, writer = await asyncio.open_connection(url.host, url.port)
        head = [
            f"POST {UPLOAD} HTTP/1.1",
            f"Host: {url.host}:{url.port}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Expect: 100-continue",
            "Connection: close",
            *(f"{name}: {value}" for name, value in headers.items()),
        ]
        try:
            async with asyncio.timeout(ANSWER_DEADLINE):
                writer.write(("\r\n".join(head) + "\r\n\r\n").encode())
                await writer.drain()
                lines = [(await reader.readline()).strip()]
                if lines[0] == b"HTTP/1.1 100 Continue":
                    assert await reader.readline() == b"\r\n"
                    writer.write(body)
                    await writer.drain()
                    lines.append((await reader.readline()).strip())
                return lines
        finally:
            writer.close()
            await writer.wait_closed()

    forged = await status_lines(_wrong_secret(recording))
    assert forged == [b"HTTP/1.1 401 Unauthorized"]
    assert signed.files.bodies_read == 0  # refused from the headers: the body never read
    assert kept(signed.root) == NOTHING
    good = await status_lines(recording.signed())
    assert good == [b"HTTP/1.1 100 Continue", b"HTTP/1.1 200 OK"]
    assert signed.files.bodies_read == 1
    assert kept(signed.root) == stored(recording)


# -- bounds: uploads at once, a body that stops, the store's free space ------------------------


async def test_uploads_over_the_limit_at_once_are_503_with_retry_after(
    receiver_dsn: str, tmp_path: Path
) -> None:
    async with upload_receiver(
        receiver_dsn,
        tmp_path / "store",
        secret=SECRET,
        max_concurrent_uploads=2,
        busy_retry_after_sec=3,
    ) as busy:
        first, second, third = (Upload(audio=noise(MIB, n)) for n in range(3))
        release = asyncio.Event()
        async with aiohttp.ClientSession() as client:
            held = []
            for recording in (first, second):
                body, content_type = await multipart(recording.parts())
                half = audio_offset(body, recording) + MIB // 2
                held.append(
                    asyncio.create_task(
                        post(
                            client,
                            busy.url,
                            held_back(body[:half], release, body[half:]),
                            content_type=content_type,
                            headers=recording.signed(),
                        )
                    )
                )
            try:
                await wait_until(lambda: busy.streaming() == 2, what="two uploads streaming")
                body, content_type = await multipart(third.parts())
                never = asyncio.Event()
                async with asyncio.timeout(ANSWER_DEADLINE):
                    status, reply, headers = await answer(
                        client,
                        busy.url,
                        held_back(body[: audio_offset(body, third) + 1000], never),
                        content_type,
                        third.signed(),
                    )
                assert_error((status, reply), 503, "INGEST_BUSY")
                assert headers["Retry-After"] == "3"
                assert busy.streaming() == 2
            finally:
                release.set()
            for status, reply in await asyncio.gather(*held):
                assert status == 200, reply
            # The slots are free again.
            status, reply = await upload(client, busy.url, third, headers=third.signed())
            assert status == 200, reply
        assert kept(busy.root) == sorted({*stored(first), *stored(second), *stored(third)})


async def test_a_body_that_stops_arriving_is_abandoned_after_the_idle_timeout(
    receiver_dsn: str, tmp_path: Path
) -> None:
    async with upload_receiver(
        receiver_dsn, tmp_path / "store", secret=SECRET, body_idle_timeout_sec=0.5
    ) as idle:
        recording = Upload(audio=noise(MIB))
        body, _ = await multipart(recording.parts())
        started = time.monotonic()
        # Stopped in the middle of the audio (a part file is being written), and before any
        # part at all.
        cut = audio_offset(body, recording) + MIB // 2
        got = await stopped_after(idle, recording, recording.signed(), cut)
        assert_error(got, 408, "INGEST_BODY_TIMEOUT", "audio")
        got = await stopped_after(idle, recording, recording.signed(), 10)
        assert_error(got, 408, "INGEST_BODY_TIMEOUT")
        assert time.monotonic() - started >= 1.0
        assert kept(idle.root) == NOTHING


async def paced(body: bytes, piece: int, rate: float) -> AsyncIterator[bytes]:
    """`body` sent `piece` bytes at a time at `rate` bytes/s, on an absolute schedule (no drift
    from late wake-ups)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    for start in range(0, len(body), piece):
        await asyncio.sleep(max(0.0, started + start / rate - loop.time()))
        yield body[start : start + piece]


async def test_a_slow_body_that_keeps_arriving_is_not_cut_off(
    receiver_dsn: str, tmp_path: Path
) -> None:
    # The overall deadline (test_a_trickling_upload_is_cut_off_by_its_overall_deadline) set far
    # off: at 1 KiB/s, over a minute.
    async with upload_receiver(
        receiver_dsn,
        tmp_path / "store",
        secret=SECRET,
        body_idle_timeout_sec=1.0,
        min_upload_bytes_per_sec=1024,
    ) as idle:
        recording = Upload(audio=noise(64 * 1024))
        body, content_type = await multipart(recording.parts())

        # The sender's pace, not a wait for the receiver: six pieces 0.4 s apart take longer
        # than the idle timeout, but no gap between two reads does.
        step = len(body) // 6 + 1
        trickle = paced(body, step, rate=step / 0.4)
        started = time.monotonic()
        async with aiohttp.ClientSession() as client:
            status, reply = await post(
                client, idle.url, trickle, content_type=content_type, headers=recording.signed()
            )
        assert time.monotonic() - started > 2.0
        assert status == 200, reply
        assert kept(idle.root) == stored(recording)


KIB = 1024


async def test_a_trickling_upload_is_cut_off_by_its_overall_deadline(
    receiver_dsn: str, tmp_path: Path
) -> None:
    # 64 KiB of audio at 64 KiB/s at least, after a 2 s idle allowance: about 3 s in all.
    async with upload_receiver(
        receiver_dsn,
        tmp_path / "store",
        secret=SECRET,
        body_idle_timeout_sec=2.0,
        min_upload_bytes_per_sec=64 * KIB,
    ) as slow:
        recording = Upload(audio=noise(64 * KIB))
        body, content_type = await multipart(recording.parts())
        # 1 KiB every 0.5 s: never idle for the 2 s the idle timeout waits, but the whole body
        # would take over half a minute.
        started = time.monotonic()
        async with aiohttp.ClientSession() as client, asyncio.timeout(ANSWER_DEADLINE):
            got = await post(
                client,
                slow.url,
                paced(body, KIB, 2 * KIB),
                content_type=content_type,
                headers=recording.signed(),
            )
        elapsed = time.monotonic() - started
        assert_error(got, 408, "INGEST_BODY_TIMEOUT", "audio")
        assert "did not arrive within" in got[1]["error"]["message"], got
        assert 2.5 <= elapsed < ANSWER_DEADLINE
        assert kept(slow.root) == NOTHING
        # Its slot and its recordingId are free again.
        assert (slow.files.uploading, slow.files.receiving) == (0, set())


async def test_a_steady_upload_at_the_minimum_rate_is_not_cut_off(
    receiver_dsn: str, tmp_path: Path
) -> None:
    async with upload_receiver(
        receiver_dsn,
        tmp_path / "store",
        secret=SECRET,
        body_idle_timeout_sec=2.0,
        min_upload_bytes_per_sec=64 * KIB,
    ) as slow:
        recording = Upload(audio=noise(192 * KIB))
        body, content_type = await multipart(recording.parts())
        started = time.monotonic()
        async with aiohttp.ClientSession() as client:
            status, reply = await post(
                client,
                slow.url,
                paced(body, 8 * KIB, 64 * KIB),
                content_type=content_type,
                headers=recording.signed(),
            )
        # Three seconds at the minimum rate: longer than the idle allowance alone.
        assert time.monotonic() - started > 2.5
        assert status == 200, reply
        assert kept(slow.root) == stored(recording)


def test_the_receivers_minimum_rate_is_at_most_the_consumers() -> None:
    # A consumer gives up on an upload after its timeout + size / MIN_UPLOAD_RATE: the
    # receiver's deadline must be no shorter, or it would cut off uploads the consumer waits on.
    field = ReceiverSettings.model_fields["min_upload_bytes_per_sec"]
    highest = next(rule.le for rule in field.metadata if isinstance(rule, annotated_types.Le))
    assert isinstance(highest, int)
    assert field.default == MIN_UPLOAD_BYTES_PER_SEC <= highest <= MIN_UPLOAD_RATE


async def test_a_second_upload_of_a_recording_being_received_is_503_and_the_first_is_kept(
    receiver_dsn: str, tmp_path: Path
) -> None:
    async with upload_receiver(
        receiver_dsn, tmp_path / "store", secret=SECRET, busy_retry_after_sec=3
    ) as once:
        recording, other = Upload(audio=noise(MIB)), Upload(audio=noise(MIB, 2))
        # A captured signed request: the same headers and body, replayed while it is received.
        headers = recording.signed()
        body, content_type = await multipart(recording.parts())
        half = audio_offset(body, recording) + MIB // 2
        release = asyncio.Event()
        async with aiohttp.ClientSession() as client:
            first = asyncio.create_task(
                post(
                    client,
                    once.url,
                    held_back(body[:half], release, body[half:]),
                    content_type=content_type,
                    headers=headers,
                )
            )
            try:
                await wait_until(lambda: once.streaming() == 1, what="the first upload streaming")
                never = asyncio.Event()
                async with asyncio.timeout(ANSWER_DEADLINE):
                    status, reply, answered = await answer(
                        client,
                        once.url,
                        held_back(body[:half], never),
                        content_type,
                        headers,
                    )
                assert_error((status, reply), 503, "INGEST_BUSY", "recordingId")
                assert answered["Retry-After"] == "3"
                # Refused from its headers, without a slot: the first's body alone was read.
                assert once.files.bodies_read == 1
                assert once.files.uploading == 1
                # Another recording meanwhile is received as usual.
                status, reply = await upload(client, once.url, other, headers=other.signed())
                assert status == 200, reply
            finally:
                release.set()
            status, reply = await first
            assert (status, reply["created"]) == (200, True), reply
            # Once it is kept, the same recording may come again (a retry): the same answer.
            status, reply = await upload(client, once.url, recording, headers=recording.signed())
            assert (status, reply["created"]) == (200, False), reply
        assert kept(once.root) == sorted({*stored(recording), *stored(other)})
        assert once.files.receiving == set()


async def test_an_unsigned_upload_of_a_recording_being_received_is_503_once_its_id_is_read(
    receiver_dsn: str, tmp_path: Path
) -> None:
    # Without a manifest the recordingId is known from its part only.
    async with upload_receiver(receiver_dsn, tmp_path / "store", secret=None) as unsigned:
        recording = Upload(audio=noise(MIB))
        body, content_type = await multipart(recording.parts())
        half = audio_offset(body, recording) + MIB // 2
        release = asyncio.Event()
        async with aiohttp.ClientSession() as client:
            first = asyncio.create_task(
                post(
                    client,
                    unsigned.url,
                    held_back(body[:half], release, body[half:]),
                    content_type=content_type,
                )
            )
            try:
                await wait_until(
                    lambda: unsigned.streaming() == 1, what="the first upload streaming"
                )
                async with asyncio.timeout(ANSWER_DEADLINE):
                    got = await post(
                        client,
                        unsigned.url,
                        held_back(body[:half], asyncio.Event()),
                        content_type=content_type,
                    )
                assert_error(got, 503, "INGEST_BUSY", "recordingId")
                assert unsigned.streaming() == 1
            finally:
                release.set()
            status, reply = await first
            assert status == 200, reply
        assert kept(unsigned.root) == stored(recording)
        assert unsigned.files.receiving == set()


async def test_an_upload_that_would_leave_less_free_space_than_the_minimum_is_507(
    receiver_dsn: str, tmp_path: Path
) -> None:
    store = tmp_path / "store"
    store.mkdir()
    free = shutil.disk_usage(store).free
    async with upload_receiver(
        receiver_dsn,
        store,
        secret=SECRET,
        # Large enough to declare most of the disk: nothing of such a size is ever sent.
        max_bytes=2 * free,
        min_free_bytes=free + 1024**4,
        full_retry_after_sec=7,
    ) as full:
        recording = Upload()
        body, content_type = await multipart(recording.parts())
        never = asyncio.Event()
        async with aiohttp.ClientSession() as client, asyncio.timeout(ANSWER_DEADLINE):
            status, reply, headers = await answer(
                client,
                full.url,
                held_back(body[: audio_offset(body, recording) + 100], never),
                content_type,
                recording.signed(),
            )
        assert_error((status, reply), 507, "INGEST_INSUFFICIENT_STORAGE")
        assert headers["Retry-After"] == "7"
        assert kept(full.root) == NOTHING

        # Uploads in flight count with what they declared, not with what they wrote so far:
        # two that declare 60 % of the free space each do not both fit.
        full.files.min_free_bytes = 0
        big = int(free * 0.6)
        first, second = Upload(audio=noise(MIB, 1)), Upload(audio=noise(1000, 2))
        release = asyncio.Event()
        async with aiohttp.ClientSession() as client:
            body, content_type = await multipart(first.parts())
            cut = audio_offset(body, first) + MIB // 2
            in_flight = asyncio.create_task(
                post(
                    client,
                    full.url,
                    held_back(body[:cut], release),
                    content_type=content_type,
                    headers=manifest_headers(
                        SECRET, replace(first.manifest(), audio_size=big, audio_sha256="0" * 64)
                    ),
                )
            )
            try:
                await wait_until(lambda: full.streaming() == 1, what="the first upload streaming")
                declared = manifest_headers(
                    SECRET, replace(second.manifest(), audio_size=big, audio_sha256="0" * 64)
                )
                got = await head_only(full, second, declared)
                assert_error(got, 507, "INGEST_INSUFFICIENT_STORAGE")
            finally:
                in_flight.cancel()
            with pytest.raises(asyncio.CancelledError):
                await in_flight
        # The first one's client went away: its reservation is given back.
        await wait_until(lambda: kept(full.root) == NOTHING, what="nothing left of the first")
        async with aiohttp.ClientSession() as client:
            status, reply = await upload(client, full.url, second, headers=second.signed())
        assert status == 200, reply


# -- symlinks in the store: neither written through nor served -------------------------------


def snapshot(root: Path) -> dict[str, bytes | str]:
    """Every file and symlink under `root`: a file's bytes, a symlink's target."""
    found: dict[str, bytes | str] = {}
    for path in [root, *root.rglob("*")]:
        name = path.relative_to(root).as_posix()
        if path.is_symlink():
            found[name] = str(path.readlink())
        elif path.is_file():
            found[name] = path.read_bytes()
    return found


async def status_of(client: aiohttp.ClientSession, method: str, url: str) -> tuple[int, bytes]:
    """The status and body of a GET or HEAD."""
    async with client.request(method, url) as response:
        return response.status, await response.read()


async def test_a_symlinked_call_folder_is_neither_written_through_nor_served(
    signed: UploadReceiver, tmp_path: Path
) -> None:
    recording = Upload()
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = b"RIFF-planted-outside-the-store-" + noise(64)
    (outside / f"{recording.recording_id}.wav").write_bytes(planted)
    (signed.root / recording.call_log_id).symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    file_url = f"{signed.url}{FILES}/{recording.where}"
    async with aiohttp.ClientSession() as client:
        for method in ("GET", "HEAD"):
            status, body = await status_of(client, method, file_url)
            assert status == 404, method
            assert planted not in body
        got = await upload(client, signed.url, recording, headers=recording.signed())
        assert_error(got, 500, "INGEST_INTERNAL_ERROR")
    assert snapshot(outside) == before
    assert (signed.root / recording.call_log_id).is_symlink()
    assert kept(signed.root) == sorted([".incoming", recording.call_log_id])


async def test_a_symlinked_recording_is_not_served_and_an_upload_replaces_the_link_itself(
    signed: UploadReceiver, tmp_path: Path
) -> None:
    recording = Upload()
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = b"RIFF-planted-outside-the-store-" + noise(64)
    (outside / "secret.wav").write_bytes(planted)
    (outside / "secret.json").write_bytes(b'{"secret": true}')
    folder = signed.root / recording.call_log_id
    folder.mkdir()
    (folder / f"{recording.recording_id}.wav").symlink_to(outside / "secret.wav")
    (folder / f"{recording.recording_id}.meta.json").symlink_to(outside / "secret.json")
    before = snapshot(outside)
    file_url = f"{signed.url}{FILES}/{recording.where}"
    async with aiohttp.ClientSession() as client:
        for method in ("GET", "HEAD"):
            status, body = await status_of(client, method, file_url)
            assert status == 404, method
            assert planted not in body
        status, reply = await upload(client, signed.url, recording, headers=recording.signed())
        assert (status, reply["created"]) == (200, True), reply
        assert await status_of(client, "GET", file_url) == (200, recording.audio)
    # The links were replaced by the files; what they pointed to is untouched.
    assert snapshot(outside) == before
    assert not (signed.root / recording.where).is_symlink()
    assert (signed.root / recording.where).read_bytes() == recording.audio
    meta = folder / f"{recording.recording_id}.meta.json"
    assert not meta.is_symlink()
    assert meta.read_bytes() == recording.meta


async def test_a_recording_that_is_not_a_regular_file_is_404(signed: UploadReceiver) -> None:
    recording = Upload()
    folder = signed.root / recording.call_log_id
    folder.mkdir()
    os.mkfifo(folder / f"{recording.recording_id}.wav")
    async with aiohttp.ClientSession() as client, asyncio.timeout(ANSWER_DEADLINE):
        status, _ = await status_of(client, "GET", f"{signed.url}{FILES}/{recording.where}")
    assert status == 404


def test_an_incoming_folder_that_is_a_symlink_is_refused_at_start(tmp_path: Path) -> None:
    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    outside.mkdir()
    (store / ".incoming").symlink_to(outside, target_is_directory=True)
    old = outside / f"audio-{uuid.uuid4().hex}.part"
    old.write_bytes(b"someone else's file")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    with pytest.raises(OSError, match="symlink"):
        RecordingFiles(store, max_bytes=1024).prepare()
    assert old.read_bytes() == b"someone else's file"
