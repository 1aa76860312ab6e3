"""The `Idempotency-Key` request header of the create endpoints, and the lookup-or-create step
they share (store/idempotency.py holds the rows and the race handling).

A replay answers with the first request's rows as they are now, plus `Idempotent-Replayed: true`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, TypeVar

from fastapi import Header
from sqlalchemy.orm import Session, sessionmaker

from tokenloom.api.auth import Principal
from tokenloom.api.errors import ApiError
from tokenloom.store.idempotency import (
    MAX_KEY_LENGTH,
    IdempotencyClaim,
    IdempotencyKeyReusedError,
    KeyTakenError,
    PreviousRequest,
    find_previous,
)

T = TypeVar("T")

IdempotencyKeyHeader = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        description=f"1-{MAX_KEY_LENGTH} characters, unique per request within your project: a retry with the "
        "same key and body returns the first request's result instead of creating another",
    ),
]
REPLAYED_HEADERS = {"Idempotent-Replayed": "true"}


def idempotency_claim(key: str | None, caller: Principal, endpoint: str, body: object) -> IdempotencyClaim | None:
    """None without a key; 400 for a key that is empty, too long or holds control characters."""
    if key is None:
        return None
    if not 0 < len(key) <= MAX_KEY_LENGTH or not key.isprintable():
        raise ApiError(
            400,
            f"Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable characters (got "
            f"{len(key)}): send e.g. a UUID, one per distinct request",
            param="Idempotency-Key",
            code="invalid_idempotency_key",
        )
    return IdempotencyClaim.of(caller.project, key, endpoint, body)


def create_once(
    sessions: sessionmaker[Session],
    claim: IdempotencyClaim | None,
    create: Callable[[], T],
    replay: Callable[[PreviousRequest], T],
) -> tuple[T, bool]:
    """(result, replayed): `create()` (which stores `claim` with its rows), or `replay(previous)`
    when the key was stored already, before this request or by a concurrent one. Blocking: call
    it in the thread pool."""
    if claim is None:
        return create(), False
    try:
        previous = find_previous(sessions, claim)
        if previous is None:
            try:
                return create(), False
            except KeyTakenError:
                previous = find_previous(sessions, claim)
    except IdempotencyKeyReusedError as exc:
        raise ApiError(
            422,
            f"{exc}: send a new key for a new request, or resend the original body to get its result",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        ) from None
    if previous is None:  # the first request's row was pruned between its commit and our read
        raise ApiError(
            409,
            f"Idempotency-Key {claim.key!r} expired while this request ran: retry it",
            param="Idempotency-Key",
            code="idempotency_key_expired",
        )
    return replay(previous), True


def replay_not_found(claim: IdempotencyClaim, what: str) -> ApiError:
    """The key's rows were deleted by retention after the key row was read."""
    return ApiError(
        404,
        f"the {what} created with Idempotency-Key {claim.key!r} was deleted by retention "
        "after the key was read: send the request with a new key",
        param="Idempotency-Key",
        code="idempotency_key_expired",
    )
