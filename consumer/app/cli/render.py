"""How the commands print: aligned tables, ages, times, JSON, the consumer tables and snapshots.

`status`, `offsets list` and `consumers list` show one query (admin.consumer_status) in one
renderer: each names the columns it shows, from the same cells.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import orjson

from consumer.observability.redact import printable
from consumer.store.snapshots import SnapshotState, SnapshotTable

NO_CONSUMERS = "no consumers registered yet (start one with `serversync run NAME`)"


def to_json(value: Any) -> str:
    """`value` as indented JSON (dates, UUIDs and the like as their text)."""
    return orjson.dumps(value, default=str, option=orjson.OPT_INDENT_2).decode()


def age(seconds: float | None) -> str:
    """A duration as `12.5s`, `3.0m` or `1.2h`; `-` for none."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def when(value: Any) -> str:
    """A time to the second in ISO 8601; `-` for none."""
    return value.isoformat(timespec="seconds") if value is not None else "-"


def one_line(text: str | None) -> str:
    """Text fit for a table cell: control characters gone, runs of white space one space,
    `-` for none. Errors and other connections' queries may hold anything."""
    return " ".join(printable(text or "-").split()) or "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns left-aligned to their widest cell, two spaces apart, under a header line."""
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


# -- the consumer tables -------------------------------------------------------------------------

Row = dict[str, Any]


def _backlog(row: Row) -> str:
    # "~" marks a backlog too large to count on every look (admin.EXACT_BACKLOG_UP_TO).
    return f"~{row['backlog']}" if row["backlog_estimated"] else str(row["backlog"])


def _leader(row: Row) -> str:
    if not row["running"]:
        return "none"
    if row["leader_pid"]:
        return f"{row['leader_host']}/{row['leader_pid']}"
    return f"backend {row['lock_backend_pid']}"


def delivery(row: Row) -> str:
    """`ok`, or `FAILING <age>` while a batch is retried with the offset held."""
    if row["failing_since"] is None:
        return "ok"
    return f"FAILING {age(row['failing_seconds'])}"


# Every column a consumer table may show: its header and its cell from a consumer_status row.
CONSUMER_COLUMNS: dict[str, Callable[[Row], str]] = {
    "CONSUMER": lambda r: str(r["consumer"]),
    "LEADER": _leader,
    "LAST_SEQ": lambda r: str(r["last_seq"]),
    "POSITION": lambda r: f"{r['last_txid']}/{r['last_seq']}",
    "BACKLOG": _backlog,
    "LAG": lambda r: age(r["lag_seconds"]),
    "DELIVERED": lambda r: str(r["delivered_total"]),
    "DLQ_PENDING": lambda r: str(r["dlq_pending"] + r["dlq_retrying"]),
    "DLQ_DEAD": lambda r: str(r["dlq_dead"]),
    "DELIVERY": delivery,
    "LAST_ERROR": lambda r: one_line(r["last_error"])[:60],
    "UPDATED_AT": lambda r: when(r["updated_at"]),
    "RUNNING": lambda r: "yes" if r["running"] else "no",
}

# What each command shows of it (scripts read these columns: add at the end, never reorder).
STATUS_COLUMNS = (
    "CONSUMER",
    "LEADER",
    "LAST_SEQ",
    "BACKLOG",
    "LAG",
    "DELIVERED",
    "DLQ_PENDING",
    "DLQ_DEAD",
    "DELIVERY",
    "LAST_ERROR",
)
OFFSETS_COLUMNS = ("CONSUMER", "LAST_SEQ", "POSITION", "BACKLOG", "UPDATED_AT", "RUNNING")
CONSUMERS_COLUMNS = ("CONSUMER", "POSITION", "LEADER", "UPDATED_AT", "BACKLOG")


def consumer_table(rows: Sequence[Row], columns: Sequence[str]) -> str:
    """Rows of admin.consumer_status in the named columns; a hint to start one when empty."""
    if not rows:
        return NO_CONSUMERS
    return table(columns, [[CONSUMER_COLUMNS[c](r) for c in columns] for r in rows])


# -- JSON text as it is stored -------------------------------------------------------------------

# A token of JSON text that PostgreSQL has validated: a string (escapes included), a structural
# character, or a literal (a number, true, false, null).
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\],:]|[^\s{}\[\],:"]+')
# Inside a JSON string, DEL and the C1 controls may stand raw; some terminals act on them.
_RAW_CONTROL = re.compile(r"[\x7f-\x9f]")


def indented_json(text: str) -> str:
    """Valid JSON text laid out one member or element per line, indented by two spaces.

    Only whitespace changes (and DEL or C1 control characters in strings become \\u escapes of
    themselves): every number, string and duplicate key stays exactly as written, which decoding
    and encoding again would not keep (orjson refuses integers wider than 64 bits, a double turns
    1.8e308 into infinity)."""
    out: list[str] = []
    depth = 0
    previous = ""
    for piece in _JSON_TOKEN.findall(text):
        if piece in ("}", "]"):
            depth -= 1
            # An empty object or array stays on one line: {} and [].
            if previous not in ("{", "["):
                out.append("\n" + "  " * depth)
            out.append(piece)
        else:
            if previous in ("{", "["):
                out.append("\n" + "  " * depth)
            if piece in ("{", "["):
                depth += 1
                out.append(piece)
            elif piece == ",":
                out.append(",\n" + "  " * depth)
            elif piece == ":":
                out.append(": ")
            elif piece.startswith('"'):
                out.append(_RAW_CONTROL.sub(lambda c: f"\\u{ord(c.group()):04x}", piece))
            else:
                out.append(piece)
        previous = piece
    return "".join(out)


# -- snapshots -----------------------------------------------------------------------------------


def snapshot_progress(part: SnapshotTable) -> str:
    """One table of a snapshot: its rows sent of those it held when the snapshot was asked for."""
    total = max(part.rows_total, part.rows_sent)
    percent = f" ({100 * part.rows_sent // total}%)" if total else ""
    state = ", done" if part.done else ""
    return (
        f"{one_line(part.relation)} ({one_line(part.entity_type)}): {part.rows_sent} of {total} "
        f"rows{percent}{state}"
    )


def snapshot_lines(shots: Sequence[SnapshotState]) -> list[str]:
    """Each snapshot's describe() line, then, indented, the progress of the table it is at."""
    lines = []
    for shot in shots:
        lines.append(one_line(shot.describe()))
        current = shot.current
        if shot.state == "running" and current is not None:
            lines.append(f"  {snapshot_progress(current)}")
    return lines


def snapshot_to_dict(shot: SnapshotState) -> dict[str, Any]:
    """The JSON shape of a snapshot (`status --json`)."""
    current = shot.current
    return {
        "id": shot.id,
        "consumer": shot.consumer,
        "requested_by": shot.requested_by,
        "delete_missing": shot.delete_missing,
        "state": shot.state,
        "begin_seq": shot.begin_seq,
        "created_at": shot.created_at,
        "updated_at": shot.updated_at,
        "finished_at": shot.finished_at,
        "rows_total": shot.rows_total,
        "rows_sent": shot.rows_sent,
        "current_table": current.relation if current is not None else None,
        "tables": [
            {
                "relation": t.relation,
                "entity_type": t.entity_type,
                "key_column": t.key_column,
                "both_ways": t.both_ways,
                "rows_total": t.rows_total,
                "rows_sent": t.rows_sent,
                "done": t.done,
            }
            for t in shot.tables
        ],
        "describe": shot.describe(),
    }
