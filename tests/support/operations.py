"""What the operations tests share: the environment of their `serversync` subprocesses, JSON log
lines, a Prometheus scraper, waits on /metrics and /readyz, and an OTLP/HTTP collector (a real
aiohttp server on loopback)."""

from __future__ import annotations

import contextlib
import gzip
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.conftest import serve_app, wait_until
from tests.support.processes import FAST_ENV

# Labels the OpenTelemetry Prometheus exporter adds to every serversync series.
SCOPE_LABELS = frozenset({"otel_scope_name", "otel_scope_version", "otel_scope_schema_url"})

# -- serversync processes ------------------------------------------------------------------------

# What the operations tests run with: FAST_ENV timers, INFO logs, gauges refreshed every 0.2 s.
OPS_ENV: dict[str, str] = {
    **FAST_ENV,
    "SYNC_LOG_LEVEL": "INFO",
    "SYNC_METRICS_INTERVAL_SEC": "0.2",
}


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a JSON log; fails on a line that is not one JSON object."""
    entries = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            entry = orjson.loads(line)
        except orjson.JSONDecodeError:
            raise AssertionError(f"not a JSON log line: {line!r}") from None
        assert isinstance(entry, dict), line
        entries.append(entry)
    return entries


# -- HTTP ----------------------------------------------------------------------------------------


async def get_json(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    """GET; the status and the JSON body (every answer of the ops port must be JSON)."""
    async with http.get(url) as response:
        assert response.content_type == "application/json", await response.text()
        return response.status, orjson.loads(await response.read())


@dataclass(frozen=True)
class Scrape:
    """One parsed Prometheus exposition."""

    types: dict[str, str]  # family name -> counter, gauge, histogram, ...
    samples: list[Sample]

    @property
    def names(self) -> set[str]:
        """Every sample name (histograms as _bucket, _sum and _count; counters with _total)."""
        return {s.name for s in self.samples}

    def series(self, name: str) -> dict[frozenset[tuple[str, str]], float]:
        """Every sample of `name`: its labels (without the exporter's scope labels) -> value."""
        return {
            frozenset((k, v) for k, v in s.labels.items() if k not in SCOPE_LABELS): s.value
            for s in self.samples
            if s.name == name
        }

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """The samples of `name` that carry `labels`, by the value of `label`."""
        found: dict[str, float] = {}
        for key, value in self.series(name).items():
            as_dict = dict(key)
            if all(as_dict.get(k) == v for k, v in labels.items()) and label in as_dict:
                found[as_dict[label]] = value
        return found

    def value(self, name: str, **labels: str) -> float | None:
        """The one sample of `name` whose labels are exactly `labels` (None if there is none)."""
        return self.series(name).get(frozenset(labels.items()))


async def scrape(http: aiohttp.ClientSession, base_url: str) -> Scrape:
    """GET /metrics and parse it as Prometheus does."""
    async with http.get(base_url + "/metrics") as response:
        assert response.status == 200, await response.text()
        assert response.headers["Content-Type"].startswith("text/plain"), response.headers
        text = await response.text()
    types: dict[str, str] = {}
    samples: list[Sample] = []
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        samples += family.samples
    return Scrape(types, samples)


async def wait_metric(
    http: aiohttp.ClientSession,
    base_url: str,
    name: str,
    expected: float,
    *,
    timeout: float = 10.0,
    **labels: str,
) -> Scrape:
    """Scrape until the sample `name{labels}` equals `expected`; the last scrape."""
    last: list[Scrape] = []

    async def reached() -> bool:
        last[:] = [await scrape(http, base_url)]
        return last[0].value(name, **labels) == expected

    try:
        await wait_until(reached, timeout=timeout, interval=0.05, what=f"{name}{labels}")
    except AssertionError as exc:
        seen = last[0].value(name, **labels) if last else None
        raise AssertionError(f"{exc}: wanted {expected}, last scraped {seen}") from None
    return last[0]


async def wait_ready(
    http: aiohttp.ClientSession, base_url: str, role: str, timeout: float = 10.0
) -> dict[str, Any]:
    """Wait until /readyz answers 200 with `role`; its body."""
    answers: list[tuple[int, Any]] = []

    async def ready() -> bool:
        answers[:] = [await get_json(http, base_url + "/readyz")]
        status, body = answers[0]
        return bool(status == 200 and body.get("role") == role)

    try:
        await wait_until(ready, timeout=timeout, interval=0.05, what=f"/readyz 200 as {role}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last answer {answers}") from None
    body: dict[str, Any] = answers[0][1]
    return body


# -- an OTLP/HTTP collector ----------------------------------------------------------------------


def attribute(attributes: Any, key: str) -> Any:
    """The value of one OTLP attribute (None if absent)."""
    for kv in attributes:
        assert isinstance(kv, KeyValue)
        if kv.key == key:
            return any_value(kv.value)
    return None


def any_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as Python."""
    kind = value.WhichOneof("value")
    return getattr(value, kind) if kind else None


@dataclass(frozen=True)
class CollectedSpan:
    """One exported span and the service that exported it."""

    service: str
    span: Span
    received: float

    @property
    def trace_id(self) -> str:
        """32 hex digits."""
        return bytes(self.span.trace_id).hex()

    @property
    def span_id(self) -> str:
        """16 hex digits."""
        return bytes(self.span.span_id).hex()

    @property
    def parent_id(self) -> str:
        """16 hex digits, or "" for a root span."""
        return bytes(self.span.parent_span_id).hex()

    def attribute(self, key: str) -> Any:
        """The value of one of the span's attributes."""
        return attribute(self.span.attributes, key)


@dataclass
class Collector:
    """An OTLP/HTTP collector (protobuf) on loopback: keeps every span and metric name."""

    url: str = ""
    spans: list[CollectedSpan] = field(default_factory=list)
    # service.name -> every metric name that service exported
    metrics: dict[str, set[str]] = field(default_factory=dict)
    requests: list[str] = field(default_factory=list)

    @staticmethod
    async def _body(request: web.Request) -> bytes:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return body

    async def traces(self, request: web.Request) -> web.Response:
        """POST /v1/traces."""
        self.requests.append(request.path)
        export = ExportTraceServiceRequest.FromString(await self._body(request))
        for resource_spans in export.resource_spans:
            service = str(attribute(resource_spans.resource.attributes, "service.name"))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(CollectedSpan(service, span, time.monotonic()))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def metrics_export(self, request: web.Request) -> web.Response:
        """POST /v1/metrics."""
        self.requests.append(request.path)
        export = ExportMetricsServiceRequest.FromString(await self._body(request))
        for resource_metrics in export.resource_metrics:
            service = str(attribute(resource_metrics.resource.attributes, "service.name"))
            names = self.metrics.setdefault(service, set())
            for scope_metrics in resource_metrics.scope_metrics:
                names |= {metric.name for metric in scope_metrics.metrics}
        return web.Response(
            body=ExportMetricsServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    def named(self, name: str, service: str | None = None) -> list[CollectedSpan]:
        """The collected spans called `name` (of `service`)."""
        return [s for s in self.spans if s.span.name == name and service in (None, s.service)]


@contextlib.asynccontextmanager
async def otlp_collector() -> AsyncIterator[Collector]:
    """A Collector on a free loopback port."""
    collector = Collector()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/traces", collector.traces)
    app.router.add_post("/v1/metrics", collector.metrics_export)
    async with serve_app(app, shutdown_timeout=1.0) as url:
        collector.url = url
        yield collector
