"""API key material: random, prefixed, shown once; only a keyed hash (HMAC-SHA256) is ever stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "lpx_"
ADMIN_KEY_PREFIX = "lpx_admin_"
DISPLAY_PREFIX_LEN = 12


def generate_key(*, admin: bool = False) -> str:
    return (ADMIN_KEY_PREFIX if admin else KEY_PREFIX) + secrets.token_urlsafe(32)


def hash_key(secret_key: str, key: str) -> str:
    # Keyed so a leaked database alone cannot be used to test guesses offline.
    return hmac.new(secret_key.encode(), key.encode(), hashlib.sha256).hexdigest()


def display_prefix(key: str) -> str:
    if key.startswith(ADMIN_KEY_PREFIX):
        return key[: len(ADMIN_KEY_PREFIX) + 4]
    return key[:DISPLAY_PREFIX_LEN]


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()
