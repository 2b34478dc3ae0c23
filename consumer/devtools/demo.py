"""`serversync demo`: the whole path on one machine, in both directions, started for you.

Backend and frontend databases side by side on one server (DATABASE_URL's, a local one, or a
private throwaway cluster), two nodes named `backend` and `frontend`, each with serversync's
schema and the voicebot's tables, the settings tables tracked both ways on both. Real processes:
frontend-sync and recording-upload on the backend's database, delivering to the reference
receiver on the frontend's; the declared consumer settings-sync on the frontend's database,
delivering to a second receiver that maps the settings into the backend's own tables.

First an operator adds a registered number in the frontend's database: timed until it is in the
backend's registered_numbers, and shown not to come back. Then call logs are written to the
backend and watched arriving at the frontend's receiver; then a table filled before it was
tracked reaches the frontend through `serversync snapshot` while its rows keep changing, and the
two copies are compared row by row; then a few calls get a real recording
(a short WAV tone and its meta.json in a temp RECORDINGS_DIR), and each one is checked end to
end: uploaded, playable from its fileUrl, marked uploaded at the backend, gone from the backend's
disk, and delivered with its URL to the receiver's database; then, where a nats-server is
installed, a call log goes through a declared JetStream consumer into a replicated stream and is
read back (consumer/devtools/demo_jetstream.py). Exit 0 only when every check holds; otherwise
one line says which failed.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from consumer.devtools.demo_jetstream import jetstream_step
from consumer.devtools.demo_processes import DemoCheckFailed, DemoProcesses
from consumer.devtools.demo_settings import (
    SETTINGS_SECRET_ENV,
    consumers_file,
    mapping_file,
    metrics_url,
    name_and_track,
    settings_edit,
)
from consumer.devtools.demo_snapshot import snapshot_step
from consumer.devtools.demo_steps import (
    CONSUMERS,
    SETTINGS_CONSUMER,
    DemoRun,
    call_logs,
    check_recordings,
    fetch_one,
    say,
    tone_wav,
    zero_backlog,
)
from consumer.devtools.devdb import NoPostgresError, free_port, fresh_database, locate_server
from consumer.store import admin
from consumer.store.db import mask_dsn, with_dbname

# tone_wav stays importable from here: the tests make their recordings with it.
__all__ = ["run_demo", "tone_wav"]

BACKEND_DB = "serversync_demo_backend"
FRONTEND_DB = "serversync_demo_frontend"
# The receivers: the frontend's (generic, into ingest.entities) and the backend's (mapped).
FRONTEND_RECEIVER = "ingest-server"
BACKEND_RECEIVER = "ingest-server-backend"
# Seconds between checks while the processes start: five interpreters importing on a small
# machine, and a tighter poll would take CPU from them.
STARTING_POLL = 0.025


async def run_demo(calls: int = 5, recordings: int = 3) -> int:
    """Run the demo; 0 when the registered number reached the backend and did not come back,
    every call log and recording arrived, and every check held."""
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
        backend, frontend = (
            with_dbname(server.dsn, BACKEND_DB),
            with_dbname(server.dsn, FRONTEND_DB),
        )
        env = {
            **os.environ,
            "SYNC_LOG_LEVEL": "INFO",
            # Each receiver gets its own store, each direction its own secret (below).
            "RECORDINGS_STORE_DIR": str(store_dir),
        }
        port, backend_port = free_port(), free_port()
        base_url, backend_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{backend_port}"
        # backend -> frontend: the consumers sign, the frontend's receiver checks.
        to_frontend = {
            **env,
            "DATABASE_URL": backend,
            "FRONTEND_DATABASE_URL": frontend,
            "FRONTEND_BASE_URL": base_url,
            "INGEST_PORT": str(port),
            "RECORDINGS_DIR": str(recordings_dir),
            "SYNC_SHARED_SECRET": secrets.token_hex(32),
        }
        # frontend -> backend: settings-sync signs with its declared secret, which the
        # backend's receiver checks as its SYNC_SHARED_SECRET.
        settings_secret = secrets.token_hex(32)
        to_backend = {
            **env,
            "DATABASE_URL": frontend,
            "SYNC_CONSUMERS_FILE": str(consumers_file(workdir, backend_url)),
            SETTINGS_SECRET_ENV: settings_secret,
            "FRONTEND_DATABASE_URL": backend,
            "INGEST_PORT": str(backend_port),
            "RECORDINGS_STORE_DIR": str(workdir / "backend-store"),
            "SYNC_SHARED_SECRET": settings_secret,
        }
        mapping = mapping_file(workdir)
        http_ports = {name: free_port() for name in (*CONSUMERS, SETTINGS_CONSUMER)}

        # The processes of each database start as soon as it is ready (a consumer reads its
        # node's name at start): the backend's import their code while the frontend's database
        # is being made.
        await fresh_database(server.dsn, BACKEND_DB, ["backend"], examples=True)
        await name_and_track(backend, "backend")
        await processes.spawn(
            BACKEND_RECEIVER, ["ingest-server", "--mapping", str(mapping)], to_backend
        )
        for consumer in CONSUMERS:
            # Each consumer process serves its own HTTP port (health, metrics).
            own = {**to_frontend, "SYNC_HTTP_PORT": str(http_ports[consumer])}
            if consumer == "frontend-sync":
                # The backend's relay of a change that came from the frontend is not sent back.
                own["SYNC_TARGET_NODE"] = "frontend"
            await processes.spawn(consumer, ["run", consumer], own)
        await fresh_database(server.dsn, FRONTEND_DB, ["backend", "receiver"], examples=True)
        await name_and_track(frontend, "frontend")
        await processes.spawn(FRONTEND_RECEIVER, ["ingest-server"], to_frontend)
        own = {**to_backend, "SYNC_HTTP_PORT": str(http_ports[SETTINGS_CONSUMER])}
        await processes.spawn(SETTINGS_CONSUMER, ["run", SETTINGS_CONSUMER], own)
        say(
            f"databases {BACKEND_DB} (node backend) and {FRONTEND_DB} (node frontend, and the "
            "receiver's) migrated"
        )
        say("the voicebot's tables in both; its five settings tables tracked both ways on both")
        say(
            "backend -> frontend: `serversync run frontend-sync` (SYNC_TARGET_NODE=frontend) "
            f"and `serversync run recording-upload` to ingest-server on {base_url}"
        )
        say(
            f"frontend -> backend: `serversync run {SETTINGS_CONSUMER}` (consumers.toml, "
            f"target_node backend) to `ingest-server --mapping {_shown(mapping)}` on {backend_url}"
        )
        say(
            f"logs, consumers.toml, RECORDINGS_DIR and the receivers' stores in {workdir} "
            "(removed at the end; the logs are kept if the demo fails)"
        )

        bconn = await psycopg.AsyncConnection.connect(backend, autocommit=True)
        fconn = await psycopg.AsyncConnection.connect(frontend, autocommit=True)
        async with bconn, fconn, aiohttp.ClientSession() as http:
            run = DemoRun(processes, bconn, fconn, http, recordings_dir)

            def receiver_up(url: str) -> Callable[[], Awaitable[bool]]:
                async def up() -> bool:
                    try:
                        async with http.get(f"{url}/readyz") as response:
                            return response.status == 200
                    except aiohttp.ClientError:
                        return False

                return up

            def leading(
                conn: psycopg.AsyncConnection[Any], names: tuple[str, ...]
            ) -> Callable[[], Awaitable[bool]]:
                async def up() -> bool:
                    row = await fetch_one(
                        conn,
                        "SELECT count(*) FROM sync.consumer_offsets "
                        "WHERE consumer = ANY(%s) AND leader_pid IS NOT NULL",
                        (list(names),),
                    )
                    return bool(row and row[0] == len(names))

                return up

            await processes.wait_for(
                receiver_up(base_url), 20, "the frontend's ingest-server", interval=STARTING_POLL
            )
            await processes.wait_for(
                receiver_up(backend_url), 20, "the backend's ingest-server", interval=STARTING_POLL
            )
            await processes.wait_for(
                leading(bconn, CONSUMERS), 20, "both consumers to lead", interval=STARTING_POLL
            )
            await processes.wait_for(
                leading(fconn, (SETTINGS_CONSUMER,)),
                20,
                f"{SETTINGS_CONSUMER} to lead",
                interval=STARTING_POLL,
            )
            await settings_edit(run, metrics_url(http_ports["frontend-sync"]))
            await call_logs(run, calls)
            await snapshot_step(run, to_frontend, backend)
            if recordings > 0:
                await check_recordings(run, recordings)
            await jetstream_step(run, to_frontend, workdir)
            await zero_backlog(run)
            await _show_status(to_frontend, fconn)

        say("serversync status shows zero backlog on both databases: done")
        return 0
    except (DemoCheckFailed, TimeoutError, psycopg.Error, aiohttp.ClientError, OSError) as exc:
        keep_logs = True
        print(f"serversync demo failed: {exc} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        # The consumers first: a batch in flight then finishes against a receiver still up.
        await processes.stop([*CONSUMERS, SETTINGS_CONSUMER])
        await processes.stop([FRONTEND_RECEIVER, BACKEND_RECEIVER])
        # The recordings go in every case; the logs stay only when they explain a failure.
        if keep_logs:
            for folder in (recordings_dir, store_dir, workdir / "backend-store"):
                shutil.rmtree(folder, ignore_errors=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        await asyncio.to_thread(server.close)


async def _show_status(env: dict[str, str], frontend: psycopg.AsyncConnection[Any]) -> None:
    """`serversync status` of the backend's database; settings-sync's row of the frontend's,
    read here (a second `status` process would cost a second of imports)."""
    status = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "consumer", "status", env=env
    )
    await status.wait()
    for row in await admin.consumer_status(frontend, SETTINGS_CONSUMER):
        print(
            f"{row['consumer']} (the frontend's database): last_seq {row['last_seq']}, "
            f"backlog {row['backlog']}, delivered {row['delivered_total']}",
            flush=True,
        )


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is under it (deploy/...), else whole."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
