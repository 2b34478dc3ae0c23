"""The two receivers side by side: one backlog of a settings-like table drained through HTTP into
the generic receiver (every entry into ingest.entities) and into the table-mapping receiver
(INGEST_MAPPING_FILE: every entry into a table of the same shape, guarded by
sync.row_versions), in interleaved rounds on the same server.

The backlog is half inserts of new rows and half updates of them, as settings are edited; the
backend's node is named, so every entry carries the origin and createdAt that a mapped entry
needs (and the generic receiver ignores). Each figure of a receiver is the median of its rounds;
each ratio is mapped over generic, of those medians. The round order alternates (generic first,
then mapped first), so a machine that speeds up or slows down during the run favours neither.
"""

from __future__ import annotations

import statistics
from typing import Any

from bench.drain import ReceiverSide, product
from bench.harness import MAPPED_DB, BenchEnv, execute, progress
from consumer.devtools.devdb import fresh_database

RECEIVERS = ("generic", "mapped")
ENTITY_TYPE = "bench_setting"
# The same shape on both sides: the backend's tracked table and the mapped receiver's table.
SETTINGS_TABLE = """
CREATE TABLE IF NOT EXISTS public.bench_settings (
    id         bigint      PRIMARY KEY,
    label      text        NOT NULL,
    number     text        NOT NULL,
    enabled    boolean     NOT NULL DEFAULT true,
    updated_at timestamptz NOT NULL DEFAULT now()
)
"""
MAPPING = f"""[entities.{ENTITY_TYPE}]
table = "public.bench_settings"
key = "id"
deletes = true
"""
# The CPU the receiving side spends: the receiver's process and its PostgreSQL sessions.
RECEIVER_PARTS = ("receiver", "postgres receiver")
# Each ratio: the CPU parts (or the rate) it divides, mapped over generic.
RATIOS = {
    "events_per_sec": None,
    "receiver_cpu": ("receiver",),
    "receiver_postgres_cpu": ("postgres receiver",),
    "receiver_side_cpu": RECEIVER_PARTS,
    "total_cpu": ("total",),
}


def parse(value: str) -> tuple[str, ...]:
    """`--receivers generic,mapped`: the receivers to measure, each once, in a fixed order."""
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = sorted(names - set(RECEIVERS))
    if unknown or not names:
        raise ValueError(f"unknown receiver {unknown[0]!r}" if unknown else "no receiver named")
    return tuple(name for name in RECEIVERS if name in names)


async def _produce_settings(env: BenchEnv, events: int, chunk: int = 50_000) -> int:
    """`events` changes of bench_settings through the real relay, in an emptied outbox: inserts
    of half as many rows, then an update of each. Returns the number of rows."""
    await execute(env.backend, SETTINGS_TABLE)
    await execute(env.backend, "TRUNCATE sync.events_outbox, public.bench_settings")
    # A named node: the consumer's entries carry an origin, which a mapped entry needs.
    await execute(env.backend, "SELECT sync.set_node_name('backend')")
    tracked = await execute(
        env.backend,
        "SELECT 1 FROM sync.tracked_tables WHERE table_name = 'public.bench_settings'::regclass",
    )
    if not tracked:
        await execute(env.backend, "SELECT sync.track('public.bench_settings', %s)", (ENTITY_TYPE,))
    rows = (events + 1) // 2
    for first in range(1, rows + 1, chunk):
        last = min(first + chunk - 1, rows)
        await execute(
            env.backend,
            "INSERT INTO public.bench_settings (id, label, number, enabled)"
            " SELECT g, 'bench setting ' || g, '090' || lpad(g::text, 8, '0'), g %% 2 = 0"
            " FROM generate_series(%s::bigint, %s::bigint) g",
            (first, last),
        )
    updates = events - rows
    for first in range(1, updates + 1, chunk):
        last = min(first + chunk - 1, updates)
        await execute(
            env.backend,
            "UPDATE public.bench_settings SET label = label || ' (edited)',"
            " enabled = NOT enabled, updated_at = now() WHERE id BETWEEN %s AND %s",
            (first, last),
        )
    await execute(env.backend, "VACUUM ANALYZE sync.events_outbox")
    progress(f"receivers: produced {events:,} events of {rows:,} {ENTITY_TYPE} rows")
    return rows


async def _sides(env: BenchEnv) -> dict[str, ReceiverSide]:
    """The generic receiver on the bench's receiver database, and the mapped one on a database
    of its own with serversync's schema (`migrate`, then `migrate --receiver`) and the table."""
    mapped_dsn = await fresh_database(env.server.dsn, MAPPED_DB, ["backend", "receiver"])
    await execute(mapped_dsn, SETTINGS_TABLE)
    mapping = env.workdir / "bench-mapping.toml"
    mapping.write_text(MAPPING)
    return {
        "generic": ReceiverSide("generic", env.frontend),
        "mapped": ReceiverSide(
            "mapped",
            mapped_dsn,
            mapping,
            reset=("TRUNCATE public.bench_settings, sync.row_versions",),
            count="SELECT count(*) FROM public.bench_settings",
        ),
    }


def _receiver_side(cpu: dict[str, float] | None) -> dict[str, float] | None:
    """The run's CPU per event with the receiving side's sum added."""
    if cpu is None:
        return None
    return {**cpu, "receiver side": round(sum(cpu.get(part, 0.0) for part in RECEIVER_PARTS), 2)}


def _median(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A receiver's figures: the median of its rounds (CPU only when every round measured it)."""
    figures: dict[str, Any] = {
        "events": runs[0]["events"],
        "events_per_sec": round(statistics.median(run["events_per_sec"] for run in runs), 1),
        "receiver_peak_rss_mb": max(run["receiver_peak_rss_mb"] for run in runs),
        "cpu_us_per_event": None,
    }
    cpus = [run["cpu_us_per_event"] for run in runs]
    if all(cpus):
        parts = set.intersection(*(set(cpu) for cpu in cpus))
        figures["cpu_us_per_event"] = {
            part: round(statistics.median(cpu[part] for cpu in cpus), 2) for part in sorted(parts)
        }
    return figures


def _cpu_of(figures: dict[str, Any], parts: tuple[str, ...]) -> float | None:
    cpu = figures["cpu_us_per_event"]
    if not cpu or not all(part in cpu for part in parts):
        return None
    return float(sum(cpu[part] for part in parts))


def ratios(generic: dict[str, Any], mapped: dict[str, Any]) -> dict[str, float | None]:
    """Each ratio, mapped over generic (None where a round did not measure CPU)."""
    found: dict[str, float | None] = {}
    for name, parts in RATIOS.items():
        if parts is None:
            top, bottom = mapped["events_per_sec"], generic["events_per_sec"]
        else:
            top, bottom = _cpu_of(mapped, parts), _cpu_of(generic, parts)
        found[name] = round(top / bottom, 3) if top is not None and bottom else None
    return found


async def compare(
    env: BenchEnv, events: int, batch_size: int, rounds: int, receivers: tuple[str, ...]
) -> dict[str, Any]:
    """Drain the same backlog into each of `receivers`, `rounds` times, alternating the order."""
    rows = await _produce_settings(env, events)
    sides = await _sides(env)
    timeout = max(120.0, events / 2_000)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in receivers}
    for number in range(rounds):
        order = receivers if number % 2 == 0 else tuple(reversed(receivers))
        for name in order:
            progress(f"receivers: {name}, {number + 1} of {rounds}")
            run = await product(env, batch_size, "http", timeout, sides[name])
            run["cpu_us_per_event"] = _receiver_side(run["cpu_us_per_event"])
            runs[name].append(run)
    result: dict[str, Any] = {
        "events": events,
        "rows": rows,
        "entity_type": ENTITY_TYPE,
        "batch_size": batch_size,
        "rounds": rounds,
        "receivers": list(receivers),
        "runs": runs,
    }
    for name in receivers:
        result[name] = _median(runs[name])
    if set(RECEIVERS) <= set(receivers):
        result["ratios"] = ratios(result["generic"], result["mapped"])
        # The same ratio within each round: how far the rounds agree.
        result["round_ratios"] = [
            ratios(_median([g]), _median([m]))
            for g, m in zip(runs["generic"], runs["mapped"], strict=True)
        ]
    return result
