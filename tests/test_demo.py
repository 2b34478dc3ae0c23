"""`make demo` is the first thing a newcomer runs: it must keep working end to end."""

from __future__ import annotations

from consumer.devtools.devdb import Server
from tests.conftest import cli_env, finish, start_cli
from tests.support.cli import assert_ok


async def test_the_demo_runs_end_to_end_and_checks_what_it_shows(pg_server: Server) -> None:
    process = await start_cli("demo", "--calls", "2", env=cli_env(DATABASE_URL=pg_server.dsn))
    result = await finish(process, 120)
    assert_ok(result)
    out = result.stdout
    assert "all 2 call logs arrived" in out, out
    # The recordings part: uploaded, playable, marked at the backend, gone from its disk.
    assert "all 3 recordings uploaded, playable from their fileUrl" in out, out
    assert out.count("Range bytes=0-43 -> 206") == 3, out
    assert "serversync status shows zero backlog" in out, out
