"""What every HTTP sink shares: the client session and turning responses into outcomes."""

from __future__ import annotations

import contextlib
import email.utils
import functools
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import aiohttp
import orjson
from aiohttp.client import _RequestContextManager
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind
from yarl import URL

from consumer.core.events import DeliveryError, Failure, Outcome
from consumer.observability.instruments import tracer
from consumer.observability.redact import mask_secrets, safe_error
from consumer.wire.contract import (
    DELIVERED_CONFLICT,
    RETRY_AFTER_STATUSES,
    UNAVAILABLE_4XX,
    WRONG_DESTINATION_4XX,
)


class HttpSink:
    """The part every HTTP sink shares: one client session, opened by start(), closed by
    close(), with the delivery timeout."""

    def __init__(self, timeout_sec: float) -> None:
        self._timeout = timeout_sec
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        """Open the HTTP session."""
        self._session = client_session(self._timeout)

    async def close(self) -> None:
        """Close the HTTP session."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        """The open session (start() first)."""
        assert self._session is not None, "start() first"
        return self._session

    def post(self, url: str, **kwargs: Any) -> _RequestContextManager:
        """POST with redirects off, for every sink: aiohttp would follow a 301/302 as a GET
        (the events go nowhere while the GET's 200 reads as delivered) and send the signature
        headers to the redirect's host. A 3xx is answered as a wrong destination instead."""
        return self.session.post(url, allow_redirects=False, **kwargs)


def client_session(timeout_sec: float) -> aiohttp.ClientSession:
    """A session with the delivery timeout and a connection pool sized for one consumer."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_sec),
        connector=aiohttp.TCPConnector(limit=16, keepalive_timeout=30),
        headers={"User-Agent": "serversync"},
    )


@functools.lru_cache(maxsize=64)
def _span_naming(method: str, url: str) -> tuple[str, Mapping[str, str]]:
    # A sink posts to one URL: parse and redact it once, not once per batch (read-only, as it
    # is shared by every span of that URL).
    return f"{method} {URL(url).path}", MappingProxyType(
        {
            "http.request.method": method,
            # Semantic conventions: credentials in url.full must be redacted.
            "url.full": mask_secrets(url),
        }
    )


@contextlib.contextmanager
def client_span(method: str, url: str, headers: dict[str, str]) -> Iterator[Span]:
    """A client span for one HTTP call, its context put into `headers` (W3C traceparent) so the
    receiver's span joins the same trace. A failure marks the span as an error."""
    name, attributes = _span_naming(method, url)
    with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes) as span:
        propagate.inject(headers)
        yield span


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds: either delta-seconds or an HTTP date."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):
        return None


# The most of an answer a sink reads: a receiver's answer is a small JSON object, and an error
# page of any size must not cost the consumer its memory.
MAX_ANSWER_BYTES = 64 * 1024


def failure_of(status: int) -> Failure | None:
    """What a status means for the events sent: None when they are delivered (2xx, and 409,
    "already processed"), else the kind of failure."""
    if 200 <= status < 300 or status == DELIVERED_CONFLICT:
        return None
    if status >= 500 or status in UNAVAILABLE_4XX:
        return Failure.UNAVAILABLE
    if status < 400 or status in WRONG_DESTINATION_4XX:
        # 3xx: redirects are never followed (a POST would become a GET, and the signature
        # would go to another host), so a redirect means the base URL is wrong.
        return Failure.WRONG_DESTINATION
    return Failure.REFUSED


async def read_capped(response: aiohttp.ClientResponse, limit: int = MAX_ANSWER_BYTES) -> bytes:
    """At most `limit` bytes of the answer's body, and one more if there is more."""
    chunks: list[bytes] = []
    size = 0
    while size <= limit:
        chunk = await response.content.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class Answer:
    """A receiver's answer that delivered the events: Outcome.DELIVERED, or
    Outcome.ALREADY_PROCESSED (a 409), and its JSON object (for a 409, whatever object it sent,
    or an empty one)."""

    outcome: Outcome
    body: dict[str, Any]


async def answer_of(
    response: aiohttp.ClientResponse,
    what: str,
    is_receivers_answer: Callable[[dict[str, Any]], bool],
) -> Answer:
    """The answer of a request that delivered the events, or DeliveryError.

    A 2xx counts only when its body is the receiver's JSON answer (`is_receivers_answer`): a
    proxy's or a login page's 200 means the events went nowhere.
    """
    status = response.status
    trace.get_current_span().set_attribute("http.response.status_code", status)
    failure = failure_of(status)
    body = await read_capped(response)
    if failure is None:
        if status == DELIVERED_CONFLICT:
            return Answer(Outcome.ALREADY_PROCESSED, _json_object(body) or {})
        answer = _json_object(body) if len(body) <= MAX_ANSWER_BYTES else None
        if answer is not None and is_receivers_answer(answer):
            return Answer(Outcome.DELIVERED, answer)
        raise DeliveryError(
            f"{what} answered HTTP {status} without the receiver's JSON answer: {_excerpt(body)}",
            failure=Failure.WRONG_DESTINATION,
            code="BAD_RESPONSE",
        )
    location = response.headers.get("Location")
    where = (
        f" to {mask_secrets(location)[:200]}"
        if failure is Failure.WRONG_DESTINATION and location
        else ""
    )
    raise DeliveryError(
        f"{what} answered HTTP {status}{where}: {_excerpt(body)}",
        failure=failure,
        code=f"HTTP_{status}",
        # The receiver's word on when to come back, where it may give one: busy, or down.
        retry_after=(
            parse_retry_after(response.headers.get("Retry-After"))
            if status in RETRY_AFTER_STATUSES
            else None
        ),
    )


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


# How much of an answer's body is read for its excerpt: room for any secret that starts in the
# first 300 characters (a private key is under 4 KiB).
EXCERPT_SCAN_BYTES = 8192


def _excerpt(body: bytes) -> str:
    """The start of a body, fit for a log line and the dead-letter queue."""
    # Only the start is kept, so only the start is masked; masked before it is cut to its final
    # length, so a secret that crosses the 300th character is still masked whole.
    text = body[:EXCERPT_SCAN_BYTES].decode("utf-8", errors="replace")
    return safe_error(" ".join(text.split()))[:300]
