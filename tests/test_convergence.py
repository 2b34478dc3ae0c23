"""Both directions converge: two nodes edit the same rows at about the same time, each relays its
changes to the other's receiver, and once both directions are drained both databases hold the
same rows, the same row versions, and nothing travels back to where it came from.

The rule under test (docs/design.md, "Both directions"): a change's version is (hybrid timestamp,
node name); the greater version wins on every node. A local edit's timestamp is
greatest(clock, the row's last version + 1 microsecond), so an edit follows every version its
node has already applied; concurrent edits on two nodes are ordered by time, then node name.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest

from consumer.runtime.worker import ConsumerRuntime
from tests.conftest import (
    fetch_all,
    make_settings,
    running_consumer,
    wait_until,
)
from tests.support.mapped import serve_mapped, with_receiver_schema
from tests.support.waiting import wait_drained

# The consumer that carries each node's changes to the other node's receiver.
CONSUMER = "frontend-sync"
ENTITY = "setting"
KEYS = [f"k{i}" for i in range(5)]
MAPPING = f"""
[entities.{ENTITY}]
table = "public.settings_kv"
key = "id"
deletes = true
"""


@dataclass
class Node:
    """One database that edits the settings and receives the other node's edits."""

    name: str
    dsn: str
    conn: psycopg.AsyncConnection[Any]
    # The consumer that sends this node's changes to the other node.
    sender: ConsumerRuntime


async def _prepare(dsn: str, name: str) -> str:
    await with_receiver_schema(dsn)
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute("SELECT sync.set_node_name(%s)", (name,))
        await conn.execute(
            "CREATE TABLE public.settings_kv (id text PRIMARY KEY, value text NOT NULL, n int)"
        )
        await conn.execute("SELECT sync.track('public.settings_kv', %s, 'id', true)", (ENTITY,))
    return dsn


@contextlib.asynccontextmanager
async def two_nodes(dsns: tuple[str, str], tmp_path: Path) -> AsyncIterator[tuple[Node, Node]]:
    """backend and frontend, each with its receiver (mapped into settings_kv) and a consumer
    that sends its changes to the other's receiver, but none that came from there."""
    mapping = tmp_path / "mapping.toml"
    mapping.write_text(MAPPING)
    backend_dsn = await _prepare(dsns[0], "backend")
    frontend_dsn = await _prepare(dsns[1], "frontend")
    async with (
        serve_mapped(backend_dsn, mapping) as backend_url,
        serve_mapped(frontend_dsn, mapping) as frontend_url,
        running_consumer(
            make_settings(backend_dsn, frontend_url, SYNC_TARGET_NODE="frontend"), CONSUMER
        ) as to_frontend,
        running_consumer(
            make_settings(frontend_dsn, backend_url, SYNC_TARGET_NODE="backend"), CONSUMER
        ) as to_backend,
        await psycopg.AsyncConnection.connect(backend_dsn, autocommit=True) as backend_conn,
        await psycopg.AsyncConnection.connect(frontend_dsn, autocommit=True) as frontend_conn,
    ):
        await _wait_leading(to_frontend, to_backend)
        yield (
            Node("backend", backend_dsn, backend_conn, to_frontend),
            Node("frontend", frontend_dsn, frontend_conn, to_backend),
        )


async def _wait_leading(*runtimes: ConsumerRuntime) -> None:
    await wait_until(
        lambda: all(r.stats.is_leader for r in runtimes), timeout=10, what="both consumers lead"
    )


async def edit(node: Node, rng: random.Random, tag: str) -> None:
    """One random edit in its own transaction: an upsert, an update of a row that may be gone,
    or a delete."""
    key = rng.choice(KEYS)
    choice = rng.random()
    if choice < 0.5:
        await node.conn.execute(
            "INSERT INTO public.settings_kv AS s (id, value, n) VALUES (%s, %s, %s) "
            "ON CONFLICT (id) DO UPDATE SET value = EXCLUDED.value, n = EXCLUDED.n",
            (key, f"{node.name}:{tag}", rng.randrange(1000)),
        )
    elif choice < 0.8:
        await node.conn.execute(
            "UPDATE public.settings_kv SET value = %s, n = coalesce(n, 0) + 1 WHERE id = %s",
            (f"{node.name}:{tag}:u", key),
        )
    else:
        await node.conn.execute("DELETE FROM public.settings_kv WHERE id = %s", (key,))


async def drained(backend: Node, frontend: Node) -> None:
    """Until both directions are drained (tests.support.waiting.wait_drained)."""
    await wait_drained((backend.dsn, CONSUMER), (frontend.dsn, CONSUMER))


async def state(node: Node) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The node's rows and its row versions, in key order."""
    rows = await fetch_all(node.dsn, "SELECT id, value, n FROM public.settings_kv ORDER BY id")
    versions = await fetch_all(
        node.dsn,
        "SELECT entity_id, version_ts, version_node, deleted FROM sync.row_versions "
        "WHERE entity_type = %s ORDER BY entity_id",
        (ENTITY,),
    )
    return rows, versions


async def assert_converged(backend: Node, frontend: Node, where: str) -> None:
    await drained(backend, frontend)
    backend_rows, backend_versions = await state(backend)
    frontend_rows, frontend_versions = await state(frontend)
    assert backend_rows == frontend_rows, where
    assert backend_versions == frontend_versions, where
    # Every live row's value was written by the node its version names.
    live = {key for key, *_ in backend_rows}
    for key, _, _, deleted in backend_versions:
        assert deleted == (key not in live), (where, key)
    for key, value, _ in backend_rows:
        (node_name,) = [n for k, _, n, _ in backend_versions if k == key]
        assert value.split(":")[0] == node_name, (where, key, value, node_name)


async def test_concurrent_edits_on_both_nodes_converge(
    node_dsns: tuple[str, str], tmp_path: Path
) -> None:
    rng = random.Random(20261127)
    async with two_nodes(node_dsns, tmp_path) as (backend, frontend):
        for batch in range(12):
            for step in range(25):
                tag = f"{batch}.{step}"
                # Both nodes edit at the same moment, while the consumers deliver what came
                # before: the receivers apply concurrently with the operators' edits.
                await asyncio.gather(
                    *(edit(backend, rng, tag) for _ in range(rng.randint(0, 2))),
                    *(edit(frontend, rng, tag) for _ in range(rng.randint(0, 2))),
                )
            await assert_converged(backend, frontend, f"after batch {batch}")


async def test_an_applied_change_never_travels_back(
    node_dsns: tuple[str, str], tmp_path: Path
) -> None:
    async with two_nodes(node_dsns, tmp_path) as (backend, frontend):
        await frontend.conn.execute(
            "INSERT INTO public.settings_kv (id, value, n) VALUES ('k0', 'frontend:only', 1)"
        )
        await assert_converged(backend, frontend, "one edit")
        # The backend relayed the applied change with its origin, and its consumer passed it
        # without sending it back: the frontend's outbox holds its own edit only.
        assert await fetch_all(
            backend.dsn, "SELECT origin FROM sync.events_outbox WHERE entity_id = 'k0'"
        ) == [("frontend",)]
        assert await fetch_all(
            frontend.dsn, "SELECT origin FROM sync.events_outbox WHERE entity_id = 'k0'"
        ) == [(None,)]
        # The backend's consumer passed over the applied change instead of posting it back.
        assert (frontend.sender.stats.delivered_events, frontend.sender.stats.skipped_events) == (
            1,
            0,
        )
        assert (backend.sender.stats.delivered_events, backend.sender.stats.skipped_events) == (
            0,
            1,
        )


@pytest.mark.parametrize("first", ["backend", "frontend"])
async def test_a_tie_in_time_is_broken_by_node_name(
    node_dsns: tuple[str, str], tmp_path: Path, first: str
) -> None:
    """Two edits of one row with the same timestamp: the greater node name wins on both nodes,
    whichever arrives first."""
    async with two_nodes(node_dsns, tmp_path) as (backend, frontend):
        nodes = {"backend": backend, "frontend": frontend}
        same = "2030-01-01T00:00:00+00:00"
        for node in (nodes[first], nodes["frontend" if first == "backend" else "backend"]):
            # A version already in the future makes the local edit's hybrid clock land exactly
            # one microsecond after it, on both nodes.
            await node.conn.execute(
                "INSERT INTO sync.row_versions VALUES (%s, 'k0', %s::timestamptz - interval "
                "'1 microsecond', 'aaa', true)",
                (ENTITY, same),
            )
        await asyncio.gather(
            backend.conn.execute("INSERT INTO public.settings_kv VALUES ('k0', 'backend:tie', 1)"),
            frontend.conn.execute(
                "INSERT INTO public.settings_kv VALUES ('k0', 'frontend:tie', 2)"
            ),
        )
        await assert_converged(backend, frontend, "tie")
        rows, versions = await state(backend)
        assert rows == [("k0", "frontend:tie", 2)]
        assert [(node_name, deleted) for _, _, node_name, deleted in versions] == [
            ("frontend", False)
        ]
