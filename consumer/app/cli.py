"""The `serversync` command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import signal
import sys
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson

from consumer.app.settings import ConfigError, ReceiverSettings, SyncSettings, load
from consumer.app.wiring import (
    CONSUMERS,
    SINKS,
    StartupError,
    connect_or_explain,
    dlq_sinks,
    open_pool,
    run_consumer,
    run_ingest_server,
)
from consumer.observability.redact import printable
from consumer.observability.telemetry import setup_logging, setup_telemetry
from consumer.ops.deadletters import DeadLetters
from consumer.store import admin, migrations, retention
from consumer.store.dlq import DEFAULT_PAGE_SIZE, DlqError, DlqMessage, DlqStore

EXIT_ERROR = 1
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
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

    p = sub.add_parser("run", help="run a consumer until SIGTERM/SIGINT")
    p.add_argument("consumer", choices=CONSUMERS)
    p.add_argument(
        "--sink",
        choices=SINKS,
        default="default",
        help="'null' accepts every batch without sending it (benchmarks)",
    )

    p = sub.add_parser("ingest-server", help="run the reference receiver (FRONTEND_DATABASE_URL)")
    p.add_argument("--host", help="address to bind (INGEST_HOST, default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to bind (INGEST_PORT, default 8080)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="accept unsigned requests when SYNC_SHARED_SECRET is not set (demos only)",
    )

    p = sub.add_parser("demo", help="end-to-end demo on a local or private PostgreSQL")
    p.add_argument("--calls", type=int, default=5, help="call logs to create (default 5)")

    p = sub.add_parser("status", help="per consumer: position, backlog, lag, leader, DLQ")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--consumer", help="only this consumer")
    p.add_argument(
        "--watch", action="store_true", help="refresh until interrupted (Ctrl-C or SIGTERM)"
    )
    p.add_argument(
        "--interval",
        type=_interval,
        default=2.0,
        metavar="SEC",
        help="seconds between refreshes with --watch (default 2)",
    )

    offsets = sub.add_parser("offsets", help="inspect and move consumer offsets")
    osub = offsets.add_subparsers(dest="offsets_command", required=True, metavar="ACTION")
    p = osub.add_parser("list", help="every consumer's position")
    p.add_argument("--json", action="store_true")
    p = osub.add_parser("reset", help="move a stopped consumer's offset (replay or skip)")
    p.add_argument("consumer")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--to-earliest", action="store_true", help="replay the whole outbox")
    target.add_argument("--to-latest", action="store_true", help="skip everything delivered so far")
    target.add_argument("--to-seq", type=int, metavar="N", help="replay every event with seq > N")
    target.add_argument(
        "--to-datetime",
        type=_iso_datetime,
        metavar="ISO",
        help="replay every event created at or after this time",
    )
    target.add_argument(
        "--shift-by", type=int, metavar="N", help="move by N events (negative: replay N events)"
    )
    p.add_argument("--dry-run", action="store_true", help="show what would change, change nothing")

    dlq = sub.add_parser("dlq", help="inspect, retry and delete parked events (dead letters)")
    dsub = dlq.add_subparsers(dest="dlq_command", required=True, metavar="ACTION")
    p = dsub.add_parser("list", help="a consumer's dead letters, newest first")
    p.add_argument("consumer")
    p.add_argument("--status", help="only PENDING, RETRYING, RESOLVED or DEAD")
    p.add_argument("--page", type=int, default=1, help="page number, from 1 (default 1)")
    p.add_argument(
        "--page-size",
        type=int,
        default=DEFAULT_PAGE_SIZE,
        help=f"messages per page, 1..100 (default {DEFAULT_PAGE_SIZE})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = dsub.add_parser("show", help="one dead letter, with its event and last error")
    p.add_argument("id")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = dsub.add_parser("retry", help="deliver one dead letter again through its consumer's sink")
    p.add_argument("id")
    p = dsub.add_parser("retry-all", help="retry every retryable dead letter of a consumer")
    p.add_argument("consumer")
    p = dsub.add_parser("delete", help="remove one dead letter for good")
    p.add_argument("id")

    p = sub.add_parser(
        "cleanup",
        help="delete old outbox rows every consumer has passed, and old resolved dead letters",
    )
    p.add_argument(
        "--older-than",
        type=_duration,
        default=retention.DEFAULT_RETENTION,
        metavar="AGE",
        help=f"retention: 30d, 12h, 90m, 45s or seconds (default {retention.DEFAULT_RETENTION})",
    )
    p.add_argument("--dry-run", action="store_true", help="count what would go, delete nothing")
    p.add_argument(
        "--batch-size",
        type=_batch_size,
        default=retention.DEFAULT_BATCH_SIZE,
        metavar="N",
        help=f"rows per delete transaction (default {retention.DEFAULT_BATCH_SIZE})",
    )
    p.add_argument("--json", action="store_true", help="machine-readable summary")

    consumers = sub.add_parser("consumers", help="list and deregister consumers")
    csub = consumers.add_subparsers(dest="consumers_command", required=True, metavar="ACTION")
    p = csub.add_parser("list", help="every registered consumer: position, leader, last update")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = csub.add_parser("remove", help="deregister a consumer that is no longer run")
    p.add_argument("consumer")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument(
        "--purge-dlq", action="store_true", help="delete its dead letters too (kept by default)"
    )
    return parser


def _interval(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0.1 <= seconds <= 3600:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds from 0.1 to 3600")
    return seconds


def _duration(value: str) -> timedelta:
    try:
        return retention.parse_duration(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _batch_size(value: str) -> int:
    try:
        size = int(value)
    except ValueError:
        size = 0
    if not 1 <= size <= retention.MAX_BATCH_SIZE:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a number of rows between 1 and {retention.MAX_BATCH_SIZE}"
        )
    return size


def _iso_datetime(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 date-time: {value!r}") from None
    if parsed.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{value!r} needs a UTC offset, e.g. {value}+00:00")
    return parsed


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `serversync` command."""
    args = _parser().parse_args(argv)
    try:
        return asyncio.run(_dispatch(args))
    except ConfigError as exc:
        print(f"serversync: configuration error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except (StartupError, admin.AdminError, migrations.MigrationError, DlqError) as exc:
        print(f"serversync: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


async def _dispatch(args: argparse.Namespace) -> int:
    command: str = args.command
    if command == "ingest-server":
        overrides: dict[str, Any] = {}
        if args.host:
            overrides["INGEST_HOST"] = args.host
        if args.port is not None:
            overrides["INGEST_PORT"] = args.port
        receiver = load(ReceiverSettings, **overrides)
        setup_logging(receiver.log_level, args.log_format)
        telemetry = setup_telemetry("serversync-ingest")
        try:
            await run_ingest_server(receiver, insecure=args.insecure)
        finally:
            telemetry.shutdown()
        return 0
    if command == "demo":
        from consumer.devtools.demo import run_demo  # noqa: PLC0415 - only the demo needs it

        setup_logging("WARNING", "text")
        return await run_demo(calls=args.calls)
    if command == "migrate" and args.receiver:
        if args.with_examples:
            raise ConfigError("--with-examples is for the backend database, not with --receiver")
        receiver = load(ReceiverSettings)
        setup_logging(receiver.log_level, args.log_format)
        return await _migrate(receiver.frontend_database_url, ["receiver"], "FRONTEND_DATABASE_URL")

    settings = load(SyncSettings)
    setup_logging(settings.log_level, args.log_format)
    if command == "migrate":
        return await _migrate(
            settings.database_url, ["backend"], "DATABASE_URL", examples=args.with_examples
        )
    if command == "run":
        telemetry = setup_telemetry(f"serversync-{args.consumer}")
        try:
            await run_consumer(settings, args.consumer, args.sink, telemetry=telemetry)
        finally:
            telemetry.shutdown()
        return 0
    if command == "status":
        return await _status(settings, args)
    if command == "offsets":
        return await _offsets(settings, args)
    if command == "dlq":
        return await _dlq(settings, args)
    if command == "cleanup":
        return await _cleanup(settings, args)
    if command == "consumers":
        return await _consumers(settings, args)
    raise AssertionError(command)


async def _migrate(dsn: str, components: list[str], what: str, *, examples: bool = False) -> int:
    async with await connect_or_explain(dsn, "migrate", what) as conn:
        done = await migrations.migrate(conn, components)
        for migration in done:
            print(f"applied {migration.component}/{migration.version}_{migration.name}")
        if not done:
            print(f"{what}: up to date ({', '.join(components)})")
        if examples:
            for example in await migrations.apply_examples(conn):
                print(
                    f"{migrations.EXAMPLES}/{example.name}: in place (created what was missing, "
                    "left what existed as it was)"
                )
    return 0


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.1f}m"
    return f"{seconds / 3600:.1f}h"


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def _backlog(row: dict[str, Any]) -> str:
    # "~" marks a backlog too large to count on every look (admin.EXACT_BACKLOG_UP_TO).
    return f"~{row['backlog']}" if row["backlog_estimated"] else str(row["backlog"])


def _leader(row: dict[str, Any]) -> str:
    if not row["running"]:
        return "none"
    if row["leader_pid"]:
        return f"{row['leader_host']}/{row['leader_pid']}"
    return f"backend {row['lock_backend_pid']}"


async def _status(settings: SyncSettings, args: argparse.Namespace) -> int:
    async with await connect_or_explain(settings.database_url, "status", "DATABASE_URL") as conn:
        await _require_schema(conn)
        if not args.watch:
            print(await _status_report(conn, args))
            return 0
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else ""
        while not stop.is_set():
            report = await _status_report(conn, args)
            stamp = datetime.now(UTC).isoformat(timespec="seconds")
            print(f"{clear}serversync status at {stamp} (every {args.interval:g}s; Ctrl-C stops)")
            print(report, flush=True)
            if not clear:
                print(flush=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=args.interval)
        return 0


async def _status_report(conn: Any, args: argparse.Namespace) -> str:
    rows = await admin.consumer_status(conn, args.consumer)
    held = await admin.horizon(conn)
    if args.consumer and not rows:
        raise admin.AdminError(f"no consumer named {args.consumer!r}")
    if args.json:
        return orjson.dumps(
            {"consumers": rows, "horizon": held}, default=str, option=orjson.OPT_INDENT_2
        ).decode()
    lines = [
        _table(
            [
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
            ],
            [
                [
                    r["consumer"],
                    _leader(r),
                    str(r["last_seq"]),
                    _backlog(r),
                    _age(r["lag_seconds"]),
                    str(r["delivered_total"]),
                    str(r["dlq_pending"] + r["dlq_retrying"]),
                    str(r["dlq_dead"]),
                    _delivery(r),
                    " ".join((r["last_error"] or "-").split())[:60],
                ]
                for r in rows
            ],
        )
        if rows
        else "no consumers registered yet (start one with `serversync run NAME`)"
    ]
    for r in rows:
        if r["failing_since"] is not None:
            lines.append(
                f"\n{r['consumer']}: delivery failing for {_age(r['failing_seconds'])} "
                f"({r['failing_reason']}); the offset is held and the batch is retried.\n"
                f"  last error: {printable(r['last_error'] or '-')[:300]}\n"
                f"  {FAILING_HINTS.get(r['failing_reason'], '')}"
            )
    if held.get("held_back_events"):
        lines.append(
            f"\n{held['held_back_events']} committed event(s) are held back "
            f"(oldest {_age(held['oldest_held_back_seconds'])}) by older open transactions:"
        )
        lines.append(
            _table(
                ["PID", "DATABASE", "USER", "APPLICATION", "STATE", "XACT_AGE", "QUERY"],
                [
                    [
                        str(b["pid"] or "-"),
                        str(b["datname"]),
                        str(b["usename"]),
                        str(b["application_name"] or "-"),
                        str(b["state"]),
                        _age(b["xact_age_seconds"]),
                        (b["query"] or "-").replace("\n", " ")[:60],
                    ]
                    for b in held["blockers"]
                ],
            )
        )
    return "\n".join(lines)


# What an operator does about each kind of failing streak (`serversync status`).
FAILING_HINTS = {
    "receiver_unavailable": "The receiver is down, busy or unreachable: check it and the network "
    "to FRONTEND_BASE_URL; delivery resumes by itself.",
    "wrong_destination": "The receiver refuses who we are or where we send (401/403: "
    "SYNC_SHARED_SECRET differs or the clocks are over 5 minutes apart; 404/405/3xx: "
    "FRONTEND_BASE_URL points at the wrong place). Fix the setting; delivery resumes by itself.",
    "internal_error": "The consumer failed on this batch: see its log (journalctl -u "
    "serversync@CONSUMER) for the traceback.",
}


def _delivery(row: dict[str, Any]) -> str:
    if row["failing_since"] is None:
        return "ok"
    return f"FAILING {_age(row['failing_seconds'])}"


async def _require_schema(conn: Any) -> None:
    pending = await migrations.pending(conn, "backend")
    if pending:
        raise StartupError("DATABASE_URL lacks serversync's schema; run `serversync migrate`")


async def _offsets(settings: SyncSettings, args: argparse.Namespace) -> int:
    async with await connect_or_explain(settings.database_url, "offsets", "DATABASE_URL") as conn:
        await _require_schema(conn)
        if args.offsets_command == "list":
            rows = await admin.consumer_status(conn)
            if args.json:
                print(orjson.dumps(rows, default=str, option=orjson.OPT_INDENT_2).decode())
                return 0
            print(
                _table(
                    ["CONSUMER", "LAST_SEQ", "POSITION", "BACKLOG", "UPDATED_AT", "RUNNING"],
                    [
                        [
                            r["consumer"],
                            str(r["last_seq"]),
                            f"{r['last_txid']}/{r['last_seq']}",
                            _backlog(r),
                            r["updated_at"].isoformat(timespec="seconds"),
                            "yes" if r["running"] else "no",
                        ]
                        for r in rows
                    ],
                )
            )
            return 0
        options = {
            "to_earliest": args.to_earliest,
            "to_latest": args.to_latest,
            "to_seq": args.to_seq,
            "to_datetime": args.to_datetime,
            "shift_by": args.shift_by,
        }
        if args.dry_run:
            plan = await admin.plan_reset(conn, args.consumer, **options)
        else:
            async with admin.holding_consumer_lock(conn, args.consumer):
                plan = await admin.plan_reset(conn, args.consumer, **options)
                await admin.apply_reset(conn, plan)
    effect = (
        f"{plan.replayed} event(s) will be replayed"
        if plan.replayed
        else f"{plan.skipped} event(s) will be skipped"
        if plan.skipped
        else "no events change hands"
    )
    verb = "would move" if args.dry_run else "moved"
    print(
        f"{plan.consumer}: {verb} from {plan.current} to {plan.target}; {effect}"
        f"{' (dry run, nothing changed)' if args.dry_run else ''}"
    )
    return 0


# -- dlq -----------------------------------------------------------------------------------------


async def _dlq(settings: SyncSettings, args: argparse.Namespace) -> int:
    async with (
        await connect_or_explain(settings.database_url, "dlq", "DATABASE_URL") as conn,
        # recording-upload's sink reads and marks recordings rows while a message is retried.
        open_pool(settings.database_url, "dlq", max_size=2) as pool,
    ):
        await _require_schema(conn)
        service = DeadLetters(DlqStore.over_connection(conn), dlq_sinks(settings, pool=pool))
        try:
            return await _dlq_action(service, args)
        finally:
            await service.close()


def _when(value: Any) -> str:
    return value.isoformat(timespec="seconds") if value is not None else "-"


# "POST <url> answered HTTP 422: " says nothing the code column does not: the table shows what
# the receiver said (`dlq show` has the whole message).
_ANSWERED = re.compile(r"^\S+ \S+ answered HTTP \d+: ")


def _short_error(m: DlqMessage) -> str:
    # printable: messages parked by older versions were only masked, not cleaned.
    return " ".join(printable(f"{m.error_code} {_ANSWERED.sub('', m.error_message)}").split())


def _dlq_rows(messages: list[DlqMessage]) -> str:
    return _table(
        ["ID", "SEQ", "ENTITY", "OP", "STATUS", "RETRIES", "PARKED_AT", "ERROR"],
        [
            [
                str(m.id),
                str(m.seq),
                printable(f"{m.entity_type}/{m.entity_id}"),
                m.op,
                m.status,
                f"{m.retry_count}/{m.max_retries}",
                _when(m.created_at),
                _short_error(m)[:60],
            ]
            for m in messages
        ],
    )


def _dlq_details(m: DlqMessage) -> str:
    fields = [
        ("id", str(m.id)),
        ("consumer", m.consumer),
        ("status", m.status),
        ("retries", f"{m.retry_count} of {m.max_retries}"),
        ("seq", str(m.seq)),
        ("entity", printable(f"{m.entity_type}/{m.entity_id}")),
        ("op", m.op),
        ("event created", _when(m.event_created_at)),
        ("parked at", _when(m.created_at)),
        ("updated at", _when(m.updated_at)),
        ("last retry at", _when(m.last_retry_at)),
        ("error code", printable(m.error_code)),
        ("error", " ".join(printable(m.error_message).split())),
    ]
    width = max(len(name) for name, _ in fields) + 1
    lines = [f"{(name + ':').ljust(width)} {value}" for name, value in fields]
    return "\n".join([*lines, "payload:", indented_json(m.payload)])


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


async def _dlq_action(service: DeadLetters, args: argparse.Namespace) -> int:
    action: str = args.dlq_command
    if action == "list":
        page = await service.list_messages(
            args.consumer, status=args.status, page=args.page, page_size=args.page_size
        )
        if args.json:
            body = page.to_dict()
            print(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode())
            return 0
        which = f" with status {args.status.upper()}" if args.status else ""
        pages = max(1, -(-page.total_count // page.page_size))
        if not page.total_count:
            print(f"no dead letters for {args.consumer}{which}")
        elif not page.messages:
            print(
                f"page {page.page} is past the end: {page.total_count} dead letter(s){which}, "
                f"{pages} page(s) of {page.page_size}"
            )
        else:
            print(_dlq_rows(page.messages))
            print(f"\npage {page.page} of {pages}, {page.total_count} dead letter(s){which}")
        return 0
    if action == "show":
        message = await service.get(args.id)
        if args.json:
            print(orjson.dumps(message.to_dict(), option=orjson.OPT_INDENT_2).decode())
        else:
            print(_dlq_details(message))
        return 0
    if action == "retry":
        result = await service.retry(args.id)
        if not result.delivered:
            print(f"serversync: {result.message.id}: {result.describe()}", file=sys.stderr)
            return EXIT_ERROR
        print(f"{result.message.id}: {result.describe()}")
        return 0
    if action == "retry-all":
        outcome = await service.retry_all(args.consumer)
        print(f"{args.consumer}: {outcome.describe()}")
        return EXIT_ERROR if outcome.failed else 0
    if action == "delete":
        await service.delete(args.id)
        print(f"deleted dead letter {args.id.strip()}")
        return 0
    raise AssertionError(action)


# -- cleanup and consumers -----------------------------------------------------------------------


async def _cleanup(settings: SyncSettings, args: argparse.Namespace) -> int:
    async with await connect_or_explain(settings.database_url, "cleanup", "DATABASE_URL") as conn:
        await _require_schema(conn)
        report = await retention.cleanup(
            conn, older_than=args.older_than, batch_size=args.batch_size, dry_run=args.dry_run
        )
    if args.json:
        print(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        print(report.summary())
    # Lagging consumers were logged as warnings; they are no failure: the run did its part.
    return 0


async def _consumers(settings: SyncSettings, args: argparse.Namespace) -> int:
    async with await connect_or_explain(settings.database_url, "consumers", "DATABASE_URL") as conn:
        await _require_schema(conn)
        if args.consumers_command == "list":
            rows = await admin.consumer_status(conn)
            if args.json:
                print(orjson.dumps(rows, default=str, option=orjson.OPT_INDENT_2).decode())
            elif rows:
                print(
                    _table(
                        ["CONSUMER", "POSITION", "LEADER", "UPDATED_AT", "BACKLOG"],
                        [
                            [
                                r["consumer"],
                                f"{r['last_txid']}/{r['last_seq']}",
                                _leader(r),
                                _when(r["updated_at"]),
                                _backlog(r),
                            ]
                            for r in rows
                        ],
                    )
                )
            else:
                print("no consumers registered yet (start one with `serversync run NAME`)")
            return 0
        try:
            return await _remove_consumer(conn, args)
        except retention.UnknownConsumerError as exc:
            # A name that is not there is bad input, as a bad option is: exit 2.
            print(f"serversync: {exc}", file=sys.stderr)
            return EXIT_CONFIG


async def _remove_consumer(conn: Any, args: argparse.Namespace) -> int:
    found = await retention.find_consumer(conn, args.consumer)
    if not args.yes:
        question = (
            f"remove consumer {found.consumer} (at {found.position}, updated "
            f"{_when(found.updated_at)}, {found.dead_letters} dead letter(s) "
            f"{'deleted' if args.purge_dlq else 'kept'})? [y/N] "
        )
        if not sys.stdin.isatty():
            print(
                f"serversync: removing consumer {found.consumer} forgets its position for good; "
                "confirm with --yes",
                file=sys.stderr,
            )
            return EXIT_CONFIG
        answer = await asyncio.to_thread(input, question)
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing removed")
            return EXIT_ERROR
    removed = await retention.remove_consumer(conn, args.consumer, purge_dlq=args.purge_dlq)
    dead_letters = (
        f"deleted its {removed.dead_letters_deleted} dead letter(s)"
        if args.purge_dlq
        else f"kept its {removed.dead_letters_kept} dead letter(s) (--purge-dlq deletes them)"
    )
    print(f"removed consumer {removed.consumer} (was at {removed.position}); {dead_letters}")
    return 0
