"""What the receiver checks in a request's headers before it reads a byte of the body.

Reading is what costs: aiohttp holds the body in memory (up to INGEST_MAX_BODY_BYTES). So a
request that is unsigned, stale, compressed or declared too large is answered from its headers
alone, and its body is never read.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from aiohttp import HttpVersion11, hdrs, web

from consumer.observability.redact import printable
from consumer.wire import signing
from consumer.wire.contract import SIGNATURE_HEADER, TIMESTAMP_HEADER
from consumer.wire.httpjson import error_response

log = logging.getLogger("serversync.receiver")

IDENTITY = "identity"
# How much of a refused header value an error message quotes.
QUOTED_CHARS = 60


def content_encoding_refusal(request: web.BaseRequest) -> web.Response | None:
    """A 415 JSON answer (INGEST_UNSUPPORTED_ENCODING, with `Accept-Encoding: identity`) when the
    request declares a Content-Encoding other than identity; None otherwise. Call it before
    reading the body. A compressed body turns a few kilobytes on the wire into megabytes in
    memory, past a Content-Length check that counts only the compressed bytes; serversync's
    servers do not inflate bodies at all (httpjson.server_handler_args), so a body read despite
    its Content-Encoding would reach the handler still compressed."""
    declared = request.headers.getall(hdrs.CONTENT_ENCODING, ())
    codings = [c.strip().lower() for value in declared for c in value.split(",")]
    if all(coding in ("", IDENTITY) for coding in codings):
        return None
    shown = printable(", ".join(declared))[:QUOTED_CHARS]
    response = error_response(
        415,
        "INGEST_UNSUPPORTED_ENCODING",
        f"Content-Encoding {shown!r} is not accepted: send the body uncompressed (identity)",
    )
    # RFC 9110 15.5.16: a 415 for a content coding says which codings are accepted.
    response.headers[hdrs.ACCEPT_ENCODING] = IDENTITY
    return response


def declared_size_refusal(request: web.BaseRequest, limit: int) -> web.Response | None:
    """A 413 JSON answer when the request's Content-Length is over `limit` bytes; None
    otherwise (a chunked body is counted while it is read instead)."""
    declared = request.content_length
    if declared is None or declared <= limit:
        return None
    return error_response(413, "INGEST_TOO_LARGE", f"request body over {limit} bytes")


def signature_headers_refusal(
    request: web.BaseRequest, secrets: Sequence[str]
) -> web.Response | None:
    """A 401 JSON answer when the receiver wants signed requests (`secrets`) and the signature
    headers are missing, malformed or stale (signing.check_headers), or, without secrets, when
    signature headers are sent malformed; None otherwise. Only the signature over the body,
    checked once the body is read, says the request is authentic."""
    timestamp = request.headers.get(TIMESTAMP_HEADER)
    given = request.headers.get(SIGNATURE_HEADER)
    if secrets:
        problem = signing.check_headers(timestamp, given)
    else:
        problem = signing.malformed_headers(timestamp, given)
    if problem is None:
        return None
    log.warning("refused %s %s: %s", request.method, printable(request.path), problem)
    return error_response(401, "INGEST_UNAUTHORIZED", problem)


def refusal_before_body(
    request: web.BaseRequest, *, secrets: Sequence[str], max_body_bytes: int
) -> web.Response | None:
    """The answer to a request refused from its headers alone, or None to go on and read it.
    The signature headers come first: an unsigned client learns nothing else."""
    refusal = signature_headers_refusal(request, secrets)
    if refusal is None:
        refusal = content_encoding_refusal(request)
    if refusal is None:
        refusal = declared_size_refusal(request, max_body_bytes)
    return refusal


async def answer_expectation(request: web.Request) -> web.StreamResponse | None:
    """The rest of an answer to `Expect:` once the headers passed: 417 for anything but
    100-continue, else 100 Continue written at once (None: go on and read the body)."""
    if request.headers.get(hdrs.EXPECT, "").lower() != "100-continue":
        return error_response(
            417, "HTTP_417", "the only expectation accepted is Expect: 100-continue"
        )
    if request.version == HttpVersion11:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        # What follows is the answer itself: aiohttp counts its bytes from here.
        request.writer.output_size = 0
    return None
