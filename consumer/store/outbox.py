"""Reading the outbox and moving a consumer's offset, fenced by the leader epoch."""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from consumer.core.events import Batch, DeadLetter, Position
from consumer.observability.redact import safe_error
from consumer.store.admin import UnknownConsumerError
from consumer.store.dlq import park_parameters
from consumer.store.new_consumers import Registration, StartFrom, register_consumer
from consumer.store.queries import query
from consumer.wire.entries import encode_entries, encode_keyed_entries


class FencedError(Exception):
    """A newer leader took over this consumer: the old one must not move the offset."""


@dataclass(frozen=True)
class ReadResult:
    """One read of the outbox: a batch (None when nothing is ready) and whether an older open
    transaction holds the horizon back."""

    batch: Batch | None
    held_back: bool
    # Some transaction was running when the read's snapshot was taken: one that wrote an outbox
    # row before the consumer announced a wait commits without a NOTIFY.
    running: bool = False
    # The read returned as many rows as asked for: more may be ready. A batch's count does not
    # say it when rows of a snapshot for another consumer were left out of it.
    full: bool = False


@dataclass(frozen=True)
class Leadership:
    """The epoch a leader took, and where the consumer stood then."""

    epoch: int
    position: Position


class OutboxStore:
    """Outbox reads and offset writes over a connection pool."""

    def __init__(self, pool: AsyncConnectionPool[Any]) -> None:
        self._pool = pool

    async def node_name(self) -> str | None:
        """This database's node name (sync.node_name(); None while unnamed): what the entries of
        changes made here carry as their origin (read_batch's `local_node`)."""
        async with self._pool.connection() as conn:
            row = await (await conn.execute("SELECT sync.node_name()")).fetchone()
        return row[0] if row else None

    async def read_batch(
        self,
        after: Position,
        limit: int,
        *,
        local_node: str | None = None,
        consumer: str | None = None,
        announced: bool = False,
    ) -> ReadResult:
        """Up to `limit` events after `after` whose transactions have all ended (gap-safe).

        `local_node` is this node's name (node_name()): the origin the entries of changes made
        here carry; None leaves it out of them. Rows of a snapshot for one consumer
        (target_consumer) are read by every consumer, to move past them, and left out of the
        batch of every other than `consumer`: a batch may then have no entry (count 0), and
        still ends after them. `announced`: the consumer's wait is announced, so the read also
        counts as running a transaction its snapshot cannot list (see read_batch in
        sql/queries.sql)."""
        async with self._pool.connection() as conn:
            cur = await conn.execute(
                query("read_batch"),
                {
                    "txid": str(after.txid),
                    "seq": after.seq,
                    "limit": limit,
                    "consumer": consumer,
                    "announced": announced,
                },
                prepare=True,
                binary=True,
            )
            rows = await cur.fetchall()
        horizon = int(rows[0][0])
        held_back, running = horizon == 2, horizon >= 1
        if rows[0][1] is None:
            return ReadResult(None, held_back, running=running)
        last = rows[-1]
        seqs = [row[3] for row in rows]
        ours = [row for row in rows if row[2] is None or row[2] == consumer]
        batch = Batch(
            count=len(ours),
            end=Position(int(last[1]), last[3]),
            min_seq=min(seqs),
            max_seq=max(seqs),
            write_entries=functools.partial(encode_entries, ours, local_node=local_node),
            write_keyed=functools.partial(encode_keyed_entries, ours, local_node=local_node),
        )
        return ReadResult(batch, held_back, full=len(rows) == limit, running=running)

    async def ensure_consumer(
        self,
        consumer: str,
        *,
        start: StartFrom = "earliest",
        entity_types: frozenset[str] | None = None,
    ) -> Registration:
        """Register the consumer unless it exists, where `start` says (new_consumers.py: "auto"
        also asks for a snapshot of its `entity_types`' tables when the outbox no longer holds
        the whole history); what it did."""
        async with self._pool.connection() as conn:
            return await register_consumer(conn, consumer, start=start, entity_types=entity_types)

    async def take_leadership(self, consumer: str) -> Leadership:
        """Take a new epoch for this process (call while holding the leader lock).

        Committed durably even on a pool whose offset commits are not: an epoch lost in a
        server crash could be taken a second time, and fencing rests on epochs never repeating.
        """
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(query("commit_durably"))
            cur = await conn.execute(
                query("take_leadership"),
                {"consumer": consumer, "host": socket.gethostname(), "pid": os.getpid()},
            )
            row = await cur.fetchone()
        if row is None:
            raise UnknownConsumerError(consumer)
        epoch, last_txid, last_seq = row
        return Leadership(epoch, Position(int(last_txid), last_seq))

    async def commit_offset(
        self,
        consumer: str,
        epoch: int,
        position: Position,
        delivered: int,
        *,
        parked: Sequence[DeadLetter] = (),
        max_retries: int = 3,
    ) -> None:
        """Move the offset to `position`, parking `parked` in the dead-letter queue in the same
        transaction; raises FencedError (and parks nothing) if a newer leader took over."""
        params = {
            "consumer": consumer,
            "epoch": epoch,
            "txid": str(position.txid),
            "seq": position.seq,
            "delivered": delivered,
        }
        async with self._pool.connection() as conn:
            if not parked:
                cur = await conn.execute(query("commit_offset"), params, prepare=True)
                if cur.rowcount != 1:
                    raise FencedError(f"consumer {consumer}: epoch {epoch} was fenced off")
                return
            async with conn.transaction():
                cur = await conn.execute(query("commit_offset"), params)
                if cur.rowcount != 1:
                    raise FencedError(f"consumer {consumer}: epoch {epoch} was fenced off")
                # Each payload goes in as the entry's own JSON text, byte for byte; the errors
                # are cleaned. Nothing an entry holds can make this fail, so a refused entry
                # never holds the offset.
                await conn.execute(
                    query("park_entries"),
                    {
                        "consumer": consumer,
                        "max_retries": max_retries,
                        **park_parameters(parked),
                    },
                )
                # Parking is an error an operator should see in `serversync status`.
                reason = safe_error(parked[0].message)
                await conn.execute(
                    query("record_error"),
                    {
                        "consumer": consumer,
                        "epoch": epoch,
                        "error": f"parked {len(parked)} event(s): {reason}"[:2000],
                    },
                )

    async def set_waiting(self, consumer: str, waiting: bool) -> None:
        """Mark whether this consumer sleeps until a NOTIFY (producers notify only then)."""
        async with self._pool.connection() as conn:
            await conn.execute(
                query("set_waiting"), {"consumer": consumer, "waiting": waiting}, prepare=True
            )

    async def record_failure(self, consumer: str, epoch: int, error: str, reason: str) -> None:
        """A failed delivery that is tried again: the last error, and since when and why
        deliveries fail (cleared by the next offset commit)."""
        async with self._pool.connection() as conn:
            await conn.execute(
                query("record_failure"),
                {"consumer": consumer, "epoch": epoch, "error": error[:2000], "reason": reason},
            )

    async def clear_failure(self, consumer: str, epoch: int) -> None:
        """The failing streak is over, though no offset was committed."""
        async with self._pool.connection() as conn:
            await conn.execute(query("clear_failure"), {"consumer": consumer, "epoch": epoch})

    async def release_leadership(self, consumer: str, epoch: int) -> None:
        """Clear the leader columns on a clean stop."""
        async with self._pool.connection() as conn:
            await conn.execute(query("release_leadership"), {"consumer": consumer, "epoch": epoch})
