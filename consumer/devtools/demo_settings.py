"""The demo's other direction: the voicebot's settings, edited in the frontend's database, applied
into the backend's tables by a second receiver, and never sent back.

Both databases are nodes (`backend`, `frontend`) with the five settings tables tracked both ways,
as deploy/consumers.toml.example and deploy/voicebot-mapping.toml describe a real deployment:
the declared consumer settings-sync runs on the frontend's database and posts to an ingest-server
on the backend side that maps the entries into the backend's tables; frontend-sync, which carries
the backend's changes to the frontend, has the frontend as its target node, so the backend's
relay of an applied change (origin frontend) is passed over, not echoed.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import psycopg

from consumer.devtools.demo_processes import DemoCheckFailed
from consumer.devtools.demo_steps import SETTINGS_CONSUMER, DemoRun, fetch_one, say

# The voicebot's settings tables (sql/examples/voicebot.sql) and their entity types.
SETTINGS_TABLES = {
    "registered_number": "public.registered_numbers",
    "routing_rule": "public.routing_rules",
    "ivr_flow": "public.ivr_flows",
    "schedule": "public.schedules",
    "announcement": "public.announcements",
}
# The variable settings-sync's declaration names for its secret (secret_env).
SETTINGS_SECRET_ENV = "SETTINGS_SYNC_SECRET"  # noqa: S105 (a variable name, not a secret)
# deploy/ beside the package in a source checkout; a wheel does not ship it (mapping_file).
_CHECKOUT_MAPPING = Path(__file__).resolve().parents[2] / "deploy" / "voicebot-mapping.toml"


async def name_and_track(dsn: str, node: str) -> None:
    """Name the database's node and track the settings tables both ways: what `serversync
    migrate --node NODE` and `sync.track(table, type, 'id', true)` do on a real node.

    --with-examples tracked them one way already; tracking again regenerates their relay."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute("SELECT sync.set_node_name(%s)", (node,))
        for entity_type, table in SETTINGS_TABLES.items():
            await conn.execute(
                "SELECT sync.track(%s::regclass, %s, 'id', true)", (table, entity_type)
            )


def mapping_file(workdir: Path) -> Path:
    """deploy/voicebot-mapping.toml of the checkout; where serversync runs from a wheel (which
    does not ship deploy/), the same mapping written into `workdir`."""
    if _CHECKOUT_MAPPING.is_file():
        return _CHECKOUT_MAPPING
    path = workdir / "voicebot-mapping.toml"
    path.write_text(
        "".join(
            f'[entities.{entity_type}]\ntable = "{table}"\nkey = "id"\ndeletes = true\n\n'
            for entity_type, table in SETTINGS_TABLES.items()
        )
    )
    return path


def consumers_file(workdir: Path, backend_url: str) -> Path:
    """The SYNC_CONSUMERS_FILE declaring settings-sync (deploy/consumers.toml.example's)."""
    path = workdir / "consumers.toml"
    types = ", ".join(f'"{entity_type}"' for entity_type in SETTINGS_TABLES)
    path.write_text(
        f"[consumers.{SETTINGS_CONSUMER}]\n"
        'sink = "json"\n'
        f'url = "{backend_url}"\n'
        f'secret_env = "{SETTINGS_SECRET_ENV}"\n'
        f"entity_types = [{types}]\n"
        'target_node = "backend"\n'
    )
    return path


async def _skipped(http: aiohttp.ClientSession, metrics_url: str, consumer: str) -> float:
    """serversync_events_total{outcome="skipped"} of `consumer`, from its process's /metrics."""
    async with http.get(metrics_url) as response:
        text = await response.text()
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("serversync_events_total{")
            and 'outcome="skipped"' in line
            and f'consumer="{consumer}"' in line
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _version(row: Any) -> str:
    return f"({row[0].isoformat(timespec='microseconds')}, {row[1]})" if row else "none"


async def settings_edit(run: DemoRun, frontend_sync_metrics: str) -> None:
    """An operator adds a registered number in the frontend's database: timed until it is in the
    backend's registered_numbers, then shown not to come back."""
    say(
        "an operator adds a registered number in the frontend's database; settings-sync "
        "carries it to the backend"
    )
    key = str(uuid.uuid4())
    phone = f"0120{uuid.uuid4().int % 1_000_000:06d}"
    started = time.monotonic()
    await run.frontend.execute(
        "INSERT INTO registered_numbers (id, phone_number, label, category) "
        "VALUES (%s, %s, 'demo: front desk', 'vip')",
        (key, phone),
    )

    async def arrived() -> bool:
        return (
            await fetch_one(run.backend, "SELECT 1 FROM registered_numbers WHERE id = %s", (key,))
            is not None
        )

    await run.processes.wait_for(arrived, 10, f"registered_number {key} at the backend")
    latency = (time.monotonic() - started) * 1000
    say(f"registered number {phone} is in the backend's registered_numbers in {latency:.1f} ms")

    row = await fetch_one(
        run.backend,
        "SELECT phone_number, label, category FROM registered_numbers WHERE id = %s",
        (key,),
    )
    if tuple(row) != (phone, "demo: front desk", "vip"):
        raise DemoCheckFailed(f"registered_number {key}: the backend's row is {tuple(row)!r}")
    version_sql = (
        "SELECT version_ts, version_node FROM sync.row_versions "
        "WHERE entity_type = 'registered_number' AND entity_id = %s"
    )
    here = await fetch_one(run.frontend, version_sql, (key,))
    there = await fetch_one(run.backend, version_sql, (key,))
    if here is None or tuple(here) != tuple(there or ()):
        raise DemoCheckFailed(
            f"registered_number {key}: version {_version(here)} at the frontend, "
            f"{_version(there)} at the backend"
        )
    print(f"    the same row and version {_version(here)} on both sides")
    await _nothing_came_back(run, key, frontend_sync_metrics)


async def _nothing_came_back(run: DemoRun, key: str, frontend_sync_metrics: str) -> None:
    """The backend relays the applied change onward with origin frontend; frontend-sync (target
    node frontend) passes it over once its offset is past it, so nothing reaches the frontend."""
    relayed = await fetch_one(
        run.backend,
        "SELECT seq, origin FROM sync.events_outbox "
        "WHERE entity_type = 'registered_number' AND entity_id = %s ORDER BY seq DESC LIMIT 1",
        (key,),
    )
    if relayed is None or relayed[1] != "frontend":
        raise DemoCheckFailed(
            f"registered_number {key}: the backend's outbox has {relayed!r}, "
            "not the change with origin frontend"
        )
    seq = int(relayed[0])

    async def passed() -> bool:
        # Positions are (txid, seq): frontend-sync has settled everything up to its position.
        row = await fetch_one(
            run.backend,
            "SELECT (o.last_txid, o.last_seq) >= (e.txid, e.seq) "
            "FROM sync.consumer_offsets AS o, sync.events_outbox AS e "
            "WHERE o.consumer = 'frontend-sync' AND e.seq = %s",
            (seq,),
        )
        return bool(row and row[0])

    await run.processes.wait_for(passed, 10, "frontend-sync to pass the backend's relay")
    skipped = await _skipped(run.http, frontend_sync_metrics, "frontend-sync")
    received = await fetch_one(
        run.frontend,
        "SELECT count(*) FROM ingest.entities WHERE entity_type = 'registered_number'",
    )
    outbox = await fetch_one(
        run.frontend,
        "SELECT count(*), count(origin) FROM sync.events_outbox "
        "WHERE entity_type = 'registered_number' AND entity_id = %s",
        (key,),
    )
    if skipped < 1 or received[0] != 0 or tuple(outbox) != (1, 0):
        raise DemoCheckFailed(
            f"registered_number {key} came back: frontend-sync skipped {skipped:g}, the "
            f"frontend's receiver holds {received[0]} registered_number(s), its outbox "
            f"{outbox[0]} row(s) of it ({outbox[1]} with an origin)"
        )
    print(
        f"    backend relayed it onward as seq {seq} with origin=frontend; frontend-sync "
        f"(target node frontend) passed it over ({skipped:g} skipped)"
    )
    say(
        "nothing came back: the frontend's receiver has no registered_number, its outbox "
        "holds only the operator's edit"
    )


def metrics_url(port: int) -> str:
    """A consumer process's /metrics on its SYNC_HTTP_PORT."""
    return f"http://127.0.0.1:{port}/metrics"
