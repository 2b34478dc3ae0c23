"""`serversync status`: per consumer its position, backlog, lag, leader and dead letters; why a
failing one fails; the open transactions that hold events back; and the snapshots not finished."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from datetime import UTC, datetime
from typing import Any

import psycopg

from consumer.app.cli.common import Subparsers, backend_settings, operator_connection
from consumer.app.cli.render import (
    STATUS_COLUMNS,
    age,
    consumer_table,
    one_line,
    snapshot_lines,
    snapshot_to_dict,
    table,
    to_json,
)
from consumer.store import admin, snapshots

# What an operator does about each kind of failing streak.
FAILING_HINTS = {
    "receiver_unavailable": "The receiver is down, busy or unreachable: check it and the network "
    "to FRONTEND_BASE_URL, or a declared consumer's url; delivery resumes by itself.",
    "wrong_destination": "The receiver refuses who we are or where we send (401/403: "
    "SYNC_SHARED_SECRET differs, or a declared consumer's secret, or the clocks are over 5 "
    "minutes apart; 404/405/3xx: FRONTEND_BASE_URL, or a declared consumer's url, points at the "
    "wrong place). Fix the setting; delivery resumes by itself.",
    "internal_error": "The consumer failed on this batch: see its log (journalctl -u "
    "serversync@CONSUMER) for the traceback.",
}


def register(sub: Subparsers) -> None:
    """Add `status` to the command line."""
    p = sub.add_parser("status", help="per consumer: position, backlog, lag, leader, DLQ")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--consumer", help="only this consumer")
    p.add_argument(
        "--watch", action="store_true", help="refresh until interrupted (Ctrl-C or SIGTERM)"
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=2.0,
        metavar="SEC",
        help="seconds between refreshes with --watch (default 2)",
    )
    p.set_defaults(handler=run)


def _interval(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds from 0.1 to 3600")
    return seconds


async def run(args: argparse.Namespace) -> int:
    """Print the report once, or with --watch every --interval seconds until signalled."""
    async with operator_connection(backend_settings(args), "status") as conn:
        if not args.watch:
            print(await report(conn, consumer=args.consumer, as_json=args.json))
            return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        # On a terminal each report replaces the last; piped, they follow one another.
        clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
        while not stop.is_set():
            text = await report(conn, consumer=args.consumer, as_json=args.json)
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            print(f"{clear}serversync status at {stamp} (every {args.interval:g}s; Ctrl-C stops)")
            print(text, flush=True)
            if not clear:
                print(flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=args.interval)
        return 0


async def report(
    conn: psycopg.AsyncConnection[Any], *, consumer: str | None = None, as_json: bool = False
) -> str:
    """The status of every consumer (or of `consumer`), of the read horizon and of the running
    snapshots (with `consumer`, those it receives: its own and those for every consumer), as
    text."""
    async with conn.transaction():
        # Every query here walks at most a few thousand index entries per consumer, but their
        # cost estimates (LIMIT 10001 per consumer, times the consumers, or 360 of them on a
        # consumer_offsets never analysed) reach jit_above_cost: compiling took 450 ms where
        # running took 10.
        await conn.execute("SET LOCAL jit = off")
        rows = await admin.consumer_status(conn, consumer)
        held = await admin.horizon(conn)
        shots = await snapshots.list_snapshots(conn, running_only=True)
    if consumer and not rows:
        raise admin.UnknownConsumerError(f"no consumer named {consumer!r}")
    running = [shot for shot in shots if consumer is None or shot.consumer in (None, consumer)]
    if as_json:
        return to_json(
            {
                "consumers": rows,
                "horizon": held,
                "snapshots": [snapshot_to_dict(shot) for shot in running],
            }
        )
    lines = [consumer_table(rows, STATUS_COLUMNS)]
    lines += [_failing(r) for r in rows if r["failing_since"] is not None]
    if held.get("held_back_events"):
        lines.append(_held_back(held))
    if running:
        lines.append(
            "\nsnapshots not finished (`serversync snapshot --list` shows the recent ones):\n"
            + "\n".join(snapshot_lines(running))
        )
    return "\n".join(lines)


def _failing(row: dict[str, Any]) -> str:
    return (
        f"\n{row['consumer']}: delivery failing for {age(row['failing_seconds'])} "
        f"({row['failing_reason']}); the offset is held and the batch is retried.\n"
        f"  last error: {one_line(row['last_error'])[:300]}\n"
        f"  {FAILING_HINTS.get(row['failing_reason'], '')}"
    )


def _held_back(held: dict[str, Any]) -> str:
    blockers = table(
        ["PID", "DATABASE", "USER", "APPLICATION", "STATE", "XACT_AGE", "QUERY"],
        [
            [
                str(b["pid"] or "-"),
                one_line(str(b["datname"])),
                one_line(str(b["usename"])),
                one_line(b["application_name"]),
                str(b["state"]),
                age(b["xact_age_seconds"]),
                one_line(b["query"])[:60],
            ]
            for b in held["blockers"]
        ],
    )
    about = "about " if held.get("held_back_estimated") else ""
    return (
        f"\n{about}{held['held_back_events']} committed event(s) are held back "
        f"(oldest {age(held['oldest_held_back_seconds'])}) by older open transactions:\n"
        f"{blockers}"
    )
