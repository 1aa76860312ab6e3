"""API keys: generation, hashing and the api_keys table (create, list, revoke, look up).

Only a SHA-256 of each key is stored: keys are 256-bit random strings, so a fast unsalted hash
is enough (nothing to brute-force) and lets a request find its key with one indexed lookup.
The first characters (`key_prefix`) are kept in clear so listings can tell keys apart.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.models import ApiKey, utcnow

KEY_MARKER = "tlk-"
PREFIX_LEN = 12  # "tlk-" + 8 random characters


def generate_key() -> str:
    return KEY_MARKER + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def key_prefix(key: str) -> str:
    return key[:PREFIX_LEN]


@dataclass(slots=True, frozen=True)
class KeyInfo:
    id: uuid.UUID
    project: str
    name: str
    key_prefix: str
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None

    @classmethod
    def of(cls, row: ApiKey) -> "KeyInfo":
        return cls(row.id, row.project, row.name, row.key_prefix, row.is_admin, row.created_at, row.revoked_at)


def create_key(sessions: sessionmaker[Session], project: str, name: str = "", is_admin: bool = False) -> tuple[str, KeyInfo]:
    """Store a new key's hash; returns (the key, shown once and never again, its listing)."""
    key = generate_key()
    row = ApiKey(project=project, name=name or project, key_prefix=key_prefix(key), key_hash=hash_key(key),
                 is_admin=is_admin)
    with sessions.begin() as session:
        session.add(row)
    return key, KeyInfo.of(row)


def list_keys(sessions: sessionmaker[Session]) -> list[KeyInfo]:
    with sessions() as session:
        rows = session.execute(select(ApiKey).order_by(ApiKey.project, ApiKey.created_at)).scalars()
        return [KeyInfo.of(row) for row in rows]


def revoke_key(sessions: sessionmaker[Session], id_or_prefix: str) -> KeyInfo:
    """Revoke by id or by the listed prefix; LookupError if none or several keys match."""
    with sessions.begin() as session:
        matches = list(session.execute(_match(id_or_prefix)).scalars())
        if not matches:
            raise LookupError(f"no API key with id or prefix {id_or_prefix!r}: see `tokenloom keys list`")
        if len(matches) > 1:
            raise LookupError(f"{len(matches)} keys start with {id_or_prefix!r}: give the key's id instead")
        row = matches[0]
        row.revoked_at = row.revoked_at or utcnow()
        return KeyInfo.of(row)


def _match(id_or_prefix: str):
    try:
        return select(ApiKey).where(ApiKey.id == uuid.UUID(id_or_prefix))
    except ValueError:
        return select(ApiKey).where(ApiKey.key_prefix == id_or_prefix)


def find_key(sessions: sessionmaker[Session], key: str) -> KeyInfo | None:
    with sessions() as session:
        row = session.execute(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).scalar_one_or_none()
        return None if row is None else KeyInfo.of(row)


def any_keys(sessions: sessionmaker[Session]) -> bool:
    with sessions() as session:
        return session.execute(select(ApiKey.id).limit(1)).first() is not None
