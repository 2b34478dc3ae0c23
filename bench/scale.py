"""Scale: how the cost of a drain grows as the work grows.

Four curves. Each point is a drain by the product (`serversync run`, bench/drain.py) measured
beside the in-database reference on the same events: events/s, and the CPU microseconds per
event of the consumer and of PostgreSQL (its backends and background processes).

1. backlog: the outbox holds 100k, 1M and 10M events, and each drain reads the same first
   `window` events of it (100k: the whole of the smallest backlog). The figure a user needs is a
   consumer's drain rate with 10M events waiting against with 100k, and drains of the same
   events compare exactly that; draining all 10M with each sink in each round would take most
   of an hour on 2 cores. The outbox grows between the points (topped up, then vacuumed,
   checkpointed and written back to disk, as after a real outage's fill).
2. consumers: 1, 4 and 16 consumers declared in a SYNC_CONSUMERS_FILE, each its own
   `serversync run NAME --sink null` process, reading the same backlog at once. The null sink
   isolates what this curve is about, the outbox read. They all start before the backlog
   becomes readable: an open transaction older than the backlog holds the read horizon back
   until every one of them leads, so they start reading together and no process start-up falls
   inside the measurement. The machine's CPU busy share says when the curve is CPU-bound.
3. payload: events of ~300 bytes (a call_logs row), 4 KiB and 64 KiB (random hex that pglz
   cannot shrink, so TOAST stores it as is): events/s and MB/s.
4. tracked tables: 1 and 100 tables of the call_logs shape tracked with sync.track, the events
   written through their relays in statements of 25 rows that go round the tables.

The backlog, consumer and payload curves fill sync.events_outbox directly (INSERT ... SELECT of
rows shaped as the relay writes call_logs', 50,000 to a transaction as bench/harness.py
produce_calls does): through the relay (and the call_logs table beside it) a fill took twice
as long (38k against 75k events/s at 300k), for the same outbox.
The tables curve goes through the relay: the tables are what it varies.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import inspect
import math
import os
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from bench import drain, report
from bench.harness import (
    BenchEnv,
    Service,
    bench_run,
    cpu_meter,
    execute,
    machine,
    machine_cpu,
    outbox_end,
    progress,
    server_is_local,
    start_service,
    wait_for,
)
from consumer.core.errors import first_line
from consumer.devtools.devdb import fresh_database

PARTS = ("backlog", "consumers", "payload", "tables")
# Payload sizes at or below this are the call_logs row as it is (~340 bytes of JSON).
PLAIN_PAYLOAD_BYTES = 400
# What the call_logs row's JSON holds besides its summary, which the blob replaces.
PAYLOAD_OVERHEAD_BYTES = 320
# Distinct blobs the events take turns with: each event's payload is still incompressible.
BLOB_SLOTS = 64
# The receiver refuses bodies over INGEST_MAX_BODY_BYTES (32 MiB): batches of large payloads
# are made smaller so that each request stays under half of it.
HTTP_BATCH_BYTES = 16 * 2**20
# Rows of each relay statement in the tables curve: a batch of 1000 events spans 40 statements,
# so with 100 tables a batch holds events of 40 of them.
ROWS_PER_STATEMENT = 25
FILL_CHUNK = 50_000
# A machine this busy during the consumers' drain had no CPU left for more of them.
CPU_BOUND_SHARE = 0.9
CONSUMER_PREFIX = "scale-"
# Where bench/outbox_scale.py builds and cleans up its outbox.
STATUS_DB = "serversync_bench_outbox_scale"


@dataclass(frozen=True)
class Plan:
    """The sizes of a run."""

    backlogs: tuple[int, ...]
    window: int
    consumers: tuple[int, ...]
    consumer_events: int
    payloads: tuple[int, ...]
    payload_events: int
    payload_budget_bytes: int
    tables: tuple[int, ...]
    table_events: int
    rounds: int
    batch_size: int
    parts: tuple[str, ...]


FULL = Plan(
    backlogs=(100_000, 1_000_000, 10_000_000),
    window=100_000,
    consumers=(1, 4, 16),
    consumer_events=300_000,
    payloads=(300, 4096, 65536),
    payload_events=200_000,
    payload_budget_bytes=512 * 2**20,
    tables=(1, 100),
    table_events=300_000,
    rounds=3,
    batch_size=1000,
    parts=PARTS,
)
QUICK = Plan(
    backlogs=(50_000, 200_000),
    window=50_000,
    consumers=(1, 4),
    consumer_events=100_000,
    payloads=(300, 4096),
    payload_events=50_000,
    payload_budget_bytes=64 * 2**20,
    tables=(1, 10),
    table_events=50_000,
    rounds=1,
    batch_size=1000,
    parts=PARTS,
)


def _sizes(value: str) -> tuple[int, ...]:
    """'100k,1m,10000000' -> (100000, 1000000, 10000000)."""
    sizes = []
    for part in value.split(","):
        text = part.strip().lower().replace("_", "")
        scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
        try:
            number = float(text[:-1] if scale != 1 else text) * scale
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a list of sizes: {value!r}") from None
        if number < 1 or number != int(number):
            raise argparse.ArgumentTypeError(f"sizes must be positive integers: {value!r}")
        sizes.append(int(number))
    return tuple(sizes)


def _parts(value: str) -> tuple[str, ...]:
    parts = tuple(p.strip() for p in value.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise argparse.ArgumentTypeError(f"unknown parts {unknown} (known: {', '.join(PARTS)})")
    return parts


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `python -m bench scale`."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="small sizes (backlogs 50k/200k, consumers 1/4, payloads 300B/4KiB, tables 1/10,"
        " one round): a smoke run of about 3 minutes",
    )
    p.add_argument("--parts", type=_parts, help=f"curves to measure (default {','.join(PARTS)})")
    p.add_argument("--backlogs", type=_sizes, help="outbox sizes, e.g. 100k,1m,10m")
    p.add_argument(
        "--window",
        type=int,
        help="events each backlog drain reads from the outbox's start (default and at most:"
        " the smallest backlog)",
    )
    p.add_argument("--consumers", type=_sizes, help="consumer counts, e.g. 1,4,16")
    p.add_argument("--consumer-events", type=int, help="the backlog every consumer reads whole")
    p.add_argument("--payloads", type=_sizes, help="payload bytes, e.g. 300,4096,65536")
    p.add_argument(
        "--payload-events",
        type=int,
        help="events per payload size (fewer for large payloads: at most 512 MiB, quick 64 MiB)",
    )
    p.add_argument("--tables", type=_sizes, help="tracked table counts, e.g. 1,100")
    p.add_argument("--table-events", type=int, help="events of the tables curve")
    p.add_argument("--rounds", type=int, help="interleaved repeats, each figure their median")
    p.add_argument("--batch-size", type=int, default=1000)
    report.add_run_arguments(p)


def plan_from(args: argparse.Namespace) -> Plan:
    """The plan of the command line: --quick or the full sizes, each overridden by its option."""
    base = QUICK if args.quick else FULL
    backlogs = tuple(sorted(args.backlogs or base.backlogs))
    return Plan(
        backlogs=backlogs,
        window=min(args.window or base.window, backlogs[0]),
        consumers=tuple(sorted(args.consumers or base.consumers)),
        consumer_events=args.consumer_events or base.consumer_events,
        payloads=tuple(sorted(args.payloads or base.payloads)),
        payload_events=args.payload_events or base.payload_events,
        payload_budget_bytes=base.payload_budget_bytes,
        tables=tuple(sorted(args.tables or base.tables)),
        table_events=args.table_events or base.table_events,
        rounds=args.rounds or base.rounds,
        batch_size=args.batch_size,
        parts=args.parts or base.parts,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """`python -m bench scale`: measure the plan's curves, write the result, return it."""
    plan = plan_from(args)
    name = args.name or time.strftime("%Y%m%d-%H%M%S") + "-scale" + ("-quick" if args.quick else "")
    result: dict[str, Any] = {
        "name": name,
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "parameters": {**asdict(plan), "quick": args.quick},
    }
    started = time.monotonic()
    async with bench_run(result, private=args.private, keep_logs=args.keep_logs) as env:
        result["scale"] = {}

        def save() -> None:
            # A run of the full sizes takes long: what is measured is kept as it comes, so a run
            # that fails late leaves the points it finished in its file.
            result["parameters"]["duration_sec"] = round(time.monotonic() - started)
            result["targets"] = report.targets(result)
            report.write(result, name, args.out)

        await measure(env, plan, result["scale"], save)
    save()
    path = args.out / f"{name}.json"
    progress(f"wrote {path}")
    return result


Publish = Callable[[dict[str, Any]], None]


async def measure(
    env: BenchEnv, plan: Plan, scale: dict[str, Any], save: Callable[[], None]
) -> None:
    """Every curve of the plan into `scale`, each on an outbox of its own; `save` after each
    point (or, for the consumers, each curve)."""
    await execute(
        env.backend, "CREATE TABLE bench_scale_blobs (slot integer PRIMARY KEY, blob text NOT NULL)"
    )
    curves: dict[str, Callable[[BenchEnv, Plan, Publish], Any]] = {
        "backlog": backlog_curve,
        "consumers": consumers_curve,
        "payload": payload_curve,
        "tables": tables_curve,
    }
    for part in PARTS:
        if part not in plan.parts:
            continue

        def publish(curve: dict[str, Any], part: str = part) -> None:
            scale[part] = curve
            save()

        await _empty_outbox(env)
        publish(await curves[part](env, plan, publish))
    await execute(env.backend, "DROP TABLE bench_scale_blobs")


# == Filling the outbox =========================================================================

FILL = """
INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload)
SELECT 'upsert', 'call_log', c.id::text, to_json(c)
FROM (
    SELECT gen_random_uuid() AS id, '090' || lpad(g::text, 8, '0') AS caller_number,
           '0312345678' AS callee_number, 'inbound' AS direction, 'completed' AS status,
           now() AS started_at, now() AS ended_at, (g %% 600)::integer AS duration_sec,
           coalesce(b.blob, 'bench call ' || g) AS summary, now() AS updated_at
    FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS g
    LEFT JOIN bench_scale_blobs AS b ON b.slot = g %% %(slots)s
) AS c
"""


async def _empty_outbox(env: BenchEnv) -> None:
    await execute(env.backend, "TRUNCATE sync.events_outbox")


async def _settle(env: BenchEnv) -> None:
    """After a fill: hint bits set, statistics fresh, dirty buffers written and, on this
    machine, on disk, as before any drain the bench measures.

    A private cluster runs with fsync off, so its CHECKPOINT leaves the fill in the kernel's
    dirty pages: after a 10M fill about 2 GB of them, which the kernel kept writing back through
    every drain of that point (0.75-0.80x the events/s of the 100k point, the in-database
    reference included, at 1.2-1.3x the CPU per event). A backlog built over an outage was
    written back long before a consumer drains it, so the bench waits for the disk here."""
    await execute(env.backend, "VACUUM ANALYZE sync.events_outbox")
    await execute(env.backend, "CHECKPOINT")
    if server_is_local(env.backend):
        dirty = _dirty_mb()
        started = time.monotonic()
        await asyncio.to_thread(os.sync)
        progress(
            f"  the fill written back to disk ({dirty:,.0f} MB were dirty;"
            f" {time.monotonic() - started:.1f}s)"
        )


def _dirty_mb() -> float:
    """The kernel's dirty and under-writeback page cache, MB (/proc/meminfo)."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return sum(int(fields[key].split()[0]) for key in ("Dirty", "Writeback")) / 1024


async def set_payload(env: BenchEnv, payload_bytes: int) -> None:
    """Make the next fills' payloads about `payload_bytes` long (the plain call_logs row at or
    below PLAIN_PAYLOAD_BYTES): the summary becomes one of BLOB_SLOTS random hex strings."""
    await execute(env.backend, "TRUNCATE bench_scale_blobs")
    if payload_bytes <= PLAIN_PAYLOAD_BYTES:
        return
    chars = payload_bytes - PAYLOAD_OVERHEAD_BYTES
    await execute(
        env.backend,
        "INSERT INTO bench_scale_blobs (slot, blob) SELECT s, left(string_agg(md5(random()::text),"
        " ''), %(chars)s) FROM generate_series(0, %(slots)s - 1) AS s,"
        " generate_series(1, %(pieces)s) AS p GROUP BY s",
        {"chars": chars, "slots": BLOB_SLOTS, "pieces": math.ceil(chars / 32)},
    )


async def fill_outbox(env: BenchEnv, first: int, count: int) -> None:
    """Write `count` call_logs-shaped events straight into the outbox, FILL_CHUNK to a
    transaction (`first`: the number of the first, which its caller number carries)."""
    done = 0
    started = last_report = time.monotonic()
    while done < count:
        size = min(FILL_CHUNK, count - done)
        await execute(
            env.backend,
            FILL,
            {"first": first + done, "last": first + done + size - 1, "slots": BLOB_SLOTS},
        )
        done += size
        if time.monotonic() - last_report > 5 or done == count:
            last_report = time.monotonic()
            rate = done / (last_report - started)
            progress(f"  filled {done:,}/{count:,} events ({rate:,.0f}/s)")


async def bytes_per_event(env: BenchEnv) -> float:
    """The mean payload size, in bytes of JSON text (a sample of the outbox)."""
    rows = await execute(
        env.backend,
        "SELECT avg(octet_length(payload::text))::float8 FROM"
        " (SELECT payload FROM sync.events_outbox LIMIT 1000) AS s",
    )
    return round(float(rows[0][0]), 1)


# == Figures ====================================================================================


def _postgres_us(cpu: dict[str, float]) -> float:
    """PostgreSQL's CPU on the outbox's side: its backends on the backend database and its
    background processes (the receiver's database is counted apart)."""
    return round(cpu.get("postgres backend", 0.0) + cpu.get("postgres background", 0.0), 2)


def _median(values: Sequence[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


def sink_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of a sink's runs at one point: events/s and CPU per event of the consumer,
    PostgreSQL, and each part (a run whose drain fell between two polls has no CPU figures)."""
    cpus = [run["cpu_us_per_event"] for run in runs if run["cpu_us_per_event"]]
    parts = sorted({part for cpu in cpus for part in cpu})
    return {
        "events_per_sec": statistics.median(run["events_per_sec"] for run in runs),
        "consumer_cpu_us_per_event": _median([cpu.get("consumer", 0.0) for cpu in cpus]),
        "postgres_cpu_us_per_event": _median([_postgres_us(cpu) for cpu in cpus]),
        "cpu_us_per_event": {p: _median([cpu.get(p, 0.0) for cpu in cpus]) for p in parts} or None,
        "runs": runs,
    }


def reference_figures(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of the in-database reference's runs at one point."""
    cpus = [run["cpu_us_per_event"] for run in runs]
    return {
        "events_per_sec": statistics.median(run["events_per_sec"] for run in runs),
        "postgres_cpu_us_per_event": _median([_postgres_us(cpu) for cpu in cpus]),
        "runs": runs,
    }


async def drain_point(
    env: BenchEnv,
    plan: Plan,
    *,
    window: int | None = None,
    batch_size: int | None = None,
    events: int,
) -> dict[str, Any]:
    """One point of a curve: the in-database reference, the runtime alone (null sink) and
    frontend-sync through HTTP into the receiver, `plan.rounds` times interleaved, each figure
    the median of its rounds. `window`: drain only the outbox's first events; `batch_size`: the
    product's (default the plan's)."""
    batch = batch_size or plan.batch_size
    # Generous: a drain that slows down as the work grows is what this measures.
    timeout = max(300.0, events / 1_000)
    runs: dict[str, list[dict[str, Any]]] = {"in_database": [], "null": [], "http": []}
    for number in range(plan.rounds):
        label = f" (round {number + 1}/{plan.rounds})" if plan.rounds > 1 else ""
        progress(f"  in-database reference{label}")
        runs["in_database"].append(await drain.in_database_ceiling(env, window=window))
        for sink in ("null", "http"):
            progress(f"  {sink} sink{label}")
            runs[sink].append(await drain.product(env, batch, sink, timeout, window=window))
    figures: dict[str, Any] = {
        "events": events,
        "batch_size": batch,
        "in_database": reference_figures(runs["in_database"]),
        "null": sink_figures(runs["null"]),
        "http": sink_figures(runs["http"]),
    }
    ceiling = figures["in_database"]["events_per_sec"]
    figures["null_to_in_database"] = round(figures["null"]["events_per_sec"] / ceiling, 3)
    figures["http_to_in_database"] = round(figures["http"]["events_per_sec"] / ceiling, 3)
    return figures


def _ratios(points: list[dict[str, Any]]) -> dict[str, float]:
    """The last point against the first: events/s of each sink and of the reference, and the
    CPU per event of the consumer and PostgreSQL together (a rate moves with whatever else the
    machine runs; the CPU an event costs much less)."""
    ratios = {}
    for key in ("null", "http", "in_database"):
        last, first = points[-1][key]["events_per_sec"], points[0][key]["events_per_sec"]
        ratios[f"{key}_largest_to_smallest"] = round(float(last) / float(first), 3)
    for key in ("null", "http"):
        cpu = [_outbox_side_us(point[key]) for point in (points[0], points[-1])]
        if cpu[0] and cpu[1]:
            ratios[f"{key}_cpu_per_event_largest_to_smallest"] = round(cpu[1] / cpu[0], 3)
    return ratios


def _outbox_side_us(figures: dict[str, Any]) -> float | None:
    """CPU microseconds per event of the consumer and PostgreSQL's outbox side."""
    consumer, postgres = figures["consumer_cpu_us_per_event"], figures["postgres_cpu_us_per_event"]
    return None if consumer is None or postgres is None else float(consumer + postgres)


# == 1. Backlog =================================================================================


async def backlog_curve(env: BenchEnv, plan: Plan, publish: Publish) -> dict[str, Any]:
    """The same first `plan.window` events drained from outboxes of each backlog size."""
    status = _status_and_cleanup()
    curve: dict[str, Any] = {
        "window": plan.window,
        "fill": "direct INSERT ... SELECT into sync.events_outbox, call_logs-shaped rows",
        "points": [],
    }
    if isinstance(status, str):
        curve["status_and_cleanup"] = status
    filled = 0
    for size in plan.backlogs:
        progress(f"scale: backlog of {size:,} events (drains read the first {plan.window:,})")
        await fill_outbox(env, filled + 1, size - filled)
        await _settle(env)
        filled = size
        point = {
            "backlog": size,
            **await drain_point(env, plan, window=plan.window, events=plan.window),
        }
        if not isinstance(status, str):
            progress(f"  status and cleanup at {size:,} events, in a database of their own")
            point["status_and_cleanup"] = await _measure_status(env, status, size)
        curve["points"].append(point)
        curve["ratios"] = _ratios(curve["points"])
        publish(curve)
    return curve


async def _measure_status(env: BenchEnv, measure: Callable[[str, int], Any], size: int) -> Any:
    """`measure` (bench/outbox_scale.py) on an outbox of `size` events that it builds itself,
    with its own consumers, in a database of its own: it needs an empty outbox, and its cleanup
    deletes events. The database is dropped afterwards (at 10M events it holds gigabytes)."""
    dsn = await fresh_database(env.server.dsn, STATUS_DB, ["backend"])
    try:
        timings = measure(dsn, size)
        return await timings if inspect.isawaitable(timings) else timings
    except Exception as exc:  # its failure is reported; the curves stand
        progress(f"  status and cleanup failed: {first_line(exc)}")
        return {"error": first_line(exc)}
    finally:
        await execute(
            env.server.dsn,
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(STATUS_DB)),
        )


def _status_and_cleanup() -> Callable[[str, int], Any] | str:
    """bench.outbox_scale.measure_status_and_cleanup, or why it is not measured."""
    try:
        from bench import outbox_scale  # noqa: PLC0415 - optional: a module of its own
    except ImportError as exc:
        return f"not measured: bench.outbox_scale cannot be imported ({exc})"
    found: Callable[[str, int], Any] | None = getattr(
        outbox_scale, "measure_status_and_cleanup", None
    )
    if found is None:
        return "not measured: bench.outbox_scale has no measure_status_and_cleanup"
    return found


# == 2. Consumers ===============================================================================


async def consumers_curve(env: BenchEnv, plan: Plan, _publish: Publish) -> dict[str, Any]:
    """N consumers reading the same backlog at once, for each N, `plan.rounds` times
    interleaved; each figure the median of its rounds (known once every round is done)."""
    declared = env.workdir / "scale-consumers.toml"
    declared.write_text(
        "".join(
            f'[consumers.{_consumer(i)}]\nsink = "null"\n\n' for i in range(max(plan.consumers))
        )
    )
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in plan.consumers}
    for number in range(plan.rounds):
        for count in plan.consumers:
            label = f" (round {number + 1}/{plan.rounds})" if plan.rounds > 1 else ""
            progress(f"scale: {count} consumers, {plan.consumer_events:,} events each{label}")
            runs[count].append(await _consumers_run(env, plan, count, declared))
    points = [_consumers_point(count, runs[count]) for count in plan.consumers]
    first = points[0]
    return {
        "events_per_consumer": plan.consumer_events,
        "sink": "null",
        "cpus": os.cpu_count(),
        "points": points,
        "ratios": {
            f"{p['consumers']}_to_{first['consumers']}": round(
                p["events_per_sec"] / first["events_per_sec"], 3
            )
            for p in points[1:]
        },
        # Events per CPU second of the consumers and PostgreSQL together, against the first
        # point's: 1.0 when more readers make no event dearer, whatever the cores allow.
        "cpu_efficiency": {
            f"{p['consumers']}_to_{first['consumers']}": round(
                p["events_per_cpu_second"] / first["events_per_cpu_second"], 3
            )
            for p in points[1:]
            if p["events_per_cpu_second"] and first["events_per_cpu_second"]
        },
    }


def _consumer(index: int) -> str:
    return f"{CONSUMER_PREFIX}{index + 1:02d}"


def _consumers_point(count: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each figure of one consumer count's runs."""
    figures: dict[str, Any] = {"consumers": count, "events": runs[0]["events"]}
    for key in (
        "events_per_sec",
        "seconds",
        "slowest_consumer_events_per_sec",
        "fastest_consumer_events_per_sec",
        "machine_busy_share",
        "measured_share",
        "steal_share",
        "events_per_cpu_second",
    ):
        figures[key] = _median([run[key] for run in runs if run[key] is not None])
    parts = sorted({part for run in runs for part in run["cpu_us_per_event"]})
    figures["cpu_us_per_event"] = {
        p: _median([run["cpu_us_per_event"].get(p, 0.0) for run in runs]) for p in parts
    }
    figures["in_database"] = reference_figures([run["in_database"] for run in runs])
    figures["cpu_bound"] = (figures["machine_busy_share"] or 0.0) >= CPU_BOUND_SHARE
    figures["runs"] = runs
    return figures


@contextlib.asynccontextmanager
async def _held_horizon(env: BenchEnv) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """A transaction with an xid, open until the caller rolls it back: every consumer's read
    horizon stays before the events written after it began."""
    gate = await psycopg.AsyncConnection.connect(env.backend)
    async with gate:
        await gate.execute("SELECT pg_current_xact_id()")
        yield gate


async def _consumers_run(env: BenchEnv, plan: Plan, count: int, declared: Path) -> dict[str, Any]:
    """`count` consumers drain a backlog of plan.consumer_events each, all starting at once."""
    names = [_consumer(i) for i in range(count)]
    await _empty_outbox(env)
    await execute(
        env.backend,
        "DELETE FROM sync.consumer_offsets WHERE starts_with(consumer, %s)",
        (CONSUMER_PREFIX,),
    )
    await execute(
        env.backend,
        "INSERT INTO sync.consumer_offsets (consumer) SELECT unnest(%s::text[])",
        (names,),
    )
    services: list[Service] = []
    monitor = await psycopg.AsyncConnection.connect(env.backend, autocommit=True)
    try:
        async with monitor, _held_horizon(env) as gate:
            await fill_outbox(env, 1, plan.consumer_events)
            await _settle(env)
            end = await outbox_end(env.backend)
            for name in names:
                services.append(
                    start_service(
                        ["run", name, "--sink", "null"],
                        {
                            "DATABASE_URL": env.backend,
                            "SYNC_CONSUMERS_FILE": str(declared),
                            "SYNC_BATCH_SIZE": str(plan.batch_size),
                            "SYNC_LOG_LEVEL": "WARNING",
                            # Held back by the open transaction, each re-reads every 5 ms at
                            # most: all of them see the backlog within 5 ms of its release.
                            "SYNC_RECHECK_INTERVAL_MS": "5",
                        },
                        env.workdir / f"consumer-{name}.log",
                    )
                )
            pids = {service.pid for service in services}

            async def all_lead() -> bool:
                cur = await monitor.execute(
                    "SELECT count(*) FROM sync.consumer_offsets"
                    " WHERE consumer = ANY(%s) AND leader_pid = ANY(%s)",
                    (names, list(pids)),
                )
                row = await cur.fetchone()
                return row is not None and row[0] == count

            progress(f"  waiting for {count} consumers to lead")
            await wait_for(
                all_lead, timeout=120, what=f"{count} consumers", every=0.1, watching=services
            )
            processes = {f"consumer {name}": s.pid for name, s in zip(names, services, strict=True)}
            async with cpu_meter(env, processes) as meter:
                busy_before, steal_before = machine_cpu()
                wall = time.monotonic()
                await meter.mark()
                await gate.rollback()
                cur = await monitor.execute("SELECT clock_timestamp()")
                released = await cur.fetchone()
                assert released is not None
                progress(f"  released the backlog to {count} consumers")

                async def all_done() -> bool:
                    cur = await monitor.execute(
                        "SELECT count(*) FROM sync.consumer_offsets WHERE consumer = ANY(%s)"
                        " AND (last_txid, last_seq) >= (%s::xid8, %s)",
                        (names, str(end.txid), end.seq),
                    )
                    row = await cur.fetchone()
                    return row is not None and row[0] == count

                await wait_for(
                    all_done,
                    timeout=max(300.0, count * plan.consumer_events / 5_000),
                    what=f"the drain of {count} consumers",
                    every=0.02,
                    watching=services,
                )
                wall = time.monotonic() - wall
                busy, steal = machine_cpu()
                events = count * plan.consumer_events
                cpu = await meter.per_event(events)
            cur = await monitor.execute(
                "SELECT extract(epoch FROM updated_at - %s)::float8, delivered_total"
                " FROM sync.consumer_offsets WHERE consumer = ANY(%s)",
                (released[0], names),
            )
            finished = await cur.fetchall()
    finally:
        for service in services:
            service.process.terminate()
        for service in services:
            service.stop()
        await execute(
            env.backend,
            "DELETE FROM sync.consumer_waits WHERE starts_with(consumer, %s)",
            (CONSUMER_PREFIX,),
        )
    seconds = max(row[0] for row in finished)
    delivered = sum(row[1] for row in finished)
    if delivered != events:
        raise RuntimeError(f"{count} consumers delivered {delivered:,} events, not {events:,}")
    consumers_us = round(sum(v for k, v in cpu.items() if k.startswith("consumer ")), 2)
    cpus = os.cpu_count() or 1
    progress("  in-database reference")
    return {
        "events": events,
        "seconds": seconds,
        "events_per_sec": events / seconds,
        "slowest_consumer_events_per_sec": min(row[1] / row[0] for row in finished),
        "fastest_consumer_events_per_sec": max(row[1] / row[0] for row in finished),
        "cpu_us_per_event": {
            "consumers": consumers_us,
            **{k: v for k, v in cpu.items() if not k.startswith("consumer ")},
        },
        "machine_busy_share": round((busy - busy_before) / (wall * cpus), 3),
        "steal_share": round((steal - steal_before) / (wall * cpus), 3),
        # The consumers and PostgreSQL alone (the rest of the machine's busy share is others').
        "measured_share": round(cpu["total"] * events / 1e6 / (wall * cpus), 3),
        "events_per_cpu_second": round(1e6 / cpu["total"]) if cpu["total"] else None,
        "in_database": await drain.in_database_ceiling(env),
    }


# == 3. Payload =================================================================================


async def payload_curve(env: BenchEnv, plan: Plan, publish: Publish) -> dict[str, Any]:
    """Drains of events of each payload size (fewer events for the large ones: at most
    plan.payload_budget_bytes of payload per point)."""
    curve: dict[str, Any] = {"points": []}
    for size in plan.payloads:
        events = max(1_000, min(plan.payload_events, plan.payload_budget_bytes // size))
        progress(f"scale: {events:,} events of ~{size:,} bytes")
        await _empty_outbox(env)
        await set_payload(env, size)
        await fill_outbox(env, 1, events)
        await _settle(env)
        size_measured = await bytes_per_event(env)
        batch = max(1, min(plan.batch_size, HTTP_BATCH_BYTES // math.ceil(size_measured)))
        point = {
            "payload_bytes": size,
            "bytes_per_event": size_measured,
            **await drain_point(env, plan, batch_size=batch, events=events),
        }
        for key in ("in_database", "null", "http"):
            point[key]["mb_per_sec"] = round(point[key]["events_per_sec"] * size_measured / 1e6, 1)
        curve["points"].append(point)
        curve["ratios"] = _ratios(curve["points"])
        publish(curve)
    await set_payload(env, 0)
    return curve


# == 4. Tracked tables ==========================================================================

FILL_TABLES = """
CREATE FUNCTION bench_scale_fill_tables(tables integer, per_statement integer, statements integer)
RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    -- Statement i writes rows i*per_statement+1 .. (i+1)*per_statement into table i % tables.
    FOR i IN 0 .. statements - 1 LOOP
        EXECUTE format(
            'INSERT INTO %I (caller_number, callee_number, status, ended_at, duration_sec, summary)'
            ' SELECT ''090'' || lpad(g::text, 8, ''0''), ''0312345678'', ''completed'', now(),'
            ' g %% 600, ''bench call '' || g FROM generate_series($1, $2) AS g',
            'bench_scale_t' || lpad((i % tables + 1)::text, 3, '0'))
        USING i * per_statement + 1, (i + 1) * per_statement;
    END LOOP;
END
$$
"""


def _table(index: int) -> str:
    return f"bench_scale_t{index + 1:03d}"


async def tables_curve(env: BenchEnv, plan: Plan, publish: Publish) -> dict[str, Any]:
    """Drains of plan.table_events events written through the relays of 1..N tracked tables of
    the call_logs shape, ROWS_PER_STATEMENT rows at a time, going round the tables."""
    await execute(env.backend, FILL_TABLES)
    curve: dict[str, Any] = {
        "events": plan.table_events,
        "rows_per_statement": ROWS_PER_STATEMENT,
        "fill": "through the relay of each table",
        "points": [],
    }
    for count in plan.tables:
        progress(f"scale: {plan.table_events:,} events across {count} tracked tables")
        await _empty_outbox(env)
        # No consumer runs now: a waiting flag a stopped one left would make every relay
        # statement of the fill notify.
        await execute(env.backend, "DELETE FROM sync.consumer_waits")
        tables = [_table(i) for i in range(count)]
        for table in tables:
            await execute(
                env.backend,
                sql.SQL("CREATE TABLE {} (LIKE public.call_logs INCLUDING ALL)").format(
                    sql.Identifier(table)
                ),
            )
            await execute(
                env.backend,
                "SELECT sync.track(%s::regclass, %s)",
                (table, table.replace("bench_scale_t", "scale_call_")),
            )
        try:
            statements = plan.table_events // ROWS_PER_STATEMENT
            per_chunk = FILL_CHUNK // ROWS_PER_STATEMENT
            started = time.monotonic()
            for done in range(0, statements, per_chunk):
                # FILL_CHUNK events to a transaction, as the other fills.
                await execute(
                    env.backend,
                    "SELECT bench_scale_fill_tables(%s, %s, %s)",
                    (count, ROWS_PER_STATEMENT, min(per_chunk, statements - done)),
                )
            events = statements * ROWS_PER_STATEMENT
            rate = events / (time.monotonic() - started)
            progress(f"  filled {events:,} events through the relays ({rate:,.0f}/s)")
            await _settle(env)
            curve["points"].append({"tables": count, **await drain_point(env, plan, events=events)})
            curve["ratios"] = _ratios(curve["points"])
            publish(curve)
        finally:
            for table in tables:
                await execute(env.backend, "SELECT sync.untrack(%s::regclass)", (table,))
                await execute(env.backend, sql.SQL("DROP TABLE {}").format(sql.Identifier(table)))
    await execute(env.backend, "DROP FUNCTION bench_scale_fill_tables")
    return curve
