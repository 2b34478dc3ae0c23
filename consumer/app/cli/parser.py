"""The `serversync` argument parser: global options, then each command's own (which its module
adds, with the handler that runs it)."""

from __future__ import annotations

import argparse

from consumer.app.cli import (
    cleanup,
    consumers,
    demo,
    dlq,
    ingest,
    migrate,
    offsets,
    run,
    snapshot,
    status,
)

# In the order `serversync --help` lists them.
COMMANDS = (migrate, run, ingest, demo, status, offsets, snapshot, dlq, cleanup, consumers)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `serversync`: parse_args sets `handler`, the command's coroutine function,
    which takes the parsed arguments and returns the exit code."""
    parser = argparse.ArgumentParser(
        prog="serversync",
        description="Move every change out of a PostgreSQL database to the services that need it.",
    )
    parser.add_argument(
        "--log-format",
        choices=["json", "text"],
        default="json",
        help="log lines on stderr as JSON objects (default) or text",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return parser
