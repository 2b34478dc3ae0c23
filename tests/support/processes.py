"""serversync processes run as real subprocesses (`python -m consumer ...`), with their output
in a file: consumers with short timers, and any other command, each killed and its log printed
when the test ends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Self

from tests.conftest import ROOT, wait_until
from tests.support.backend import CONSUMER

# Short timers, so that faults play out in well under a second.
FAST_ENV: dict[str, str] = {
    "SYNC_LOG_LEVEL": "DEBUG",
    "SYNC_BATCH_SIZE": "100",
    "SYNC_TIMEOUT_SEC": "20",
    "SYNC_POLL_INTERVAL_SEC": "30",
    "SYNC_RECHECK_INTERVAL_MS": "50",
    "SYNC_STANDBY_INTERVAL_SEC": "0.2",
    "SYNC_RETRY_INITIAL_SEC": "0.05",
    "SYNC_RETRY_MAX_SEC": "0.5",
    "SYNC_SHUTDOWN_TIMEOUT_SEC": "2",
    # Every process serves /healthz, /readyz and /metrics: on a free port, so that several fit.
    "SYNC_HTTP_PORT": "0",
}

# The line every `run` logs at start (SYNC_HTTP_PORT=0: the port is only known from it).
OPS_URL = re.compile(r"health, readiness and metrics on (http://127\.0\.0\.1:\d+)")
# Variables a test process never inherits from the environment pytest runs in: each test sets
# its own.
OWN_PREFIXES = (
    "SYNC_",
    "DATABASE_URL",
    "FRONTEND_",
    "INGEST_",
    "RECORDINGS_",
    "SERVERSYNC_",
    "PG",
    "OTEL_",
)


def lock_application_name(pid: int) -> str:
    """The application_name of a consumer process's leader lock connection."""
    return f"serversync:leader:{CONSUMER}:{socket.gethostname()}:{pid}"[:63]


def pool_application_name(pid: int) -> str:
    """The application_name of a consumer process's pool connections (offset writes)."""
    return f"serversync:run:{CONSUMER}:{socket.gethostname()}:{pid}"[:63]


def process_env(**variables: str) -> dict[str, str]:
    """This process's environment without any serversync, PostgreSQL or OpenTelemetry setting,
    plus `variables`."""
    base = {key: value for key, value in os.environ.items() if not key.startswith(OWN_PREFIXES)}
    return {**base, **variables}


class ServersyncProcess:
    """`python -m consumer ARGS...` with stdout and stderr in one file (nothing else writes
    to stdout for `run` and `ingest-server`)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self._log_file = log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "consumer", *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

    @property
    def pid(self) -> int:
        """The process id (what a consumer writes to sync.consumer_offsets.leader_pid)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """None while running."""
        return self.proc.poll()

    def log(self) -> str:
        """Everything the process wrote so far."""
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM: a graceful stop."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def assert_alive(self) -> None:
        """Fail with the log if the process ended."""
        assert self.proc.poll() is None, (
            f"{self.name} exited with {self.proc.returncode}:\n{self.log()}"
        )

    def memory_kib(self, key: str) -> int:
        """A line of /proc/<pid>/status in KiB (VmRSS: now; VmHWM: the peak so far)."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            name, _, value = line.partition(":")
            if name == key:
                return int(value.split()[0])
        raise AssertionError(f"no {key} in /proc/{self.pid}/status")

    async def wait_exit(self, timeout: float = 10.0) -> int:
        """Wait for the process to end; its return code."""
        await wait_until(
            lambda: self.proc.poll() is not None,
            timeout=timeout,
            what=f"{self.name} (pid {self.pid}) to exit",
        )
        code = self.proc.poll()
        assert code is not None
        return code

    async def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait for the exit; the return code."""
        self.terminate()
        return await self.wait_exit(timeout)

    async def wait_log(self, pattern: str | re.Pattern[str], timeout: float = 10.0) -> str:
        """Wait until the output holds `pattern` (a substring or a regex); the first match.
        Fails at once if the process ended without logging it."""

        def find() -> str | None:
            text = self.log()
            if isinstance(pattern, str):
                return pattern if pattern in text else None
            match = pattern.search(text)
            return match.group(0) if match else None

        found: list[str] = []

        def logged() -> bool:
            # Whether it ended is asked before the log is read: what an ended process logged
            # is all in the file by then.
            ended = self.proc.poll() is not None
            if (hit := find()) is not None:
                found.append(hit)
                return True
            assert not ended, (
                f"{self.name} exited with {self.proc.returncode} before logging {pattern!r}:\n"
                + self.log()
            )
            return False

        await wait_until(logged, timeout=timeout, what=f"{self.name} to log {pattern!r}")
        return found[0]

    async def ops_url(self, timeout: float = 15.0) -> str:
        """The base URL of a consumer's /healthz, /readyz and /metrics (SYNC_HTTP_PORT=0: read
        from the line the process logs at start)."""
        line = await self.wait_log(OPS_URL, timeout)
        match = OPS_URL.search(line)
        assert match is not None
        return match.group(1)

    def close(self) -> None:
        """Kill the process if it still runs, reap it, close the log."""
        self.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        self._log_file.close()


class Processes:
    """Starts serversync processes for one test, with process_env(), `defaults` (FAST_ENV
    unless told) and each start's own variables; as a context manager, kills what still runs at
    the end and prints every log (pytest shows them when a test fails)."""

    def __init__(self, log_dir: Path, defaults: Mapping[str, str] = FAST_ENV) -> None:
        self.log_dir = log_dir
        self.defaults = dict(defaults)
        self.started: list[ServersyncProcess] = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def launch(self, name: str, args: list[str], env: dict[str, str]) -> ServersyncProcess:
        """`serversync ARGS...` with exactly `env`."""
        process = ServersyncProcess(name, args, env, self.log_dir / f"{name}.log")
        self.started.append(process)
        return process

    def start(self, name: str, args: list[str], **env: str) -> ServersyncProcess:
        """`serversync ARGS...` with process_env(), the defaults, and `env` over them."""
        return self.launch(name, args, process_env(**{**self.defaults, **env}))

    def consumer(
        self,
        database_url: str,
        frontend_url: str,
        name: str | None = None,
        *,
        consumer: str = CONSUMER,
        log_format: str | None = "text",
        **env: str,
    ) -> ServersyncProcess:
        """`serversync [--log-format FORMAT] run CONSUMER` (None: the default format, JSON);
        `env` adds or overrides variables (SYNC_BATCH_SIZE="50", ...)."""
        args = ["--log-format", log_format] if log_format else []
        return self.start(
            name or f"consumer-{len(self.started) + 1}",
            [*args, "run", consumer],
            **{"DATABASE_URL": database_url, "FRONTEND_BASE_URL": frontend_url, **env},
        )

    def close(self) -> None:
        """Kill every process still running and print every log."""
        for process in self.started:
            process.close()
        for process in self.started:
            print(f"===== {process.name} (pid {process.pid}, exit {process.returncode}) =====")
            print(process.log())


# -- a process started with conftest's start_cli -------------------------------------------------


@contextlib.asynccontextmanager
async def reaped(process: asyncio.subprocess.Process) -> AsyncIterator[None]:
    """Kill the process if the block leaves it running (a failed test)."""
    try:
        yield
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGKILL)
            await process.wait()
