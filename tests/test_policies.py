"""The runtime's pure policies, without a database or a network: retry delays, read pacing, what
a receiver's HTTP answer means for the events, and how a refused batch is narrowed down to the
events the receiver refuses."""

from __future__ import annotations

import asyncio
import email.utils
import time
from collections.abc import Mapping
from typing import Any, cast

import aiohttp
import orjson
import pytest

from consumer.app.settings import runtime_config
from consumer.core.events import Batch, DeliveryError, Failure, Outcome, Position
from consumer.observability.redact import mask_secrets
from consumer.runtime.backoff import (
    RETRY_AFTER_CEILING_SEC,
    RETRY_AFTER_FLOOR_SEC,
    Backoff,
    retry_delay,
)
from consumer.runtime.pacing import ReadPacer
from consumer.runtime.settle import Settled, Settler
from consumer.runtime.stats import RuntimeStats
from consumer.runtime.steps import Steps
from consumer.sinks.frontend_sync import is_sync_answer
from consumer.sinks.http import MAX_ANSWER_BYTES, Answer, answer_of
from consumer.store.outbox import OutboxStore
from tests.conftest import make_settings

# -- backoff -------------------------------------------------------------------------------------


def test_backoff_doubles_from_initial_up_to_the_cap() -> None:
    backoff = Backoff(2.0, 20.0, jitter=0)
    assert [backoff.next_delay() for _ in range(6)] == [2.0, 4.0, 8.0, 16.0, 20.0, 20.0]
    assert backoff.attempts == 6


def test_backoff_tells_the_upcoming_delay_without_counting_an_attempt() -> None:
    backoff = Backoff(1.0, 8.0, jitter=0.5)
    assert [backoff.upcoming(), backoff.upcoming()] == [1.0, 1.0]
    assert backoff.attempts == 0
    backoff.next_delay()
    assert (backoff.upcoming(), backoff.attempts) == (2.0, 1)


def test_backoff_stays_at_the_cap_after_very_many_failures() -> None:
    backoff = Backoff(0.2, 10.0, jitter=0)
    for _ in range(5000):
        delay = backoff.next_delay()
    assert delay == 10.0


def test_backoff_jitter_stays_within_its_fraction_and_spreads_the_delays() -> None:
    delays = []
    for _ in range(300):
        backoff = Backoff(1.0, 8.0, jitter=0.1)
        delays.append(backoff.next_delay())
    assert all(0.9 <= delay <= 1.1 for delay in delays)
    # Two consumers failing together must not retry in lockstep.
    assert len(set(delays)) > 100
    capped = Backoff(1.0, 8.0, jitter=0.1)
    assert all(capped.next_delay() <= 8.0 * 1.1 for _ in range(50))


def test_backoff_reset_starts_again_from_initial() -> None:
    backoff = Backoff(0.5, 60.0, jitter=0)
    for _ in range(5):
        backoff.next_delay()
    backoff.reset()
    assert backoff.attempts == 0
    assert backoff.next_delay() == 0.5


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_backoff_refuses_a_shape_that_would_busy_loop_or_shrink(
    initial: float, maximum: float
) -> None:
    with pytest.raises(ValueError, match="initial"):
        Backoff(initial, maximum)


# -- retry_delay: the receiver's Retry-After ----------------------------------------------------


@pytest.mark.parametrize(
    ("retry_after", "expected"),
    [
        (0.0, RETRY_AFTER_FLOOR_SEC),
        (0.1, RETRY_AFTER_FLOOR_SEC),
        (0.5, 0.5),
        (42.0, 42.0),
        (3600.0, 3600.0),
        (7 * 86400.0, RETRY_AFTER_CEILING_SEC),
    ],
)
def test_retry_after_is_taken_within_half_a_second_and_an_hour(
    retry_after: float, expected: float
) -> None:
    assert (RETRY_AFTER_FLOOR_SEC, RETRY_AFTER_CEILING_SEC) == (0.5, 3600.0)
    assert retry_delay(Backoff(100.0, 200.0), retry_after) == expected


def test_without_retry_after_the_backoff_decides_and_a_retry_after_still_counts_the_attempt() -> (
    None
):
    backoff = Backoff(1.0, 100.0, jitter=0)
    assert retry_delay(backoff, None) == 1.0
    assert retry_delay(backoff, 30.0) == 30.0
    # The attempt answered with Retry-After counted: the next backoff delay has grown on.
    assert retry_delay(backoff, None) == 4.0


# -- read pacing ---------------------------------------------------------------------------------


def test_pacing_starts_above_the_rate_and_stops_once_traffic_slows() -> None:
    pacer = ReadPacer(wait=0.02, min_rate=2000)
    assert pacer.window == 0.1
    # 5,000 events/s in batches of 50 every 10 ms: paced.
    for step in range(10):
        pacer.observe(50, now=step * 0.01)
    assert pacer.pause(now=0.1) == 0.02
    # The batches the waits made bigger do not keep it going: at 500 events/s (25 every 50 ms),
    # pacing ends once the fast reads have left the window.
    now = 0.1
    for _ in range(4):
        now += 0.05
        pacer.observe(25, now=now)
    assert pacer.rate(now=now) <= 750  # the last 100 ms: two or three of the slow reads
    assert pacer.pause(now=now) == 0.0


def test_pacing_ends_when_traffic_stops() -> None:
    pacer = ReadPacer(wait=0.05, min_rate=100)
    pacer.observe(1000, now=10.0)
    assert pacer.pause(now=10.0) == 0.05
    # One window (5 waits) later the burst is forgotten: the next event is read at once.
    assert pacer.pause(now=10.0 + pacer.window) == 0.0


def test_one_burst_below_the_rate_is_not_paced() -> None:
    pacer = ReadPacer(wait=0.4, min_rate=1000)
    assert pacer.window == 2.0
    pacer.observe(1500, now=0.0)  # 750 events/s over the window
    assert pacer.pause(now=0.0) == 0.0


def test_no_pacing_when_the_wait_is_zero() -> None:
    pacer = ReadPacer(wait=0, min_rate=0)
    pacer.observe(10_000, now=0.0)
    assert pacer.pause(now=0.0) == 0.0
    with pytest.raises(ValueError, match="wait >= 0"):
        ReadPacer(wait=-1, min_rate=0)


# -- what an HTTP answer means for the events ----------------------------------------------------


class _Body:
    def __init__(self, body: bytes) -> None:
        self._body = body

    async def read(self, n: int) -> bytes:
        chunk, self._body = self._body[:n], self._body[n:]
        return chunk


class _Response:
    """What answer_of reads of an aiohttp response: the status, headers and the body."""

    def __init__(self, status: int, body: bytes, headers: Mapping[str, str]) -> None:
        self.status = status
        self.headers = headers
        self.content = _Body(body)


async def answer(status: int, body: Any = None, **headers: str) -> Answer:
    """answer_of for a frontend-sync request answered `status` with `body` (JSON unless bytes)."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    response = cast(aiohttp.ClientResponse, _Response(status, raw, headers))
    return await answer_of(response, "POST /api/ingest/sync", is_sync_answer)


async def refusal(status: int, body: Any = None, **headers: str) -> DeliveryError:
    """The DeliveryError answer_of raises for this answer."""
    with pytest.raises(DeliveryError) as caught:
        await answer(status, body, **headers)
    return caught.value


async def test_the_receivers_2xx_answer_delivers() -> None:
    delivered = await answer(200, {"ok": True, "applied": 3})
    assert delivered.outcome is Outcome.DELIVERED
    assert delivered.body == {"ok": True, "applied": 3}


async def test_a_409_is_already_processed_not_a_failure() -> None:
    assert (await answer(409, {"error": "duplicate"})).outcome is Outcome.ALREADY_PROCESSED
    assert (await answer(409, b"<html>conflict</html>")).outcome is Outcome.ALREADY_PROCESSED


@pytest.mark.parametrize(
    "body",
    [b"<html>Sign in</html>", {"ok": False}, {"status": "ok"}, b"", b"[true]"],
)
async def test_a_2xx_that_is_not_the_receivers_answer_is_a_wrong_destination(body: Any) -> None:
    """A proxy's or a login page's 200 means the events went nowhere: held, never parked."""
    error = await refusal(200, body)
    assert error.failure is Failure.WRONG_DESTINATION
    assert error.code == "BAD_RESPONSE"
    assert error.retryable


async def test_a_2xx_answer_too_large_to_read_is_not_taken_as_delivered() -> None:
    # Words, not one long token: masking a long token costs seconds (consumer/observability/
    # redact.py's URL pattern backtracks over it), which is not what this test is about.
    padding = "x " * (MAX_ANSWER_BYTES // 2)
    error = await refusal(200, {"ok": True, "padding": padding})
    assert error.failure is Failure.WRONG_DESTINATION


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408, 425, 429])
async def test_a_busy_or_down_receiver_is_unavailable_and_retried(status: int) -> None:
    error = await refusal(status, {"error": "later"})
    assert (error.failure, error.code, error.retryable) == (
        Failure.UNAVAILABLE,
        f"HTTP_{status}",
        True,
    )


@pytest.mark.parametrize("status", [301, 302, 307, 308, 401, 403, 404, 405])
async def test_a_wrong_url_or_secret_is_a_wrong_destination_held_not_parked(status: int) -> None:
    error = await refusal(status, b"", Location="https://elsewhere.example/login")
    assert error.failure is Failure.WRONG_DESTINATION
    assert not error.failure.parks
    if status < 400:
        assert "to https://elsewhere.example/login" in str(error)


@pytest.mark.parametrize("status", [400, 413, 415, 422, 418])
async def test_a_refusal_of_the_content_parks(status: int) -> None:
    error = await refusal(status, {"error": "bad entry"})
    assert error.failure is Failure.REFUSED
    assert error.failure.parks and not error.retryable


@pytest.mark.parametrize(("status", "honoured"), [(429, True), (503, True), (500, False)])
async def test_retry_after_is_honoured_only_on_429_and_503(status: int, honoured: bool) -> None:
    error = await refusal(status, {}, **{"Retry-After": "120"})
    assert error.retry_after == (120.0 if honoured else None)


async def test_a_retry_after_on_a_refusal_is_ignored() -> None:
    error = await refusal(422, {}, **{"Retry-After": "120"})
    assert (error.failure, error.retry_after) == (Failure.REFUSED, None)


async def test_a_retry_after_date_counts_from_now() -> None:
    when = email.utils.formatdate(time.time() + 90, usegmt=True)
    error = await refusal(503, {}, **{"Retry-After": when})
    assert error.retry_after is not None
    assert 80 <= error.retry_after <= 91


# -- narrowing a refused batch down to the refused events ----------------------------------------


def make_batch(seqs: list[int], payload: str = '{"n":1}') -> Batch:
    parts = [
        f'{{"entityType":"call_log","entityId":"e{seq}","op":"upsert","seq":{seq},'
        f'"payload":{payload},"createdAt":"2026-01-01T00:00:00Z"}}'.encode()
        for seq in seqs
    ]
    return Batch.of_raw(parts, Position(100, seqs[-1]))


def test_a_batch_splits_into_ordered_halves_with_the_entries_byte_for_byte() -> None:
    # A number no double holds and an escaped NUL: both pass through a split unchanged.
    batch = make_batch(
        [5, 6, 7, 8, 9], payload='{"big":123456789012345678901234567890,"s":"\\u0000"}'
    )
    first, second = batch.split()
    assert [(h.count, h.min_seq, h.max_seq) for h in (first, second)] == [(2, 5, 6), (3, 7, 9)]
    assert first.raw_entries() + second.raw_entries() == batch.raw_entries()
    assert b"123456789012345678901234567890" in first.entries_json
    # Both halves commit to where the whole batch ends.
    assert first.end == second.end == batch.end


class ScriptedSink:
    """Refuses (422) every batch holding one of `refused`; is unavailable (503) while
    `unavailable` lasts; else answers `outcome`. Remembers the seqs of every call."""

    name = "scripted"

    def __init__(
        self,
        *,
        refused: frozenset[int] = frozenset(),
        unavailable: int = 0,
        outcome: Outcome = Outcome.DELIVERED,
    ) -> None:
        self.refused = refused
        self.unavailable = unavailable
        self.outcome = outcome
        self.calls: list[list[int]] = []

    async def start(self) -> None:
        """Nothing to open."""

    async def close(self) -> None:
        """Nothing to close."""

    async def deliver(self, batch: Batch) -> Outcome:
        seqs = [int(entry["seq"]) for entry in batch.entries()]
        self.calls.append(seqs)
        if self.unavailable:
            self.unavailable -= 1
            raise DeliveryError("HTTP 503", code="HTTP_503")
        if self.refused & set(seqs):
            raise DeliveryError("HTTP 422", retryable=False, code="HTTP_422")
        return self.outcome


async def settle(sink: ScriptedSink, batch: Batch, **settings: Any) -> Settled | None:
    """Settle `batch` through `sink` as a leading runtime would, configured from settings."""
    config = runtime_config(make_settings("postgresql://unused", "http://127.0.0.1:9", **settings))
    stats = RuntimeStats()
    # The store is only written to while an epoch leads (stats.epoch), never here.
    steps = Steps("policies", cast(OutboxStore, None), stats, config)
    steps.start()
    steps.begin_lead()
    settler = Settler("policies", sink, config=config, stats=stats, steps=steps)
    return await asyncio.wait_for(settler.settle(batch), timeout=10)


def parked_seqs(settled: Settled | None) -> list[int]:
    assert settled is not None
    return [int(orjson.loads(dead.entry_json)["seq"]) for dead in settled.parked]


async def test_one_refused_event_is_parked_alone_and_its_neighbours_delivered() -> None:
    sink = ScriptedSink(refused=frozenset({3}))
    settled = await settle(sink, make_batch([1, 2, 3, 4, 5, 6, 7, 8]))
    assert parked_seqs(settled) == [3]
    assert settled is not None and settled.outcome is Outcome.PARKED
    assert {dead.code for dead in settled.parked} == {"HTTP_422"}
    delivered = [seq for call in sink.calls[1:] if not {3} & set(call) for seq in call]
    assert sorted(delivered) == [1, 2, 4, 5, 6, 7, 8]
    # Halving: log2(8) narrowing steps, not one call per event.
    assert len(sink.calls) <= 2 * 3 + 1


async def test_every_refused_event_is_found_in_order() -> None:
    sink = ScriptedSink(refused=frozenset({1, 5, 6}))
    settled = await settle(sink, make_batch(list(range(1, 8))))
    assert parked_seqs(settled) == [1, 5, 6]


async def test_a_batch_the_receiver_had_already_is_already_processed() -> None:
    settled = await settle(ScriptedSink(outcome=Outcome.ALREADY_PROCESSED), make_batch([1, 2]))
    assert settled == Settled([], Outcome.ALREADY_PROCESSED)


async def test_an_unavailable_receiver_is_retried_until_it_answers_and_nothing_parks() -> None:
    sink = ScriptedSink(unavailable=3)
    settled = await settle(
        sink, make_batch([1, 2, 3]), SYNC_RETRY_INITIAL_SEC=0.001, SYNC_RETRY_MAX_SEC=0.002
    )
    assert settled == Settled([], Outcome.DELIVERED)
    # Never narrowed down: the same whole batch each time.
    assert sink.calls == [[1, 2, 3]] * 4


async def test_max_attempts_parks_the_whole_batch_the_receiver_stayed_unavailable_for() -> None:
    sink = ScriptedSink(unavailable=100)
    settled = await settle(
        sink,
        make_batch([1, 2, 3]),
        SYNC_MAX_ATTEMPTS=2,
        SYNC_RETRY_INITIAL_SEC=0.001,
        SYNC_RETRY_MAX_SEC=0.002,
    )
    assert parked_seqs(settled) == [1, 2, 3]
    assert len(sink.calls) == 2


@pytest.mark.parametrize(
    ("first", "second", "combined"),
    [
        (Outcome.DELIVERED, Outcome.ALREADY_PROCESSED, Outcome.DELIVERED),
        (Outcome.ALREADY_PROCESSED, Outcome.ALREADY_PROCESSED, Outcome.ALREADY_PROCESSED),
        (Outcome.ALREADY_PROCESSED, Outcome.PARKED, Outcome.PARKED),
        (Outcome.PARKED, Outcome.DELIVERED, Outcome.PARKED),
    ],
)
def test_the_word_for_a_split_batch_is_parked_if_any_half_parked(
    first: Outcome, second: Outcome, combined: Outcome
) -> None:
    assert Settled.both(Settled([], first), Settled([], second)).outcome is combined


# -- masking secrets ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("postgresql://app:s3cr%2Ft@db/x", "postgresql://app:***@db/x"),
        ("GET https://u:p:w@host/path?q", "GET https://u:***@host/path?q"),
        ("x" * 40 + "redis://user:pw@h", "x" * 40 + "redis://user:***@h"),
        ('{"password": "hunter2"}', '{"password": "***"}'),
        ("Authorization: Bearer abc.def", "Authorization: Bearer ***"),
    ],
)
def test_secrets_are_masked_wherever_they_stand(text: str, masked: str) -> None:
    assert mask_secrets(text) == masked


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "hostile",
    [
        # One long word: a pattern that may start anywhere in it must not rescan the rest.
        "a" * 2_000_000,
        # Many URL-shaped starts with no '@' to end them.
        "a://b:" * 300_000,
    ],
    ids=["one-long-word", "url-starts-without-end"],
)
def test_masking_is_linear_in_a_receivers_hostile_answer(hostile: str) -> None:
    """A receiver's error body is masked before it is logged: quadratic masking of a few MB
    would hold the event loop for hours (the timeout fails the test long before)."""
    assert mask_secrets(hostile) == hostile
