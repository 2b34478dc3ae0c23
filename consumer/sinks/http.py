"""What every HTTP sink shares: the client session and turning responses into outcomes."""

from __future__ import annotations

import contextlib
import email.utils
import functools
import time
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import aiohttp
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind
from yarl import URL

from consumer.events import DeliveryError
from consumer.instruments import tracer
from consumer.redact import mask_secrets


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
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# What an answer means (seed 001): 409 says "already processed", the rest of 4xx refuses the
# content itself (retrying cannot help), 5xx, 408, 425 and 429 are passing trouble.
DELIVERED_CONFLICT = 409
RETRYABLE_4XX = frozenset({408, 425, 429})


async def raise_for_outcome(response: aiohttp.ClientResponse, what: str) -> str:
    """ "delivered" or "conflict_processed"; DeliveryError (retryable or not) for the rest."""
    status = response.status
    trace.get_current_span().set_attribute("http.response.status_code", status)
    if 200 <= status < 300:
        return "delivered"
    if status == DELIVERED_CONFLICT:
        return "conflict_processed"
    # Masked before it is cut short: a secret cut in two would escape its pattern.
    body = mask_secrets(" ".join((await response.text(errors="replace")).split()))[:300]
    retryable = status >= 500 or status in RETRYABLE_4XX or status < 400
    raise DeliveryError(
        f"{what} answered HTTP {status}: {body}",
        retryable=retryable,
        code=f"HTTP_{status}",
        retry_after=parse_retry_after(response.headers.get("Retry-After")),
    )
