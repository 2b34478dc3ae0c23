"""The SQL files shipped with serversync: migrations and the named queries of sql/queries.sql."""

from __future__ import annotations

import functools
import re
from pathlib import Path

_NAME_LINE = re.compile(r"^-- name: ([a-z_][a-z0-9_]*)\s*$", re.MULTILINE)


def sql_dir() -> Path:
    """The folder holding serversync's SQL: packaged in a wheel, or sql/ of a source checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_sql", package.parent / "sql"):
        if (candidate / "queries.sql").is_file():
            return candidate
    raise FileNotFoundError(
        f"serversync's SQL files are missing (looked in {package}/_sql and ../sql)"
    )


def parse_named_queries(text: str) -> dict[str, str]:
    """Split a file of `-- name: NAME` blocks into a mapping of name to statement."""
    matches = list(_NAME_LINE.finditer(text))
    queries: dict[str, str] = {}
    for i, match in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        lines = text[match.end() : end].strip().splitlines()
        # The comment block before a statement is for readers of this file and is not sent:
        # psycopg converts a statement of over 4 KB afresh at every execution instead of
        # caching the conversion (the gap-safe read is one, read many times a second), and
        # pg_stat_activity shows the statement itself.
        while lines and lines[0].lstrip().startswith("--"):
            del lines[0]
        body = "\n".join(lines).strip()
        if match.group(1) in queries:
            raise ValueError(f"query {match.group(1)!r} is defined twice")
        queries[match.group(1)] = body
    return queries


@functools.cache
def _queries() -> dict[str, str]:
    return parse_named_queries((sql_dir() / "queries.sql").read_text(encoding="utf-8"))


def query(name: str) -> str:
    """The named query `name` from sql/queries.sql."""
    try:
        return _queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in sql/queries.sql") from None
