"""The receiver's quick check (models.quick_count) against its full validation: whatever the
quick check vouches for, the full validation accepts with as many entries; the bodies a consumer
sends take the quick path."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from consumer.receiver.models import INGEST_REQUEST, parse_body, quick_count
from consumer.wire.entries import encode_entries


def full_count(body: bytes) -> int | None:
    """The number of entries the full validation accepts, or None when it refuses the body."""
    try:
        return len(INGEST_REQUEST.validate_python(parse_body(body))["entries"])
    except (ValueError, ValidationError):
        return None


def agrees(body: bytes) -> int | None:
    """quick_count's answer, checked against the full validation's."""
    quick = quick_count(body)
    if quick is not None:
        assert full_count(body) == quick, body[:300]
    return quick


def entry(**changes: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "entityType": "call_log",
        "entityId": "42",
        "op": "upsert",
        "seq": 7,
        "payload": {"id": 42, "status": "done"},
        "createdAt": "2026-11-27T20:55:01.123456+00:00",
        "origin": "backend",
    }
    base.update(changes)
    return {key: value for key, value in base.items() if value is not ...}


def body_of(*entries: dict[str, Any]) -> bytes:
    return json.dumps({"entries": list(entries)}).encode()


def test_what_a_consumer_sends_takes_the_quick_path() -> None:
    created = dt.datetime(2026, 11, 27, 20, 55, 1, 123456, tzinfo=dt.UTC)
    rows = [
        (1, "upsert", "call_log", "1", '{"id": 1, "n": 123456789012345678901234567890}', created,
         None, None),
        (2, "delete", "call_log", "2", '{"id": 2}', None, "frontend", None),
        (3, "upsert", "settings.value", "k\u2028é\"", '{"k": "\u2028\\"\\u00e9"}', created,
         None, 9),
    ]  # fmt: skip
    # Wrapped as frontend-sync wraps a batch's entries.
    body = b'{"entries":' + encode_entries(rows, local_node="backend") + b"}"
    assert agrees(body) == 3
    assert agrees(b'{"entries": []}') == 0


# Each a body the quick check leaves to the full validation: it accepts some (a seq written
# 8444.0, a sweep) and refuses the rest, and says why.
LEFT_TO_THE_FULL_VALIDATION = [
    pytest.param(body_of(entry(seq=8444.0)), 1, id="seq-written-as-a-float"),
    pytest.param(body_of(entry(op="sweep", payload={"keepFromSeq": 3})), 1, id="a-sweep"),
    pytest.param(body_of(entry(entityType="call_log\n")), None, id="type-with-a-newline"),
    pytest.param(body_of(entry(origin="backend\n")), None, id="origin-with-a-newline"),
    pytest.param(
        body_of(entry(createdAt="2026-11-27T20:55:01Z\n")), None, id="time-with-a-newline"
    ),
    pytest.param(body_of(entry(createdAt="٢٠٢٦-11-27T20:55:01Z")), 1, id="time-in-other-digits"),
    pytest.param(body_of(entry(createdAt="2026-11-27 20:55:01")), None, id="time-without-zone"),
    pytest.param(body_of(entry(payload=[1, 2])), None, id="payload-a-list"),
    pytest.param(body_of(entry(payload="{}")), None, id="payload-a-string"),
    pytest.param(body_of(entry(payload=...)), None, id="payload-missing"),
    pytest.param(body_of(entry(snapshot=None)), None, id="snapshot-null"),
    pytest.param(body_of(entry(seq=True)), None, id="seq-true"),
    pytest.param(body_of(entry(seq=2**63)), None, id="seq-too-large"),
    pytest.param(body_of(entry(entityId="")), None, id="id-empty"),
    pytest.param(body_of(entry(entityId="é" * 513)), None, id="id-too-long"),
    pytest.param(body_of(entry(origin="Backend")), None, id="origin-upper-case"),
    pytest.param(
        b'{"entries": [{"entityType": "t", "entityId": "1", "op": "upsert", "seq": 1,'
        b' "payload": {}, "payload": [1]}]}',
        None,
        id="payload-given-twice",
    ),
    pytest.param(b'{"entries": [' + b"[" * 5000 + b"]" * 5000 + b"]}", None, id="deep"),
    pytest.param(b'{"entries": {}}', None, id="entries-an-object"),
    pytest.param(b"\xff", None, id="not-utf-8"),
    pytest.param(
        body_of(entry(payload={"a": "?"})).replace(b'"?"', b'"\xff"'), None, id="payload-not-utf-8"
    ),
    pytest.param(
        body_of(entry(payload={"a": "?"})).replace(b'"?"', b'"\xed\xa0\x80"'),
        None,
        id="payload-an-encoded-surrogate",
    ),
    pytest.param(body_of(entry(extra="?")).replace(b'"?"', b'"\xff"'), None, id="extra-not-utf-8"),
    pytest.param(body_of(entry(entityId="?")).replace(b'"?"', b'"\xff"'), None, id="id-not-utf-8"),
    pytest.param(
        body_of(entry(payload={"a": "?"})).replace(b'"?"', b"[" * 1000 + b"]" * 1000),
        1,
        id="payload-nested-1000-deep",
    ),
]


@pytest.mark.parametrize(("body", "expected"), LEFT_TO_THE_FULL_VALIDATION)
def test_the_quick_check_leaves_what_it_cannot_vouch_for(body: bytes, expected: int | None) -> None:
    assert quick_count(body) is None
    assert full_count(body) == expected


def test_a_body_given_twice_counts_its_last_entries() -> None:
    one, two = json.dumps([entry()]), json.dumps([entry(), entry(entityId="43")])
    assert agrees(f'{{"entries": {one}, "entries": {two}}}'.encode()) == 2


# Values a hostile sender might put in any field: odd strings, numbers of every shape, nulls,
# containers.
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(
        [
            "upsert", "delete", "sweep", "call_log", "backend", "2026-11-27T20:55:01Z",
            "2026-11-27T20:55:01.1+09:00", "a.b-c_d", "x\n", "\u0663", {}, [], {"keepFromSeq": 1},
        ]
    ),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
    st.lists(st.integers(), max_size=3),
)  # fmt: skip
FIELDS = ["entityType", "entityId", "op", "seq", "payload", "createdAt", "origin", "snapshot"]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.sampled_from(FIELDS), ODD_VALUES, max_size=4), min_size=1, max_size=4
    )
)
def test_the_quick_check_vouches_only_for_what_the_full_validation_accepts(
    changes: list[dict[str, Any]],
) -> None:
    agrees(json.dumps({"entries": [entry(**change) for change in changes]}).encode())
