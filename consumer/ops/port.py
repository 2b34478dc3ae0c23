"""A consumer process's HTTP port (SYNC_HTTP_HOST:SYNC_HTTP_PORT): /healthz, /readyz, /metrics,
and the dead-letter admin API when SYNC_ADMIN_TOKEN is set."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Middleware

from consumer.core.errors import first_line
from consumer.ops import adminapi
from consumer.ops.deadletters import DeadLetters
from consumer.wire.httpjson import json_response, server_handler_args

# Roles in which a consumer process is doing its job: leading, or standing by, ready to lead.
READY_STATES = frozenset({"leader", "standby"})
PING_TIMEOUT_SEC = 2.0


@dataclass(frozen=True)
class Health:
    """What /readyz asks: the consumer's state, a database round trip, and whether deliveries
    go through ({"state": "ok" | "not_leading" | "delivery_failing", ...})."""

    consumer: str
    state: Callable[[], str]
    ping: Callable[[], Awaitable[None]]
    delivery: Callable[[], dict[str, Any]] = lambda: {"state": "ok"}


@dataclass(frozen=True)
class MetricsEndpoint:
    """Renders the process's metrics: (body, content type)."""

    render: Callable[[], tuple[bytes, str]]


HEALTH_KEY = web.AppKey("health", Health)
METRICS_KEY = web.AppKey("metrics", MetricsEndpoint)


async def healthz(request: web.Request) -> web.Response:
    """The process is alive and its event loop answers."""
    return json_response({"status": "ok", "consumer": request.app[HEALTH_KEY].consumer})


async def readyz(request: web.Request) -> web.Response:
    """200 when the database answers and the consumer leads or stands by healthily, else 503;
    the body says which. Deliveries that keep failing (the receiver down, or a wrong
    destination) leave it 200, since the process itself is fine and a restart would not help,
    but the body says "delivery_failing", why and since when."""
    health = request.app[HEALTH_KEY]
    state = health.state()
    try:
        await asyncio.wait_for(health.ping(), timeout=PING_TIMEOUT_SEC)
        database = "ok"
    except TimeoutError:
        database = f"no answer within {PING_TIMEOUT_SEC:g}s"
    except Exception as exc:
        database = first_line(exc)
    ready = database == "ok" and state in READY_STATES
    return json_response(
        {
            "status": "ready" if ready else "unavailable",
            "consumer": health.consumer,
            "role": state,
            "database": database,
            "delivery": health.delivery(),
        },
        status=200 if ready else 503,
    )


async def metrics(request: web.Request) -> web.Response:
    """The Prometheus exposition of this process's metrics."""
    body, content_type = request.app[METRICS_KEY].render()
    response = web.Response(body=body)
    # The exposition format's type carries a version parameter aiohttp's content_type rejects.
    response.headers["Content-Type"] = content_type
    return response


def build_ops_app(
    health: Health,
    *,
    metrics_endpoint: MetricsEndpoint | None = None,
    dead_letters: DeadLetters | None = None,
    token: str | None = None,
) -> web.Application:
    """The application behind a consumer's HTTP port."""
    middlewares: list[Middleware] = [adminapi.json_errors]
    if token:
        middlewares.append(adminapi.bearer_auth(token))
    app = web.Application(
        middlewares=middlewares, handler_args=server_handler_args("serversync.opshttp")
    )
    app[HEALTH_KEY] = health
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    if metrics_endpoint is not None:
        app[METRICS_KEY] = metrics_endpoint
        app.router.add_get("/metrics", metrics)
    if dead_letters is not None and token:
        adminapi.add_dlq_routes(app, dead_letters)
    return app
