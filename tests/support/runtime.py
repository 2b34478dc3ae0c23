"""A ConsumerRuntime running in the test's event loop with a sink the test gives: a sink that
remembers what it delivered (RecordingSink), a store that counts its reads (WatchedStore), and
the runtime's parts as the tests look at them."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from consumer.app.settings import runtime_config
from consumer.app.wiring import open_pool
from consumer.core.events import Batch, Outcome, Position, Sink
from consumer.runtime.wakeup import NotifyListener
from consumer.runtime.worker import ConsumerRuntime
from consumer.store.leadership import LeaderLock
from consumer.store.outbox import OutboxStore, ReadResult
from tests.conftest import make_settings, wait_until
from tests.support.backend import CONSUMER

# -- a real sink that remembers what it delivered ------------------------------------------------


class RecordingSink:
    """Keeps every delivered batch, in the order the runtime sent them; optionally delivers on
    to another sink first (then it keeps only what that sink accepted).

    Send order, not the order of the answers: with several batches in flight the receiver may
    answer a newer batch first, while the runtime sends (and commits) them in outbox order."""

    name = "recording"

    def __init__(self, forward: Sink | None = None) -> None:
        self.forward = forward
        # One slot per delivery call, in call order; None until that delivery is accepted.
        self._sent: list[Batch | None] = []

    async def start(self) -> None:
        """Start the sink delivered on to, if any."""
        if self.forward is not None:
            await self.forward.start()

    async def deliver(self, batch: Batch) -> Outcome:
        """Deliver on (if forwarding), then remember the batch in the slot of this call."""
        slot = len(self._sent)
        self._sent.append(None)
        outcome = Outcome.DELIVERED
        if self.forward is not None:
            outcome = await self.forward.deliver(batch)
        self._sent[slot] = batch
        return outcome

    async def close(self) -> None:
        """Close the sink delivered on to, if any."""
        if self.forward is not None:
            await self.forward.close()

    @property
    def batches(self) -> list[Batch]:
        """The accepted batches, in the order they were sent."""
        return [batch for batch in self._sent if batch is not None]

    @property
    def entries(self) -> list[dict[str, Any]]:
        """The accepted entries, in the order they were sent."""
        return [entry for batch in self.batches for entry in batch.entries()]

    @property
    def seqs(self) -> list[int]:
        """Delivered seqs in delivery order."""
        return [int(e["seq"]) for e in self.entries]


class WatchedStore(OutboxStore):
    """The real outbox store; it also counts its reads and keeps what the last one returned."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reads = 0
        self.full_reads = 0
        self.held_back_reads = 0
        self.last: ReadResult | None = None

    async def read_batch(
        self,
        after: Position,
        limit: int,
        *,
        local_node: str | None = None,
        consumer: str | None = None,
        announced: bool = False,
    ) -> ReadResult:
        """OutboxStore.read_batch, counted."""
        result = await super().read_batch(
            after, limit, local_node=local_node, consumer=consumer, announced=announced
        )
        self.reads += 1
        self.full_reads += result.full
        self.held_back_reads += result.held_back
        self.last = result
        return result


# -- the runtime ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_runtime(dsn: str, sink: Sink, **settings: Any) -> AsyncIterator[ConsumerRuntime]:
    """A ConsumerRuntime wired like wiring.consumer_runtime but with the given sink, configured
    like a user's from tests.conftest.make_settings plus `settings` (SYNC_* variables; batches
    of 7 and a 20 ms re-check unless given), running in this loop; yielded once it leads and
    listens, stopped (errors raised) on exit."""
    config = runtime_config(
        make_settings(
            dsn,
            # Not called: the sink is given.
            "http://127.0.0.1:9",
            **{"SYNC_BATCH_SIZE": 7, "SYNC_RECHECK_INTERVAL_MS": 20, **settings},
        )
    )
    async with open_pool(dsn, f"run:{CONSUMER}") as pool:
        runtime = ConsumerRuntime(
            CONSUMER,
            store=WatchedStore(pool),
            sink=sink,
            lock=LeaderLock(dsn, CONSUMER),
            listener=NotifyListener(dsn, CONSUMER),
            config=config,
        )
        task = asyncio.create_task(runtime.run())
        try:

            def ready() -> bool:
                return task.done() or (
                    runtime.stats.is_leader and listener_of(runtime).connected.is_set()
                )

            await wait_until(ready, what="the consumer to lead and listen")
            if task.done():
                task.result()  # raises what stopped it
                raise AssertionError("the consumer stopped on its own")
            yield runtime
        finally:
            runtime.request_stop()
            await asyncio.wait_for(task, timeout=15)


def listener_of(runtime: ConsumerRuntime) -> NotifyListener:
    """The runtime's NOTIFY listener (running_runtime always gives it one)."""
    listener = runtime.listener
    assert listener is not None
    return listener


def store_of(runtime: ConsumerRuntime) -> WatchedStore:
    """The runtime's store (running_runtime always gives it a WatchedStore)."""
    store = runtime.store
    assert isinstance(store, WatchedStore)
    return store


def parked(runtime: ConsumerRuntime) -> bool:
    """Whether the consumer sleeps after a read that found nothing and was not held back: its
    next read then follows a NOTIFY, the poll timer or a stop, nothing else. A set listener
    event is a NOTIFY wake-up that the loop has not acted on yet."""
    return runtime.stats.sleeping == "wakeup" and not listener_of(runtime).event.is_set()
