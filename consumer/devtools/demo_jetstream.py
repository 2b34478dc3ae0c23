"""The demo's JetStream step, shown where a nats-server is installed (Debian's package puts it in
/usr/sbin) and nats-py is (the `jetstream` extra): a call log reaches a replicated JetStream
stream through a declared `sink = "jetstream"` consumer, and a downstream reader gets it back
through a durable pull consumer of its own (docs/jetstream.md). Without either, one line says
the step is skipped and why.

A three-node cluster, not a single server: replicas 3 is what a JetStream consumer is declared
with in production, and the three nodes start and elect their leaders in about a second on a
2-core machine, a small part of the demo's time. The servers live in the demo's temp dir and are
killed at the end of the step, whatever happened.
"""

from __future__ import annotations

import contextlib
import importlib.util
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from consumer.devtools.demo_processes import DemoCheckFailed
from consumer.devtools.demo_steps import DemoRun, fetch_one, require, say
from consumer.devtools.devdb import free_port
from consumer.store import admin
from consumer.store.queries import query

if TYPE_CHECKING:
    from nats.js.client import JetStreamContext

    from consumer.devtools.nats_cluster import NatsCluster

CONSUMER = "events-js"
STREAM = "SERVERSYNC"
PREFIX = "serversync"
REPLICAS = 3
# The downstream service's durable consumer: the stream remembers how far it read.
READER = "demo-reader"
SUBJECT = f"{PREFIX}.call_log.>"
# Where `run.processes.wait_for` looks again while a fetch waits (the fetch itself waits on the
# server up to this long for a message, so the loop does not spin).
FETCH_WAIT_SEC = 0.5


def missing() -> str | None:
    """Why the step cannot run here, or None when it can."""
    if importlib.util.find_spec("nats") is None:
        return "nats-py is not installed (pip install 'serversync[jetstream]'; make install has it)"
    from consumer.devtools.nats_cluster import (  # noqa: PLC0415 - nats-py, checked above
        INSTALL_HINT,
        nats_server_binary,
    )

    if nats_server_binary() is None:
        return f"no nats-server on PATH or in /usr/sbin ({INSTALL_HINT})"
    return None


def declaration(workdir: Path, servers: list[str]) -> Path:
    """The SYNC_CONSUMERS_FILE declaring events-js: call logs only, into STREAM."""
    path = workdir / "jetstream.toml"
    path.write_text(
        f"[consumers.{CONSUMER}]\n"
        'sink = "jetstream"\n'
        f"servers = {orjson.dumps(servers).decode()}\n"
        f'stream = "{STREAM}"\n'
        f'subject_prefix = "{PREFIX}"\n'
        f"replicas = {REPLICAS}\n"
        'entity_types = ["call_log"]\n'
    )
    return path


async def jetstream_step(run: DemoRun, env: dict[str, str], workdir: Path) -> None:
    """Start the cluster and `serversync run events-js`, write a call log, read it back from
    the stream with a durable pull consumer and check its subject, ids and body; the consumer
    is caught up and stopped, and the cluster gone, when this returns."""
    reason = missing()
    if reason is not None:
        say(f"JetStream step skipped: {reason}")
        return
    import nats.errors  # noqa: PLC0415 - the jetstream extra, checked by missing()

    from consumer.devtools.nats_cluster import (  # noqa: PLC0415 - the jetstream extra
        NatsServerError,
        nats_server_binary,
        running_cluster,
    )

    binary = nats_server_binary()
    assert binary is not None  # missing() said so
    starting = running_cluster(binary, workdir / "nats", cluster_name="serversync-demo")
    try:
        async with starting as cluster:
            await _publish_and_read_back(run, env, workdir, cluster)
    except (NatsServerError, nats.errors.Error) as exc:
        raise DemoCheckFailed(f"JetStream: {type(exc).__name__}: {exc}") from None


async def _publish_and_read_back(
    run: DemoRun, env: dict[str, str], workdir: Path, cluster: NatsCluster
) -> None:
    path = declaration(workdir, cluster.urls)
    say(
        f"JetStream: a {len(cluster.nodes)}-node nats-server cluster in {workdir / 'nats'}; "
        f"`serversync run {CONSUMER} --from-now` (declared in {path.name}: sink jetstream, "
        f"stream {STREAM}, {REPLICAS} replicas, call logs only)"
    )
    own = {**env, "SYNC_CONSUMERS_FILE": str(path), "SYNC_HTTP_PORT": str(free_port())}
    await run.processes.spawn(CONSUMER, ["run", CONSUMER, "--from-now"], own)
    try:

        async def leading() -> bool:
            row = await fetch_one(
                run.backend,
                "SELECT leader_pid IS NOT NULL FROM sync.consumer_offsets WHERE consumer = %s",
                (CONSUMER,),
            )
            return bool(row and row[0])

        # It made the stream (three replicas) before it took the lead.
        await run.processes.wait_for(leading, 30, f"{CONSUMER} to lead", interval=0.025)
        async with _reader(cluster) as reader:
            await _one_call_log(run, reader)
        info = await cluster.stream_info(STREAM)
        stored_on = 1 + len(info["cluster"].get("replicas") or [])
        require(stored_on == REPLICAS, f"stream {STREAM} is on {stored_on} server(s)")
        held = int(info["state"]["messages"])
        require(held == 1, f"stream {STREAM} holds {held} messages, not the one call log")

        async def caught_up() -> bool:
            rows = await admin.consumer_status(run.backend, CONSUMER)
            return bool(rows) and rows[0]["backlog"] == 0

        await run.processes.wait_for(caught_up, 10, f"{CONSUMER} to catch up")
        say(
            f"the call log is in stream {STREAM} once, on all {stored_on} servers, and "
            f"{READER} read it back; {CONSUMER} caught up"
        )
    finally:
        await run.processes.stop([CONSUMER])


@contextlib.asynccontextmanager
async def _reader(cluster: NatsCluster) -> AsyncIterator[Any]:
    """A downstream service's durable pull consumer of the call logs, as docs/jetstream.md
    shows it."""
    from nats.js.api import AckPolicy, ConsumerConfig  # noqa: PLC0415 - the jetstream extra

    from consumer.devtools.nats_cluster import connected  # noqa: PLC0415 - the jetstream extra

    async with connected(cluster.urls) as nc:
        js: JetStreamContext = nc.jetstream()
        yield await js.pull_subscribe(
            SUBJECT,
            durable=READER,
            stream=STREAM,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
        )


async def _one_call_log(run: DemoRun, reader: Any) -> None:
    """Write a call log, time it until the reader fetches it, check and print what it got."""
    import nats.errors  # noqa: PLC0415 - the jetstream extra

    started = time.monotonic()
    row = await fetch_one(
        run.backend,
        "INSERT INTO call_logs (caller_number, callee_number, status, summary) "
        "VALUES ('09011112222', '0312345678', 'completed', 'demo call to JetStream') "
        "RETURNING id::text",
    )
    call_id = row[0]
    fetched: list[Any] = []

    async def arrived() -> bool:
        with contextlib.suppress(nats.errors.TimeoutError):
            fetched.extend(await reader.fetch(batch=1, timeout=FETCH_WAIT_SEC))
        return bool(fetched)

    await run.processes.wait_for(arrived, 20, f"call log {call_id} from stream {STREAM}")
    latency = (time.monotonic() - started) * 1000
    msg = fetched[0]
    await msg.ack()
    seq_row = await fetch_one(
        run.backend,
        "SELECT seq FROM sync.events_outbox WHERE entity_type = 'call_log' AND entity_id = %s "
        "ORDER BY seq DESC LIMIT 1",
        (call_id,),
    )
    # The id starts with the database's node name, or its system identifier and oid while it
    # has none (consumer/app/jetstream_kind.py database_source reads the same query).
    node, system_identifier, oid = await fetch_one(run.backend, query("jetstream_source"))
    source = node if node is not None else f"{system_identifier}.{oid}"
    msg_id = (msg.headers or {}).get("Nats-Msg-Id")
    entry = orjson.loads(msg.data)
    expected = (f"{PREFIX}.call_log.upsert", f"{source}:{CONSUMER}:{seq_row[0]}", call_id)
    if (msg.subject, msg_id, entry.get("entityId")) != expected:
        raise DemoCheckFailed(
            f"stream {STREAM} gave subject {msg.subject}, Nats-Msg-Id {msg_id}, entityId "
            f"{entry.get('entityId')}; expected {', '.join(map(str, expected))}"
        )
    print(
        f"    call_log {call_id} read back by the durable JetStream consumer {READER} "
        f"(pull subscription) in {latency:.1f} ms",
        flush=True,
    )
    print(
        f"      subject {msg.subject}, Nats-Msg-Id {msg_id}; body: the wire entry "
        f"(entityId {entry['entityId']}, seq {entry['seq']})",
        flush=True,
    )
