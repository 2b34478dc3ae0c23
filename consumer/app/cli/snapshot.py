"""`serversync snapshot`: the current rows of tracked tables written into the stream, for every
consumer or for one, chunk by chunk, with progress on stderr; a stopped one resumes where it
stood when the same command runs again. `--dry-run` shows what it would send, `--list` the
recent snapshots, `--cancel ID` stops one for good."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

import psycopg

from consumer.app import kinds
from consumer.app.cli.common import (
    EXIT_CONFIG,
    EXIT_ERROR,
    Subparsers,
    backend_settings,
    operator_connection,
)
from consumer.app.cli.render import one_line, snapshot_progress, table
from consumer.app.settings import SyncSettings
from consumer.store import admin, snapshot_writer, snapshots
from consumer.store.snapshots import SnapshotError, SnapshotState, SnapshotTable

# A chunk's rows stay locked FOR SHARE until it commits: beyond this a producer editing one of
# them could wait for long.
MAX_CHUNK_SIZE = 100_000
# Seconds between progress lines on stderr.
PROGRESS_EVERY = 1.0
# What `--list` shows.
LIST_LIMIT = 20


def register(sub: Subparsers) -> None:
    """Add `snapshot` to the command line."""
    p = sub.add_parser(
        "snapshot",
        help="send the current rows of tracked tables to the consumers (resumable)",
        description="Write the current rows of tracked tables into the stream as upserts, in "
        "key order, a chunk per short transaction. Stopped (Ctrl-C, SIGTERM) or killed, the same "
        "command resumes it where it stood.",
    )
    p.add_argument(
        "tables",
        nargs="*",
        metavar="TABLE",
        help="a tracked table as SQL names it (items, shop.items, 'shop.\"Items\"'); "
        "default every tracked table",
    )
    p.add_argument(
        "--consumer",
        metavar="NAME",
        help="for this consumer only (registered, built in or declared); default every consumer",
    )
    p.add_argument(
        "--delete-missing",
        action="store_true",
        help="end with a sweep marker per entity type: a receiver may then delete what the "
        "snapshot did not send",
    )
    p.add_argument(
        "--chunk-size",
        type=_chunk_size,
        default=snapshots.CHUNK_SIZE,
        metavar="N",
        help=f"rows per chunk transaction (default {snapshots.CHUNK_SIZE})",
    )
    p.add_argument(
        "--max-rate",
        type=_max_rate,
        metavar="ROWS",
        help="at most this many rows a second: a snapshot's WAL competes with producers' "
        "commits for the disk (default: as fast as the server goes)",
    )
    what = p.add_mutually_exclusive_group()
    what.add_argument(
        "--dry-run",
        action="store_true",
        help="show per table its entity type, key column and rows; write nothing",
    )
    what.add_argument("--list", action="store_true", help="the recent snapshots and their progress")
    what.add_argument("--cancel", type=int, metavar="ID", help="stop snapshot ID for good")
    p.set_defaults(handler=run)


def _max_rate(value: str) -> float:
    """`--max-rate`: rows a second, above 0."""
    try:
        rate = float(value)
    except ValueError:
        rate = 0.0
    if not rate > 0 or rate == float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of rows a second above 0")
    return rate


def _chunk_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 1 <= size <= MAX_CHUNK_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of rows between 1 and {MAX_CHUNK_SIZE}"
        )
    return size


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _bad_input(message: str) -> int:
    _say(f"serversync: {one_line(message)}")
    return EXIT_CONFIG


async def run(args: argparse.Namespace) -> int:
    """List, cancel, plan (--dry-run) or write a snapshot; the exit code says how it ended:
    0 done, 2 bad input, 1 cancelled meanwhile, 128 + the signal's number when a signal stopped
    it before its end (130 for Ctrl-C, as a shell says; the same command resumes it)."""
    settings = backend_settings(args)
    if (args.list or args.cancel is not None) and (
        args.tables or args.consumer or args.delete_missing
    ):
        return _bad_input("--list and --cancel take no TABLE, --consumer or --delete-missing")
    async with operator_connection(settings, "snapshot") as conn:
        if args.list:
            return await _list(conn)
        if args.cancel is not None:
            return await _cancel(conn, args.cancel)
        try:
            consumer, carried = await _consumer_scope(conn, settings, args.consumer)
            planned = await snapshots.plan_tables(conn, args.tables, entity_types=carried)
            if args.delete_missing:
                await snapshots.refuse_partial_sweep(conn, planned)
        except SnapshotError as exc:
            return _bad_input(str(exc))
        refusal = _scope_refusal(consumer, carried, planned, named=bool(args.tables))
        if refusal:
            return _bad_input(refusal)
        # Asked for by an operator, or by a new consumer whose leader could not write it (its
        # role lacks a grant): resumed alike. One its leader is writing is refused by the
        # snapshot's lock (SnapshotBusyError), not written twice.
        found = await snapshots.unfinished(
            conn, consumer=consumer, relations=[t.relation for t in planned]
        )
        if args.dry_run:
            print(_dry_run(planned, consumer, found))
            return 0
        if found is not None and found.delete_missing != args.delete_missing:
            return _bad_input(
                f"snapshot {found.id} of these tables {_scope(consumer)} is unfinished "
                f"{'with' if found.delete_missing else 'without'} --delete-missing: run it "
                f"again as it was asked for to resume it, or cancel it first (`serversync "
                f"snapshot --cancel {found.id}`)"
            )
        return await _write(conn, args, consumer, planned, found)


def _scope(consumer: str | None) -> str:
    return f"for consumer {consumer}" if consumer else "for every consumer"


async def _consumer_scope(
    conn: psycopg.AsyncConnection[Any], settings: SyncSettings, name: str | None
) -> tuple[str | None, frozenset[str] | None]:
    """The consumer a snapshot is for (None: every one) and the entity types it carries (None:
    every type, or not known here). UnknownConsumerError naming the known ones when `name` is
    neither registered nor built in nor declared in SYNC_CONSUMERS_FILE."""
    if name is None:
        return None, None
    declared = kinds.declared_kinds(settings)
    kind = kinds.KINDS.get(name) or declared.get(name)
    if kind is not None:
        return name, kind.entity_types
    registered = [str(r["consumer"]) for r in await admin.consumer_status(conn)]
    if name in registered:
        return name, None
    known = (
        f"registered: {', '.join(registered) or 'none'}; this build runs: {', '.join(kinds.KINDS)}"
    )
    if declared:
        known += f"; SYNC_CONSUMERS_FILE declares: {', '.join(declared)}"
    raise admin.UnknownConsumerError(f"unknown consumer {name!r} ({known})")


def _scope_refusal(
    consumer: str | None,
    carried: frozenset[str] | None,
    planned: Sequence[SnapshotTable],
    *,
    named: bool,
) -> str | None:
    """Why this snapshot would send nothing a consumer uses, or None."""
    types = ", ".join(sorted(carried or ()))
    if not planned:
        if carried is not None:
            return (
                f"consumer {consumer} carries entity types {types}, and no tracked table holds "
                "any of them"
            )
        return "no table is tracked (track one with sync.track), so a snapshot has nothing to send"
    if named and carried is not None:
        foreign = [t for t in planned if t.entity_type not in carried]
        if foreign:
            listed = ", ".join(f"{t.relation} ({t.entity_type})" for t in foreign)
            return (
                f"consumer {consumer} carries entity types {types} only and would pass over "
                f"{listed}"
            )
    return None


def _dry_run(
    planned: Sequence[SnapshotTable], consumer: str | None, found: SnapshotState | None
) -> str:
    rows = [
        [one_line(t.relation), one_line(t.entity_type), one_line(t.key_column), str(t.rows_total)]
        for t in planned
    ]
    total = sum(t.rows_total for t in planned)
    lines = [
        table(["TABLE", "ENTITY_TYPE", "KEY_COLUMN", "ROWS"], rows),
        f"total: {total} row(s) in {len(planned)} table(s), {_scope(consumer)} "
        "(dry run, nothing written)",
    ]
    if found is not None:
        lines.append(
            f"snapshot {found.id} of these tables is unfinished ({found.rows_sent} of "
            f"{found.rows_total} rows sent): the same command without --dry-run resumes it"
        )
    return "\n".join(lines)


async def _list(conn: psycopg.AsyncConnection[Any]) -> int:
    shots = await snapshots.list_snapshots(conn, limit=LIST_LIMIT)
    if not shots:
        print("no snapshots yet (start one with `serversync snapshot`)")
        return 0
    lines = []
    for shot in shots:
        ended = f", ended {shot.finished_at:%Y-%m-%d %H:%M:%S%z}" if shot.finished_at else ""
        sweep = ", with a sweep marker per entity type" if shot.delete_missing else ""
        lines.append(one_line(shot.describe()))
        lines.append(
            f"  asked for by {shot.requested_by} at {shot.created_at:%Y-%m-%d %H:%M:%S%z}"
            f"{ended}{sweep}"
        )
        lines += [f"  {snapshot_progress(t)}" for t in shot.tables]
    print("\n".join(lines))
    return 0


async def _cancel(conn: psycopg.AsyncConnection[Any], snapshot_id: int) -> int:
    try:
        await snapshots.snapshot_state(conn, snapshot_id)
    except SnapshotError as exc:
        return _bad_input(f"{exc} (`serversync snapshot --list` shows them)")
    # Not running any more: a SnapshotError, one line and exit 1 (cli/entry.py).
    shot = await snapshots.cancel_snapshot(conn, snapshot_id)
    print(f"cancelled {shot.describe()}; what it wrote stays in the stream")
    return 0


class _Progress:
    """Progress lines on stderr, at most one a PROGRESS_EVERY seconds: the snapshot's describe()
    line and the rows per second this run sends."""

    def __init__(self, stream: TextIO, rows_before: int) -> None:
        self.stream = stream
        self.rows_before = rows_before
        self.started = time.monotonic()
        self.shown_at = self.started

    @property
    def elapsed(self) -> float:
        """Seconds since this run began."""
        return time.monotonic() - self.started

    def rate(self, shot: SnapshotState) -> float:
        """Rows per second this run."""
        return (shot.rows_sent - self.rows_before) / max(self.elapsed, 1e-6)

    def __call__(self, shot: SnapshotState) -> None:
        if time.monotonic() - self.shown_at >= PROGRESS_EVERY:
            self.show(shot)

    def show(self, shot: SnapshotState) -> None:
        """Print the line now."""
        self.shown_at = time.monotonic()
        print(
            f"{one_line(shot.describe())}, {self.rate(shot):.0f} rows/s",
            file=self.stream,
            flush=True,
        )


async def _write(
    conn: psycopg.AsyncConnection[Any],
    args: argparse.Namespace,
    consumer: str | None,
    planned: Sequence[SnapshotTable],
    found: SnapshotState | None,
) -> int:
    """Begin a snapshot of `planned` (or resume `found`) and write it to its end, or until
    SIGINT or SIGTERM, which stop it after the chunk in progress."""
    stop = asyncio.Event()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        if found is not None:
            snapshot_id = found.id
            _say(
                f"resuming snapshot {found.id}: {found.rows_sent} of "
                f"{max(found.rows_total, found.rows_sent)} rows sent"
            )
            rows_before = found.rows_sent
        else:
            snapshot_id = await snapshots.create_snapshot(
                conn, planned, consumer=consumer, delete_missing=args.delete_missing
            )
            _say(
                f"snapshot {snapshot_id} {_scope(consumer)}: {sum(t.rows_total for t in planned)} "
                f"row(s) in {len(planned)} table(s), {args.chunk_size} per chunk"
            )
            rows_before = 0
        progress = _Progress(sys.stderr, rows_before)
        shot = await snapshot_writer.run_snapshot(
            conn,
            snapshot_id,
            chunk_size=args.chunk_size,
            progress=progress,
            stop=stop,
            max_rate=args.max_rate,
        )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    progress.show(shot)
    total = max(shot.rows_total, shot.rows_sent)
    if shot.state == "done":
        this_run = shot.rows_sent - rows_before
        resumed = f", {this_run} of them in this run" if found is not None else ""
        sweep = "; a sweep marker per entity type ends it" if shot.delete_missing else ""
        print(
            f"snapshot {shot.id} done {_scope(consumer)}: {shot.rows_sent} row(s) from "
            f"{len(shot.tables)} table(s) in {progress.elapsed:.1f}s "
            f"({progress.rate(shot):.0f} rows/s){resumed}{sweep}"
        )
        return 0
    if shot.state == "cancelled":
        _say(
            f"serversync: snapshot {shot.id} was cancelled at {shot.rows_sent} of {total} rows; "
            "what it wrote stays in the stream"
        )
        return EXIT_ERROR
    _say(
        f"serversync: snapshot {shot.id} stopped at {shot.rows_sent} of {total} rows; running "
        "the same command again resumes it"
    )
    return 128 + (received[0] if received else signal.SIGINT)
