"""`serversync consumers list|remove`: the registered consumers, and deregistering one."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import psycopg

from consumer.app.cli.common import (
    EXIT_CONFIG,
    EXIT_ERROR,
    Subparsers,
    backend_settings,
    operator_connection,
)
from consumer.app.cli.render import CONSUMERS_COLUMNS, consumer_table, to_json, when
from consumer.store import admin, registration


def register(sub: Subparsers) -> None:
    """Add `consumers list` and `consumers remove` to the command line."""
    consumers = sub.add_parser("consumers", help="list and deregister consumers")
    consumers.set_defaults(handler=run)
    csub = consumers.add_subparsers(dest="consumers_command", required=True, metavar="ACTION")
    p = csub.add_parser("list", help="every registered consumer: position, leader, last update")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = csub.add_parser("remove", help="deregister a consumer that is no longer run")
    p.add_argument("consumer")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument(
        "--purge-dlq", action="store_true", help="delete its dead letters too (kept by default)"
    )


async def run(args: argparse.Namespace) -> int:
    """List the consumers, or remove one."""
    async with operator_connection(backend_settings(args), "consumers") as conn:
        if args.consumers_command == "list":
            rows = await admin.consumer_status(conn)
            print(to_json(rows) if args.json else consumer_table(rows, CONSUMERS_COLUMNS))
            return 0
        return await _remove(conn, args)


async def _remove(conn: psycopg.AsyncConnection[Any], args: argparse.Namespace) -> int:
    found = await registration.find_consumer(conn, args.consumer)
    if not args.yes:
        if not sys.stdin.isatty():
            print(
                f"serversync: removing consumer {found.consumer} forgets its position for good; "
                "confirm with --yes",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        question = (
            f"remove consumer {found.consumer} (at {found.position}, updated "
            f"{when(found.updated_at)}, {found.dead_letters} dead letter(s) "
            f"{'deleted' if args.purge_dlq else 'kept'})? [y/N] "
        )
        answer = await asyncio.to_thread(input, question)
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_ERROR
    removed = await registration.remove_consumer(conn, args.consumer, purge_dlq=args.purge_dlq)
    dead_letters = (
        f"deleted its {removed.dead_letters_deleted} dead letter(s)"
        if args.purge_dlq
        else f"kept its {removed.dead_letters_kept} dead letter(s) (--purge-dlq deletes them)"
    )
    print(f"removed consumer {removed.consumer} (was at {removed.position}); {dead_letters}")
    return 0
