"""FastAPI dependencies as `Annotated` aliases: the shared state and the authenticated caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from tokenloom.api.auth import Principal, authenticate
from tokenloom.api.state import ApiState


def get_state(request: Request) -> ApiState:
    return request.app.state.tokenloom


def get_principal(
    request: Request,
    authorization: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Principal:
    # A plain `def`: FastAPI runs it in the thread pool, so the key lookup never blocks the loop.
    state = get_state(request)
    return authenticate(state.sessions, state.admin_key, authorization)


State = Annotated[ApiState, Depends(get_state)]
Caller = Annotated[Principal, Depends(get_principal)]
