"""`serversync demo`: the whole path on one machine, started for you.

Backend and receiver databases side by side on one server (DATABASE_URL's, a local one, or a
private throwaway cluster), the reference receiver and the frontend-sync and recording-upload
consumers as real processes. Call logs are written to the backend and watched arriving at the
receiver; then a few calls get a real recording (a short WAV tone and its meta.json in a temp
RECORDINGS_DIR), and each one is checked end to end: uploaded, playable from its fileUrl, marked
uploaded at the backend, gone from the backend's disk, and delivered with its URL to the
receiver's database. Exit 0 only when every check holds; otherwise one line says which failed.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

import aiohttp
import psycopg

from consumer.devtools.demo_processes import DemoCheckFailed, DemoProcesses
from consumer.devtools.demo_steps import (
    CONSUMERS,
    DemoRun,
    call_logs,
    check_recordings,
    fetch_one,
    say,
    tone_wav,
    zero_backlog,
)
from consumer.devtools.devdb import NoPostgresError, free_port, fresh_database, locate_server
from consumer.store.db import mask_dsn

# tone_wav stays importable from here: the tests make their recordings with it.
__all__ = ["run_demo", "tone_wav"]

BACKEND_DB = "serversync_demo_backend"
FRONTEND_DB = "serversync_demo_frontend"


async def run_demo(calls: int = 5, recordings: int = 3) -> int:
    """Run the demo; 0 when every call log and recording arrived and every check held."""
    try:
        server = await asyncio.to_thread(locate_server)
    except NoPostgresError as exc:
        print(f"serversync demo: {exc}", file=sys.stderr)
        return 1
    where = "a private throwaway cluster" if server.cluster else mask_dsn(server.dsn)
    say(f"PostgreSQL: {where}")
    workdir = Path(tempfile.mkdtemp(prefix="serversync-demo-"))
    recordings_dir = workdir / "backend-recordings"
    store_dir = workdir / "frontend-recordings"
    recordings_dir.mkdir()
    processes = DemoProcesses(workdir)
    keep_logs = False
    try:
        backend = await fresh_database(server.dsn, BACKEND_DB, ["backend"], examples=True)
        frontend = await fresh_database(server.dsn, FRONTEND_DB, ["receiver"])
        say(f"databases {BACKEND_DB} (backend) and {FRONTEND_DB} (receiver) migrated")

        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "DATABASE_URL": backend,
            "FRONTEND_DATABASE_URL": frontend,
            "FRONTEND_BASE_URL": base_url,
            "INGEST_PORT": str(port),
            "RECORDINGS_DIR": str(recordings_dir),
            "RECORDINGS_STORE_DIR": str(store_dir),
            "SYNC_LOG_LEVEL": "INFO",
            # The consumers sign, the receiver checks: the same secret on both sides.
            "SYNC_SHARED_SECRET": secrets.token_hex(32),
        }
        await processes.spawn("ingest-server", ["ingest-server"], env)
        for consumer in CONSUMERS:
            # Each consumer process serves its own HTTP port (health, metrics).
            own = {**env, "SYNC_HTTP_PORT": str(free_port())}
            await processes.spawn(consumer, ["run", consumer], own)
        say(
            f"started ingest-server on {base_url}, `serversync run frontend-sync` and "
            "`serversync run recording-upload`"
        )
        say(
            f"logs, RECORDINGS_DIR and the receiver's RECORDINGS_STORE_DIR in {workdir} "
            "(removed at the end; the logs are kept if the demo fails)"
        )

        bconn = await psycopg.AsyncConnection.connect(backend, autocommit=True)
        fconn = await psycopg.AsyncConnection.connect(frontend, autocommit=True)
        async with bconn, fconn, aiohttp.ClientSession() as http:
            run = DemoRun(processes, bconn, fconn, http, recordings_dir)

            async def receiver_up() -> bool:
                try:
                    async with http.get(f"{base_url}/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            async def leaders_up() -> bool:
                row = await fetch_one(
                    bconn,
                    "SELECT count(*) FROM sync.consumer_offsets "
                    "WHERE consumer = ANY(%s) AND leader_pid IS NOT NULL",
                    (list(CONSUMERS),),
                )
                return bool(row and row[0] == len(CONSUMERS))

            await processes.wait_for(receiver_up, 20, "the ingest-server")
            await processes.wait_for(leaders_up, 20, "both consumers to take the lead")
            await call_logs(run, calls)
            if recordings > 0:
                await check_recordings(run, recordings)
            await zero_backlog(run)

        status = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "consumer", "status", env=env
        )
        await status.wait()
        say("serversync status shows zero backlog: done")
        return 0
    except (DemoCheckFailed, TimeoutError, psycopg.Error, aiohttp.ClientError, OSError) as exc:
        keep_logs = True
        print(f"serversync demo failed: {exc} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        # The consumers first: a batch in flight then finishes against a receiver still up.
        await processes.stop(list(CONSUMERS))
        await processes.stop(["ingest-server"])
        # The recordings go in every case; the logs stay only when they explain a failure.
        if keep_logs:
            shutil.rmtree(recordings_dir, ignore_errors=True)
            shutil.rmtree(store_dir, ignore_errors=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        await asyncio.to_thread(server.close)
