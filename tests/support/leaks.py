"""Secrets of every kind a log line, an error message or a dead letter might carry, and a check
that none of them leaked (a truncated secret is still a leak)."""

from __future__ import annotations

GITHUB_TOKEN = "ghp_" + "Gh7TokenBody0123456789abcdefGHIJKLmn"
AWS_KEY = "AKIA" + "QX7ZL2M4N6P8R0TV"
ANTHROPIC_KEY = "sk-ant-api03-Anthr0picKeyBody-xyz987"
BEARER_TOKEN = "eyJhbGciOiJIUzI1NiJ9.QmVhcmVyQm9keQ.S1gnatur3Part"  # noqa: S105 - made up
URL_PASSWORD = "UrlPa55wordZz"  # noqa: S105 - made up
DSN_PASSWORD = "DsnPa55wordYy"  # noqa: S105 - made up
API_KEY = "ApiKeyValue7788Qq"
KEY_MATERIAL = "MIIEowIBAAKCAQEAk3yMaterialLine1"
KEY_MATERIAL_2 = "Qm9ndXNLZXlNYXRlcmlhbExpbmUy"

SECRET_LINES = {
    "bearer": f"Authorization: Bearer {BEARER_TOKEN}",
    "url": f"https://svc-user:{URL_PASSWORD}@api.example.com/v1",
    "dsn": f"host=db.internal user=sync password={DSN_PASSWORD} dbname=app",
    "api_key": f"api_key={API_KEY}",
    "github": f"token was {GITHUB_TOKEN}",
    "aws": f"aws access key {AWS_KEY}",
    "anthropic": f"key {ANTHROPIC_KEY}",
    "private_key": (
        "-----BEGIN RSA PRIVATE KEY-----\n"
        f"{KEY_MATERIAL}\n{KEY_MATERIAL_2}\n"
        "-----END RSA PRIVATE KEY-----"
    ),
}

# What must never appear: the secret part of each line (not its harmless prefix).
SECRET_VALUES = [
    BEARER_TOKEN,
    URL_PASSWORD,
    DSN_PASSWORD,
    API_KEY,
    GITHUB_TOKEN.removeprefix("ghp_"),
    AWS_KEY.removeprefix("AKIA"),
    ANTHROPIC_KEY.removeprefix("sk-ant-api03-"),
    KEY_MATERIAL,
    KEY_MATERIAL_2,
]


def leaks(text: str, window: int = 8) -> list[str]:
    """Every secret of which `text` holds `window` or more consecutive characters (a truncated
    secret is still a leak)."""
    found = []
    for secret in SECRET_VALUES:
        pieces = {secret[i : i + window] for i in range(len(secret) - window + 1)}
        if any(piece in text for piece in pieces):
            found.append(secret)
    return found
