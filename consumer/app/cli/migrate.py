"""`serversync migrate`: serversync's schema in the backend (or the receiver's) database."""

from __future__ import annotations

import argparse

from consumer.app.cli.common import Subparsers, backend_settings
from consumer.app.settings import ConfigError, ReceiverSettings, load
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
    p.set_defaults(handler=run)


async def run(args: argparse.Namespace) -> int:
    """Apply what is missing and say what was applied."""
    if args.receiver:
        if args.with_examples:
            raise ConfigError("--with-examples is for the backend database, not with --receiver")
        receiver = load(ReceiverSettings)
        setup_logging(receiver.log_level, args.log_format)
        return await _migrate(receiver.frontend_database_url, ["receiver"], "FRONTEND_DATABASE_URL")
    settings = backend_settings(args)
    return await _migrate(
        settings.database_url, ["backend"], "DATABASE_URL", examples=args.with_examples
    )


async def _migrate(dsn: str, components: list[str], what: str, *, examples: bool = False) -> int:
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
    return 0
