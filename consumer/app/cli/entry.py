"""`main`: parse, run the command, and turn the errors an operator can fix into one line and an
exit code."""

from __future__ import annotations

import asyncio
import sys

import psycopg

from consumer.app.cli.common import EXIT_CONFIG, EXIT_ERROR
from consumer.app.cli.parser import build_parser
from consumer.app.settings import ConfigError
from consumer.app.startup import StartupError
from consumer.core.errors import first_line
from consumer.store import admin, migrations
from consumer.store.dlq import DlqError


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `serversync` command."""
    args = build_parser().parse_args(argv)
    try:
        exit_code: int = asyncio.run(args.handler(args))
    except ConfigError as exc:
        print(f"serversync: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except admin.UnknownConsumerError as exc:
        # A name that is not there is bad input, as a bad option is.
        print(f"serversync: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (StartupError, admin.AdminError, migrations.MigrationError, DlqError) as exc:
        print(f"serversync: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except psycopg.errors.InsufficientPrivilege as exc:
        # The role of DATABASE_URL lacks a grant: which one is in PostgreSQL's message.
        print(
            f"serversync: {first_line(exc)} (the grants each command needs: "
            "docs/security.md, Roles and grants)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    except psycopg.Error as exc:
        # What the database refused (a table dropped under a snapshot, say): its message is
        # the line an operator needs; a traceback would bury it.
        print(f"serversync: {first_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    return exit_code
