"""Who is calling: the admin key (env var named by [server] api_key_env) or a project key.

- admin key, or a key created with --admin: sees every project's jobs.
- project key: sees only its project's jobs; another project's id answers 404, not 403, so ids
  of other tenants cannot be probed.
- no admin key set and no keys in the table: the API is open (everyone is admin), and the app
  logs a loud warning at start-up. Creating the first key closes it, without a restart.

Each caller carries its allowance of classes of work (api/class_allowance.py): an admin's is
unlimited, a project key's is what its row says (docs/priority.md).
"""

from __future__ import annotations

import hmac
import uuid
from dataclasses import dataclass

from sqlalchemy.orm import Session, sessionmaker

from tokenloom.api.class_allowance import UNLIMITED, ClassAllowance
from tokenloom.api.errors import ApiError
from tokenloom.store.api_keys.key_queries import any_keys, find_key

DEFAULT_PROJECT = "default"  # where the admin's (and an open API's) jobs go


@dataclass(slots=True, frozen=True)
class Principal:
    project: str
    is_admin: bool
    key_id: uuid.UUID | None = None
    allowance: ClassAllowance = ClassAllowance()  # which classes of work and priorities it may ask for


ADMIN = Principal(DEFAULT_PROJECT, is_admin=True, allowance=UNLIMITED)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def authenticate(sessions: sessionmaker[Session], admin_key: str | None, authorization: str | None) -> Principal:
    token = bearer_token(authorization)
    if token is not None and admin_key and hmac.compare_digest(token.encode(), admin_key.encode()):
        return ADMIN
    key = find_key(sessions, token) if token is not None else None
    if key is not None:
        if key.revoked_at is not None:
            raise ApiError(
                403,
                f"API key {key.key_prefix}... was revoked: ask for a new one (`tokenloom keys create --project ...`)",
                code="key_revoked",
            )
        allowance = (
            UNLIMITED
            if key.is_admin
            else ClassAllowance(key.allow_priority_tier, key.min_priority, key_prefix=key.key_prefix)
        )
        return Principal(key.project, key.is_admin, key.id, allowance)
    if not admin_key and not any_keys(sessions):
        return ADMIN  # open API: no key configured at all
    if token is None:
        raise ApiError(
            401,
            "missing API key: send the header 'Authorization: Bearer <key>' (the admin key is "
            "in the env var named by [server] api_key_env; project keys come from "
            "`tokenloom keys create`)",
            code="missing_api_key",
        )
    raise ApiError(
        401,
        "invalid API key: check the key you send in 'Authorization: Bearer <key>' "
        "(`tokenloom keys list` shows the prefixes of valid keys)",
        code="invalid_api_key",
    )
