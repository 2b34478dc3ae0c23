"""What `serversync cleanup` and `serversync status` read does not grow with the outbox: the plan
samples the outbox instead of counting it, a delete batch reads a bounded window, the walk ends
after a run of younger rows, and the held-back count is bounded. Each is shown on a small outbox
with the bounds made small (retention.ReadBounds), as a large outbox would hit the defaults."""

from __future__ import annotations

from typing import Any

import orjson
import psycopg

from consumer.app.cli import status
from consumer.core.events import Position
from consumer.store import retention
from consumer.store.queries import query
from consumer.store.retention import CleanupReport, ReadBounds
from tests.conftest import fetch_all, fetch_value

RETENTION = retention.parse_duration("30d")
OLD = "40 days"
YOUNG = "1 day"
ROWS = "SELECT o.txid::text, o.seq FROM sync.events_outbox o ORDER BY o.txid, o.seq"


async def add_rows(dsn: str, n: int, *, age: str) -> None:
    """`n` outbox rows in one transaction, created `age` ago."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute(
            "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload, created_at) "
            "SELECT 'upsert', 'thing', g::text, '{}', now() - %(age)s::interval "
            "FROM generate_series(1, %(n)s) g",
            {"age": age, "n": n},
        )


async def positions(dsn: str) -> list[Position]:
    """Every outbox row's position, in delivery order."""
    return [Position(int(t), int(s)) for t, s in await fetch_all(dsn, ROWS)]


async def place(dsn: str, consumer: str, at: Position) -> None:
    """Register `consumer` at position `at`."""
    await fetch_all(
        dsn,
        "INSERT INTO sync.consumer_offsets (consumer, last_txid, last_seq) "
        "VALUES (%s, %s::xid8, %s) RETURNING consumer",
        (consumer, str(at.txid), at.seq),
    )


async def run_cleanup(dsn: str, **options: Any) -> CleanupReport:
    """The cleanup in this process, on its own autocommit connection."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        return await retention.cleanup(conn, older_than=RETENTION, **options)


async def explain(
    conn: psycopg.AsyncConnection[Any], statement: str, params: dict[str, Any]
) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, FORMAT JSON) of `statement`: its top plan node."""
    cur = await conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}", params)
    row = await cur.fetchone()
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else orjson.loads(row[0])
    plan: dict[str, Any] = document[0]["Plan"]
    return plan


async def cutoff_of(conn: psycopg.AsyncConnection[Any]) -> Any:
    """The cutoff a 30-day cleanup computes now."""
    row = await (
        await conn.execute(query("retention_cutoff"), {"older_than": RETENTION})
    ).fetchone()
    assert row is not None
    return row[0]


def nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every node of a plan, depth first."""
    found = [plan]
    for child in plan.get("Plans", []):
        found += nodes(child)
    return found


def outbox_reads(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The plan's nodes that read sync.events_outbox."""
    return [n for n in nodes(plan) if n.get("Relation Name") == "events_outbox"]


# -- the plan ------------------------------------------------------------------------------------


async def test_the_plan_reads_a_sample_of_the_outbox_not_all_of_it(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 6000, age=OLD)
    await add_rows(backend_dsn, 4000, age=YOUNG)
    await place(backend_dsn, "audit", (await positions(backend_dsn))[-1])
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        await conn.execute("VACUUM sync.events_outbox")
        blocks = await fetch_value(
            backend_dsn, "SELECT pg_relation_size('sync.events_outbox') / 8192"
        )
        assert blocks > 40
        cutoff = await cutoff_of(conn)
        plan = await explain(
            conn,
            query("retention_outbox_plan"),
            {"cutoff": cutoff, "sample_blocks": 10, "exact_up_to": 100},
        )
    reads = outbox_reads(plan)
    # One read of the outbox, a sample of its blocks: no scan of the whole table.
    assert [n["Node Type"] for n in reads] == ["Sample Scan"], reads
    (sample,) = reads
    assert sample["Actual Rows"] + sample.get("Rows Removed by Filter", 0) < 10_000 / 2


async def test_a_large_outbox_is_estimated_and_the_report_says_so(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 6000, age=OLD)
    await add_rows(backend_dsn, 4000, age=YOUNG)
    rows = await positions(backend_dsn)
    # audit has passed 1,000 of the old rows and needs 5,000; billing has passed everything.
    await place(backend_dsn, "audit", rows[999])
    await place(backend_dsn, "billing", rows[-1])
    blocks = await fetch_value(backend_dsn, "SELECT pg_relation_size('sync.events_outbox') / 8192")
    # About half the blocks are sampled, and audit's walk stops after 100 rows.
    bounds = ReadBounds(exact_up_to=100, sample_blocks=blocks // 2)

    dry = await run_cleanup(backend_dsn, dry_run=True, bounds=bounds)
    assert dry.outbox_old_estimated and dry.outbox_kept_estimated
    assert 0 < dry.outbox_sampled_percent < 100
    # Sampling half the blocks, anything beyond a factor of two is far out of chance.
    assert 3000 < dry.outbox_old < 12_000
    (audit,) = dry.lagging
    assert audit.consumer == "audit" and audit.estimated
    assert 2500 < audit.old_rows_needed < 10_000
    summary = dry.summary()
    assert "would delete about " in summary and "would keep about " in summary
    assert "estimated from" in summary
    shape = dry.to_dict()
    # The outbox figures keep their shape; what is estimated is said beside them.
    assert set(shape["outbox"]) == {"old", "passed", "deleted", "batches", "kept"}
    assert shape["outbox_estimated"]["old"] is True
    assert shape["outbox_estimated"]["kept"] is True
    assert shape["lagging"][0]["old_rows_needed_estimated"] is True

    # What a run deletes is counted, never estimated.
    done = await run_cleanup(backend_dsn, bounds=bounds)
    assert done.outbox_deleted == 1000
    assert await positions(backend_dsn) == rows[1000:]
    assert "deleted 1000 outbox row(s)" in done.summary()


async def test_a_small_outbox_is_counted_exactly(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 300, age=OLD)
    await add_rows(backend_dsn, 200, age=YOUNG)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[99])
    await place(backend_dsn, "billing", rows[-1])

    dry = await run_cleanup(backend_dsn, dry_run=True)
    assert (dry.outbox_old, dry.outbox_passed, dry.outbox_kept) == (300, 100, 200)
    assert not dry.outbox_old_estimated and not dry.outbox_kept_estimated
    assert dry.outbox_sampled_percent == 100
    assert [(c.consumer, c.old_rows_needed, c.estimated) for c in dry.lagging] == [
        ("audit", 200, False)
    ]
    assert "about" not in dry.summary()


# -- the deletes ---------------------------------------------------------------------------------


async def test_a_delete_batch_reads_at_most_its_window(backend_dsn: str) -> None:
    await add_rows(backend_dsn, 200, age=OLD)
    await add_rows(backend_dsn, 20_000, age=YOUNG)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[-1])
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn:
        # Planned with statistics, as autovacuum keeps them on a large outbox.
        await conn.execute("ANALYZE sync.events_outbox")
        cutoff = await cutoff_of(conn)
        # A batch after the last old row: 20,000 younger rows lie between it and the floor.
        params = {
            "cutoff": cutoff,
            "after_txid": str(rows[199].txid),
            "after_seq": rows[199].seq,
            "limit": 100,
            "window": 1000,
        }
        async with conn.transaction(force_rollback=True):
            plan = await explain(conn, query("retention_delete_outbox"), params)
    read = sum(
        n["Actual Rows"] * n.get("Actual Loops", 1) + n.get("Rows Removed by Filter", 0)
        for n in outbox_reads(plan)
        if n["Node Type"] in ("Index Scan", "Index Only Scan", "Bitmap Heap Scan", "Seq Scan")
    )
    # The window's 1,000 rows, not the 20,000 up to the floor in search of old ones.
    assert 0 < read <= 1000


async def test_the_walk_ends_after_a_run_of_younger_rows(backend_dsn: str) -> None:
    # Old rows, younger ones, then old rows again (as a transaction open across the cutoff
    # leaves them, behind younger rows in position order).
    await add_rows(backend_dsn, 300, age=OLD)
    await add_rows(backend_dsn, 3000, age=YOUNG)
    await add_rows(backend_dsn, 50, age=OLD)
    rows = await positions(backend_dsn)
    await place(backend_dsn, "audit", rows[-1])

    first = await run_cleanup(
        backend_dsn, batch_size=100, bounds=ReadBounds(younger_rows_to_stop=2000)
    )
    assert first.outbox_deleted == 300
    assert first.outbox_walk_end == "younger_rows"
    # The walk read the old rows and at most a window past the stopping point, not the rest of
    # the younger rows.
    assert first.outbox_examined <= 300 + 2000 + retention.OUTBOX_WINDOW_MIN
    assert await positions(backend_dsn) == rows[300:]
    assert first.to_dict()["outbox_walk"]["ended"] == "younger_rows"

    # A walk allowed past them (as a later run is, once they have aged) deletes the rest.
    second = await run_cleanup(backend_dsn, batch_size=100)
    assert second.outbox_deleted == 50
    assert second.outbox_walk_end == "floor"
    assert await positions(backend_dsn) == rows[300:3300]


# -- status --------------------------------------------------------------------------------------


async def test_status_bounds_the_count_of_held_back_events(private_backend_dsn: str) -> None:
    blocker = await psycopg.AsyncConnection.connect(private_backend_dsn)
    conn = await psycopg.AsyncConnection.connect(private_backend_dsn, autocommit=True)
    async with blocker, conn:
        # An open transaction with an xid holds every later one back ...
        await blocker.execute("SELECT pg_current_xact_id()")
        # ... here 10,050 committed events, more than the exact count goes to.
        await conn.execute(
            "INSERT INTO sync.events_outbox (op, entity_type, entity_id, payload) "
            "SELECT 'upsert', 'thing', g::text, '{}' FROM generate_series(1, 10050) g"
        )
        report = orjson.loads(await status.report(conn, as_json=True))
        held = report["horizon"]
        assert held["held_back_estimated"] is True
        assert held["held_back_events"] == 10050
        text = await status.report(conn)
        assert "about 10050 committed event(s) are held back" in text
        await blocker.rollback()
        report = orjson.loads(await status.report(conn, as_json=True))
        assert report["horizon"]["held_back_events"] == 0
        assert report["horizon"]["held_back_estimated"] is False
