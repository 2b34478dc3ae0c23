"""The JetStream sink: each entry of a batch becomes one message of a NATS JetStream stream,
effectively once (docs/jetstream.md).

- Subject `<prefix>.<entityType>.<op>`, each name made a legal subject token (`subject_token`).
- `Nats-Msg-Id: <source>:<consumer>:<seq>` (`message_id`): the event's place in the outbox, so a
  batch published again (a retry, a crash, a takeover) is dropped by the stream's duplicate
  window; `<source>` is the publishing database (its node name, or its system identifier and
  oid while it has none), so the consumers of two databases never share an id in one stream.
- `Nats-Expected-Stream: <stream>`: a subject some other stream takes is refused, never stored
  there.
- `Serversync-Entity-Id`: the entity id, percent-encoded where it is not printable ASCII
  (`header_value`); the body is the wire entry, byte for byte as the HTTP sinks send it.

A batch is published pipelined, each entity in turn: a message goes out at once unless an
earlier message of its entity in the batch is not acknowledged yet; then it waits in its
entity's queue and goes out when that acknowledgement comes, while the messages of other
entities go on. So an entity's messages are stored in outbox order even when a message is lost
in a leader change and the batch is published again: a later message of that entity is never
sent before the earlier one is stored. Each message has the timeout from its own sending for its
acknowledgement (a long chain of one entity's messages takes as long as it takes). The batch is
delivered when the stream acknowledged every message; any failure fails the whole batch, which
the runtime publishes again (what was stored is dropped as a duplicate).

The connection never holds a publication back for later: the client buffers nothing while it is
disconnected (a publication then fails at once), a lost or closed connection fails the
acknowledgements awaited at once, and a connection that is not connected when a delivery fails
is closed, not left to reconnect. So nothing a delivery gave up on reaches the stream later,
after newer messages (a process that lost the lead keeps its sink open until it stops). A
permission the server refuses (publishing to the subject, subscribing to the replies) fails the
delivery at once as a wrong destination, and that connection is not used again.

The replies are read from one subscription of the sink's own, not with nats-py's
publish_async: in nats-py 2.9 an error answer (a message over the stream's max_msg_size, say)
raises inside its reply handler and leaves the publish waiting until it times out, so a refused
message would read as a stream that does not answer.

Only this module imports `nats` (the `jetstream` extra; an import-linter contract holds it); the
kind that builds it imports it when a JetStream consumer is declared.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import nats
import nats.errors
import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from opentelemetry.trace import SpanKind

from consumer.core import failpoints
from consumer.core.errors import first_line
from consumer.core.events import (
    Batch,
    DeliveryError,
    EntryKey,
    Failure,
    Outcome,
    json_members,
)
from consumer.observability.instruments import tracer

log = logging.getLogger("serversync.jetstream")

MSG_ID_HEADER = "Nats-Msg-Id"
EXPECTED_STREAM_HEADER = "Nats-Expected-Stream"
ENTITY_ID_HEADER = "Serversync-Entity-Id"
# Reached once half of a batch's messages are acknowledged (crash tests kill the process here).
MID_BATCH_FAILPOINT = "jetstream.mid-batch"
# The most messages waiting for their acknowledgement at once (nats.go's default for async
# publishing): a batch of 50,000 entries does not queue 50,000 replies.
MAX_PENDING_ACKS = 4000
# JetStream refuses a message whose header block (the NATS/1.0 line, each header line and the
# blank line after them) is longer than this (nats-server's math.MaxUint16; err_code 10097).
MAX_HEADER_BYTES = 65_535
# Seconds between the client's pings: a connection whose peer vanished without closing it
# (half-open) is given up after two pings without an answer.
PING_INTERVAL_SEC = 15
# Errors kept from a connection attempt's tries, to tell why it failed.
KEPT_CONNECT_ERRORS = 16
# JetStream's own error codes (nats-server's errors.json) that decide the failure; any other
# error is decided by its HTTP-like code: 5xx passes (UNAVAILABLE), the rest is WRONG_DESTINATION.
REFUSED_ERRORS = {
    10054: "the message is over the stream's max_msg_size",
    10097: "the message's headers are over JetStream's limit of 64 KiB",
}
WRONG_DESTINATION_ERRORS = {
    10059: "the stream does not exist",
    10060: "the subject belongs to another stream",
}
STREAM_NOT_FOUND = 10059
STREAM_NAME_IN_USE = 10058
NO_RESPONDERS_STATUS = "503"
# In the text of an error the server sends when it refuses a publish or a subscription (nats-py
# lower-cases it).
PERMISSIONS_VIOLATION = "permissions violation"

# Bytes kept as they are in a subject token; every other byte is written ~XX (upper-case hex).
_TOKEN_BYTES = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
# Printable ASCII but '%', kept as they are in a header value.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) != "%")
# A header value made of those only, which needs no encoding (most entity ids).
_HEADER_PLAIN = re.compile(r"[!-$&-~]*")


def message_id(source: str | None, consumer: str, seq: int | str) -> str:
    """The Nats-Msg-Id of the event `seq` of `consumer`: `<source>:<consumer>:<seq>`, or
    `<consumer>:<seq>` without a source."""
    return f"{source}:{consumer}:{seq}" if source else f"{consumer}:{seq}"


@functools.lru_cache(maxsize=4096)
def subject_token(name: str) -> str:
    """`name` as one legal subject token: ASCII letters, digits, '_' and '-' are kept, every
    other byte of its UTF-8 form (the '.' that separates tokens, '*', '>', '~', blanks, control
    characters, non-ASCII) becomes '~' and two upper-case hex digits; the empty name is "~".
    Reversible, and distinct names never share a token."""
    if not name:
        return "~"
    return "".join(
        chr(byte) if byte in _TOKEN_BYTES else f"~{byte:02X}"
        for byte in name.encode("utf-8", "surrogatepass")
    )


def subject_of(prefix: str, entity_type: str, op: str) -> str:
    """The subject an entry is published to."""
    return f"{prefix}.{subject_token(entity_type)}.{subject_token(op)}"


def header_value(text: str) -> str:
    """`text` fit for a header value: printable ASCII but '%' as it is, every other byte of its
    UTF-8 form (blanks, CR and LF, non-ASCII) percent-encoded; urllib.parse.unquote reverses
    it."""
    if _HEADER_PLAIN.fullmatch(text):
        return text
    return quote(text.encode("utf-8", "surrogatepass"), safe=_HEADER_SAFE)


def subject_matches(pattern: str, subject: str) -> bool:
    """Whether a stream subject (with '*' and '>' wildcards) takes `subject`."""
    wanted, parts = pattern.split("."), subject.split(".")
    for index, part in enumerate(wanted):
        if part == ">":
            return len(parts) > index
        if index >= len(parts) or part not in ("*", parts[index]):
            return False
    return len(parts) == len(wanted)


def format_duration(seconds: float) -> str:
    """A duration as the declarations write it ("2m", "1h30m", "500ms"); 0 is "none"."""
    if seconds <= 0:
        return "none"
    millis = round(seconds * 1000)
    parts = []
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1000)):
        if millis >= size:
            parts.append(f"{millis // size}{unit}")
            millis %= size
    if millis:
        parts.append(f"{millis}ms")
    return "".join(parts)


# -- where it connects and what stream it publishes to -------------------------------------------


@dataclass(frozen=True)
class JetStreamConnection:
    """How to reach the cluster. The password and the token never show in a repr."""

    servers: tuple[str, ...]
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    # nats-py reads the seed from this file when it connects.
    nkey_seed_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # How long one connection attempt to one server may take.
    connect_timeout: float = 5.0

    def tls_context(self) -> ssl.SSLContext | None:
        """The TLS context, when any TLS file is given or a server is a tls:// URL."""
        wants_tls = any(server.startswith("tls://") for server in self.servers)
        if not (wants_tls or self.tls_ca_file or self.tls_cert_file):
            return None
        context = ssl.create_default_context(cafile=self.tls_ca_file)
        if self.tls_cert_file is not None:
            context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments of nats.connect for these credentials and TLS."""
        options: dict[str, Any] = {
            "servers": list(self.servers),
            "connect_timeout": max(1, round(self.connect_timeout)),
        }
        if self.user is not None:
            options["user"], options["password"] = self.user, self.password
        if self.token is not None:
            options["token"] = self.token
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = self.nkey_seed_file
        tls = self.tls_context()
        if tls is not None:
            options["tls"] = tls
        return options


@dataclass(frozen=True)
class StreamSpec:
    """The stream a consumer publishes to, with the settings serversync sets on it."""

    name: str
    subject_prefix: str
    replicas: int
    # limits | interest | workqueue
    retention: str
    # Seconds; 0: messages never expire by age.
    max_age: float
    duplicate_window: float

    @property
    def subject_filter(self) -> str:
        """The subject the stream takes every message of this consumer by."""
        return f"{self.subject_prefix}.>"

    def config(self) -> dict[str, Any]:
        """The stream's configuration as JetStream's API takes it (durations in ns)."""
        return {
            "name": self.name,
            "subjects": [self.subject_filter],
            "retention": self.retention,
            "num_replicas": self.replicas,
            "max_age": _nanos(self.max_age),
            "duplicate_window": _nanos(self.duplicate_window),
            "storage": "file",
            "discard": "old",
        }

    def differences(self, config: dict[str, Any]) -> list[str]:
        """What an existing stream's configuration has otherwise than this spec sets, one
        phrase each ("replicas 1 (declared 3)"). The stream may take more subjects than ours,
        and may have settings serversync does not set (max_msg_size, max_bytes, ...)."""
        found: list[str] = []
        subjects = config.get("subjects") or []
        if self.subject_filter not in subjects:
            found.append(
                f"subjects {', '.join(subjects) or 'none'} (declared {self.subject_filter})"
            )

        def compare(what: str, have: str, declared: str) -> None:
            if have != declared:
                found.append(f"{what} {have} (declared {declared})")

        compare("replicas", str(config.get("num_replicas", 1)), str(self.replicas))
        compare("retention", str(config.get("retention", "limits")), self.retention)
        compare(
            "max_age",
            format_duration(int(config.get("max_age", 0)) / 1e9),
            format_duration(self.max_age),
        )
        compare(
            "duplicate_window",
            format_duration(int(config.get("duplicate_window", 0)) / 1e9),
            format_duration(self.duplicate_window),
        )
        compare("storage", str(config.get("storage", "file")), "file")
        return found


def _nanos(seconds: float) -> int:
    return round(seconds * 1_000_000_000)


class JetStreamError(Exception):
    """JetStream cannot be used now (unreachable, not answering, refusing an API request)."""


class StreamMismatchError(JetStreamError):
    """The stream exists with settings other than those declared."""


async def connect(
    connection: JetStreamConnection,
    *,
    consumer: str,
    reconnect: bool = True,
    errors: list[Exception] | None = None,
    on_error: Callable[[Exception], None] | None = None,
    on_lost: Callable[[], None] | None = None,
) -> NATS:
    """A client connected to one of the servers; nats.errors.Error or OSError when none takes
    it. With `reconnect` it reconnects for as long as it lives, and its first connection is
    tried until it succeeds (bound it with a timeout; `errors` gets what each try met); without,
    it gives up after one pass over the servers. It never buffers a publication while it is
    disconnected (pending_size 0: publish raises OutboundBufferLimitError at once). `on_error`
    hears every error the client reports, `on_lost` every loss of the connection (a disconnect,
    the close). An attempt that fails or is cancelled closes the client it made."""
    nc = NATS()

    async def on_client_error(error: Exception) -> None:
        # The runtime logs every failed delivery already; these are the client's own details.
        log.debug("consumer %s: NATS: %s", consumer, first_line(error))
        if errors is not None:
            errors.append(error)
            del errors[:-KEPT_CONNECT_ERRORS]
        if on_error is not None:
            on_error(error)

    async def on_disconnect() -> None:
        if reconnect and not nc.is_closed:
            log.warning("consumer %s: disconnected from NATS; reconnecting", consumer)
        if on_lost is not None:
            on_lost()

    async def on_closed() -> None:
        if on_lost is not None:
            on_lost()

    async def on_reconnect() -> None:
        url = nc.connected_url
        log.info("consumer %s: reconnected to NATS at %s", consumer, url.netloc if url else "?")

    try:
        await nc.connect(
            **connection.connect_options(),
            name=f"serversync:{consumer}",
            allow_reconnect=reconnect,
            max_reconnect_attempts=-1 if reconnect else 1,
            reconnect_time_wait=1,
            pending_size=0,
            ping_interval=PING_INTERVAL_SEC,
            error_cb=on_client_error,
            disconnected_cb=on_disconnect,
            closed_cb=on_closed,
            reconnected_cb=on_reconnect if reconnect else None,
        )
    except BaseException:
        # A timeout around the attempt cancels it half-way: the client's socket and tasks go.
        await close_quietly(nc)
        raise
    return nc


async def close_quietly(nc: NATS) -> None:
    """Close a client in whatever state it is (half-made, reconnecting, closed), dropping the
    commands it has not written yet: nats-py 2.9 writes them when it reconnects or closes, and
    a publication a delivery gave up on must never reach the stream after newer ones."""
    nc._pending = []
    nc._pending_data_size = 0
    with contextlib.suppress(Exception):
        await nc.close()


async def api_request(nc: NATS, subject: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """One JetStream API request; its JSON object (which may hold "error"), or JetStreamError
    when nothing answers or the answer is not one."""
    try:
        reply = await nc.request(
            subject, orjson.dumps(body) if body is not None else b"", timeout=timeout
        )
    except nats.errors.NoRespondersError:
        raise JetStreamError(
            "JetStream does not answer (no responders: not enabled for this account, or no "
            "cluster leader)"
        ) from None
    except (nats.errors.Error, TimeoutError) as exc:
        raise JetStreamError(f"JetStream does not answer: {_describe(exc)}") from None
    try:
        answer = orjson.loads(reply.data)
    except orjson.JSONDecodeError:
        answer = None
    if not isinstance(answer, dict):
        raise JetStreamError(f"JetStream answered {subject} with no JSON object")
    return answer


async def ensure_stream(nc: NATS, spec: StreamSpec, *, timeout: float) -> str:
    """Make the stream exist as `spec` says: "created" when it was missing, "found" when it
    exists with the declared settings. StreamMismatchError when it exists otherwise (it is
    never changed), JetStreamError when it cannot be read or made."""
    info = await api_request(nc, f"$JS.API.STREAM.INFO.{spec.name}", None, timeout)
    error = info.get("error")
    if error is not None and error.get("err_code") == STREAM_NOT_FOUND:
        created = await api_request(
            nc, f"$JS.API.STREAM.CREATE.{spec.name}", spec.config(), timeout
        )
        error = created.get("error")
        if error is None:
            return "created"
        if error.get("err_code") != STREAM_NAME_IN_USE:
            raise JetStreamError(f"cannot create stream {spec.name}: {_api_error_text(error)}")
        # Another process made it first (a standby starting beside the leader): compare.
        info = await api_request(nc, f"$JS.API.STREAM.INFO.{spec.name}", None, timeout)
        error = info.get("error")
    if error is not None:
        raise JetStreamError(f"cannot read stream {spec.name}: {_api_error_text(error)}")
    differences = spec.differences(info.get("config") or {})
    if differences:
        raise StreamMismatchError(
            f"stream {spec.name} exists with other settings: {'; '.join(differences)}; "
            "serversync never changes an existing stream: change the stream or the declaration"
        )
    return "found"


async def prepare_stream(
    connection: JetStreamConnection, spec: StreamSpec, *, consumer: str, timeout: float
) -> str:
    """Connect once and make the stream exist as `spec` says (ensure_stream): "created" or
    "found". StreamMismatchError when it exists otherwise; JetStreamError when no server takes
    the connection or JetStream cannot do it."""
    try:
        nc = await connect(connection, consumer=consumer, reconnect=False)
    except (nats.errors.Error, OSError, TimeoutError) as exc:
        raise JetStreamError(
            f"cannot connect to NATS at {', '.join(connection.servers)}: {_describe(exc)}"
        ) from None
    try:
        return await ensure_stream(nc, spec, timeout=timeout)
    finally:
        await nc.close()


def _api_error_text(error: dict[str, Any]) -> str:
    return (
        f"{error.get('description', 'no description')} "
        f"(code {error.get('code')}, err_code {error.get('err_code')})"
    )


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


# -- the sink ------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Message:
    """One entry as it is published."""

    seq: int
    entity: tuple[str, str]
    subject: str
    headers: dict[str, str]
    body: bytes

    def header_size(self) -> int:
        """The size of its header block as nats-py writes it: the NATS/1.0 line, one
        "name: value" line per header, a blank line."""
        lines = sum(len(k) + len(v) + 4 for k, v in self.headers.items())
        return len(b"NATS/1.0\r\n") + lines + 2


@dataclass(frozen=True)
class _Trouble:
    """What ends every publication waiting on a connection: the connection lost or closed, a
    permission refused, the sink closed."""

    text: str
    code: str
    failure: Failure = Failure.UNAVAILABLE

    def error(self) -> DeliveryError:
        """A new DeliveryError saying so."""
        return DeliveryError(self.text, failure=self.failure, code=self.code)


# A publication's reply (the token it was sent with, the answer) or what ended the connection.
_Reply = tuple[str, Msg] | _Trouble


@dataclass(eq=False)
class _Link:
    """One connection of the sink and what waits on it."""

    nc: NATS
    # Acknowledgements come to <inbox>.<token>.
    inbox: str
    # Token -> the replies of the publication that awaits it.
    acks: dict[str, asyncio.Queue[_Reply]] = field(default_factory=dict)
    # The replies of each publication running on this connection.
    publications: set[asyncio.Queue[_Reply]] = field(default_factory=set)
    # Why it is not used again (the server refused a permission): the next delivery connects
    # anew.
    trouble: _Trouble | None = None
    tokens: itertools.count[int] = field(default_factory=itertools.count)

    def usable(self) -> bool:
        """Whether a delivery may publish on it."""
        return self.trouble is None and not self.nc.is_closed

    def fail(self, trouble: _Trouble) -> None:
        """End every publication waiting on this connection."""
        for replies in self.publications:
            replies.put_nowait(trouble)


class JetStreamSink:
    """Publishes each entry of a batch as one message of `stream`, and returns once the
    stream acknowledged every one (see the module's docstring). `source` reads, at the first
    delivery, what starts every Nats-Msg-Id (`message_id`); None: ids are `<consumer>:<seq>`."""

    def __init__(
        self,
        consumer: str,
        *,
        connection: JetStreamConnection,
        stream: StreamSpec,
        timeout_sec: float,
        source: Callable[[], Awaitable[str]] | None = None,
    ) -> None:
        # The consumer's name: part of every Nats-Msg-Id.
        self.name = consumer
        self.connection = connection
        self.stream = stream
        self._timeout = timeout_sec
        self._source = source
        # The source of the Nats-Msg-Ids ("": none); None until `source` is read.
        self._id_source: str | None = None if source is not None else ""
        self._link: _Link | None = None
        self._connecting = asyncio.Lock()

    def __repr__(self) -> str:
        return f"JetStreamSink({self.name!r}, stream={self.stream.name!r})"

    async def start(self) -> None:
        """Nothing to open: the first delivery connects. Before the process starts, the kind's
        check (consumer/app/jetstream_kind.py) has connected and made or found the stream, so a
        cluster that is down or refuses the login then stops the start (exit 1); once running,
        the same troubles are failed deliveries, retried."""

    async def close(self) -> None:
        """Close the connection. A delivery still waiting for acknowledgements fails ("the
        sink closed"), and nothing it queued is sent."""
        link, self._link = self._link, None
        if link is not None:
            link.fail(
                _Trouble("the sink closed while the batch was being published", "SINK_CLOSED")
            )
            await close_quietly(link.nc)

    async def deliver(self, batch: Batch) -> Outcome:
        """Publish the batch and wait until the stream acknowledged every message: delivered,
        or already processed when every message was a duplicate; else a DeliveryError."""
        if self._id_source is None:
            self._id_source = await self._read_source()
        keyed = batch.keyed_entries()
        if keyed is not None:
            messages = [self._message(raw, key) for key, raw in keyed]
        else:
            messages = [self._message(raw) for raw in batch.raw_entries()]
        # JetStream refuses headers over 64 KiB (an entity id that long): refused here, before
        # anything is sent, as content (the event is parked).
        header_sizes = [message.header_size() for message in messages]
        if over := _first_over(MAX_HEADER_BYTES, header_sizes, messages):
            size, message = over
            raise DeliveryError(
                f"the headers of seq {message.seq} are {size} bytes (its entity id is "
                f"{len(message.entity[1])} characters), over JetStream's limit of "
                f"{MAX_HEADER_BYTES} bytes",
                failure=Failure.REFUSED,
                code="NATS_HEADER_SIZE",
            )
        link = await self._client()
        nc = link.nc
        # The server's limit on one message, headers included: a message over it would make
        # the server close the connection, so it is refused here, before anything is sent.
        limit = nc.max_payload
        wire_sizes = [
            size + len(message.body) for size, message in zip(header_sizes, messages, strict=True)
        ]
        if over := _first_over(limit, wire_sizes, messages):
            size, message = over
            raise DeliveryError(
                f"the message of seq {message.seq} ({size} bytes with its headers) is over the "
                f"server's max_payload of {limit} bytes",
                failure=Failure.REFUSED,
                code="NATS_MAX_PAYLOAD",
            )
        attributes: dict[str, str | int] = {
            "messaging.system": "nats",
            "messaging.destination.name": self.stream.name,
            "messaging.batch.message_count": len(messages),
        }
        with tracer.start_as_current_span(
            f"publish {self.stream.name}", kind=SpanKind.PRODUCER, attributes=attributes
        ):
            try:
                duplicates = await _Publication(self, link, messages).run()
            except BaseException:
                # Not connected (lost, reconnecting): the client would send what it still holds
                # of this attempt once it reconnects, maybe after a newer attempt's messages,
                # so it is closed; the next delivery connects anew.
                if not nc.is_connected:
                    await self._discard(link)
                raise
        if messages and duplicates == len(messages):
            return Outcome.ALREADY_PROCESSED
        return Outcome.DELIVERED

    async def _read_source(self) -> str:
        """The source of the Nats-Msg-Ids, read once: every publication of an event carries
        one id."""
        if self._source is None:
            return ""
        source = await self._source()
        log.info(
            "consumer %s: message ids are %s", self.name, message_id(source, self.name, "<seq>")
        )
        return source

    def _message(self, raw: bytes, key: EntryKey | None = None) -> _Message:
        """An entry as its message; the body is the entry exactly as the outbox gave it. The
        entry's key as its row held it, when known; else it is read from the entry."""
        if key is None:
            key = _entry_key(raw)
        seq, op, entity_type, entity_id = key
        headers = {
            MSG_ID_HEADER: message_id(self._id_source, self.name, seq),
            EXPECTED_STREAM_HEADER: self.stream.name,
            ENTITY_ID_HEADER: header_value(entity_id),
        }
        subject = subject_of(self.stream.subject_prefix, entity_type, op)
        return _Message(seq, (entity_type, entity_id), subject, headers, raw)

    async def _client(self) -> _Link:
        """The connection, made on first use, and again once closed or refused a permission."""
        async with self._connecting:
            link = self._link
            if link is not None and link.usable():
                return link
            if link is not None:
                await self._discard(link)
            # The callbacks find the connection's link here once it is made.
            made: list[_Link] = []

            def on_error(error: Exception) -> None:
                if made and PERMISSIONS_VIOLATION in str(error).lower():
                    self._refused(made[0], error)

            def on_lost() -> None:
                if made:
                    self._lost(made[0])

            # Its first connection is tried until a server takes it: bounded here, so a cluster
            # that is down is a failed delivery (retried, reported) rather than a silent wait.
            seen: list[Exception] = []
            try:
                nc = await asyncio.wait_for(
                    connect(
                        self.connection,
                        consumer=self.name,
                        errors=seen,
                        on_error=on_error,
                        on_lost=on_lost,
                    ),
                    self._timeout,
                )
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                cause = connect_cause(seen, exc)
                failure, code = _connect_failure(cause)
                raise DeliveryError(
                    f"cannot connect to NATS at {', '.join(self.connection.servers)} within "
                    f"{self._timeout:g}s: {_describe(cause)}",
                    failure=failure,
                    code=code,
                ) from None
            link = _Link(nc, nc.new_inbox())
            made.append(link)

            async def on_reply(msg: Msg) -> None:
                self._on_reply(link, msg)

            try:
                await nc.subscribe(f"{link.inbox}.*", cb=on_reply)
            except BaseException as exc:
                await close_quietly(nc)
                if isinstance(exc, nats.errors.Error):
                    raise _connection_error(exc) from None
                raise
            self._link = link
            return link

    async def _discard(self, link: _Link) -> None:
        """Close a connection that is not to be used again."""
        if self._link is link:
            self._link = None
        await close_quietly(link.nc)

    def _on_reply(self, link: _Link, msg: Msg) -> None:
        token = msg.subject[len(link.inbox) + 1 :]
        replies = link.acks.pop(token, None)
        # None: the reply of an attempt given up already.
        if replies is not None:
            replies.put_nowait((token, msg))

    def _refused(self, link: _Link, error: Exception) -> None:
        """The server refused a permission on this connection: to publish to a subject (the
        message is not stored, and no answer comes) or to subscribe to the replies (none
        comes). A wrong destination; the connection is not used again."""
        link.trouble = _Trouble(
            f"NATS refused a permission: {first_line(error)} (the user must be allowed to "
            f"publish to {self.stream.subject_filter} and to subscribe to _INBOX.>)",
            "NATS_PERMISSION",
            Failure.WRONG_DESTINATION,
        )
        link.fail(link.trouble)

    def _lost(self, link: _Link) -> None:
        """The connection was lost or closed: its acknowledgements in flight never come."""
        error = link.nc.last_error
        why = f": {_describe(error)}" if error is not None else ""
        link.fail(
            _Trouble(
                f"the connection to NATS was lost while the batch was being published{why}",
                "NATS_CONNECTION",
            )
        )

    async def _answer(self, nc: NATS, message: _Message, reply: Msg) -> dict[str, Any]:
        """The stream's acknowledgement of `message` (a PubAck of this stream), or the
        DeliveryError its answer means."""
        if reply.headers and reply.headers.get("Status") == NO_RESPONDERS_STATUS:
            raise await self._no_responders(nc, message)
        try:
            answer = orjson.loads(reply.data)
        except orjson.JSONDecodeError:
            answer = None
        if isinstance(answer, dict):
            error = answer.get("error")
            if isinstance(error, dict):
                raise self._refusal(message, error)
            seq = answer.get("seq")
            if (
                error is None
                and answer.get("stream") == self.stream.name
                and isinstance(seq, int)
                and not isinstance(seq, bool)
            ):
                return answer
        # Something else answers on the subject (a service's own subscriber), or not JetStream.
        excerpt = reply.data[:200].decode("utf-8", "replace")
        raise DeliveryError(
            f"seq {message.seq} ({message.subject}) was answered by something other than stream "
            f"{self.stream.name}'s acknowledgement: {excerpt!r}",
            failure=Failure.WRONG_DESTINATION,
            code="NATS_BAD_ANSWER",
        )

    def _refusal(self, message: _Message, error: dict[str, Any]) -> DeliveryError:
        """What an error answer to one message means (see REFUSED_ERRORS)."""
        err_code = error.get("err_code")
        code = error.get("code") or 0
        text = f"stream {self.stream.name} refused seq {message.seq} ({message.subject})"
        if err_code in REFUSED_ERRORS:
            failure, why = Failure.REFUSED, REFUSED_ERRORS[err_code]
        elif err_code in WRONG_DESTINATION_ERRORS:
            failure, why = Failure.WRONG_DESTINATION, WRONG_DESTINATION_ERRORS[err_code]
        elif isinstance(code, int) and code >= 500:
            failure, why = Failure.UNAVAILABLE, "the stream cannot store it now"
        else:
            failure, why = Failure.WRONG_DESTINATION, "an error serversync does not expect"
        return DeliveryError(
            f"{text}: {why}: {_api_error_text(error)}",
            failure=failure,
            code=f"JS_{err_code or code}",
        )

    async def _no_responders(self, nc: NATS, message: _Message) -> DeliveryError:
        """No stream took the message's subject: the stream is gone or takes other subjects (a
        wrong destination), or it has no leader now (it passes). Its info says which."""
        text = f"no stream took {message.subject} (seq {message.seq})"
        try:
            info = await api_request(
                nc, f"$JS.API.STREAM.INFO.{self.stream.name}", None, min(self._timeout, 5.0)
            )
        except JetStreamError as exc:
            return DeliveryError(f"{text}: {exc}", code="NATS_NO_RESPONDERS")
        error = info.get("error")
        if error is not None and error.get("err_code") == STREAM_NOT_FOUND:
            return DeliveryError(
                f"{text}: stream {self.stream.name} does not exist (deleted since the consumer "
                "started? a restart creates it)",
                failure=Failure.WRONG_DESTINATION,
                code="JS_STREAM_NOT_FOUND",
            )
        if error is not None:
            return DeliveryError(f"{text}: {_api_error_text(error)}", code="NATS_NO_RESPONDERS")
        subjects: list[str] = (info.get("config") or {}).get("subjects") or []
        if not any(subject_matches(pattern, message.subject) for pattern in subjects):
            return DeliveryError(
                f"{text}: stream {self.stream.name} takes only {', '.join(subjects) or 'none'}",
                failure=Failure.WRONG_DESTINATION,
                code="JS_SUBJECT_NOT_TAKEN",
            )
        return DeliveryError(
            f"{text}: stream {self.stream.name} has no leader now", code="NATS_NO_RESPONDERS"
        )


class _Publication:
    """One batch being published on one connection: each message sent at once unless its
    entity has one unacknowledged (then it waits in that entity's queue), each acknowledgement
    awaited for the timeout from its message's sending."""

    def __init__(self, sink: JetStreamSink, link: _Link, messages: list[_Message]) -> None:
        self.sink = sink
        self.link = link
        self.messages = messages
        self.loop = asyncio.get_running_loop()
        self.replies: asyncio.Queue[_Reply] = asyncio.Queue()
        # Sent and not acknowledged yet, in sending order: reply token -> (message, sent at).
        self.unacked: dict[str, tuple[_Message, float]] = {}
        # Each entity with a message unacknowledged -> its later messages of the batch.
        self.held: dict[tuple[str, str], collections.deque[_Message]] = {}
        self.acknowledged = 0
        self.duplicates = 0

    async def run(self) -> int:
        """Publish every message; how many the stream took as duplicates. Raises the first
        failure met."""
        self.link.publications.add(self.replies)
        try:
            for message in self.messages:
                # Acknowledgements that came meanwhile let held messages go first.
                while not self.replies.empty():
                    await self._settle(self.replies.get_nowait())
                later = self.held.get(message.entity)
                if later is not None:
                    later.append(message)
                    continue
                while len(self.unacked) >= MAX_PENDING_ACKS:
                    await self._settle(await self._next_reply())
                self.held[message.entity] = collections.deque()
                await self._send(message)
            while self.unacked:
                await self._settle(await self._next_reply())
        finally:
            self.link.publications.discard(self.replies)
            for token in self.unacked:
                self.link.acks.pop(token, None)
        return self.duplicates

    async def _send(self, message: _Message) -> None:
        trouble = self.link.trouble
        if trouble is not None:
            raise trouble.error()
        token = str(next(self.link.tokens))
        self.link.acks[token] = self.replies
        self.unacked[token] = (message, self.loop.time())
        try:
            await self.link.nc.publish(
                message.subject,
                message.body,
                reply=f"{self.link.inbox}.{token}",
                headers=message.headers,
            )
        except nats.errors.Error as exc:
            raise _connection_error(exc) from None

    async def _next_reply(self) -> _Reply:
        """The next reply, waiting at most until the oldest unacknowledged message's time is
        up."""
        if not self.replies.empty():
            return self.replies.get_nowait()
        message, sent_at = next(iter(self.unacked.values()))
        timeout = self.sink._timeout
        try:
            async with asyncio.timeout(max(0.0, sent_at + timeout - self.loop.time())):
                return await self.replies.get()
        except TimeoutError:
            raise DeliveryError(
                f"stream {self.sink.stream.name} did not acknowledge seq {message.seq} within "
                f"{timeout:g}s of its sending ({self.acknowledged} of the batch's "
                f"{len(self.messages)} messages acknowledged)",
                code="NATS_TIMEOUT",
            ) from None

    async def _settle(self, reply: _Reply) -> None:
        """Take one reply: the acknowledgement of a message (its entity's next message goes
        out), or the DeliveryError it means."""
        if isinstance(reply, _Trouble):
            raise reply.error()
        token, msg = reply
        sent = self.unacked.pop(token, None)
        if sent is None:
            return
        message = sent[0]
        answer = await self.sink._answer(self.link.nc, message, msg)
        self.duplicates += answer.get("duplicate") is True
        self.acknowledged += 1
        if self.acknowledged == len(self.messages) // 2:
            failpoints.reach(MID_BATCH_FAILPOINT)
        later = self.held[message.entity]
        if later:
            await self._send(later.popleft())
        else:
            del self.held[message.entity]


def _first_over(
    limit: int, sizes: list[int], messages: list[_Message]
) -> tuple[int, _Message] | None:
    """The first message whose size is over `limit`, with its size; None when none is."""
    if not sizes or max(sizes) <= limit:
        return None
    return next(
        (size, message) for size, message in zip(sizes, messages, strict=True) if size > limit
    )


def _entry_key(raw: bytes) -> EntryKey:
    """The key of an entry read from its JSON."""
    try:
        entry = orjson.loads(raw)
        return EntryKey(entry["seq"], entry["op"], entry["entityType"], entry["entityId"])
    except orjson.JSONDecodeError:
        # orjson refuses what a payload may hold (an integer over 64 bits, a lone surrogate,
        # deep nesting): the fields are cut out of the entry's text instead, ten times slower,
        # the payload never decoded.
        members = json_members(raw.decode())
        return EntryKey(
            int(members["seq"]),
            orjson.loads(members["op"]),
            orjson.loads(members["entityType"]),
            orjson.loads(members["entityId"]),
        )


def _connection_error(exc: nats.errors.Error) -> DeliveryError:
    if isinstance(exc, nats.errors.MaxPayloadError):
        return DeliveryError(
            f"a message is over the server's max_payload: {_describe(exc)}",
            failure=Failure.REFUSED,
            code="NATS_MAX_PAYLOAD",
        )
    if isinstance(exc, nats.errors.OutboundBufferLimitError):
        return DeliveryError(
            "not connected to NATS (the connection was lost; nothing is held back to send later)",
            code="NATS_CONNECTION",
        )
    return DeliveryError(f"publishing failed: {_describe(exc)}", code="NATS_CONNECTION")


# TLS errors of a connection cut in the handshake, which pass; any other (a certificate that
# does not verify, no common protocol or cipher) is a wrong destination.
_PASSING_TLS_ERRORS = (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError)


def connect_cause(seen: list[Exception], exc: BaseException) -> BaseException:
    """The error that tells why a bounded connection attempt failed: a refusal (login, TLS)
    met on any try, since the server may also reset the socket after refusing and that reset
    says nothing; else the last error the tries met when the bound cut them; else `exc`."""
    for error in reversed(seen):
        if _connect_failure(error)[0] is Failure.WRONG_DESTINATION:
            return error
    if isinstance(exc, TimeoutError) and seen:
        return seen[-1]
    return exc


def _connect_failure(exc: BaseException) -> tuple[Failure, str]:
    """What a failed connection means, and its code: a refused login or a server whose TLS
    certificate does not verify is a wrong destination (as HTTP 401 is); the rest passes."""
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, _PASSING_TLS_ERRORS):
        return Failure.WRONG_DESTINATION, "NATS_TLS"
    text = str(exc).lower()
    if "authorization" in text or "authentication" in text or "permissions" in text:
        return Failure.WRONG_DESTINATION, "NATS_AUTH"
    return Failure.UNAVAILABLE, "NATS_UNREACHABLE"
