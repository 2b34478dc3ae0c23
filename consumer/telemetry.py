"""Logging: one JSON object per line on stderr (or text), with secrets masked."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any

import orjson

from consumer.redact import mask_secrets

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
        for key, value in record.__dict__.items():
            if key not in _STANDARD:
                # extra= fields are masked like the message: a DSN or a header may ride along.
                plain = value is None or isinstance(value, bool | int | float)
                entry[key] = value if plain else mask_secrets(str(value))
        if record.exc_info:
            entry["exc"] = mask_secrets(self.formatException(record.exc_info))
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    """Human-readable lines with secrets masked."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        """Render the record as text with secrets masked."""
        return mask_secrets(super().format(record))


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
