"""What the commands share: exit codes, the backend settings, and an operator's connection."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import psycopg

from consumer.app.settings import SyncSettings, load
from consumer.app.startup import StartupError, connect_or_explain
from consumer.observability.telemetry import setup_logging
from consumer.store import migrations

# What add_subparsers returns, to which each command module adds its parser (a string: argparse's
# class is generic only to type checkers).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

EXIT_ERROR = 1
# Bad input (a setting, an option, a name that is not there): what argparse exits with too.
EXIT_CONFIG = 2


def backend_settings(args: argparse.Namespace) -> SyncSettings:
    """The consumer side's settings (DATABASE_URL, ...), with logging set up from them."""
    settings = load(SyncSettings)
    setup_logging(settings.log_level, args.log_format)
    return settings


@contextlib.asynccontextmanager
async def operator_connection(
    settings: SyncSettings, command: str
) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """An autocommit connection to DATABASE_URL for an operator command, once it is known to
    hold serversync's schema (else a StartupError that says to migrate)."""
    async with await connect_or_explain(settings.database_url, command, "DATABASE_URL") as conn:
        if await migrations.pending(conn, "backend"):
            raise StartupError("DATABASE_URL lacks serversync's schema; run `serversync migrate`")
        yield conn
