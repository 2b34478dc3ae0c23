"""Several batches in flight (SYNC_MAX_IN_FLIGHT): while a backlog drains, the next batch goes out
before the one before it is answered, yet the offset only ever moves in order, and a receiver that
sees an older batch after a newer one (a retry) still ends in the newest state.

Real PostgreSQL, the reference receiver on loopback, and a middleware in front of it that holds
or refuses chosen requests; every wait is a wait_until with a deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson
import pytest
from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from consumer.core.events import Batch, Outcome
from tests.conftest import (
    fetch_all,
    make_settings,
    running_consumer,
    serve_receiver,
    wait_until,
)
from tests.support.backend import committed_position, insert_calls
from tests.support.runtime import running_runtime, store_of
from tests.support.waiting import wait_caught_up

BATCH = 100


@dataclass
class Gate:
    """Counts the ingest requests in flight at the receiver; `decide(n)` may hold request n
    (0-based, by arrival) or answer it itself instead of letting the receiver apply it."""

    decide: Callable[[int], Awaitable[web.Response | None]]
    arrived: int = 0
    in_flight: int = 0
    most_in_flight: int = 0
    # min seq of each request applied (answered 2xx by the receiver), in the order applied.
    applied: list[int] = field(default_factory=list)

    def middleware(self) -> Middleware:
        @web.middleware
        async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
            index = self.arrived
            self.arrived += 1
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
            try:
                answer = await self.decide(index)
                if answer is not None:
                    return answer
                response = await handler(request)
                if response.status < 300:
                    entries = orjson.loads(await request.read())["entries"]
                    self.applied.append(min(int(e["seq"]) for e in entries))
                return response
            finally:
                self.in_flight -= 1

        return gate


async def stays(check: Callable[[], Awaitable[bool]], seconds: float) -> bool:
    """Whether `check` holds at every look for `seconds` (polled every 20 ms until the deadline)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not await check():
            return False
        await asyncio.sleep(0.02)  # poll interval of a bounded watch, not a synchronisation
    return await check()


async def test_the_offset_never_passes_an_older_batch_still_in_flight(
    backend_dsn: str, receiver_dsn: str
) -> None:
    """With two in flight, the second batch is answered while the first is held: the offset stays
    before both, no third request goes out, and once the first is answered every batch commits."""
    await insert_calls(backend_dsn, 5 * BATCH, tag="held")
    release = asyncio.Event()

    async def decide(index: int) -> web.Response | None:
        if index == 0:
            await release.wait()
        return None

    gate = Gate(decide)
    async with (
        serve_receiver(receiver_dsn, middlewares=[gate.middleware()]) as url,
        running_consumer(
            make_settings(backend_dsn, url, SYNC_BATCH_SIZE=BATCH, SYNC_MAX_IN_FLIGHT=2)
        ) as runtime,
    ):
        await wait_until(
            lambda: len(gate.applied) == 1, timeout=10, what="the second batch applied"
        )
        assert gate.most_in_flight == 2

        async def nothing_committed() -> bool:
            return await committed_position(backend_dsn) == (0, 0)

        assert await stays(nothing_committed, 0.5), "the offset passed a batch still in flight"
        assert gate.arrived == 2, "a third batch went out while the window was full"
        release.set()
        await wait_caught_up(backend_dsn)
    assert gate.most_in_flight == 2
    assert runtime.stats.delivered_events == 5 * BATCH
    assert runtime.stats.delivered_batches == 5
    rows = await fetch_all(receiver_dsn, "SELECT count(*) FROM ingest.entities")
    assert rows[0][0] == 5 * BATCH


async def test_an_older_batch_retried_after_a_newer_one_leaves_the_newest_state(
    backend_dsn: str, receiver_dsn: str
) -> None:
    """Batch 1 holds the inserts of 100 calls, batch 2 their updates. The receiver applies batch 2
    first and refuses batch 1 with a 503 until then; the retried batch 1 arrives last and, thanks
    to the receiver's version guard, changes nothing: every call ends in its updated state."""
    await insert_calls(backend_dsn, BATCH, tag="ooo")
    await fetch_all(
        backend_dsn,
        "UPDATE call_logs SET summary = 'updated' WHERE caller_number LIKE 'ooo-%' RETURNING 1",
    )
    newer_applied = asyncio.Event()

    async def decide(index: int) -> web.Response | None:
        if index == 0:
            await newer_applied.wait()
            return web.json_response({"error": {"code": "BUSY"}}, status=503)
        return None

    gate = Gate(decide)
    original = gate.middleware()

    @web.middleware
    async def note_newer(request: web.Request, handler: Handler) -> web.StreamResponse:
        response = await original(request, handler)
        if gate.applied:
            newer_applied.set()
        return response

    async with (
        serve_receiver(receiver_dsn, middlewares=[note_newer]) as url,
        running_consumer(
            make_settings(
                backend_dsn,
                url,
                SYNC_BATCH_SIZE=BATCH,
                SYNC_MAX_IN_FLIGHT=2,
                SYNC_RETRY_INITIAL_SEC=0.05,
            )
        ) as runtime,
    ):
        await wait_caught_up(backend_dsn)
    first_seq = (await fetch_all(backend_dsn, "SELECT min(seq) FROM sync.events_outbox"))[0][0]
    assert gate.applied == [first_seq + BATCH, first_seq], "batch 2 first, then batch 1's retry"
    assert runtime.stats.retries == 1
    assert runtime.stats.parked_events == 0
    states = await fetch_all(
        receiver_dsn, "SELECT entity_id, seq, payload->>'summary' FROM ingest.entities"
    )
    newest = await fetch_all(
        backend_dsn, "SELECT entity_id, max(seq) FROM sync.events_outbox GROUP BY entity_id"
    )
    assert len(states) == BATCH
    assert {summary for _, _, summary in states} == {"updated"}
    assert {entity: seq for entity, seq, _ in states} == dict(newest)


async def test_one_in_flight_is_one_batch_at_a_time(backend_dsn: str, receiver_dsn: str) -> None:
    """SYNC_MAX_IN_FLIGHT=1: the next batch is read ahead but never sent before the last one is
    answered and committed."""
    await insert_calls(backend_dsn, 4 * BATCH, tag="one")
    gate = Gate(_pass)
    async with (
        serve_receiver(receiver_dsn, middlewares=[gate.middleware()]) as url,
        running_consumer(
            make_settings(backend_dsn, url, SYNC_BATCH_SIZE=BATCH, SYNC_MAX_IN_FLIGHT=1)
        ),
    ):
        await wait_caught_up(backend_dsn)
    assert gate.arrived == 4
    assert gate.most_in_flight == 1
    assert gate.applied == sorted(gate.applied)


async def _pass(index: int) -> web.Response | None:
    return None


class _HeldSink:
    """Holds its first delivery until released; delivers every other at once."""

    name = "held"

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.deliveries = 0

    async def start(self) -> None:
        """Nothing to start."""

    async def deliver(self, batch: Batch) -> Outcome:
        """Hold the first batch, then accept."""
        self.deliveries += 1
        if self.deliveries == 1:
            await self.release.wait()
        return Outcome.DELIVERED

    async def close(self) -> None:
        """Nothing to close."""


@pytest.mark.parametrize("read_ahead", [True, False], ids=["read-ahead", "no-read-ahead"])
async def test_read_ahead_reads_the_next_batch_while_a_full_one_is_delivered(
    backend_dsn: str, read_ahead: bool
) -> None:
    """SYNC_READ_AHEAD: after a full read, the next batch is read while that one is delivered
    (one in flight, so it is not sent yet); without it, nothing is read until the delivery
    ends."""
    await insert_calls(backend_dsn, 3 * 7, tag="ahead")
    sink = _HeldSink()
    async with running_runtime(
        backend_dsn, sink, SYNC_MAX_IN_FLIGHT=1, SYNC_READ_AHEAD=str(read_ahead).lower()
    ) as runtime:
        store = store_of(runtime)
        await wait_until(lambda: sink.deliveries == 1, what="the first batch held")
        if read_ahead:
            await wait_until(lambda: store.reads >= 2, what="the next batch read ahead")
        else:
            assert await stays(_constant(lambda: store.reads == 1), 0.3), store.reads
        assert sink.deliveries == 1  # one in flight: read, not sent
        sink.release.set()
        await wait_caught_up(backend_dsn)
    assert runtime.stats.delivered_events == 3 * 7


def _constant(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def checked() -> bool:
        return check()

    return checked
