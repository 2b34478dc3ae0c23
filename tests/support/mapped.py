"""The reference receiver in its mapped mode (INGEST_MAPPING_FILE) on loopback, the entries a
node with a name sends it, and what to read back from the receiving database."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psycopg

from consumer.app.wiring import open_pool
from consumer.receiver.app import build_app
from consumer.receiver.mapping import read_mapping, resolve
from consumer.receiver.store import EntityStore
from consumer.receiver.tables import TableWriter
from consumer.store import migrations
from tests.conftest import ROOT, fetch_all, fetch_value, serve_app

INGEST = "/api/ingest/sync"
VOICEBOT_MAPPING = ROOT / "deploy" / "voicebot-mapping.toml"
T1 = "2026-03-01T10:00:00.000001+00:00"
T2 = "2026-03-01T10:00:00.000002+00:00"
T3 = "2026-03-01T10:00:00.000003+00:00"


async def with_receiver_schema(dsn: str) -> str:
    """`dsn` (a backend database: serversync's schema and the voicebot tables) with the
    receiver's own schema too, as `serversync ingest-server` migrates it."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await migrations.migrate(conn, ["receiver"])
    return dsn


@contextlib.asynccontextmanager
async def serve_mapped(dsn: str, mapping: Path = VOICEBOT_MAPPING) -> AsyncIterator[str]:
    """The reference receiver with `mapping` checked against `dsn`; yields its base URL."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        tables = TableWriter(await resolve(conn, read_mapping(mapping)))
    async with open_pool(dsn, "test-ingest", max_size=4) as pool:
        app = build_app(EntityStore(pool, tables), max_body_bytes=1024 * 1024)
        async with serve_app(app) as url:
            yield url


def entry(
    entity_type: str,
    entity_id: str,
    payload: dict[str, Any],
    *,
    op: str = "upsert",
    created_at: str | None = T1,
    origin: str | None = "frontend",
    seq: int = 1,
) -> dict[str, Any]:
    """One wire entry as a node with a name sends it."""
    item: dict[str, Any] = {
        "entityType": entity_type,
        "entityId": entity_id,
        "op": op,
        "seq": seq,
        "payload": payload,
    }
    if created_at is not None:
        item["createdAt"] = created_at
    if origin is not None:
        item["origin"] = origin
    return item


async def post_body(url: str, body: str) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    """POST a body as it is; (status, JSON answer, headers)."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + INGEST, data=body, headers={"Content-Type": "application/json"}) as r,
    ):
        return r.status, orjson.loads(await r.read()), r.headers


async def post(url: str, *entries: dict[str, Any]) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    """POST the entries; (status, JSON answer, headers)."""
    # json, not orjson: a payload may hold an integer wider than 64 bits.
    return await post_body(url, json.dumps({"entries": list(entries)}))


def new_id() -> str:
    """A fresh key of a voicebot table."""
    return str(uuid.uuid4())


def number_row(key: str, label: str, phone: str = "0312345678") -> dict[str, Any]:
    """A whole registered_numbers row as its relay sends it."""
    return {"id": key, "phone_number": phone, "label": label, "category": "general"}


async def label_of(dsn: str, key: str) -> Any:
    """registered_numbers.label of the row `key`, or None when there is no such row."""
    return await fetch_value(dsn, "SELECT label FROM registered_numbers WHERE id = %s", (key,))


async def outbox_of(dsn: str, key: str) -> list[tuple[Any, ...]]:
    """(op, created_at, origin) of the outbox rows of one entity, in order."""
    return await fetch_all(
        dsn,
        "SELECT op, created_at, origin FROM sync.events_outbox WHERE entity_id = %s ORDER BY seq",
        (key,),
    )


async def track_both_ways(dsn: str) -> None:
    """Name the receiving node and track registered_numbers both ways there."""
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
    async with conn:
        await conn.execute("SELECT sync.set_node_name('backend')")
        await conn.execute(
            "SELECT sync.track('public.registered_numbers', 'registered_number', 'id', true)"
        )
