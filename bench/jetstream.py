"""JetStream: a declared `sink = "jetstream"` consumer draining a backlog into a replicated
stream, against the publish loop a competent user would write with nats-py for the same job.

A three-node JetStream cluster (consumer/devtools/nats_cluster.py, Debian's nats-server) runs
beside PostgreSQL; the outbox holds a backlog of `events` call logs written through the relay
(bench/harness.py produce_calls). Then, `rounds` times, each in turn going first:

(a) the product: `serversync run bench-js`, declared in a SYNC_CONSUMERS_FILE with
    `sink = "jetstream"`, drains the whole backlog into a new stream of 3 replicas (created by
    the consumer at start, as in production);
(b) the publish loop: psycopg reads the same outbox rows in batches of the same size, each row
    becomes the same message (subject, Nats-Msg-Id, Nats-Expected-Stream, Serversync-Entity-Id,
    the wire entry of consumer/wire/entries.py as body), published with nats-py's
    `publish_async` into a new stream of the same settings. The loop keeps `window` batches
    in flight: it reads and publishes the next batch while the previous one's acknowledgements
    arrive, and commits an offset (as the product does) once every message of a batch is
    acknowledged. That is at-least-once relaying done well; it does none of what the product
    adds (leadership, gap-safe horizon waits, retries, parking, per-entity ordering across a
    failed batch), so it is the rate to beat.

Each run reports events/s and the CPU microseconds per event of the publisher (the consumer
process, or this process for the loop), PostgreSQL (its backends and background processes) and
the three nats-server processes. Each stream is checked to hold exactly `events` messages, the
first and last of which carry the same body and ids in both streams, and is deleted after its
run (its files would otherwise fill the disk across rounds). The goal: the product at least
1.0x the loop's events/s (report.py, `jetstream_drain_vs_publish_loop`).

Needs the `jetstream` extra (nats-py) and a nats-server binary; nats-py is imported only here,
inside the functions that use it, so that the other benchmarks run without it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import statistics
import subprocess
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
import psycopg

from bench import report
from bench.harness import (
    BenchEnv,
    bench_run,
    cpu_meter,
    execute,
    machine,
    outbox_end,
    produce_calls,
    progress,
    start_service,
    watch_drain,
)
from consumer.app import jetstream_kind
from consumer.core.events import Position
from consumer.store.db import connect_kwargs
from consumer.wire.entries import encode_entries

if TYPE_CHECKING:
    from nats.aio.client import Client as NATS

    from consumer.devtools.nats_cluster import NatsCluster

# The declared consumer; the loop's messages carry the same Nats-Msg-Id
# (<source>:<consumer>:<seq>, jetstream.message_id), so that both publish the same bytes. Its
# offset row is the loop's own.
CONSUMER = "bench-js"
LOOP_OFFSET = "bench-js-loop"
SIDES = ("product", "loop")
REPLICAS = 3
# The stream settings both sides' streams must share (checked after each run).
STREAM_SETTINGS = ("num_replicas", "retention", "max_age", "duplicate_window", "storage", "discard")
GOAL = 1.0
QUICK_EVENTS, FULL_EVENTS = 10_000, 100_000
QUICK_ROUNDS, FULL_ROUNDS = 2, 3
# Batches the loop keeps in flight: the next is read and published while the last one's
# acknowledgements come back.
LOOP_WINDOW = 2
# Polling the product's offset (as bench/drain.py does).
POLL_SEC = 0.02


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m bench jetstream`."""
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: {QUICK_EVENTS:,} events, {QUICK_ROUNDS} rounds (under a minute)",
    )
    p.add_argument("--events", type=int, help=f"backlog size (default {FULL_EVENTS:,})")
    p.add_argument(
        "--rounds",
        type=int,
        help=f"interleaved repeats, each figure their median (default {FULL_ROUNDS},"
        f" quick {QUICK_ROUNDS})",
    )
    p.add_argument("--batch-size", type=int, default=1000, help="both sides' batch (1000)")
    p.add_argument(
        "--window",
        type=int,
        default=LOOP_WINDOW,
        help=f"the loop's batches in flight (default {LOOP_WINDOW})",
    )
    report.add_run_arguments(p)


class NoNatsServerError(RuntimeError):
    """This machine cannot run the JetStream bench (no nats-server, or no nats-py)."""


def _requirements() -> str:
    """The nats-server binary; NoNatsServerError saying what is missing."""
    try:
        from consumer.devtools.nats_cluster import (  # noqa: PLC0415 - the jetstream extra
            INSTALL_HINT,
            nats_server_binary,
        )
    except ImportError:
        raise NoNatsServerError(
            "nats-py is not installed (pip install -e '.[jetstream]')"
        ) from None
    binary = nats_server_binary()
    if binary is None:
        raise NoNatsServerError(f"no nats-server binary on PATH or in /usr/sbin ({INSTALL_HINT})")
    return binary


def _version(binary: str) -> str:
    """What `nats-server --version` says ("nats-server: v2.9.10")."""
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
    return done.stdout.strip()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """`python -m bench jetstream`: measure, write the result, return it."""
    from consumer.devtools.nats_cluster import running_cluster  # noqa: PLC0415 - jetstream extra

    binary = _requirements()
    events = args.events or (QUICK_EVENTS if args.quick else FULL_EVENTS)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else FULL_ROUNDS)
    name = args.name or time.strftime("%Y%m%d-%H%M%S") + "-jetstream" + (
        "-quick" if args.quick else ""
    )
    version = await asyncio.to_thread(_version, binary)
    result: dict[str, Any] = {
        "name": name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {**machine(), "nats_server": version},
        "parameters": {
            "events": events,
            "rounds": rounds,
            "batch_size": args.batch_size,
            "window": args.window,
            "quick": args.quick,
            "replicas": REPLICAS,
        },
    }
    async with bench_run(result, private=args.private, keep_logs=args.keep_logs) as env:
        progress(f"jetstream: producing {events:,} events through the relay trigger")
        await produce_calls(env.backend, events)
        await execute(env.backend, "VACUUM ANALYZE sync.events_outbox")
        async with running_cluster(binary, env.workdir / "nats", size=REPLICAS) as cluster:
            progress(f"jetstream: {REPLICAS}-node cluster at {', '.join(cluster.urls)}")
            result["jetstream"] = await measure(
                env,
                cluster,
                events=events,
                rounds=rounds,
                batch=args.batch_size,
                window=args.window,
            )
    result["targets"] = report.targets(result)
    path = report.write(result, name, args.out)
    progress(f"wrote {path}")
    return result


async def measure(
    env: BenchEnv, cluster: NatsCluster, *, events: int, rounds: int, batch: int, window: int
) -> dict[str, Any]:
    """Both sides `rounds` times, alternating which goes first; each figure the median of its
    runs, and the ratios product / loop."""
    runs: dict[str, list[dict[str, Any]]] = {side: [] for side in SIDES}
    samples: dict[str, list[list[dict[str, Any]]]] = {side: [] for side in SIDES}
    order: list[list[str]] = []
    timeout = max(120.0, events / 500)
    for number in range(1, rounds + 1):
        sides = list(SIDES) if number % 2 else list(reversed(SIDES))
        order.append(sides)
        for side in sides:
            progress(f"jetstream: round {number}/{rounds}, {side}")
            if side == "product":
                run, sample = await product_run(
                    env, cluster, number, events=events, batch=batch, timeout=timeout
                )
            else:
                run, sample = await loop_run(env, cluster, number, batch, window)
            if run["stream"]["messages"] != events:
                raise RuntimeError(
                    f"the {side}'s stream holds {run['stream']['messages']:,} messages,"
                    f" expected {events:,}"
                )
            runs[side].append(run)
            samples[side].append(sample)
    figures: dict[str, Any] = {
        "events": events,
        "batch_size": batch,
        "window": window,
        "rounds": rounds,
        "replicas": REPLICAS,
        "order": order,
        "runs": runs,
        # Both sides stored the same first and last message (body, Nats-Msg-Id, entity id) in
        # every round, into streams of the same settings.
        "same_messages": all(
            p == lp for p, lp in zip(samples["product"], samples["loop"], strict=True)
        ),
        "same_stream_settings": all(
            run["stream"]["settings"] == runs["product"][0]["stream"]["settings"]
            for side in SIDES
            for run in runs[side]
        ),
    }
    for side in SIDES:
        figures[side] = _medians(runs[side])
    product, loop = figures["product"], figures["loop"]
    figures["ratios"] = {
        "events_per_sec": round(product["events_per_sec"] / loop["events_per_sec"], 3),
        "cpu_per_event": _ratio(
            (product["cpu_us_per_event"] or {}).get("total"),
            (loop["cpu_us_per_event"] or {}).get("total"),
        ),
    }
    figures["round_ratios"] = [
        round(p["events_per_sec"] / lp["events_per_sec"], 3)
        for p, lp in zip(runs["product"], runs["loop"], strict=True)
    ]
    return figures


def _ratio(top: float | None, bottom: float | None) -> float | None:
    return round(top / bottom, 3) if top is not None and bottom else None


def _medians(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A side's figure: the median events/s of its runs, and the median CPU per event of each
    part over the runs that measured it."""
    cpus = [run["cpu_us_per_event"] for run in runs if run["cpu_us_per_event"]]
    parts = list(cpus[0]) if cpus else []
    return {
        "events_per_sec": round(statistics.median(run["events_per_sec"] for run in runs), 1),
        "cpu_us_per_event": {
            part: round(statistics.median(cpu[part] for cpu in cpus), 2) for part in parts
        }
        or None,
    }


def _cpu_parts(cpu: dict[str, float], publisher: str) -> dict[str, float]:
    """A CpuMeter's figures in the parts the bench compares: the publisher, PostgreSQL (backends
    and background processes) and the nats-server processes; "bench monitor" (the polling
    connection's backend) left out."""
    parts = {
        publisher: cpu.get(publisher, 0.0),
        "postgres": sum(v for k, v in cpu.items() if k.startswith("postgres ")),
        "nats-server": sum(v for k, v in cpu.items() if k.startswith("nats-server ")),
    }
    parts["total"] = sum(parts.values())
    return {part: round(value, 2) for part, value in parts.items()}


def _node_pids(cluster: NatsCluster) -> dict[str, int]:
    return {f"nats-server {node.name}": node.pid for node in cluster.nodes if node.pid is not None}


def _stream_names(side: str, number: int) -> tuple[str, str]:
    """The stream and subject prefix of a run: new each run (a stream that stored an id within
    its duplicate window drops it as a duplicate), of the same length on both sides."""
    letter = "P" if side == "product" else "L"
    return f"BENCH-{letter}{number}", f"bench-{letter.lower()}{number}"


async def _reset_offset(env: BenchEnv, consumer: str) -> None:
    await execute(
        env.backend,
        "INSERT INTO sync.consumer_offsets (consumer) VALUES (%s)"
        " ON CONFLICT (consumer) DO UPDATE SET last_txid = '0', last_seq = 0,"
        " delivered_total = 0",
        (consumer,),
    )


async def _stream_after(
    cluster: NatsCluster, stream: str, events: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """What the stream holds once its run ended: its message count and settings, and its first
    and last message (body and the ids the publisher set), before it is deleted."""
    from consumer.devtools.nats_cluster import connected  # noqa: PLC0415 - jetstream extra

    info = await cluster.stream_info(stream)
    config = info["config"]
    messages = int(info["state"]["messages"])
    held = {"messages": messages, "settings": {key: config.get(key) for key in STREAM_SETTINGS}}
    sample = []
    async with connected(cluster.urls) as nc:
        manager = nc.jsm()
        for seq in sorted({1, max(events, 1)}):
            if seq > messages:
                continue
            msg = await manager.get_msg(stream, seq)
            headers = msg.headers or {}
            sample.append(
                {
                    "body": msg.data,
                    "msg_id": headers.get("Nats-Msg-Id"),
                    "entity_id": headers.get("Serversync-Entity-Id"),
                    "subject": (msg.subject or "").split(".", 1)[-1],
                }
            )
    await cluster.delete_stream(stream)
    return held, sample


async def product_run(
    env: BenchEnv, cluster: NatsCluster, number: int, *, events: int, batch: int, timeout: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(a) `serversync run bench-js` draining the outbox into a new stream of 3 replicas: from
    taking the lead to the last offset commit, CPU from its first delivered batch on."""
    stream, prefix = _stream_names("product", number)
    declaration = env.workdir / f"consumers-{number}.toml"
    declaration.write_text(
        f"[consumers.{CONSUMER}]\n"
        'sink = "jetstream"\n'
        f"servers = {orjson.dumps(cluster.urls).decode()}\n"
        f'stream = "{stream}"\n'
        f'subject_prefix = "{prefix}"\n'
        f"replicas = {REPLICAS}\n"
    )
    await _reset_offset(env, CONSUMER)
    end = await outbox_end(env.backend)
    monitor = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    async with monitor:
        consumer = start_service(
            ["run", CONSUMER],
            {
                "DATABASE_URL": env.backend,
                "SYNC_CONSUMERS_FILE": str(declaration),
                "SYNC_BATCH_SIZE": str(batch),
                "SYNC_LOG_LEVEL": "WARNING",
            },
            env.workdir / f"consumer-jetstream-{number}.log",
        )
        processes = {"consumer": consumer.pid, **_node_pids(cluster)}
        # The polling connection's backend is named apart, and left out of the figures.
        processes["bench monitor"] = monitor.info.backend_pid
        try:
            async with cpu_meter(env, processes) as meter:
                run = await watch_drain(
                    monitor,
                    meter,
                    consumer=CONSUMER,
                    end=end,
                    total=events,
                    label="JetStream consumer's",
                    timeout=timeout,
                    every=POLL_SEC,
                    watching=[consumer],
                )
                delivered, seconds, cpu = run.events, run.seconds, run.cpu
        finally:
            consumer.stop()
    held, sample = await _stream_after(cluster, stream, events)
    return {
        "events": delivered,
        "seconds": seconds,
        "events_per_sec": delivered / seconds,
        "cpu_us_per_event": _cpu_parts(cpu, "consumer") if cpu else None,
        "stream": held,
    }, sample


async def loop_run(
    env: BenchEnv, cluster: NatsCluster, number: int, batch: int, window: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(b) the publish loop: the same rows read with psycopg, the same messages published with
    nats-py's publish_async, `window` batches in flight, an offset committed per acknowledged
    batch; from its first read to its last commit."""
    import nats  # noqa: PLC0415 - the jetstream extra

    from consumer.sinks import jetstream  # noqa: PLC0415 - the jetstream extra

    stream, prefix = _stream_names("loop", number)
    spec = jetstream.StreamSpec(
        name=stream,
        subject_prefix=prefix,
        replicas=REPLICAS,
        retention="limits",
        max_age=0.0,
        duplicate_window=jetstream_kind.DEFAULT_DUPLICATE_WINDOW_SEC,
    )
    await _reset_offset(env, LOOP_OFFSET)
    nc: NATS = await nats.connect(cluster.urls)
    source = await psycopg.AsyncConnection.connect(
        env.backend, autocommit=True, **connect_kwargs("bench-js-loop", synchronous_commit=False)
    )
    events = duplicates = 0
    async with source:
        try:
            await jetstream.ensure_stream(nc, spec, timeout=10)
            js = nc.jetstream()
            row = await (await source.execute("SELECT sync.node_name()")).fetchone()
            local_node = row[0] if row else None
            # What starts every Nats-Msg-Id, read as the product's sink reads it.
            id_source = await jetstream_kind.database_source(env.backend, CONSUMER)
            count = await (
                await source.execute("SELECT count(*) FROM sync.events_outbox")
            ).fetchone()
            expected = int(count[0]) if count else 0
            # Batches published and not yet acknowledged: (its end, its acknowledgements).
            pending: collections.deque[tuple[Position, list[asyncio.Future[Any]]]] = (
                collections.deque()
            )

            async def settle() -> None:
                nonlocal duplicates
                position, futures = pending.popleft()
                acks = await asyncio.gather(*futures)
                duplicates += sum(1 for ack in acks if ack.duplicate)
                await source.execute(
                    "UPDATE sync.consumer_offsets SET last_txid = %s::xid8, last_seq = %s,"
                    " updated_at = now() WHERE consumer = %s",
                    (str(position.txid), position.seq, LOOP_OFFSET),
                )

            position = Position.start()
            async with cpu_meter(env, {"loop": os.getpid(), **_node_pids(cluster)}) as meter:
                await meter.mark()
                started = time.perf_counter()
                while events < expected:
                    cur = await source.execute(
                        "SELECT o.txid::text, o.seq, o.op, o.entity_type, o.entity_id,"
                        " o.payload::text, o.created_at, o.origin, o.snapshot_id"
                        " FROM sync.events_outbox o WHERE (o.txid, o.seq) > (%s::xid8, %s)"
                        " AND o.txid < pg_snapshot_xmin(pg_current_snapshot())"
                        " ORDER BY o.txid, o.seq LIMIT %s",
                        (str(position.txid), position.seq, batch),
                        prepare=True,
                    )
                    rows = await cur.fetchall()
                    if not rows:
                        # Held back by a transaction open elsewhere: look again shortly.
                        await asyncio.sleep(0.01)
                        continue
                    futures = []
                    for r in rows:
                        headers = {
                            jetstream.MSG_ID_HEADER: jetstream.message_id(
                                id_source, CONSUMER, r[1]
                            ),
                            jetstream.EXPECTED_STREAM_HEADER: stream,
                            jetstream.ENTITY_ID_HEADER: jetstream.header_value(r[4]),
                        }
                        futures.append(
                            await js.publish_async(
                                jetstream.subject_of(prefix, r[3], r[2]),
                                encode_entries([r], local_node=local_node)[1:-1],
                                headers=headers,
                            )
                        )
                    position = Position(int(rows[-1][0]), rows[-1][1])
                    pending.append((position, futures))
                    events += len(rows)
                    while len(pending) >= window:
                        await settle()
                while pending:
                    await settle()
                seconds = time.perf_counter() - started
                cpu = await meter.per_event(events)
        finally:
            await nc.close()
    if duplicates:
        raise RuntimeError(f"the loop's stream took {duplicates} messages as duplicates")
    held, sample = await _stream_after(cluster, stream, events)
    return {
        "events": events,
        "seconds": seconds,
        "events_per_sec": events / seconds,
        "cpu_us_per_event": _cpu_parts(cpu, "loop"),
        "stream": held,
    }, sample


def summary(j: dict[str, Any]) -> list[str]:
    """Both sides' medians, the ratios, each pair of runs, and the goal met or missed."""
    lines = [
        f"jetstream: a backlog of {j['events']:,} events into a stream of {j['replicas']}"
        f" replicas, batch {j['batch_size']}, median of {j['rounds']} interleaved rounds:"
    ]
    for side, label in (
        ("product", "serversync run (sink jetstream)"),
        (
            "loop",
            f"nats-py publish loop ({j['window']} batch{'es' * (j['window'] != 1)} in flight)",
        ),
    ):
        f = j[side]
        lines.append(f"  {label:44} {f['events_per_sec']:>10,.0f} events/s")
        if f["cpu_us_per_event"]:
            lines.append(
                f"  {'':44} CPU us/event: "
                + ", ".join(f"{k} {v}" for k, v in f["cpu_us_per_event"].items())
            )
    ratios = j["ratios"]
    lines.append(
        f"  product / loop: events/s {ratios['events_per_sec']}, CPU per event"
        f" {ratios['cpu_per_event']}; each round {', '.join(map(str, j['round_ratios']))}"
    )
    lines.append(
        f"  same messages in both streams: {j['same_messages']}; same stream settings:"
        f" {j['same_stream_settings']}"
    )
    met = ratios["events_per_sec"] >= GOAL
    lines.append(
        f"  goal: the product >= {GOAL}x the loop's events/s:"
        f" {'met' if met else 'missed'} ({ratios['events_per_sec']}x)"
    )
    return lines
