"""The naive relay: the design a user writes first, as the reference serversync's latency is
judged against.

On the backend database, `naive_call_logs` (the shape of call_logs) has a plain row trigger that
inserts each new row into `naive_outbox` (a bigserial seq) and sends pg_notify('naive_outbox')
in the same transaction. A separate process (`python -m bench.naive`) LISTENs; on every
notification, and on a poll timer, it reads `seq > last ORDER BY seq LIMIT 1000`, POSTs those
rows at once to the receiver (the same URL, the same signed wire entries as frontend-sync), then
stores last = the batch's largest seq.

That is deliberately the naive "seq > last" design: a transaction that took its seq before
another one but commits after it, once the reader has moved past it, is never read again. The
bench counts those events as lost.

The entries are encoded by serversync's own encoder (consumer/wire/entries.py) and signed by its
own signing: both designs put the same bytes on the wire, so the comparison is of the designs,
not of their JSON code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
from psycopg import sql

from bench.harness import BENCH_SECRET, ROOT, Service, execute
from consumer.wire.contract import IDEMPOTENCY_KEY_HEADER, SYNC_PATH
from consumer.wire.entries import encode_entries
from consumer.wire.signing import sign

ENTITY_TYPE = "naive_call_log"
CHANNEL = "naive_outbox"
BATCH_SIZE = 1000
log = logging.getLogger("bench.naive")

# The tables and trigger of the naive design, (re)created on the bench's backend database.
# naive_offset holds the reader's position (one row), as a naive relay keeps it across restarts;
# the bench also reads it to know when the reader has caught up.
SETUP = [
    "DROP TABLE IF EXISTS naive_call_logs, naive_outbox, naive_offset",
    "CREATE TABLE naive_call_logs (LIKE call_logs INCLUDING DEFAULTS INCLUDING CONSTRAINTS"
    " INCLUDING INDEXES)",
    """CREATE TABLE naive_outbox (
        seq         bigserial   PRIMARY KEY,
        entity_type text        NOT NULL,
        entity_id   text        NOT NULL,
        payload     json        NOT NULL,
        created_at  timestamptz NOT NULL DEFAULT now()
    )""",
    "CREATE TABLE naive_offset (last_seq bigint NOT NULL)",
    # A NOTIFY per row, as the naive design sends it (ENTITY_TYPE and CHANNEL, written out).
    """CREATE OR REPLACE FUNCTION naive_outbox_relay() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        INSERT INTO naive_outbox (entity_type, entity_id, payload)
        VALUES ('naive_call_log', NEW.id::text, row_to_json(NEW));
        PERFORM pg_notify('naive_outbox', '');
        RETURN NULL;
    END;
    $$""",
    "CREATE TRIGGER naive_outbox_relay AFTER INSERT ON naive_call_logs"
    " FOR EACH ROW EXECUTE FUNCTION naive_outbox_relay()",
]

READ = (
    "SELECT seq, 'upsert', entity_type, entity_id, payload::text, created_at, NULL, NULL"
    " FROM naive_outbox WHERE seq > %s ORDER BY seq LIMIT %s"
)


async def prepare(backend: str) -> None:
    """Create the naive design's tables and trigger on `backend` (dropping earlier ones)."""
    for statement in SETUP:
        await execute(backend, statement)


async def listening(backend: str) -> bool:
    """Whether the naive reader has started: it LISTENs before it stores its first position."""
    rows = await execute(backend, "SELECT EXISTS (SELECT 1 FROM naive_offset)")
    return bool(rows[0][0])


async def caught_up(backend: str) -> bool:
    """Whether the naive reader's stored position has reached the outbox's last seq: every
    event it will ever deliver has been delivered."""
    rows = await execute(
        backend,
        "SELECT o.last_seq >= coalesce((SELECT max(seq) FROM naive_outbox), 0) FROM naive_offset o",
    )
    return bool(rows and rows[0][0])


def start_naive(backend: str, url: str, poll_interval: float, log_path: Path) -> Service:
    """`python -m bench.naive` delivering from `backend` to the receiver at `url`, signing with
    the bench's secret, its output in `log_path`."""
    with log_path.open("wb") as handle:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.naive",
                *("--dsn", backend, "--url", url, "--poll-interval", str(poll_interval)),
            ],
            cwd=ROOT,
            env={**os.environ, "SYNC_SHARED_SECRET": BENCH_SECRET},
            stdout=handle,
            stderr=handle,
        )
    return Service(process, log_path)


async def relay(dsn: str, url: str, *, poll_interval: float, secret: str | None) -> None:
    """LISTEN, then on every notification or poll timeout read `seq > last` and POST it."""
    # Named after this process, as serversync's connections are: the bench finds them by it.
    name = f"bench-naive:{os.getpid()}"
    listener = await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=name)
    reader = await psycopg.AsyncConnection.connect(dsn, autocommit=True, application_name=name)
    wake = asyncio.Event()
    async with listener, reader, aiohttp.ClientSession() as http:
        await listener.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
        rows = await (await reader.execute("SELECT last_seq FROM naive_offset")).fetchall()
        if rows:
            last = int(rows[0][0])
        else:
            # First start: from the end of the outbox. The row also tells the bench that the
            # reader is listening.
            cur = await reader.execute(
                "INSERT INTO naive_offset SELECT coalesce(max(seq), 0) FROM naive_outbox"
                " RETURNING last_seq"
            )
            last = int((await cur.fetchall())[0][0])

        async def listen() -> None:
            async for _ in listener.notifies():
                wake.set()

        listening = asyncio.create_task(listen())
        target = url.rstrip("/") + SYNC_PATH
        try:
            while True:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), poll_interval)
                wake.clear()
                while True:
                    cur = await reader.execute(READ, (last, BATCH_SIZE))
                    batch: list[tuple[Any, ...]] = await cur.fetchall()
                    if not batch:
                        break
                    await post(http, target, batch, secret)
                    last = int(batch[-1][0])
                    await reader.execute("UPDATE naive_offset SET last_seq = %s", (last,))
                    if len(batch) < BATCH_SIZE:
                        break
        finally:
            listening.cancel()


async def post(
    http: aiohttp.ClientSession, target: str, batch: list[tuple[Any, ...]], secret: str | None
) -> None:
    """POST `batch` as one signed request, until the receiver takes it."""
    body = b'{"entries":' + encode_entries(batch) + b"}"
    while True:
        headers = {
            "Content-Type": "application/json",
            IDEMPOTENCY_KEY_HEADER: f"naive:{batch[0][0]}:{batch[-1][0]}:{len(batch)}",
            **sign(secret, body),
        }
        try:
            async with http.post(target, data=body, headers=headers) as response:
                if response.status < 300 or response.status == 409:
                    return
                log.warning("POST %s: %s %s", target, response.status, await response.text())
        except aiohttp.ClientError as exc:
            log.warning("POST %s failed: %s", target, exc)
        await asyncio.sleep(0.5)


def main() -> int:
    """Entry point: `python -m bench.naive --dsn DSN --url URL [--poll-interval S]`."""
    parser = argparse.ArgumentParser(prog="python -m bench.naive", description=__doc__)
    parser.add_argument("--dsn", required=True, help="the backend database")
    parser.add_argument("--url", required=True, help="the receiver's base URL")
    parser.add_argument("--poll-interval", type=float, default=1.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(
        relay(
            args.dsn,
            args.url,
            poll_interval=args.poll_interval,
            secret=os.environ.get("SYNC_SHARED_SECRET"),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
