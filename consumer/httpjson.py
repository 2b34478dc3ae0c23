"""JSON answers for serversync's aiohttp servers (the receiver and the admin API)."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


def error_response(status: int, code: str, message: str, **extra: Any) -> web.Response:
    """A JSON error body: {"error": {"code", "message", ...}}."""
    return web.Response(
        status=status,
        body=orjson.dumps({"error": {"code": code, "message": message, **extra}}),
        content_type="application/json",
    )


def json_response(data: Any, status: int = 200) -> web.Response:
    """A JSON body serialised with orjson."""
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")
