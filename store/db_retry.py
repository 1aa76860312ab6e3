"""Retrying database calls through a Postgres outage, so a finished job's result is not lost.

A worker that cannot reach the database keeps its job (and the engine's output) in memory and
retries with capped exponential backoff for `[database] retry_s`; only errors that mean "the
database is unreachable or restarting" are retried, never a bug in a query. If the outage outlasts
the budget the error propagates and the job is handed back to the queue (see worker/tasks.py);
its lease then expires, so any worker re-runs it once the database is back.
"""

from __future__ import annotations

import logging
from typing import Callable, TypeVar, cast

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from tenacity import Future, Retrying, retry_if_exception, stop_after_delay, wait_exponential

log = logging.getLogger("tokenloom.worker")

T = TypeVar("T")


def is_outage(exc: BaseException) -> bool:
    """Connection refused/reset, server shutting down, a pooled connection that died."""
    if isinstance(exc, (OperationalError, InterfaceError)):
        return True
    return isinstance(exc, DBAPIError) and bool(exc.connection_invalidated)


def with_db_retry(call: Callable[[], T], what: str, budget_s: float) -> T:
    """Run `call()`, retrying it while the database is unreachable, for at most `budget_s` seconds."""
    retrying = Retrying(
        retry=retry_if_exception(is_outage),
        stop=stop_after_delay(budget_s),
        wait=wait_exponential(multiplier=0.2, max=5.0),
        before_sleep=lambda state: log.warning(
            "database unavailable while %s (%s); retrying (attempt %d)",
            # tenacity sets the failed attempt's outcome before it calls before_sleep
            what,
            type(cast(Future, state.outcome).exception()).__name__,
            state.attempt_number,
        ),
        reraise=True,
    )
    return retrying(call)
