"""What the reference receiver and a consumer's HTTP port do with requests that are not what
they should be, over real HTTP on loopback (raw sockets where aiohttp's client would refuse to
send the request): headers checked before the body is read (unsigned 401, compressed 415,
declared too large 413, none of them waiting for a body), malformed header values and clients
that leave mid-body answered in JSON with one log line, control characters kept out of the logs,
and 405s that name the allowed methods."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import logging
import re
import time
import zlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
from yarl import URL

from consumer.app.wiring import consumer_runtime, open_pool, serve_ops_http
from consumer.observability.redact import printable
from consumer.observability.telemetry import JsonFormatter, TextFormatter
from consumer.receiver.app import BodyReads, build_app
from consumer.receiver.store import EntityStore
from consumer.wire import signing
from tests.conftest import fetch_value, make_settings, serve_app, wait_until
from tests.support.receivers import INGEST_PATH, CountingStore, serve_reference_receiver

SECRET = "guards-test-secret-0123456789abcdef"  # noqa: S105 - a test secret
TOKEN = "admin-token-0123456789abcdef"  # noqa: S105 - a test token
# The test receivers take bodies up to 1 MiB (tests/support/receivers.py, tests/conftest.py).
LIMIT = 1024 * 1024
ANSWER_DEADLINE = 10.0
# A frontend for a consumer that never delivers in these tests.
FRONTEND = "http://127.0.0.1:9"
CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def body_of(*entity_ids: str) -> bytes:
    """A valid request body with one call_log entry per id."""
    entries = [
        {"entityType": "call_log", "entityId": e, "op": "upsert", "seq": i + 1, "payload": {}}
        for i, e in enumerate(entity_ids)
    ]
    return orjson.dumps({"entries": entries})


def fresh_headers(body: bytes = b"") -> dict[str, str]:
    """Signature headers that pass the header check (well-formed, fresh)."""
    return signing.sign(SECRET, body)


# -- raw HTTP ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """An HTTP answer as it came off the socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def request_head(
    method: str, target: bytes | str, headers: dict[str, str | bytes] | None = None
) -> bytes:
    """A request line and headers, byte for byte as given (values may hold any bytes)."""
    raw_target = target.encode() if isinstance(target, str) else target
    lines = [method.encode() + b" " + raw_target + b" HTTP/1.1", b"Host: 127.0.0.1"]
    for name, value in (headers or {}).items():
        lines.append(
            name.encode() + b": " + (value if isinstance(value, bytes) else value.encode())
        )
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    """The next answer on the connection (an interim 100 Continue counts as one)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    status = int(status_line.split(" ")[1])
    headers = {}
    for line in header_lines:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return Answer(status, headers, body)


@contextlib.asynccontextmanager
async def connection(base_url: str) -> AsyncIterator[tuple[asyncio.StreamReader, Any]]:
    """A TCP connection to the server at `base_url`, closed on exit."""
    url = URL(base_url)
    assert url.host is not None and url.port is not None
    reader, writer = await asyncio.open_connection(url.host, url.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def exchange(base_url: str, head: bytes, body: bytes = b"") -> Answer:
    """Send `head` and `body` (which may be short of what the head declares: the rest never
    comes) and read the first answer, within ANSWER_DEADLINE."""
    async with connection(base_url) as (reader, writer), asyncio.timeout(ANSWER_DEADLINE):
        writer.write(head + body)
        await writer.drain()
        return await read_answer(reader)


def assert_json_error(answer: Answer, status: int, code: str) -> dict[str, Any]:
    """A JSON error answer with this status and code; its error object."""
    assert answer.status == status, answer
    assert answer.headers["content-type"].startswith("application/json"), answer
    error: dict[str, Any] = answer.json()["error"]
    assert error["code"] == code, answer
    assert error["message"], answer
    return error


# -- a receiver and its log ----------------------------------------------------------------------


@dataclass
class ReferenceReceiver:
    """The reference receiver on loopback, its store (which counts what it applied) and the
    log records of its process."""

    url: str
    store: CountingStore
    dsn: str
    caplog: pytest.LogCaptureFixture

    def records(self) -> list[logging.LogRecord]:
        """Every record logged at DEBUG or above since the receiver started."""
        return list(self.caplog.records)

    async def stored(self) -> int:
        return int(await fetch_value(self.dsn, "SELECT count(*) FROM ingest.entities"))


@pytest.fixture
def logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every record of the process at DEBUG and above (aiohttp's own included)."""
    caplog.set_level(logging.DEBUG)
    yield caplog


@pytest.fixture
async def signed(
    receiver_dsn: str, logs: pytest.LogCaptureFixture
) -> AsyncIterator[ReferenceReceiver]:
    """A receiver that wants every request signed with SECRET."""
    async with serve_reference_receiver(receiver_dsn, shared_secret=SECRET) as (url, store):
        logs.clear()
        yield ReferenceReceiver(url, store, receiver_dsn, logs)


@pytest.fixture
async def unsigned(
    receiver_dsn: str, logs: pytest.LogCaptureFixture
) -> AsyncIterator[ReferenceReceiver]:
    """A receiver without a secret (`ingest-server --insecure`)."""
    async with serve_reference_receiver(receiver_dsn) as (url, store):
        logs.clear()
        yield ReferenceReceiver(url, store, receiver_dsn, logs)


# -- the headers are checked before the body is read ---------------------------------------------


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param("expect-100-continue", id="expect-100-continue"),
        pytest.param("headers-only", id="headers-only"),
        pytest.param("part-of-the-body", id="part-of-the-body"),
    ],
)
async def test_an_unsigned_request_is_refused_before_its_body_is_sent(
    signed: ReferenceReceiver, sent: str
) -> None:
    """The body declared (900 KB, under the limit) never comes, or comes only in part: the 401
    can only be an answer to the headers. With `Expect: 100-continue` the client is not even
    invited to send it: the first answer is the 401, not 100 Continue."""
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Length": str(900 * 1024),
    }
    if sent == "expect-100-continue":
        headers["Expect"] = "100-continue"
    body = body_of("never")[:-2] if sent == "part-of-the-body" else b""
    answer = await exchange(signed.url, request_head("POST", INGEST_PATH, headers), body)
    error = assert_json_error(answer, 401, "INGEST_UNAUTHORIZED")
    assert "missing" in error["message"]
    assert signed.store.applied == []
    assert await signed.stored() == 0


async def test_a_stale_request_is_refused_while_its_body_is_still_being_sent(
    signed: ReferenceReceiver,
) -> None:
    """aiohttp's client, a chunked body that stops after its first chunk: the 401 arrives."""
    release = asyncio.Event()  # never set: the rest of the body is never sent

    async def held_back() -> AsyncIterator[bytes]:
        yield b'{"entries": ['
        await release.wait()

    stale = signing.sign(SECRET, b"", now=time.time() - signing.MAX_SKEW_SEC - 60)
    async with (
        aiohttp.ClientSession() as http,
        asyncio.timeout(ANSWER_DEADLINE),
        http.post(
            signed.url + INGEST_PATH,
            data=held_back(),
            headers={"Content-Type": "application/json", **stale},
        ) as response,
    ):
        status, reply = response.status, orjson.loads(await response.read())
    assert status == 401, reply
    assert reply["error"]["code"] == "INGEST_UNAUTHORIZED"
    assert "stale" in reply["error"]["message"]
    assert signed.store.applied == []


async def test_a_body_declared_over_the_limit_is_413_before_it_is_sent(
    signed: ReferenceReceiver,
) -> None:
    for expect in ({}, {"Expect": "100-continue"}):
        headers: dict[str, str | bytes] = {
            "Content-Type": "application/json",
            "Content-Length": str(LIMIT + 1),
            **fresh_headers(),
            **expect,
        }
        answer = await exchange(signed.url, request_head("POST", INGEST_PATH, headers))
        error = assert_json_error(answer, 413, "INGEST_TOO_LARGE")
        assert str(LIMIT) in error["message"]
    assert signed.store.applied == []


def bomb() -> bytes:
    """15 KB of gzip that inflates to 15 MB of JSON-looking bytes."""
    return gzip.compress(b'{"entries": [' + b" " * (15 * 1024 * 1024) + b"]}", 9)


@pytest.mark.parametrize(
    "encoding",
    ["gzip", "x-gzip", "deflate", "br", "zstd", "gzip, identity", "GZIP", "compress"],
)
async def test_a_compressed_body_is_refused_with_415(
    signed: ReferenceReceiver, encoding: str
) -> None:
    """Compressed, 15 KB on the wire were 15 MB in memory, past the Content-Length check. The
    415 comes from the headers (the body is not sent at all here), names the encoding the
    receiver takes, and is answered the same to a client that sends the whole bomb."""
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Encoding": encoding,
        "Content-Length": "15000",
        **fresh_headers(),
    }
    answer = await exchange(signed.url, request_head("POST", INGEST_PATH, headers))
    error = assert_json_error(answer, 415, "INGEST_UNSUPPORTED_ENCODING")
    assert "identity" in error["message"]
    assert answer.headers["accept-encoding"] == "identity"
    assert signed.store.applied == []


@pytest.mark.parametrize("secret", [SECRET, None], ids=["signed", "unsigned"])
async def test_a_gzip_bomb_is_refused_with_415_and_nothing_applied(
    receiver_dsn: str, secret: str | None
) -> None:
    compressed = bomb()
    assert len(compressed) < 20 * 1024
    headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    if secret:
        headers.update(signing.sign(secret, compressed))
    async with (
        serve_reference_receiver(receiver_dsn, shared_secret=secret) as (url, store),
        aiohttp.ClientSession(auto_decompress=False) as http,
        http.post(url + INGEST_PATH, data=compressed, headers=headers) as response,
    ):
        status, reply = response.status, orjson.loads(await response.read())
    assert (status, reply["error"]["code"]) == (415, "INGEST_UNSUPPORTED_ENCODING"), reply
    assert store.applied == []


@pytest.mark.parametrize("encoding", ["identity", ""])
async def test_an_identity_content_encoding_is_accepted(
    signed: ReferenceReceiver, encoding: str
) -> None:
    body = body_of("plain")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            signed.url + INGEST_PATH,
            data=body,
            headers={
                "Content-Type": "application/json",
                "Content-Encoding": encoding,
                **signing.sign(SECRET, body),
            },
        ) as response,
    ):
        assert response.status == 200, await response.text()
    assert signed.store.applied == [1]


async def test_a_signed_request_that_expects_100_continue_is_applied(
    signed: ReferenceReceiver,
) -> None:
    """Headers that pass get 100 Continue, then the body is read and applied as usual."""
    body = body_of("asked-first")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            signed.url + INGEST_PATH,
            data=body,
            expect100=True,
            headers={"Content-Type": "application/json", **signing.sign(SECRET, body)},
        ) as response,
    ):
        assert response.status == 200, await response.text()
    assert signed.store.applied == [1]
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        "Expect": "something-else",
        **signing.sign(SECRET, body),
    }
    answer = await exchange(signed.url, request_head("POST", INGEST_PATH, headers))
    assert_json_error(answer, 417, "HTTP_417")


async def test_deflate_on_a_route_without_a_secret_is_415_too(unsigned: ReferenceReceiver) -> None:
    compressed = zlib.compress(body_of("deflated"))
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Encoding": "deflate",
        "Content-Length": str(len(compressed)),
    }
    answer = await exchange(unsigned.url, request_head("POST", INGEST_PATH, headers), compressed)
    assert_json_error(answer, 415, "INGEST_UNSUPPORTED_ENCODING")
    assert unsigned.store.applied == []


# -- malformed headers and clients that leave: JSON, one log line ----------------------------------


def receiver_lines(records: list[logging.LogRecord]) -> list[logging.LogRecord]:
    """The records of the receiver (aiohttp's complaints about connections included)."""
    return [r for r in records if r.name.startswith(("serversync", "aiohttp"))]


def assert_one_quiet_line(records: list[logging.LogRecord]) -> logging.LogRecord:
    """Exactly one record, below ERROR, without a traceback, one line in both formats."""
    mine = receiver_lines(records)
    assert len(mine) == 1, [(r.levelname, r.getMessage()) for r in mine]
    record = mine[0]
    assert record.levelno < logging.ERROR, record.getMessage()
    assert record.exc_info is None, record.getMessage()
    text = TextFormatter().format(record)
    assert "\n" not in text and "\r" not in text, text
    assert not CONTROL.search(text), text
    assert "\n" not in JsonFormatter().format(record)
    return record


def signature_cases() -> list[Any]:
    now = str(int(time.time()))
    good = signing.signature(SECRET, now, body_of("x"))
    hex_digits = good.removeprefix("v1=")
    arabic_now = "".join(chr(0x660 + int(d)) for d in now)  # the same number, Arabic-Indic
    return [
        pytest.param(now.encode(), "v1=€".encode() + hex_digits[1:].encode(), id="non-ascii"),
        pytest.param(now.encode(), b"v1=\xff\xfe" + hex_digits[2:].encode(), id="not-utf8"),
        pytest.param(arabic_now.encode(), good.encode(), id="arabic-indic-timestamp"),
        pytest.param(now.encode(), good.upper().encode(), id="upper-case"),
        pytest.param(now.encode() + b"\xc3\xa9", good.encode(), id="timestamp-not-utf8"),
        pytest.param(now.encode(), good.encode() + "\u00a0".encode(), id="trailing-nbsp"),
    ]


@pytest.mark.parametrize(("timestamp", "signature"), signature_cases())
async def test_a_malformed_signature_header_is_401_and_one_line(
    signed: ReferenceReceiver, timestamp: bytes, signature: bytes
) -> None:
    body = body_of("x")
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        signing.TIMESTAMP_HEADER: timestamp,
        signing.SIGNATURE_HEADER: signature,
    }
    answer = await exchange(signed.url, request_head("POST", INGEST_PATH, headers), body)
    assert_json_error(answer, 401, "INGEST_UNAUTHORIZED")
    assert_one_quiet_line(signed.records())
    assert signed.store.applied == []


@pytest.mark.parametrize("secret", [SECRET, None], ids=["signed", "unsigned"])
async def test_a_client_that_disconnects_mid_body_costs_one_line(
    receiver_dsn: str, logs: pytest.LogCaptureFixture, secret: str | None
) -> None:
    """The headers pass, the body stops halfway and the connection closes: not a 500 with a
    traceback, one INFO line; nothing is applied."""
    body = body_of(*(f"left-{i}" for i in range(200)))
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Length": str(len(body)),
        **(signing.sign(secret, body) if secret else {}),
    }
    async with serve_reference_receiver(receiver_dsn, shared_secret=secret) as (url, store):
        logs.clear()
        async with connection(url) as (_, writer):
            writer.write(request_head("POST", INGEST_PATH, headers) + body[: len(body) // 2])
            await writer.drain()

        def logged() -> bool:
            return bool(receiver_lines(logs.records))

        await wait_until(logged, what="the receiver to log the disconnect")
        record = assert_one_quiet_line(logs.records)
        assert "disconnected mid-body" in record.getMessage()
        assert store.applied == []


# -- control characters never reach a log line -----------------------------------------------------

FORGED = "2026-01-01 00:00:00,000 ERROR   serversync: forged"


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(
            f"{INGEST_PATH}%0a{FORGED.replace(' ', '%20')}%0d%0a%1b[2J%00%7f%c2%85",
            id="percent-encoded",
        ),
        pytest.param(f"{INGEST_PATH}\x1b[2J\x7f\x01".encode(), id="raw-control-bytes"),
        pytest.param(b"/api/ingest/sync\r\n" + FORGED.encode(), id="raw-newline"),
    ],
)
async def test_control_characters_in_a_request_make_exactly_one_log_line(
    signed: ReferenceReceiver, target: str | bytes
) -> None:
    """A %0a in the path forged a line of its own in the text log. Whatever the request line
    holds, percent-encoded or raw, the receiver answers in one log line with no control
    character, in the text format as in JSON."""
    headers: dict[str, str | bytes] = {"Content-Type": "application/json", "Content-Length": "2"}
    async with connection(signed.url) as (reader, writer), asyncio.timeout(ANSWER_DEADLINE):
        writer.write(request_head("POST", target, headers) + b"{}")
        await writer.drain()
        answer = await read_answer(reader)
    assert answer.status in (400, 401), answer
    # The answer came after the line was logged: no waiting needed.
    record = assert_one_quiet_line(signed.records())
    text = TextFormatter().format(record)
    assert not text.endswith("forged"), text
    assert signed.store.applied == []


def test_the_text_formatter_keeps_a_record_on_one_line() -> None:
    record = logging.LogRecord(
        "serversync.receiver",
        logging.WARNING,
        __file__,
        1,
        "refused POST %s",
        (f"/x\n{FORGED}\r\n\x1b[2J\x00\u0085\u2028end",),
        None,
    )
    text = TextFormatter().format(record)
    assert "\n" not in text and not CONTROL.search(text), text
    assert text.endswith("end"), text
    try:
        raise ValueError(f"bad path /x\n{FORGED}")
    except ValueError as exc:
        record.exc_info = (type(exc), exc, exc.__traceback__)
    lines = TextFormatter().format(record).split("\n")
    # A traceback keeps its lines, each marked as a continuation: none passes for a record.
    assert all(line.startswith("  | ") for line in lines[1:]), lines
    assert not any(line.startswith(FORGED) for line in lines), lines


# -- 405 names the allowed methods ---------------------------------------------------------------


async def test_the_receivers_405_carries_allow(unsigned: ReferenceReceiver) -> None:
    async with aiohttp.ClientSession() as http:
        for method, path, allowed in [
            ("GET", INGEST_PATH, {"POST"}),
            ("PUT", INGEST_PATH, {"POST"}),
            ("POST", "/healthz", {"GET", "HEAD"}),
            ("DELETE", "/readyz", {"GET", "HEAD"}),
        ]:
            async with http.request(method, unsigned.url + path) as response:
                assert response.status == 405, (method, path)
                reply = orjson.loads(await response.read())
                assert reply["error"]["code"] == "HTTP_405"
                assert set(response.headers["Allow"].split(",")) == allowed, (method, path)


@pytest.fixture
async def ops_url(backend_dsn: str) -> AsyncIterator[str]:
    """A consumer process's HTTP port with the admin API on, as `serversync run` serves it."""
    settings = make_settings(backend_dsn, FRONTEND, SYNC_ADMIN_TOKEN=TOKEN, SYNC_HTTP_PORT=0)
    async with (
        consumer_runtime(settings, "frontend-sync") as runtime,
        serve_ops_http(settings, runtime) as url,
    ):
        yield url


async def test_the_ops_ports_405_carries_allow(ops_url: str) -> None:
    message = "/api/v1/dlq/messages/00000000-0000-0000-0000-000000000001"
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http:
        for method, path, allowed in [
            ("POST", "/healthz", {"GET", "HEAD"}),
            ("POST", "/readyz", {"GET", "HEAD"}),
            ("PUT", message, {"GET", "HEAD", "DELETE"}),
            ("GET", f"{message}/retry", {"POST"}),
            ("DELETE", "/api/v1/dlq/frontend-sync/retry-all", {"POST"}),
        ]:
            async with http.request(method, ops_url + path) as response:
                assert response.status == 405, (method, path)
                reply = orjson.loads(await response.read())
                assert reply["error"]["code"] == "HTTP_405"
                assert set(response.headers["Allow"].split(",")) == allowed, (method, path)


@pytest.mark.parametrize(
    "authorization",
    [
        pytest.param(b"Bearer \xff\xfe\xfd", id="not-utf8"),
        pytest.param("Bearer tökén-0123456789abcdef".encode(), id="non-ascii"),
        pytest.param(b"Bearer " + TOKEN.encode()[:-1] + b"\xe9", id="token-and-a-latin1-byte"),
        pytest.param(b"\xc3\x28 " + TOKEN.encode(), id="scheme-not-utf8"),
    ],
)
async def test_an_admin_authorization_header_that_is_not_utf8_is_401_and_one_line(
    ops_url: str, logs: pytest.LogCaptureFixture, authorization: bytes
) -> None:
    logs.clear()
    head = request_head("GET", "/api/v1/dlq/frontend-sync", {"Authorization": authorization})
    answer = await exchange(ops_url, head)
    assert_json_error(answer, 401, "SYS_DLQ_UNAUTHORIZED")
    assert answer.headers["www-authenticate"].startswith("Bearer")
    record = assert_one_quiet_line(
        [r for r in logs.records if r.name.startswith(("serversync.adminapi", "aiohttp"))]
    )
    assert "refused" in record.getMessage()


@pytest.mark.parametrize(
    "disguise", ["\u2028", "\u2029", "\u202e", "\u2066", "\x85", "\x1b", "\ud800"]
)
def test_printable_leaves_nothing_that_breaks_or_disguises_a_line(disguise: str) -> None:
    """Line and paragraph separators break a line in many log viewers, and a right-to-left
    override makes a line read backwards: they go the way of the control characters."""
    assert printable(f"refused{disguise}forged: admin logged in") == (
        "refused forged: admin logged in"
    )
    assert printable("é 日本 ok") == "é 日本 ok"


# -- bodies a stranger could make the receiver hold ------------------------------------------------


@contextlib.asynccontextmanager
async def bounded_receiver(receiver_dsn: str, reads: BodyReads) -> AsyncIterator[str]:
    """The reference receiver with SECRET and these bounds on reading bodies; its base URL."""
    async with open_pool(receiver_dsn, "test-ingest", max_size=2) as pool:
        app = build_app(
            EntityStore(pool), max_body_bytes=1024 * 1024, shared_secret=SECRET, body_reads=reads
        )
        async with serve_app(app, shutdown_timeout=1.0) as url:
            yield url


def forged_head(length: int) -> bytes:
    """A POST whose signature headers are well-formed and fresh, though no secret made them:
    what anyone can send, and what the receiver must read the body of to tell."""
    headers: dict[str, str | bytes] = {
        "Content-Type": "application/json",
        "Content-Length": str(length),
        **fresh_headers(b"not the body"),
    }
    return request_head("POST", INGEST_PATH, headers)


async def test_a_trickling_body_is_cut_off_by_its_deadline(receiver_dsn: str) -> None:
    """4 KiB declared, at a minimum of 1 KiB/s after a 0.5 s allowance: the body that stops
    after a few bytes is answered 408 within about 4.5 s, not held open for ever."""
    reads = BodyReads(max_concurrent=8, idle_timeout=0.5, min_rate=1024)
    async with bounded_receiver(receiver_dsn, reads) as url:
        started = time.monotonic()
        answer = await exchange(url, forged_head(4096), b'{"entries"')
        took = time.monotonic() - started
    assert_json_error(answer, 408, "INGEST_BODY_TIMEOUT")
    assert 4.0 <= took < ANSWER_DEADLINE, took
    assert reads.reading == 0


async def test_bodies_read_at_once_are_bounded_and_one_more_is_503(receiver_dsn: str) -> None:
    """One body is being read (it trickles); a second request is turned away with 503 and
    Retry-After at once, and is taken again once the first is done."""
    reads = BodyReads(max_concurrent=1, idle_timeout=30.0, min_rate=1024)
    async with (
        bounded_receiver(receiver_dsn, reads) as url,
        connection(url) as (_, holder),
    ):
        holder.write(forged_head(4096) + b'{"entr')
        await holder.drain()
        await wait_until(lambda: reads.reading == 1, what="the first body being read")
        busy = await exchange(url, forged_head(2), b"{}")
        assert_json_error(busy, 503, "INGEST_BUSY")
        assert busy.headers["retry-after"] == "1"
        holder.close()
        await wait_until(lambda: reads.reading == 0, what="the first read to end")
        # Free again: the next one is read (and refused for its forged signature).
        again = await exchange(url, forged_head(2), b"{}")
        assert_json_error(again, 401, "INGEST_UNAUTHORIZED")
