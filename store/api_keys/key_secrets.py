"""An API key's secret: how a key is generated, and the two things of it the api_keys table keeps.

Only a SHA-256 of each key is stored: keys are 256-bit random strings, so a fast unsalted hash
is enough (nothing to brute-force) and lets a request find its key with one indexed lookup.
The first characters (`key_prefix`) are kept in clear so listings can tell keys apart.
"""

from __future__ import annotations

import hashlib
import secrets

KEY_MARKER = "tlk-"
PREFIX_LEN = 12  # "tlk-" + 8 random characters


def generate_key() -> str:
    return KEY_MARKER + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_prefix(key: str) -> str:
    return key[:PREFIX_LEN]
