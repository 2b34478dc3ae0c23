"""Each mechanism of the runtime on and off, in the same run: what it gains, and whether that
pays for it.

Three mechanisms landed together with other changes and were never measured alone:

- the in-flight window (`SYNC_MAX_IN_FLIGHT`, 2 against 1): two batches delivered at once while
  a backlog drains. It weakens the wire contract (a receiver can see two requests of one
  consumer at once) and doubles what a crash sends again, so it must earn that.
- the read-ahead (`SYNC_READ_AHEAD`): the next batch read while a full one is delivered, and
  while a short one's offset commits.
- the linger (`SYNC_LINGER_MS`, 5 against 0): after an empty read, look again a little later
  before asking producers for a NOTIFY. It costs latency whenever an event arrives during it; it
  is meant to spare producers NOTIFYs while a consumer flaps between idle and busy.

For each, with the setting off and on (everything else at its default), interleaved over
`rounds` rounds, each figure the median of its rounds:

- drain: `serversync run frontend-sync` through HTTP into the receiver, events/s and the CPU per
  event of the consumer, the receiver and PostgreSQL;
- latency: commit -> applied at the receiver, p50 and p99, at each of `rates` (one producer
  connection, the consumer alone);
- producers: pgbench's tps at 8 connections with the consumer running (single-row INSERTs and
  UPDATEs of a tracked table, NOTIFY on), and the CPU per transaction; and the machine's CPU per
  transaction (PostgreSQL, pgbench and the consumer) while the same producers run at a steady
  `PACED_TPS`, the middle ground where a consumer that keeps up goes idle between batches and
  producers' NOTIFYs are at stake.

A mechanism is kept when it gains at least `KEEP_GAIN` on one of the judged figures (events/s or
tps higher; a median latency or the paced producers' CPU per transaction lower); the result says
which figure and by how much. The p99 latencies, the CPU split and the NOTIFYs producers sent per
1,000 transactions (a cause, where the CPU is what users pay) are reported beside them, not
judged: in runs of a few seconds a p99 rests on a handful of events.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql

from bench import drain, latency, producer
from bench.harness import BenchEnv, execute, outbox_end, produce_calls, progress
from consumer.core.events import Position

# (setting, value off, value on) of each mechanism.
MECHANISMS: dict[str, tuple[str, str, str]] = {
    "in_flight_window": ("SYNC_MAX_IN_FLIGHT", "1", "2"),
    "read_ahead": ("SYNC_READ_AHEAD", "false", "true"),
    "linger": ("SYNC_LINGER_MS", "0", "5"),
}
STATES = ("off", "on")
# What a mechanism must gain on one figure to stay: ~5 %, the smallest difference these runs
# tell apart from the machine's own drift within a run.
KEEP_GAIN = 1.05
RATES = (200.0, 1000.0)
PRODUCER_CONNECTIONS = 8
# Below SYNC_BATCH_WAIT_MIN_RATE (2,000/s): the consumer reads at once after every batch and goes
# idle between them, where the linger is meant to spare producers NOTIFYs.
PACED_TPS = 1000
# The channel the relay sends its wake-ups on (sql/backend/functions/track.sql).
CHANNEL = "sync_outbox"


def _env(mechanism: str, state: str) -> dict[str, str]:
    setting, off, on = MECHANISMS[mechanism]
    return {setting: off if state == "off" else on}


async def run_mechanisms(
    env: BenchEnv,
    *,
    events: int,
    batch_size: int,
    seconds: float,
    rounds: int,
    rates: Sequence[float] = RATES,
    mechanisms: Sequence[str] = tuple(MECHANISMS),
) -> dict[str, Any]:
    """Every mechanism off and on, drain, latency and producers, in `rounds` interleaved
    rounds; the medians, the gains (on against off) and the verdicts."""
    # Every drain reads this backlog whole: what the latency and producer runs add behind it is
    # deleted before each drain (bench_outbox_end), so every drain checks that the receiver holds
    # every entity of it.
    progress(f"mechanisms: producing a backlog of {events:,} events")
    await execute(env.backend, "TRUNCATE sync.events_outbox")
    await produce_calls(env.backend, events)
    await execute(env.backend, "VACUUM ANALYZE sync.events_outbox")
    backlog_end = await outbox_end(env.backend)
    pgq_missing = await producer.prepare_tables(env.backend)
    del pgq_missing  # PgQ is not part of this comparison
    runs: dict[str, dict[str, list[dict[str, float]]]] = {
        name: {state: [] for state in STATES} for name in mechanisms
    }
    timeout = max(120.0, events / 2_000)
    for round_ in range(rounds):
        for name in mechanisms:
            # Off first in even rounds, on first in odd ones: neither always runs in the wake
            # of the other.
            order = STATES if round_ % 2 == 0 else tuple(reversed(STATES))
            for state in order:
                progress(f"mechanisms: round {round_ + 1}/{rounds}, {name} {state}")
                runs[name][state].append(
                    await _measure(
                        env,
                        _env(name, state),
                        backlog_end=backlog_end,
                        batch_size=batch_size,
                        seconds=seconds,
                        rates=rates,
                        timeout=timeout,
                        round_=round_,
                    )
                )
    result: dict[str, Any] = {
        "events": events,
        "batch_size": batch_size,
        "seconds": seconds,
        "rounds": rounds,
        "rates": list(rates),
        "keep_gain": KEEP_GAIN,
        "mechanisms": {},
    }
    for name in mechanisms:
        setting, off, on = MECHANISMS[name]
        # The figures every run has (a drain too short for two CPU readings has no CPU split).
        keys = [
            key
            for key in runs[name]["off"][0]
            if all(key in run for state in STATES for run in runs[name][state])
        ]
        medians = {
            state: {
                key: round(statistics.median(run[key] for run in runs[name][state]), 3)
                for key in keys
            }
            for state in STATES
        }
        gains = _gains(medians["off"], medians["on"])
        best = max(gains.items(), key=lambda item: item[1])
        result["mechanisms"][name] = {
            "setting": setting,
            "off": off,
            "on": on,
            "medians": medians,
            "runs": runs[name],
            "gains": gains,
            "best_gain": {"figure": best[0], "gain": best[1]},
            "pays_for_itself": best[1] >= KEEP_GAIN,
        }
    return result


# The judged figures: higher is better for these ...
_HIGHER_IS_BETTER = ("drain_events_per_sec", "producer_tps")
# ... lower for these.
# (The NOTIFYs producers sent are reported, not judged: they are a cause; what users pay for
# them is the CPU per transaction.)
_LOWER_IS_BETTER = ("latency_p50_ms_at_", "producer_paced_cpu_us_per_tx_total")


def _gains(off: Mapping[str, float], on: Mapping[str, float]) -> dict[str, float]:
    """What switching the mechanism on gains on each judged figure, as a factor (> 1 is
    better): events/s and tps on/off, median latencies and CPU per transaction off/on."""
    gains: dict[str, float] = {}
    for key in off:
        if key in _HIGHER_IS_BETTER and off[key] > 0:
            gains[key] = round(on[key] / off[key], 3)
        elif key.startswith(_LOWER_IS_BETTER) and on[key] > 0:
            gains[key] = round(off[key] / on[key], 3)
    return gains


async def _measure(
    env: BenchEnv,
    consumer_env: dict[str, str],
    *,
    backlog_end: Position,
    batch_size: int,
    seconds: float,
    rates: Sequence[float],
    timeout: float,
    round_: int,
) -> dict[str, float]:
    """One setting's figures: a drain of the whole outbox, the latency at each rate, pgbench
    with the consumer running."""
    figures: dict[str, float] = {}
    await execute(
        env.backend,
        "DELETE FROM sync.events_outbox WHERE (txid, seq) > (%s::xid8, %s)",
        (str(backlog_end.txid), backlog_end.seq),
    )
    http = await drain.product(env, batch_size, "http", timeout, consumer_env=consumer_env)
    figures["drain_events_per_sec"] = round(http["events_per_sec"], 1)
    for part, us in (http["cpu_us_per_event"] or {}).items():
        figures[f"drain_cpu_us_per_event_{part}"] = us
    await execute(env.frontend, "TRUNCATE ingest.entities")
    for rate in rates:
        run = await latency.run_latency(
            env,
            rate=rate,
            seconds=seconds,
            listen=True,
            poll_interval=300.0,
            consumer_env=consumer_env,
        )
        key = latency.rate_key(rate)
        figures[f"latency_p50_ms_at_{key}"] = run["p50_ms"]
        figures[f"latency_p99_ms_at_{key}"] = run["p99_ms"]
        await execute(env.frontend, "TRUNCATE ingest.entities")
    name = f"mechanism_{'_'.join(f'{k}_{v}' for k, v in consumer_env.items())}"
    paced: tuple[tuple[str, int | None], ...] = (("producer", None), ("producer_paced", PACED_TPS))
    for prefix, tps_limit in paced:
        mode = producer.Mode(
            f"{name}_{prefix}", "bench_tracked", "auto", dict(consumer_env), rate=tps_limit
        )
        run_seconds = max(2, round(seconds))
        # The consumer starts at the outbox's end: what it delivers is what pgbench writes.
        await latency.start_at_outbox_end(env)
        async with _notifications(env.backend) as count:
            tps, cpu = await producer.run_mode(env, mode, run_seconds, PRODUCER_CONNECTIONS, round_)
        figures[f"{prefix}_tps"] = round(tps, 1)
        # The NOTIFYs the producers sent, counted by a listener of the relay's channel: what the
        # wake-ups cost them, whatever else the machine does.
        figures[f"{prefix}_notifies_per_1000_tx"] = round(count() * 1000 / (tps * run_seconds), 2)
        for part in ("postgres", "consumer", "total"):
            if part in cpu:
                figures[f"{prefix}_cpu_us_per_tx_{part}"] = round(cpu[part], 1)
    return figures


@contextlib.asynccontextmanager
async def _notifications(dsn: str) -> AsyncIterator[Callable[[], int]]:
    """LISTEN on the relay's channel meanwhile; yields how many notifications came so far."""
    received = 0
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)

    async def count() -> None:
        nonlocal received
        async for _ in conn.notifies():
            received += 1

    async with conn:
        await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
        counting = asyncio.create_task(count())
        try:
            yield lambda: received
        finally:
            counting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await counting


def targets(result: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each mechanism pays for itself: a gain of at least KEEP_GAIN on some figure."""
    checks: dict[str, dict[str, Any]] = {}
    for name, m in result["mechanisms"].items():
        best = m["best_gain"]
        checks[f"mechanism_pays_for_itself_{name}"] = {
            "target": f">= {KEEP_GAIN} on some figure"
            f" ({m['setting']} {m['on']} against {m['off']})",
            "measured": f"{best['gain']} ({best['figure']})",
            "met": m["pays_for_itself"],
        }
    return checks


def summary(result: Mapping[str, Any]) -> list[str]:
    """One block per mechanism: its figures off and on, the gains, the verdict."""
    lines = [
        f"mechanisms on and off ({result['rounds']} interleaved rounds, medians; drain of"
        f" {result['events']:,} events, latency at {', '.join(f'{r:g}' for r in result['rates'])}"
        f"/s, pgbench {PRODUCER_CONNECTIONS} connections with the consumer running, unpaced and"
        f" at {PACED_TPS:,} tps):"
    ]
    for name, m in result["mechanisms"].items():
        verdict = "pays for itself" if m["pays_for_itself"] else "gains < 5 %: remove"
        lines.append(f"  {name} ({m['setting']} {m['off']} -> {m['on']}): {verdict}")
        for key in m["medians"]["off"]:
            gain = m["gains"].get(key)
            off, on = m["medians"]["off"][key], m["medians"]["on"][key]
            lines.append(
                f"    {key:40} {off:>12,.3f} -> {on:>12,.3f}"
                + (f"  x{gain}" if gain is not None else "")
            )
    return lines
