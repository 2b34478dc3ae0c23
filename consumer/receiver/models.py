"""The wire contract of POST /api/ingest/sync, as validated by the receiver.

TypedDicts rather than models, and the payload checked for being an object without being walked:
validation is the receiver's hottest path (three times cheaper this way, measured with py-spy on
the drain bench), and the payload goes to PostgreSQL untouched anyway.

Before that, `quick_count` tries a narrower check that is cheaper still: msgspec decodes the
entries in C and skips over each payload without building it (about half the CPU of parsing and
validating the bench's 500-byte entries, a third when a request's entries share their times). It
accepts only what the full validation accepts, and says nothing about anything else, which the
full validation then decides and explains.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Annotated, Any, Literal, NotRequired

import msgspec
import orjson
from pydantic import (
    AfterValidator,
    ConfigDict,
    Field,
    PlainValidator,
    StringConstraints,
    TypeAdapter,
    ValidationError,
)

# pydantic needs typing_extensions' TypedDict before Python 3.12.
from typing_extensions import TypedDict

ENTITY_TYPE_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,127}$"
# RFC 3339, as PostgreSQL's timestamptz input reads it; PostgreSQL remains the final judge.
# A node's name (sync.node's rule, that of a consumer's name): an entry's origin.
NODE_PATTERN = r"^[a-z][a-z0-9_-]{0,62}$"
TIMESTAMP_PATTERN = r"^\d{4}-\d{2}-\d{2}[T ]\d{2}:\d{2}:\d{2}(\.\d{1,9})?(Z|z|[+-]\d{2}(:?\d{2})?)$"


MAX_SEQ = 2**63 - 1


def _json_object(value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


def _bigint(value: object, minimum: int) -> int:
    """A JSON integer from `minimum` to a bigint's maximum. Written as 8444.0 it is the same
    number (a JSON Schema integer is any number with a zero fraction); 8444.5, true and "8444"
    are not."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    if not minimum <= value <= MAX_SEQ:
        raise ValueError(f"must be between {minimum} and {MAX_SEQ}")
    return value


def _seq(value: object) -> int:
    """A seq (or a snapshot's id): an integer from 1 to a bigint's maximum."""
    return _bigint(value, 1)


def _keep_from_seq(value: object) -> int:
    """A sweep's keepFromSeq: an integer from 0 (nothing is older) to a bigint's maximum."""
    return _bigint(value, 0)


class SweepPayload(TypedDict):
    """The payload of a sweep entry; other members (its "snapshot") are ignored."""

    __pydantic_config__ = ConfigDict(extra="ignore")  # type: ignore[misc]

    keepFromSeq: Annotated[int, PlainValidator(_keep_from_seq)]


class _SweepEntry(TypedDict):
    """What a sweep entry has beyond any entry: a payload naming the seq it keeps from."""

    __pydantic_config__ = ConfigDict(extra="ignore")  # type: ignore[misc]

    payload: SweepPayload


_SWEEP_ENTRY = TypeAdapter(_SweepEntry)


class Entry(TypedDict):
    """One change of one entity."""

    __pydantic_config__ = ConfigDict(extra="ignore")  # type: ignore[misc]

    entityType: Annotated[str, StringConstraints(pattern=ENTITY_TYPE_PATTERN)]
    entityId: Annotated[str, StringConstraints(min_length=1, max_length=512)]
    # "sweep": the end marker of a snapshot asked for with --delete-missing (docs/wire-contract.md,
    # Snapshots); its payload is a SweepPayload.
    op: Literal["upsert", "delete", "sweep"]
    # A bigint in the receiver's store (and in the outbox): larger values are a bad field.
    seq: Annotated[int, PlainValidator(_seq)]
    payload: Annotated[dict[str, Any], PlainValidator(_json_object)]
    createdAt: NotRequired[Annotated[str, StringConstraints(pattern=TIMESTAMP_PATTERN)] | None]
    # The node where the change was first made; absent from a node without a name. A receiver
    # that maps the entity type into a table requires it (with createdAt, it is the version).
    origin: NotRequired[Annotated[str, StringConstraints(pattern=NODE_PATTERN)] | None]
    # The snapshot the entry belongs to (an upsert of a snapshot, or its sweep); informational.
    snapshot: NotRequired[Annotated[int, PlainValidator(_seq)]]


def _sweep_checked(entry: Entry) -> Entry:
    """A sweep entry's payload checked as a SweepPayload: a malformed one is refused naming
    its field (entries[N].payload.keepFromSeq). Any other entry's payload is not walked."""
    if entry["op"] == "sweep":
        _SWEEP_ENTRY.validate_python(entry)
    return entry


class IngestRequest(TypedDict):
    """The body of POST /api/ingest/sync."""

    __pydantic_config__ = ConfigDict(extra="ignore")  # type: ignore[misc]

    entries: Annotated[
        list[Annotated[Entry, AfterValidator(_sweep_checked)]], Field(max_length=50_000)
    ]


INGEST_REQUEST = TypeAdapter(IngestRequest)


@dataclass(frozen=True)
class Sweep:
    """A validated sweep entry: an entity of `entity_type` whose last applied seq is below
    `keep_from_seq` is gone (the snapshot sent every live one with a seq at least that, and a
    change since has one too; one still in flight wins over the tombstone when it arrives)."""

    index: int  # in the request's entries
    entity_type: str
    keep_from_seq: int

    @classmethod
    def of(cls, index: int, entry: Mapping[str, Any]) -> Sweep:
        """The sweep of a validated sweep entry, `index` in its request."""
        # int(): validated as an integer, it may be written 8444.0.
        return cls(index, entry["entityType"], int(entry["payload"]["keepFromSeq"]))


_OP = itemgetter("op")


def sweeps_of(entries: Sequence[Mapping[str, Any]]) -> list[Sweep]:
    """The sweep entries of validated `entries`, in request order. Looked for at C speed first
    (a sweep is rare: one per entity type at the end of a snapshot)."""
    if "sweep" not in map(_OP, entries):
        return []
    return [Sweep.of(index, entry) for index, entry in enumerate(entries) if entry["op"] == "sweep"]


# An integer this long is no seq (a bigint has at most 19 digits and a sign); kept as text, it
# costs no conversion (Python refuses to convert one of more than 4300 digits) and fails the seq
# check like any other non-integer.
_MAX_INT_CHARS = 20


def _int_or_text(text: str) -> int | str:
    return int(text) if len(text) <= _MAX_INT_CHARS else text


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def parse_body(body: bytes) -> Any:
    """The request body as Python values, for validation only: the entries are stored from the
    body's own bytes, which PostgreSQL parses (its numeric keeps every number exactly).

    orjson reads almost every body. What it refuses although it is JSON (a number beyond a
    double's range such as 1.8e308 or -1e400, a lone surrogate escape such as "\\ud800") is read
    again with Python's json module, which accepts both; PostgreSQL then stores the number or
    refuses the string (422). ValueError (orjson's own message) when the body is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as refused:
        try:
            return json.loads(
                body.decode("utf-8"), parse_int=_int_or_text, parse_constant=_no_constant
            )
        except ValueError:
            raise refused from None
        except RecursionError:
            # Nested deeper than this receiver validates (PostgreSQL's json takes more): a
            # refusal of this content, never a 500.
            raise ValueError("nested too deeply to validate") from None


# The same patterns for quick_count, with re's fullmatch: ASCII only (the full validation's \d
# also takes other scripts' digits, which quick_count leaves to it) and no "$" (which re lets
# match before a final newline).
_QUICK_ENTITY_TYPE = re.compile(ENTITY_TYPE_PATTERN.strip("^$"), re.ASCII)
_QUICK_NODE = re.compile(NODE_PATTERN.strip("^$"), re.ASCII)
_QUICK_TIMESTAMP = re.compile(TIMESTAMP_PATTERN.strip("^$"), re.ASCII)
_OBJECT_START = ord("{")


class _QuickEntry(msgspec.Struct):
    """An entry as quick_count takes it: what Entry requires, with no sweep, no null snapshot,
    and integers that are JSON integers (not 8444.0); the patterns are checked after decoding."""

    entityType: str
    entityId: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    op: Literal["upsert", "delete"]
    seq: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)]
    # Skipped over as raw bytes (well-formed JSON, checked for being an object below).
    payload: msgspec.Raw
    createdAt: str | None = None
    origin: str | None = None
    snapshot: Annotated[int, msgspec.Meta(ge=1, le=MAX_SEQ)] | msgspec.UnsetType = msgspec.UNSET


class _QuickRequest(msgspec.Struct):
    entries: Annotated[list[_QuickEntry], msgspec.Meta(max_length=50_000)]


_QUICK_DECODER = msgspec.json.Decoder(_QuickRequest)


def quick_count(body: bytes) -> int | None:
    """The number of entries of a body that the full validation (parse_body, then
    INGEST_REQUEST) certainly accepts and that holds no sweep; None when it must decide."""
    try:
        # Decoded first: msgspec skips over a payload's bytes without checking their encoding.
        entries = _QUICK_DECODER.decode(body.decode("utf-8")).entries
    except (msgspec.DecodeError, ValueError, RecursionError):
        # Not UTF-8 (UnicodeDecodeError is a ValueError), or nested deeper than msgspec goes.
        return None
    # A request's entries share a handful of types and origins: each distinct one checked once.
    if not all(map(_QUICK_ENTITY_TYPE.fullmatch, {entry.entityType for entry in entries})):
        return None
    origins = {entry.origin for entry in entries if entry.origin is not None}
    if not all(map(_QUICK_NODE.fullmatch, origins)):
        return None
    created = {entry.createdAt for entry in entries if entry.createdAt is not None}
    if not all(map(_QUICK_TIMESTAMP.fullmatch, created)):
        return None
    # msgspec keeps a raw value from its first byte: an object starts with "{".
    if not all(memoryview(entry.payload)[0] == _OBJECT_START for entry in entries):
        return None
    return len(entries)


def describe(exc: ValidationError) -> tuple[str, str]:
    """(field path, message) of the first problem, e.g. ("entries[3].op", "Input should be ...")."""
    error = exc.errors()[0]
    path = ""
    for part in error["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "body", error["msg"]
