"""`make demo` is the first thing a newcomer runs: it must keep working end to end."""

from __future__ import annotations

import re

from consumer.devtools.devdb import Server
from tests.conftest import cli_env, finish, start_cli
from tests.support.cli import assert_ok


async def test_the_demo_runs_end_to_end_and_checks_what_it_shows(pg_server: Server) -> None:
    process = await start_cli("demo", "--calls", "2", env=cli_env(DATABASE_URL=pg_server.dsn))
    result = await finish(process, 120)
    assert_ok(result)
    out = result.stdout
    # Frontend -> backend: the operator's registered number reaches the backend's own table,
    # with the same version on both nodes, and the backend's relay of it is not sent back.
    assert re.search(
        r"registered number \d+ is in the backend's registered_numbers in \d+\.\d ms", out
    ), out
    assert re.search(r"the same row and version \(\S+, frontend\) on both sides", out), out
    assert "with origin=frontend; frontend-sync (target node frontend) passed it over" in out, out
    assert "nothing came back: the frontend's receiver has no registered_number" in out, out
    # Backend -> frontend, as before: call logs, then recordings uploaded, playable, marked at
    # the backend, gone from its disk.
    assert "all 2 call logs arrived" in out, out
    # A table filled before it was tracked reaches the frontend through a snapshot.
    assert "NOTICE: sync.track: table campaigns already holds rows" in out, out
    assert re.search(r"snapshot \d+ done for every consumer: \d+ row\(s\) from 1 table", out), out
    assert re.search(
        r"all \d+ rows of public.campaigns are at the frontend, equal row by row, with the \d+"
        r" edits made during the snapshot",
        out,
    ), out
    assert "all 3 recordings uploaded, playable from their fileUrl" in out, out
    assert out.count("Range bytes=0-43 -> 206") == 3, out
    # Both databases' consumers caught up, settings-sync's on the frontend's database.
    assert "settings-sync (the frontend's database): last_seq 1, backlog 0, delivered 1" in out, out
    assert "serversync status shows zero backlog on both databases" in out, out
