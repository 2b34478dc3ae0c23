"""`serversync dlq list|show|retry|retry-all|delete`: the dead-letter queue for an operator."""

from __future__ import annotations

import argparse
import re
import sys

from consumer.app.cli.common import (
    EXIT_ERROR,
    Subparsers,
    backend_settings,
    operator_connection,
)
from consumer.app.cli.render import indented_json, one_line, table, to_json, when
from consumer.app.startup import open_pool
from consumer.app.wiring import dlq_sinks
from consumer.observability.redact import printable
from consumer.ops.deadletters import DeadLetters
from consumer.store.dlq import DEFAULT_PAGE_SIZE, DlqMessage, DlqStore

# "POST <url> answered HTTP 422: " says nothing the code column does not: the table shows what
# the receiver said (`dlq show` has the whole message).
_ANSWERED = re.compile(r"^\S+ \S+ answered HTTP \d+: ")


def register(sub: Subparsers) -> None:
    """Add the `dlq` actions to the command line."""
    dlq = sub.add_parser("dlq", help="inspect, retry and delete parked events (dead letters)")
    dlq.set_defaults(handler=run)
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


async def run(args: argparse.Namespace) -> int:
    """Carry out one dead-letter action."""
    settings = backend_settings(args)
    async with (
        operator_connection(settings, "dlq") as conn,
        # A sink that updates the backend (recording-upload's) reads and marks rows through it.
        open_pool(settings.database_url, "dlq", max_size=2) as pool,
    ):
        service = DeadLetters(DlqStore.over_connection(conn), dlq_sinks(settings, pool=pool))
        try:
            return await _action(service, args)
        finally:
            await service.close()


async def _action(service: DeadLetters, args: argparse.Namespace) -> int:
    action: str = args.dlq_command
    if action == "list":
        return await _list(service, args)
    if action == "show":
        message = await service.get(args.id)
        print(to_json(message.to_dict()) if args.json else _details(message))
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


async def _list(service: DeadLetters, args: argparse.Namespace) -> int:
    page = await service.list_messages(
        args.consumer, status=args.status, page=args.page, page_size=args.page_size
    )
    if args.json:
        print(to_json(page.to_dict()))
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
        print(_rows(page.messages))
        print(f"\npage {page.page} of {pages}, {page.total_count} dead letter(s){which}")
    return 0


def _short_error(m: DlqMessage) -> str:
    # one_line cleans: messages parked by older versions were only masked.
    return one_line(f"{m.error_code} {_ANSWERED.sub('', m.error_message)}")


def _rows(messages: list[DlqMessage]) -> str:
    return table(
        ["ID", "SEQ", "ENTITY", "OP", "STATUS", "RETRIES", "PARKED_AT", "ERROR"],
        [
            [
                str(m.id),
                str(m.seq),
                printable(f"{m.entity_type}/{m.entity_id}"),
                m.op,
                m.status,
                f"{m.retry_count}/{m.max_retries}",
                when(m.created_at),
                _short_error(m)[:60],
            ]
            for m in messages
        ],
    )


def _details(m: DlqMessage) -> str:
    fields = [
        ("id", str(m.id)),
        ("consumer", m.consumer),
        ("status", m.status),
        ("retries", f"{m.retry_count} of {m.max_retries}"),
        ("seq", str(m.seq)),
        ("entity", printable(f"{m.entity_type}/{m.entity_id}")),
        ("op", m.op),
        ("event created", when(m.event_created_at)),
        ("parked at", when(m.created_at)),
        ("updated at", when(m.updated_at)),
        ("last retry at", when(m.last_retry_at)),
        ("error code", printable(m.error_code)),
        ("error", one_line(m.error_message)),
    ]
    width = max(len(name) for name, _ in fields) + 1
    lines = [f"{(name + ':').ljust(width)} {value}" for name, value in fields]
    return "\n".join([*lines, "payload:", indented_json(m.payload)])
