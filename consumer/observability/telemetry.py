"""Logs, metrics and traces of a serversync process.

Logs: one JSON object per line on stderr (or text), with secrets masked and the current trace id.
Metrics and traces: the OpenTelemetry SDK, set up once per process by setup_telemetry; metrics
are scraped from /metrics (Prometheus), and both go over OTLP/HTTP when the standard
OTEL_EXPORTER_OTLP_* variables name an endpoint.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Status
from opentelemetry.util.types import Attributes, AttributeValue
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

from consumer.observability.redact import mask_secrets, printable

# What starts each further line of a text record (a traceback's).
CONTINUATION = "  | "
_STANDARD = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg and any `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as JSON with secrets masked."""
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": mask_secrets(record.getMessage()),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = format(context.trace_id, "032x")
            entry["span_id"] = format(context.span_id, "016x")
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                # extra= fields are masked like the message: a DSN or a header may ride along.
                plain = value is None or isinstance(value, bool | int | float)
                entry[key] = value if plain else mask_secrets(str(value))
        if record.exc_info:
            entry["exc"] = mask_secrets(self.formatException(record.exc_info))
        try:
            return orjson.dumps(entry, default=str).decode()
        except orjson.JSONEncodeError:
            # A lone surrogate (a header's bytes that were not UTF-8) is no JSON text: it
            # becomes U+FFFD rather than losing the record.
            return orjson.dumps(_without_surrogates(entry), default=str).decode()


_SURROGATE = re.compile("[\ud800-\udfff]")


def _without_surrogates(entry: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _SURROGATE.sub("\ufffd", value) if isinstance(value, str) else value
        for key, value in entry.items()
    }


class TextFormatter(logging.Formatter):
    """Human-readable lines with secrets masked, one line per record.

    A message may quote what a client sent (a path, a header): every control character in it
    (a newline from a %0a in a URL, a carriage return, an escape sequence) becomes a space, so
    that no request can write a line of its own into the log. A traceback keeps its lines, each
    made printable and marked with a leading "  | ", so none can pass for a record either."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as text with secrets masked (and the trace id, inside a span)."""
        record.message = printable(mask_secrets(record.getMessage()))
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            line += f" trace={context.trace_id:032x}"
        details = []
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            details.append(record.exc_text)
        if record.stack_info:
            details.append(self.formatStack(record.stack_info))
        for text in details:
            line += "".join(
                f"\n{CONTINUATION}{printable(part)}" for part in mask_secrets(text).split("\n")
            )
        return line


def setup_logging(level: str = "INFO", fmt: str = "json") -> None:
    """Send serversync's logs to stderr in the chosen format."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Third-party chatter stays at warnings.
    for noisy in ("aiohttp.access", "psycopg.pool"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _otlp_wanted(signal: str) -> bool:
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or os.environ.get(f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT")
    )


def _masked_value(value: AttributeValue) -> AttributeValue:
    if isinstance(value, str):
        return mask_secrets(value)
    if isinstance(value, Sequence) and value and isinstance(value[0], str):
        return [mask_secrets(str(item)) for item in value]
    return value


def _masked_attributes(attributes: Attributes) -> Attributes:
    if not attributes:
        return attributes
    return {key: _masked_value(value) for key, value in attributes.items()}


def masked_span(span: ReadableSpan) -> ReadableSpan:
    """A copy of the span with secrets masked in its attributes, its events' attributes (a
    recorded exception's message and stack trace) and its status description."""
    status = span.status
    description = status.description and mask_secrets(status.description)
    return ReadableSpan(
        name=span.name,
        context=span.context,
        parent=span.parent,
        resource=span.resource,
        attributes=_masked_attributes(span.attributes),
        events=[
            Event(event.name, _masked_attributes(event.attributes), event.timestamp)
            for event in span.events
        ],
        links=span.links,
        kind=span.kind,
        status=Status(status.status_code, description),
        start_time=span.start_time,
        end_time=span.end_time,
        instrumentation_scope=span.instrumentation_scope,
    )


class MaskingSpanExporter(SpanExporter):
    """Masks secrets in every span before `exporter` sends it: a URL with a password in
    url.full, or an exception recorded with such a URL, must not leave the process in a trace
    any more than in a log line."""

    def __init__(self, exporter: SpanExporter) -> None:
        self._exporter = exporter

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        """Mask, then export."""
        return self._exporter.export([masked_span(span) for span in spans])

    def shutdown(self) -> None:
        """Shut the wrapped exporter down."""
        self._exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Flush the wrapped exporter."""
        return self._exporter.force_flush(timeout_millis)


@dataclass
class Telemetry:
    """The process's metrics and traces, as set up by setup_telemetry."""

    meter_provider: MeterProvider
    tracer_provider: TracerProvider

    def render_prometheus(self) -> tuple[bytes, str]:
        """The Prometheus exposition of every metric: (body, content type)."""
        return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

    def shutdown(self) -> None:
        """Flush what is still to export (OTLP) and stop the exporters."""
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup_telemetry(service_name: str) -> Telemetry:
    """Install the OpenTelemetry SDK for this process (call once, at start).

    The service name is OTEL_SERVICE_NAME if set, else `service_name`. Metrics are always
    readable at /metrics; OTLP/HTTP export of metrics and traces starts when
    OTEL_EXPORTER_OTLP_ENDPOINT (or the per-signal variable) is set, configured by the other
    standard OTEL_EXPORTER_OTLP_* variables.
    """
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)})
    readers: list[MetricReader] = [PrometheusMetricReader()]
    if _otlp_wanted("METRICS"):
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    metrics.set_meter_provider(meter_provider)
    # A real tracer provider even without an exporter: spans get ids, which go into the logs
    # and, propagated in headers, let the receiver's logs name the same trace.
    tracer_provider = TracerProvider(resource=resource)
    if _otlp_wanted("TRACES"):
        tracer_provider.add_span_processor(
            BatchSpanProcessor(MaskingSpanExporter(OTLPSpanExporter()))
        )
    trace.set_tracer_provider(tracer_provider)
    return Telemetry(meter_provider, tracer_provider)
