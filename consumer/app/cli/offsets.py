"""`serversync offsets list|reset`: every consumer's position, and moving a stopped one's."""

from __future__ import annotations

import argparse
from datetime import datetime

from consumer.app.cli.common import Subparsers, backend_settings, operator_connection
from consumer.app.cli.render import OFFSETS_COLUMNS, consumer_table, to_json
from consumer.store import admin


def register(sub: Subparsers) -> None:
    """Add `offsets list` and `offsets reset` to the command line."""
    offsets = sub.add_parser("offsets", help="inspect and move consumer offsets")
    offsets.set_defaults(handler=run)
    osub = offsets.add_subparsers(dest="offsets_command", required=True, metavar="ACTION")
    p = osub.add_parser("list", help="every consumer's position")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = osub.add_parser("reset", help="move a stopped consumer's offset (replay or skip)")
    p.add_argument("consumer")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-earliest", action="store_true", help="replay the whole outbox")
    target.add_argument("--to-latest", action="store_true", help="skip everything delivered so far")
    target.add_argument("--to-seq", type=int, metavar="N", help="replay every event with seq > N")
    target.add_argument(
        "--to-datetime",
        type=_iso_datetime,
        metavar="ISO",
        help="replay every event created at or after this time",
    )
    target.add_argument(
        "--shift-by", type=int, metavar="N", help="move by N events (negative: replay N events)"
    )
    p.add_argument("--dry-run", action="store_true", help="show what would change, change nothing")


def _iso_datetime(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date-time: {value!r}") from None
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} needs a UTC offset, e.g. {value}+00:00")
    return parsed


async def run(args: argparse.Namespace) -> int:
    """List the positions, or plan (and unless --dry-run, apply) one reset."""
    async with operator_connection(backend_settings(args), "offsets") as conn:
        if args.offsets_command == "list":
            rows = await admin.consumer_status(conn)
            print(to_json(rows) if args.json else consumer_table(rows, OFFSETS_COLUMNS))
            return 0
        options = {
            "to_earliest": args.to_earliest,
            "to_latest": args.to_latest,
            "to_seq": args.to_seq,
            "to_datetime": args.to_datetime,
            "shift_by": args.shift_by,
        }
        if args.dry_run:
            plan = await admin.plan_reset(conn, args.consumer, **options)
        else:
            # The consumer's leader lock keeps it from starting while its offset moves.
            async with admin.holding_consumer_lock(conn, args.consumer):
                plan = await admin.plan_reset(conn, args.consumer, **options)
                await admin.apply_reset(conn, plan)
    effect = (
        f"{plan.replayed} event(s) will be replayed"
        if plan.replayed
        else f"{plan.skipped} event(s) will be skipped"
        if plan.skipped
        else "no events change hands"
    )
    verb = "would move" if args.dry_run else "moved"
    print(
        f"{plan.consumer}: {verb} from {plan.current} to {plan.target}; {effect}"
        f"{' (dry run, nothing changed)' if args.dry_run else ''}"
    )
    return 0
