"""Every command in README.md and docs/ is a command that exists, and the README's "Using it"
walkthrough runs for real against a fresh database.

The fenced ```sh, ```console and ```bash blocks are read line by line (a `$ ` prompt in a console
block marks a command, other lines there are output; a trailing backslash continues a line):

- `serversync ...` must be accepted by the real command-line parser;
- `make X` must name a target of the Makefile;
- `python -m bench X` must be a real bench subcommand with arguments it accepts;
- any other command must be on ALLOWED below: a new kind of command fails this test until
  someone decides it belongs in the docs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import re
import shlex
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from bench.__main__ import _parser as bench_parser
from consumer.app.cli import build_parser
from tests.conftest import (
    CliResult,
    cli_env,
    fetch_value,
    finish,
    serve_receiver,
    start_cli,
    wait_until,
)

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"^```(?:sh|console|bash)[ \t]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Commands the docs may show besides serversync, make and python -m bench.
ALLOWED = frozenset({"export", "psql", "curl", "systemctl", "journalctl", "pip"})
PYTHONS = frozenset({"python", "python3", ".venv/bin/python"})
SECRET = "docs-walkthrough-" + "0" * 32


@dataclass(frozen=True)
class Command:
    """One command line of a document."""

    where: str
    argv: list[str]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def block_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, command text) of every command in the shell blocks of `text`."""
    for block in BLOCK.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).splitlines()
        console = any(line.startswith("$ ") for line in lines)
        pending, start = "", 0
        for offset, raw in enumerate(lines):
            line = raw.rstrip()
            if console and not pending:
                if not line.startswith("$ "):
                    continue  # output
                line = line[2:]
            if not pending:
                start = first + offset
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            command = (pending + line).strip()
            pending = ""
            if command and not command.startswith("#"):
                yield start, command


def commands(path: Path) -> list[Command]:
    """Every command line of the document at `path`, split as a shell would (comments off)."""
    name = path.relative_to(ROOT).as_posix()
    return [
        Command(f"{name}:{number}", shlex.split(text, comments=True))
        for number, text in block_lines(path.read_text("utf-8"))
    ]


ALL_COMMANDS = [command for path in DOCUMENTS for command in commands(path)]


def make_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w-]*):", (ROOT / "Makefile").read_text(), re.MULTILINE))


def parses(parser: argparse.ArgumentParser, args: list[str]) -> str | None:
    """None when `parser` accepts `args`, else what it said."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            parser.parse_args(args)
    except SystemExit:
        return said.getvalue().strip().splitlines()[-1] if said.getvalue().strip() else "exited"
    return None


ENV_ASSIGNMENT = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")


def problem(command: Command) -> str | None:
    """Why `command` is not a command the project has, or None."""
    argv = command.argv
    # `NAME=value command ...`: the environment of one command, then the command.
    while len(argv) > 1 and ENV_ASSIGNMENT.fullmatch(argv[0]):
        argv = argv[1:]
    word = argv[0]
    if word.endswith("serversync"):
        return parses(build_parser(), argv[1:])
    if word == "make":
        unknown = [target for target in argv[1:] if target not in make_targets()]
        return f"no Makefile target {unknown}" if unknown else None
    if word in PYTHONS and argv[1:3] == ["-m", "bench"]:
        return parses(bench_parser(), argv[3:])
    if word in ALLOWED:
        return None
    return f"{word!r} is not an allowed command (add it to ALLOWED if it belongs in the docs)"


def test_the_docs_have_commands_to_check() -> None:
    words = {command.argv[0] for command in ALL_COMMANDS}
    assert {"serversync", "make"} <= words
    assert len(ALL_COMMANDS) > 30


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_every_documented_command_exists(command: Command) -> None:
    assert problem(command) is None, f"{command}: {problem(command)}"


def test_the_checks_refuse_what_does_not_exist() -> None:
    """The checks above can fail: a made-up option, target, subcommand or program is refused."""
    for text in (
        "serversync run frontend-sync --no-such-option",
        "serversync offsets reset frontend-sync",
        "make deploy",
        "python -m bench nonsense",
        "rm -rf /tmp/x",
    ):
        assert problem(Command("made up", shlex.split(text))) is not None, text
    assert (
        problem(Command("fine", shlex.split("serversync status --json # a comment", comments=True)))
        is None
    )


# -- the README's walkthrough, run ---------------------------------------------------------------


def walkthrough() -> list[list[str]]:
    """The commands of the first shell block of the README's "Using it" section."""
    text = (ROOT / "README.md").read_text("utf-8")
    section = text.split("\n## Using it\n", 1)[1].split("\n## ", 1)[0]
    first = BLOCK.search(section)
    assert first is not None, "no shell block in README 'Using it'"
    return [shlex.split(line, comments=True) for _, line in block_lines(first.group(0))]


@contextlib.asynccontextmanager
async def running(
    args: list[str], env: dict[str, str]
) -> AsyncIterator[asyncio.subprocess.Process]:
    """`serversync ARGS...` running in the background; SIGTERM on exit must end it with 0."""
    process = await start_cli(*args, env=env)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGTERM)
        result = await finish(process, timeout=20)
        assert result.code == 0, (args, result.stderr[-2000:])


async def sql_of_psql(dsn: str, argv: list[str]) -> None:
    """Run the `-c` statement of a psql line on `dsn`, creating the table it tracks first."""
    statement = argv[argv.index("-c") + 1]
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        for table in re.findall(r"sync\.track\('([\w.]+)'", statement):
            schema, name = table.split(".")
            await conn.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (id bigint PRIMARY KEY, total numeric)"
                ).format(sql.Identifier(schema, name))
            )
        await conn.execute(statement)


async def leads(dsn: str, consumer: str) -> bool:
    """Some process leads `consumer`."""
    return bool(
        await fetch_value(
            dsn,
            "SELECT leader_pid IS NOT NULL FROM sync.consumer_offsets WHERE consumer = %s",
            (consumer,),
        )
    )


async def invoice_arrived(receiver_dsn: str) -> bool:
    """The walkthrough's invoice is at the receiver."""
    return bool(
        await fetch_value(
            receiver_dsn,
            "SELECT count(*) = 1 FROM ingest.entities"
            " WHERE entity_type = 'invoice' AND entity_id = '1'",
        )
    )


async def test_the_readme_walkthrough_runs(
    empty_dsn: str, receiver_dsn: str, tmp_path: Path
) -> None:
    """migrate, track a table, run both consumers, then status, offsets, consumers and dlq, as
    the README shows them, against a fresh database and a real receiver."""
    steps = walkthrough()
    assert [s[:2] for s in steps if s[0] == "serversync"][:1] == [["serversync", "migrate"]]
    recordings = tmp_path / "recordings"
    recordings.mkdir()
    outputs: dict[str, CliResult] = {}
    async with (
        serve_receiver(receiver_dsn, shared_secret=SECRET) as url,
        contextlib.AsyncExitStack() as stack,
    ):
        env = cli_env(
            DATABASE_URL=empty_dsn,
            FRONTEND_BASE_URL=url,
            SYNC_SHARED_SECRET=SECRET,
            RECORDINGS_DIR=str(recordings),
            SYNC_STANDBY_INTERVAL_SEC="0.2",
            SYNC_SHUTDOWN_TIMEOUT_SEC="2",
        )
        started: list[str] = []
        for argv in steps:
            word = argv[0]
            if word == "export":
                names = {item.split("=", 1)[0] for item in argv[1:] if "=" in item}
                assert names <= set(env), names - set(env)
            elif word == "psql":
                await sql_of_psql(empty_dsn, argv)
                async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as c:
                    await c.execute("INSERT INTO public.invoices (id, total) VALUES (1, 9.5)")
            elif argv[1] == "run":
                await stack.enter_async_context(running(argv[1:], env))
                started.append(argv[2])
                await wait_until(
                    functools.partial(leads, empty_dsn, argv[2]),
                    timeout=20,
                    what=f"{argv[2]} to lead",
                )
            else:
                if started:
                    await wait_until(
                        functools.partial(invoice_arrived, receiver_dsn),
                        timeout=20,
                        what="the invoice at the receiver",
                    )
                result = await finish(await start_cli(*argv[1:], env=env))
                assert result.code == 0, (argv, result.stdout, result.stderr)
                assert "Traceback" not in result.stderr
                outputs[" ".join(argv[1:3])] = result
                if argv[1] == "migrate":
                    # The comment names --with-examples: the voicebot tables recording-upload reads.
                    examples = await finish(await start_cli("migrate", "--with-examples", env=env))
                    assert examples.code == 0, examples.stderr
        assert started == ["frontend-sync", "recording-upload"]

    status = outputs["status"].stdout
    assert status.split()[0] == "CONSUMER", status
    rows = {line.split()[0]: line.split() for line in status.splitlines()[1:] if line.strip()}
    assert {"frontend-sync", "recording-upload"} <= set(rows), status
    assert "ok" in rows["frontend-sync"], status
    assert "frontend-sync" in outputs["offsets list"].stdout
    assert "recording-upload" in outputs["consumers list"].stdout
    assert "no dead letters for frontend-sync" in outputs["dlq list"].stdout
    tracked = await fetch_value(
        empty_dsn, "SELECT count(*) FROM sync.tracked_tables WHERE table_name::text = 'invoices'"
    )
    assert tracked == 1
