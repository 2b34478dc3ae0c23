"""Snapshots leave a receiver exactly as the database is, whatever producers do meanwhile and
wherever the process writing the snapshot is killed.

Everything is real: PostgreSQL, the consumer (`serversync run`) and `serversync snapshot` as
processes, the reference receiver over HTTP on loopback with its generic store. Producers insert,
update, delete and re-key random rows of two tracked tables (a bigint key, a text key) in short
transactions while snapshots of random scope and chunk size run; each snapshot's process is
SIGKILLed at a random number of rows sent and run again, which resumes it. Once producers stop
and the consumer passed the end of the outbox, the receiver's live entities must be the tables'
rows: none missing, none that was deleted or moved to another key, none with an older payload
(docs/design.md, Snapshots: a chunk reads its rows FOR SHARE, so its outbox rows are ordered
against every change of them).

The inputs are random; SERVERSYNC_TEST_RANDOM=N replays a failed run's choices (the failure
message names N). The producers' interleaving with the snapshot is the machine's own.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from pydantic import ValidationError

from consumer.receiver.models import INGEST_REQUEST
from tests.conftest import (
    Databases,
    cli_env,
    fetch_all,
    fetch_value,
    serve_receiver,
    wait_until,
)
from tests.support.backend import CONSUMER
from tests.support.cli import assert_ok, run_cli
from tests.support.processes import Processes
from tests.support.snapshots_random import (
    ITEM,
    ITEMS,
    TAG,
    TAGS,
    Keys,
    ProducerCounts,
    SnapshotPlan,
    create_tables,
    database_rows,
    dead_letters,
    differences,
    producing,
    random_plan,
    receiver_rows,
    run_plan,
)
from tests.support.waiting import wait_drained

pytestmark = pytest.mark.slow

RANDOM_VARIABLE = "SERVERSYNC_TEST_RANDOM"
# Snapshots in the first test, each with producers writing throughout.
SNAPSHOTS = 6
# The retention of the cleanup that leaves the outbox without the early history.
RETENTION_SECONDS = 1
# Every tracked table, named or not (a sweep then covers both entity types).
EVERY_TABLE = ((), (ITEMS, TAGS))


def random_start() -> int:
    """The number every random choice of a test follows: SERVERSYNC_TEST_RANDOM, or a new one."""
    value = int(os.environ.get(RANDOM_VARIABLE) or random.randrange(2**32))
    print(f"{RANDOM_VARIABLE}={value}")
    return value


def receiver_takes_sweeps() -> bool:
    """Whether the reference receiver takes a sweep entry (docs/wire-contract.md, Snapshots)."""
    sweep = {
        "op": "sweep",
        "entityType": ITEM,
        "entityId": "1",
        "seq": 2,
        "snapshot": 1,
        "payload": {"snapshot": 1, "keepFromSeq": 1},
    }
    try:
        INGEST_REQUEST.validate_python({"entries": [sweep]})
    except ValidationError:
        return False
    return True


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Processes]:
    """Starts consumer and snapshot processes; kills whatever still runs at the end and prints
    the logs."""
    with Processes(tmp_path) as launched:
        yield launched


async def assert_receiver_exact(
    backend_dsn: str, receiver_dsn: str, context: str, *, timeout: float = 90.0
) -> None:
    """Wait until the consumer passed the end of the outbox, then compare the receiver's live
    entities with the tables, row by row; nothing may have been parked either."""
    await wait_drained((backend_dsn, CONSUMER), timeout=timeout)
    problem = differences(await database_rows(backend_dsn), await receiver_rows(receiver_dsn))
    assert not problem, f"{context}\n{problem}"
    parked = await dead_letters(backend_dsn)
    assert not parked, f"{context}\nparked: {parked}"


async def produced_more(counts: ProducerCounts, transactions: int) -> None:
    """Wait until producers committed `transactions` more transactions."""
    target = counts.transactions + transactions
    await wait_until(
        lambda: counts.transactions >= target, timeout=30, what=f"{transactions} more changes"
    )


def describe(value: int, index: int, plan: SnapshotPlan, counts: ProducerCounts) -> str:
    """Where a failure happened, and how to replay it."""
    return f"{RANDOM_VARIABLE}={value}, snapshot #{index}: {plan}; producers: {counts}"


# -- never older than the database ---------------------------------------------------------------


async def test_snapshots_with_kills_never_leave_the_receiver_older_than_the_database(
    backend_dsn: str, receiver_dsn: str, procs: Processes
) -> None:
    """Several snapshots of random scope and chunk size, each SIGKILLed and resumed at random
    while producers write: after each, the receiver holds exactly the tables' rows."""
    value = random_start()
    rng = random.Random(value)
    keys = Keys(random.Random(rng.random()))
    await create_tables(backend_dsn, keys, items=2000, tags=600)
    async with serve_receiver(receiver_dsn) as url:
        procs.consumer(backend_dsn, url, SYNC_BATCH_SIZE="500")
        await assert_receiver_exact(backend_dsn, receiver_dsn, f"{RANDOM_VARIABLE}={value}")
        kills = 0
        for index in range(SNAPSHOTS):
            # The first is killed twice, its chunks small enough that both kills fall before
            # its end; the others draw from 0 to 3 kills.
            plan = (
                random_plan(rng, CONSUMER, chunk_sizes=(7, 50), kills=(2,))
                if index == 0
                else random_plan(rng, CONSUMER)
            )
            started = time.monotonic()
            async with producing(backend_dsn, keys, rng) as counts:
                # Producers are under way before the snapshot begins, and go on after it ends.
                await produced_more(counts, rng.randint(1, 20))
                run = await run_plan(procs, backend_dsn, plan, rng, name=f"snapshot-{index}")
                await produced_more(counts, rng.randint(1, 20))
            written = time.monotonic()
            kills += run.kills
            context = describe(value, index, plan, counts)
            assert run.rows_sent > 0, context
            await assert_receiver_exact(backend_dsn, receiver_dsn, context)
            print(
                f"{context}; snapshot {run.snapshot_id}: {run.rows_sent} rows, {run.kills} "
                f"kills, {written - started:.1f} s, drained and compared in "
                f"{time.monotonic() - written:.1f} s"
            )
        # A kill is left out only when the process ended before the point drawn for it.
        assert kills > 0, f"{RANDOM_VARIABLE}={value}: no snapshot was killed"


# -- a receiver rebuilt ------------------------------------------------------------------------


async def recreate_receiver_database(databases: Databases, receiver_dsn: str) -> None:
    """Drop the receiver's database and create it again, migrated and empty."""
    name = str(conninfo_to_dict(receiver_dsn)["dbname"])
    template = databases.template("receiver")
    conn = await psycopg.AsyncConnection.connect(databases.server_dsn, autocommit=True)
    async with conn:
        await conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
        await conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )


async def entities_copy(receiver_dsn: str) -> bytes:
    """The receiver's ingest.entities as COPY data: a backup of it."""
    conn = await psycopg.AsyncConnection.connect(receiver_dsn, autocommit=True)
    async with conn, conn.cursor() as cur, cur.copy("COPY ingest.entities TO STDOUT") as copy:
        return b"".join([bytes(block) async for block in copy])


async def restore_entities(receiver_dsn: str, data: bytes) -> None:
    """Put a backup of ingest.entities back in place of what it holds, in one transaction."""
    conn = await psycopg.AsyncConnection.connect(receiver_dsn, autocommit=True)
    async with conn, conn.transaction(), conn.cursor() as cur:
        await cur.execute("DELETE FROM ingest.entities")
        async with cur.copy("COPY ingest.entities FROM STDIN") as copy:
            await copy.write(data)


async def rows_without_event(dsn: str) -> int:
    """Rows of the tables of which the outbox holds no event any more."""
    return int(
        await fetch_value(
            dsn,
            sql.SQL(
                "SELECT (SELECT count(*) FROM {items} t WHERE NOT EXISTS ("
                "  SELECT FROM sync.events_outbox o"
                "   WHERE o.entity_type = {item} AND o.entity_id = t.id::text))"
                " + (SELECT count(*) FROM {tags} t WHERE NOT EXISTS ("
                "  SELECT FROM sync.events_outbox o"
                "   WHERE o.entity_type = {tag} AND o.entity_id = t.code))"
            ).format(
                items=sql.Identifier(ITEMS),
                item=sql.Literal(ITEM),
                tags=sql.Identifier(TAGS),
                tag=sql.Literal(TAG),
            ),
        )
    )


async def outbox_older_than_retention(dsn: str) -> bool:
    """Every outbox row is older than the retention (by the database's clock)."""
    return bool(
        await fetch_value(
            dsn,
            "SELECT coalesce(max(created_at) < now() - make_interval(secs => %s), true) "
            "FROM sync.events_outbox",
            (RETENTION_SECONDS,),
        )
    )


async def rebuild_with_snapshot(
    procs: Processes,
    backend_dsn: str,
    receiver_dsn: str,
    *,
    keys: Keys,
    rng: random.Random,
    value: int,
    delete_missing: bool,
) -> None:
    """With the consumer running to the receiver at `receiver_dsn`: a snapshot of every table
    (for the consumer or for every one, killed and resumed at random) while producers write,
    then the receiver must hold exactly the tables' rows."""
    async with serve_receiver(receiver_dsn) as url:
        procs.consumer(backend_dsn, url, SYNC_BATCH_SIZE="500")
        plan = random_plan(rng, CONSUMER, tables=EVERY_TABLE, delete_missing=delete_missing)
        async with producing(backend_dsn, keys, rng) as counts:
            await produced_more(counts, rng.randint(1, 20))
            run = await run_plan(procs, backend_dsn, plan, rng, name="rebuild")
            await produced_more(counts, rng.randint(1, 20))
        context = describe(value, 0, plan, counts)
        print(f"{context}; snapshot {run.snapshot_id}: {run.rows_sent} rows, {run.kills} kills")
        await assert_receiver_exact(backend_dsn, receiver_dsn, context)


async def test_a_receiver_rebuilt_from_scratch_after_a_cleanup_gets_every_row_back(
    backend_dsn: str, receiver_dsn: str, databases: Databases, procs: Processes
) -> None:
    """A cleanup left the outbox without the early history; the receiver's database is lost and
    made again empty. A snapshot, with producers writing meanwhile, brings back every row, those
    untouched for longer than the retention too."""
    value = random_start()
    rng = random.Random(value)
    keys = Keys(random.Random(rng.random()))
    await create_tables(backend_dsn, keys, items=1500, tags=500)
    async with serve_receiver(receiver_dsn) as url:
        consumer = procs.consumer(backend_dsn, url, SYNC_BATCH_SIZE="500")
        async with producing(backend_dsn, keys, rng) as counts:
            await produced_more(counts, 100)
        await assert_receiver_exact(backend_dsn, receiver_dsn, f"{RANDOM_VARIABLE}={value}")
        assert await consumer.stop() == 0, consumer.log()

    # The retention passes, and a cleanup deletes the early history: the outbox no longer holds
    # any event of the rows untouched since.
    await wait_until(
        lambda: outbox_older_than_retention(backend_dsn),
        timeout=10,
        what=f"every outbox row to be older than {RETENTION_SECONDS}s",
    )
    cleaned = await run_cli(
        "cleanup", "--older-than", f"{RETENTION_SECONDS}s", env=cli_env(DATABASE_URL=backend_dsn)
    )
    assert_ok(cleaned)
    untouched = await rows_without_event(backend_dsn)
    assert untouched > 0, cleaned.stdout
    print(f"{cleaned.stdout.strip()}; {untouched} rows have no event in the outbox any more")

    # The receiver's database is lost, and made again empty.
    await recreate_receiver_database(databases, receiver_dsn)
    assert await receiver_rows(receiver_dsn) == {}
    await rebuild_with_snapshot(
        procs, backend_dsn, receiver_dsn, keys=keys, rng=rng, value=value, delete_missing=False
    )


@pytest.mark.skipif(
    not receiver_takes_sweeps(),
    reason="the reference receiver does not take sweep entries (consumer/receiver/models.py, "
    "op 'sweep') yet",
)
async def test_a_receiver_restored_from_an_old_copy_is_made_exact_by_a_snapshot_and_sweep(
    backend_dsn: str, receiver_dsn: str, procs: Processes
) -> None:
    """The receiver is restored from a copy older than rows deleted, added and changed since. A
    snapshot with --delete-missing, with producers writing meanwhile, makes it exact: what it
    sends replaces what is older, and its sweep tombstones what was deleted."""
    value = random_start()
    rng = random.Random(value)
    keys = Keys(random.Random(rng.random()))
    await create_tables(backend_dsn, keys, items=1500, tags=500)
    async with serve_receiver(receiver_dsn) as url:
        consumer = procs.consumer(backend_dsn, url, SYNC_BATCH_SIZE="500")
        await assert_receiver_exact(backend_dsn, receiver_dsn, f"{RANDOM_VARIABLE}={value}")
        backup = await entities_copy(receiver_dsn)
        then = await database_rows(backend_dsn)
        # Life goes on after the backup: rows inserted, changed, deleted, moved to other keys.
        async with producing(backend_dsn, keys, rng) as counts:
            await produced_more(counts, 300)
        await assert_receiver_exact(backend_dsn, receiver_dsn, f"{RANDOM_VARIABLE}={value}")
        assert await consumer.stop() == 0, consumer.log()

    now = await database_rows(backend_dsn)
    gone = then.keys() - now.keys()
    assert gone, "no row was deleted since the backup"
    assert now.keys() - then.keys(), "no row was added since the backup"
    assert any(then[k] != now[k] for k in then.keys() & now.keys()), "no row changed since"
    # The receiver is restored from the backup: it holds rows deleted since, and misses others.
    await restore_entities(receiver_dsn, backup)
    assert await receiver_rows(receiver_dsn) == then

    await rebuild_with_snapshot(
        procs, backend_dsn, receiver_dsn, keys=keys, rng=rng, value=value, delete_missing=True
    )
    # What was deleted since the backup is a tombstone again: the sweep's, as no change of those
    # keys comes any more (a deleted key is never used again).
    tombstones = await fetch_all(
        receiver_dsn,
        "SELECT entity_type, entity_id FROM ingest.entities WHERE deleted "
        "AND (entity_type, entity_id) IN (SELECT * FROM unnest(%s::text[], %s::text[]))",
        ([t for t, _ in gone], [k for _, k in gone]),
    )
    assert len(tombstones) == len(gone)
