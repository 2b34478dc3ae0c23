"""The knobs of the consumer loop.

No defaults here: the only defaults are SyncSettings' (consumer/app/settings.py), and
`runtime_config(settings)` there is the one place a RuntimeConfig is built, in production and in
the tests alike, so that no test runs a configuration users never run.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuntimeConfig:
    """The knobs of the loop, in seconds where they are durations."""

    # Events per read and per delivered batch.
    batch_size: int
    # How long an idle consumer sleeps without a NOTIFY before it reads anyway.
    poll_interval: float
    # While committed events wait behind an older open transaction, the longest wait between
    # re-reads (the first comes after 1 ms; pipeline.py).
    recheck_interval: float
    # How often a standby tries to take over, and how often the leader checks its lock.
    standby_interval: float
    # Delivery retries: from retry_initial, doubling up to retry_max.
    retry_initial: float
    retry_max: float
    # How long a stop waits for a delivery or a database step in flight.
    shutdown_timeout: float
    # After an empty read, look again this much later before announcing that we wait.
    linger: float
    # Attempts while the receiver is unavailable before a batch is parked; 0 never gives up.
    max_attempts: int
    # How often an operator may retry a parked event before it is DEAD.
    dlq_max_retries: int
    # Batches being delivered at once while a backlog drains; offsets still move in order.
    max_in_flight: int
    # After a full read, read the next batch while this one is delivered; after a short one,
    # while its offset commits.
    read_ahead: bool
    # While events arrive at batch_wait_min_rate per second or faster, wait batch_wait after a
    # short batch before reading again (consumer/runtime/pacing.py); 0 never waits.
    batch_wait: float
    batch_wait_min_rate: float
