"""The admin API of a consumer process (aiohttp): the dead-letter queue over HTTP.

Mounted on the process's HTTP port (opshttp) only when SYNC_ADMIN_TOKEN is set. Every /api/
route wants `Authorization: Bearer <SYNC_ADMIN_TOKEN>`; errors leave as
{"error": {"code": "SYS_DLQ_...", "message": ...}}.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable

import psycopg
from aiohttp import web
from aiohttp.typedefs import Middleware

from consumer.observability.redact import printable
from consumer.ops.deadletters import DeadLetters
from consumer.store.dlq import (
    DEFAULT_PAGE_SIZE,
    DlqConflictError,
    DlqError,
    DlqNotFoundError,
    DlqValidationError,
)
from consumer.wire.httpjson import error_response, http_error_response, json_response

log = logging.getLogger("serversync.adminapi")

SERVICE_KEY = web.AppKey("dead_letters", DeadLetters)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# The admin API's error codes (docs/admin-api.md): stable names a client may branch on.
NOT_FOUND = "SYS_DLQ_NOT_FOUND"
VALIDATION_ERROR = "SYS_DLQ_VALIDATION_ERROR"
CONFLICT = "SYS_DLQ_CONFLICT"
INTERNAL_ERROR = "SYS_DLQ_INTERNAL_ERROR"
UNAUTHORIZED = "SYS_DLQ_UNAUTHORIZED"

_ERRORS: list[tuple[type[DlqError], int, str]] = [
    (DlqNotFoundError, 404, NOT_FOUND),
    (DlqValidationError, 400, VALIDATION_ERROR),
    (DlqConflictError, 409, CONFLICT),
]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON with a SYS_DLQ_ code, never as HTML or a traceback."""
    try:
        return await handler(request)
    except DlqError as exc:
        for kind, status, code in _ERRORS:
            if isinstance(exc, kind):
                return error_response(status, code, str(exc))
        raise
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = NOT_FOUND if exc.status == 404 else f"HTTP_{exc.status}"
        return http_error_response(exc, code)
    except psycopg.OperationalError as exc:
        log.warning(
            "admin API: database unavailable in %s %s: %s",
            request.method,
            printable(request.path),
            exc,
        )
        return error_response(500, INTERNAL_ERROR, "database unavailable; retry later")
    except Exception:
        log.exception(
            "admin API: unhandled error in %s %s", request.method, printable(request.path)
        )
        return error_response(500, INTERNAL_ERROR, "internal error")


def bearer_auth(token: str) -> Middleware:
    """Refuse (401) every /api/ request without `Authorization: Bearer <token>`."""
    expected = token.encode()

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path.startswith("/api/"):
            scheme, _, given = request.headers.get("Authorization", "").partition(" ")
            # aiohttp hands bytes that are not UTF-8 over as lone surrogates: encoded back as
            # they came, such a header is only a wrong token, never an error.
            sent = given.strip().encode("utf-8", "surrogateescape")
            # compare_digest: the time taken must not tell how much of a guess was right.
            if scheme.lower() != "bearer" or not hmac.compare_digest(sent, expected):
                log.warning(
                    "admin API: refused %s %s from %s: missing or wrong bearer token",
                    request.method,
                    printable(request.path),
                    request.remote,
                )
                response = error_response(
                    401, UNAUTHORIZED, "missing or wrong bearer token (SYNC_ADMIN_TOKEN)"
                )
                response.headers["WWW-Authenticate"] = 'Bearer realm="serversync"'
                return response
        return await handler(request)

    return check


def _int_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise DlqValidationError(f"{name} must be an integer, not {raw[:40]!r}") from None


async def list_messages(request: web.Request) -> web.Response:
    """GET /api/v1/dlq/{consumer}?page=&page_size=&status= : a page, newest first."""
    page = await request.app[SERVICE_KEY].list_messages(
        request.match_info["consumer"],
        status=request.query.get("status"),
        page=_int_param(request, "page", 1),
        page_size=_int_param(request, "page_size", DEFAULT_PAGE_SIZE),
    )
    return json_response(page.to_dict())


async def get_message(request: web.Request) -> web.Response:
    """GET /api/v1/dlq/messages/{id}."""
    message = await request.app[SERVICE_KEY].get(request.match_info["id"])
    return json_response(message.to_dict())


async def retry_message(request: web.Request) -> web.Response:
    """POST /api/v1/dlq/messages/{id}/retry: deliver the event again; 200 whether or not it got
    through (the status says which), 409 for a RESOLVED or DEAD message."""
    result = await request.app[SERVICE_KEY].retry(request.match_info["id"])
    m = result.message
    log.log(
        logging.INFO if result.delivered else logging.WARNING,
        "admin API: retry of dead letter %s (%s seq %d): %s",
        m.id,
        m.consumer,
        m.seq,
        result.describe(),
    )
    return json_response(
        {
            "id": str(result.message.id),
            "status": result.message.status,
            "message": result.describe(),
        }
    )


async def delete_message(request: web.Request) -> web.Response:
    """DELETE /api/v1/dlq/messages/{id}."""
    message_id = request.match_info["id"]
    await request.app[SERVICE_KEY].delete(message_id)
    log.info("admin API: deleted dead letter %s", message_id)
    return json_response({"success": True, "message": f"dead letter {message_id} deleted"})


async def retry_all(request: web.Request) -> web.Response:
    """POST /api/v1/dlq/{consumer}/retry-all: every retryable message, in pages of 100."""
    consumer = request.match_info["consumer"]
    result = await request.app[SERVICE_KEY].retry_all(consumer)
    log.log(
        logging.WARNING if result.failed else logging.INFO,
        "admin API: retry-all of %s: %s",
        consumer,
        result.describe(),
    )
    return json_response(
        {
            "retried": result.retried,
            "succeeded": result.succeeded,
            "failed": result.failed,
            "message": result.describe(),
        }
    )


def add_dlq_routes(app: web.Application, service: DeadLetters) -> None:
    """Mount the DLQ routes on `app` (whose middlewares must include json_errors and
    bearer_auth)."""
    app[SERVICE_KEY] = service
    # /messages/ first: else "messages" would be taken for a consumer's name.
    app.router.add_get("/api/v1/dlq/messages/{id}", get_message)
    app.router.add_post("/api/v1/dlq/messages/{id}/retry", retry_message)
    app.router.add_delete("/api/v1/dlq/messages/{id}", delete_message)
    app.router.add_get("/api/v1/dlq/{consumer}", list_messages)
    app.router.add_post("/api/v1/dlq/{consumer}/retry-all", retry_all)
