"""The demo's snapshot: a table that held rows before it was tracked reaches the frontend through
`serversync snapshot`, while its rows keep changing, and the two sides end equal row by row."""

from __future__ import annotations

import asyncio
import random
import sys
from typing import Any

import psycopg

from consumer.devtools.demo_steps import DemoRun, require, say

TABLE = "public.campaigns"
ENTITY_TYPE = "campaign"
ROWS = 2000
# Small chunks, so that the demo shows progress and the edits meet chunks in flight.
CHUNK_SIZE = 200
# Between two edits of the producer that keeps changing rows while the snapshot runs.
EDIT_PAUSE = 0.002

CREATE = """
CREATE TABLE IF NOT EXISTS public.campaigns (
    id     bigint  PRIMARY KEY,
    name   text    NOT NULL,
    budget integer NOT NULL
)
"""
FILL = """
INSERT INTO public.campaigns (id, name, budget)
SELECT g, 'campaign ' || g, 1000 + g FROM generate_series(1, %s) AS g
"""
BACKEND_ROWS = "SELECT id::text, to_jsonb(c) FROM public.campaigns AS c"
FRONTEND_ROWS = (
    "SELECT entity_id, payload FROM ingest.live_entities WHERE entity_type = %s"
)  # fmt: skip


async def _keep_editing(conn: psycopg.AsyncConnection[Any], stop: asyncio.Event) -> int:
    """Update, delete and insert rows at random until `stop`; how many edits were made."""
    edits = 0
    next_id = ROWS + 1
    pick = random.Random(7)
    while not stop.is_set():
        choice = pick.random()
        if choice < 0.8:
            await conn.execute(
                "UPDATE public.campaigns SET budget = budget + 1 WHERE id = %s",
                (pick.randint(1, ROWS),),
            )
        elif choice < 0.9:
            await conn.execute(
                "DELETE FROM public.campaigns WHERE id = %s", (pick.randint(1, ROWS),)
            )
        else:
            await conn.execute(
                "INSERT INTO public.campaigns VALUES (%s, %s, 0)", (next_id, f"new {next_id}")
            )
            next_id += 1
        edits += 1
        await asyncio.sleep(EDIT_PAUSE)  # a producer's pace, not a wait for anything
    return edits


async def snapshot_step(run: DemoRun, backend_env: dict[str, str], backend_dsn: str) -> None:
    """Fill a table, track it (sync.track says it holds rows), send it with `serversync
    snapshot` while another connection keeps editing it, and check the frontend's copy."""
    say(f"a table filled before it was tracked: {ROWS} rows in the backend's {TABLE}")
    await run.backend.execute(CREATE)
    await run.backend.execute(FILL, (ROWS,))
    notices: list[str] = []
    run.backend.add_notice_handler(
        lambda notice: notices.extend(
            line for line in (notice.message_primary, notice.message_hint) if line
        )
    )
    await run.backend.execute("SELECT sync.track(%s, %s)", (TABLE, ENTITY_TYPE))
    for notice in notices:
        print(f"    NOTICE: {notice}", flush=True)
    say(
        f"`serversync snapshot {TABLE} --chunk-size {CHUNK_SIZE}` while another connection keeps "
        "updating, deleting and inserting its rows"
    )
    stop = asyncio.Event()
    editor = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with editor:
        editing = asyncio.create_task(_keep_editing(editor, stop))
        try:
            snapshot = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "consumer",
                "snapshot",
                TABLE,
                "--chunk-size",
                str(CHUNK_SIZE),
                env=backend_env,
            )
            code = await snapshot.wait()
        finally:
            stop.set()
            edits = await editing
    require(code == 0, f"serversync snapshot exited with {code}")

    async def equal() -> bool:
        backend = dict(await (await run.backend.execute(BACKEND_ROWS)).fetchall())
        cur = await run.frontend.execute(FRONTEND_ROWS, (ENTITY_TYPE,))
        return dict(await cur.fetchall()) == backend

    await run.processes.wait_for(equal, 15, f"the frontend's {ENTITY_TYPE} rows to equal {TABLE}")
    count = await (await run.backend.execute("SELECT count(*) FROM public.campaigns")).fetchone()
    say(
        f"all {count[0] if count else 0} rows of {TABLE} are at the frontend, equal row by row, "
        f"with the {edits} edits made during the snapshot"
    )
