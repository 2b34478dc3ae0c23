"""The reference receiver's HTTP side (aiohttp): POST /api/ingest/sync and health."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import psycopg
from aiohttp import hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware
from opentelemetry import propagate
from opentelemetry.trace import SpanKind
from pydantic import ValidationError

from consumer.observability.instruments import tracer
from consumer.observability.redact import printable
from consumer.receiver.guards import answer_expectation, refusal_before_body
from consumer.receiver.models import (
    INGEST_REQUEST,
    Entry,
    describe,
    parse_body,
    quick_count,
)
from consumer.receiver.store import EntityStore
from consumer.receiver.tables import EntryRefused
from consumer.receiver.uploads import RecordingFiles, add_routes
from consumer.wire import signing
from consumer.wire.contract import (
    IDEMPOTENCY_KEY_HEADER,
    INGEST_PREFIX,
    RECORDING_UPLOAD_PATH,
    SIGNATURE_HEADER,
    SYNC_PATH,
    TIMESTAMP_HEADER,
)
from consumer.wire.httpjson import (
    error_response,
    http_error_response,
    json_response,
    server_handler_args,
)

log = logging.getLogger("serversync.receiver")

STORE_KEY = web.AppKey("store", EntityStore)
# A mapped apply that met a local edit in progress (a lock not granted within its lock timeout),
# a deadlock, or a serialization failure: retried by the sender after ROW_BUSY_RETRY_AFTER_SEC.
ROW_BUSY = (
    psycopg.errors.LockNotAvailable,
    psycopg.errors.DeadlockDetected,
    psycopg.errors.SerializationFailure,
)
ROW_BUSY_RETRY_AFTER_SEC = 1
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
        return http_error_response(exc, f"HTTP_{exc.status}")
    except ConnectionResetError:
        # The client went away mid-body: nothing was applied, and the answer reaches no one.
        log.info("%s %s: the client disconnected mid-body", request.method, printable(request.path))
        return error_response(400, "INGEST_INCOMPLETE_BODY", "the client disconnected mid-body")
    except HttpProcessingError as exc:
        # A body aiohttp cannot read to its end (a broken chunked encoding, ...).
        reason = " ".join(printable(exc.message).split())
        log.info("%s %s: unreadable body: %s", request.method, printable(request.path), reason)
        return error_response(400, "INGEST_BAD_BODY", f"unreadable body: {reason}")
    except Exception:
        log.exception("unhandled error in %s %s", request.method, printable(request.path))
        return error_response(500, "INGEST_INTERNAL_ERROR", "internal error")


async def ingest_sync(request: web.Request) -> web.Response:
    """Validate the whole request, then apply it in one transaction (all or nothing)."""
    if request.content_type != "application/json":
        return error_response(
            415, "INGEST_UNSUPPORTED_MEDIA_TYPE", "Content-Type must be application/json"
        )
    body = await request.read()
    store = request.app[STORE_KEY]
    # A store that reads only the body takes a body the quick check vouches for as it is.
    received = None if store.reads_entries else quick_count(body)
    entries: list[Entry] = []
    if received is None:
        try:
            parsed = parse_body(body)
        except ValueError as exc:
            return error_response(400, "INGEST_BAD_JSON", f"body is not JSON: {exc}")
        try:
            entries = INGEST_REQUEST.validate_python(parsed)["entries"]
        except ValidationError as exc:
            field, message = describe(exc)
            return error_response(
                422, "INGEST_VALIDATION_ERROR", f"{field}: {message}", field=field
            )
        received = len(entries)
    if received == 0:
        return json_response({"ok": True, "received": 0, "applied": 0, "stale": 0})
    try:
        applied = await store.apply(body, entries)
    except EntryRefused as exc:
        # A mapped entry without its version, a sweep of a mapped type, or an entry its table
        # refuses: the sender's bisection parks just that entry.
        return error_response(422, "INGEST_VALIDATION_ERROR", str(exc), field=exc.field)
    except ROW_BUSY as exc:
        # A local transaction holds a row this request writes (lock_timeout), or two
        # transactions crossed: the receiver yields, and the sender retries the same batch.
        log.info("yielded to a concurrent transaction: %s", exc.diag.message_primary or exc)
        response = error_response(
            503, "INGEST_BUSY", "rows are being changed by another transaction; retry"
        )
        response.headers[hdrs.RETRY_AFTER] = str(ROW_BUSY_RETRY_AFTER_SEC)
        return response
    except psycopg.errors.ForeignKeyViolation as exc:
        # A mapped row refers to one that has not arrived yet (a batch still in flight, an
        # entity type applied later): the sender retries; if it never arrives, the stream stops
        # loudly (failing) rather than parking data that is fine.
        log.info("a referenced row is not there yet: %s", exc.diag.message_detail or exc)
        response = error_response(
            503, "INGEST_BUSY", "an entry refers to a row that has not arrived yet; retry"
        )
        response.headers[hdrs.RETRY_AFTER] = str(ROW_BUSY_RETRY_AFTER_SEC)
        return response
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
        printable(request.headers.get(IDEMPOTENCY_KEY_HEADER, "-"))[:200],
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


# How soon a client turned away because too many bodies are being read may try again (a read
# ends within its deadline; an upload slot, upload_limits.BUSY_RETRY_AFTER_SEC, takes longer).
BODIES_BUSY_RETRY_AFTER_SEC = 1


@dataclass
class BodyReads:
    """How bodies of /api/ingest/ requests are read: at most `max_concurrent` at once (one more
    is answered 503 with Retry-After), each whole within `idle_timeout` + its declared size /
    `min_rate` (else 408). Well-formed signature headers cost a stranger nothing to make, and
    the signature is checked only once the body is there: without these bounds, trickling
    bodies could hold INGEST_MAX_BODY_BYTES of memory per connection for as long as they like."""

    max_concurrent: int = 8
    idle_timeout: float = 30.0
    min_rate: int = 64 * 1024
    reading: int = 0

    async def read(self, request: web.Request, max_body_bytes: int) -> bytes | web.Response:
        """The body, or the answer refusing to read it (503) or to wait for it longer (408)."""
        if self.reading >= self.max_concurrent:
            response = error_response(
                503, "INGEST_BUSY", f"{self.max_concurrent} request bodies are being read"
            )
            response.headers[hdrs.RETRY_AFTER] = str(BODIES_BUSY_RETRY_AFTER_SEC)
            return response
        declared = request.content_length or max_body_bytes
        deadline = self.idle_timeout + declared / self.min_rate
        self.reading += 1
        try:
            async with asyncio.timeout(deadline):
                return await request.read()  # aiohttp keeps it for the handler
        except TimeoutError:
            log.info("abandoned %s: its body took over %.0fs", printable(request.path), deadline)
            return error_response(
                408, "INGEST_BODY_TIMEOUT", f"the body did not arrive within {deadline:.0f}s"
            )
        finally:
            self.reading -= 1


def ingest_guard(
    secrets: Sequence[str], max_body_bytes: int, body_reads: BodyReads | None = None
) -> Middleware:
    """Every /api/ingest/ request but the recording upload: refused from its headers alone
    (guards.refusal_before_body: unsigned or stale 401, compressed 415, declared too large 413)
    before its body is read; its body read within `body_reads`' bounds; then, with `secrets`,
    refused (401, nothing written) unless the body is signed with one of them."""
    reads = body_reads or BodyReads()

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        # A recording upload is streamed and makes its own checks, its signature over digests.
        if not request.path.startswith(INGEST_PREFIX) or request.path == RECORDING_UPLOAD_PATH:
            return await handler(request)
        if isinstance(request.match_info.http_exception, web.HTTPMethodNotAllowed):
            # A method the route does not take: its 405 (with Allow) says so, and no body is
            # read for it either.
            return await handler(request)
        refused = refusal_before_body(request, secrets=secrets, max_body_bytes=max_body_bytes)
        if refused is not None:
            return refused
        body = await reads.read(request, max_body_bytes)
        if isinstance(body, web.Response):
            return body
        if secrets:
            problem = signing.verify(
                secrets,
                request.headers.get(TIMESTAMP_HEADER),
                request.headers.get(SIGNATURE_HEADER),
                body,
            )
            if problem is not None:
                log.warning("refused %s %s: %s", request.method, printable(request.path), problem)
                return error_response(401, "INGEST_UNAUTHORIZED", problem)
        return await handler(request)

    return guard


def expect_guard(
    secrets: Sequence[str], max_body_bytes: int
) -> Callable[[web.Request], Awaitable[web.StreamResponse | None]]:
    """The answer to `Expect: 100-continue`: the refusal when the headers alone refuse the
    request (the client then never sends the body), else 100 Continue. aiohttp's own answer
    would invite every body before any middleware has looked at the headers."""

    async def expect(request: web.Request) -> web.StreamResponse | None:
        refused = refusal_before_body(request, secrets=secrets, max_body_bytes=max_body_bytes)
        if refused is not None:
            return refused
        return await answer_expectation(request)

    return expect


def build_app(
    store: EntityStore,
    *,
    max_body_bytes: int,
    shared_secret: str | Sequence[str] | None = None,
    recordings: RecordingFiles | None = None,
    body_reads: BodyReads | None = None,
) -> web.Application:
    """The receiver's aiohttp application; `shared_secret`: one secret, or the secrets accepted
    while one is rotated. Without one it accepts unsigned requests
    (the CLI allows that only with --insecure). With `recordings` it also takes recording
    uploads and serves them. `body_reads`: the bounds on reading batch bodies (defaults:
    BodyReads())."""
    secrets = (shared_secret,) if isinstance(shared_secret, str) else tuple(shared_secret or ())
    middlewares: list[Middleware] = [
        traced,
        json_errors,
        ingest_guard(secrets, max_body_bytes, body_reads),
    ]
    app = web.Application(
        client_max_size=max_body_bytes,
        middlewares=middlewares,
        handler_args=server_handler_args("serversync.receiver"),
    )
    app[STORE_KEY] = store
    app[MAX_BODY_KEY] = max_body_bytes
    app.router.add_post(
        SYNC_PATH, ingest_sync, expect_handler=expect_guard(secrets, max_body_bytes)
    )
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if recordings is not None:
        add_routes(app, recordings, secrets)
    return app
