"""The wire contract of POST /api/ingest/sync, as validated by the receiver."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

ENTITY_TYPE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$"


class Entry(BaseModel):
    """One change of one entity."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    entity_type: str = Field(alias="entityType", pattern=ENTITY_TYPE_PATTERN)
    entity_id: str = Field(alias="entityId", min_length=1, max_length=512)
    op: Literal["upsert", "delete"]
    # A bigint in the receiver's store (and in the outbox): larger values are a bad field.
    seq: int = Field(ge=1, le=2**63 - 1, strict=True)
    payload: dict[str, Any]
    created_at: datetime | None = Field(None, alias="createdAt")

    @field_validator("created_at", mode="before")
    @classmethod
    def _timestamp_text(cls, value: object) -> object:
        # The store reads createdAt as timestamptz text: a number (which pydantic would take as
        # epoch seconds) must be refused here, naming the field, not later by PostgreSQL.
        if value is not None and not isinstance(value, str):
            raise ValueError("must be an RFC 3339 timestamp string")
        return value


class IngestRequest(BaseModel):
    """The body of POST /api/ingest/sync."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    entries: list[Entry] = Field(max_length=50_000)


INGEST_REQUEST = TypeAdapter(IngestRequest)


def describe(exc: ValidationError) -> tuple[str, str]:
    """(field path, message) of the first problem, e.g. ("entries[3].op", "Input should be ...")."""
    error = exc.errors()[0]
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body", error["msg"]
