"""Connections: the settings every serversync connection gets, and DSN helpers."""

from __future__ import annotations

import os
import socket
from typing import Any

import psycopg
from psycopg import conninfo

APPLICATION_PREFIX = "serversync"


def application_name(role: str) -> str:
    """An application_name that tells an operator in pg_stat_activity who holds a connection."""
    return f"{APPLICATION_PREFIX}:{role}:{socket.gethostname()}:{os.getpid()}"[:63]


def connect_kwargs(role: str, *, synchronous_commit: bool = True) -> dict[str, Any]:
    """Options for every serversync connection: UTC timestamps, no JIT and a telling
    application_name; `synchronous_commit=False` for a session whose commits may be lost in a
    server crash.

    JIT off: every statement serversync runs walks at most a few thousand index entries, but
    some cost estimates (a LIMIT per consumer, times the consumers, or a table never analysed)
    pass jit_above_cost, and compiling then took 450 ms where running took 10 (the status and
    gauge queries at 10 million outbox rows)."""
    return {
        "application_name": application_name(role),
        "options": "-c TimeZone=UTC -c jit=off"
        + ("" if synchronous_commit else " -c synchronous_commit=off"),
        # Keepalives make a half-open TCP connection to a crashed server fail in seconds.
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
    }


async def connect(dsn: str, role: str, *, autocommit: bool = True) -> psycopg.AsyncConnection[Any]:
    """A connection outside any pool (leader lock, LISTEN, admin commands)."""
    return await psycopg.AsyncConnection.connect(
        dsn, autocommit=autocommit, connect_timeout=10, **connect_kwargs(role)
    )


def mask_dsn(dsn: str) -> str:
    """The DSN with its password replaced, fit for logs and error messages."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "<unparseable DATABASE_URL>"
    if "password" in params:
        params["password"] = "***"  # noqa: S105 - a mask, not a password
    return conninfo.make_conninfo("", **params)


def with_dbname(dsn: str, dbname: str) -> str:
    """The same server and credentials, another database."""
    return conninfo.make_conninfo(dsn, dbname=dbname)
