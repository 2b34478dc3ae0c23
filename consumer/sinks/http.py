"""What every HTTP sink shares: the client session and turning responses into outcomes."""

from __future__ import annotations

import email.utils
import time

import aiohttp

from consumer.events import DeliveryError


def client_session(timeout_sec: float) -> aiohttp.ClientSession:
    """A session with the delivery timeout and a connection pool sized for one consumer."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_sec),
        connector=aiohttp.TCPConnector(limit=16, keepalive_timeout=30),
        headers={"User-Agent": "serversync"},
    )


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


async def raise_for_outcome(response: aiohttp.ClientResponse, what: str) -> None:
    """Raise DeliveryError for anything but a 2xx answer."""
    if 200 <= response.status < 300:
        return
    body = (await response.text(errors="replace"))[:300]
    raise DeliveryError(
        f"{what} answered HTTP {response.status}: {body}",
        retry_after=parse_retry_after(response.headers.get("Retry-After")),
    )
