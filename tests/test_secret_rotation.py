"""SYNC_SHARED_SECRET as a list: a real `serversync ingest-server` accepting a new and an old
secret while consumers move from one to the other, then only the new one; and the secrets
refused at start (too short, the example's placeholder) with one line and exit 2."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import aiohttp
import pytest

from consumer.devtools.devdb import free_port
from consumer.wire import signing
from tests.conftest import cli_env, fetch_value, finish, start_cli, wait_until
from tests.support.backend import consuming, insert_calls
from tests.support.cli import assert_one_line_error, run_many
from tests.support.processes import reaped
from tests.support.receivers import post_signed, wire_body
from tests.support.waiting import wait_caught_up

OLD = "the-old-secret-0123456789abcdef-0123"
NEW = "the-new-secret-fedcba9876543210-4567"
PLACEHOLDER = "CHANGE_ME_TO_A_LONG_RANDOM_SECRET"
# Shorter than the 32 characters each secret needs.
SHORT = "short-secret-0123456789"
# A DSN nothing answers: a configuration error is reported before any connection.
NOWHERE = "postgresql://serversync@127.0.0.1:9/none"


async def entities(receiver_dsn: str) -> int:
    return int(await fetch_value(receiver_dsn, "SELECT count(*) FROM ingest.entities"))


@contextlib.asynccontextmanager
async def ingest_server(receiver_dsn: str, shared_secret: str) -> AsyncIterator[str]:
    """`serversync ingest-server` with SYNC_SHARED_SECRET=`shared_secret` on a free port, until
    the block ends (SIGTERM, exit 0); yields its base URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = cli_env(
        FRONTEND_DATABASE_URL=receiver_dsn, INGEST_PORT=str(port), SYNC_SHARED_SECRET=shared_secret
    )
    process = await start_cli("ingest-server", env=env)
    async with reaped(process), aiohttp.ClientSession() as http:

        async def healthy() -> bool:
            if process.returncode is not None:
                raise AssertionError(f"ingest-server exited: {(await finish(process)).stderr}")
            try:
                async with http.get(url + "/healthz") as response:
                    return response.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await wait_until(healthy, timeout=30, what="the ingest-server to start")
        yield url
        process.terminate()
        stopped = await finish(process, timeout=15)
    assert stopped.code == 0, stopped.stderr
    assert "Traceback" not in stopped.stderr, stopped.stderr
    for secret in (OLD, NEW):
        assert secret not in stopped.stderr


async def test_a_secret_is_rotated_without_an_outage(backend_dsn: str, receiver_dsn: str) -> None:
    """1. The receiver takes NEW and OLD: a consumer still signing with OLD delivers, and so does
    one already signing with NEW (SYNC_SHARED_SECRET=NEW,OLD: the first signs).
    2. The receiver takes NEW only: a consumer signing with OLD is refused (401; its offset is
    held, nothing is parked), one signing with NEW delivers what it left."""
    async with ingest_server(receiver_dsn, f"{NEW},{OLD}") as url:
        await insert_calls(backend_dsn, 3, tag="during-old")
        async with consuming(backend_dsn, url, SYNC_SHARED_SECRET=OLD) as runtime:
            await wait_caught_up(backend_dsn)
        assert runtime.stats.failed_deliveries == 0
        assert await entities(receiver_dsn) == 3

        await insert_calls(backend_dsn, 3, tag="during-new")
        async with consuming(backend_dsn, url, SYNC_SHARED_SECRET=f"{NEW},{OLD}") as runtime:
            await wait_caught_up(backend_dsn)
        assert runtime.stats.failed_deliveries == 0
        assert await entities(receiver_dsn) == 6

    async with ingest_server(receiver_dsn, NEW) as url:
        await insert_calls(backend_dsn, 2, tag="after")
        async with consuming(backend_dsn, url, SYNC_SHARED_SECRET=OLD) as runtime:
            await wait_until(
                lambda: runtime.stats.failed_deliveries >= 2, what="two refused deliveries"
            )
            assert runtime.stats.failing_reason == "wrong_destination"
            assert runtime.stats.parked_events == 0
        assert await entities(receiver_dsn) == 6
        async with aiohttp.ClientSession() as http:
            body = wire_body("signed-with-old")
            status, _, answer = await post_signed(http, url, body, signing.sign(OLD, body))
            assert (status, answer["error"]["code"]) == (401, "INGEST_UNAUTHORIZED"), answer
            status, _, answer = await post_signed(http, url, body, signing.sign(NEW, body))
            assert status == 200, answer

        async with consuming(backend_dsn, url, SYNC_SHARED_SECRET=f"{NEW},{OLD}") as runtime:
            await wait_caught_up(backend_dsn)
        assert runtime.stats.failing_since is None
    assert await entities(receiver_dsn) == 9


REFUSED = [
    pytest.param(SHORT, "the secret is shorter than 32 characters", id="short"),
    pytest.param(f"{NEW},{SHORT}", "secret 2 of 2 is shorter than 32 characters", id="short-old"),
    pytest.param(PLACEHOLDER, "the secret is the example's placeholder", id="placeholder"),
    pytest.param(
        f"{NEW},{PLACEHOLDER}", "secret 2 of 2 is the example's placeholder", id="placeholder-old"
    ),
    pytest.param(f"{NEW},", "secret 2 of 2 is empty", id="trailing-comma"),
]


@pytest.mark.parametrize(("value", "message"), REFUSED)
async def test_a_weak_secret_is_a_one_line_configuration_error(value: str, message: str) -> None:
    """ingest-server and run alike: exit 2, one line naming the variable and what is wrong,
    and no secret of the list quoted."""
    env = cli_env(
        SYNC_SHARED_SECRET=value,
        FRONTEND_DATABASE_URL=NOWHERE,
        DATABASE_URL=NOWHERE,
        FRONTEND_BASE_URL="http://127.0.0.1:9",
    )
    results = await run_many(
        ["ingest-server"], ["run", "frontend-sync"], ["run", "recording-upload"], env=env
    )
    for result in results:
        line = assert_one_line_error(
            result, 2, "serversync: configuration error: SYNC_SHARED_SECRET: ", message
        )
        for secret in (NEW, SHORT):
            assert secret not in line, line


async def test_the_examples_placeholder_stops_ingest_server_even_with_insecure() -> None:
    env = cli_env(SYNC_SHARED_SECRET=PLACEHOLDER, FRONTEND_DATABASE_URL=NOWHERE)
    result = await finish(await start_cli("ingest-server", "--insecure", env=env))
    assert_one_line_error(result, 2, "SYNC_SHARED_SECRET: the secret is the example's placeholder")
