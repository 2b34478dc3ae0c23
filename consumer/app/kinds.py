"""The kinds of consumer this process runs, by name: what each delivers to and how it is assembled.

Everything that differs between consumers is a field of its ConsumerKind, so the process
assembly (wiring.py), the dead-letter retries and the command line ask `consumer_kind` instead
of comparing names. The built-in kinds are KINDS; a consumer an operator declares in
SYNC_CONSUMERS_FILE (declared.py: a name, a sink, a url, a secret, the entity types it sends, the
node it delivers to) becomes one more ConsumerKind, built from its declaration each time it is
resolved, with the built-in parts of its sink.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from psycopg_pool import AsyncConnectionPool

from consumer.app import declared, jetstream_kind, recording_kind
from consumer.app.settings import ConfigError, SyncSettings
from consumer.app.startup import StartupError
from consumer.core.events import Sink
from consumer.runtime.filtering import EntryFilter
from consumer.sinks.frontend_sync import FrontendSyncSink
from consumer.sinks.null import NullSink
from consumer.sinks.recording_upload import RECORDING_ENTITY
from consumer.store.admin import UnknownConsumerError
from consumer.store.outbox import OutboxStore

# settings, the backend pool of a kind with `ledger_pool_size` (else None) -> a new sink.
SinkBuilder = Callable[[SyncSettings, AsyncConnectionPool[Any] | None], Sink]
# the consumer's own pool, its ledger pool (None when it has none) -> its outbox store.
OutboxBuilder = Callable[[AsyncConnectionPool[Any], AsyncConnectionPool[Any] | None], OutboxStore]


def _plain_outbox(
    pool: AsyncConnectionPool[Any], _ledger_pool: AsyncConnectionPool[Any] | None
) -> OutboxStore:
    return OutboxStore(pool)


def _settings_target_node(settings: SyncSettings) -> str | None:
    return settings.target_node


def _frontend_url(settings: SyncSettings) -> None:
    # A built-in consumer that would deliver to no configured frontend does not start.
    _ = settings.frontend_url


@dataclass(frozen=True)
class ConsumerKind:
    """One kind of consumer. The hooks below apply when it delivers through its own sink; with
    `--sink null` (benchmarks) it is a plain consumer that accepts every batch."""

    name: str
    # A new sink for the running consumer.
    sink: SinkBuilder
    # A new sink that redelivers events an operator retries from the dead-letter queue.
    dead_letter_sink: SinkBuilder
    # The entity types it delivers; None: every type. This describes the kind (recording-upload's
    # sink passes over the rest itself); `sends_only` is what the runtime filters on.
    entity_types: frozenset[str] | None = None
    # The entity types the runtime hands its sink; the others are passed over, never sent
    # (counted SKIPPED). None: every type.
    sends_only: frozenset[str] | None = None
    # The node it delivers to: events whose origin is that node are not sent back (no echo).
    # The built-in kinds take SYNC_TARGET_NODE; a declared one its own target_node.
    target_node: Callable[[SyncSettings], str | None] = _settings_target_node
    # A check of the settings before anything else: a ConfigError stops the process, one line.
    check_settings: Callable[[SyncSettings], None] = _frontend_url
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

    def entry_filter(self, settings: SyncSettings) -> EntryFilter | None:
        """What the runtime passes over instead of sending; None when it sends everything."""
        target = self.target_node(settings)
        if self.sends_only is None and target is None:
            return None
        return EntryFilter(self.sends_only, target)


class UnknownKindError(UnknownConsumerError, StartupError, LookupError):
    """No consumer of that name, built in or declared: bad input (exit 2, as for every command),
    and a LookupError for the dead-letter retries' sink factory."""

    def __init__(self, name: str, declared_names: tuple[str, ...] = ()) -> None:
        runs = f"this build runs: {', '.join(KINDS)}"
        if declared_names:
            runs += f"; SYNC_CONSUMERS_FILE declares: {', '.join(declared_names)}"
        super().__init__(f"unknown consumer {name!r} ({runs})")


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


def declared_kinds(settings: SyncSettings) -> dict[str, ConsumerKind]:
    """The consumers SYNC_CONSUMERS_FILE declares, as kinds ({} without the file); the whole
    file checked (a ConfigError of one line), its secrets not yet read."""
    if settings.consumers_file is None:
        return {}
    consumers = declared.load(settings.consumers_file)
    for name in consumers:
        if name in KINDS:
            raise ConfigError(
                f"SYNC_CONSUMERS_FILE ({settings.consumers_file}): consumer {name!r} is built "
                "in; give the declared one another name"
            )
    return {name: _declared_kind(name, consumer) for name, consumer in consumers.items()}


def consumer_kind(name: str, settings: SyncSettings | None = None) -> ConsumerKind:
    """The kind of the consumer `name`: a built-in one, or one SYNC_CONSUMERS_FILE declares
    (with `settings`; the file is checked whole even for a built-in name). UnknownKindError if
    there is none of that name."""
    found = declared_kinds(settings) if settings is not None else {}
    kind = KINDS.get(name) or found.get(name)
    if kind is None:
        raise UnknownKindError(name, tuple(found))
    return kind


def _declared_kind(name: str, consumer: declared.Declaration) -> ConsumerKind:
    """A ConsumerKind from a declaration: the sink of its kind, to its url, signed with its
    secret (read when a sink is made, and at start by check_settings)."""
    if isinstance(consumer, jetstream_kind.JetStreamConsumer):
        return _jetstream_kind(name, consumer)
    url = consumer.base_url

    def secret(settings: SyncSettings) -> str | None:
        return consumer.signing_secret(name, settings.signing_secret)

    def check(settings: SyncSettings) -> None:
        secret(settings)

    def target_node(_settings: SyncSettings) -> str | None:
        return consumer.target_node

    def json_sink(settings: SyncSettings, _pool: AsyncConnectionPool[Any] | None) -> Sink:
        return FrontendSyncSink(
            url, timeout_sec=settings.timeout_sec, shared_secret=secret(settings), name=name
        )

    kind = ConsumerKind(
        name=name,
        sink=json_sink,
        dead_letter_sink=json_sink,
        entity_types=consumer.types,
        sends_only=consumer.types,
        target_node=target_node,
        check_settings=check,
    )
    if consumer.sink == "recording-upload":
        delivery, dead_letters = recording_kind.sinks_to(lambda s: (url, secret(s)))
        return replace(
            kind,
            sink=delivery,
            dead_letter_sink=dead_letters,
            ledger_pool_size=recording_kind.ledger_pool_size,
            outbox_store=recording_kind.outbox_store,
            check=recording_kind.check,
            one_batch_at_a_time=True,
        )
    if consumer.sink == "null":
        # Sends nothing: no secret to read.
        return replace(kind, sink=_null_sink, dead_letter_sink=_null_sink, check_settings=_no_check)
    return kind


def _jetstream_kind(name: str, consumer: jetstream_kind.JetStreamConsumer) -> ConsumerKind:
    """A consumer that publishes to a JetStream stream: the stream made or checked at start,
    one batch in flight (each entity's messages keep outbox order in the stream)."""
    hooks = jetstream_kind.JetStreamHooks(name, consumer)

    def target_node(_settings: SyncSettings) -> str | None:
        return consumer.target_node

    return ConsumerKind(
        name=name,
        sink=hooks.sink,
        dead_letter_sink=hooks.sink,
        entity_types=consumer.types,
        sends_only=consumer.types,
        target_node=target_node,
        check_settings=hooks.check_settings,
        check=hooks.check,
        one_batch_at_a_time=True,
    )


def _null_sink(_settings: SyncSettings, _pool: AsyncConnectionPool[Any] | None) -> Sink:
    return NullSink()


def _no_check(_settings: SyncSettings) -> None:
    return None
