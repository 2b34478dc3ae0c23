"""A declared consumer of sink "jetstream": its declaration and the parts of its kind.

    [consumers.events-js]
    sink = "jetstream"
    servers = ["nats://nats-1:4222", "nats://nats-2:4222", "nats://nats-3:4222"]
    user = "serversync"
    password_env = "EVENTS_JS_PASSWORD"   # or password_file; or token_env / token_file;
                                          # or nkey_seed_file
    tls_ca_file = "/etc/serversync/nats-ca.pem"
    stream = "SERVERSYNC"
    subject_prefix = "serversync"         # subjects <prefix>.<entityType>.<op>
    replicas = 3
    retention = "limits"                  # limits | interest | workqueue
    max_age = "7d"                        # absent: messages never expire by age
    duplicate_window = "5m"               # the default: covers a retry at SYNC_RETRY_MAX_SEC

At start the stream is made when it is missing, with exactly these settings, and a stream that
exists with other settings for any of them stops the start with one line naming each difference:
an existing stream is never changed. Secrets are read only by the consumer's own process, from
the variable or file named (never from the declaration itself), and appear in no message and no
repr. Every Nats-Msg-Id starts with the database's node name (or, while it has none, its
system identifier and oid: `database_source`), read at the sink's first delivery. The sink is
consumer/sinks/jetstream.py, imported only when a JetStream consumer runs: the
`jetstream` extra (nats-py) is needed on that machine alone.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

import psycopg
from psycopg_pool import AsyncConnectionPool
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from consumer.app.settings import CONSUMER_NAME, ENV_NAME, ConfigError, SyncSettings, read_secret
from consumer.app.startup import StartupError
from consumer.core.errors import first_line
from consumer.core.events import DeliveryError, Sink
from consumer.store import db
from consumer.store.queries import query

if TYPE_CHECKING:
    from consumer.sinks import jetstream

log = logging.getLogger("serversync")

# A stream name JetStream takes, also as a file name on every server: no '.', '*', '>', blanks
# or path separators.
STREAM_NAME = r"^[A-Za-z0-9_-]{1,255}$"
# One or more subject tokens of letters, digits, '_' and '-'.
SUBJECT_PREFIX = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# The default duplicate window: a batch published again after a retry at the longest delay
# (SYNC_RETRY_MAX_SEC, 256 s) plus the attempt's SYNC_TIMEOUT_SEC (30 s) is still within it.
DEFAULT_DUPLICATE_WINDOW_SEC = 300.0


def parse_duration(value: Any) -> float:
    """A duration as written in a declaration ("90s", "2m", "1h30m", "7d", "500ms") in
    seconds; ValueError for anything else."""
    text = value.strip() if isinstance(value, str) else None
    if not text or _DURATION.sub("", text) != "":
        raise ValueError("must be a duration like 500ms, 90s, 2m, 1h30m or 7d")
    seconds = sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _DURATION.findall(text))
    if seconds <= 0:
        raise ValueError("must be a duration longer than 0")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration)]


class JetStreamConsumer(BaseModel):
    """One `[consumers.NAME]` table with sink = "jetstream"."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sink: Literal["jetstream"]
    # nats:// or tls:// URLs of the cluster's servers (more are learnt from the cluster).
    servers: tuple[str, ...] = Field(min_length=1)
    # One way to log in, or none: user with password_env or password_file; token_env or
    # token_file; nkey_seed_file.
    user: str | None = Field(None, min_length=1)
    password_env: str | None = Field(None, pattern=ENV_NAME)
    password_file: Path | None = None
    token_env: str | None = Field(None, pattern=ENV_NAME)
    token_file: Path | None = None
    nkey_seed_file: Path | None = None
    # TLS: the CA that signed the servers' certificates, and a client certificate if the
    # servers ask for one.
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    stream: str = Field(pattern=STREAM_NAME)
    subject_prefix: str = Field("serversync", pattern=SUBJECT_PREFIX, max_length=200)
    replicas: int = Field(3, ge=1, le=5)
    retention: Literal["limits", "interest", "workqueue"] = "limits"
    # None: messages never expire by age.
    max_age: Duration | None = None
    duplicate_window: Duration = Field(DEFAULT_DUPLICATE_WINDOW_SEC, validate_default=False)
    # As for every declared consumer: the entity types it sends, and the node it delivers to.
    entity_types: tuple[str, ...] | None = Field(None, min_length=1)
    target_node: str | None = Field(None, pattern=CONSUMER_NAME)

    @field_validator("servers")
    @classmethod
    def _server_urls(cls, servers: tuple[str, ...]) -> tuple[str, ...]:
        for number, server in enumerate(servers, 1):
            # The value is never quoted back: a URL may carry a password.
            try:
                parts = urlsplit(server)
                _ = parts.port
            except ValueError:
                raise ValueError(f"server {number} is not a URL") from None
            if parts.scheme not in ("nats", "tls") or not parts.hostname:
                raise ValueError(
                    f"server {number} is not a nats://host:port or tls://host:port URL"
                )
            if parts.username is not None or parts.password is not None:
                raise ValueError(
                    f"server {number} has credentials in its URL: give them as user and "
                    "password_env/password_file, token_env/token_file or nkey_seed_file"
                )
            if parts.path not in ("", "/") or parts.query or parts.fragment:
                raise ValueError(f"server {number} has a path or query: give host:port only")
        return servers

    @model_validator(mode="after")
    def _consistent(self) -> JetStreamConsumer:
        if self.password_env is not None and self.password_file is not None:
            raise ValueError("give password_env or password_file, not both")
        if self.token_env is not None and self.token_file is not None:
            raise ValueError("give token_env or token_file, not both")
        has_password = self.password_env is not None or self.password_file is not None
        if has_password != (self.user is not None):
            raise ValueError("user goes with password_env or password_file")
        ways = [
            self.user is not None,
            self.token_env is not None or self.token_file is not None,
            self.nkey_seed_file is not None,
        ]
        if sum(ways) > 1:
            raise ValueError("give one way to log in: user and password, a token, or an nkey")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together")
        if self.max_age is not None and self.duplicate_window > self.max_age:
            raise ValueError("duplicate_window (5m unless declared) may not be longer than max_age")
        if self.entity_types is not None and not all(t.strip() for t in self.entity_types):
            raise ValueError("entity_types holds an empty name")
        return self

    @property
    def types(self) -> frozenset[str] | None:
        """entity_types as a set; None: every type."""
        return frozenset(self.entity_types) if self.entity_types is not None else None

    def secrets(
        self, name: str, environ: Mapping[str, str] | None = None
    ) -> tuple[str | None, str | None]:
        """(password, token), read now from the variable or file named; a ConfigError names the
        variable or the file, never the secret."""
        env = os.environ if environ is None else environ
        password = _secret(name, "password", self.password_env, self.password_file, env)
        token = _secret(name, "token", self.token_env, self.token_file, env)
        return password, token


def _secret(
    name: str, what: str, variable: str | None, path: Path | None, env: Mapping[str, str]
) -> str | None:
    """The secret in `variable` or the file at `path` (blanks around it ignored), or None when
    neither is given; an empty one is a ConfigError."""
    owner = f"consumer {name}"
    found = read_secret(owner, what, variable, path, env, holds=what)
    if found is None:
        return None
    value, source = found
    if not value:
        raise ConfigError(f"{owner}: {source} is empty (its {what})")
    return value


async def database_source(dsn: str, consumer: str) -> str:
    """What starts the Nats-Msg-Id of every event of this database (jetstream.message_id): its
    node name, or `<system identifier>.<oid>` while it has none. Either stays the same on a
    physical replica that takes over, and differs between any two databases, so two databases
    whose consumers share a name and a stream never share an id. A DeliveryError (it passes)
    when the database cannot be read."""
    try:
        async with await db.connect(dsn, f"run:{consumer}:source") as conn:
            row = await (await conn.execute(query("jetstream_source"))).fetchone()
    except psycopg.Error as exc:
        raise DeliveryError(
            f"cannot read this database's node name: {first_line(exc)}", code="DB_UNAVAILABLE"
        ) from None
    if row is None:
        raise DeliveryError("this database's node name reads as no row", code="DB_UNAVAILABLE")
    node, system_identifier, oid = row
    return str(node) if node is not None else f"{system_identifier}.{oid}"


def _readable(name: str, what: str, path: Path | None) -> None:
    if path is None:
        return
    try:
        with path.open("rb") as file:
            file.read(1)
    except OSError as exc:
        raise ConfigError(
            f"consumer {name}: cannot read its {what} {path}: {exc.strerror}"
        ) from None


def _require_nats() -> None:
    """A ConfigError when nats-py (the `jetstream` extra) is not installed."""
    if importlib.util.find_spec("nats") is None:
        raise ConfigError(
            "sink jetstream needs nats-py, which is not installed: install serversync with its "
            "`jetstream` extra (pip install 'serversync[jetstream]')"
        )


class JetStreamHooks:
    """The parts of a JetStream consumer's kind (kinds.py puts them in a ConsumerKind)."""

    def __init__(self, name: str, consumer: JetStreamConsumer) -> None:
        self.name = name
        self.consumer = consumer

    def check_settings(self, _settings: SyncSettings) -> None:
        """Before anything else: nats-py is there, every secret and file can be read and the
        TLS files load (a ConfigError of one line otherwise)."""
        _require_nats()
        consumer = self.consumer
        consumer.secrets(self.name)
        _readable(self.name, "nkey_seed_file", consumer.nkey_seed_file)
        for what in ("tls_ca_file", "tls_cert_file", "tls_key_file"):
            _readable(self.name, what, getattr(consumer, what))
        try:
            self.connection(timeout=1.0).tls_context()
        except (OSError, ValueError) as exc:
            # ssl.SSLError is an OSError; its text names what is wrong, never a key's content.
            raise ConfigError(
                f"consumer {self.name}: cannot load its TLS files: {type(exc).__name__}: "
                f"{getattr(exc, 'reason', None) or exc}"
            ) from None

    def connection(self, *, timeout: float) -> jetstream.JetStreamConnection:
        """Where and how it connects, with its secrets read now."""
        from consumer.sinks import jetstream  # noqa: PLC0415 - nats-py only where it is used

        consumer = self.consumer
        password, token = consumer.secrets(self.name)

        def text(path: Path | None) -> str | None:
            return str(path) if path is not None else None

        return jetstream.JetStreamConnection(
            servers=consumer.servers,
            user=consumer.user,
            password=password,
            token=token,
            nkey_seed_file=text(consumer.nkey_seed_file),
            tls_ca_file=text(consumer.tls_ca_file),
            tls_cert_file=text(consumer.tls_cert_file),
            tls_key_file=text(consumer.tls_key_file),
            connect_timeout=min(timeout, 5.0),
        )

    def spec(self) -> jetstream.StreamSpec:
        """The stream it publishes to, with the declared settings."""
        from consumer.sinks import jetstream  # noqa: PLC0415 - nats-py only where it is used

        consumer = self.consumer
        return jetstream.StreamSpec(
            name=consumer.stream,
            subject_prefix=consumer.subject_prefix,
            replicas=consumer.replicas,
            retention=consumer.retention,
            max_age=consumer.max_age or 0.0,
            duplicate_window=consumer.duplicate_window,
        )

    def sink(self, settings: SyncSettings, _pool: AsyncConnectionPool[Any] | None) -> Sink:
        """A new sink (the running consumer's, or one that redelivers parked events)."""
        _require_nats()
        from consumer.sinks import jetstream  # noqa: PLC0415 - nats-py only where it is used

        return jetstream.JetStreamSink(
            self.name,
            connection=self.connection(timeout=settings.timeout_sec),
            stream=self.spec(),
            timeout_sec=settings.timeout_sec,
            source=functools.partial(database_source, settings.database_url, self.name),
        )

    async def check(self, settings: SyncSettings) -> None:
        """Before the consumer starts: the stream exists with the declared settings, made now
        if it was missing. A stream with other settings is a ConfigError naming each
        difference; a cluster that cannot be reached or refuses is a StartupError."""
        _require_nats()
        from consumer.sinks import jetstream  # noqa: PLC0415 - nats-py only where it is used

        spec = self.spec()
        try:
            outcome = await jetstream.prepare_stream(
                self.connection(timeout=settings.timeout_sec),
                spec,
                consumer=self.name,
                timeout=settings.timeout_sec,
            )
        except jetstream.StreamMismatchError as exc:
            raise ConfigError(f"consumer {self.name}: {exc}") from None
        except jetstream.JetStreamError as exc:
            raise StartupError(f"consumer {self.name}: {exc}") from None
        log.info(
            "consumer %s: stream %s %s (subjects %s, %d replicas, retention %s, max_age %s, "
            "duplicate_window %s)",
            self.name,
            spec.name,
            "created" if outcome == "created" else "found with the declared settings",
            spec.subject_filter,
            spec.replicas,
            spec.retention,
            jetstream.format_duration(spec.max_age),
            jetstream.format_duration(spec.duplicate_window),
        )
