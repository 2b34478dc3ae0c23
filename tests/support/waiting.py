"""Waiting for delivery, each wait a condition with a deadline (wait_until, from conftest):
a consumer's offset at the end of the outbox, every event at a fake receiver, or a number of
events delivered by (or the position reached by) an in-process consumer."""

from __future__ import annotations

from consumer.core.events import Position
from consumer.runtime.worker import ConsumerRuntime
from tests.conftest import wait_until
from tests.support.backend import CONSUMER, offset, outbox_end, outbox_seqs
from tests.support.receivers import ScriptedReceiver

__all__ = [
    "caught_up",
    "wait_all_delivered",
    "wait_caught_up",
    "wait_delivered_events",
    "wait_drained",
    "wait_position",
    "wait_until",
]


async def caught_up(dsn: str, consumer: str = CONSUMER) -> bool:
    """Whether the consumer's committed offset stands at the last event of the outbox.

    The end is read after the offset: events the consumer causes itself (recording-upload's
    marks) count too, so an offset that fell behind them is not caught up."""
    position = await offset(dsn, consumer)
    end = await outbox_end(dsn)
    return end is not None and position == Position(*end)


async def wait_drained(*consumers: tuple[str, str], timeout: float = 30.0) -> None:
    """Until every (database, consumer) passed every event of its outbox, twice in a row: in
    both directions, applying the other side's changes writes new outbox rows (relayed with
    their origin), which the consumer must pass too."""
    streak = 0

    async def all_caught_up() -> bool:
        nonlocal streak
        done = True
        for dsn, consumer in consumers:
            done = done and await caught_up(dsn, consumer)
        streak = streak + 1 if done else 0
        return streak >= 2

    await wait_until(all_caught_up, timeout=timeout, what="every direction drained")


async def wait_caught_up(dsn: str, consumer: str = CONSUMER, *, timeout: float = 10.0) -> Position:
    """Wait until the consumer's offset passed every event of the outbox; that offset."""
    await wait_until(
        lambda: caught_up(dsn, consumer),
        timeout=timeout,
        what=f"the offset of {consumer} to pass every event",
    )
    position = await offset(dsn, consumer)
    assert position is not None
    return position


async def wait_all_delivered(
    dsn: str, receiver: ScriptedReceiver, *, timeout: float = 15.0
) -> set[int]:
    """Wait until the receiver accepted every event of the outbox and the offset stands at the
    end of the outbox; the outbox's seqs. Fails if the receiver accepted any other event."""
    expected = set(await outbox_seqs(dsn))
    await wait_until(
        lambda: expected <= receiver.delivered,
        timeout=timeout,
        what=f"all {len(expected)} events at the receiver "
        f"(missing {len(expected - receiver.delivered)})",
    )
    await wait_caught_up(dsn, timeout=timeout)
    assert receiver.delivered == expected, "the receiver got events that are not in the outbox"
    return expected


async def wait_delivered_events(
    runtime: ConsumerRuntime, count: int, *, timeout: float = 10.0, what: str = ""
) -> None:
    """Wait until the in-process consumer counts exactly `count` events delivered."""
    await wait_until(
        lambda: runtime.stats.delivered_events == count,
        timeout=timeout,
        what=what or f"{count} events delivered",
    )


async def wait_position(runtime: ConsumerRuntime, end: Position, *, timeout: float = 20.0) -> None:
    """Wait until the in-process consumer's own position (what it committed last) is `end`."""
    await wait_until(
        lambda: runtime.stats.position == end,
        timeout=timeout,
        what=f"the consumer to reach {end} (stats: {runtime.stats})",
    )
