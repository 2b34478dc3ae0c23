"""The JetStream sink against a real three-node JetStream cluster on loopback (Debian's
nats-server; skipped without it) and a real consumer process: each event lands in the stream
exactly once and in outbox order per entity, through a consumer killed mid-batch, a node killed
mid-drain and a cluster without quorum; a message too large is parked and the rest delivered;
an existing stream with other settings stops the start with one line. On a lone server: what a
client cut off from its server published never arrives later, two databases share a consumer
name and a stream, a refused permission fails at once. Then the parts in-process: subject
tokens, header values, the failure each JetStream answer means, the declarations, and the
publishing itself with a client of the test's own (each entity's queue, each message's timeout,
a lost connection, a closed sink, answers that are not acknowledgements).
"""

from __future__ import annotations

import asyncio
import importlib.util
import signal
import ssl
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from urllib.parse import unquote

import nats.errors
import orjson
import pytest
from nats.aio.msg import Msg

from consumer.app import declared, kinds
from consumer.app.jetstream_kind import database_source, parse_duration
from consumer.app.settings import ConfigError
from consumer.app.startup import StartupError
from consumer.core.events import Batch, DeliveryError, Failure, Outcome, Position
from consumer.runtime.filtering import EntryFilter
from consumer.sinks import jetstream
from consumer.sinks.jetstream import JetStreamSink
from tests.conftest import cli_env, fetch_value, make_settings, wait_until
from tests.support.backend import execute, last_error, offset, outbox_in_delivery_order
from tests.support.cli import assert_one_line_error, run_cli
from tests.support.dlq import dead_letters
from tests.support.nats_cluster import NatsCluster, StoredMessage, connected, nats_cluster
from tests.support.processes import Processes, ServersyncProcess
from tests.support.waiting import wait_caught_up

NAME = "events-js"
STREAM = "SERVERSYNC"
PREFIX = "events"
PASSWORD_ENV = "EVENTS_JS_PASSWORD"  # noqa: S105 - the name of a variable
# Short timers: a lost acknowledgement is given up after 3 s and the batch published again.
JS_ENV = {"SYNC_TIMEOUT_SEC": "3", "SYNC_LOG_LEVEL": "INFO"}


def declaration(servers: list[str], **keys: str) -> str:
    """The TOML of the JetStream consumer; `keys` add or replace keys (TOML values; an empty
    one leaves the key out)."""
    values = {
        "sink": '"jetstream"',
        "servers": orjson.dumps(servers).decode(),
        "stream": f'"{STREAM}"',
        "subject_prefix": f'"{PREFIX}"',
        **keys,
    }
    body = "".join(f"{key} = {value}\n" for key, value in values.items() if value)
    return f"[consumers.{NAME}]\n{body}"


def consumers_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "consumers.toml"
    path.write_text(text)
    return path


def start_consumer(
    processes: Processes, dsn: str, path: Path, label: str = "consumer", **env: str
) -> ServersyncProcess:
    """`serversync run events-js` as a real process."""
    return processes.start(
        label,
        ["--log-format", "text", "run", NAME],
        **{"DATABASE_URL": dsn, "SYNC_CONSUMERS_FILE": str(path), **JS_ENV, **env},
    )


async def write_events(dsn: str, entities: int, each: int, *, tag: str = "e") -> None:
    """`entities` call logs inserted, then each updated `each - 1` times: entities * each
    upsert events, each statement its own transaction, each entity's events in order."""
    await execute(
        dsn,
        "INSERT INTO call_logs (caller_number, callee_number) "
        "SELECT %s || '-' || g, 'x' FROM generate_series(1, %s) g",
        params=(tag, entities),
    )
    for number in range(1, each):
        await execute(
            dsn,
            "UPDATE call_logs SET summary = %s WHERE caller_number LIKE %s",
            params=(f"update {number}", f"{tag}-%"),
        )


async def source_of(dsn: str) -> str:
    """What the database's Nats-Msg-Ids start with: its node name, or its cluster's system
    identifier and its oid."""
    source: str = await fetch_value(
        dsn,
        "SELECT coalesce(sync.node_name(), system_identifier::text || '.' || "
        "(SELECT oid FROM pg_database WHERE datname = current_database())::text) "
        "FROM pg_control_system()",
    )
    return source


async def assert_exactly_once_in_order(dsn: str, cluster: NatsCluster) -> list[StoredMessage]:
    """The stream holds every outbox event exactly once, under its subject and ids, and each
    entity's events in outbox order; the messages."""
    outbox = await outbox_in_delivery_order(dsn)
    messages = await cluster.messages(STREAM)
    source = await source_of(dsn)
    ids = Counter(message.headers["Nats-Msg-Id"] for message in messages)
    assert [key for key, count in ids.items() if count > 1] == []
    assert set(ids) == {f"{source}:{NAME}:{row.seq}" for row in outbox}
    assert len(messages) == len(outbox)
    rows = {row.seq: row for row in outbox}
    stream_order: dict[str, list[int]] = defaultdict(list)
    for message in messages:
        entry = message.entry
        row = rows[entry["seq"]]
        assert message.headers["Nats-Msg-Id"] == f"{source}:{NAME}:{row.seq}"
        assert unquote(message.headers["Serversync-Entity-Id"]) == row.entity_id
        assert message.subject == f"{PREFIX}.{row.entity_type}.{row.op}"
        assert (entry["entityType"], entry["entityId"], entry["op"]) == (
            row.entity_type,
            row.entity_id,
            row.op,
        )
        stream_order[row.entity_id].append(row.seq)
    outbox_order: dict[str, list[int]] = defaultdict(list)
    for row in outbox:
        outbox_order[row.entity_id].append(row.seq)
    assert stream_order == outbox_order
    return messages


async def stored_some(cluster: NatsCluster) -> bool:
    """Whether the stream holds a message yet."""
    return int((await cluster.stream_info(STREAM))["state"]["messages"]) > 0


async def failing(dsn: str) -> bool:
    """Whether the consumer recorded a failed delivery (cleared by its next commit)."""
    return await last_error(dsn, NAME) is not None


async def failed_attempts(dsn: str, process: ServersyncProcess) -> int:
    """How many failed deliveries the consumer logged so far."""
    process.assert_alive()
    return process.log().count("failed (attempt")


# -- against a real cluster ----------------------------------------------------------------------


async def drain(backend_dsn: str, tmp_path: Path, entities: int, each: int, batch: int) -> None:
    async with nats_cluster(tmp_path) as cluster:
        path = consumers_file(tmp_path, declaration(cluster.urls))
        await write_events(backend_dsn, entities, each)
        with Processes(tmp_path) as processes:
            consumer = start_consumer(processes, backend_dsn, path, SYNC_BATCH_SIZE=str(batch))
            await consumer.wait_log(f"stream {STREAM} created", timeout=30)
            await wait_caught_up(backend_dsn, NAME, timeout=30 + entities * each / 500)
            assert await consumer.stop() == 0
        messages = await assert_exactly_once_in_order(backend_dsn, cluster)
        assert len(messages) == entities * each
        info = await cluster.stream_info(STREAM)
        config = info["config"]
        assert (config["num_replicas"], config["retention"], config["subjects"]) == (
            3,
            "limits",
            [f"{PREFIX}.>"],
        )
        # The default window covers a retry at SYNC_RETRY_MAX_SEC.
        assert config["duplicate_window"] == 300 * 10**9
        # Every message is on every node.
        assert len(info["cluster"]["replicas"]) == 2


async def test_a_drain_lands_each_event_once_in_order_per_entity(
    backend_dsn: str, tmp_path: Path
) -> None:
    # 50 entities, 40 events each, batches of 100: every batch holds two events of each entity,
    # so the second waits for the first's acknowledgement while the others go on.
    await drain(backend_dsn, tmp_path, entities=50, each=40, batch=100)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_a_drain_of_100000_events(backend_dsn: str, tmp_path: Path) -> None:
    await drain(backend_dsn, tmp_path, entities=1000, each=100, batch=2000)


async def test_a_consumer_killed_mid_batch_leaves_each_event_once(
    backend_dsn: str, tmp_path: Path
) -> None:
    async with nats_cluster(tmp_path) as cluster:
        path = consumers_file(tmp_path, declaration(cluster.urls))
        await write_events(backend_dsn, entities=50, each=40)
        with Processes(tmp_path) as processes:
            # Killed once half of its first batch is acknowledged, before the offset commits.
            first = start_consumer(
                processes,
                backend_dsn,
                path,
                "killed",
                SERVERSYNC_FAILPOINTS=f"{jetstream.MID_BATCH_FAILPOINT}=kill",
            )
            assert await first.wait_exit(30) == -signal.SIGKILL
            committed = await offset(backend_dsn, NAME)
            stored = await cluster.messages(STREAM)
            # Part of the batch is in the stream, beyond the committed offset: the next leader
            # publishes it again.
            assert 50 <= len(stored) <= 100
            assert committed is None or all(m.entry["seq"] > committed.seq for m in stored)
            second = start_consumer(processes, backend_dsn, path, "restarted")
            await wait_caught_up(backend_dsn, NAME, timeout=60)
            assert await second.stop() == 0
        await assert_exactly_once_in_order(backend_dsn, cluster)


async def test_a_node_killed_mid_drain_loses_and_doubles_nothing(
    backend_dsn: str, tmp_path: Path
) -> None:
    async with nats_cluster(tmp_path) as cluster:
        path = consumers_file(tmp_path, declaration(cluster.urls))
        await write_events(backend_dsn, entities=50, each=20, tag="a")
        with Processes(tmp_path) as processes:
            consumer = start_consumer(processes, backend_dsn, path, SYNC_BATCH_SIZE="20")
            await wait_until(
                lambda: stored_some(cluster), timeout=30, what="the first messages in the stream"
            )
            # The stream's leader dies while batches are in flight; the second half of the
            # events is written after, so the drain must go through the failover.
            cluster.kill(await cluster.stream_leader(STREAM))
            await write_events(backend_dsn, entities=50, each=20, tag="b")
            await wait_caught_up(backend_dsn, NAME, timeout=90)
            consumer.assert_alive()
            assert await consumer.stop() == 0
        messages = await assert_exactly_once_in_order(backend_dsn, cluster)
        assert len(messages) == 2000


async def test_a_stream_reads_back_while_a_killed_meta_leader_is_replaced(
    tmp_path: Path,
) -> None:
    # The tests read a stream back right after killing a node; when that node led the
    # cluster's metadata, the reader is made once its successor is elected.
    async with nats_cluster(tmp_path) as cluster:
        await create_stream(cluster, jetstream.StreamSpec(STREAM, PREFIX, 3, "limits", 0, 300))
        async with connected(cluster.urls) as nc:
            js = nc.jetstream(timeout=10)
            for number in range(5):
                await js.publish(f"{PREFIX}.note.upsert", orjson.dumps({"n": number}))
        cluster.kill(await cluster.meta_leader())
        messages = await cluster.messages(STREAM)
        assert [orjson.loads(m.body) for m in messages] == [{"n": n} for n in range(5)]


async def test_without_quorum_the_offset_holds_and_the_drain_resumes(
    backend_dsn: str, tmp_path: Path
) -> None:
    async with nats_cluster(tmp_path) as cluster:
        path = consumers_file(tmp_path, declaration(cluster.urls))
        await write_events(backend_dsn, entities=50, each=20, tag="a")
        with Processes(tmp_path) as processes:
            consumer = start_consumer(processes, backend_dsn, path)
            held = await wait_caught_up(backend_dsn, NAME, timeout=30)
            leader = await cluster.stream_leader(STREAM)
            down = [leader, next(node for node in cluster.nodes if node is not leader)]
            for node in down:
                cluster.kill(node)
            await write_events(backend_dsn, entities=50, each=20, tag="b")
            # The consumer fails and retries, and its offset stays where the stream's quorum
            # left it.
            await wait_until(lambda: failing(backend_dsn), timeout=30, what="a failed delivery")
            failed = await failed_attempts(backend_dsn, consumer)
            await wait_more_failures(backend_dsn, consumer, failed + 2)
            last_seq = await fetch_value(
                backend_dsn,
                "SELECT last_seq FROM sync.consumer_offsets WHERE consumer = %s",
                (NAME,),
            )
            assert (await offset(backend_dsn, NAME), last_seq) == (held, held.seq)
            # The nodes come back; the drain finishes by itself.
            await cluster.start(down)
            await wait_caught_up(backend_dsn, NAME, timeout=90)
            consumer.assert_alive()
            assert await consumer.stop() == 0
        messages = await assert_exactly_once_in_order(backend_dsn, cluster)
        assert len(messages) == 2000


async def wait_more_failures(dsn: str, process: ServersyncProcess, count: int) -> None:
    """Until the consumer logged `count` failed deliveries."""

    async def enough() -> bool:
        return await failed_attempts(dsn, process) >= count

    await wait_until(enough, timeout=60, interval=0.1, what=f"{count} failed deliveries")


async def test_a_message_too_large_is_parked_and_the_rest_delivered(
    backend_dsn: str, tmp_path: Path
) -> None:
    # Each server takes messages of up to 64 KiB; the stream, made beforehand with the declared
    # settings, stores messages of up to 16 KiB (a setting serversync does not set).
    async with nats_cluster(tmp_path, max_payload=64 * 1024) as cluster:
        spec = jetstream.StreamSpec(STREAM, PREFIX, 3, "limits", 0, 300)
        await create_stream(cluster, spec, max_msg_size=16 * 1024)
        path = consumers_file(tmp_path, declaration(cluster.urls))
        enqueue = "SELECT sync.enqueue('note', %s, json_build_object('text', %s::text))"
        for entity, size in [("n1", 10), ("n2", 20_000), ("n3", 10), ("n4", 100_000)] + [
            (f"m{i}", 100) for i in range(40)
        ]:
            await execute(backend_dsn, enqueue, params=(entity, "x" * size))
        with Processes(tmp_path) as processes:
            consumer = start_consumer(processes, backend_dsn, path, SYNC_BATCH_SIZE="50")
            await consumer.wait_log(f"stream {STREAM} found with the declared settings")
            await wait_caught_up(backend_dsn, NAME, timeout=30)
            assert await consumer.stop() == 0
        parked = {letter.entity_id: letter for letter in await dead_letters(backend_dsn, NAME)}
        assert set(parked) == {"n2", "n4"}
        assert parked["n2"].error_code == "JS_10054"
        assert "max_msg_size" in parked["n2"].error_message
        assert parked["n4"].error_code == "NATS_MAX_PAYLOAD"
        messages = await cluster.messages(STREAM)
        assert [m.entry["entityId"] for m in messages] == ["n1", "n3"] + [
            f"m{i}" for i in range(40)
        ]
        assert all(m.subject == f"{PREFIX}.note.upsert" for m in messages)


async def test_an_existing_stream_with_other_settings_stops_the_start(
    backend_dsn: str, tmp_path: Path
) -> None:
    async with nats_cluster(tmp_path) as cluster:
        other = jetstream.StreamSpec(STREAM, PREFIX, 1, "interest", 3600, 60)
        await create_stream(cluster, other)
        # A server without authorization takes any login: the password is read and sent.
        password = "p4ssw0rd-of-the-consumer"  # noqa: S105 - a test's own
        path = consumers_file(
            tmp_path,
            declaration(cluster.urls, user='"sync"', password_env=f'"{PASSWORD_ENV}"'),
        )
        result = await run_cli(
            "run",
            NAME,
            env=cli_env(
                DATABASE_URL=backend_dsn, SYNC_CONSUMERS_FILE=str(path), **{PASSWORD_ENV: password}
            ),
        )
        line = assert_one_line_error(
            result,
            2,
            f"consumer {NAME}: stream {STREAM} exists with other settings",
            "replicas 1 (declared 3)",
            "retention interest (declared limits)",
            "max_age 1h (declared none)",
            "duplicate_window 1m (declared 5m)",
            "never changes an existing stream",
        )
        assert password not in line
        # Unchanged.
        config = (await cluster.stream_info(STREAM))["config"]
        assert (config["num_replicas"], config["retention"]) == (1, "interest")


def entries_batch(*seqs: int) -> Batch:
    """A batch of call_log upserts of entity 1 at these seqs."""
    entries = [
        {"entityType": "call_log", "entityId": "1", "op": "upsert", "seq": seq, "payload": {}}
        for seq in seqs
    ]
    return Batch(
        count=len(seqs),
        end=Position(1, max(seqs)),
        min_seq=min(seqs),
        max_seq=max(seqs),
        entries_json=orjson.dumps(entries),
    )


async def test_credentials_and_wrong_destinations_on_a_lone_server(
    backend_dsn: str, tmp_path: Path
) -> None:
    """One server that asks for a password: a wrong one stops the start and fails deliveries
    as a wrong destination, never showing the password; the right one makes the stream and
    delivers. Then the stream deleted, given other subjects, or another stream taking ours:
    each a wrong destination that holds the offset."""
    password = "nats-password-of-the-test"  # noqa: S105 - the test's own
    extra = f'authorization {{ user: "sync", password: "{password}" }}\n'
    credentials = {"user": "sync", "password": password}
    async with nats_cluster(tmp_path, size=1, extra=extra, credentials=credentials) as cluster:
        password_file = tmp_path / "password"
        password_file.write_text("not-the-password\n")
        path = consumers_file(
            tmp_path,
            declaration(
                cluster.urls, user='"sync"', password_file=f'"{password_file}"', replicas="1"
            ),
        )
        settings = make_settings(
            backend_dsn, "http://frontend:1", SYNC_CONSUMERS_FILE=str(path), SYNC_TIMEOUT_SEC=3
        )
        kind = kinds.consumer_kind(NAME, settings)
        assert kind.check is not None
        with pytest.raises(StartupError, match="Authorization Violation") as refused:
            await kind.check(settings)
        sink = kind.sink(settings, None)
        with pytest.raises(DeliveryError) as failed:
            await sink.deliver(entries_batch(1))
        await sink.close()
        assert (failed.value.failure, failed.value.code) == (Failure.WRONG_DESTINATION, "NATS_AUTH")
        assert "not-the-password" not in str(refused.value) + str(failed.value)

        password_file.write_text(f"{password}\n")
        await kind.check(settings)
        sink = kind.sink(settings, None)
        assert isinstance(sink, JetStreamSink)
        try:
            assert await sink.deliver(entries_batch(1, 2)) is Outcome.DELIVERED
            # Published again (a retry, a new leader): every message is a duplicate.
            assert await sink.deliver(entries_batch(1, 2)) is Outcome.ALREADY_PROCESSED
            assert await sink.deliver(entries_batch(2, 3)) is Outcome.DELIVERED
            messages = await cluster.messages(STREAM)
            source = await source_of(backend_dsn)
            assert [m.headers["Nats-Msg-Id"] for m in messages] == [
                f"{source}:{NAME}:{n}" for n in (1, 2, 3)
            ]

            async with connected(cluster.urls, **credentials) as nc:

                async def api(subject: str, body: dict[str, Any] | None = None) -> None:
                    answer = await jetstream.api_request(nc, subject, body, 5)
                    assert "error" not in answer, answer

                async def fails(code: str) -> None:
                    with pytest.raises(DeliveryError) as caught:
                        await sink.deliver(entries_batch(4))
                    assert (caught.value.failure, caught.value.code) == (
                        Failure.WRONG_DESTINATION,
                        code,
                    )

                await api(f"$JS.API.STREAM.DELETE.{STREAM}")
                await fails("JS_STREAM_NOT_FOUND")
                other_subjects = {**sink.stream.config(), "subjects": ["elsewhere.>"]}
                await api(f"$JS.API.STREAM.CREATE.{STREAM}", other_subjects)
                await fails("JS_SUBJECT_NOT_TAKEN")
                await api(f"$JS.API.STREAM.DELETE.{STREAM}")
                another = {**sink.stream.config(), "name": "ANOTHER"}
                await api("$JS.API.STREAM.CREATE.ANOTHER", another)
                await fails("JS_10060")
        finally:
            await sink.close()


def batch_of(*events: tuple[str, int]) -> Batch:
    """A batch of call_log upserts, one per (entity id, seq)."""
    entries = [
        {"entityType": "call_log", "entityId": entity, "op": "upsert", "seq": seq, "payload": {}}
        for entity, seq in events
    ]
    seqs = [seq for _, seq in events]
    return Batch(
        count=len(events),
        end=Position(1, max(seqs)),
        min_seq=min(seqs),
        max_seq=max(seqs),
        entries_json=orjson.dumps(entries),
    )


def lone_sink(
    cluster: NatsCluster,
    *,
    source: str | None = None,
    user: str | None = None,
    password: str | None = None,
) -> JetStreamSink:
    """A sink to the stream of a lone server (replicas 1); `source` starts its ids."""

    async def read_source() -> str:
        assert source is not None
        return source

    return JetStreamSink(
        NAME,
        connection=jetstream.JetStreamConnection(tuple(cluster.urls), user=user, password=password),
        stream=jetstream.StreamSpec(STREAM, PREFIX, 1, "limits", 0, 300),
        timeout_sec=30,
        source=read_source if source is not None else None,
    )


async def create_stream(cluster: NatsCluster, spec: jetstream.StreamSpec, **settings: Any) -> None:
    """Make the stream beforehand, as an operator would: `spec`'s settings, `settings` over them
    (JetStream's own names)."""
    async with connected(cluster.urls) as nc:
        config = {**spec.config(), **settings}
        created = await jetstream.api_request(nc, f"$JS.API.STREAM.CREATE.{spec.name}", config, 10)
    assert "error" not in created, created


async def make_stream(
    cluster: NatsCluster, user: str | None = None, password: str | None = None
) -> None:
    """The stream of `lone_sink`, made as a consumer's start makes it."""
    spec = jetstream.StreamSpec(STREAM, PREFIX, 1, "limits", 0, 300)
    connection = jetstream.JetStreamConnection(tuple(cluster.urls), user=user, password=password)
    made = await jetstream.prepare_stream(connection, spec, consumer=NAME, timeout=10)
    assert made == "created"


async def stream_ids(cluster: NatsCluster) -> list[str]:
    """The Nats-Msg-Id of every message in the stream, in stream order."""
    return [m.headers["Nats-Msg-Id"] for m in await cluster.messages(STREAM)]


async def test_what_a_cut_off_client_published_never_reaches_the_stream_later(
    tmp_path: Path,
) -> None:
    """A delivery while the server is gone fails at once and its client is closed: nothing it
    published is buffered and sent when the server is back (by then a new leader may have
    stored newer messages, and the window may be over)."""
    async with nats_cluster(tmp_path, size=1) as cluster:
        await make_stream(cluster)
        old = lone_sink(cluster)
        try:
            assert await old.deliver(entries_batch(1, 2)) is Outcome.DELIVERED
            assert old._link is not None
            nc = old._link.nc
            # A publication never waits in a buffer; the client pings every 15 s.
            assert nc.options["ping_interval"] == jetstream.PING_INTERVAL_SEC
            node = cluster.nodes[0]
            cluster.kill(node)
            await wait_until(lambda: not nc.is_connected, what="the client to miss the server")
            with pytest.raises(DeliveryError) as failed:
                await old.deliver(entries_batch(3, 4))
            assert (failed.value.failure, failed.value.code) == (
                Failure.UNAVAILABLE,
                "NATS_CONNECTION",
            )
            await cluster.start([node])
            # The client that was cut off is closed, not reconnected; had it reconnected, what
            # it held of seqs 3 and 4 would now be stored.
            await wait_until(
                lambda: nc.is_closed or nc.is_connected, what="the old client closed or back"
            )
            if nc.is_connected:
                await nc.flush()
            assert nc.is_closed
            assert await stream_ids(cluster) == [f"{NAME}:1", f"{NAME}:2"]
            # The next delivery connects anew.
            assert await old.deliver(entries_batch(3, 4)) is Outcome.DELIVERED
            assert await stream_ids(cluster) == [f"{NAME}:{n}" for n in (1, 2, 3, 4)]
        finally:
            await old.close()


async def test_two_databases_publish_one_consumer_name_to_one_stream(tmp_path: Path) -> None:
    """Each id starts with the database's source: the same consumer name on two nodes stores
    both nodes' events, none dropped as the other's duplicate. And an entity id as long as
    JetStream's 64 KiB header limit allows is stored; one byte more is refused before sending."""
    async with nats_cluster(tmp_path, size=1) as cluster:
        await make_stream(cluster)
        node_a, node_b = lone_sink(cluster, source="node-a"), lone_sink(cluster, source="node-b")
        try:
            assert await node_a.deliver(entries_batch(1, 2)) is Outcome.DELIVERED
            assert await node_b.deliver(entries_batch(1, 2)) is Outcome.DELIVERED
            assert await node_b.deliver(entries_batch(2)) is Outcome.ALREADY_PROCESSED
            assert await stream_ids(cluster) == [
                f"{node}:{NAME}:{seq}" for node in ("node-a", "node-b") for seq in (1, 2)
            ]
            assert jetstream.message_id("node-a", NAME, 7) == f"node-a:{NAME}:7"

            def longest(extra: int) -> Batch:
                # The headers of an entity id of no characters, and what is left to the limit.
                base = node_a._message(batch_of(("", 3)).raw_entries()[0]).header_size()
                return batch_of(("k" * (jetstream.MAX_HEADER_BYTES - base + extra), 3))

            with pytest.raises(DeliveryError) as refused:
                await node_a.deliver(longest(1))
            assert (refused.value.failure, refused.value.code) == (
                Failure.REFUSED,
                "NATS_HEADER_SIZE",
            )
            assert await node_a.deliver(longest(0)) is Outcome.DELIVERED
            assert len(await stream_ids(cluster)) == 5
        finally:
            await node_a.close()
            await node_b.close()


async def test_a_permission_the_server_refuses_fails_at_once_as_a_wrong_destination(
    tmp_path: Path,
) -> None:
    """A user that may not publish to the subjects, or may not subscribe to the replies: the
    delivery fails at once (not after the timeout) as a wrong destination."""
    extra = f"""
authorization {{
  users = [
    {{ user: admin, password: "admin-pw" }}
    {{ user: nopub, password: "nopub-pw", permissions: {{ publish: {{ deny: ["{PREFIX}.>"] }} }} }}
    {{ user: nosub, password: "nosub-pw", permissions: {{ subscribe: {{ deny: ["_INBOX.>"] }} }} }}
  ]
}}
"""
    admin = {"user": "admin", "password": "admin-pw"}
    async with nats_cluster(tmp_path, size=1, extra=extra, credentials=admin) as cluster:
        await make_stream(cluster, **admin)
        for user in ("nopub", "nosub"):
            js = lone_sink(cluster, user=user, password=f"{user}-pw")
            try:
                for _attempt in range(2):
                    with pytest.raises(DeliveryError) as refused:
                        # Well within the sink's own timeout of 30 s.
                        await asyncio.wait_for(js.deliver(entries_batch(1)), 10)
                    assert (refused.value.failure, refused.value.code) == (
                        Failure.WRONG_DESTINATION,
                        "NATS_PERMISSION",
                    ), (user, refused.value)
                    assert "permissions violation" in str(refused.value)
            finally:
                await js.close()


async def test_the_source_is_the_node_name_or_the_database_s_identity(backend_dsn: str) -> None:
    unnamed = await database_source(backend_dsn, NAME)
    system_identifier = await fetch_value(
        backend_dsn, "SELECT system_identifier::text FROM pg_control_system()"
    )
    oid = await fetch_value(
        backend_dsn, "SELECT oid::text FROM pg_database WHERE datname = current_database()"
    )
    assert unnamed == f"{system_identifier}.{oid}"
    await execute(backend_dsn, "SELECT sync.set_node_name('node-a')")
    assert await database_source(backend_dsn, NAME) == "node-a"
    with pytest.raises(DeliveryError) as failed:
        await database_source("host=127.0.0.1 port=9 dbname=none connect_timeout=1", NAME)
    assert (failed.value.failure, failed.value.code) == (Failure.UNAVAILABLE, "DB_UNAVAILABLE")


# -- in-process ---------------------------------------------------------------------------------


def test_subject_tokens_keep_plain_names_and_escape_every_other_byte() -> None:
    token = jetstream.subject_token
    assert token("call_log") == "call_log"
    assert token("Call-Log_2") == "Call-Log_2"
    assert token("a.b") == "a~2Eb"
    assert token("x y*>~") == "x~20y~2A~3E~7E"
    assert token("é\n\x00") == "~C3~A9~0A~00"
    assert token("") == "~"
    names = ["a.b", "a~2Eb", "a_b", "a-b", "", "~", "a b", "a\tb", "ä", "a" * 100]
    tokens = [token(name) for name in names]
    assert len(set(tokens)) == len(names)
    for made in tokens:
        assert made and all(c.isascii() and c.isprintable() and c not in ".*> " for c in made)
    assert jetstream.subject_of("p.q", "call.log", "up sert") == "p.q.call~2Elog.up~20sert"


def test_header_values_are_printable_ascii_and_reversible() -> None:
    for text in ["42", "a b", "line\r\nInjected: yes", "100%", "ü-ß", " lead"]:
        value = jetstream.header_value(text)
        assert all(0x21 <= ord(c) <= 0x7E for c in value)
        assert unquote(value) == text
    assert jetstream.header_value("550e8400-e29b-41d4") == "550e8400-e29b-41d4"


def test_stream_subjects_match_like_nats() -> None:
    match = jetstream.subject_matches
    assert match("events.>", "events.call_log.upsert")
    assert not match("events.>", "events")
    assert match("events.*.upsert", "events.call_log.upsert")
    assert not match("events.*.upsert", "events.call_log.delete")
    assert not match("events.*", "events.call_log.upsert")
    assert not match("other.>", "events.call_log.upsert")


def sink(timeout: float = 1) -> JetStreamSink:
    """A sink whose server is nowhere (port 9) unless the test gives it a client."""
    return JetStreamSink(
        NAME,
        connection=jetstream.JetStreamConnection(("nats://127.0.0.1:9",)),
        stream=jetstream.StreamSpec(STREAM, PREFIX, 3, "limits", 0, 300),
        timeout_sec=timeout,
    )


REFUSED, WRONG, PASSES = Failure.REFUSED, Failure.WRONG_DESTINATION, Failure.UNAVAILABLE


@pytest.mark.parametrize(
    ("code", "err_code", "failure"),
    [
        # Over the stream's max_msg_size, or headers over 64 KiB: the content is refused
        # (parked, found by bisection).
        (400, 10054, REFUSED),
        (400, 10097, REFUSED),
        # The subject is another stream's, or the stream is gone: a wrong destination.
        (400, 10060, WRONG),
        (404, 10059, WRONG),
        # Stream full (discard new), no quorum, storage trouble: it passes.
        (503, 10077, PASSES),
        (503, 10008, PASSES),
        (500, 10049, PASSES),
        # An error nothing here expects holds the offset, loudly.
        (400, 10999, WRONG),
    ],
)
def test_each_jetstream_answer_means_one_failure(
    code: int, err_code: int, failure: Failure
) -> None:
    js = sink()
    error = {"code": code, "err_code": err_code, "description": f"what went wrong {err_code}"}
    message = js._message(
        b'{"entityType":"call_log","entityId":"7","op":"upsert","seq":5,"payload":{}}'
    )
    refusal = js._refusal(message, error)
    assert refusal.failure is failure
    assert refusal.code == f"JS_{err_code}"
    assert f"what went wrong {err_code}" in str(refusal)
    assert message.headers == {
        "Nats-Msg-Id": f"{NAME}:5",
        "Nats-Expected-Stream": STREAM,
        "Serversync-Entity-Id": "7",
    }


def test_durations() -> None:
    parse = parse_duration
    assert parse("2m") == 120
    assert parse("1h30m") == 5400
    assert parse("7d") == 7 * 86400
    assert parse("500ms") == 0.5
    for bad in ["", "2", "2 m", "-1s", "0s", "1w", "m"]:
        with pytest.raises(ValueError, match="duration"):
            parse(bad)
    assert jetstream.format_duration(5400) == "1h30m"
    assert jetstream.format_duration(0.5) == "500ms"
    assert jetstream.format_duration(0) == "none"


def test_a_declared_jetstream_consumer_becomes_its_kind(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("  the-token-value  \n")
    path = consumers_file(
        tmp_path,
        declaration(
            ["nats://n1:4222", "tls://n2:4222"],
            token_file=f'"{token_file}"',
            entity_types='["call_log"]',
            target_node='"frontend"',
            max_age='"7d"',
            replicas="5",
            retention='"workqueue"',
            duplicate_window='"10m"',
        )
        + '\n[consumers.plain]\nsink = "null"\n',
    )
    settings = make_settings(
        "dbname=unused", "http://frontend:1", SYNC_CONSUMERS_FILE=str(path), SYNC_TIMEOUT_SEC=7
    )
    kind = kinds.consumer_kind(NAME, settings)
    assert kind.one_batch_at_a_time
    assert kind.batches_in_flight(settings) == 1
    assert kind.entry_filter(settings) == EntryFilter(frozenset({"call_log"}), "frontend")
    kind.check_settings(settings)
    made = kind.sink(settings, None)
    assert isinstance(made, JetStreamSink)
    assert made.name == NAME
    assert made.connection.token == "the-token-value"  # noqa: S105 - the test's own
    assert made.connection.servers == ("nats://n1:4222", "tls://n2:4222")
    assert made.stream == jetstream.StreamSpec(STREAM, PREFIX, 5, "workqueue", 7 * 86400, 600)
    assert "the-token-value" not in repr(made) + repr(made.connection)
    assert "the-token-value" not in repr(declared.load(path))
    assert list(declared.load(path)) == [NAME, "plain"]

    # A password from its variable, read when the sink is made.
    path.write_text(
        declaration(["nats://n1:4222"], user='"sync"', password_env=f'"{PASSWORD_ENV}"')
    )
    with pytest.raises(ConfigError, match=f"consumer {NAME}: {PASSWORD_ENV} is not set"):
        kinds.consumer_kind(NAME, settings).check_settings(settings)


# (keys added to the declaration, what the one line says)
BAD_DECLARATIONS: list[tuple[dict[str, str], list[str]]] = [
    ({"url": '"http://x"'}, [f"consumers.{NAME}: unknown key 'url'"]),
    ({"stream": '"a.b"'}, [f"consumers.{NAME}.stream"]),
    ({"stream": ""}, [f"consumers.{NAME}.stream", "Field required"]),
    ({"subject_prefix": '"a..b"'}, [f"consumers.{NAME}.subject_prefix"]),
    ({"subject_prefix": '"a.>"'}, [f"consumers.{NAME}.subject_prefix"]),
    ({"replicas": "0"}, [f"consumers.{NAME}.replicas"]),
    ({"replicas": "6"}, [f"consumers.{NAME}.replicas"]),
    ({"retention": '"forever"'}, [f"consumers.{NAME}.retention"]),
    ({"max_age": '"a week"'}, [f"consumers.{NAME}.max_age", "duration"]),
    ({"duplicate_window": '"10m"', "max_age": '"5m"'}, ["may not be longer than max_age"]),
    # The default window, 5m, is longer than this max_age.
    ({"max_age": '"2m"'}, ["duplicate_window (5m unless declared) may not be longer"]),
    ({"user": '"u"'}, ["user goes with password_env or password_file"]),
    ({"password_env": '"P"'}, ["user goes with password_env or password_file"]),
    ({"user": '"u"', "password_env": '"P"', "token_env": '"T"'}, ["one way to log in"]),
    ({"token_env": '"T"', "token_file": '"/t"'}, ["token_env or token_file, not both"]),
    ({"tls_cert_file": '"/c"'}, ["tls_cert_file and tls_key_file go together"]),
    ({"password_env": '"not a name"', "user": '"u"'}, [f"consumers.{NAME}.password_env"]),
]


def test_a_wrong_jetstream_declaration_is_one_line(tmp_path: Path) -> None:
    for number, (keys, fragments) in enumerate(BAD_DECLARATIONS):
        path = tmp_path / f"consumers-{number}.toml"
        path.write_text(declaration(["nats://n1:4222"], **keys))
        with pytest.raises(ConfigError) as caught:
            declared.load(path)
        message = str(caught.value)
        assert "\n" not in message
        for fragment in fragments:
            assert fragment in message, (keys, message)
    for servers, fragment in [
        ([], "at least 1"),
        (["http://n1:4222"], "server 1 is not a nats://host:port"),
        (["nats://n1:4222", "nats://user:hunter2@n2:4222"], "server 2 has credentials"),
        (["nats://n1:4222/path"], "server 1 has a path"),
    ]:
        path = tmp_path / "servers.toml"
        path.write_text(declaration(servers))
        with pytest.raises(ConfigError, match=fragment) as caught:
            declared.load(path)
        assert "hunter2" not in str(caught.value)


def test_a_sink_that_does_not_exist_is_told_with_every_sink(tmp_path: Path) -> None:
    path = consumers_file(tmp_path, '[consumers.x]\nsink = "jetstrem"\nurl = "http://a"\n')
    with pytest.raises(ConfigError) as caught:
        declared.load(path)
    assert "consumers.x.sink:" in str(caught.value)
    assert "'json', 'recording-upload', 'null' or 'jetstream'" in str(caught.value)


def test_without_nats_py_a_jetstream_consumer_says_which_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = consumers_file(tmp_path, declaration(["nats://n1:4222"]))
    settings = make_settings("dbname=unused", "http://frontend:1", SYNC_CONSUMERS_FILE=str(path))
    # Resolving the consumer needs no nats-py; checking its settings does, and says so.
    kind = kinds.consumer_kind(NAME, settings)
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "nats" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"needs nats-py.*serversync\[jetstream\]"):
        kind.check_settings(settings)


# -- in-process, with a client of the test's own -------------------------------------------------


@dataclass
class Published:
    """One publication the fake client took."""

    subject: str
    reply: str
    headers: dict[str, str]
    body: bytes

    @property
    def seq(self) -> int:
        seq: int = orjson.loads(self.body)["seq"]
        return seq


class FakeClient:
    """A connected nats-py client as the sink uses it: publications recorded, and replies,
    errors and losses of the connection made by the test."""

    max_payload = 1024 * 1024

    def __init__(
        self,
        on_error: Callable[[Exception], None],
        on_lost: Callable[[], None],
        subscribe_error: Exception | None = None,
        ack_after: float | None = None,
    ) -> None:
        self.on_error = on_error
        self.on_lost = on_lost
        self.subscribe_error = subscribe_error
        self.published: list[Published] = []
        # What happened, in order: ("sent", seq) and ("acked", seq).
        self.log: list[tuple[str, int]] = []
        self.is_connected = True
        self.is_closed = False
        self.last_error: Exception | None = None
        self.callback: Callable[[Msg], Awaitable[None]] | None = None
        # Seconds after which each publication is acknowledged by itself; None: by the test.
        self.ack_after = ack_after
        self.never_ack: set[int] = set()
        self._pending: list[bytes] = []
        self._pending_data_size = 0

    def new_inbox(self) -> str:
        return "_INBOX.fake"

    async def subscribe(self, subject: str, cb: Callable[[Msg], Awaitable[None]]) -> None:
        if self.subscribe_error is not None:
            raise self.subscribe_error
        assert subject == "_INBOX.fake.*"
        self.callback = cb

    async def publish(
        self, subject: str, payload: bytes, reply: str, headers: dict[str, str]
    ) -> None:
        if not self.is_connected:
            raise nats.errors.OutboundBufferLimitError
        published = Published(subject, reply, headers, payload)
        self.published.append(published)
        self.log.append(("sent", published.seq))
        if self.ack_after is not None and published.seq not in self.never_ack:
            asyncio.get_running_loop().call_later(
                self.ack_after, lambda: asyncio.ensure_future(self.ack(published.seq))
            )

    async def ack(self, seq: int, answer: Any = None) -> None:
        """Answer the publication of `seq`: the stream's acknowledgement, or `answer` (bytes
        as they are, anything else as JSON)."""
        published = next(p for p in self.published if p.seq == seq)
        if answer is None:
            answer = {"stream": STREAM, "seq": seq}
        data = answer if isinstance(answer, bytes) else orjson.dumps(answer)
        self.log.append(("acked", seq))
        assert self.callback is not None
        await self.callback(Msg(_client=cast(Any, self), subject=published.reply, data=data))

    def lose(self, error: Exception | None = None) -> None:
        """The connection is lost (reconnecting), or closed by the client after `error`."""
        self.is_connected = False
        if error is not None:
            self.is_closed = True
            self.last_error = error
        self.on_lost()

    async def close(self) -> None:
        self.is_connected = False
        self.is_closed = True
        self.on_lost()

    def sent(self) -> list[int]:
        return [p.seq for p in self.published]


class FakeClients(list[FakeClient]):
    """Every client the sink made, in order; `subscribe_error` and `ack_after` for the next
    ones."""

    subscribe_error: Exception | None = None
    ack_after: float | None = None

    @property
    def last(self) -> FakeClient:
        assert self, "no client made yet"
        return self[-1]

    def have(self, made: int, sent: int) -> bool:
        """Whether the sink made `made` clients, the last of which took `sent` publications."""
        return len(self) == made and len(self[-1].published) >= sent


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> FakeClients:
    """The sink's connections are FakeClients."""
    made = FakeClients()

    async def connect(
        _connection: jetstream.JetStreamConnection,
        *,
        on_error: Callable[[Exception], None],
        on_lost: Callable[[], None],
        **_options: Any,
    ) -> FakeClient:
        client = FakeClient(on_error, on_lost, made.subscribe_error, made.ack_after)
        made.append(client)
        return client

    monkeypatch.setattr(jetstream, "connect", connect)
    return made


async def settled(delivery: asyncio.Task[Outcome], timeout: float = 5) -> DeliveryError:
    """The DeliveryError the delivery ends with, within `timeout` (a test's bound, far below
    the sink's own timeout: the failure comes at once)."""
    done, _ = await asyncio.wait({delivery}, timeout=timeout)
    assert done, f"the delivery did not end within {timeout}s"
    error = delivery.exception()
    assert isinstance(error, DeliveryError), repr(error)
    return error


async def test_an_entity_s_next_message_waits_for_its_ack_while_others_go_out(
    clients: FakeClients,
) -> None:
    js = sink(timeout=30)
    delivery = asyncio.create_task(
        js.deliver(batch_of(("a", 1), ("b", 2), ("a", 3), ("c", 4), ("a", 5)))
    )
    await wait_until(lambda: clients.have(1, 3), what="3 sent")
    client = clients.last
    # a's second and third wait for its first's acknowledgement; b and c go out meanwhile.
    assert client.sent() == [1, 2, 4]
    await client.ack(2)
    await client.ack(4)
    await client.ack(1)
    await wait_until(lambda: len(client.published) == 4, what="a's second sent")
    await client.ack(3)
    await wait_until(lambda: len(client.published) == 5, what="a's third sent")
    await client.ack(5)
    assert await delivery is Outcome.DELIVERED
    assert client.log == [
        ("sent", 1),
        ("sent", 2),
        ("sent", 4),
        ("acked", 2),
        ("acked", 4),
        ("acked", 1),
        ("sent", 3),
        ("acked", 3),
        ("sent", 5),
        ("acked", 5),
    ]
    # Each entity's messages went out in batch order.
    assert [p.seq for p in client.published if orjson.loads(p.body)["entityId"] == "a"] == [1, 3, 5]


async def test_each_message_has_the_timeout_from_its_own_sending(clients: FakeClients) -> None:
    """30 messages of one entity, each acknowledged 20 ms after it is sent: 0.6 s in all, with
    a timeout of 0.2 s for each acknowledgement."""
    js = sink(timeout=0.2)
    clients.ack_after = 0.02
    assert await js.deliver(batch_of(*(("a", seq) for seq in range(1, 31)))) is Outcome.DELIVERED
    assert clients.last.sent() == list(range(1, 31))
    # One acknowledgement that never comes: its message's time runs out, and says so.
    clients.last.never_ack = {33}
    with pytest.raises(DeliveryError) as late:
        await js.deliver(batch_of(*(("a", seq) for seq in range(31, 36))))
    assert late.value.code == "NATS_TIMEOUT"
    assert "seq 33 within 0.2s of its sending (2 of the batch's 5 messages acknowledged)" in str(
        late.value
    )


async def test_a_lost_or_closed_connection_fails_the_delivery_at_once(
    clients: FakeClients,
) -> None:
    js = sink(timeout=60)
    # Lost while acknowledgements are awaited: the delivery fails at once, and the client,
    # not connected, is closed (never left to reconnect and send what it holds).
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1), ("b", 2))))
    await wait_until(lambda: clients.have(1, 2), what="2 sent")
    clients.last.lose()
    error = await settled(delivery)
    assert (error.failure, error.code) == (Failure.UNAVAILABLE, "NATS_CONNECTION")
    assert clients.last.is_closed
    # The next delivery connects anew; the client closes after an -ERR: the same, saying why.
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(2, 1), what="a new client")
    clients.last.lose(nats.errors.Error("nats: 'maximum subscriptions exceeded'"))
    error = await settled(delivery)
    assert error.code == "NATS_CONNECTION"
    assert "maximum subscriptions exceeded" in str(error)
    # Lost while no delivery runs (the client reconnecting): the next delivery fails at once,
    # nothing held back for later, and closes it.
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(3, 1), what="a third client")
    await clients.last.ack(1)
    assert await delivery is Outcome.DELIVERED
    clients.last.lose()
    with pytest.raises(DeliveryError) as failed:
        await js.deliver(batch_of(("a", 2)))
    assert (failed.value.code, len(clients), clients.last.is_closed) == ("NATS_CONNECTION", 3, True)
    await js.close()


async def test_a_refused_permission_fails_at_once_and_the_connection_is_not_used_again(
    clients: FakeClients,
) -> None:
    js = sink(timeout=60)
    refused = nats.errors.Error('nats: permissions violation for publish to "events.x.upsert"')
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(1, 1), what="1 sent")
    clients.last.on_error(refused)
    error = await settled(delivery)
    assert (error.failure, error.code) == (Failure.WRONG_DESTINATION, "NATS_PERMISSION")
    assert "permissions violation for publish" in str(error)
    # Refused before anything is sent (a subscription denied, say): the first send fails.
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(2, 1), what="a new client")
    clients.last.on_error(refused)
    error = await settled(delivery)
    assert error.code == "NATS_PERMISSION"
    assert clients[0].is_closed
    # An error that is not about permissions leaves the connection alone.
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(3, 1), what="a third client")
    clients.last.on_error(nats.errors.Error("nats: slow consumer"))
    await clients.last.ack(1)
    assert await delivery is Outcome.DELIVERED
    await js.close()


async def test_closing_the_sink_fails_a_delivery_still_running(clients: FakeClients) -> None:
    js = sink(timeout=60)
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1), ("a", 2))))
    await wait_until(lambda: clients.have(1, 1), what="1 sent")
    await js.close()
    error = await settled(delivery)
    assert (error.failure, error.code) == (Failure.UNAVAILABLE, "SINK_CLOSED")
    assert not delivery.cancelled()
    assert clients.last.is_closed
    assert clients.last.sent() == [1]


@pytest.mark.parametrize(
    "answer",
    [
        b"[]",
        b'"ok"',
        b"not json",
        {"stream": "ANOTHER", "seq": 1},
        {"stream": STREAM},
        {"stream": STREAM, "seq": "1"},
        {"error": "no"},
    ],
)
async def test_an_answer_that_is_not_the_stream_s_acknowledgement_is_a_wrong_destination(
    clients: FakeClients, answer: Any
) -> None:
    js = sink(timeout=60)
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(1, 1), what="1 sent")
    await clients.last.ack(1, answer)
    error = await settled(delivery)
    assert (error.failure, error.code) == (Failure.WRONG_DESTINATION, "NATS_BAD_ANSWER")
    await js.close()


async def test_a_subscription_that_fails_closes_its_connection(clients: FakeClients) -> None:
    clients.subscribe_error = nats.errors.ConnectionClosedError()
    js = sink(timeout=60)
    with pytest.raises(DeliveryError) as failed:
        await js.deliver(batch_of(("a", 1)))
    assert failed.value.code == "NATS_CONNECTION"
    assert clients.last.is_closed
    clients.subscribe_error = None
    delivery = asyncio.create_task(js.deliver(batch_of(("a", 1))))
    await wait_until(lambda: clients.have(2, 1), what="a new client")
    await clients.last.ack(1)
    assert await delivery is Outcome.DELIVERED
    await js.close()


async def test_entity_ids_over_the_header_limit_are_refused_before_connecting() -> None:
    # The sink's server (port 9) is never asked: a connection would fail as unreachable.
    with pytest.raises(DeliveryError) as refused:
        await sink().deliver(batch_of(("k" * 70_000, 1)))
    assert (refused.value.failure, refused.value.code) == (Failure.REFUSED, "NATS_HEADER_SIZE")
    assert "over JetStream's limit of 65535 bytes" in str(refused.value)


async def test_a_connection_attempt_given_up_closes_its_socket() -> None:
    """A server that takes the TCP connection and never says a word: the attempt times out,
    and the half-made client's socket is closed (the server reads its end)."""
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()
        closed.set()
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        js = JetStreamSink(
            NAME,
            connection=jetstream.JetStreamConnection((f"nats://127.0.0.1:{port}",)),
            stream=jetstream.StreamSpec(STREAM, PREFIX, 1, "limits", 0, 300),
            timeout_sec=0.3,
        )
        with pytest.raises(DeliveryError) as failed:
            await js.deliver(batch_of(("a", 1)))
        assert (failed.value.failure, failed.value.code) == (
            Failure.UNAVAILABLE,
            "NATS_UNREACHABLE",
        )
        await asyncio.wait_for(closed.wait(), 5)
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize(
    ("error", "failure", "code"),
    [
        (
            ssl.SSLCertVerificationError(1, "certificate verify failed: self-signed certificate"),
            WRONG,
            "NATS_TLS",
        ),
        (ssl.SSLError(1, "no protocols available"), WRONG, "NATS_TLS"),
        (ssl.SSLEOFError(8, "EOF occurred in violation of protocol"), PASSES, "NATS_UNREACHABLE"),
        (nats.errors.AuthorizationError(), WRONG, "NATS_AUTH"),
        (ConnectionRefusedError(111, "Connection refused"), PASSES, "NATS_UNREACHABLE"),
    ],
)
def test_each_connection_failure_means_one_failure(
    error: Exception, failure: Failure, code: str
) -> None:
    assert jetstream._connect_failure(error) == (failure, code)


def test_a_refused_login_tells_why_an_attempt_failed_though_a_reset_came_after_it() -> None:
    """A server that refuses the login may also reset the socket: the attempt, cut by its
    bound after the reset, is still a wrong destination."""
    refused = nats.errors.Error("nats: 'Authorization Violation'")
    reset = ConnectionResetError(104, "Connection reset by peer")
    refused_then_reset = jetstream.connect_cause([refused, reset], TimeoutError())
    assert jetstream._connect_failure(refused_then_reset) == (WRONG, "NATS_AUTH")
    assert jetstream.connect_cause([reset], TimeoutError()) is reset
    assert jetstream.connect_cause([], TimeoutError()).__class__ is TimeoutError
    refused_at_once = nats.errors.AuthorizationError()
    assert jetstream.connect_cause([], refused_at_once) is refused_at_once
