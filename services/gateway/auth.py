"""Who is calling: `Authorization: Bearer <key>` checked against the key file (shared/wire/api_keys.py), or nobody when
no file is configured. Limits per key are limits.py's job.
"""

from __future__ import annotations

from services.gateway.errors import unauthorized
from shared.wire.api_keys import ApiKey, ApiKeys

OPEN_PATHS = frozenset({"/health", "/live", "/metrics", "/openapi.json"})  # health checks and scrapers hold no key


def needs_key(path: str) -> bool:
    """Everything but health, liveness, metrics and the API document."""
    return path not in OPEN_PATHS


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header (the scheme in any case), else None."""
    if header is None:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def authenticate(keys: ApiKeys | None, header: str | None) -> ApiKey | None:
    """The caller's key; None when the gateway has no key file (every caller is welcome).

    Raises:
        ApiError: (401 `invalid_api_key`) no bearer token, or one that matches no key.
    """
    if keys is None:
        return None
    token = bearer_token(header)
    if token is None:
        raise unauthorized("no API key: send the header 'Authorization: Bearer <key>'")
    key = keys.find(token)
    if key is None:
        raise unauthorized("the API key is not valid")
    return key
