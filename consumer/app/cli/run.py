"""`serversync run CONSUMER`: one consumer process, built in or declared in SYNC_CONSUMERS_FILE,
until SIGTERM or SIGINT (an unknown name, or a declaration that is wrong, exits 2 with one
line). The first run of a consumer registers it where --from-now / --from-earliest (or
SYNC_START) say; by default with a snapshot of its tables when the outbox no longer holds the
whole history (consumer/store/new_consumers.py)."""

from __future__ import annotations

import argparse

from consumer.app.cli.common import Subparsers, backend_settings
from consumer.app.wiring import CONSUMERS, SINKS, run_consumer
from consumer.observability.telemetry import setup_telemetry


def register(sub: Subparsers) -> None:
    """Add `run` to the command line."""
    p = sub.add_parser("run", help="run a consumer until SIGTERM/SIGINT")
    p.add_argument(
        "consumer",
        metavar="CONSUMER",
        # Not argparse's choices: a declared name is known only once the settings are read.
        help=f"{', '.join(CONSUMERS)}, or a consumer declared in SYNC_CONSUMERS_FILE",
    )
    p.add_argument(
        "--sink",
        choices=SINKS,
        default="default",
        help="'null' accepts every batch without sending it (benchmarks)",
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--from-now",
        dest="start_from",
        action="store_const",
        const="now",
        help="first run only: start at the outbox's current end, with no snapshot",
    )
    start.add_argument(
        "--from-earliest",
        dest="start_from",
        action="store_const",
        const="earliest",
        help="first run only: start at the outbox's start, with no snapshot (what is left of "
        "the history after cleanup)",
    )
    p.set_defaults(handler=run, start_from=None)


async def run(args: argparse.Namespace) -> int:
    """Run the consumer; its telemetry is flushed on the way out."""
    settings = backend_settings(args)
    if args.start_from is not None:
        # The option wins over SYNC_START.
        settings = settings.model_copy(update={"start_from": args.start_from})
    telemetry = setup_telemetry(f"serversync-{args.consumer}")
    try:
        await run_consumer(settings, args.consumer, args.sink, telemetry=telemetry)
    finally:
        telemetry.shutdown()
    return 0
