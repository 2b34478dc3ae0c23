"""Helpers for the failure-policy tests: a scripted receiver (a real aiohttp server on loopback)
whose answer to each request is decided by a script, the reference receiver with a shared secret
and a counting store, `serversync ingest-server` as a subprocess, and secrets to leak."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from consumer.app.wiring import open_pool
from consumer.receiver.app import build_app
from consumer.receiver.store import EntityStore
from tests.conftest import fetch_all, serve_app

ROOT = Path(__file__).resolve().parent.parent
CONSUMER = "frontend-sync"
INGEST_PATH = "/api/ingest/sync"


# -- the scripted receiver ----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the scripted receiver answers to one request."""

    status: int = 200
    body: bytes | dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Attempt:
    """One request as the scripted receiver saw it."""

    index: int
    seqs: list[int]
    # payload.caller_number of every entry (the tag of a call_logs row).
    callers: list[str]
    headers: dict[str, str]
    # When the request arrived: monotonic (for gaps) and wall clock (for HTTP dates).
    arrived: float
    wall: float
    # The request body as sent.
    body: bytes = b""
    status: int = 0


Script = Callable[[Attempt], Reply | None]


@dataclass
class ScriptedReceiver:
    """Records every request; `script(attempt)` decides the answer (None: 200, accepted).

    An event counts as delivered when a request holding it was answered 2xx."""

    script: Script | None = None
    url: str = ""
    attempts: list[Attempt] = field(default_factory=list)
    # Every seq of every 2xx-answered request, duplicates included, in order.
    accepted: list[int] = field(default_factory=list)

    @property
    def statuses(self) -> list[int]:
        """The status answered to each request, in order."""
        return [a.status for a in self.attempts]

    def gaps(self) -> list[float]:
        """Seconds between consecutive requests' arrivals."""
        times = [a.arrived for a in self.attempts]
        return [b - a for a, b in itertools.pairwise(times)]

    def duplicates(self) -> Counter[int]:
        """seq -> how many extra times it was accepted."""
        return Counter({s: n - 1 for s, n in Counter(self.accepted).items() if n > 1})

    async def handle(self, request: web.Request) -> web.Response:
        """POST /api/ingest/sync."""
        body = await request.read()
        entries: list[dict[str, Any]] = orjson.loads(body)["entries"]
        attempt = Attempt(
            index=len(self.attempts),
            seqs=[int(e["seq"]) for e in entries],
            callers=[str(e["payload"].get("caller_number")) for e in entries],
            headers=dict(request.headers),
            arrived=time.monotonic(),
            wall=time.time(),
            body=body,
        )
        self.attempts.append(attempt)
        reply = (self.script(attempt) if self.script is not None else None) or Reply(
            200, {"ok": True, "received": len(entries), "applied": len(entries)}
        )
        attempt.status = reply.status
        if 200 <= reply.status < 300:
            self.accepted.extend(attempt.seqs)
        body_out = reply.body if reply.body is not None else {"error": {"code": "SCRIPTED"}}
        return web.Response(
            status=reply.status,
            body=body_out if isinstance(body_out, bytes) else orjson.dumps(body_out),
            content_type="application/json",
            headers=reply.headers,
        )


@contextlib.asynccontextmanager
async def serve_scripted_receiver(
    script: Script | None = None, *, port: int = 0
) -> AsyncIterator[ScriptedReceiver]:
    """A ScriptedReceiver on 127.0.0.1 (`port`, or a free one) until the block ends."""
    receiver = ScriptedReceiver(script)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post(INGEST_PATH, receiver.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    receiver.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield receiver
    finally:
        await runner.cleanup()


# -- the reference receiver, signed, with a counting store ---------------------------------------


class CountingStore(EntityStore):
    """The receiver's real store; it also keeps how many entities each request changed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied: list[int] = []

    async def apply(self, body: bytes) -> int:
        """EntityStore.apply, recorded."""
        changed = await super().apply(body)
        self.applied.append(changed)
        return changed


@contextlib.asynccontextmanager
async def serve_reference_receiver(
    receiver_dsn: str, *, shared_secret: str | None = None
) -> AsyncIterator[tuple[str, CountingStore]]:
    """build_app(..., shared_secret=...) on a free loopback port: (base URL, its store)."""
    async with open_pool(receiver_dsn, "test-ingest", max_size=4) as pool:
        store = CountingStore(pool)
        app = build_app(store, max_body_bytes=1024 * 1024, shared_secret=shared_secret)
        async with serve_app(app) as url:
            yield url, store


# -- the backend side ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Parked:
    """One row of sync.dlq_messages."""

    seq: int
    entity_id: str
    caller: str
    error_code: str
    error_message: str
    status: str
    retry_count: int
    id: str
    created_at: Any


async def dlq(dsn: str) -> list[Parked]:
    """Every parked event of the consumer, by seq."""
    rows = await fetch_all(
        dsn,
        "SELECT seq, entity_id, payload->>'caller_number', error_code, error_message, status, "
        "retry_count, id::text, created_at FROM sync.dlq_messages WHERE consumer = %s "
        "ORDER BY seq",
        (CONSUMER,),
    )
    return [Parked(*row) for row in rows]


async def committed_position(dsn: str) -> tuple[int, int]:
    """(txid, seq) the consumer committed."""
    rows = await fetch_all(
        dsn,
        "SELECT last_txid::text, last_seq FROM sync.consumer_offsets WHERE consumer = %s",
        (CONSUMER,),
    )
    return (int(rows[0][0]), int(rows[0][1])) if rows else (0, 0)


async def seqs_by_caller(dsn: str) -> dict[str, int]:
    """caller_number -> seq of its call_logs event."""
    rows = await fetch_all(
        dsn, "SELECT payload->>'caller_number', seq FROM sync.events_outbox ORDER BY seq"
    )
    return {str(caller): int(seq) for caller, seq in rows}


# -- `serversync ingest-server` as a process ------------------------------------------------------


@contextlib.asynccontextmanager
async def reaped(process: asyncio.subprocess.Process) -> AsyncIterator[None]:
    """Kill the process if the block leaves it running (a failed test)."""
    try:
        yield
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            await process.wait()


# -- secrets -------------------------------------------------------------------------------------

GITHUB_TOKEN = "ghp_" + "Gh7TokenBody0123456789abcdefGHIJKLmn"
AWS_KEY = "AKIA" + "QX7ZL2M4N6P8R0TV"
ANTHROPIC_KEY = "sk-ant-api03-Anthr0picKeyBody-xyz987"
BEARER_TOKEN = "eyJhbGciOiJIUzI1NiJ9.QmVhcmVyQm9keQ.S1gnatur3Part"  # noqa: S105 - made up
URL_PASSWORD = "UrlPa55wordZz"  # noqa: S105 - made up
DSN_PASSWORD = "DsnPa55wordYy"  # noqa: S105 - made up
API_KEY = "ApiKeyValue7788Qq"
KEY_MATERIAL = "MIIEowIBAAKCAQEAk3yMaterialLine1"
KEY_MATERIAL_2 = "Qm9ndXNLZXlNYXRlcmlhbExpbmUy"

SECRET_LINES = {
    "bearer": f"Authorization: Bearer {BEARER_TOKEN}",
    "url": f"https://svc-user:{URL_PASSWORD}@api.example.com/v1",
    "dsn": f"host=db.internal user=sync password={DSN_PASSWORD} dbname=app",
    "api_key": f"api_key={API_KEY}",
    "github": f"token was {GITHUB_TOKEN}",
    "aws": f"aws access key {AWS_KEY}",
    "anthropic": f"key {ANTHROPIC_KEY}",
    "private_key": (
        "-----BEGIN RSA PRIVATE KEY-----\n"
        f"{KEY_MATERIAL}\n{KEY_MATERIAL_2}\n"
        "-----END RSA PRIVATE KEY-----"
    ),
}

# What must never appear: the secret part of each line (not its harmless prefix).
SECRET_VALUES = [
    BEARER_TOKEN,
    URL_PASSWORD,
    DSN_PASSWORD,
    API_KEY,
    GITHUB_TOKEN.removeprefix("ghp_"),
    AWS_KEY.removeprefix("AKIA"),
    ANTHROPIC_KEY.removeprefix("sk-ant-api03-"),
    KEY_MATERIAL,
    KEY_MATERIAL_2,
]


def leaks(text: str, window: int = 8) -> list[str]:
    """Every secret of which `text` holds `window` or more consecutive characters (a truncated
    secret is still a leak)."""
    found = []
    for secret in SECRET_VALUES:
        pieces = {secret[i : i + window] for i in range(len(secret) - window + 1)}
        if any(piece in text for piece in pieces):
            found.append(secret)
    return found
