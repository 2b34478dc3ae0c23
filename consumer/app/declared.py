"""Consumers an operator declares: the TOML file named by SYNC_CONSUMERS_FILE.

    [consumers.settings-sync]
    sink = "json"                  # json (POST /api/ingest/sync) | recording-upload | null
                                   # | jetstream (its own keys: jetstream_kind.py)
    url = "http://backend-host:8080"
    secret_env = "SETTINGS_SYNC_SECRET"    # or secret_file = "/etc/serversync/settings.secret"
    entity_types = ["registered_number", "routing_rule"]
    target_node = "backend"        # events whose origin is this node are not sent (no echo)

The file is checked whole each time it is read: an unknown key, a bad name, a missing url, a
bad target node is a ConfigError of one line naming the file and the consumer. A secret is read
only for the consumer that needs it (its variable is in that consumer's environment alone),
checked by the rules of SYNC_SHARED_SECRET, and never appears in a message or a repr.
kinds.py turns each declaration into a ConsumerKind.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError, model_validator

from consumer.app.jetstream_kind import JetStreamConsumer
from consumer.app.settings import CONSUMER_NAME, ENV_NAME, ConfigError, parse_secrets, read_secret

__all__ = ["ConsumersFile", "Declaration", "DeclaredConsumer", "JetStreamConsumer", "load"]

# A table of sink "jetstream" is checked by JetStreamConsumer (load); it is named here too, so
# the message for a sink that does not exist lists every one.
SinkName = Literal["json", "recording-upload", "null", "jetstream"]


class DeclaredConsumer(BaseModel):
    """One `[consumers.NAME]` table."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sink: SinkName = "json"
    # The receiver's base URL (the sink adds its path). Required unless the sink is null.
    url: HttpUrl | None = None
    # Where its shared secret is: an environment variable, or a file (its content, blanks
    # around it ignored). Neither: SYNC_SHARED_SECRET, as for the built-in consumers.
    secret_env: str | None = Field(None, pattern=ENV_NAME)
    secret_file: Path | None = None
    # The entity types it sends; the others are passed over. Absent: every type.
    entity_types: tuple[str, ...] | None = Field(None, min_length=1)
    # The node it delivers to: an event whose origin is that node is not sent back.
    target_node: str | None = Field(None, pattern=CONSUMER_NAME)

    @model_validator(mode="after")
    def _consistent(self) -> DeclaredConsumer:
        if self.url is None and self.sink != "null":
            raise ValueError(f'url is required for sink "{self.sink}" (the receiver\'s base URL)')
        if self.secret_env is not None and self.secret_file is not None:
            raise ValueError("give secret_env or secret_file, not both")
        if self.entity_types is not None and not all(t.strip() for t in self.entity_types):
            raise ValueError("entity_types holds an empty name")
        return self

    @property
    def base_url(self) -> str:
        """The url without a trailing slash (a null sink has none: empty)."""
        return str(self.url).rstrip("/") if self.url is not None else ""

    @property
    def types(self) -> frozenset[str] | None:
        """entity_types as a set; None: every type."""
        return frozenset(self.entity_types) if self.entity_types is not None else None

    def signing_secret(
        self, name: str, fallback: str | None, environ: Mapping[str, str] | None = None
    ) -> str | None:
        """The secret this consumer signs with (the first of its list), read now; `fallback`
        (SYNC_SHARED_SECRET's) when the declaration names none. A ConfigError names the
        variable or the file, never the secret."""
        owner = f"consumer {name}"
        found = read_secret(
            owner,
            "secret",
            self.secret_env,
            self.secret_file,
            os.environ if environ is None else environ,
            holds="shared secret",
        )
        if found is None:
            return fallback
        value, source = found
        return parse_secrets(value, f"{owner}: {source}")[0]


class ConsumersFile(BaseModel):
    """The whole file: `[consumers.NAME]` tables and nothing else."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    consumers: dict[str, DeclaredConsumer] = Field(default_factory=dict)


# A consumer of sink "jetstream" has keys of its own (servers, stream, ...): its table is
# checked by JetStreamConsumer instead.
Declaration = DeclaredConsumer | JetStreamConsumer


def load(path: Path) -> dict[str, Declaration]:
    """The consumers `path` declares, by name, checked; a ConfigError of one line otherwise."""
    where = f"SYNC_CONSUMERS_FILE ({path})"
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {_one_line(str(exc))}") from None
    consumers = data.get("consumers")
    if isinstance(consumers, dict):
        for name in consumers:
            # The rule of sync.consumer_offsets: a name it refuses could never run.
            if not re.fullmatch(CONSUMER_NAME.strip("^$"), name):
                raise ConfigError(
                    f"{where}: consumer name {name!r} does not match {CONSUMER_NAME} "
                    "(lower-case letters, digits, '-' and '_', starting with a letter)"
                )
        jetstream = {
            name: table
            for name, table in consumers.items()
            if isinstance(table, dict) and table.get("sink") == "jetstream"
        }
        others = {name: table for name, table in consumers.items() if name not in jetstream}
        data = {**data, "consumers": others}
    else:
        jetstream = {}
    try:
        found: dict[str, Declaration] = dict(ConsumersFile.model_validate(data).consumers)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_first_error(exc)}") from None
    for name, table in jetstream.items():
        try:
            found[name] = JetStreamConsumer.model_validate(table)
        except ValidationError as exc:
            raise ConfigError(f"{where}: {_first_error(exc, ('consumers', name))}") from None
    # In the file's order.
    return {name: found[name] for name in consumers} if isinstance(consumers, dict) else found


def _first_error(exc: ValidationError, within: tuple[str, ...] = ()) -> str:
    """The first error as `consumers.NAME: what is wrong`, without the value given (a url may
    hold a password); `within`: where the validated table is in the file."""
    error = exc.errors()[0]
    loc = [*within, *(str(part) for part in error["loc"])]
    if error["type"] == "extra_forbidden":
        place = ".".join(loc[:-1]) or "the file"
        return f"{place}: unknown key {loc[-1]!r}"
    place = ".".join(loc) or "the file"
    message: str = error["msg"]
    message = message.removeprefix("Value error, ")
    return _one_line(f"{place}: {message}")


def _one_line(text: str) -> str:
    return " ".join(text.split())
