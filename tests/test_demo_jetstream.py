"""The demo's JetStream step alone (tests/test_demo.py runs the whole demo): with a nats-server it
starts a three-node cluster and a declared JetStream consumer, and a call log comes back from the
stream through a durable pull consumer with its subject and Nats-Msg-Id; without one it says in
one line that it is skipped and why, and starts nothing."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import psycopg
import pytest

from consumer.app import jetstream_kind
from consumer.devtools import demo_jetstream
from consumer.devtools.demo_processes import DemoProcesses
from consumer.devtools.demo_steps import DemoRun
from tests.conftest import cli_env, fetch_value


def _run(processes: DemoProcesses, conn: Any, http: Any, tmp_path: Path) -> DemoRun:
    # The step reads and writes the backend's database only.
    return DemoRun(processes, conn, conn, http, tmp_path / "recordings")


async def test_a_call_log_comes_back_from_the_stream(
    backend_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = demo_jetstream.missing()
    if reason is not None:
        pytest.skip(reason)
    processes = DemoProcesses(tmp_path)
    env = cli_env(DATABASE_URL=backend_dsn, SYNC_LOG_LEVEL="INFO")
    conn = await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True)
    async with conn, aiohttp.ClientSession() as http:
        try:
            await demo_jetstream.jetstream_step(
                _run(processes, conn, http, tmp_path), env, tmp_path
            )
        finally:
            await processes.stop(list(processes.running))
    out = capsys.readouterr().out
    seq = await fetch_value(
        backend_dsn, "SELECT max(seq) FROM sync.events_outbox WHERE entity_type = 'call_log'"
    )
    assert re.search(
        r"call_log \S+ read back by the durable JetStream consumer demo-reader \(pull"
        r" subscription\) in \d+\.\d ms",
        out,
    ), out
    source = await jetstream_kind.database_source(backend_dsn, "events-js")
    assert f"subject serversync.call_log.upsert, Nats-Msg-Id {source}:events-js:{seq};" in out, out
    assert "is in stream SERVERSYNC once, on all 3 servers" in out, out
    # The consumer was stopped, caught up; the servers are gone with the step.
    assert processes.running["events-js"].returncode is not None
    backlog = await fetch_value(
        backend_dsn,
        "SELECT count(*) FROM sync.events_outbox o, sync.consumer_offsets c"
        " WHERE c.consumer = 'events-js' AND (o.txid, o.seq) > (c.last_txid, c.last_seq)",
    )
    assert backlog == 0
    assert _servers_under(tmp_path) == []


def _servers_under(root: Path) -> list[str]:
    """The command lines of the nats-servers running with a configuration under `root`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:  # it ended meanwhile
            continue
        if "nats-server" in command and str(root) in command:
            found.append(command)
    return found


async def test_without_nats_server_the_step_says_it_is_skipped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("nats", reason="nats-py (the jetstream extra) is not installed")
    monkeypatch.setattr("consumer.devtools.nats_cluster.nats_server_binary", lambda: None)
    processes = DemoProcesses(tmp_path)
    run = _run(processes, None, None, tmp_path)
    await demo_jetstream.jetstream_step(run, {}, tmp_path)
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "==> JetStream step skipped: no nats-server on PATH or in /usr/sbin (Debian: apt-get"
        " install nats-server)"
    ]
    assert processes.running == {}
    assert not (tmp_path / "nats").exists()
