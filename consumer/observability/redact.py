"""Masking secrets in anything serversync logs or stores (credentials of the kinds that leak into
error messages, and URL passwords)."""

from __future__ import annotations

import re

MASK = "***"

_SECRETS = [
    # user:password@ in URLs and DSNs. Linear on any text: the scheme is bounded (else every
    # position of a long word would rescan the rest of it) and the password stops where an
    # authority must end ('/', '?', '#' cannot stand unencoded in it).
    (re.compile(r"(?i)([a-z][a-z0-9+.-]{0,31}://[^:/@\s]+:)[^@\s/?#]+@"), r"\1***@"),
    (re.compile(r"(?i)(password\s*=\s*)('[^']*'|\S+)"), r"\1***"),
    (re.compile(r"(?i)(bearer\s+)[A-Za-z0-9._~+/=-]+"), r"\1***"),
    (re.compile(r"(?i)(basic\s+)[A-Za-z0-9+/=]{8,}"), r"\1***"),
    # "password": "..." in JSON bodies
    (re.compile(r'(?i)("(?:password|passwd|secret|token|api[_-]?key)"\s*:\s*")[^"]*"'), r'\1***"'),
    (re.compile(r"(?i)((?:api[_-]?key|token|secret)[\"']?\s*[:=]\s*[\"']?)[^\s\"',}]+"), r"\1***"),
    # Credentials with a recognisable shape: GitHub tokens, Anthropic keys, AWS access keys,
    # private keys.
    (re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"), MASK),
    (re.compile(r"sk-ant-api[A-Za-z0-9-]+"), MASK),
    (re.compile(r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"), MASK),
    (
        re.compile(
            r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?(?:-----END [A-Z ]*PRIVATE KEY-----|$)", re.S
        ),
        "-----PRIVATE KEY REDACTED-----",
    ),
]


def mask_secrets(text: str) -> str:
    """The text with passwords, tokens and keys replaced by ***."""
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


# C0 and C1 control characters, DEL, the line and paragraph separators, the bidirectional
# overrides and isolates, and lone surrogates: none may reach a log line or a text column raw (a
# NUL is refused by PostgreSQL's text, a newline or U+2028 forges a log line, an override
# disguises one, a surrogate cannot be encoded as UTF-8).
_UNPRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]+"
)


def printable(text: str) -> str:
    """The text on one line: each run of control characters (newlines, tabs and NUL included)
    and lone surrogates becomes one space, so it is safe to log and to store."""
    return _UNPRINTABLE.sub(" ", text)


def safe_error(text: str) -> str:
    """An error text fit to log and store: secrets masked, on one line, control characters gone,
    no space at either end."""
    return printable(mask_secrets(text)).strip()
