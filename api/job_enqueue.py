"""Insert and queue jobs for a route: the one step every submitting endpoint shares (/v1/jobs,
/v1/completions, /v1/chat/completions), so no route imports another."""

from __future__ import annotations

from tokenloom.api.errors import DATABASE_RETRY_AFTER_S, ApiError
from tokenloom.api.state import ApiState
from tokenloom.store import idempotency
from tokenloom.store.jobs import job_queries
from tokenloom.store.models import Job


def enqueue(state: ApiState, jobs: list[Job], claim: idempotency.IdempotencyClaim | None = None) -> list[Job]:
    """Insert and queue `jobs`; with `claim`, its key row goes in the same transaction (a key that a
    concurrent request took raises KeyTakenError and writes nothing)."""
    try:
        if claim is not None:
            return idempotency.enqueue_jobs_once(state.sessions, state.celery, claim, jobs)
        return job_queries.enqueue_jobs(state.sessions, state.celery, jobs)
    except job_queries.QueueUnavailableError as exc:
        raise ApiError(
            503,
            f"{exc}; the jobs were not queued: retry when [queue] broker_url is reachable",
            code="queue_unavailable",
            headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
        ) from None
