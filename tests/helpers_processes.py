"""Temporary: re-exports from tests.support for modules not yet switched to it."""

from tests.support.backend import (
    CONSUMER,
    insert_callers,
    insert_calls,
    offsets_row,
    outbox_end,
)
from tests.support.processes import FAST_ENV, Processes, ServersyncProcess, process_env
from tests.support.receivers import INGEST_PATH
from tests.support.receivers import ScriptedReceiver as FaultReceiver
from tests.support.receivers import scripted_receiver as serve_fault_receiver

__all__ = [
    "CONSUMER",
    "FAST_ENV",
    "INGEST_PATH",
    "FaultReceiver",
    "Processes",
    "ServersyncProcess",
    "insert_callers",
    "insert_calls",
    "offsets_row",
    "outbox_end",
    "process_env",
    "serve_fault_receiver",
]
