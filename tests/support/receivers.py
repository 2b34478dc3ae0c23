"""Receivers on loopback (real aiohttp servers): the ScriptedReceiver, a fake whose answers the
test decides, and the reference receiver with a store that counts what it applied; and requests
signed by hand, as a sender other than the consumer would send them."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from consumer.app.wiring import open_pool
from consumer.receiver.app import build_app
from consumer.receiver.store import EntityStore
from tests.conftest import serve_app

INGEST_PATH = "/api/ingest/sync"


def url_with_password(url: str, password: str, user: str = "sync") -> str:
    """`url` with user:password in it (FRONTEND_BASE_URL may carry them: basic auth)."""
    return url.replace("http://", f"http://{user}:{password}@", 1)


# -- the scripted receiver -----------------------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    """What the scripted receiver answers to one request (a dict body is sent as JSON)."""

    status: int = 200
    body: bytes | dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Attempt:
    """One POST /api/ingest/sync as the scripted receiver saw it."""

    index: int
    # The batch's entries (empty when the body is no JSON this receiver reads), their seqs and
    # payload.caller_number (the tag of a call_logs row).
    entries: list[dict[str, Any]]
    seqs: list[int]
    callers: list[str]
    headers: dict[str, str]
    # When the request arrived: monotonic (for gaps) and wall clock (for HTTP dates).
    arrived: float
    wall: float
    # The request body as sent.
    body: bytes = b""
    # The status answered; None while the request is held or delayed.
    status: int | None = None

    @property
    def key(self) -> str:
        """The request's Idempotency-Key."""
        return self.headers.get("Idempotency-Key", "")


Script = Callable[[Attempt], Reply | Awaitable[Reply | None] | None]


def _entries(body: bytes) -> list[dict[str, Any]]:
    """The entries of a batch body. Python's json, not orjson: it reads every JSON number
    (orjson refuses 1.8e308). A body it cannot read has none."""
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return []
    entries = parsed.get("entries") if isinstance(parsed, dict) else None
    return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []


def _caller(entry: dict[str, Any]) -> str:
    payload = entry.get("payload")
    return str(payload.get("caller_number") if isinstance(payload, dict) else None)


@dataclass
class ScriptedReceiver:
    """A fake receiver that records every request and answers as the test set it up, the first
    rule that applies deciding:

    1. held (hold_next, or hold_from/hold_until by request index) until release(), which lets
       the requests through or answers them 500; then `slow` (by index) and `latency` delay it;
    2. `script(attempt)`, when set, returning a Reply (or None: the rules below decide);
    3. `unavailable`: 503 to every request;
    4. a request holding a caller number in `refuse`: 422, naming it and the answer's number;
       in `conflict`: 409 "already processed";
    5. a body holding any of `refuse_markers` (bytes, matched undecoded): 422;
    6. `fail_remaining` more requests: `fail_status` (500) with `fail_body`;
    7. otherwise 200, accepted.

    An event counts as delivered once a request holding it was answered 2xx (even when the
    client was already gone: a real receiver applies the body it read). Any other path answers
    200 with an HTML page, as a web server would (recorded in `pages`)."""

    script: Script | None = None
    url: str = ""
    attempts: list[Attempt] = field(default_factory=list)
    # Every seq of every 2xx-answered request, duplicates included, in acceptance order; the
    # entries of those requests, and their bodies.
    accepted: list[int] = field(default_factory=list)
    accepted_entries: list[dict[str, Any]] = field(default_factory=list)
    bodies: list[bytes] = field(default_factory=list)
    hold_from: int | None = None
    hold_until: int | None = None
    slow: dict[int, float] = field(default_factory=dict)
    # Random latency of each answer, in seconds (a receiver doing some work).
    latency: tuple[float, float] = (0.0, 0.0)
    unavailable: bool = False
    refuse: set[str] = field(default_factory=set)
    # Added to every refusal's message (a receiver echoing what it was sent, a token say).
    refusal_detail: str = ""
    conflict: set[str] = field(default_factory=set)
    refuse_markers: set[bytes] = field(default_factory=set)
    fail_remaining: int = 0
    fail_status: int = 500
    fail_body: bytes | dict[str, Any] = field(
        default_factory=lambda: {"error": {"code": "SCRIPTED", "message": "try later"}}
    )
    # "METHOD /path" of every request to another path than the ingest route.
    pages: list[str] = field(default_factory=list)
    _waiters: list[asyncio.Future[bool]] = field(default_factory=list)

    # -- what arrived

    @property
    def seen(self) -> int:
        """How many requests arrived so far."""
        return len(self.attempts)

    @property
    def statuses(self) -> list[int | None]:
        """The status answered to each request, in order (None: not answered yet)."""
        return [a.status for a in self.attempts]

    @property
    def held(self) -> int:
        """How many requests are held right now."""
        return sum(1 for w in self._waiters if not w.done())

    @property
    def delivered(self) -> set[int]:
        """Every seq accepted at least once."""
        return set(self.accepted)

    def accepted_callers(self) -> list[str]:
        """caller_number of every accepted entry, in arrival order, duplicates included."""
        return [_caller(e) for e in self.accepted_entries]

    def duplicates(self) -> Counter[int]:
        """seq -> how many extra times it was accepted."""
        return Counter({s: n - 1 for s, n in Counter(self.accepted).items() if n > 1})

    def gaps(self) -> list[float]:
        """Seconds between consecutive requests' arrivals."""
        return [b.arrived - a.arrived for a, b in itertools.pairwise(self.attempts)]

    def with_password(self, password: str, user: str = "sync") -> str:
        """The base URL with user:password in it."""
        return url_with_password(self.url, password, user)

    # -- steering it

    def hold_next(self, count: int | None = None) -> None:
        """Hold the next `count` requests (every request from now on when None)."""
        self.hold_from = self.seen
        self.hold_until = None if count is None else self.seen + count

    def release(self, *, accept: bool = True) -> None:
        """Let every held request proceed (or answer them 500: `accept=False`), and hold no new
        ones."""
        self.hold_from = self.hold_until = None
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(accept)
        self._waiters.clear()

    def fail_next(self, count: int) -> None:
        """Answer the next `count` requests (that no earlier rule decides) with fail_status."""
        self.fail_remaining = count

    # -- answering

    def _should_hold(self, index: int) -> bool:
        if self.hold_from is None or index < self.hold_from:
            return False
        return self.hold_until is None or index < self.hold_until

    async def _decide(self, attempt: Attempt) -> Reply:
        if self.script is not None:
            scripted = self.script(attempt)
            reply = scripted if scripted is None or isinstance(scripted, Reply) else await scripted
            if reply is not None:
                return reply
        callers = set(attempt.callers)
        if self.unavailable:
            return Reply(503, {"error": {"code": "DOWN", "message": "unavailable"}})
        if refused := sorted(callers & self.refuse):
            message = f"refused {refused[0]} (answer {attempt.index + 1})"
            if self.refusal_detail:
                message += f" {self.refusal_detail}"
            return Reply(422, {"error": {"code": "REFUSED", "message": message}})
        if callers & self.conflict:
            return Reply(409, {"error": {"code": "ALREADY", "message": "already processed"}})
        if any(marker in attempt.body for marker in self.refuse_markers):
            return Reply(422, {"error": {"code": "REFUSED", "message": "this entry is refused"}})
        if self.fail_remaining > 0:
            self.fail_remaining -= 1
            return Reply(self.fail_status, self.fail_body)
        count = len(attempt.entries)
        return Reply(200, {"ok": True, "received": count, "applied": count})

    async def handle(self, request: web.Request) -> web.Response:
        """POST /api/ingest/sync."""
        body = await request.read()
        entries = _entries(body)
        attempt = Attempt(
            index=self.seen,
            entries=entries,
            seqs=[int(e["seq"]) for e in entries],
            callers=[_caller(e) for e in entries],
            headers=dict(request.headers),
            arrived=time.monotonic(),
            wall=time.time(),
            body=body,
        )
        self.attempts.append(attempt)
        accept = True
        if self._should_hold(attempt.index):
            waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            accept = await waiter
        if attempt.index in self.slow:
            await asyncio.sleep(self.slow[attempt.index])  # a slow receiver, not waiting until
        low, high = self.latency
        if high > 0:
            await asyncio.sleep(random.uniform(low, high))  # simulated work, not waiting until
        reply = await self._decide(attempt) if accept else Reply(500)
        attempt.status = reply.status
        if 200 <= reply.status < 300:
            self.accepted.extend(attempt.seqs)
            self.accepted_entries.extend(entries)
            self.bodies.append(body)
        out = reply.body if reply.body is not None else {"error": {"code": "SCRIPTED"}}
        return web.Response(
            status=reply.status,
            body=out if isinstance(out, bytes) else orjson.dumps(out),
            content_type="application/json",
            headers=reply.headers,
        )

    async def page(self, request: web.Request) -> web.Response:
        """Any other path: a web page, not the receiver's answer."""
        self.pages.append(f"{request.method} {request.path}")
        return web.Response(text="<html>Welcome</html>", content_type="text/html")


@contextlib.asynccontextmanager
async def scripted_receiver(
    script: Script | None = None, *, port: int = 0
) -> AsyncIterator[ScriptedReceiver]:
    """A ScriptedReceiver on 127.0.0.1 (`port`, or a free one) until the block ends."""
    receiver = ScriptedReceiver(script)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post(INGEST_PATH, receiver.handle)
    app.router.add_route("*", "/{path:.*}", receiver.page)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    receiver.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        yield receiver
    finally:
        # Held requests must end before the server can shut down.
        receiver.release()
        await runner.cleanup()


# -- the reference receiver, with a counting store -----------------------------------------------


class CountingStore(EntityStore):
    """The receiver's real store; it also keeps how many entities each request changed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.applied: list[int] = []

    async def apply(self, body: bytes, entries: Sequence[Mapping[str, Any]] = ()) -> int:
        """EntityStore.apply, recorded."""
        changed = await super().apply(body, entries)
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


# -- requests sent by hand -----------------------------------------------------------------------


def wire_body(entity_id: str, seq: int = 1) -> bytes:
    """A batch of one call_log upsert, as the consumer would send it."""
    entry = {
        "entityType": "call_log",
        "entityId": entity_id,
        "op": "upsert",
        "seq": seq,
        "payload": {"id": entity_id},
    }
    return orjson.dumps({"entries": [entry]})


async def post_signed(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str]
) -> tuple[int, str, dict[str, Any]]:
    """POST `body` to the receiver at `url` with `headers` (the signature's, or none): the status,
    the content type and the JSON answer."""
    async with session.post(
        url + INGEST_PATH, data=body, headers={"Content-Type": "application/json", **headers}
    ) as response:
        return response.status, response.content_type, orjson.loads(await response.read())
