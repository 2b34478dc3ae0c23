"""`serversync demo`: the whole path on one machine, started for you.

Backend and receiver databases side by side on one server (DATABASE_URL's, a local one, or a
private throwaway cluster), the reference receiver and the frontend-sync consumer as real
processes, call logs written to the backend and watched arriving at the receiver.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from consumer.db import mask_dsn
from consumer.devdb import NoPostgresError, free_port, fresh_database, locate_server

BACKEND_DB = "serversync_demo_backend"
FRONTEND_DB = "serversync_demo_frontend"


def _say(message: str) -> None:
    print(f"==> {message}", flush=True)


async def _spawn(args: list[str], env: dict[str, str], log: Path) -> asyncio.subprocess.Process:
    handle = log.open("wb")
    try:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "consumer",
            "--log-format",
            "text",
            *args,
            env=env,
            stdout=handle,
            stderr=handle,
        )
    finally:
        handle.close()


async def _wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def run_demo(calls: int = 5) -> int:
    """Run the demo; 0 when every call log arrived and the backlog is zero."""
    try:
        server = await asyncio.to_thread(locate_server)
    except NoPostgresError as exc:
        print(f"serversync demo: {exc}", file=sys.stderr)
        return 1
    where = "a private throwaway cluster" if server.cluster else mask_dsn(server.dsn)
    _say(f"PostgreSQL: {where}")
    workdir = Path(tempfile.mkdtemp(prefix="serversync-demo-"))
    processes: list[asyncio.subprocess.Process] = []
    try:
        backend = await fresh_database(server.dsn, BACKEND_DB, ["backend", "voicebot"])
        frontend = await fresh_database(server.dsn, FRONTEND_DB, ["receiver"])
        _say(f"databases {BACKEND_DB} (backend) and {FRONTEND_DB} (receiver) migrated")

        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "DATABASE_URL": backend,
            "FRONTEND_DATABASE_URL": frontend,
            "FRONTEND_BASE_URL": base_url,
            "INGEST_PORT": str(port),
            "SYNC_LOG_LEVEL": "INFO",
            # The consumer signs, the receiver checks: the same secret on both sides.
            "SYNC_SHARED_SECRET": secrets.token_hex(16),
        }
        processes.append(await _spawn(["ingest-server"], env, workdir / "ingest-server.log"))
        processes.append(await _spawn(["run", "frontend-sync"], env, workdir / "frontend-sync.log"))
        _say(
            f"started ingest-server on {base_url} and `serversync run frontend-sync` "
            f"(logs in {workdir})"
        )

        async with aiohttp.ClientSession() as http:

            async def receiver_up() -> bool:
                try:
                    async with http.get(f"{base_url}/readyz") as response:
                        return response.status == 200
                except aiohttp.ClientError:
                    return False

            await _wait_for(receiver_up, 20, "the ingest-server")

        bconn = await psycopg.AsyncConnection.connect(backend, autocommit=True)
        fconn = await psycopg.AsyncConnection.connect(frontend, autocommit=True)
        async with bconn, fconn:

            async def leader_up() -> bool:
                cur = await bconn.execute(
                    "SELECT leader_pid IS NOT NULL FROM sync.consumer_offsets "
                    "WHERE consumer = 'frontend-sync'"
                )
                row = await cur.fetchone()
                return bool(row and row[0])

            await _wait_for(leader_up, 20, "the consumer to take the lead")
            _say(f"creating {calls} call logs in the backend, one transaction each")
            latencies = []
            for i in range(calls):
                started = time.monotonic()
                cur = await bconn.execute(
                    "INSERT INTO call_logs (caller_number, callee_number, status, summary) "
                    "VALUES (%s, '0312345678', 'completed', %s) RETURNING id::text",
                    (f"09012345{i:03d}", f"demo call {i + 1}"),
                )
                row = await cur.fetchone()
                assert row is not None
                call_id = row[0]

                async def arrived(call_id: str = call_id) -> bool:
                    cur = await fconn.execute(
                        "SELECT 1 FROM ingest.live_entities "
                        "WHERE entity_type = 'call_log' AND entity_id = %s",
                        (call_id,),
                    )
                    return await cur.fetchone() is not None

                await _wait_for(arrived, 10, f"call log {call_id} at the receiver")
                latency = (time.monotonic() - started) * 1000
                latencies.append(latency)
                print(f"    call_log {call_id} arrived at the receiver in {latency:6.1f} ms")
        _say(f"all {calls} call logs arrived (slowest {max(latencies):.1f} ms)")

        status = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "consumer",
            "status",
            env=env,
        )
        await status.wait()
        sync_env = {**env, "DATABASE_URL": backend}
        check = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "consumer",
            "status",
            "--json",
            env=sync_env,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await check.communicate()
        if b'"backlog": 0' not in out:
            print("serversync demo: backlog is not zero", file=sys.stderr)
            return 1
        _say("serversync status shows zero backlog: done")
        return 0
    except (TimeoutError, psycopg.Error, OSError) as exc:
        print(f"serversync demo failed: {exc} (logs in {workdir})", file=sys.stderr)
        return 1
    finally:
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
        await asyncio.to_thread(server.close)
