"""The kinds of consumer this build runs, by name: what each delivers to and how it is assembled.

Everything that differs between consumers is a field of its ConsumerKind, so the process
assembly (wiring.py), the dead-letter retries and the command line ask the registry instead of
comparing names. A consumer an operator declares (a name, a sink kind, a target URL, a secret,
the entity types it wants) is meant to become one more ConsumerKind built from that declaration.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from psycopg_pool import AsyncConnectionPool

from consumer.app import recording_kind
from consumer.app.settings import SyncSettings
from consumer.app.startup import StartupError
from consumer.core.events import Sink
from consumer.sinks.frontend_sync import FrontendSyncSink
from consumer.sinks.recording_upload import RECORDING_ENTITY
from consumer.store.outbox import OutboxStore

# settings, the backend pool of a kind with `ledger_pool_size` (else None) -> a new sink.
SinkBuilder = Callable[[SyncSettings, AsyncConnectionPool[Any] | None], Sink]
# the consumer's own pool, its ledger pool (None when it has none) -> its outbox store.
OutboxBuilder = Callable[[AsyncConnectionPool[Any], AsyncConnectionPool[Any] | None], OutboxStore]


def _plain_outbox(
    pool: AsyncConnectionPool[Any], _ledger_pool: AsyncConnectionPool[Any] | None
) -> OutboxStore:
    return OutboxStore(pool)


@dataclass(frozen=True)
class ConsumerKind:
    """One kind of consumer. The hooks below apply when it delivers through its own sink; with
    `--sink null` (benchmarks) it is a plain consumer that accepts every batch."""

    name: str
    # A new sink for the running consumer.
    sink: SinkBuilder
    # A new sink that redelivers events an operator retries from the dead-letter queue.
    dead_letter_sink: SinkBuilder
    # The entity types it delivers; None: every type. The outbox is read whole either way
    # (the sink passes over the rest), so this describes the kind rather than filters reads.
    entity_types: frozenset[str] | None = None
    # Its sink reads and writes the backend database through a pool of its own of this size;
    # None: it needs none.
    ledger_pool_size: Callable[[SyncSettings], int] | None = None
    # Its outbox store (hooks on taking the lead and on each commit).
    outbox_store: OutboxBuilder = _plain_outbox
    # A check before the process starts: a ConfigError or StartupError stops it with one line.
    check: Callable[[SyncSettings], Awaitable[None]] | None = None
    # Its sink runs its own concurrency inside a batch, so the runtime sends one batch at a time.
    one_batch_at_a_time: bool = False

    def batches_in_flight(self, settings: SyncSettings) -> int:
        """How many batches the runtime may have in flight at once (SYNC_MAX_IN_FLIGHT)."""
        return 1 if self.one_batch_at_a_time else settings.max_in_flight


class UnknownKindError(StartupError, LookupError):
    """No consumer kind of that name in this build (a StartupError for `serversync run`, a
    LookupError for the dead-letter retries' sink factory)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"unknown consumer {name!r} (this build runs: {', '.join(KINDS)})")


def _frontend_sync_sink(settings: SyncSettings, _pool: AsyncConnectionPool[Any] | None) -> Sink:
    return FrontendSyncSink(
        settings.frontend_url,
        timeout_sec=settings.timeout_sec,
        shared_secret=settings.signing_secret,
    )


FRONTEND_SYNC = ConsumerKind(
    name="frontend-sync",
    sink=_frontend_sync_sink,
    dead_letter_sink=_frontend_sync_sink,
)

RECORDING_UPLOAD = ConsumerKind(
    name=recording_kind.NAME,
    sink=recording_kind.delivery_sink,
    dead_letter_sink=recording_kind.dead_letter_sink,
    entity_types=frozenset({RECORDING_ENTITY}),
    ledger_pool_size=recording_kind.ledger_pool_size,
    outbox_store=recording_kind.outbox_store,
    check=recording_kind.check,
    # SYNC_UPLOAD_CONCURRENCY uploads run inside one batch instead.
    one_batch_at_a_time=True,
)

KINDS: dict[str, ConsumerKind] = {kind.name: kind for kind in (FRONTEND_SYNC, RECORDING_UPLOAD)}


def consumer_kind(name: str) -> ConsumerKind:
    """The kind of the consumer `name`; UnknownKindError if this build has none of that name."""
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKindError(name) from None
