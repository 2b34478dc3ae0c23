"""Named fault-injection points, for crash tests of real processes.

`SERVERSYNC_FAILPOINTS="recording-upload.after-upload=kill"` makes the process SIGKILL itself the
moment it reaches that point, the way FreeBSD's fail(9) or TiKV's fail-rs let a test crash a
program at an exact step. Unset (always, in production) a failpoint costs one dict lookup.
"""

from __future__ import annotations

import functools
import os
import signal

ENV = "SERVERSYNC_FAILPOINTS"
_ACTIONS = ("kill",)


@functools.cache
def _configured() -> dict[str, str]:
    points: dict[str, str] = {}
    for item in os.environ.get(ENV, "").split(","):
        name, _, action = item.strip().partition("=")
        if name and action in _ACTIONS:
            points[name] = action
    return points


def reach(name: str) -> None:
    """Act out the failpoint `name` if it is configured (kill: SIGKILL this process)."""
    if _configured().get(name) == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
