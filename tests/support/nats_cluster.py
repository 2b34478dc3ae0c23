"""A real three-node NATS JetStream cluster on loopback for the tests, from Debian's nats-server
(consumer/devtools/nats_cluster.py starts it; the bench and the demo start theirs from there):
skipped without a nats-server binary, killed at the end of the test, its nodes' logs printed
(pytest shows them when a test fails).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from consumer.devtools.nats_cluster import (
    INSTALL_HINT,
    NatsCluster,
    Node,
    StoredMessage,
    connected,
    nats_server_binary,
    running_cluster,
)

__all__ = [
    "NatsCluster",
    "Node",
    "StoredMessage",
    "connected",
    "nats_cluster",
    "nats_server_binary",
    "require_nats_server",
]

CLUSTER_NAME = "serversync-test"


def require_nats_server() -> str:
    """The nats-server binary, or skip the test saying how to get one."""
    binary = nats_server_binary()
    if binary is None:
        pytest.skip(f"no nats-server binary ({INSTALL_HINT}; .ci/run installs it)")
    return binary


@contextlib.asynccontextmanager
async def nats_cluster(
    root: Path,
    *,
    max_payload: int = 1024 * 1024,
    size: int = 3,
    extra: str = "",
    credentials: dict[str, Any] | None = None,
) -> AsyncIterator[NatsCluster]:
    """A running cluster of `size` nodes under `root` (skips without nats-server); killed at
    the end, whatever the test did to it."""
    async with running_cluster(
        require_nats_server(),
        root / "nats",
        show_logs=True,
        max_payload=max_payload,
        size=size,
        extra=extra,
        credentials=credentials or {},
        cluster_name=CLUSTER_NAME,
    ) as cluster:
        yield cluster
