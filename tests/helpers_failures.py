"""Temporary: re-exports from tests.support for modules not yet switched to it."""

from tests.support.backend import committed_position, seqs_by_caller
from tests.support.dlq import dead_letters as dlq
from tests.support.processes import reaped
from tests.support.receivers import (
    INGEST_PATH,
    Attempt,
    CountingStore,
    Reply,
    serve_reference_receiver,
)
from tests.support.receivers import scripted_receiver as serve_scripted_receiver

__all__ = [
    "INGEST_PATH",
    "Attempt",
    "CountingStore",
    "Reply",
    "committed_position",
    "dlq",
    "reaped",
    "seqs_by_caller",
    "serve_reference_receiver",
    "serve_scripted_receiver",
]
