"""Admission control: a bound on each project's open (queued + running) jobs -> 429 + Retry-After.

It protects the queue from one tenant flooding it. The count comes from the aggregates the
database keeps (store/jobs/job_stats.py), not from counting rows, so it costs the same however many
jobs a project has queued. The check and the insert are not one transaction, so concurrent
requests may overshoot the bound by a request's worth, which is fine for a back-pressure signal.
"""

from __future__ import annotations

from tokenloom.api.auth import Principal
from tokenloom.api.errors import ApiError
from tokenloom.api.state import ApiState
from tokenloom.store.jobs import job_stats

RETRY_AFTER_S = 5


def admit(state: ApiState, caller: Principal, num_new_jobs: int) -> None:
    """Raise a 429 if `num_new_jobs` more would put the caller's project over [server] max_queued_jobs
    (a 400 if they alone exceed it: waiting would never help)."""
    limit = state.config.server.max_queued_jobs
    if limit == 0:
        return
    if num_new_jobs > limit:
        raise ApiError(
            400,
            f"{num_new_jobs:,} requests at once exceed the {limit:,} jobs a project may have queued "
            "or running ([server] max_queued_jobs): split them, or raise the limit",
            code="too_many_jobs",
        )
    open_jobs = job_stats.open_jobs(state.sessions, caller.project)
    if open_jobs + num_new_jobs > limit:
        raise ApiError(
            429,
            f"project {caller.project!r} has {open_jobs:,} jobs queued or running and the limit is {limit:,} "
            f"([server] max_queued_jobs): retry after {RETRY_AFTER_S} s, or wait for jobs to finish",
            code="too_many_queued_jobs",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
