"""API-key rows (the api_keys table): create, list, revoke, grant, and look up the key a request presents.

A key is stored as its hash and prefix (store/api_keys/key_secrets.py); `create_key` returns the
key itself once, and nothing can show it again. Each key also holds its allowance of classes of
work (`allow_priority_tier`, `min_priority`: docs/priority.md); what a request may do with it is
the API's decision (api/class_allowance.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.store.api_keys.key_secrets import generate_key, hash_key, key_prefix
from tokenloom.store.jobs.work_class import DEFAULT_MIN_PRIORITY, PRIORITY_LIMIT
from tokenloom.store.models import ApiKey, utcnow


@dataclass(slots=True, frozen=True)
class KeyInfo:
    """A key's row as listings and callers see it: everything but its hash."""

    id: uuid.UUID
    project: str
    name: str
    key_prefix: str
    is_admin: bool
    created_at: datetime
    revoked_at: datetime | None
    allow_priority_tier: bool = False  # `service_tier: "priority"` may lift /v1/jobs work into the interactive class
    min_priority: int = DEFAULT_MIN_PRIORITY  # the most important `priority` it may set

    @classmethod
    def of(cls, row: ApiKey) -> "KeyInfo":
        return cls(
            id=row.id,
            project=row.project,
            name=row.name,
            key_prefix=row.key_prefix,
            is_admin=row.is_admin,
            created_at=row.created_at,
            revoked_at=row.revoked_at,
            allow_priority_tier=row.allow_priority_tier,
            min_priority=row.min_priority,
        )


def check_min_priority(min_priority: int) -> int:
    """A key's priority floor lies in [-PRIORITY_LIMIT, 0]: above 0 its own default requests would be refused."""
    if not -PRIORITY_LIMIT <= min_priority <= 0:
        raise ValueError(
            f"min_priority {min_priority} is outside [{-PRIORITY_LIMIT}, 0]: 0 keeps a key from preempting "
            f"other projects, {-PRIORITY_LIMIT} lets it use every priority"
        )
    return min_priority


def create_key(
    sessions: sessionmaker[Session],
    project: str,
    name: str = "",
    is_admin: bool = False,
    *,
    allow_priority_tier: bool = False,
    min_priority: int = DEFAULT_MIN_PRIORITY,
) -> tuple[str, KeyInfo]:
    """Store a new key's hash; returns (the key, shown once and never again, its listing).
    The allowance defaults to what any tenant may safely have (docs/priority.md)."""
    key = generate_key()
    row = ApiKey(
        project=project,
        name=name or project,
        key_prefix=key_prefix(key),
        key_hash=hash_key(key),
        is_admin=is_admin,
        allow_priority_tier=allow_priority_tier,
        min_priority=check_min_priority(min_priority),
    )
    with sessions.begin() as session:
        session.add(row)
    return key, KeyInfo.of(row)


def list_keys(sessions: sessionmaker[Session]) -> list[KeyInfo]:
    """Every key, revoked ones included, by project then age."""
    with sessions() as session:
        rows = session.execute(select(ApiKey).order_by(ApiKey.project, ApiKey.created_at)).scalars()
        return [KeyInfo.of(row) for row in rows]


def revoke_key(sessions: sessionmaker[Session], id_or_prefix: str) -> KeyInfo:
    """Revoke by id or by the listed prefix; LookupError if none or several keys match."""
    with sessions.begin() as session:
        row = _one(session, id_or_prefix)
        row.revoked_at = row.revoked_at or utcnow()
        return KeyInfo.of(row)


def grant_key(
    sessions: sessionmaker[Session],
    id_or_prefix: str,
    *,
    allow_priority_tier: bool | None = None,
    min_priority: int | None = None,
) -> KeyInfo:
    """Change a key's allowance of classes of work (None keeps a setting); by id or listed prefix,
    LookupError if none or several keys match. Requests with the key see it at once."""
    if min_priority is not None:
        check_min_priority(min_priority)
    with sessions.begin() as session:
        row = _one(session, id_or_prefix)
        if allow_priority_tier is not None:
            row.allow_priority_tier = allow_priority_tier
        if min_priority is not None:
            row.min_priority = min_priority
        return KeyInfo.of(row)


def _one(session: Session, id_or_prefix: str) -> ApiKey:
    matches = list(session.execute(_match(id_or_prefix)).scalars())
    if not matches:
        raise LookupError(f"no API key with id or prefix {id_or_prefix!r}: see `tokenloom keys list`")
    if len(matches) > 1:
        raise LookupError(f"{len(matches)} keys start with {id_or_prefix!r}: give the key's id instead")
    return matches[0]


def _match(id_or_prefix: str):
    try:
        return select(ApiKey).where(ApiKey.id == uuid.UUID(id_or_prefix))
    except ValueError:
        return select(ApiKey).where(ApiKey.key_prefix == id_or_prefix)


def find_key(sessions: sessionmaker[Session], key: str) -> KeyInfo | None:
    """The row of the key a request presents (revoked or not), found by its hash; None if unknown."""
    with sessions() as session:
        row = session.execute(select(ApiKey).where(ApiKey.key_hash == hash_key(key))).scalar_one_or_none()
        return None if row is None else KeyInfo.of(row)


def any_keys(sessions: sessionmaker[Session]) -> bool:
    """Whether any key exists at all (none, and no admin key: the API is open)."""
    with sessions() as session:
        return session.execute(select(ApiKey.id).limit(1)).first() is not None
