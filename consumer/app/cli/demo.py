"""`serversync demo`: end to end on a local or private PostgreSQL."""

from __future__ import annotations

import argparse

from consumer.app.cli.common import Subparsers
from consumer.observability.telemetry import setup_logging


def register(sub: Subparsers) -> None:
    """Add `demo` to the command line."""
    p = sub.add_parser("demo", help="end-to-end demo on a local or private PostgreSQL")
    p.add_argument("--calls", type=int, default=5, help="call logs to create (default 5)")
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    """Run the demo, with only warnings logged over its own output."""
    # Imported here: every other command would pay for the demo's imports.
    from consumer.devtools.demo import run_demo  # noqa: PLC0415

    setup_logging("WARNING", "text")
    return await run_demo(calls=args.calls)
