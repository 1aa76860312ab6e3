"""Probes. /healthz (and /health, vLLM's name): the process answers. /readyz: it can do work
right now. /version: which tokenloom this is.

Ready means all three: the database answers `SELECT 1`, Redis answers PING, and at least one
live Celery worker consumes this model's queue. The worker check is Celery's own remote control
(`inspect().active_queues()`, a broadcast over Redis with a short reply timeout): it needs no
extra heartbeat table and sees exactly what matters, a worker listening on our queue.

/health and /version need no key, as in vLLM, so probes and deploy checks can call them; /version
adds the served model's name and context limit only for a caller that GET /v1/models would answer.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated

from fastapi import APIRouter, Header
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

from tokenloom.api.auth import authenticate
from tokenloom.api.deps import State
from tokenloom.api.errors import ApiError, error_body
from tokenloom.api.state import ApiState
from tokenloom.store.celery_app import queue_name

router = APIRouter(tags=["health"])

WORKER_PING_TIMEOUT_S = 1.0


@router.get("/healthz")
@router.get("/health")
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/version")
def version_info(state: State, authorization: Annotated[str | None, Header(include_in_schema=False)] = None) -> dict:
    """tokenloom's package version; with a valid key (or on an open API) also the served model.
    A plain `def`: the key lookup runs in the thread pool."""
    info: dict = {"version": package_version()}
    try:
        authenticate(state.sessions, state.admin_key, authorization)
    except ApiError:
        return info
    return {**info, "model": state.served.public_name, "max_model_len": state.served.max_model_len}


def package_version() -> str:
    try:
        return version("tokenloom")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@router.get("/readyz")
async def readyz(state: State) -> JSONResponse:
    database, redis_check, worker = await asyncio.gather(
        run_in_threadpool(_check_database, state),
        _check_redis(state),
        run_in_threadpool(_check_worker, state),
    )
    checks = {"database": database, "redis": redis_check, "worker": worker}
    failing = {name: result for name, result in checks.items() if result != "ok"}
    if not failing:
        return JSONResponse({"status": "ready", "checks": checks})
    message = "not ready: " + "; ".join(f"{name}: {result}" for name, result in failing.items())
    return JSONResponse({**error_body(503, message), "status": "not_ready", "checks": checks}, status_code=503)


def _check_database(state: ApiState) -> str:
    try:
        with state.sessions() as session:
            session.execute(text("SELECT 1"))
        return "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready; say which
        return f"cannot reach [database] url ({type(exc).__name__}): check that the database runs"


async def _check_redis(state: ApiState) -> str:
    try:
        await asyncio.wait_for(state.redis.ping(), timeout=2.0)
        return "ok"
    except Exception as exc:  # noqa: BLE001
        return f"cannot reach Redis at [queue] broker_url ({type(exc).__name__}): check that Redis runs"


def _check_worker(state: ApiState) -> str:
    queue = queue_name(state.served.name)
    try:
        replies = state.celery.control.inspect(timeout=WORKER_PING_TIMEOUT_S).active_queues() or {}
    except Exception as exc:  # noqa: BLE001
        return f"cannot ask workers ({type(exc).__name__})"
    if any(q.get("name") == queue for queues in replies.values() for q in queues):
        return "ok"
    return f"no live worker consumes queue {queue}: start `tokenloom worker` with the same [model] name"
