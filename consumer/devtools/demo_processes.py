"""The demo's serversync processes: started with their output in log files, watched while the
demo waits, stopped at the end."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path


class DemoCheckFailed(Exception):
    """A check of the demo did not hold; the message says which, in one line."""


@dataclass
class DemoProcesses:
    """The demo's serversync processes, their logs in `workdir`, and waits that stop early,
    with the reason, when one of them has exited."""

    workdir: Path
    running: dict[str, asyncio.subprocess.Process] = field(default_factory=dict)

    def log(self, name: str) -> Path:
        """Where a process's output goes."""
        return self.workdir / f"{name}.log"

    async def spawn(self, name: str, args: list[str], env: dict[str, str]) -> None:
        """Start `python -m consumer ARGS` with its output in its log."""
        with self.log(name).open("wb") as handle:
            self.running[name] = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "consumer",
                "--log-format",
                "text",
                *args,
                env=env,
                stdout=handle,
                stderr=handle,
            )

    def check(self) -> None:
        """Fail, with the last line it logged, if a process has exited."""
        for name, process in self.running.items():
            if process.returncode is not None:
                lines = self.log(name).read_text(errors="replace").strip().splitlines()
                last = lines[-1] if lines else "no output"
                raise DemoCheckFailed(f"{name} exited with code {process.returncode}: {last}")

    async def wait_for(
        self,
        check: Callable[[], Awaitable[bool]],
        timeout: float,
        what: str,
        *,
        interval: float = 0.005,
    ) -> None:
        """Poll `check` every `interval` seconds until it is true; fail on timeout or when a
        process has exited. The default suits the timed waits (their milliseconds are shown);
        a wait for processes to start polls less often, leaving the CPU to their start."""
        deadline = time.monotonic() + timeout
        while not await check():
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            await asyncio.sleep(interval)

    async def stop(self, names: list[str]) -> None:
        """SIGTERM, and SIGKILL whatever has not stopped 10 s later."""
        chosen = [self.running[name] for name in names if name in self.running]
        for process in chosen:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        for process in chosen:
            try:
                await asyncio.wait_for(process.wait(), timeout=10)
            except TimeoutError:
                process.kill()
                await process.wait()
