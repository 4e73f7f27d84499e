"""API keys: `lpx-` + 43 url-safe characters (32 random bytes). Only the sha256 hash is stored.

The hash is what the database looks up (an index on a uniformly random value leaks nothing useful
through timing), and the stored hash is then compared with `hmac.compare_digest`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

KEY_PREFIX = "lpx-"
KEY_BYTES = 32
MIN_KEY_CHARS = len(KEY_PREFIX) + 43  # token_urlsafe(32) gives 43 characters
DISPLAY_CHARS = len(KEY_PREFIX) + 8  # what listings show: enough to tell keys apart, useless to an attacker


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(KEY_BYTES)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def key_prefix(key: str) -> str:
    return key[:DISPLAY_CHARS]


def is_well_formed_key(key: str) -> bool:
    return key.startswith(KEY_PREFIX) and len(key) >= MIN_KEY_CHARS and key.isascii()


def matches(key: str, stored_hash: str) -> bool:
    """Constant-time check of a presented key against a stored hash."""
    return hmac.compare_digest(hash_key(key), stored_hash)
