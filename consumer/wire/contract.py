"""The wire contract between serversync's sinks and a receiver, in one place: the paths, the
header names and what each class of answer means for the events sent (docs/wire-contract.md).

The sinks (consumer/sinks/) and the reference receiver (consumer/receiver/) both import these
names, so that the two sides cannot drift apart by a typo. How a body or a manifest is signed is
consumer/wire/signing.py.
"""

from __future__ import annotations

# -- paths ----------------------------------------------------------------------------------------

# Every path below it is a sink's delivery: signed, bounded, and read with care.
INGEST_PREFIX = "/api/ingest/"
# POST: a batch of entries as JSON ({"entries": [...]}).
SYNC_PATH = INGEST_PREFIX + "sync"
# POST: one recording's files as multipart/form-data, authenticated by a signed manifest.
RECORDING_UPLOAD_PATH = INGEST_PREFIX + "recording-file"
# GET: where the reference receiver serves a kept recording, <callLogId>/<recordingId>.wav.
RECORDING_FILES_PREFIX = "/storage/recordings"

# -- headers --------------------------------------------------------------------------------------

# The unix time a request was signed at, and its HMAC-SHA256 signature (signing.sign).
TIMESTAMP_HEADER = "X-Serversync-Timestamp"
SIGNATURE_HEADER = "X-Serversync-Signature"
# A recording upload's manifest: its ids and each file part's size and SHA-256, signed like a
# body (signing.RecordingManifest).
MANIFEST_HEADER = "X-Serversync-Manifest"
# The same delivery always carries the same key, so that a receiver can recognise a retry.
IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"

# -- the multipart parts of a recording upload ----------------------------------------------------

RECORDING_UPLOAD_PARTS = ("callLogId", "recordingId", "audio", "meta")

# -- what an answer's status means for the events sent --------------------------------------------

# "Already processed": the events are delivered, as with a 2xx.
DELIVERED_CONFLICT = 409
# The answers whose Retry-After the sender waits for instead of its backoff's delay.
RETRY_AFTER_STATUSES = frozenset({429, 503})
# The receiver is down or busy: tried again, with the offset held.
UNAVAILABLE_4XX = frozenset({408, 425, 429})
# The destination is wrong, not the data (a wrong or rotated secret, a skewed clock, a route not
# served yet): tried again, with the offset held, until an operator fixes it.
WRONG_DESTINATION_4XX = frozenset({401, 403, 404, 405})
