"""`serversync cleanup`: delete old outbox rows every consumer has passed, and old resolved dead
letters."""

from __future__ import annotations

import argparse
from datetime import timedelta

from consumer.app.cli.common import Subparsers, backend_settings, operator_connection
from consumer.app.cli.render import to_json
from consumer.store import retention


def register(sub: Subparsers) -> None:
    """Add `cleanup` to the command line."""
    p = sub.add_parser(
        "cleanup",
        help="delete old outbox rows every consumer has passed, and old resolved dead letters",
    )
    p.add_argument(
        "--older-than",
        type=_duration,
        default=retention.DEFAULT_RETENTION,
        metavar="AGE",
        help=f"retention: 30d, 12h, 90m, 45s or seconds (default {retention.DEFAULT_RETENTION})",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    p.add_argument(
        "--batch-size",
        type=_batch_size,
        default=retention.DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"rows per delete transaction (default {retention.DEFAULT_BATCH_SIZE})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(handler=run)


def _duration(value: str) -> timedelta:
    try:
        return retention.parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _batch_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 1 <= size <= retention.MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of rows between 1 and {retention.MAX_BATCH_SIZE}"
        )
    return size


async def run(args: argparse.Namespace) -> int:
    """Clean up (or with --dry-run count) and print the summary."""
    async with operator_connection(backend_settings(args), "cleanup") as conn:
        report = await retention.cleanup(
            conn, older_than=args.older_than, batch_size=args.batch_size, dry_run=args.dry_run
        )
    print(to_json(report.to_dict()) if args.json else report.summary())
    # Lagging consumers were logged as warnings; they are no failure: the run did its part.
    return 0
