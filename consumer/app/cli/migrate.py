"""`serversync migrate`: serversync's schema in the backend (or the receiver's) database."""

from __future__ import annotations

import argparse
import re
from typing import Any

import psycopg

from consumer.app.cli.common import Subparsers, backend_settings
from consumer.app.settings import CONSUMER_NAME, ConfigError, ReceiverSettings, load
from consumer.app.startup import connect_or_explain
from consumer.observability.telemetry import setup_logging
from consumer.store import migrations


def register(sub: Subparsers) -> None:
    """Add `migrate` to the command line."""
    p = sub.add_parser("migrate", help="apply serversync's SQL migrations (DATABASE_URL)")
    examples = p.add_mutually_exclusive_group()
    examples.add_argument(
        "--with-examples",
        action="store_true",
        help="also the example voicebot tables (call_logs, recordings, ...), tracked: created "
        "where missing, left as they are where they exist (demos, tests)",
    )
    examples.add_argument(
        "--core-only",
        action="store_true",
        help="only serversync's own schema: what migrate does without --with-examples",
    )
    p.add_argument(
        "--receiver",
        action="store_true",
        help="migrate the reference receiver's database (FRONTEND_DATABASE_URL) instead",
    )
    p.add_argument(
        "--node",
        metavar="NAME",
        help="name this database's node (the origin its changes carry, the node of its row "
        "versions; sync.node): set, or changed, after the migrations",
    )
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    """Apply what is missing and say what was applied."""
    node = getattr(args, "node", None)
    # Checked before connecting: a bad name changes nothing.
    if node is not None and not re.fullmatch(CONSUMER_NAME, node):
        raise ConfigError(
            f"--node {node[:80]!r} is not a node name (a lowercase letter, then up to 62 "
            "lowercase letters, digits, _ or -)"
        )
    if args.receiver:
        if node is not None:
            raise ConfigError("--node is for the backend database, not with --receiver")
        if args.with_examples:
            raise ConfigError("--with-examples is for the backend database, not with --receiver")
        receiver = load(ReceiverSettings)
        setup_logging(receiver.log_level, args.log_format)
        return await _migrate(receiver.frontend_database_url, ["receiver"], "FRONTEND_DATABASE_URL")
    settings = backend_settings(args)
    return await _migrate(
        settings.database_url, ["backend"], "DATABASE_URL", examples=args.with_examples, node=node
    )


async def _migrate(
    dsn: str,
    components: list[str],
    what: str,
    *,
    examples: bool = False,
    node: str | None = None,
) -> int:
    async with await connect_or_explain(dsn, "migrate", what) as conn:
        done = await migrations.migrate(conn, components)
        for migration in done:
            print(f"applied {migration.label}")
        if not done:
            print(f"{what}: up to date ({', '.join(components)})")
        if examples:
            for example in await migrations.apply_examples(conn):
                print(
                    f"{migrations.EXAMPLES}/{example.name}: in place (created what was missing, "
                    "left what existed as it was)"
                )
        if "backend" in components:
            line = await _name_node(conn, node)
            if line:
                print(line)
    return 0


async def _name_node(conn: psycopg.AsyncConnection[Any], node: str | None) -> str | None:
    """Set the node's name when `node` is given; the line that says the node's name (None for
    an unnamed node nobody named: the output of a one-way setup stays as it was)."""
    row = await (await conn.execute("SELECT sync.node_name()")).fetchone()
    before: str | None = row[0] if row else None
    if node is None:
        return f"node: {before}" if before is not None else None
    if node == before:
        return f"node: {node} (unchanged)"
    await conn.execute("SELECT sync.set_node_name(%s)", (node,))
    if before is None:
        return f"node: {node} (named)"
    return f"node: {node} (renamed from {before})"
