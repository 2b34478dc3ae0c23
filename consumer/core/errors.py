"""Errors as text fit for one line of a log or a status field."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """The first line of `exc`'s message, or the name of its type when the message is empty.

    PostgreSQL's errors carry DETAIL, HINT and CONTEXT lines after the message: a log line or a
    status field keeps only the first, which says what failed.
    """
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
