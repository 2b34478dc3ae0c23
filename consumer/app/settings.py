"""Configuration from environment variables, validated once at start."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import AliasChoices, Field, HttpUrl, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from consumer.observability.redact import mask_secrets
from consumer.runtime.config import RuntimeConfig

__all__ = [
    "CONSUMER_NAME",
    "ENV_NAME",
    "ConfigError",
    "ReceiverSettings",
    "SyncSettings",
    "load",
    "read_secret",
]


class ConfigError(Exception):
    """A setting is missing or invalid; the message names the variable, fit for one line."""


# Each shared secret's least length: `openssl rand -hex 32` gives 64 characters.
MIN_SECRET_CHARS = 32
# What deploy/*.env.example put in SYNC_SHARED_SECRET: a secret holding it was never replaced.
PLACEHOLDER = "CHANGE_ME"
# Settings whose value an error message never echoes.
_UNECHOED = frozenset({"SYNC_SHARED_SECRET", "SYNC_ADMIN_TOKEN"})
# A consumer's name, and a node's (sync.consumer_offsets' CHECK and sync.node hold the same rule).
CONSUMER_NAME = r"^[a-z][a-z0-9_-]{0,62}$"
# An environment variable's name, as a shell and systemd's EnvironmentFile take it (a declared
# consumer's *_env keys).
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


def _secret_list(value: str | None) -> str | None:
    """SYNC_SHARED_SECRET checked: one secret or a comma-separated list, each at least
    MIN_SECRET_CHARS long and not the example's placeholder; returned without the blanks
    around each secret. The messages never quote a secret."""
    if value is None:
        return None
    secrets = [part.strip() for part in value.split(",")]
    count = len(secrets)
    for number, secret in enumerate(secrets, 1):
        which = "the secret" if count == 1 else f"secret {number} of {count}"
        if not secret:
            raise PydanticCustomError(
                "secret_empty",
                f"{which} is empty (one secret, or secrets separated by commas)",
            )
        if PLACEHOLDER.lower() in secret.lower():
            raise PydanticCustomError(
                "secret_placeholder",
                f"{which} is the example's placeholder ({PLACEHOLDER}...): set a random one, "
                "e.g. `openssl rand -hex 32`, the same on the receiver and the consumers",
            )
        if len(secret) < MIN_SECRET_CHARS:
            raise PydanticCustomError(
                "secret_too_short",
                f"{which} is shorter than {MIN_SECRET_CHARS} characters "
                "(e.g. `openssl rand -hex 32`)",
            )
    return ",".join(secrets)


def parse_secrets(value: str, what: str) -> tuple[str, ...]:
    """`value` checked as SYNC_SHARED_SECRET is (one secret or a comma-separated list, each long
    enough and not the placeholder): its secrets in order, or a ConfigError that starts with
    `what` and never quotes a secret."""
    try:
        checked = _secret_list(value)
    except PydanticCustomError as exc:
        raise ConfigError(f"{what}: {exc.message()}") from None
    assert checked is not None
    return tuple(checked.split(","))


def read_secret(
    owner: str,
    key: str,
    variable: str | None,
    path: Path | None,
    environ: Mapping[str, str],
    *,
    holds: str,
) -> tuple[str, str] | None:
    """A declared secret, read now: the value of the environment variable `variable` (its
    `<key>_env`) or the content of the file at `path` (its `<key>_file`), blanks around it
    stripped, with where it was read; None when neither is given. A ConfigError, starting with
    `owner`, names the variable or the file, never the secret; `holds` says what it is."""
    if variable is not None:
        value = environ.get(variable)
        if value is None:
            raise ConfigError(
                f"{owner}: {variable} is not set (its {key}_env, the variable that holds its "
                f"{holds})"
            )
        return value.strip(), variable
    if path is not None:
        try:
            value = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(
                f"{owner}: cannot read its {key}_file {path}: {reason or exc}"
            ) from None
        return value.strip(), f"{key}_file {path}"
    return None


def _unset_when_empty(value: object) -> object:
    # `NAME=` in an env file (how the examples show a setting that is off) means "not set".
    return None if value == "" else value


class _Base(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="", case_sensitive=True, extra="ignore")

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", validation_alias="SYNC_LOG_LEVEL"
    )
    # One secret, or several separated by commas while a secret is rotated (docs/security.md):
    # a receiver accepts a request signed with any of them, a consumer signs with the first.
    # Read through shared_secrets and signing_secret, never as the raw text.
    shared_secret_list: str | None = Field(None, validation_alias="SYNC_SHARED_SECRET", repr=False)

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @field_validator("shared_secret_list")
    @classmethod
    def _secrets(cls, value: str | None) -> str | None:
        return _secret_list(value)

    @property
    def shared_secrets(self) -> tuple[str, ...]:
        """Every secret of SYNC_SHARED_SECRET, in order; empty when it is not set."""
        return tuple(self.shared_secret_list.split(",")) if self.shared_secret_list else ()

    @property
    def signing_secret(self) -> str | None:
        """The secret requests are signed with: the first of SYNC_SHARED_SECRET."""
        return self.shared_secrets[0] if self.shared_secrets else None


class SyncSettings(_Base):
    """Settings of a consumer process (`serversync run`) and of the operator commands."""

    database_url: str = Field(validation_alias="DATABASE_URL", min_length=1)
    # Where frontend-sync and recording-upload deliver. No default: a forgotten one must not
    # send a production stream to whatever listens on a local port.
    frontend_base_url: HttpUrl | None = Field(None, validation_alias="FRONTEND_BASE_URL")
    poll_interval_sec: float = Field(
        300.0, gt=0, le=86400, validation_alias="SYNC_POLL_INTERVAL_SEC"
    )
    batch_size: int = Field(100, ge=1, le=50_000, validation_alias="SYNC_BATCH_SIZE")
    timeout_sec: float = Field(30.0, gt=0, le=3600, validation_alias="SYNC_TIMEOUT_SEC")
    # LISTEN for wake-ups; off, the consumer relies on the poll timer alone (e.g. behind a
    # transaction-pooling PgBouncer, where LISTEN does not work).
    listen: bool = Field(True, validation_alias="SYNC_LISTEN")
    # While committed events wait behind an older open transaction, re-read soon (1 ms) and
    # back off to at most this long between re-reads.
    recheck_interval_ms: int = Field(
        100, ge=5, le=5000, validation_alias="SYNC_RECHECK_INTERVAL_MS"
    )
    # After an empty read, read again this much later before asking producers for a NOTIFY: a
    # consumer under steady load keeps polling at this pace and costs producers no NOTIFY.
    linger_ms: int = Field(5, ge=0, le=1000, validation_alias="SYNC_LINGER_MS")
    # While events arrive at SYNC_BATCH_WAIT_MIN_RATE per second or faster, wait this long after
    # a short batch before reading again: fewer, bigger batches (each costs a read, a request and
    # a commit whatever its size), for at most this much added latency. 0 never waits.
    batch_wait_ms: int = Field(20, ge=0, le=5000, validation_alias="SYNC_BATCH_WAIT_MS")
    batch_wait_min_rate: float = Field(
        2000.0, ge=0, le=10_000_000, validation_alias="SYNC_BATCH_WAIT_MIN_RATE"
    )
    # How often a standby tries to take over, and how often the leader checks its lock.
    standby_interval_sec: float = Field(
        1.0, gt=0, le=60, validation_alias="SYNC_STANDBY_INTERVAL_SEC"
    )
    retry_initial_sec: float = Field(2.0, gt=0, le=3600, validation_alias="SYNC_RETRY_INITIAL_SEC")
    retry_max_sec: float = Field(256.0, gt=0, le=86400, validation_alias="SYNC_RETRY_MAX_SEC")
    # Attempts while the receiver is unavailable before a batch is parked in the DLQ. 0 (the
    # default) never gives up: an ordered stream waits out an outage of any length rather than
    # deliver later events ahead of parked ones. Opt in only where gaps are acceptable.
    max_attempts: int = Field(0, ge=0, le=1000, validation_alias="SYNC_MAX_ATTEMPTS")
    # Operator retries of a parked event before it is DEAD.
    dlq_max_retries: int = Field(3, ge=0, le=1000, validation_alias="SYNC_DLQ_MAX_RETRIES")
    # SYNC_SHARED_SECRET (in _Base): signs every request to the receiver (HMAC-SHA256, see
    # consumer/wire/signing.py) with its first secret.
    # The consumer process's HTTP port: /healthz, /readyz, /metrics, and the DLQ admin API
    # (off unless SYNC_ADMIN_TOKEN is set). Port 0 picks a free port (logged at start).
    http_host: str = Field("127.0.0.1", validation_alias="SYNC_HTTP_HOST")
    http_port: int = Field(9464, ge=0, le=65535, validation_alias="SYNC_HTTP_PORT")
    admin_token: str | None = Field(None, min_length=16, validation_alias="SYNC_ADMIN_TOKEN")
    shutdown_timeout_sec: float = Field(
        5.0, gt=0, le=300, validation_alias="SYNC_SHUTDOWN_TIMEOUT_SEC"
    )
    # How often the backlog, lag, DLQ and outbox gauges are read from the database.
    metrics_interval_sec: float = Field(
        5.0, gt=0, le=3600, validation_alias="SYNC_METRICS_INTERVAL_SEC"
    )
    # recording-upload: where the backend keeps <callId>/mixed.wav and meta.json.
    recordings_dir: Path = Field(Path("storage/recordings"), validation_alias="RECORDINGS_DIR")
    # recording-upload: uploads in flight at once (the offset still moves in order).
    upload_concurrency: int = Field(4, ge=1, le=64, validation_alias="SYNC_UPLOAD_CONCURRENCY")
    # frontend-sync: batches delivered at once while a backlog drains (offsets move in order).
    max_in_flight: int = Field(2, ge=1, le=16, validation_alias="SYNC_MAX_IN_FLIGHT")
    # Read the next batch while the last full one is being delivered, and while a short one's
    # offset commits.
    read_ahead: bool = Field(True, validation_alias="SYNC_READ_AHEAD")
    # Consumers an operator declares (consumer/app/declared.py): `serversync run NAME` finds NAME
    # there when it is no built-in one. Read when a consumer is resolved, checked whole.
    consumers_file: Path | None = Field(None, validation_alias="SYNC_CONSUMERS_FILE")
    # The node the built-in consumers deliver to: an event whose origin is that node came from
    # it and is not sent back (no echo). A declared consumer names its own (`target_node`).
    target_node: str | None = Field(
        None, pattern=CONSUMER_NAME, validation_alias="SYNC_TARGET_NODE"
    )

    # Where a consumer registered for the first time starts (consumer/store/new_consumers.py):
    # "auto", the outbox's start while it holds the whole history, else its current end with a
    # snapshot of the tables the consumer carries; "now", the current end with no snapshot;
    # "earliest", the outbox's start with no snapshot. `run --from-now/--from-earliest` override
    # it; a registered consumer goes on from its offset whatever it says.
    start_from: Literal["auto", "now", "earliest"] = Field("auto", validation_alias="SYNC_START")

    @field_validator("consumers_file", "target_node", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        return _unset_when_empty(value)

    @field_validator("start_from", mode="before")
    @classmethod
    def _lower(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def frontend_url(self) -> str:
        """FRONTEND_BASE_URL without a trailing slash; ConfigError when it is not set (only the
        consumers and commands that deliver to the frontend need it)."""
        if self.frontend_base_url is None:
            raise ConfigError(
                "FRONTEND_BASE_URL is not set (the frontend that frontend-sync and "
                "recording-upload deliver to, e.g. https://frontend.example.com)"
            )
        return str(self.frontend_base_url).rstrip("/")


class ReceiverSettings(_Base):
    """Settings of the reference receiver (`serversync ingest-server`)."""

    frontend_database_url: str = Field(
        validation_alias=AliasChoices("FRONTEND_DATABASE_URL"), min_length=1
    )
    host: str = Field("127.0.0.1", validation_alias="INGEST_HOST")
    port: int = Field(8080, ge=0, le=65535, validation_alias="INGEST_PORT")
    # SYNC_SHARED_SECRET (in _Base): requests signed with any of its secrets are accepted.
    # Without a secret the receiver only starts with --insecure (local demos).
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, validation_alias="INGEST_MAX_BODY_BYTES")
    # Uploaded recordings land here, as <callLogId>/<recordingId>.wav and .meta.json.
    recordings_store_dir: Path = Field(
        Path("storage/frontend-recordings"), validation_alias="RECORDINGS_STORE_DIR"
    )
    # The largest recording the receiver takes (larger uploads get 413 and are parked).
    max_recording_bytes: int = Field(
        1024 * 1024 * 1024, ge=1024, validation_alias="INGEST_MAX_RECORDING_BYTES"
    )
    # Recording uploads streamed at once; one more is answered 503 with Retry-After (the
    # consumer tries it again). Each holds a connection and a file being written.
    max_concurrent_uploads: int = Field(
        4, ge=1, le=1024, validation_alias="INGEST_MAX_CONCURRENT_UPLOADS"
    )
    # A recording upload whose body stops arriving for this long is abandoned (408), nothing
    # of it kept.
    body_idle_timeout_sec: float = Field(
        30.0, gt=0, le=3600, validation_alias="INGEST_BODY_IDLE_TIMEOUT_SEC"
    )
    # A recording upload of N bytes must arrive whole within INGEST_BODY_IDLE_TIMEOUT_SEC + N / this
    # rate, else it is abandoned (408), nothing of it kept: a body trickling in never holds an
    # upload slot for long. At most 1 MiB/s, the rate the consumer allows itself
    # (MIN_UPLOAD_RATE in sinks/recording_upload.py).
    min_upload_bytes_per_sec: int = Field(
        64 * 1024, ge=1024, le=1024 * 1024, validation_alias="INGEST_MIN_UPLOAD_BYTES_PER_SEC"
    )
    # Batch bodies (POST /api/ingest/sync) read at once; one more is answered 503 with
    # Retry-After. Each may hold up to INGEST_MAX_BODY_BYTES in memory while it arrives, and
    # must arrive within INGEST_BODY_IDLE_TIMEOUT_SEC + its size / INGEST_MIN_UPLOAD_BYTES_PER_SEC.
    max_concurrent_bodies: int = Field(
        8, ge=1, le=1024, validation_alias="INGEST_MAX_CONCURRENT_BODIES"
    )
    # Free space kept on RECORDINGS_STORE_DIR's filesystem: an upload that would leave less
    # (counting what the uploads in flight declared) is answered 507 with Retry-After.
    min_free_bytes: int = Field(1024 * 1024 * 1024, ge=0, validation_alias="INGEST_MIN_FREE_BYTES")
    # The base of the fileUrl answered for an upload; by default the URL the request came to.
    public_base_url: HttpUrl | None = Field(None, validation_alias="INGEST_PUBLIC_BASE_URL")
    # The mapping of entity types to tables of the receiving database (TOML; consumer/receiver/
    # mapping.py): those types are applied into their tables, the others go to ingest.entities.
    # Unset: every type goes to ingest.entities.
    mapping_file: Path | None = Field(None, validation_alias="INGEST_MAPPING_FILE")

    @field_validator("mapping_file", mode="before")
    @classmethod
    def _no_mapping_when_empty(cls, value: object) -> object:
        # `INGEST_MAPPING_FILE=` in an env file (how the example shows it unset) is "not set".
        return None if value == "" else value


def _one_line(exc: ValidationError, model: type[BaseSettings]) -> str:
    error = exc.errors()[0]
    field = str(error["loc"][0]) if error["loc"] else "?"
    info = model.model_fields.get(field)
    alias = info.validation_alias if info is not None else None
    if isinstance(alias, AliasChoices):
        alias = str(alias.choices[0])
    name = alias if isinstance(alias, str) else field
    if error["type"] == "missing":
        return f"{name} is not set"
    if name in _UNECHOED:
        return f"{name}: {error['msg']}"
    given = error.get("input")
    # The value is echoed to help, but a URL may carry credentials: mask them.
    return mask_secrets(f"{name}={given!s}: {error['msg']}")


S = TypeVar("S", bound=BaseSettings)


def load(model: type[S], **overrides: object) -> S:
    """Read and validate `model` from the environment; raise ConfigError naming the variable."""
    try:
        return model(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        raise ConfigError(_one_line(exc, model)) from None


def runtime_config(settings: SyncSettings) -> RuntimeConfig:
    """The consumer loop's knobs from the settings: the one place a RuntimeConfig is built, so
    the loop runs with SyncSettings' defaults and nothing else (tests build theirs here too)."""
    return RuntimeConfig(
        batch_size=settings.batch_size,
        poll_interval=settings.poll_interval_sec,
        recheck_interval=settings.recheck_interval_ms / 1000,
        standby_interval=settings.standby_interval_sec,
        retry_initial=settings.retry_initial_sec,
        retry_max=settings.retry_max_sec,
        shutdown_timeout=settings.shutdown_timeout_sec,
        linger=settings.linger_ms / 1000,
        max_attempts=settings.max_attempts,
        dlq_max_retries=settings.dlq_max_retries,
        max_in_flight=settings.max_in_flight,
        read_ahead=settings.read_ahead,
        batch_wait=settings.batch_wait_ms / 1000,
        batch_wait_min_rate=settings.batch_wait_min_rate,
    )
