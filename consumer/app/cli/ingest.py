"""`serversync ingest-server`: the reference receiver, until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
from typing import Any

from consumer.app.cli.common import Subparsers
from consumer.app.ingest_server import run_ingest_server
from consumer.app.settings import ReceiverSettings, load
from consumer.observability.telemetry import setup_logging, setup_telemetry


def register(sub: Subparsers) -> None:
    """Add `ingest-server` to the command line."""
    p = sub.add_parser("ingest-server", help="run the reference receiver (FRONTEND_DATABASE_URL)")
    p.add_argument("--host", help="address to bind (INGEST_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (INGEST_PORT, default 8080)")
    p.add_argument(
        "--mapping",
        metavar="FILE",
        help="apply the entity types it maps into tables (INGEST_MAPPING_FILE; TOML)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="accept unsigned requests when SYNC_SHARED_SECRET is not set (demos only)",
    )
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    """Serve; the options override INGEST_HOST, INGEST_PORT and INGEST_MAPPING_FILE."""
    overrides: dict[str, Any] = {}
    if args.host:
        overrides["INGEST_HOST"] = args.host
    if args.port is not None:
        overrides["INGEST_PORT"] = args.port
    if args.mapping:
        overrides["INGEST_MAPPING_FILE"] = args.mapping
    receiver = load(ReceiverSettings, **overrides)
    setup_logging(receiver.log_level, args.log_format)
    telemetry = setup_telemetry("serversync-ingest")
    try:
        await run_ingest_server(receiver, insecure=args.insecure)
    finally:
        telemetry.shutdown()
    return 0
