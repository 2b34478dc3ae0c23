"""Snapshots as the database records them: a snapshot's outbox rows, its progress, and whether
the outbox still holds the whole history; and `serversync snapshot` run against a database."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tests.conftest import CliResult, cli_env, fetch_all, fetch_value
from tests.support.cli import run_cli

__all__ = [
    "SnapshotRow",
    "history",
    "rows_sent",
    "snapshot_cli",
    "snapshot_outbox",
    "snapshot_state",
]


@dataclass(frozen=True)
class SnapshotRow:
    """One outbox row a snapshot wrote."""

    seq: int
    op: str
    entity_type: str
    entity_id: str
    payload: Any
    target_consumer: str | None


async def snapshot_cli(dsn: str, *args: str, timeout: float = 60.0, **env: str) -> CliResult:
    """`serversync snapshot ARGS...` against `dsn` (with more environment `env`), to the end."""
    return await run_cli("snapshot", *args, env=cli_env(DATABASE_URL=dsn, **env), timeout=timeout)


async def snapshot_outbox(dsn: str, snapshot_id: int) -> list[SnapshotRow]:
    """The outbox rows of snapshot `snapshot_id`, in seq order."""
    rows = await fetch_all(
        dsn,
        "SELECT seq, op, entity_type, entity_id, payload, target_consumer"
        " FROM sync.events_outbox WHERE snapshot_id = %s ORDER BY seq",
        (snapshot_id,),
    )
    return [SnapshotRow(*row) for row in rows]


async def rows_sent(dsn: str, snapshot_id: int | None = None) -> int:
    """Rows snapshot `snapshot_id` (None: every snapshot) recorded as sent."""
    return int(
        await fetch_value(
            dsn,
            "SELECT coalesce(sum(rows_sent), 0) FROM sync.snapshot_tables"
            " WHERE %(id)s::bigint IS NULL OR snapshot_id = %(id)s::bigint",
            {"id": snapshot_id},
        )
    )


async def snapshot_state(dsn: str, snapshot_id: int) -> dict[str, Any]:
    """The row of sync.snapshots, as a dict."""
    rows = await fetch_all(
        dsn,
        "SELECT id, consumer, state, delete_missing, begin_seq FROM sync.snapshots WHERE id = %s",
        (snapshot_id,),
    )
    assert rows, f"no snapshot {snapshot_id}"
    return dict(
        zip(("id", "consumer", "state", "delete_missing", "begin_seq"), rows[0], strict=True)
    )


async def history(dsn: str) -> tuple[bool, str | None]:
    """sync.outbox_history: whether the outbox holds the whole history, and why not."""
    rows = await fetch_all(dsn, "SELECT complete, reason FROM sync.outbox_history")
    assert len(rows) == 1, rows
    return bool(rows[0][0]), rows[0][1]
