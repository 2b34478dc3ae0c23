"""JSON answers for serversync's aiohttp servers (the receiver and the admin API), and the log of
what aiohttp itself says about a connection."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from consumer.observability.redact import printable


def error_response(status: int, code: str, message: str, **extra: Any) -> web.Response:
    """A JSON error body: {"error": {"code", "message", ...}}."""
    return web.Response(
        status=status,
        body=orjson.dumps({"error": {"code": code, "message": message, **extra}}),
        content_type="application/json",
    )


def http_error_response(exc: web.HTTPException, code: str) -> web.Response:
    """aiohttp's own 4xx/5xx (no such route, method not allowed, body too large) as a JSON error
    body. The headers the status requires come along: a 405 names the methods the route takes in
    `Allow` (RFC 9110)."""
    response = error_response(exc.status, code, exc.reason)
    if "Allow" in exc.headers:
        response.headers["Allow"] = exc.headers["Allow"]
    return response


def json_response(data: Any, status: int = 200) -> web.Response:
    """A JSON body serialised with orjson."""
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


class ConnectionLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server logger for one of serversync's servers (pass it as the `logger` handler
    argument). aiohttp logs a request its parser refuses (a control character in the request
    line, a header that is not HTTP) as an ERROR with a traceback, the refused bytes quoted in
    it. That is the client's fault, not the server's: it becomes one WARNING line, made
    printable. Anything else aiohttp reports passes unchanged."""

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__(logger, {})

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        """Log like the wrapped logger, a refused request on one line."""
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError) and 400 <= exc.code < 500:
            kwargs.pop("exc_info")
            text = " ".join(printable(f"{exc.message}").split())
            level = min(level, logging.WARNING)
            msg, args = f"{printable(str(msg))}: HTTP {exc.code}: %s", (*args, text)
        super().log(level, msg, *args, **kwargs)


def server_handler_args(name: str) -> Mapping[str, Any]:
    """The `handler_args` of one of serversync's aiohttp Applications: aiohttp's complaints
    about connections go to `name`'s logger through ConnectionLog, and request bodies are never
    inflated. Left to itself aiohttp inflates a gzip, deflate, br or zstd body as it arrives,
    even one the application refuses unread, and refuses a coding it has no library for with a
    plain-text 400; so the bytes stay as sent, and the application refuses a Content-Encoding
    other than identity itself (consumer/receiver/guards.py), in JSON."""
    return {"logger": ConnectionLog(logging.getLogger(name)), "auto_decompress": False}
