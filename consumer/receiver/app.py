"""The reference receiver's HTTP side (aiohttp): POST /api/ingest/sync and health."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import psycopg
from aiohttp import web
from aiohttp.typedefs import Middleware
from opentelemetry import propagate
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from consumer import signing
from consumer.httpjson import error_response, json_response
from consumer.instruments import tracer
from consumer.receiver.models import INGEST_REQUEST, describe, parse_body
from consumer.receiver.recordings import UPLOAD_PATH, RecordingFiles, add_routes
from consumer.receiver.store import EntityStore

log = logging.getLogger("serversync.receiver")

STORE_KEY = web.AppKey("store", EntityStore)
MAX_BODY_KEY = web.AppKey("max_body_bytes", int)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as JSON, never as an HTML page or a traceback."""
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_KEY]
        return error_response(413, "INGEST_TOO_LARGE", f"request body over {limit} bytes")
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc.status, f"HTTP_{exc.status}", exc.reason)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(500, "INGEST_INTERNAL_ERROR", "internal error")


async def ingest_sync(request: web.Request) -> web.Response:
    """Validate the whole request, then apply it in one transaction (all or nothing)."""
    if request.content_type != "application/json":
        return error_response(
            415, "INGEST_UNSUPPORTED_MEDIA_TYPE", "Content-Type must be application/json"
        )
    body = await request.read()
    try:
        parsed = parse_body(body)
    except ValueError as exc:
        return error_response(400, "INGEST_BAD_JSON", f"body is not JSON: {exc}")
    try:
        ingest = INGEST_REQUEST.validate_python(parsed)
    except ValidationError as exc:
        field, message = describe(exc)
        return error_response(422, "INGEST_VALIDATION_ERROR", f"{field}: {message}", field=field)
    received = len(ingest["entries"])
    if received == 0:
        return json_response({"ok": True, "received": 0, "applied": 0, "stale": 0})
    try:
        applied = await request.app[STORE_KEY].apply(body)
    except psycopg.DataError as exc:
        # An entry PostgreSQL refuses ("\u0000" or a lone surrogate in a payload, a date out of
        # range): the sender's fault, and its detail says which part of the entry.
        reason = exc.diag.message_primary or str(exc)
        if exc.diag.message_detail:
            reason += f" ({exc.diag.message_detail})"
        return error_response(422, "INGEST_VALIDATION_ERROR", f"entries: {reason}")
    except psycopg.OperationalError as exc:
        log.warning("receiver database unavailable: %s", exc)
        return error_response(503, "INGEST_UNAVAILABLE", "database unavailable; retry later")
    log.debug(
        "applied %d of %d entries (key %s)",
        applied,
        received,
        request.headers.get("Idempotency-Key", "-"),
    )
    return json_response(
        {"ok": True, "received": received, "applied": applied, "stale": received - applied}
    )


async def healthz(request: web.Request) -> web.Response:
    """The process is alive."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """The receiver's database answers."""
    try:
        await request.app[STORE_KEY].ping()
    except psycopg.Error as exc:
        return json_response({"status": "unavailable", "database": str(exc).strip()}, status=503)
    return json_response({"status": "ready"})


@web.middleware
async def traced(request: web.Request, handler: Handler) -> web.StreamResponse:
    """A server span per request, a child of the caller's span when the request carries W3C
    trace context: a consumer's batch and the receiver's work on it share one trace."""
    with tracer.start_as_current_span(
        f"{request.method} {request.path}",
        context=propagate.extract(request.headers),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.path},
    ) as span:
        response = await handler(request)
        span.set_attribute("http.response.status_code", response.status)
        return response


def signature_check(secret: str) -> Middleware:
    """Refuse (401, nothing written) ingest requests not signed with the shared secret."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        # A recording upload is streamed and checks its own signature, over its digests.
        if request.path.startswith("/api/ingest/") and request.path != UPLOAD_PATH:
            body = await request.read()  # aiohttp keeps it for the handler
            problem = signing.verify(
                secret,
                request.headers.get(signing.TIMESTAMP_HEADER),
                request.headers.get(signing.SIGNATURE_HEADER),
                body,
            )
            if problem is not None:
                log.warning("refused unsigned or badly signed %s: %s", request.path, problem)
                return error_response(401, "INGEST_UNAUTHORIZED", problem)
        return await handler(request)

    return check


def build_app(
    store: EntityStore,
    *,
    max_body_bytes: int,
    shared_secret: str | None = None,
    recordings: RecordingFiles | None = None,
) -> web.Application:
    """The receiver's aiohttp application; without `shared_secret` it accepts unsigned requests
    (the CLI allows that only with --insecure). With `recordings` it also takes recording
    uploads and serves them."""
    middlewares: list[Middleware] = [traced, json_errors]
    if shared_secret:
        middlewares.append(signature_check(shared_secret))
    app = web.Application(client_max_size=max_body_bytes, middlewares=middlewares)
    app[STORE_KEY] = store
    app[MAX_BODY_KEY] = max_body_bytes
    app.router.add_post("/api/ingest/sync", ingest_sync)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if recordings is not None:
        add_routes(app, recordings, shared_secret)
    return app
