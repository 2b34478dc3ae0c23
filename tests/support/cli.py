"""`serversync` run to its end as a real subprocess, and what its result must look like."""

from __future__ import annotations

import asyncio

from tests.conftest import CliResult, finish, start_cli


async def run_cli(*args: str, env: dict[str, str], timeout: float = 60.0) -> CliResult:
    """Run `serversync ARGS...` to the end."""
    return await finish(await start_cli(*args, env=env), timeout)


async def run_many(*commands: list[str], env: dict[str, str]) -> list[CliResult]:
    """Several independent commands at once (each run is a second of imports)."""
    return list(await asyncio.gather(*(run_cli(*command, env=env) for command in commands)))


def assert_ok(result: CliResult) -> None:
    """Exit 0, no traceback."""
    assert result.code == 0, result
    assert "Traceback" not in result.stderr, result.stderr


def assert_one_line_error(result: CliResult, code: int, *fragments: str) -> str:
    """Exit `code`; stderr is one `serversync: ...` line holding every fragment; no traceback."""
    assert result.code == code, result
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert line.startswith("serversync: "), line
    for fragment in fragments:
        assert fragment in line, line
    assert result.stdout == ""
    return line


def table(stdout: str) -> tuple[list[str], dict[str, list[str]]]:
    """A CLI table: its header and its rows by first column (cells split on whitespace)."""
    lines = stdout.strip().splitlines()
    rows = {line.split()[0]: line.split() for line in lines[1:] if line.strip()}
    return lines[0].split(), rows
